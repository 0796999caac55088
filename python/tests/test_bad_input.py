"""Bad input: each rejected class raises a Python exception naming the problem
(InvalidArgument before any work, or ContractViolation carrying the clause,
location and values), and leaves the caller's tensors as they were."""
import ctypes

import pytest
import torch

import moecert
import moecert.torch as mt
from moecert import _abi
from moecert.torch import ops
from moecert.torch._tensors import describe

E, H, I, K, RANK, T = 4, 32, 48, 2, 4, 6


@pytest.fixture
def case(rng):
    n = lambda *s, sd=1.0: torch.randn(*s, generator=rng) * sd
    packed = ops.PackedExperts(n(E, I, H, sd=0.2).bfloat16(), n(E, I, H, sd=0.2).bfloat16(),
                               n(E, H, I, sd=0.2).bfloat16())
    shapes = ops._lora_shapes(E, H, I, RANK)
    lora = ops.Lora(*(n(*shapes[k], sd=0.3).bfloat16() for k in ops.LORA_NAMES), alpha=8.0)
    ids = torch.stack([torch.randperm(E, generator=rng)[:K] for _ in range(T)]).to(torch.int32)
    return packed, lora, n(T, H).bfloat16(), ids, torch.rand(T, K, generator=rng)


def unchanged(*tensors):
    """A check that the tensors still hold what they hold now."""
    bits = lambda t: t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)  # NaN == NaN
    copies = [bits(t).clone() for t in tensors]
    return lambda: all(torch.equal(bits(a), b) for a, b in zip(tensors, copies))


def _with_a(lora, a_gate, a_up):
    """lora's factors with these a_gate and a_up."""
    f = lora.factors()
    return (a_gate, f[1], a_up) + f[3:]


def _overlapping(t):
    """Two tensors of t's shape and values over one storage, the second one element further."""
    n = t.numel()
    storage = torch.empty(n + 1, dtype=t.dtype)
    storage[:n] = t.reshape(-1)
    return storage[:n].view(t.shape), storage[1:].view(t.shape)


@pytest.mark.parametrize("mutate, message", [
    (lambda a: a.update(x=a["x"].to(torch.int32)), "x: dtype int32, expected bfloat16"),
    (lambda a: a.update(x=torch.empty(T, H, dtype=torch.bfloat16, device="meta")), "x: on meta, expected a CPU tensor"),
    (lambda a: a.update(x=torch.zeros(H, T, dtype=torch.bfloat16).t()), "x: not contiguous"),
    (lambda a: a.update(x=torch.zeros(T, H + 1, dtype=torch.bfloat16)), "x: shape [6, 33], expected [? x 32]"),
    (lambda a: a.update(weights=a["weights"].double()), "weights: dtype float64, expected float32"),
    (lambda a: a.update(ids=a["ids"].float()), "expert_ids: dtype float32, expected int32 or int64"),
    (lambda a: a.update(ids=a["ids"][:, :1].contiguous()), "weights: shape [6, 2], expected [6 x 1]"),
    (lambda a: a.update(lora=ops.Lora(*_with_a(a["lora"], *_overlapping(a["lora"].a_gate)), alpha=8.0)),
     "lora.a_gate and lora.a_up overlap in memory"),  # (a_up may be a_gate itself: a shared A)
    (lambda a: a.update(lora=ops.Lora(*a["lora"].factors()[:5], torch.zeros(E, H, RANK + 1), alpha=8.0)),
     "lora.b_down: shape [4, 32, 5], expected [4 x 32 x 4]"),
    (lambda a: a.update(isa="avx9"), "isa 'avx9'"),
    (lambda a: a.update(x=a["lora"].a_gate.view(-1)[:T * H].view(T, H)), "x and lora.a_gate overlap in memory"),
])
@pytest.mark.parametrize("warm", [False, True], ids=["first call", "after a good call"])
def test_invalid_arguments_raise_before_any_work(case, mutate, message, warm):
    packed, lora, x, ids, weights = case
    if warm:  # the good call's checked descriptors are remembered (PackedExperts.memo)
        mt.experts(x, ids, weights, packed, lora)
    args = {"x": x, "ids": ids, "weights": weights, "lora": lora, "isa": None}
    mutate(args)
    same = unchanged(x, ids, weights)
    with pytest.raises(moecert.InvalidArgument, match=message.replace("[", r"\[").replace("?", r"\?")):
        mt.experts(args["x"], args["ids"], args["weights"], packed, args["lora"], isa=args["isa"])
    assert same()


