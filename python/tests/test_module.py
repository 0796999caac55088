"""MoELayer as a torch module: no documented way of changing a base weight leaves the packed
weights stale (the next forward uses the new values, bitwise those of the ops on a fresh pack,
or raises naming the weight); state_dict, deepcopy, pickle and torch.save round trips; dtype
conversions; observe semantics; the input range."""
import copy
import io
import pickle

import pytest
import torch

import moecert
import moecert.torch as mt
from moecert.torch import ops

E, H, I, K, RANK, T = 8, 32, 24, 2, 4, 10


def make(train_base=False, **kw):
    torch.manual_seed(3)
    layer = mt.MoELayer(E, H, I, K, rank=RANK, alpha=8.0, max_tokens=T, train_base=train_base, **kw)
    with torch.no_grad():
        for n in ("b_gate", "b_up", "b_down"):  # B = 0 at init; nonzero so every LoRA path counts
            getattr(layer, n).normal_(0, 0.3)
    return layer


def x_of(seed=5):
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed)).bfloat16()


def base_values(layer):
    """The base weights the layer holds, as plain bf16 tensors."""
    return [getattr(layer, n).detach().to(torch.bfloat16).clone().as_subclass(torch.Tensor)
            for n in ops.BASE_NAMES]


def expected(layer, x, base):
    """y [T, H] fp32 of the ops on a fresh pack of `base` and the layer's router and LoRA."""
    packed = ops.PackedExperts(*(b.to(torch.bfloat16).contiguous() for b in base))
    p = {n: getattr(layer, n).detach().float() for n in ("router_w", "router_b") + ops.LORA_NAMES}
    lora = ops.Lora(*(p[n] for n in ops.LORA_NAMES), alpha=layer.config.lora_alpha)
    y, _ = ops.layer_forward(layer.config, packed, p["router_w"], p["router_b"], x, None, lora, training=False)
    return y


def new_weights(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(E, I, H, generator=g), torch.randn(E, I, H, generator=g), torch.randn(E, H, I, generator=g)]


IN_PLACE = {
    "data.mul_": lambda l: l.w_gate.data.mul_(2),
    "data.copy_": lambda l: l.w_gate.data.copy_(torch.zeros(E, I, H)),
    "data =": lambda l: setattr(l.w_gate, "data", torch.zeros(E, I, H, dtype=torch.bfloat16)),
    "mul_ under no_grad": lambda l: _no_grad(lambda: l.w_gate.mul_(2)),
    "copy_": lambda l: l.w_gate.copy_(torch.zeros(E, I, H)),
    "nn.init.normal_": lambda l: torch.nn.init.normal_(l.w_gate),
    "setitem": lambda l: l.w_gate.__setitem__(0, 0.0),
    "a view's add_": lambda l: l.w_gate[1].add_(1),
    "detach().mul_": lambda l: l.w_gate.detach().mul_(2),
    "requires_grad_": lambda l: l.w_gate.requires_grad_(),
}


def _no_grad(fn):
    with torch.no_grad():
        fn()


@pytest.mark.parametrize("path", list(IN_PLACE))
def test_frozen_base_weights_refuse_in_place_changes(path):
    """Frozen base weights live only in the pack: layer.w_gate is a read-only copy, and every
    in-place change of it raises naming the weight and the fix, after which the layer computes
    as before."""
    layer = make()
    x = x_of()
    y0 = layer(x)
    with pytest.raises(moecert.InvalidArgument, match=r"w_gate: a read-only copy .* assign layer.w_gate = tensor"):
        IN_PLACE[path](layer)
    assert torch.equal(layer(x), y0)
    assert "w_gate" not in dict(layer.named_parameters())


def test_frozen_base_weights_set_by_assignment_set_base_weights_and_load_state_dict():
    layer = make(out_dtype=torch.float32)
    x = x_of()
    layer(x).sum().backward()
    w = new_weights(1)
    layer.w_gate = w[0]  # fp32: rounded to bf16 on the way in
    assert torch.equal(layer(x), expected(layer, x, [w[0]] + base_values(layer)[1:]))
    assert torch.equal(layer.w_gate, w[0].bfloat16())
    layer.set_base_weights(w_up=w[1], w_down=w[2])
    assert torch.equal(layer(x), expected(layer, x, w))
    other = new_weights(2)
    sd = layer.state_dict()
    sd.update({n: t.bfloat16() for n, t in zip(ops.BASE_NAMES, other)})
    layer.load_state_dict(sd)  # after forwards: no repack() needed
    assert torch.equal(layer(x), expected(layer, x, other))
    with pytest.raises(RuntimeError, match="size mismatch for w_down"):
        layer.load_state_dict(dict(sd, w_down=torch.zeros(E, I, H)))
    missing = {k: v for k, v in sd.items() if k != "w_up"}
    with pytest.raises(RuntimeError, match="Missing key.*w_up"):
        layer.load_state_dict(missing)
    result = layer.load_state_dict(missing, strict=False)
    assert result.missing_keys == ["w_up"] and not result.unexpected_keys
    assert torch.equal(layer(x), expected(layer, x, other))
    with pytest.raises(moecert.InvalidArgument, match="size mismatch for w_gate"):
        layer.w_gate = torch.zeros(E, H, I)


