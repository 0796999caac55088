"""moecert's experts op, routers and layer as torch.library custom ops (torch
>= 2.4), so that torch.compile keeps each as one op in its graphs:

    torch.ops.moecert.experts(x, expert_ids, weights, a_gate, b_gate, a_up, b_up, a_down, b_down,
                              alpha, packed_key, training) -> (y, state)
    torch.ops.moecert.experts_backward(dy, state, x, weights, a_gate, .., b_down, alpha, wanted)
        -> [dx, dweights, d a_gate, .., d b_down]  (empty where not wanted)

and likewise moecert::layer (-> [y, state]) with its backward op, each joined
to its forward by register_autograd; the routers moecert::softmax_topk,
sigmoid_topk and product_key (-> [idx, w]) are registered from their single
definitions (routers.py, define.py). Packed weights, layer configs and saved
states are Python objects, which a schema cannot carry: the ops take the
packed weights and the config by key (`key_of(packed)`, `config_key(cfg)`)
and return the saved state as an int64 tensor [key, generation] naming it;
after the backward the state serves later forwards (a retained graph's second
backward works until one does). A forward with training=False keeps none.
moecert.torch's functions and MoELayer call these ops while torch.compile
traces; eagerly, and on older torch, they run the autograd.Functions, with the
same bits (the Functions cost less dispatch per call).
"""
import dataclasses
import itertools
import threading
import weakref
from typing import List, Optional

import torch
from torch import Tensor

from ..errors import InvalidArgument
from . import define, ops, routers

_lock = threading.Lock()
_packed = weakref.WeakValueDictionary()  # key -> PackedExperts, while its owner holds it
_in_flight = {}                          # key -> saved state whose backward has not run
_all_states = weakref.WeakValueDictionary()  # key -> every saved state alive (pooled ones too)
_next = itertools.count(1)
_WANTED = ("dx", "dweights") + ops.LORA_NAMES


def key_of(packed):
    """The key naming `packed` for the ops, while `packed` lives or until forget(packed)."""
    key = getattr(packed, "_library_key", None)
    if key is None:
        with _lock:
            key = next(_next)
            _packed[key] = packed
        packed._library_key = key
    return key


def forget(packed):
    """Drops `packed` from the registry (MoELayer does it for the pack it replaces)."""
    key = getattr(packed, "_library_key", None)
    if key is not None:
        with _lock:
            _packed.pop(key, None)
        packed._library_key = None


def _lora(factors, alpha):
    return ops.Lora(*factors, alpha=alpha) if factors[0] is not None else None


def experts(x: Tensor, expert_ids: Tensor, weights: Tensor, a_gate: Optional[Tensor], b_gate: Optional[Tensor],
            a_up: Optional[Tensor], b_up: Optional[Tensor], a_down: Optional[Tensor], b_down: Optional[Tensor],
            alpha: float, packed_key: int, training: bool) -> List[Tensor]:
    lora = _lora((a_gate, b_gate, a_up, b_up, a_down, b_down), alpha)
    packed = _packed[packed_key]
    y, saved = ops.experts_forward_train(packed, x, expert_ids, weights, lora, packed.experts_pool.take(),
                                         training=training)
    return [y, _hold(saved, training)]


def _experts_fake(x, expert_ids, weights, a_gate, b_gate, a_up, b_up, a_down, b_down, alpha, packed_key, training):
    return [x.new_empty(x.shape, dtype=torch.float32), x.new_empty(2, dtype=torch.int64)]


def experts_backward(dy: Tensor, state: Tensor, x: Tensor, weights: Tensor, a_gate: Optional[Tensor],
                     b_gate: Optional[Tensor], a_up: Optional[Tensor], b_up: Optional[Tensor],
                     a_down: Optional[Tensor], b_down: Optional[Tensor], alpha: float,
                     wanted: List[bool]) -> List[Tensor]:
    saved = _resume(state)
    g = ops.experts_backward(saved, dy, [n for n, w in zip(_WANTED, wanted) if w], dx_dtype=x.dtype)
    _release(saved, saved.packed.experts_pool)
    return [g[n] if n in g else dy.new_empty(0, dtype=torch.float32) for n in _WANTED]


def _backward_fake(dy, state, x, weights, a_gate, b_gate, a_up, b_up, a_down, b_down, alpha, wanted):
    shapes = [x.shape, weights.shape] + [f.shape if f is not None else (0,)
                                         for f in (a_gate, b_gate, a_up, b_up, a_down, b_down)]
    dtypes = [x.dtype] + [torch.float32] * 7
    return [dy.new_empty(s if w else (0,), dtype=d) for s, w, d in zip(shapes, wanted, dtypes)]