def broken(field, fn):
    def apply(args):
        args[field] = args[field].clone()
        fn(args[field])
    return apply


@pytest.mark.parametrize("mutate, clause, location, observed", [
    (broken("x", lambda x: x.__setitem__((3, 5), float("nan"))), "experts.forward_train.x_finite", "x[3, 5]", "x=nan"),
    (broken("ids", lambda i: i.__setitem__((2, 1), E)), "experts.forward_train.idx_in_range", "t=2 j=1", "idx=4"),
    (broken("ids", lambda i: i.__setitem__((1, 0), -1)), "experts.forward_train.idx_in_range", "t=1 j=1",
     "idx="),
    (broken("ids", lambda i: i.__setitem__((4, 1), int(i[4, 0]))), "experts.forward_train.idx_unique", "t=4", None),
    (broken("weights", lambda w: w.__setitem__((0, 1), float("inf"))), "experts.forward_train.weight_finite",
     "t=0 j=1", None),
])
def test_contract_violations_name_clause_location_and_value(case, mutate, clause, location, observed):
    packed, lora, x, ids, weights = case
    args = {"x": x, "ids": ids, "weights": weights}
    mutate(args)
    same = unchanged(args["x"], args["ids"], args["weights"], *lora.factors())
    with moecert.contracts("check"):
        with pytest.raises(moecert.ContractViolation) as err:
            mt.experts(args["x"], args["ids"], args["weights"], packed, lora)
    v = err.value
    assert v.clause == clause and v.op == "experts.forward_train" and v.kind == "pre"
    assert location in v.location, v.location
    assert observed is None or observed in v.observed, v.observed
    assert clause in str(v) and v.file and v.line > 0
    assert same()


def test_backward_before_forward_and_nan_dy(case):
    packed, lora, x, ids, weights = case
    saved = ops.ExpertsSaved()
    saved.packed, saved.lora, saved.x, saved.tokens, saved.topk = packed, lora, x, T, K
    with pytest.raises(moecert.ContractViolation) as err:
        ops.experts_backward(saved, torch.zeros(T, H))
    assert err.value.clause == "experts.backward.state"
    y, saved = ops.experts_forward_train(packed, x, ids, weights, lora)
    dy = torch.zeros(T, H)
    dy[2, 7] = float("nan")
    with pytest.raises(moecert.ContractViolation) as err:
        ops.experts_backward(saved, dy)
    assert err.value.clause == "experts.backward.dy_finite" and "dy[2, 7]" in err.value.location


def test_base_weights_given_are_packed_at_every_call(rng):
    """mt.experts(base=...) computes with the base weights' current values (packed at the call):
    an in-place change, through .data too, reaches the next call; packed and base together are
    refused."""
    w = [torch.randn(E, I, H, generator=rng).bfloat16(), torch.randn(E, I, H, generator=rng).bfloat16(),
         torch.randn(E, H, I, generator=rng).bfloat16()]
    x = torch.randn(T, H, generator=rng).bfloat16()
    ids = torch.zeros(T, 1, dtype=torch.int32)
    y0 = mt.experts(x, ids, torch.ones(T, 1), None, base=w)
    w[0].data.mul_(2)
    y1 = mt.experts(x, ids, torch.ones(T, 1), None, base=w)
    assert not torch.equal(y0, y1)
    assert torch.equal(y1, mt.experts(x, ids, torch.ones(T, 1), ops.PackedExperts(*w)))
    with pytest.raises(moecert.InvalidArgument, match="pass packed=None with base"):
        mt.experts(x, ids, torch.ones(T, 1), ops.PackedExperts(*w), base=w)


def test_router_and_layer_violations(rng):
    z = torch.randn(T, 8, generator=rng)
    z[1, 3] = float("nan")
    with pytest.raises(moecert.ContractViolation) as err:
        mt.softmax_topk(z, 2)
    assert err.value.clause == "router.softmax_topk.scores_finite"
    layer = mt.MoELayer(8, H, I, K, rank=RANK, max_tokens=T)
    x = torch.randn(T, H).bfloat16()
    x[0, 0] = float("inf")
    with pytest.raises(moecert.ContractViolation) as err:
        layer(x)
    assert err.value.clause == "layer.forward.x_finite"
    with pytest.raises(moecert.InvalidArgument, match=r"x: \[{}, {}\] int32, expected a \[..., {}\] floating".format(
            T, H, H)):
        layer(torch.zeros(T, H, dtype=torch.int32))


