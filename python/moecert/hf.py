"""Hugging Face transformers' sparse-MoE blocks with their routed experts on moecert's kernels.

    import moecert.hf
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16)
    moecert.hf.patch(model, rank=8)   # each block's `experts` -> moecert.hf.Experts (LoRA r = 8)

transformers 5 keeps a block's routed experts in one module with stacked parameters,
gate_up_proj [E, 2I, H] (the gate's I rows, then the up projection's) and down_proj [E, H, I],
called as experts(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) by the block
after its router (`gate`). patch() replaces that module only: the router stays the model's own
(its softmax or sigmoid, norm_topk_prob, e_score_correction_bias, routed_scaling_factor, its
dtype), and so do attention, norms and shared experts; output_router_logits and the model's
load-balancing loss see the same router logits. Families whose experts are not a plain SwiGLU
(an activation other than silu, biases, a clamped gate as gpt-oss's) are refused, naming what
moecert does not compute.
"""
import math

import torch
from torch import nn

from .errors import InvalidArgument
from .torch import functions, library, ops
from .torch.modules import NATIVE, PackedBase, _what

BASE = ("gate_up_proj", "down_proj")


class Experts(PackedBase):
    """A transformers 5 experts module on moecert's experts op, with LoRA of rank r on gate, up
    and down.

    Args:
        gate_up_proj: [E, 2I, H], the gate's I rows then the up projection's (any float dtype:
            rounded to bf16, what the kernels compute with).
        down_proj: [E, H, I].
        rank, alpha: LoRA rank (0: none) and alpha (default 2r), scale alpha / r (alpha / sqrt(r)
            with rslora, rank-stabilised LoRA); factors a_gate, a_up [E, r, H],
            a_down [E, r, I] (uniform in +-1/sqrt(in)), b_gate, b_up [E, I, r], b_down [E, H, r]
            (zero: the module starts as its base weights), fp32 parameters.
        train_base: the base weights are parameters too (packed at every forward); else the
            packed experts are their only storage (moecert.torch.modules.PackedBase).
        isa: force a kernel.

    forward(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H] in
    hidden_states' dtype: sum_j w[t, j] * expert_{idx[t, j]}(x_t), x rounded to bf16, the
    weights widened to fp32; differentiable in hidden_states, top_k_weights and the LoRA factors
    (and the base weights with train_base). state_dict() holds gate_up_proj and down_proj (bf16,
    transformers' names and layout) and the LoRA factors. After each forward, `token_counts` [E]
    int64 holds how many (token, slot) pairs each expert received."""

    BASE = BASE

    def __init__(self, gate_up_proj, down_proj, rank=0, alpha=None, train_base=False, isa=None, rslora=False):
        """See the class docstring; raises moecert.InvalidArgument for shapes that do not fit."""
        super().__init__()
        if not isinstance(gate_up_proj, torch.Tensor) or gate_up_proj.dim() != 3 or gate_up_proj.shape[1] % 2:
            raise InvalidArgument("gate_up_proj: {}, expected [E, 2I, H]".format(_what(gate_up_proj)))
        E, two_i, H = gate_up_proj.shape
        I = two_i // 2
        if not isinstance(down_proj, torch.Tensor) or tuple(down_proj.shape) != (E, H, I):
            raise InvalidArgument("down_proj: {}, expected [{}, {}, {}]".format(_what(down_proj), E, H, I))
        self.num_experts, self.hidden, self.inter, self.isa = E, H, I, isa
        self.rank, self.alpha = int(rank), float(alpha if alpha is not None else 2 * rank)
        # The kernels' scale is alpha / r: rank-stabilised LoRA's alpha / sqrt(r) is alpha sqrt(r) / r.
        self._kernel_alpha = self.alpha * math.sqrt(self.rank) if rslora and self.rank else self.alpha
        self.rslora, self.token_counts = bool(rslora), None
        self._init_base({"gate_up_proj": gate_up_proj, "down_proj": down_proj}, train_base)
        if self.rank:
            for name, shape in ops._lora_shapes(E, H, I, self.rank).items():
                init = (torch.zeros(shape) if name.startswith("b_")
                        else torch.empty(shape).uniform_(-1 / math.sqrt(shape[2]), 1 / math.sqrt(shape[2])))
                setattr(self, name, nn.Parameter(init))

    def base_shapes(self):
        E, H, I = self.num_experts, self.hidden, self.inter
        return {"gate_up_proj": (E, 2 * I, H), "down_proj": (E, H, I)}

    def split(self, named):
        gate_up, I = named["gate_up_proj"], self.inter
        return gate_up[:, :I].contiguous(), gate_up[:, I:].contiguous(), named["down_proj"]

    def _stored(self, base):
        w_gate, w_up, w_down = base
        return {"gate_up_proj": torch.cat([w_gate, w_up], 1), "down_proj": w_down}

    def _pack_keys(self):
        if library.registered():
            self._keys = library.key_of(self._packed)

    def lora(self):
        """The LoRA factors (as the kernels read them: all bf16 or all fp32, else fp32 through a
        differentiable cast) as an ops.Lora, or None."""
        if not self.rank:
            return None
        factors = tuple(getattr(self, n) for n in ops.LORA_NAMES)
        if len({t.dtype for t in factors}) != 1 or factors[0].dtype not in NATIVE:
            factors = tuple(t.float() for t in factors)
        return ops.Lora(*factors, alpha=self._kernel_alpha)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        """[T, H] in hidden_states' dtype (see the class docstring)."""
        x = hidden_states
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.hidden or not x.is_floating_point():
            raise InvalidArgument("hidden_states: {}, expected a [T, {}] floating-point tensor".format(
                _what(x), self.hidden))
        weights = top_k_weights
        if isinstance(weights, torch.Tensor) and weights.dtype not in (torch.float32, torch.bfloat16):
            weights = weights.float()
        with torch.no_grad():
            ids = top_k_index.reshape(-1) if isinstance(top_k_index, torch.Tensor) else None
            if ids is not None and not ids.is_floating_point():
                valid = ids[(ids >= 0) & (ids < self.num_experts)].long()
                self.token_counts = torch.bincount(valid, minlength=self.num_experts)
        if self.train_base:  # packed at this call from the parameters' values
            gate_up, down = self.gate_up_proj, self.down_proj
            base = (gate_up[:, :self.inter].to(torch.bfloat16).contiguous(),
                    gate_up[:, self.inter:].to(torch.bfloat16).contiguous(), down.to(torch.bfloat16).contiguous())
            y = functions.experts(x, top_k_index, weights, None, self.lora(), base=base, isa=self.isa)
        else:
            y = functions.experts(x, top_k_index, weights, self._packed, self.lora(), isa=self.isa)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def extra_repr(self):
        return "num_experts={}, hidden={}, inter={}, rank={}, train_base={}".format(
            self.num_experts, self.hidden, self.inter, self.rank, self.train_base)


