"""moecert's experts op as torch.library custom ops (torch >= 2.4), so that
torch.compile keeps it as one op in its graphs:

    torch.ops.moecert.experts(x, expert_ids, weights, a_gate, b_gate, a_up, b_up, a_down, b_down,
                              alpha, packed_key, training) -> (y, state)
    torch.ops.moecert.experts_backward(dy, state, x, weights, a_gate, .., b_down, alpha, wanted)
        -> [dx, dweights, d a_gate, .., d b_down]  (empty where not wanted)

joined by register_autograd. Packed weights and saved states are Python
objects, which a schema cannot carry: the ops take the packed weights by key
(`key_of(packed)`) and return the saved state as a one-element int64 tensor
naming it; the backward releases it (a forward with training=False keeps
none). `moecert.torch.experts` calls these ops where they are registered; on
older torch it runs the autograd.Function, with the same bits.
"""
import itertools
import threading
from typing import List, Optional

import torch
from torch import Tensor

from ..errors import InvalidArgument
from . import ops

_lock = threading.Lock()
_packed = {}  # key -> PackedExperts
_states = {}  # key -> ExpertsSaved
_next = itertools.count(1)
_WANTED = ("dx", "dweights") + ops.LORA_NAMES


def key_of(packed):
    """The key naming `packed` for the ops; the registry holds it until forget(packed)."""
    key = getattr(packed, "_library_key", None)
    if key is None:
        with _lock:
            key = next(_next)
            _packed[key] = packed
        packed._library_key = key
    return key


def forget(packed):
    """Drops `packed` from the registry (MoELayer.repack does it for the pack it replaces)."""
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
    key = 0
    if training:
        with _lock:
            key = next(_next)
            _states[key] = saved
    return [y, torch.tensor([key], dtype=torch.int64)]


def _experts_fake(x, expert_ids, weights, a_gate, b_gate, a_up, b_up, a_down, b_down, alpha, packed_key, training):
    return [x.new_empty(x.shape, dtype=torch.float32), x.new_empty(1, dtype=torch.int64)]


def experts_backward(dy: Tensor, state: Tensor, x: Tensor, weights: Tensor, a_gate: Optional[Tensor],
                     b_gate: Optional[Tensor], a_up: Optional[Tensor], b_up: Optional[Tensor],
                     a_down: Optional[Tensor], b_down: Optional[Tensor], alpha: float,
                     wanted: List[bool]) -> List[Tensor]:
    with _lock:
        saved = _states.pop(int(state[0]), None)
    if saved is None:
        raise InvalidArgument("the forward's saved state was released by this graph's first backward: a second "
                              "backward through one graph is not supported")
    g = ops.experts_backward(saved, dy, [n for n, w in zip(_WANTED, wanted) if w], dx_dtype=x.dtype)
    saved.packed.experts_pool.give(saved)
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
    _registered = True
    return True


def registered():
    """Whether register() registered the ops."""
    return bool(_registered)


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