def test_layer_arguments_checked_after_a_good_call(rng):
    """The layer's checked weight descriptors are remembered between calls (PackedExperts.memo):
    a router weight or LoRA factor replaced, or an x over one of them, is still refused."""
    layer = mt.MoELayer(8, H, I, K, rank=RANK, max_tokens=T)
    x = torch.randn(T, H, generator=rng).bfloat16()
    layer(x).sum().backward()
    with torch.no_grad():
        layer.router_w.data = layer.router_w.data.t().contiguous().t()
    with pytest.raises(moecert.InvalidArgument, match="router_w: not contiguous"):
        layer(x)
    with torch.no_grad():
        layer.router_w.data = layer.router_w.data.contiguous()
        layer.a_up.data = layer.a_up.data.to(torch.complex64)
    with pytest.raises(moecert.InvalidArgument, match="lora.a_up: dtype complex64"):
        layer(x)
    with torch.no_grad():
        layer.a_up.data = layer.a_up.data.float()
    layer(x).sum().backward()
    over = layer.router_w.detach().view(torch.bfloat16).view(-1)[:T * H].view(T, H)
    with pytest.raises(moecert.InvalidArgument, match="router_w and x overlap in memory|x and router_w overlap"):
        ops.layer_forward(layer.config, layer._packed, layer.router_w.detach(), layer.router_b.detach(), over, None,
                          layer.lora())
    with pytest.raises(moecert.InvalidArgument, match="router_w and x overlap in memory|x and router_w overlap"):
        layer(over)  # the training step's check


def test_observe_reports_and_continues(case, capfd):
    packed, lora, x, ids, weights = case
    x = x.clone()
    x[0, 1] = float("nan")
    with moecert.contracts("check", "observe"):
        y = mt.experts(x, ids, weights, packed, lora)
    assert y.shape == (T, H)
    assert "experts.forward_train.x_finite" in capfd.readouterr().err


def test_the_c_abi_rejects_bad_descriptors(case):
    """The C side checks descriptors itself (for callers other than this package)."""
    packed = case[0]
    t = torch.zeros(3, H)
    y = torch.zeros(3, H)
    idx = torch.zeros(3, 1, dtype=torch.int32)
    one_dim = describe(torch.zeros(3 * H, dtype=torch.bfloat16))
    for desc, message in [(describe(t), "x: dtype float32, expected bfloat16"), (_abi.Tensor(), "x: absent, expected a 2-D tensor"),
                          (one_dim, "x: 1 dimensions, expected 2")]:
        status = _abi.lib.moecert_experts_forward(packed.ptr, ctypes.byref(desc), ctypes.byref(describe(idx)),
                                                   ctypes.byref(describe(t)), ctypes.byref(describe(y)), -1)
        err = _abi.lib.moecert_last_error().contents
        assert status == 2 and err.status == 2
        assert err.message.decode() == "moecert_experts_forward: " + message
    with pytest.raises(moecert.InvalidArgument, match="experts: null handle"):
        _abi.call("moecert_experts_forward", None, ctypes.byref(describe(t)), ctypes.byref(describe(idx)),
                  ctypes.byref(describe(t)), ctypes.byref(describe(y)), -1)
    strided = describe(t)
    strided.stride[1] = 2
    with pytest.raises(moecert.InvalidArgument, match="stride\\[1\\] = 2, expected 1"):
        _abi.call("moecert_softmax_topk_forward", ctypes.byref(strided), ctypes.byref(describe(idx)),
                  ctypes.byref(describe(y[:, :1].contiguous())), 1)


