"""The routers, each defined once (define.py): softmax_topk, sigmoid_topk and
product_key, differentiable in their scores through the weights (the ids are
integers). Under torch.compile (torch >= 2.4) they are the registered ops
torch.ops.moecert.*; eagerly, their autograd.Functions, with the same bits."""
import dataclasses
from typing import Callable

import torch

from . import ops
from .define import OpDef


def _selection_fake(scores, k):
    rows = scores.shape[0]
    return [scores.new_empty((rows, k), dtype=torch.int32), scores.new_empty((rows, k), dtype=torch.float32)]


SOFTMAX_TOPK = OpDef(
    name="softmax_topk",
    schema="(Tensor z, int k, bool renormalize) -> Tensor[]",
    backward_schema="(Tensor z, Tensor idx, Tensor g, bool renormalize) -> Tensor[]",
    forward=lambda z, k, renormalize: list(ops.softmax_topk(z, k, renormalize)),
    backward=lambda z, idx, g, renormalize: [ops.softmax_topk_backward(z, idx, g, renormalize).to(z.dtype)],
    keep=lambda inputs, outputs: ((inputs[0], outputs[0]), (inputs[2],)),
    fake=lambda z, k, renormalize: _selection_fake(z, k),
    backward_fake=lambda z, idx, g, renormalize: [torch.empty_like(z)],
    grads_of=(0,), from_outputs=(1,), integer_outputs=(0,))

SIGMOID_TOPK = OpDef(
    name="sigmoid_topk",
    schema="(Tensor z, Tensor bias, int k, int groups, int topk_group, float scaling) -> Tensor[]",
    backward_schema="(Tensor z, Tensor idx, Tensor g, int groups, int topk_group, float scaling) -> Tensor[]",
    forward=lambda z, bias, k, groups, topk_group, scaling: list(
        ops.sigmoid_topk(z, bias, k, groups, topk_group, scaling)),
    backward=lambda z, idx, g, groups, topk_group, scaling: [
        ops.sigmoid_topk_backward(z, idx, g, groups, topk_group, scaling).to(z.dtype)],
    keep=lambda inputs, outputs: ((inputs[0], outputs[0]), tuple(inputs[3:6])),
    fake=lambda z, bias, k, groups, topk_group, scaling: _selection_fake(z, k),
    backward_fake=lambda z, idx, g, groups, topk_group, scaling: [torch.empty_like(z)],
    grads_of=(0,), from_outputs=(1,), integer_outputs=(0,))


def _product_key_backward(sx, sy, idx, g, weights):
    dsx, dsy = ops.product_key_backward(sx, sy, idx, g, weights)
    return [dsx.to(sx.dtype), dsy.to(sy.dtype)]


PRODUCT_KEY = OpDef(
    name="product_key",
    schema="(Tensor sx, Tensor sy, int k, str weights) -> Tensor[]",
    backward_schema="(Tensor sx, Tensor sy, Tensor idx, Tensor g, str weights) -> Tensor[]",
    forward=lambda sx, sy, k, weights: list(ops.product_key(sx, sy, k, weights)),
    backward=_product_key_backward,
    keep=lambda inputs, outputs: ((inputs[0], inputs[1], outputs[0]), (inputs[3],)),
    fake=lambda sx, sy, k, weights: _selection_fake(sx, k),
    backward_fake=lambda sx, sy, idx, g, weights: [torch.empty_like(sx), torch.empty_like(sy)],
    grads_of=(0, 1), from_outputs=(1,), integer_outputs=(0,))

DEFINITIONS = (SOFTMAX_TOPK, SIGMOID_TOPK, PRODUCT_KEY)


def softmax_topk(z, k, renormalize=True):
    """(idx [T, k] int32, w [T, k] fp32): top-k of softmax(z) (z [T, E] fp32 or bf16), weights
    renormalised over the k selected or not; differentiable in z through w."""
    return SOFTMAX_TOPK(z, k, bool(renormalize))


def sigmoid_topk(z, bias, k, groups=1, topk_group=1, scaling=1.0):
    """DeepSeek-V3 group-limited sigmoid top-k; bias [E] fp32 for selection only."""
    return SIGMOID_TOPK(z, bias, k, groups, topk_group, float(scaling))


def product_key(sx, sy, k, weights="softmax"):
    """Product-key top-k over E = n*n experts (e = ix*n + iy) from halves sx, sy [T, n]."""
    return PRODUCT_KEY(sx, sy, k, weights)


@dataclasses.dataclass(frozen=True)
class LayerRouter:
    """A router kind as the layer uses it: its definition, the definition's inputs from the layer
    config, the logits z [T, R] and the selection bias, and dz [T, R] from the definition's
    gradients. The layer's router in Python (expert parallelism)
    runs the definition's forward and backward through these."""
    definition: OpDef
    inputs: Callable
    dz: Callable


def _halves(z):
    n = z.shape[1] // 2
    return z[:, :n].contiguous(), z[:, n:].contiguous()


LAYER_ROUTERS = {
    "softmax_topk": LayerRouter(SOFTMAX_TOPK, lambda c, z, bias: (z, c.topk, c.renormalize),
                                lambda grads: grads[0]),
    "sigmoid_topk": LayerRouter(SIGMOID_TOPK, lambda c, z, bias: (z, bias, c.topk, c.groups, c.topk_group, c.scaling),
                                lambda grads: grads[0]),
    "product_key": LayerRouter(PRODUCT_KEY, lambda c, z, bias: _halves(z) + (c.topk, "softmax"),
                               lambda grads: torch.cat(grads, dim=1)),
}


def layer_route(cfg, z, bias):
    """((idx, w), what layer_route_backward needs) of the layer's router on the logits z [T, R]."""
    r = LAYER_ROUTERS[cfg.router]
    inputs = r.inputs(cfg, z, bias)
    outputs = r.definition.forward(*inputs)
    return tuple(outputs), r.definition.keep(inputs, outputs)


def layer_route_backward(cfg, kept, g):
    """dz [T, R] from g = dL/dw, as the layer's router path computes it."""
    r = LAYER_ROUTERS[cfg.router]
    tensors, extras = kept
    return r.dz(r.definition.backward(*tensors, g, *extras))