def _sgd_step(layer):
    layer(x_of(7)).float().pow(2).sum().backward()
    torch.optim.SGD([p for p in layer.parameters() if p.requires_grad], lr=0.01).step()


TRAINED = {
    "data.mul_": lambda l: l.w_gate.data.mul_(2),
    "data.copy_": lambda l: l.w_up.data.copy_(new_weights(4)[1]),
    "data =": lambda l: setattr(l.w_down, "data", new_weights(4)[2].bfloat16()),
    "mul_ under no_grad": lambda l: _no_grad(lambda: l.w_gate.mul_(2)),
    "optimizer step": _sgd_step,
    "load_state_dict": lambda l: l.load_state_dict(dict(l.state_dict(), w_gate=new_weights(5)[0].bfloat16())),
    "assignment": lambda l: setattr(l, "w_gate", torch.nn.Parameter(new_weights(6)[0].bfloat16())),
    "float()": lambda l: l.float(),
    "vector_to_parameters": lambda l: torch.nn.utils.vector_to_parameters(
        torch.nn.utils.parameters_to_vector(l.parameters()) * 1.5, l.parameters()),
}


@pytest.mark.parametrize("path", list(TRAINED))
def test_trained_base_weights_reach_the_next_forward(path):
    """With train_base the base weights are parameters, packed again at every forward: whatever
    changed them, the next forward equals the ops on a fresh pack of their current values."""
    layer = make(train_base=True, out_dtype=torch.float32)
    x = x_of()
    y0 = layer(x).detach()
    TRAINED[path](layer)
    y = layer(x).detach()
    assert not torch.equal(y, y0) or path == "float()"
    assert torch.equal(y, expected(layer, x, base_values(layer)))
    y.sum()  # and a training step runs on
    layer(x).sum().backward()
    assert layer.w_gate.grad is not None and layer.w_gate.grad.dtype == layer.w_gate.dtype


@pytest.mark.parametrize("train_base", [False, True])
@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copies_compute_bitwise_the_same_before_and_after_a_forward(how, train_base):
    layer = make(train_base)
    x, dy = x_of(), torch.randn(T, H).bfloat16()

    def clone(m):
        if how == "deepcopy":
            return copy.deepcopy(m)
        if how == "pickle":
            return pickle.loads(pickle.dumps(m))
        buf = io.BytesIO()
        torch.save(m, buf)
        buf.seek(0)
        try:
            return torch.load(buf, weights_only=False)
        except TypeError:  # torch before weights_only
            return torch.load(buf)

    before = clone(layer)
    y = layer(x)
    y.backward(dy)
    after = clone(layer)
    for c in (before, after):
        xc = x.clone().requires_grad_()
        yc = c(xc)
        assert torch.equal(yc, y.detach())
        yc.backward(dy)
        assert torch.equal(c.a_up.grad if c is before else c.a_up.grad - layer.a_up.grad, layer.a_up.grad
                           if c is before else torch.zeros_like(layer.a_up.grad))
        for n in ops.BASE_NAMES:
            assert torch.equal(getattr(c, n), getattr(layer, n))
    after.w_gate = torch.zeros(E, I, H) if not train_base else torch.nn.Parameter(torch.zeros(E, I, H).bfloat16())
    assert torch.equal(layer(x), y.detach())  # the copy is its own


