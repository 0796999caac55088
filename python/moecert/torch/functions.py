"""torch.autograd.Functions over moecert's ops (ops.py): the experts op with the
caller's routing and the layer (the routers: routers.py). Each backward computes only
the gradients autograd asks for (needs_input_grad); incoming gradients are
taken as contiguous fp32. Double backward is not supported: under
create_graph=True the gradients refuse a second backward (once_differentiable)."""
import torch

from . import library, ops
from .define import first_order


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
    @first_order
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
    @first_order
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