def _setup_context(ctx, inputs, output):
    x, expert_ids, weights, *factors = inputs[:9]
    ctx.alpha = inputs[9]
    ctx.lora = factors[0] is not None
    ctx.save_for_backward(x, weights, *(factors if ctx.lora else ()))
    ctx.state = output[1]


def _backward(ctx, grads):
    dy = grads[0]
    x, weights, *factors = ctx.saved_tensors
    factors = factors or [None] * 6
    needs = ctx.needs_input_grad
    wanted = [bool(needs[0]), bool(needs[2])] + [ctx.lora and bool(n) for n in needs[3:9]]
    g = torch.ops.moecert.experts_backward(dy, ctx.state, x, weights, *factors, ctx.alpha, wanted)
    out = [t if w else None for t, w in zip(g, wanted)]
    return (out[0], None, out[1], *out[2:], None, None, None)



# ---- layer -------------------------------------------------------------------

_configs = {}      # key -> LayerConfig (a copy)
_config_keys = {}  # the config's fields -> key


def config_key(cfg):
    """A key naming the layer config (equal configs share one)."""
    fields = dataclasses.astuple(cfg)
    with _lock:
        key = _config_keys.get(fields)
        if key is None:
            key = _config_keys[fields] = next(_next)
            _configs[key] = dataclasses.replace(cfg)
    return key


def layer(x: Tensor, router_w: Tensor, router_b: Tensor, router_bias: Optional[Tensor], a_gate: Optional[Tensor],
          b_gate: Optional[Tensor], a_up: Optional[Tensor], b_up: Optional[Tensor], a_down: Optional[Tensor],
          b_down: Optional[Tensor], config: int, packed_key: int, training: bool) -> List[Tensor]:
    cfg = _configs[config]
    factors = (a_gate, b_gate, a_up, b_up, a_down, b_down)
    lora = ops.Lora(*factors, alpha=cfg.lora_alpha) if cfg.lora_rank else None
    packed = _packed[packed_key]
    y, saved = ops.layer_forward(cfg, packed, router_w, router_b, x, router_bias, lora, packed.layer_pool.take(),
                                 training=training)
    return [y, _hold(saved, training)]


def _layer_fake(x, router_w, router_b, router_bias, a_gate, b_gate, a_up, b_up, a_down, b_down, config, packed_key,
                training):
    return [x.new_empty(x.shape, dtype=torch.float32), x.new_empty(2, dtype=torch.int64)]


_LAYER_WANTED = ("dx", "router_w", "router_b") + ops.LORA_NAMES


def layer_backward(dy: Tensor, state: Tensor, x: Tensor, router_w: Tensor, router_b: Tensor,
                   a_gate: Optional[Tensor], b_gate: Optional[Tensor], a_up: Optional[Tensor],
                   b_up: Optional[Tensor], a_down: Optional[Tensor], b_down: Optional[Tensor],
                   wanted: List[bool]) -> List[Tensor]:
    saved = _resume(state)
    want = {n for n, w in zip(_LAYER_WANTED, wanted) if w}
    g = ops.layer_backward(saved, dy, want, expert_path=bool(want - {"router_w", "router_b"}),
                           router_path=bool(want & {"dx", "router_w", "router_b"}), dx_dtype=x.dtype)
    _release(saved, saved.keep[0].layer_pool)
    return [g[n] if n in g else dy.new_empty(0, dtype=torch.float32) for n in _LAYER_WANTED]


def _layer_backward_fake(dy, state, x, router_w, router_b, a_gate, b_gate, a_up, b_up, a_down, b_down, wanted):
    shapes = [x.shape, router_w.shape, router_b.shape] + [f.shape if f is not None else (0,)
                                                          for f in (a_gate, b_gate, a_up, b_up, a_down, b_down)]
    dtypes = [x.dtype] + [torch.float32] * 8
    return [dy.new_empty(s if w else (0,), dtype=d) for s, w, d in zip(shapes, wanted, dtypes)]


def _layer_setup(ctx, inputs, output):
    x, router_w, router_b, router_bias, *factors = inputs[:10]
    ctx.lora = factors[0] is not None
    ctx.save_for_backward(x, router_w, router_b, *(factors if ctx.lora else ()))
    ctx.state = output[1]


