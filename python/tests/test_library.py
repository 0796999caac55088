"""torch >= 2.4: the registered ops (torch.ops.moecert.*) give the bits of the
autograd.Functions, eagerly and under torch.compile(fullgraph=True)."""
import pytest
import torch

import moecert
import moecert.torch as mt
from moecert.torch import ops, routers

pytestmark = pytest.mark.skipif(not mt.library.registered(), reason="torch.library.custom_op needs torch >= 2.4")
T = 9


def registered_eagerly(run):
    """run() with the registered ops called eagerly (by default only torch.compile uses them)."""
    mt.library.always = True
    try:
        return run()
    finally:
        mt.library.always = False


def grads_of(run, inputs, g):
    """Outputs and input gradients of run(*leaves) with <g, w> (routers) as the loss."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    idx, w = run(*leaves)
    w.backward(g)
    return [idx, w.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("router", ["softmax_topk", "sigmoid_topk", "product_key"])
def test_routers(router, rng):
    z = torch.randn(T, 16, generator=rng)
    g = torch.randn(T, 4, generator=rng)
    bias = torch.randn(16, generator=rng) * 0.1
    if router == "softmax_topk":
        inputs, ours, function = [z], lambda a: mt.softmax_topk(a, 4), lambda a: routers.SOFTMAX_TOPK.function.apply(a, 4, True)
    elif router == "sigmoid_topk":
        inputs = [z]
        ours = lambda a: mt.sigmoid_topk(a, bias, 4, 4, 2, 1.5)
        function = lambda a: routers.SIGMOID_TOPK.function.apply(a, bias, 4, 4, 2, 1.5)
    else:
        inputs = [z[:, :4], z[:, 4:8]]
        ours = lambda a, b: mt.product_key(a, b, 4, "softmax")
        function = lambda a, b: routers.PRODUCT_KEY.function.apply(a, b, 4, "softmax")
    want = grads_of(function, inputs, g)
    for got in (registered_eagerly(lambda: grads_of(ours, inputs, g)),
                grads_of(torch.compile(ours, fullgraph=True), inputs, g)):
        assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_layer(rng):
    torch.manual_seed(3)
    layer = mt.MoELayer(8, 32, 48, 2, rank=4, alpha=8.0, max_tokens=T, out_dtype=torch.float32)
    with torch.no_grad():
        for k in ("b_gate", "b_up", "b_down"):
            getattr(layer, k).normal_(0, 0.3)
    x = torch.randn(T, 32, generator=rng).bfloat16()
    dy = torch.randn(T, 32, generator=rng)
    trainable = [layer.router_w, layer.router_b] + [getattr(layer, k) for k in ops.LORA_NAMES]

    def step(forward):
        xs = x.clone().requires_grad_()
        for p in trainable:
            p.grad = None
        y = forward(xs)
        y.backward(dy)
        return [y.detach(), xs.grad] + [p.grad for p in trainable]

    function = step(layer)  # eagerly: the definition's autograd.Function
    for got in (registered_eagerly(lambda: step(layer)), step(torch.compile(layer, fullgraph=True))):
        assert all(torch.equal(a, b) for a, b in zip(function, got))
    layer.out_dtype = None  # y in x's dtype: the graph's y rounded
    y_bf16 = registered_eagerly(lambda: torch.compile(layer, fullgraph=True)(x))
    assert y_bf16.dtype == torch.bfloat16 and torch.equal(y_bf16, function[0].bfloat16())
    layer.out_dtype = torch.float32
    mt.library.always = True  # what follows is the registered ops' state handling
    y = layer(x)
    y.backward(dy, retain_graph=True)
    layer.router_w.grad = None
    y.backward(dy, retain_graph=True)  # no forward since: the state still holds y's
    assert torch.equal(layer.router_w.grad, function[2])
    layer(x).backward(dy)  # reuses the state
    with pytest.raises(moecert.InvalidArgument, match="a second backward through one graph is not supported"):
        y.backward(dy)
    mt.library.always = False


OPCHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")


@pytest.mark.skipif(not hasattr(torch.library, "opcheck"), reason="torch.library.opcheck needs torch >= 2.4")
def test_opcheck(rng):
    """torch.library.opcheck on each registered op: its schema (no input mutated or aliased by
    an output), its autograd registration, its fake kernel's shapes and dtypes against the real
    one's. (test_aot_dispatch_dynamic compares two runs' outputs, and the stateful ops name a new
    saved state at each run.)"""
    z = torch.randn(T, 16, generator=rng, requires_grad=True)
    bias = torch.randn(16, generator=rng) * 0.1
    half = torch.randn(T, 4, generator=rng, requires_grad=True)
    cases = [(torch.ops.moecert.softmax_topk.default, (z, 4, True)),
             (torch.ops.moecert.sigmoid_topk.default, (z, bias, 4, 4, 2, 1.5)),
             (torch.ops.moecert.product_key.default, (half, half.detach().clone().requires_grad_(), 4, "softmax"))]
    packed = ops.PackedExperts(*(torch.randn(4, 24, 32, generator=rng).bfloat16() for _ in range(2)),
                               torch.randn(4, 32, 24, generator=rng).bfloat16())
    x = torch.randn(T, 32, generator=rng).bfloat16().requires_grad_()
    ids = torch.stack([torch.randperm(4, generator=rng)[:2] for _ in range(T)]).int()
    w = torch.rand(T, 2, generator=rng, requires_grad=True)
    factors = [t.requires_grad_() for t in (torch.randn(4, 2, 32), torch.randn(4, 24, 2), torch.randn(4, 2, 32),
                                            torch.randn(4, 24, 2), torch.randn(4, 2, 24), torch.randn(4, 32, 2))]
    cases.append((torch.ops.moecert.experts.default,
                  (x, ids, w, *factors, None, None, None, 4.0, packed.key, 0, -1, True)))
    layer = mt.MoELayer(4, 32, 24, 2, rank=2, alpha=4.0, max_tokens=T, out_dtype=torch.float32)
    layer(x.detach())  # packs
    lora = tuple(getattr(layer, n) for n in ops.LORA_NAMES)
    cases.append((torch.ops.moecert.layer.default,
                  (x, layer.router_w, layer.router_b, None, *lora, None, None, None, layer._config_key,
                   layer._packed.key, 0, -1, True)))
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=OPCHECKS)
