"""moecert's own fronts judged by the conformance suite (moecert.testing) as any other
implementation: the Python ops (mt.experts, the routers, MoELayer) and the C ABI, each with the
argument forms users pass (int32 and int64 ids, fp32 and bf16 LoRA factors, rows with a stride
beyond their width). A bug in a front's descriptor handling, dtype conversion or autograd wiring
fails a clause here even where every C++ conformance case passes. moecert's kernels compute as
declared `mixed` (bf16 GEMM operands, fp32 elsewhere)."""
import ctypes
import functools

import pytest
import torch

import moecert
import moecert.testing as mtest
import moecert.torch as mt
from moecert import _abi
from moecert.torch import routers
from moecert.torch._tensors import describe

LORA_NAMES = ("a_gate", "b_gate", "a_up", "b_up", "a_down", "b_down")


def _lora(lora, alpha, factors, grad=False):
    if lora is None:
        return None, {}
    leaves = {n: lora[n].to(factors).requires_grad_(grad) for n in LORA_NAMES}
    return mt.Lora(*leaves.values(), alpha=alpha), leaves


def python_experts(x, idx, weights, w_gate, w_up, w_down, lora=None, alpha=None, dy=None, ids=torch.int64,
                   factors=torch.bfloat16, base=False):
    """mt.experts on the suite's tensors (ids and factors converted as a user's might be); with dy
    the backward by autograd: (dx, dweights, the LoRA factors' or, with base, the base weights'
    gradients)."""
    train = dy is not None
    x = x.detach().clone().requires_grad_(train)
    weights = weights.detach().clone().requires_grad_(train)
    lo, leaves = _lora(lora, alpha, factors, grad=train and not base)
    if base:
        leaves = {n: t.detach().clone().requires_grad_() for n, t in
                  (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down))}
        y = mt.experts(x, idx.to(ids), weights, None, lo, base=tuple(leaves.values()))
    else:
        y = mt.experts(x, idx.to(ids), weights, mt.PackedExperts(w_gate, w_up, w_down), lo)
    if not train:
        return y
    y.backward(dy)
    return x.grad, weights.grad, {n: t.grad for n, t in leaves.items()}


@pytest.mark.parametrize("ids, factors", [(torch.int64, torch.bfloat16), (torch.int32, torch.float32)])
def test_python_experts_conform(ids, factors):
    fn = functools.partial(python_experts, ids=ids, factors=factors)
    mtest.assert_conforms(mtest.experts_forward(fn, "mixed"))
    mtest.assert_conforms(mtest.experts_backward(fn, "mixed"))


def test_python_experts_training_the_base_weights_conform():
    mtest.assert_conforms(mtest.experts_forward(python_experts, "mixed", lora=False))
    mtest.assert_conforms(mtest.experts_backward(functools.partial(python_experts, base=True), "mixed", lora=False))


# ---- routers: forward, and the backward by autograd through the forward ----

def _backward_through(forward, idx, g, *scores):
    """dscores of forward(*scores) -> (idx, w) for dL/dw = g, by autograd; the forward's selection
    must be the suite's (a different one fails the case)."""
    leaves = [s.detach().clone().requires_grad_() for s in scores]
    got, w = forward(*leaves)
    if not torch.equal(got.long(), idx.long()):
        raise AssertionError("the forward selected {} where the suite's selection is {}".format(
            got.tolist(), idx.tolist()))
    w.backward(g)
    grads = [t.grad for t in leaves]
    return grads[0] if len(grads) == 1 else tuple(grads)


def test_python_routers_conform():
    mtest.assert_conforms(mtest.router_forward("softmax_topk", mt.softmax_topk, sorted=True))
    mtest.assert_conforms(mtest.router_backward(
        "softmax_topk", lambda z, idx, g: _backward_through(lambda s: mt.softmax_topk(s, idx.shape[1]), idx, g, z)))
    mtest.assert_conforms(mtest.router_forward("sigmoid_topk", mt.sigmoid_topk, sorted=True))
    mtest.assert_conforms(mtest.router_forward("product_key", mt.product_key, sorted=True))
    mtest.assert_conforms(mtest.router_backward(
        "product_key", lambda sx, sy, idx, g: _backward_through(
            lambda a, b: mt.product_key(a, b, idx.shape[1]), idx, g, sx, sy)))