def _layer_backward(ctx, grads):
    x, router_w, router_b, *factors = ctx.saved_tensors
    factors = factors or [None] * 6
    needs = ctx.needs_input_grad
    wanted = [bool(needs[0]), bool(needs[1]), bool(needs[2])] + [ctx.lora and bool(n) for n in needs[4:10]]
    g = torch.ops.moecert.layer_backward(grads[0], ctx.state, x, router_w, router_b, *factors, wanted)
    out = [t if w else None for t, w in zip(g, wanted)]
    return (out[0], out[1], out[2], None, *out[3:], None, None, None)


def _hold(saved, training):
    """The state tensor [key, generation] naming a training forward's saved state (zeros: none)."""
    if not training:
        return torch.zeros(2, dtype=torch.int64)
    with _lock:
        if getattr(saved, "library_key", None) is None:
            saved.library_key = next(_next)
        _in_flight[saved.library_key] = saved
        _all_states[saved.library_key] = saved
    return torch.tensor([saved.library_key, saved.generation], dtype=torch.int64)


def _resume(state):
    """The saved state a state tensor names, if it still holds that forward (as the Functions'
    generation check: a retained graph's second backward works until a later forward reuses it)."""
    key, generation = int(state[0]), int(state[1])
    with _lock:
        saved = _all_states.get(key)
    if saved is None:
        raise InvalidArgument("the forward kept no saved state (training=False): it has no backward")
    ops.check_generation(saved, generation)
    return saved


def _release(saved, pool):
    """After a backward: the state may serve a later forward."""
    with _lock:
        _in_flight.pop(saved.library_key, None)
    pool.give(saved)


_registered = None


def register():
    """Registers the ops once; False where torch lacks torch.library.custom_op (before 2.4)."""
    global _registered
    if _registered is not None:
        return _registered
    lib = getattr(torch, "library", None)
    if lib is None or not hasattr(lib, "custom_op") or not hasattr(lib, "register_autograd"):
        _registered = False
        return False
    fwd = lib.custom_op("moecert::experts", mutates_args=())(experts)
    fwd.register_fake(_experts_fake)
    bwd = lib.custom_op("moecert::experts_backward", mutates_args=())(experts_backward)
    bwd.register_fake(_backward_fake)
    lib.register_autograd("moecert::experts", _backward, setup_context=_setup_context)
    layer_op = lib.custom_op("moecert::layer", mutates_args=())(layer)
    layer_op.register_fake(_layer_fake)
    layer_bwd = lib.custom_op("moecert::layer_backward", mutates_args=())(layer_backward)
    layer_bwd.register_fake(_layer_backward_fake)
    lib.register_autograd("moecert::layer", _layer_backward, setup_context=_layer_setup)
    define.register(lib, routers.DEFINITIONS)
    _registered = True
    return True


def registered():
    """Whether register() registered the ops."""
    return bool(_registered)


always = False  # call the registered ops eagerly too (tests)


def in_graph():
    """Whether calls should be the registered ops: while torch.compile traces, or `always`."""
    return bool(_registered) and (always or compiling())


def compiling():
    """Whether torch.compile is tracing (checks that read tensor versions are left to eager runs)."""
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(is_compiling and is_compiling())


def call_layer(x, layer, config, packed_key):
    """MoELayer's forward through the registered op (LoRA and router parameters trained);
    config and packed_key as MoELayer formed them when it packed its base weights."""
    factors = tuple(getattr(layer, n) for n in ops.LORA_NAMES) if layer.config.lora_rank else (None,) * 6
    params = (x, layer.router_w, layer.router_b) + factors
    needs = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in params)
    y, _ = torch.ops.moecert.layer(x, layer.router_w, layer.router_b, layer.router_bias, *factors, config, packed_key,
                                   needs)
    return y


def call_experts(x, expert_ids, weights, packed, lora):
    """moecert.torch.experts through the registered op (no stats, base weights or isa)."""
    factors = lora.factors() if lora is not None else (None,) * 6
    alpha = float(lora.alpha) if lora is not None else 0.0
    # The dispatcher would send a tensor on another device to that device's kernel (a meta
    # tensor to the fake one): the device is checked before dispatch, the rest in the kernel.
    for name, t in (("x", x), ("expert_ids", expert_ids), ("weights", weights)) + tuple(zip(ops.LORA_NAMES, factors)):
        if isinstance(t, torch.Tensor) and t.device.type != "cpu":
            raise InvalidArgument("{}: on {}, expected a CPU tensor".format(name, t.device))
    needs = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weights) + factors)
    y, _ = torch.ops.moecert.experts(x, expert_ids, weights, *factors, alpha, key_of(packed), needs)
    return y
