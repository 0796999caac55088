"""The experts op with the caller's routing and the MoE layer, each defined once
(define.py, as the routers in routers.py): a forward over plain tensors and
schema-typed values that returns [y, state], and a backward that computes only
the gradients autograd asks for. Packed experts, layer configs and Stats
recorders travel as keys (keys.py), the saved state as a state tensor. Eagerly
the ops run as their autograd.Functions; under torch.compile (torch >= 2.4) as
torch.ops.moecert.experts and torch.ops.moecert.layer, with the same bits.
Incoming gradients are taken as contiguous fp32; double backward is refused
(under create_graph=True the gradients refuse a second backward)."""
import torch

from . import keys, ops
from .define import OpDef
from .ops import BASE_NAMES, LORA_NAMES, InvalidArgument

NATIVE = (torch.float32, torch.bfloat16)  # the factor dtypes the kernels read as they are


class Stats:
    """Receives the per-token statistics M_A, M_G [T, E] (docs/DESIGN.md) of the backward of the op it
    is passed to: m_a[t, e] = ||activations of t in expert e||, m_g[t, e] = the norm of t's
    gradient of e's trainable matrices (LoRA factors, or base weights without LoRA); 0 where t is
    not routed to e. None until that backward ran. Under torch.compile keep one recorder for every
    step: the op names it by a key the graph holds.

    With routing=True a layer's training forward also hands over its router's z [T, R] (the
    logits), idx [T, K] int32 and weights [T, K], and its backward dweights [T, K] (dL/dw) and
    dz [T, R] (product_key: [dsx | dsy]); fp32 copies, for judging or logging the routing."""

    def __init__(self, routing=False):
        self.m_a = self.m_g = None
        self.routing = bool(routing)
        self.z = self.idx = self.weights = self.dweights = self.dz = None
        keys.key_of(self)


def stats(routing=False):
    """A fresh Stats recorder: pass it as `stats=` to an op or a module's forward."""
    return Stats(routing)


def _f32(t):
    """t as the kernels read router parameters: fp32 (a detached copy of another float dtype)."""
    if not isinstance(t, torch.Tensor) or t.dtype == torch.float32 or not t.is_floating_point():
        return t
    return t.detach().float()


def kernel_factors(factors):
    """The LoRA factors as the kernels read them: all bf16 or all fp32 as they are, else fp32
    detached copies (one copy of a tensor given twice, as a shared A)."""
    if not all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in factors):
        return tuple(factors)
    if len({t.dtype for t in factors}) == 1 and factors[0].dtype in NATIVE:
        return tuple(factors)
    copies = {}
    return tuple(copies.setdefault(id(t), t.detach().float()) for t in factors)


def _bf16(x):
    return x.to(torch.bfloat16) if isinstance(x, torch.Tensor) and x.is_floating_point() and \
        x.dtype != torch.bfloat16 else x


def _dx_dtype(x):
    return x.dtype if x.dtype in NATIVE else torch.float32


def _state(saved, pool, training):
    """The state tensor of a forward: naming `saved` after a training forward, else none (and
    `saved` back in its pool)."""
    if training:
        return keys.hold(saved)
    pool.give(saved)
    return keys.no_state()


def _record(stats, grads):
    """Hands M_A, M_G to the Stats recorder the forward named (0: none)."""
    if stats:
        recorder = keys.lookup(stats, "stats")
        recorder.m_a, recorder.m_g = grads["m_a"], grads["m_g"]


def _results(names, grads, like):
    """The backward's results in `names` order; an empty fp32 tensor for each not computed."""
    return [grads[n] if n in grads else like.new_empty(0, dtype=torch.float32) for n in names]


def _grad_fakes(shapes, dtypes, wanted, like):
    return [like.new_empty(s if w else (0,), dtype=d) for s, w, d in zip(shapes, wanted, dtypes)]


def _shapes(tensors):
    return [t.shape if t is not None else (0,) for t in tensors]


# ---- the experts op -----------------------------------------------------------

_EXPERTS_GRADS = ("dx", "dweights") + LORA_NAMES + BASE_NAMES  # those of grads_of, in order


def _experts_forward(x, expert_ids, weights, a_gate, b_gate, a_up, b_up, a_down, b_down, w_gate, w_up, w_down,
                     alpha, packed, stats, isa, training):
    packed = keys.lookup(packed, "packed")
    factors = kernel_factors((a_gate, b_gate, a_up, b_up, a_down, b_down))
    lora = ops.Lora(*factors, alpha=alpha) if a_gate is not None else None
    if isinstance(weights, torch.Tensor) and weights.dtype == torch.bfloat16:
        weights = weights.float()  # widened exactly
    saved = packed.experts_pool.take()
    y, saved = ops.experts_forward_train(packed, _bf16(x), expert_ids, weights, lora, saved, isa, training)
    return [y, _state(saved, packed.experts_pool, training)]