def test_python_sigmoid_router_backward_conforms():
    """The sigmoid router's backward from the op definition on the suite's selection (its float64
    scores may order near ties differently from moecert's fp32 ones, so not through the forward)."""
    mtest.assert_conforms(mtest.router_backward(
        "sigmoid_topk", lambda z, idx, g: routers.SIGMOID_TOPK.backward(z, idx.int(), g, 1, 1, 1.0)[0]))


# ---- MoELayer: the module, its intermediates from a Stats recorder with routing ----

def moelayer_step(x, router_w, router_b, w_gate, w_up, w_down, k, router_bias=None, lora=None, alpha=None,
                  dy=None, router="softmax_topk"):
    """MoELayer built from the suite's weights (as a user loads them: base= and the parameters'
    copy_), its forward and, with dy, backward; the routing from mt.stats(routing=True)."""
    E, I, H = w_gate.shape
    r = lora["a_gate"].shape[1] if lora else 0
    layer = mt.MoELayer(E, H, I, k, rank=r, alpha=alpha, router=router, base=(w_gate, w_up, w_down),
                        max_tokens=max(64, x.shape[0]), out_dtype=torch.float32)
    with torch.no_grad():
        layer.router_w.copy_(router_w)
        layer.router_b.copy_(router_b)
        if router_bias is not None:
            layer.router_bias.copy_(router_bias)
        for n in LORA_NAMES if lora else ():
            getattr(layer, n).copy_(lora[n])
    rec = mt.stats(routing=True)
    x = x.detach().clone().requires_grad_()
    y = layer(x, stats=rec)
    if dy is None:
        return rec.z, rec.idx, rec.weights, y.detach()
    y.backward(dy)
    grads = {n: getattr(layer, n).grad for n in LORA_NAMES} if lora else {}
    return {"z": rec.z, "idx": rec.idx, "weights": rec.weights, "dx": x.grad, "dweights": rec.dweights,
            "dz": rec.dz, "router_w_grad": layer.router_w.grad, "router_b_grad": layer.router_b.grad,
            "weight_grads": grads}


@pytest.mark.parametrize("router", ["softmax_topk", "sigmoid_topk"])
def test_moelayer_conforms(router):
    fn = functools.partial(moelayer_step, router=router)
    mtest.assert_conforms(mtest.layer_forward(fn, "mixed", router=router, sorted=True))
    mtest.assert_conforms(mtest.layer_backward(fn, "mixed", router=router, sorted=True))


def test_the_routing_recorder_refuses_what_it_does_not_hold():
    """z is held from a training forward until its backward; dweights and dz after a backward
    with the router path; asking otherwise is refused, naming the tensor."""
    layer = mt.MoELayer(8, 64, 32, 2, max_tokens=8)
    x = torch.randn(5, 64)
    saved = mt.ops.layer_forward(layer.config, layer._packed, layer.router_w.detach(), layer.router_b.detach(),
                                 x.bfloat16())[1]
    with pytest.raises(moecert.InvalidArgument, match="dweights: no backward"):
        mt.ops.layer_router(saved, ("dweights",))
    z = mt.ops.layer_router(saved)["z"]
    assert torch.equal(z, mt.ops.router_linear_forward(x.bfloat16(), layer.router_w.detach(),
                                                       layer.router_b.detach()))
    mt.ops.layer_backward(saved, torch.randn(5, 64), want=("dx",))
    assert mt.ops.layer_router(saved, ("dweights", "dz"))["dz"].shape == (5, 8)
    with pytest.raises(moecert.InvalidArgument, match="z: no training forward"):
        mt.ops.layer_router(saved)


# ---- the C ABI: moecert's own entry points behind the suite's C signature ----

