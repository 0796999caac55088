"""torch.autograd.Functions over moecert's ops (ops.py): the experts op with the
caller's routing, the three routers and the layer. Each backward computes only
the gradients autograd asks for (needs_input_grad); incoming gradients are
taken as contiguous fp32. Double backward is not supported: under
create_graph=True the gradients refuse a second backward (once_differentiable)."""
import functools

import torch
from torch.autograd.function import once_differentiable

from . import library, ops


class Stats:
    """Receives the per-token statistics M_A, M_G [T, E] (docs/DESIGN.md) of the backward of the op it
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


class ExpertsFunction(torch.autograd.Function):
    """apply(step, stats, x, expert_ids, weights, *tensors) -> y: the experts op through an
    ops.ExpertsStep; `tensors` are the LoRA factors and base weights step.inputs names after
    dweights (the base weights: the tensors the packed experts hold), passed so autograd routes
    their gradients, and x, weights and they must need gradients as step.needs says."""

    @staticmethod
    def forward(ctx, step, stats, x, expert_ids, weights, *tensors):
        needs = (ctx.needs_input_grad[2],) + ctx.needs_input_grad[4:]
        if needs != step.needs:
            raise ops.InvalidArgument("the step was formed for gradients of {} but autograd asks for {}".format(
                _names(("x",) + step.inputs, step.needs), _names(("x",) + step.inputs, needs)))
        saved = step.packed.experts_pool.take()
        y = step.forward(x, expert_ids, weights, saved)
        ctx.step, ctx.saved, ctx.generation, ctx.stats = step, saved, saved.generation, stats
        ctx.save_for_backward(x, *tensors)
        return y

    @staticmethod
    @_first_order
    def backward(ctx, dy):
        ctx.saved_tensors  # raises if x, a factor or a base weight was changed in place since the forward
        ops.check_generation(ctx.saved, ctx.generation)
        outs = ctx.step.backward(ctx.saved, dy)
        ctx.step.packed.experts_pool.give(ctx.saved)
        if ctx.stats is not None:
            ctx.stats.m_a, ctx.stats.m_g = outs[-2], outs[-1]
        dx, *rest = ctx.step.gradients(outs)
        return (None, None, dx, None) + tuple(rest)


def experts(x, expert_ids, weights, packed, lora=None, base=None, stats=None, isa=None):
    """The experts op with the caller's routing, differentiable in x, weights, the LoRA factors and,
    with `base`, the base weights.

    x [T, H] bf16 (another float dtype is rounded to bf16 by x.to(torch.bfloat16); dx comes in x's
    dtype), expert_ids [T, K] int32/int64 (-1 = empty slot, only at a row's tail), weights
    [T, K] fp32 or bf16 (0 at -1 slots; bf16 is widened exactly), packed: PackedExperts (the
    frozen base weights), lora: ops.Lora or None. base = (w_gate, w_up, w_down) bf16 trains the
    base weights instead: they are packed at this call (pass packed=None), so the op always
    computes with their current values. Returns y [T, H] fp32: y_t = sum_j weights[t, j] *
    expert_{ids[t, j]}(x_t), the gradient of weights dL/dw[t, j] = <dy_t, o_{t, j}>. Under
    torch.compile (torch 2.4 on), with neither base, stats nor isa given, this is the registered
    op torch.ops.moecert.experts (library.py), which the graph keeps; eagerly, the
    autograd.Function (the same bits, less dispatch per call)."""
    if isinstance(weights, torch.Tensor) and weights.dtype == torch.bfloat16:
        weights = weights.float()
    if base is not None:
        if packed is not None:
            raise ops.InvalidArgument("packed and base: pass packed=None with base (the base weights are packed "
                                      "at every call)")
        packed = ops.PackedExperts(*(b.detach() if isinstance(b, torch.Tensor) else b for b in base))
    if (base is None and stats is None and isa is None and library.in_graph() and isinstance(x, torch.Tensor) and
            x.dtype == torch.bfloat16):
        return library.call_experts(x, expert_ids, weights, packed, lora)  # a torch.compile graph op
    tensors = (weights,) + (lora.factors() if lora is not None else ()) + (tuple(base) if base is not None else ())
    needs = tuple(isinstance(t, torch.Tensor) and t.requires_grad for t in (x,) + tensors)  # as autograd's
    step = _experts_step(packed, lora, needs, base is not None, stats is not None,
                         x.dtype if isinstance(x, torch.Tensor) else None, isa)
    return ExpertsFunction.apply(step, stats, x, expert_ids, *tensors)


def _experts_step(packed, lora, needs, base, stats, dx_dtype, isa):
    """The ops.ExpertsStep of these factors and wanted gradients, kept on the packed experts: the
    one formed at an earlier call while the factors are the tensors it was formed for."""
    key = (needs, base, stats, dx_dtype, isa)
    step = packed.experts_steps.get(key) if isinstance(packed, ops.PackedExperts) else None
    if step is None or not step.holds(lora):
        step = ops.ExpertsStep(packed, lora, needs, base, stats, dx_dtype, isa)  # checks packed
        if len(packed.experts_steps) >= 8:
            packed.experts_steps.clear()
        packed.experts_steps[key] = step
    return step


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
                _names(("x",) + step.inputs, step.needs), _names(("x",) + step.inputs, ctx.needs_input_grad[2:])))
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


def _names(names, needs):
    return "[{}]".format(", ".join(n for n, w in zip(names, needs) if w))