def _experts_backward(state, x, weights, a_gate, b_gate, a_up, b_up, a_down, b_down, w_gate, w_up, w_down, dy,
                      packed, stats, wanted):
    saved = keys.resume(state, ops.check_generation)
    want = {n for n, w in zip(_EXPERTS_GRADS, wanted) if w} | ({"m_a", "m_g"} if stats else set())
    grads = ops.experts_backward(saved, dy, want, dx_dtype=_dx_dtype(x))
    saved.packed.experts_pool.give(saved)
    _record(stats, grads)
    return _results(_EXPERTS_GRADS, grads, dy)


def _experts_fake(x, expert_ids, weights, *rest):
    return [x.new_empty(x.shape, dtype=torch.float32), x.new_empty(2, dtype=torch.int64)]


def _experts_backward_fake(state, x, weights, *rest):
    tensors, dy, wanted = rest[:9], rest[9], rest[-1]
    return _grad_fakes([x.shape, weights.shape] + _shapes(tensors), [_dx_dtype(x)] + [torch.float32] * 10, wanted,
                       dy)


EXPERTS = OpDef(
    name="experts",
    schema="(Tensor x, Tensor expert_ids, Tensor weights, Tensor? a_gate, Tensor? b_gate, Tensor? a_up, "
           "Tensor? b_up, Tensor? a_down, Tensor? b_down, Tensor? w_gate, Tensor? w_up, Tensor? w_down, "
           "float alpha, int packed, int stats, int isa, bool training) -> Tensor[]",
    backward_schema="(Tensor state, Tensor x, Tensor weights, Tensor? a_gate, Tensor? b_gate, Tensor? a_up, "
                    "Tensor? b_up, Tensor? a_down, Tensor? b_down, Tensor? w_gate, Tensor? w_up, Tensor? w_down, "
                    "Tensor dy, int packed, int stats, bool[] wanted) -> Tensor[]",
    forward=_experts_forward,
    backward=_experts_backward,
    keep=lambda inputs, outputs: ((outputs[1], inputs[0]) + tuple(inputs[2:12]), (inputs[13], inputs[14])),
    fake=_experts_fake,
    backward_fake=_experts_backward_fake,
    grads_of=(0, 2) + tuple(range(3, 12)), from_outputs=(0,), integer_outputs=(1,), selective=True)


def experts(x, expert_ids, weights, packed, lora=None, base=None, stats=None, isa=None):
    """The experts op with the caller's routing, differentiable in x, weights, the LoRA factors and,
    with `base`, the base weights.

    x [T, H] bf16 (another float dtype is rounded to bf16 by x.to(torch.bfloat16); dx comes in x's
    dtype), expert_ids [T, K] int32/int64 (-1 = empty slot, only at a row's tail), weights
    [T, K] fp32 or bf16 (0 at -1 slots; bf16 is widened exactly), packed: PackedExperts (the
    frozen base weights), lora: ops.Lora or None (factors all bf16 or all fp32 are read as they
    are, others as fp32). base = (w_gate, w_up, w_down) bf16 trains the base weights instead:
    they are packed at this call (pass packed=None), so the op always computes with their current
    values. stats: a Stats recorder for M_A, M_G. isa: a name in moecert.ISAS. Returns y [T, H]
    fp32: y_t = sum_j weights[t, j] * expert_{ids[t, j]}(x_t), the gradient of weights
    dL/dw[t, j] = <dy_t, o_{t, j}>."""
    if base is not None:
        if packed is not None:
            raise InvalidArgument("packed and base: pass packed=None with base (the base weights are packed "
                                  "at every call)")
        packed = ops.PackedExperts(*(b.detach() if isinstance(b, torch.Tensor) else b for b in base))
    if not isinstance(packed, ops.PackedExperts):
        raise InvalidArgument("packed: {}, expected moecert.torch.PackedExperts".format(type(packed).__name__))
    factors = lora.factors() if lora is not None else (None,) * 6
    base = tuple(base) if base is not None else (None,) * 3
    tensors = (x, expert_ids, weights) + factors + base
    _on_cpu(zip(("x", "expert_ids", "weights") + LORA_NAMES + BASE_NAMES, tensors))
    training = _training(tensors)
    alpha = float(lora.alpha) if lora is not None else 0.0
    y, _ = EXPERTS(*tensors, alpha, packed.key, _stats_key(stats), ops.isa_number(isa), training)
    return y


def _on_cpu(named):
    """Raises for a tensor on another device (the dispatcher would send it to that device's
    kernel, a meta tensor to the fake one): the device is checked before dispatch, the rest in
    the forward."""
    for name, t in named:
        if isinstance(t, torch.Tensor) and t.device.type != "cpu":
            raise InvalidArgument("{}: on {}, expected a CPU tensor".format(name, t.device))