def _strided(t, dtype, pad):
    """t as `dtype` in rows `pad` elements wider than t (2-D; a 3-D [E, m, n] as [E*m, n])."""
    t2 = t.reshape(-1, t.shape[-1]).to(dtype)
    gap = float("nan") if dtype.is_floating_point else (2 ** 40 if dtype == torch.int64 else -7)  # never an id
    wide = torch.full((t2.shape[0], t2.shape[1] + pad), gap, dtype=dtype)
    wide[:, :t2.shape[1]] = t2
    return wide, _abi.Tensor(wide.data_ptr(), describe(t2).dtype, 2, tuple(t2.shape), (t2.shape[1] + pad, 1))


def _call(name, *args):
    if not _abi.call(name, *args):
        raise RuntimeError(name + ": a precondition failed under observe")


class _Strided:
    """The C ABI's descriptors of a case's tensors, each in rows `pad` elements wider than its
    width (NaN or -7 in the gaps); the buffers kept alive with it."""

    def __init__(self, pad):
        self.pad, self.buffers = pad, []

    def __call__(self, t, dtype):
        buf, desc = _strided(t, dtype, self.pad)
        self.buffers.append(buf)
        return desc

    def out(self, shape):
        """(view of the result, its descriptor) of a zeroed fp32 output."""
        buf, desc = _strided(torch.zeros(shape), torch.float32, self.pad)
        self.buffers.append(buf)
        return buf[:, :desc.shape[1]], desc

    def lora(self, lora, alpha, factors):
        if lora is None:
            return None
        return _abi.Lora(*(self(lora[n], factors) for n in LORA_NAMES), lora["a_gate"].shape[1], float(alpha))

    def pack(self, w_gate, w_up, w_down):
        handle = ctypes.c_void_p()
        _call("moecert_experts_pack", w_gate.shape[0], *(ctypes.byref(self(w, torch.bfloat16))
                                                         for w in (w_gate, w_up, w_down)), 1, ctypes.byref(handle))
        return handle


def _factor_grads(s, grads, lora):
    """Descriptors in `grads` for the LoRA factors' gradients; {name: view} of them."""
    out = {}
    for n in LORA_NAMES if lora is not None else ():
        view, desc = s.out((lora[n].reshape(-1, lora[n].shape[-1]).shape))
        setattr(grads, n, desc)
        out[n] = view
    return out


def c_abi_experts(x, idx, weights, w_gate, w_up, w_down, lora=None, alpha=None, dy=None, pad=3,
                  factors=torch.bfloat16, ids=torch.int32):
    """moecert_experts_pack / forward_train / backward on descriptors with row strides `pad`
    beyond their width, ids as `ids`, LoRA factors as `factors`; the backward's dx, dL/dw and
    the factors' gradients."""
    s = _Strided(pad)
    handle, saved = s.pack(w_gate, w_up, w_down), ctypes.c_void_p()
    try:
        _call("moecert_experts_saved_new", ctypes.byref(saved))
        c_lora = s.lora(lora, alpha, factors)
        lo = ctypes.byref(c_lora) if c_lora else None
        xd = s(x, torch.bfloat16)
        y, yd = s.out(x.shape)
        _call("moecert_experts_forward_train", handle, lo, ctypes.byref(xd), ctypes.byref(s(idx, ids)),
              ctypes.byref(s(weights, torch.float32)), ctypes.byref(yd), saved, None)
        if dy is None:
            return y.clone()
        grads = _abi.ExpertsGrads()
        dx, grads.dx = s.out(x.shape)
        dw, grads.dweights = s.out(weights.shape)
        factor_grads = _factor_grads(s, grads, lora)
        _call("moecert_experts_backward", handle, lo, ctypes.byref(xd), ctypes.byref(s(dy, torch.float32)), saved,
              ctypes.byref(grads))
        return dx.clone(), dw.clone(), {n: g.reshape(lora[n].shape).clone() for n, g in factor_grads.items()}
    finally:
        _abi.lib.moecert_experts_saved_free(saved)
        _abi.lib.moecert_experts_free(handle)