def test_the_c_abi_checks_counts_arrays_and_pack_shapes(case):
    """An element count that wraps in 64 bits (it would pass a NULL-data check as 0 elements),
    NULL arrays with counts, and base weights of inconsistent shapes are refused before any work."""
    packed = case[0]
    idx, w = torch.zeros(3, 1, dtype=torch.int32), torch.ones(3, 1)
    y = torch.zeros(3, H)
    wrap = _abi.Tensor(None, _abi.BF16, 2, (2 ** 62, 4), (4, 1))
    with pytest.raises(moecert.InvalidArgument, match=r"x: shape 4611686018427387904 x 4 has more than 2\^63"):
        _abi.call("moecert_experts_forward", packed.ptr, ctypes.byref(wrap), ctypes.byref(describe(idx)),
                  ctypes.byref(describe(w)), ctypes.byref(describe(y)), -1)
    verdict = ctypes.c_void_p()
    for args, name in (((None, 2, None, 0, None, 0), "inputs: NULL with a count of 2"),
                       ((None, 0, None, 1, None, 0), "outputs: NULL with a count of 1"),
                       ((None, 0, None, 0, None, 3), "params: NULL with a count of 3")):
        with pytest.raises(moecert.InvalidArgument, match=name):
            _abi.call("moecert_check", b"router.softmax_topk.forward", *args, ctypes.byref(verdict))
    g = torch.zeros(3, 32, H, dtype=torch.bfloat16)
    d = torch.zeros(3 * 32 * H // 64, 64, dtype=torch.bfloat16)  # H = 85.3 for w_down: no I fits both
    out = ctypes.c_void_p()
    with pytest.raises(moecert.InvalidArgument, match="expected \\[E\\*I x H\\] twice and \\[E\\*H x I\\]"):
        _abi.call("moecert_experts_pack", 3, ctypes.byref(describe(g)), ctypes.byref(describe(g)),
                  ctypes.byref(describe(d)), 1, ctypes.byref(out))


def test_lora_factors_in_one_dtype_and_the_backward_on_the_forwards(case):
    packed, lora, x, ids, weights = case
    mixed = ops.Lora(lora.a_gate.float(), *lora.factors()[1:], alpha=8.0)
    with pytest.raises(moecert.InvalidArgument, match="lora.b_gate: dtype bfloat16, lora.a_gate's is float32"):
        ops.experts_forward_train(packed, x, ids, weights, mixed)
    fp32 = ops.Lora(*(f.float() for f in lora.factors()), alpha=8.0)
    _, saved = ops.experts_forward_train(packed, x, ids, weights, fp32)
    saved.lora = ops.Lora(*(f.clone() for f in fp32.factors()), alpha=8.0)  # equal values, other tensors
    with pytest.raises(moecert.InvalidArgument, match="fp32 factors other than the forward's"):
        ops.experts_backward(saved, torch.zeros(T, H))


@pytest.mark.parametrize("level", ["off", "check", "audit", "full"])
def test_zero_tokens_end_to_end(level):
    """T = 0: forward and backward of every op and the layer (each router) at every level give
    empty outputs and gradients of the right shapes (an empty gradient's strides are torch's to
    choose, e.g. 0 for an expanded one)."""
    with moecert.contracts(level):
        for router, experts in (("softmax_topk", 8), ("sigmoid_topk", 8), ("product_key", 16)):
            layer = mt.MoELayer(experts, H, I, K, rank=RANK, router=router, max_tokens=T)
            x = torch.randn(0, H).requires_grad_()
            y = layer(x)
            assert y.shape == (0, H)
            y.sum().backward()
            assert x.grad.shape == (0, H) and layer.a_up.grad is not None and not layer.a_up.grad.any()
            with torch.no_grad():
                assert layer(torch.randn(0, H)).shape == (0, H)
        w = [torch.randn(8, I, H).bfloat16(), torch.randn(8, I, H).bfloat16(), torch.randn(8, H, I).bfloat16()]
        xb, wt = torch.randn(0, H).bfloat16().requires_grad_(), torch.rand(0, K).requires_grad_()
        mt.experts(xb, torch.zeros(0, K, dtype=torch.int32), wt, ops.PackedExperts(*w)).sum().backward()
        assert xb.grad.shape == (0, H) and wt.grad.shape == (0, K)
        z = torch.randn(0, 8).requires_grad_()
        for idx, wr in (mt.softmax_topk(z, K), mt.sigmoid_topk(z, torch.zeros(8), K)):
            assert idx.shape == (0, K)
            wr.sum().backward()
        sx, sy = torch.randn(0, 4).requires_grad_(), torch.randn(0, 4).requires_grad_()
        mt.product_key(sx, sy, K)[1].sum().backward()
        assert z.grad.shape == (0, 8) and sx.grad.shape == (0, 4)