def _training(tensors):
    """Whether autograd will ask for a backward: grad mode on and some input requires a gradient."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _stats_key(stats):
    if stats is None:
        return 0
    if not isinstance(stats, Stats):
        raise InvalidArgument("stats: {}, expected moecert.torch.Stats".format(type(stats).__name__))
    return stats._key


# ---- the layer ----------------------------------------------------------------

_LAYER_GRADS = ("dx", "router_w", "router_b") + LORA_NAMES + BASE_NAMES  # those of grads_of, in order


def _layer_forward(x, router_w, router_b, router_bias, a_gate, b_gate, a_up, b_up, a_down, b_down, w_gate, w_up,
                   w_down, config, packed, stats, isa, training):
    cfg, packed = keys.config(config), keys.lookup(packed, "packed")
    factors = kernel_factors((a_gate, b_gate, a_up, b_up, a_down, b_down))
    lora = ops.Lora(*factors, alpha=cfg.lora_alpha) if cfg.lora_rank else None
    saved = packed.layer_pool.take()
    y, saved = ops.layer_forward(cfg, packed, _f32(router_w), _f32(router_b), _bf16(x), _f32(router_bias), lora,
                                 saved, isa, training)
    recorder = _routing_recorder(stats)
    if recorder and training and not saved.failed:
        recorder.z = ops.layer_router(saved, ("z",))["z"]
        recorder.idx, recorder.weights = ops.layer_routing(saved)
        recorder.dweights = recorder.dz = None
    return [y, _state(saved, packed.layer_pool, training)]


def _routing_recorder(stats):
    """The Stats recorder a layer op was given, when it asked for the routing."""
    recorder = keys.lookup(stats, "stats") if stats else None
    return recorder if recorder is not None and recorder.routing else None


def _layer_backward(state, x, router_w, router_b, a_gate, b_gate, a_up, b_up, a_down, b_down, w_gate, w_up, w_down,
                    dy, config, packed, stats, wanted):
    saved = keys.resume(state, ops.check_generation)
    want = {n for n, w in zip(_LAYER_GRADS, wanted) if w} | ({"m_a", "m_g"} if stats else set())
    router_path = bool(want & {"dx", "router_w", "router_b"})
    grads = ops.layer_backward(saved, dy, want, expert_path=bool(want - {"router_w", "router_b"}),
                               router_path=router_path, dx_dtype=_dx_dtype(x))
    recorder = _routing_recorder(stats)
    if recorder and router_path:
        recorder.dweights, recorder.dz = ops.layer_router(saved, ("dweights", "dz")).values()
    saved.keep[0].layer_pool.give(saved)
    _record(stats, grads)
    return _results(_LAYER_GRADS, grads, dy)


def _layer_fake(x, *rest):
    return [x.new_empty(x.shape, dtype=torch.float32), x.new_empty(2, dtype=torch.int64)]


def _layer_backward_fake(state, x, *rest):
    tensors, dy, wanted = rest[:11], rest[11], rest[-1]
    return _grad_fakes([x.shape] + _shapes(tensors), [_dx_dtype(x)] + [torch.float32] * 11, wanted, dy)


LAYER = OpDef(
    name="layer",
    schema="(Tensor x, Tensor router_w, Tensor router_b, Tensor? router_bias, Tensor? a_gate, Tensor? b_gate, "
           "Tensor? a_up, Tensor? b_up, Tensor? a_down, Tensor? b_down, Tensor? w_gate, Tensor? w_up, "
           "Tensor? w_down, int config, int packed, int stats, int isa, bool training) -> Tensor[]",
    backward_schema="(Tensor state, Tensor x, Tensor router_w, Tensor router_b, Tensor? a_gate, Tensor? b_gate, "
                    "Tensor? a_up, Tensor? b_up, Tensor? a_down, Tensor? b_down, Tensor? w_gate, Tensor? w_up, "
                    "Tensor? w_down, Tensor dy, int config, int packed, int stats, bool[] wanted) -> Tensor[]",
    forward=_layer_forward,
    backward=_layer_backward,
    keep=lambda inputs, outputs: ((outputs[1],) + tuple(inputs[:3]) + tuple(inputs[4:13]), tuple(inputs[13:16])),
    fake=_layer_fake,
    backward_fake=_layer_backward_fake,
    grads_of=(0, 1, 2) + tuple(range(4, 13)), from_outputs=(0,), integer_outputs=(1,), selective=True)

DEFINITIONS = (EXPERTS, LAYER)


def layer(x, config, packed, router_w, router_b, router_bias=None, lora=None, base=None, stats=None, isa=None):
    """The MoE layer's y [T, H] fp32 of x [T, H] (any float dtype; rounded to bf16), through the
    layer op (MoELayer's forward): config the key of an ops.LayerConfig (keys.config_key),
    packed its PackedExperts, router_w [R, H], router_b [R]
    (read as fp32), router_bias [E] (sigmoid_topk), lora: the six factors (or None), base: the
    base weights (w_gate, w_up, w_down) whose gradients autograd routes (packed already in
    `packed`), stats: a Stats recorder."""
    factors = tuple(lora) if lora is not None else (None,) * 6
    base = tuple(base) if base is not None else (None,) * 3
    tensors = (x, router_w, router_b, router_bias) + factors + base
    training = _training(tensors)
    y, _ = LAYER(*tensors, config, packed.key, _stats_key(stats), ops.isa_number(isa), training)
    return y