def test_state_dict_holds_plain_tensors_in_one_layout_for_both_modes():
    frozen, trained = make(), make(train_base=True)
    sd = frozen.state_dict()
    assert sd.keys() == trained.state_dict().keys()
    for n, shape in zip(ops.BASE_NAMES, ((E, I, H), (E, I, H), (E, H, I))):
        assert type(sd[n]) is torch.Tensor and sd[n].dtype == torch.bfloat16 and tuple(sd[n].shape) == shape
    trained.load_state_dict(sd)
    x = x_of()
    assert torch.equal(trained(x), frozen(x))
    fresh = mt.MoELayer(E, H, I, K, rank=RANK, alpha=8.0, max_tokens=T)
    fresh.load_state_dict(trained.state_dict())
    assert torch.equal(fresh(x), frozen(x))


def test_model_to_bfloat16_then_a_training_step():
    """What a bf16 fine-tuning script does: model.to(torch.bfloat16), bf16 x, AdamW. The layer
    reads its bf16 parameters as fp32 (LoRA factors as bf16), so y equals an fp32 copy's
    rounded; the gradients reach the parameters in bf16."""
    torch.manual_seed(4)
    pair = torch.nn.Sequential(make(), make()).to(torch.bfloat16)
    x = x_of()
    assert torch.equal(pair(x), copy.deepcopy(pair).float()(x.float()).bfloat16())
    model = torch.nn.Sequential(make(), torch.nn.Linear(H, H), make())
    model.to(torch.bfloat16)
    y = model(x)
    assert y.dtype == torch.bfloat16
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    y.float().pow(2).mean().backward()
    for p in model.parameters():
        assert p.grad is not None and p.grad.dtype == torch.bfloat16 and torch.isfinite(p.grad).all()
    before = model[0].router_w.detach().clone()
    opt.step()
    assert not torch.equal(model[0].router_w, before)
    assert torch.isfinite(model(x)).all()
    for conv in (torch.nn.Module.double, torch.nn.Module.half):
        m = conv(copy.deepcopy(pair))
        assert torch.isfinite(m(x.to(m[0].router_w.dtype))).all()


def test_stacked_layers_train():
    torch.manual_seed(2)
    model = torch.nn.Sequential(make(), make())
    x, target = torch.randn(T, H), torch.randn(T, H)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    losses = []
    for _ in range(4):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses


def test_x_dtypes_and_y_dtype():
    """x of any float dtype is rounded to bf16 on entry; y is in x's dtype (or out_dtype); dx in
    x's dtype, the fp32 gradient (not rounded through bf16)."""
    layer, fp32_out = make(), make(out_dtype=torch.float32)
    xb = x_of()
    x32 = xb.float().requires_grad_()
    y32 = layer(x32)
    assert y32.dtype == torch.float32 and torch.equal(y32, fp32_out(xb))
    dy = torch.randn(T, H)
    y32.backward(dy)
    p = {n: getattr(fp32_out, n).detach() for n in ("router_w", "router_b") + ops.LORA_NAMES}
    _, saved = ops.layer_forward(fp32_out.config, fp32_out._packed, p["router_w"], p["router_b"], xb, None,
                                 ops.Lora(*(p[n] for n in ops.LORA_NAMES), alpha=fp32_out.config.lora_alpha))
    dx = ops.layer_backward(saved, dy, {"dx"}, dx_dtype=torch.float32)["dx"]
    assert x32.grad.dtype == torch.float32 and torch.equal(x32.grad, dx)
    assert layer(xb).dtype == torch.bfloat16 and torch.equal(layer(xb), fp32_out(xb).bfloat16())
    x64 = xb.double().reshape(2, T // 2, H)
    assert layer(x64).dtype == torch.float64 and layer(x64).shape == (2, T // 2, H)
    with pytest.raises(moecert.InvalidArgument, match="out_dtype"):
        mt.MoELayer(E, H, I, K, out_dtype=torch.int32)


def test_moving_off_the_cpu_is_refused():
    layer = make()
    with pytest.raises(moecert.InvalidArgument, match="runs on the CPU only"):
        layer.to("meta")
    with pytest.raises(moecert.InvalidArgument, match="runs on the CPU only"):
        layer.to(torch.device("cuda"))
    assert torch.isfinite(layer(x_of())).all()


def test_observe_gives_nan_outputs_and_no_backward(capfd):
    layer = make()
    x = x_of().requires_grad_()
    bad = x.detach().clone()
    bad[3, 5] = float("nan")
    bad.requires_grad_()
    with moecert.contracts("check", "observe"):
        y = layer(bad)
        assert torch.isnan(y).all()
        with pytest.raises(moecert.InvalidArgument, match="failed layer.forward.x_finite under observe"):
            y.sum().backward()
        with torch.no_grad():
            assert torch.isnan(layer(bad)).all()
        good = layer(x)
        assert torch.isfinite(good).all()
        good.sum().backward()
        assert torch.isfinite(x.grad).all()
        z = torch.randn(T, E)
        z[2, 1] = float("nan")
        idx, w = mt.softmax_topk(z, K)
        assert (idx == -1).all() and torch.isnan(w).all()
    assert "layer.forward.x_finite" in capfd.readouterr().err


@pytest.mark.parametrize("where", ["x", "lora"])
def test_tiny_and_huge_finite_inputs(where):
    """At the default level (check) any finite magnitude is accepted; at audit, where the bounds
    are used, values outside 0 or [2^-60, 2^60] are refused as x_range / lora_range."""
    layer = make(out_dtype=torch.float32)
    x = x_of()
    for value in (2.0 ** -100, 2.0 ** 62):
        xv = x.clone()
        if where == "x":
            xv[2, 3] = value
        else:
            layer.a_up.data[1, 2, 3] = value
        with moecert.contracts("check"):
            y = layer(xv)
            assert torch.isfinite(y).all()
            y.sum().backward()
        with moecert.contracts("audit"), pytest.raises(moecert.ContractViolation) as err:
            layer(xv)
        assert err.value.clause == "layer.forward.{}_range".format(where)
        layer.a_up.data[1, 2, 3] = 0.25


def test_expert_ids_and_routing_weights_dtypes():
    w = [t.bfloat16() for t in new_weights(8)]
    packed = ops.PackedExperts(*w)
    x = x_of()
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    weights = torch.rand(T, K)
    y = mt.experts(x, ids.int(), weights, packed)
    assert torch.equal(mt.experts(x, ids, weights, packed), y)  # int64 ids
    wb = weights.bfloat16().requires_grad_()
    yb = mt.experts(x, ids, wb, packed)  # bf16 routing weights, widened exactly
    assert torch.equal(yb, mt.experts(x, ids, wb.detach().float(), packed))
    yb.sum().backward()
    assert wb.grad.dtype == torch.bfloat16
    bad = ids.clone()
    bad[4, 1] = -5
    with pytest.raises(moecert.ContractViolation) as err:
        mt.experts(x, bad, weights, packed)
    assert err.value.clause == "experts.forward_train.idx_in_range" and "idx=-5" in err.value.observed
    bad[4, 1] = 2 ** 40
    with pytest.raises(moecert.InvalidArgument, match=r"expert_ids\[4, 1\] = 1099511627776"):
        mt.experts(x, bad, weights, packed)


def test_packed_experts_copy_and_unpack_bitwise():
    w = [t.bfloat16() for t in new_weights(9)]
    packed = ops.PackedExperts(*w)
    assert all(torch.equal(a, b) for a, b in zip(packed.unpack(), w))
    for c in (copy.deepcopy(packed), pickle.loads(pickle.dumps(packed))):
        assert all(torch.equal(a, b) for a, b in zip(c.unpack(), w))
        ids = torch.zeros(T, 1, dtype=torch.int32)
        assert torch.equal(mt.experts(x_of(), ids, torch.ones(T, 1), c), mt.experts(x_of(), ids, torch.ones(T, 1),
                                                                                       packed))


def test_jit_trace_is_refused_with_a_message():
    with pytest.raises(moecert.InvalidArgument, match="torch.jit.trace cannot record moecert's ops"):
        torch.jit.trace(make(), x_of())


def test_docstrings_read_like_torch_modules():
    text = mt.MoELayer.__doc__
    for word in ("Args:", "train_base", "out_dtype", "state_dict", "observe", "InvalidArgument"):
        assert word in text, word
    for fn in (mt.MoELayer.__init__, mt.MoELayer.forward, mt.MoELayer.set_base_weights, ops.PackedExperts,
               mt.PackedExperts.unpack, mt.experts):
        assert fn.__doc__ and len(fn.__doc__) > 40, fn


def test_a_pickled_layer_runs_where_no_key_was_formed():
    """A MoELayer unpickled in another process (simulated: the key registry emptied) names its
    config and pack by keys formed there, not the pickling process's."""
    from moecert.torch import keys
    layer = make(False)
    x = x_of()
    y = layer(x)
    data = pickle.dumps(layer)
    saved = dict(keys._configs), dict(keys._config_keys)
    keys._configs.clear(), keys._config_keys.clear()
    try:
        other = pickle.loads(data)
        assert torch.equal(other(x), y)
    finally:
        keys._configs.update(saved[0]), keys._config_keys.update(saved[1])