def _refusal(experts):
    """Why moecert cannot compute these experts (None: it can)."""
    devices = {p.device.type for p in experts.parameters(recurse=False)}
    if devices - {"cpu"}:
        return "on {}: moecert computes on the CPU".format(", ".join(sorted(devices - {"cpu"})))
    extra = [n for n, _ in experts.named_parameters(recurse=False) if n not in BASE]
    if extra:
        return "parameters {} besides gate_up_proj and down_proj (biases: moecert's experts have none)".format(
            ", ".join(extra))
    if any(hasattr(experts, a) for a in ("limit", "swiglu_limit")):
        return "a clamped SwiGLU (gpt-oss style); moecert computes silu(g) * u"
    act = getattr(experts, "act_fn", None)
    if act is None or not (isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")):
        return "activation {}, moecert computes SwiGLU with silu".format(type(act).__name__)
    for name in BASE:
        p = getattr(experts, name, None)
        if not isinstance(p, torch.Tensor) or p.dim() != 3:
            return "{}: {}, expected a stacked 3-D tensor".format(name, _what(p))
    return None


def _stacked_experts(module):
    """Whether `module` is a transformers 5 experts module (stacked gate_up_proj and down_proj)."""
    return (not isinstance(module, Experts) and isinstance(getattr(module, "gate_up_proj", None), torch.Tensor) and
            isinstance(getattr(module, "down_proj", None), torch.Tensor))


def patch(model, rank=0, alpha=None, train_base=False, isa=None, rslora=False):
    """Replaces the routed experts of every sparse-MoE block of `model` (transformers 5: a
    block's `experts` module with stacked gate_up_proj and down_proj) by an Experts holding the
    same weights (rounded to bf16; the originals are released), with LoRA of `rank` and `alpha`
    (rslora: scale alpha / sqrt(r)).
    Returns the names of the modules replaced. Raises moecert.InvalidArgument naming the block
    and what is missing when a block's experts are not a plain SwiGLU (nothing is replaced then),
    or when the model has no such block (transformers 4's ModuleList of experts included)."""
    found = []
    for name, module in model.named_modules():
        experts = getattr(module, "experts", None)
        if isinstance(experts, nn.Module) and _stacked_experts(experts):
            why = _refusal(experts)
            if why is not None:
                raise InvalidArgument("{}.experts ({}): {}".format(name, type(experts).__name__, why))
            found.append((name, module, experts))
        elif isinstance(experts, nn.ModuleList):
            raise InvalidArgument("{}.experts: a ModuleList of experts (transformers 4's layout); moecert.hf reads "
                                  "transformers 5's stacked gate_up_proj and down_proj".format(name))
    if not found:
        raise InvalidArgument("{}: no sparse-MoE block with stacked experts (gate_up_proj, down_proj)".format(
            type(model).__name__))
    for name, module, experts in found:
        with torch.no_grad():
            module.experts = Experts(experts.gate_up_proj, experts.down_proj, rank, alpha, train_base, isa, rslora)
    return [(name + ".experts") if name else "experts" for name, _, _ in found]
