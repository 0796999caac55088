"""nn.Modules over moecert's ops."""
import math

import torch
from torch import nn

from . import library, ops
from .functions import LayerFunction
from .ops import LORA_NAMES


class MoELayer(nn.Module):
    """A Mixture-of-Experts layer: router linear (router_w [R, H], router_b [R], fp32), router
    (softmax_topk, sigmoid_topk with router_bias [E], or product_key), E SwiGLU experts (w_gate,
    w_up [E, I, H], w_down [E, H, I], bf16; frozen unless train_base) and LoRA of rank r on gate, up
    and down (a_* [E, r, in], b_* [E, out, r], fp32 master weights, rounded to bf16 for the kernel;
    b_* start at 0, so the layer starts as its base weights).

    forward(x [..., H] bf16) -> y [..., H] fp32. The experts are packed at the first forward; after
    an optimizer step that changes the base weights, call repack() (a forward on stale packs
    raises). Under torch.no_grad() (or with nothing requiring grad) it keeps no saved state."""

    def __init__(self, experts, hidden, inter, topk, rank=0, alpha=None, router="softmax_topk", renormalize=True,
                 groups=1, topk_group=1, scaling=1.0, max_tokens=4096, train_base=False, isa=None):
        super().__init__()
        alpha = float(alpha if alpha is not None else 2 * rank)
        self.config = ops.LayerConfig(experts, hidden, inter, topk, rank, alpha if rank else 0.0, router,
                                      renormalize, groups, topk_group, scaling, max_tokens)
        self.config.struct()  # validates
        E, H, I, R = experts, hidden, inter, self.config.router_outputs()
        self.isa = isa

        def base(*shape, fan_in):
            return nn.Parameter((torch.randn(*shape) / math.sqrt(fan_in)).to(torch.bfloat16), requires_grad=train_base)

        self.w_gate, self.w_up, self.w_down = base(E, I, H, fan_in=H), base(E, I, H, fan_in=H), base(E, H, I, fan_in=I)
        self.router_w = nn.Parameter(torch.empty(R, H).uniform_(-1 / math.sqrt(H), 1 / math.sqrt(H)))
        self.router_b = nn.Parameter(torch.zeros(R))
        self.register_buffer("router_bias", torch.zeros(E) if router == "sigmoid_topk" else None)
        if rank:
            for name, rows, cols in (("a_gate", rank, H), ("a_up", rank, H), ("a_down", rank, I)):
                setattr(self, name, nn.Parameter(torch.empty(E, rows, cols).uniform_(-1 / math.sqrt(cols),
                                                                                      1 / math.sqrt(cols))))
            for name, rows in (("b_gate", I), ("b_up", I), ("b_down", H)):
                setattr(self, name, nn.Parameter(torch.zeros(E, rows, rank)))
        self._packed, self._steps = None, {}

    def repack(self):
        """Packs the current base weights (after an optimizer step on them)."""
        if self._packed is not None:
            library.forget(self._packed)
        self._packed = ops.PackedExperts(self.w_gate, self.w_up, self.w_down, backward=True)
        if library.registered():  # the registered op's keys, formed outside any compiled region
            self._keys = (library.config_key(self.config), library.key_of(self._packed))

    def lora(self):
        if not self.config.lora_rank:
            return None
        return ops.Lora(*(getattr(self, n) for n in LORA_NAMES), alpha=self.config.lora_alpha)

    def forward(self, x, stats=None):
        if self._packed is None:
            self.repack()
        lead, H = x.shape[:-1], self.config.hidden
        x2 = x.reshape(-1, H) if x.dim() != 2 else x
        p = self._parameters
        base = (p["w_gate"], p["w_up"], p["w_down"])
        if (library.in_graph() and stats is None and self.isa is None and x2.device.type == "cpu" and
                not any(t.requires_grad for t in base)):
            if not library.compiling():
                self._packed.check_sources(*base)
            return library.call_layer(x2, self, *self._keys).reshape(*lead, H)
        self._packed.check_sources(*base)
        if torch.is_grad_enabled():
            router = (p["router_w"], p["router_b"])
            factors = tuple(p[n] for n in LORA_NAMES) if self.config.lora_rank else ()
            train_base = any(t.requires_grad for t in base)
            tensors = router + factors + (base if train_base else ())
            needs = (x2.requires_grad,) + tuple(t.requires_grad for t in tensors)
            if any(needs):
                step = self._step(router + (self.router_bias,) + factors, needs, train_base, stats is not None,
                                  x2.dtype)
                y = LayerFunction.apply(step, stats, x2, *tensors)
                return y if x2 is x else y.reshape(*lead, H)  # a reshape is a node of the graph
        with torch.no_grad():
            y, _ = ops.layer_forward(self.config, self._packed, p["router_w"], p["router_b"], x2, self.router_bias,
                                     self.lora(), isa=self.isa, training=False)
        return y.reshape(*lead, H)

    def _step(self, weights, needs, train_base, stats, dx_dtype):
        """The ops.LayerStep of these weights (router_w, router_b, router_bias, the LoRA factors)
        and wanted gradients: the one formed at an earlier call while the weights are the tensors
        it was formed for, else a new one."""
        key = (needs, train_base, stats, dx_dtype)
        step = self._steps.get(key)
        if step is None or step.packed is not self._packed or not step.holds(weights):
            if len(self._steps) >= 8:
                self._steps.clear()
            step = self._steps[key] = ops.LayerStep(self.config, self._packed, weights, needs, train_base, stats,
                                                    dx_dtype, self.isa)
        return step

    def extra_repr(self):
        c = self.config
        return "experts={}, hidden={}, inter={}, topk={}, rank={}, router={}".format(
            c.experts, c.hidden, c.inter, c.topk, c.lora_rank, c.router)
