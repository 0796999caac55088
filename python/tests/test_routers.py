"""The three routers against float64 PyTorch: the selection exactly (random
scores: no ties), the weights and the backward within moecert's bounds."""
import pytest
import torch

import moecert.torch as mt
from moecert.torch import ops

import reference as R
from conftest import within

T = 9


def backward_of(weights_fn, inputs, g):
    """Weights and the gradients of <g, w> by float64 autograd, the selection held fixed."""
    xs = [R.f64(t) for t in inputs]
    w = weights_fn(*xs)
    return w, torch.autograd.grad((g.double() * w).sum(), xs)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_topk(renormalize, dtype, rng):
    E, K = 12, 3
    z = (torch.randn(T, E, generator=rng) * 2).to(dtype).requires_grad_()
    g = torch.randn(T, K, generator=rng)
    idx, w = mt.softmax_topk(z, K, renormalize)
    w.backward(g)
    assert torch.equal(idx, R.softmax_topk_select(z.double(), K))
    w64, (dz64,) = backward_of(lambda zz: R.softmax_topk_weights(zz, idx, renormalize), [z], g)
    wb, db = ops.router_bounds("softmax_topk", renormalize, z.float(), idx, g)
    within("w", w, w64, wb)
    dz = ops.softmax_topk_backward(z.detach(), idx, g, renormalize)  # fp32; autograd casts to z's dtype
    assert torch.equal(z.grad, dz.to(dtype))
    within("dz", dz, dz64, db)


def test_sigmoid_topk(rng):
    E, K, G, KG, C = 16, 4, 4, 2, 2.5
    z = torch.randn(T, E, generator=rng).requires_grad_()
    bias = torch.randn(E, generator=rng) * 0.1
    g = torch.randn(T, K, generator=rng)
    idx, w = mt.sigmoid_topk(z, bias, K, G, KG, C)
    w.backward(g)
    assert torch.equal(idx, R.sigmoid_topk_select(z.double(), bias, K, G, KG))
    w64, (dz64,) = backward_of(lambda zz: R.sigmoid_topk_weights(zz, idx, C), [z], g)
    wb, db = ops.router_bounds("sigmoid_topk", C, z, idx, g)
    within("w", w, w64, wb)
    within("dz", z.grad, dz64, db)


@pytest.mark.parametrize("mode", ["raw", "exp", "softmax"])
def test_product_key(mode, rng):
    n, K = 6, 4
    sx = torch.randn(T, n, generator=rng).requires_grad_()
    sy = torch.randn(T, n, generator=rng).requires_grad_()
    g = torch.randn(T, K, generator=rng)
    idx, w = mt.product_key(sx, sy, K, mode)
    w.backward(g)
    assert torch.equal(idx, R.product_key_select(sx.double(), sy.double(), K))
    w64, (dsx64, dsy64) = backward_of(lambda a, b: R.product_key_weights(a, b, idx, mode), [sx, sy], g)
    wb, db = ops.router_bounds("product_key", mode, torch.cat([sx, sy], 1), idx, g)
    within("w", w, w64, wb)
    within("dsx", sx.grad, dsx64, db[:, :n])
    within("dsy", sy.grad, dsy64, db[:, n:])
