"""torch.autograd.Functions over moecert's ops (ops.py): the experts op with the
caller's routing, the three routers and the layer. Each backward computes only
the gradients autograd asks for (needs_input_grad); incoming gradients are
taken as contiguous fp32. Double backward is not supported: under
create_graph=True the gradients refuse a second backward (once_differentiable)."""
import functools

import torch
from torch.autograd.function import once_differentiable

from . import library, ops
from .ops import BASE_NAMES, LORA_NAMES


class Stats:
    """Receives the per-token statistics M_A, M_G [T, E] (DESIGN.md) of the backward of the op it
    is passed to: m_a[t, e] = ||activations of t in expert e||, m_g[t, e] = the norm of t's
    gradient of e's trainable matrices (LoRA factors, or base weights without LoRA); 0 where t is
    not routed to e. None until that backward ran."""

    def __init__(self):
        self.m_a = self.m_g = None


def stats():
    """A fresh Stats recorder: pass it as `stats=` to an op or a module's forward."""
    return Stats()


def _first_order(backward):
    """backward as is while the engine records no graph of the gradients (create_graph=False),
    else under once_differentiable: its no_grad scope and output wrapping are left out of the
    common step."""
    once = once_differentiable(backward)

    @functools.wraps(backward)
    def run(ctx, *grads):
        return once(ctx, *grads) if torch.is_grad_enabled() else backward(ctx, *grads)

    return run


def _wanted(needs, names, first):
    return {n for i, n in enumerate(names) if needs[first + i]}


def _record(stats, grads):
    if stats is not None:
        stats.m_a, stats.m_g = grads.pop("m_a"), grads.pop("m_g")


class ExpertsFunction(torch.autograd.Function):
    """apply(x, expert_ids, weights, w_gate, w_up, w_down, a_gate, b_gate, a_up, b_up, a_down, b_down,
    packed, alpha, stats, isa) -> y. w_gate, w_up, w_down: the tensors `packed` holds (or None),
    passed so autograd can route their gradients; the LoRA factors None for no LoRA."""

    @staticmethod
    def forward(ctx, x, expert_ids, weights, w_gate, w_up, w_down, a_gate, b_gate, a_up, b_up, a_down, b_down,
                packed, alpha, stats, isa):
        base = (w_gate, w_up, w_down)
        if any(t is not None for t in base):
            packed.check_sources(*base)
        factors = (a_gate, b_gate, a_up, b_up, a_down, b_down)
        lora = ops.Lora(*factors, alpha=alpha) if a_gate is not None else None
        y, saved = ops.experts_forward_train(packed, x, expert_ids, weights, lora, packed.experts_pool.take(), isa)
        ctx.saved, ctx.generation, ctx.stats, ctx.has_lora = saved, saved.generation, stats, lora is not None
        ctx.save_for_backward(x, *(f for f in factors if f is not None))
        return y

    @staticmethod
    @_first_order
    def backward(ctx, dy):
        ctx.saved_tensors  # raises if x or a factor was changed in place since the forward
        needs = ctx.needs_input_grad
        want = _wanted(needs, ("dx",), 0) | _wanted(needs, ("dweights",), 2) | _wanted(needs, BASE_NAMES, 3)
        if ctx.has_lora:
            want |= _wanted(needs, LORA_NAMES, 6)
        if ctx.stats is not None:
            want |= {"m_a", "m_g"}
        ops.check_generation(ctx.saved, ctx.generation)
        g = ops.experts_backward(ctx.saved, dy, want, dx_dtype=ctx.saved.x.dtype)
        ctx.saved.packed.experts_pool.give(ctx.saved)
        _record(ctx.stats, g)
        return ((g.get("dx"), None, g.get("dweights")) + tuple(g.get(n) for n in BASE_NAMES) +
                tuple(g.get(n) for n in LORA_NAMES) + (None,) * 4)


def experts(x, expert_ids, weights, packed, lora=None, base=None, stats=None, isa=None):
    """The experts op with the caller's routing, differentiable in x, weights, the LoRA factors and
    (when `base` = (w_gate, w_up, w_down), the tensors packed) the base weights.

    x [T, H] bf16, expert_ids [T, K] int32/int64 (-1 = empty slot, only at a row's tail), weights
    [T, K] fp32 (0 at -1 slots), packed: PackedExperts, lora: ops.Lora or None. Returns y [T, H] fp32:
    y_t = sum_j weights[t, j] * expert_{ids[t, j]}(x_t), the gradient of weights dL/dw[t, j] =
    <dy_t, o_{t, j}>. Under torch.compile (torch 2.4 on), with neither base, stats nor isa given,
    this is the registered op torch.ops.moecert.experts (library.py), which the graph keeps;
    eagerly, the autograd.Function (the same bits, less dispatch per call)."""
    if base is None and stats is None and isa is None and library.in_graph():
        return library.call_experts(x, expert_ids, weights, packed, lora)  # a torch.compile graph op
    base = base if base is not None else (None, None, None)
    factors = lora.factors() if lora is not None else (None,) * 6
    alpha = lora.alpha if lora is not None else 0.0
    return ExpertsFunction.apply(x, expert_ids, weights, *base, *factors, packed, alpha, stats, isa)