def c_abi_layer(x, router_w, router_b, w_gate, w_up, w_down, k, router_bias=None, lora=None, alpha=None, dy=None,
                pad=3, factors=torch.float32):
    """moecert_layer_forward / backward (softmax top-k) on strided descriptors, the intermediates
    from moecert_layer_saved_routing and moecert_layer_saved_router."""
    E, I, H = w_gate.shape
    T, r = x.shape[0], lora["a_gate"].shape[1] if lora else 0
    cfg = mt.LayerConfig(E, H, I, k, r, float(alpha) if r else 0.0, "softmax_topk", True, 1, 1, 1.0,
                         max(64, T)).struct()
    s = _Strided(pad)
    weights = _abi.LayerWeights()
    weights.experts = s.pack(w_gate, w_up, w_down)
    saved = ctypes.c_void_p()
    try:
        weights.router_w, weights.router_b = s(router_w, torch.float32), s(router_b[None], torch.float32)
        weights.router_b = _abi.Tensor(weights.router_b.data, weights.router_b.dtype, 1, (E, 0), (1, 0))
        if lora is not None:
            weights.lora = s.lora(lora, alpha, factors)
        _call("moecert_layer_saved_new", ctypes.byref(saved))
        xd = s(x, torch.bfloat16)
        y, yd = s.out(x.shape)
        _call("moecert_layer_forward", ctypes.byref(cfg), ctypes.byref(weights), ctypes.byref(xd), ctypes.byref(yd),
              saved, None)
        idx, idxd = _strided(torch.zeros(T, k, dtype=torch.int32), torch.int32, pad)
        w, wd = s.out((T, k))
        z, zd = s.out((T, E))
        _call("moecert_layer_saved_routing", saved, ctypes.byref(idxd), ctypes.byref(wd))
        _call("moecert_layer_saved_router", saved, ctypes.byref(zd), None, None)
        idx, z, w = idx[:, :k].clone(), z.clone(), w.clone()
        if dy is None:
            return z, idx, w, y.clone()
        grads = _abi.LayerGrads()
        dx, grads.dx = s.out(x.shape)
        gw, grads.router_w = s.out(router_w.shape)
        gb = torch.zeros(E)
        grads.router_b = describe(gb)
        factor_grads = _factor_grads(s, grads, lora)
        _call("moecert_layer_backward", ctypes.byref(cfg), ctypes.byref(weights), ctypes.byref(xd),
              ctypes.byref(s(dy, torch.float32)), saved, ctypes.byref(grads), 1, 1)
        dw, dwd = s.out((T, k))
        dz, dzd = s.out((T, E))
        _call("moecert_layer_saved_router", saved, None, ctypes.byref(dwd), ctypes.byref(dzd))
        return {"z": z, "idx": idx, "weights": w, "dx": dx.clone(), "dweights": dw.clone(), "dz": dz.clone(),
                "router_w_grad": gw.clone(), "router_b_grad": gb,
                "weight_grads": {n: g.reshape(lora[n].shape).clone() for n, g in factor_grads.items()}}
    finally:
        _abi.lib.moecert_layer_saved_free(saved)
        _abi.lib.moecert_experts_free(weights.experts)


def test_the_c_abi_layer_conforms_with_strided_rows():
    mtest.assert_conforms(mtest.layer_forward(c_abi_layer, "mixed", sorted=True))
    mtest.assert_conforms(mtest.layer_backward(c_abi_layer, "mixed", sorted=True))


@pytest.mark.parametrize("factors, ids", [(torch.bfloat16, torch.int64), (torch.float32, torch.int32)])
def test_the_c_abi_experts_conform_with_strided_rows(factors, ids):
    fn = functools.partial(c_abi_experts, factors=factors, ids=ids)
    mtest.assert_conforms(mtest.experts_forward(fn, "mixed"))
    mtest.assert_conforms(mtest.experts_backward(fn, "mixed"))