class _Router(torch.autograd.Function):
    """Shared backward plumbing: idx is not differentiable; dz from g = dL/dw."""

    @staticmethod
    def setup(ctx, inputs, idx, extra):
        ctx.mark_non_differentiable(idx)
        ctx.save_for_backward(*inputs, idx)
        ctx.extra = extra


class SoftmaxTopk(_Router):
    @staticmethod
    def forward(ctx, z, k, renormalize):
        idx, w = ops.softmax_topk(z, k, renormalize)
        _Router.setup(ctx, (z,), idx, renormalize)
        return idx, w

    @staticmethod
    @_first_order
    def backward(ctx, _didx, dw):
        z, idx = ctx.saved_tensors
        return ops.softmax_topk_backward(z, idx, dw, ctx.extra), None, None


class SigmoidTopk(_Router):
    @staticmethod
    def forward(ctx, z, bias, k, groups, topk_group, scaling):
        idx, w = ops.sigmoid_topk(z, bias, k, groups, topk_group, scaling)
        _Router.setup(ctx, (z,), idx, (groups, topk_group, scaling))
        return idx, w

    @staticmethod
    @_first_order
    def backward(ctx, _didx, dw):
        z, idx = ctx.saved_tensors
        return (ops.sigmoid_topk_backward(z, idx, dw, *ctx.extra),) + (None,) * 5


class ProductKey(_Router):
    @staticmethod
    def forward(ctx, sx, sy, k, weights):
        idx, w = ops.product_key(sx, sy, k, weights)
        _Router.setup(ctx, (sx, sy), idx, weights)
        return idx, w

    @staticmethod
    @_first_order
    def backward(ctx, _didx, dw):
        sx, sy, idx = ctx.saved_tensors
        dsx, dsy = ops.product_key_backward(sx, sy, idx, dw, ctx.extra)
        return dsx, dsy, None, None


def softmax_topk(z, k, renormalize=True):
    """(idx [T, k] int32, w [T, k] fp32): top-k of softmax(z) (z [T, E] fp32 or bf16), weights
    renormalised over the k selected or not; differentiable in z through w. Under torch.compile
    (torch 2.4 on) the routers are the registered ops torch.ops.moecert.*."""
    if library.in_graph():
        return tuple(torch.ops.moecert.softmax_topk(z, k, renormalize))
    return SoftmaxTopk.apply(z, k, renormalize)


def sigmoid_topk(z, bias, k, groups=1, topk_group=1, scaling=1.0):
    """DeepSeek-V3 group-limited sigmoid top-k; bias [E] fp32 for selection only."""
    if library.in_graph():
        return tuple(torch.ops.moecert.sigmoid_topk(z, bias, k, groups, topk_group, float(scaling)))
    return SigmoidTopk.apply(z, bias, k, groups, topk_group, scaling)


def product_key(sx, sy, k, weights="softmax"):
    """Product-key top-k over E = n*n experts (e = ix*n + iy) from halves sx, sy [T, n]."""
    if library.in_graph():
        return tuple(torch.ops.moecert.product_key(sx, sy, k, weights))
    return ProductKey.apply(sx, sy, k, weights)


class LayerFunction(torch.autograd.Function):
    """apply(step, stats, x, *tensors) -> y: the MoE layer (router linear + router + experts with
    LoRA) through an ops.LayerStep; `tensors` are the weights step.inputs names, passed so
    autograd routes their gradients, and x and they must need gradients as step.needs says."""

    @staticmethod
    def forward(ctx, step, stats, x, *tensors):
        if ctx.needs_input_grad[2:] != step.needs:
            raise ops.InvalidArgument("the step was formed for gradients of {} but autograd asks for {}".format(
                _names(step, step.needs), _names(step, ctx.needs_input_grad[2:])))
        saved = step.packed.layer_pool.take()
        y = step.forward(x, saved)
        ctx.step, ctx.saved, ctx.generation, ctx.stats = step, saved, saved.generation, stats
        ctx.save_for_backward(x, *tensors)
        return y

    @staticmethod
    @_first_order
    def backward(ctx, dy):
        ctx.saved_tensors  # raises if x or a weight was changed in place since the forward
        ops.check_generation(ctx.saved, ctx.generation)
        outs = ctx.step.backward(ctx.saved, dy)
        ctx.step.packed.layer_pool.give(ctx.saved)
        if ctx.stats is not None:
            ctx.stats.m_a, ctx.stats.m_g = outs[-2], outs[-1]
        return (None, None) + ctx.step.gradients(outs)


def _names(step, needs):
    return "[{}]".format(", ".join(n for n, w in zip(("x",) + step.inputs, needs) if w))
