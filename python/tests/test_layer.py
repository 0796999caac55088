"""The MoE layer (router linear + router + experts with LoRA) against float64
PyTorch autograd, within moecert's bounds (conditioned on the routing the
kernel chose, which must equal the float64 selection), for the three routers;
and a two-step LoRA training loop through MoELayer against the float64 loop."""
import pytest
import torch

import moecert
import moecert.torch as mt
from moecert.torch import ops

import reference as R
from conftest import ISAS, within

H, I, K, RANK, T = 32, 48, 2, 4, 7
WANT = ("dx", "router_w", "router_b") + ops.LORA_NAMES + ("m_a", "m_g")


def config(router):
    if router == "product_key":
        return ops.LayerConfig(9, H, I, K, RANK, 8.0, router, max_tokens=T)
    if router == "sigmoid_topk":
        return ops.LayerConfig(8, H, I, K, RANK, 8.0, router, groups=4, topk_group=2, scaling=1.5, max_tokens=T)
    return ops.LayerConfig(8, H, I, K, RANK, 8.0, router, max_tokens=T)


def weights_of(cfg, z, idx):
    if cfg.router == "softmax_topk":
        return R.softmax_topk_weights(z, idx, cfg.renormalize)
    if cfg.router == "sigmoid_topk":
        return R.sigmoid_topk_weights(z, idx, cfg.scaling)
    n = cfg.router_outputs() // 2
    return R.product_key_weights(z[:, :n], z[:, n:], idx, "softmax")


def select(cfg, z, bias):
    if cfg.router == "softmax_topk":
        return R.softmax_topk_select(z, cfg.topk)
    if cfg.router == "sigmoid_topk":
        return R.sigmoid_topk_select(z, bias, cfg.topk, cfg.groups, cfg.topk_group)
    n = cfg.router_outputs() // 2
    return R.product_key_select(z[:, :n], z[:, n:], cfg.topk)


def layer64(cfg, params, x, dy, idx):
    """y and the gradients of <dy, y> in float64, routed by idx (the selection, checked apart)."""
    p = {k: R.f64(v) for k, v in params.items()}
    x64 = R.f64(x)
    z = x64 @ p["router_w"].T + p["router_b"]
    w = weights_of(cfg, z, idx)
    y, _ = R.experts(x64, idx, w, p, R.scale_of(cfg.lora_alpha, cfg.lora_rank))
    names = ("router_w", "router_b") + ops.LORA_NAMES
    gs = torch.autograd.grad((dy.double() * y).sum(), [x64] + [p[n] for n in names])
    return y, z.detach(), dict(zip(("dx",) + names, gs)), p


def random_params(cfg, g):
    E, R_ = cfg.experts, cfg.router_outputs()
    n = lambda *s, sd=1.0: torch.randn(*s, generator=g) * sd
    p = {"w_gate": n(E, I, H, sd=H ** -0.5).bfloat16(), "w_up": n(E, I, H, sd=H ** -0.5).bfloat16(),
         "w_down": n(E, H, I, sd=I ** -0.5).bfloat16(), "router_w": n(R_, H, sd=H ** -0.5), "router_b": n(R_, sd=0.1)}
    shapes = ops._lora_shapes(E, H, I, RANK)
    p.update({k: n(*shapes[k], sd=0.3).bfloat16() for k in ops.LORA_NAMES})
    return p


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("router", ["softmax_topk", "sigmoid_topk", "product_key"])
def test_layer_within_bounds(isa, router, rng):
    cfg = config(router)
    p = random_params(cfg, rng)
    bias = torch.randn(cfg.experts, generator=rng) * 0.05 if router == "sigmoid_topk" else None
    x, dy = torch.randn(T, H, generator=rng).bfloat16(), torch.randn(T, H, generator=rng)
    packed = ops.PackedExperts(p["w_gate"], p["w_up"], p["w_down"])
    lora = ops.Lora(*(p[k] for k in ops.LORA_NAMES), alpha=cfg.lora_alpha)
    y, saved = ops.layer_forward(cfg, packed, p["router_w"], p["router_b"], x, bias, lora, isa=isa)
    got = ops.layer_backward(saved, dy, WANT)
    bounds = ops.layer_bounds(saved, dy, WANT)
    idx, _ = ops.layer_routing(saved)
    y64, z64, g64, p64 = layer64(cfg, p, x, dy, idx)
    assert torch.equal(idx, select(cfg, z64, bias))
    within("y", y, y64, bounds["y"])
    for name in ("dx", "router_w", "router_b") + ops.LORA_NAMES:
        within(name, got[name], g64[name], bounds[name])
    s = R.scale_of(cfg.lora_alpha, cfg.lora_rank)
    w64 = weights_of(cfg, z64, idx).detach()
    m_a, m_g = R.stats(R.f64(x), idx, w64, p64, s, dy.double(), ops.LORA_NAMES)
    within("m_a", got["m_a"], m_a, bounds["m_a"])
    within("m_g", got["m_g"], m_g, bounds["m_g"])


@pytest.mark.parametrize("isa", ISAS)
def test_moelayer_two_lora_steps_match_the_float64_loop(isa, rng):
    """forward, backward, SGD step on the LoRA and router parameters, forward again: each step's
    outputs within their bounds of float64 on the same parameters, and each update within lr times
    the gradient's bound (plus the two fp32 roundings of p - lr g) of the float64 update."""
    torch.manual_seed(7)
    layer = mt.MoELayer(8, H, I, K, rank=RANK, alpha=8.0, max_tokens=T, isa=isa, out_dtype=torch.float32)
    with torch.no_grad():
        for k in ("b_gate", "b_up", "b_down"):  # B = 0 at init; nonzero to exercise every LoRA path
            getattr(layer, k).normal_(0, 0.3)
    trainable = ("router_w", "router_b") + ops.LORA_NAMES
    opt = torch.optim.SGD([getattr(layer, k) for k in trainable], lr=0.05)
    x = torch.randn(T, H, generator=rng).bfloat16()
    for step in range(2):
        dy = torch.randn(T, H, generator=rng)
        before = {k: getattr(layer, k).detach().clone() for k in trainable}
        params = {k: getattr(layer, k).detach() for k in ops.BASE_NAMES + trainable}
        kernel = dict(params, **{k: params[k].bfloat16() for k in ops.LORA_NAMES})  # what the kernel reads
        opt.zero_grad()
        y = layer(x)
        y.backward(dy)
        # The bounds of this step, from the ops on the same inputs (the module's own saved state is
        # inside autograd).
        lora = ops.Lora(*(params[k] for k in ops.LORA_NAMES), alpha=8.0)
        y_ops, saved = ops.layer_forward(layer.config, layer._packed, params["router_w"], params["router_b"], x,
                                         None, lora, isa=isa)
        assert torch.equal(y.detach(), y_ops)
        ops.layer_backward(saved, dy, WANT)
        bounds = ops.layer_bounds(saved, dy, WANT)
        idx, _ = ops.layer_routing(saved)
        y64, _, g64, _ = layer64(layer.config, kernel, x, dy, idx)
        within("step {} y".format(step), y, y64, bounds["y"])
        opt.step()
        for k in trainable:
            after = getattr(layer, k).detach()
            update64 = before[k].double() - 0.05 * g64[k]
            step_g = 0.05 * getattr(layer, k).grad.double().abs()  # p + (-lr g): two fp32 roundings
            tol = 0.05 * bounds[k] + 2.0 ** -24 * (after.double().abs() + step_g)
            within("step {} {} after the update".format(step, k), after, update64, tol)


def test_saved_states_are_reused_across_steps_and_a_stale_graph_is_refused(rng):
    layer = mt.MoELayer(8, H, I, K, rank=RANK, alpha=8.0, max_tokens=T)
    x = torch.randn(T, H, generator=rng).bfloat16()
    dy = torch.randn(T, H, generator=rng)
    y = layer(x)
    y.backward(dy, retain_graph=True)
    first = layer.router_w.grad.clone()
    layer.router_w.grad = None
    y.backward(dy, retain_graph=True)  # no forward in between: the state is as the forward left it
    assert torch.equal(layer.router_w.grad, first)
    pool = layer._packed.layer_pool
    assert len(pool._idle) == 1
    layer(x).backward(dy)  # takes the idle state, gives it back
    assert len(pool._idle) == 1
    with pytest.raises(moecert.InvalidArgument, match="a second backward through one graph is not supported"):
        y.backward(dy)


@pytest.mark.parametrize("frozen", ["nothing", "router and x", "lora", "base trained"])
def test_moelayer_gradients_follow_what_requires_them(frozen, rng):
    """A MoELayer step gives the gradients of exactly the tensors that require one, equal to the
    ops' backward asked for those (bitwise), at two token counts, with the per-token statistics
    of a stats recorder."""
    torch.manual_seed(11)
    layer = mt.MoELayer(8, H, I, K, rank=RANK, alpha=8.0, max_tokens=T, train_base=frozen == "base trained",
                        out_dtype=torch.float32)
    with torch.no_grad():
        for k in ("b_gate", "b_up", "b_down"):
            getattr(layer, k).normal_(0, 0.3)
    frozen_names = {"router and x": ("router_w", "router_b"), "lora": ops.LORA_NAMES}.get(frozen, ())
    for k in frozen_names:
        getattr(layer, k).requires_grad_(False)
    named = ["router_w", "router_b"] + list(ops.LORA_NAMES) + (list(ops.BASE_NAMES) if layer.train_base else [])
    for tokens in (T, 3, T):
        x = torch.randn(tokens, H, generator=rng).bfloat16().requires_grad_(frozen != "router and x")
        dy = torch.randn(tokens, H, generator=rng)
        for k in named:
            getattr(layer, k).grad = None
        st = mt.stats()
        layer(x, stats=st).backward(dy)
        wanted = {k for k in named if getattr(layer, k).requires_grad} | ({"dx"} if x.requires_grad else set())
        p = {k: getattr(layer, k).detach() for k in named}
        _, saved = ops.layer_forward(layer.config, layer._packed, p["router_w"], p["router_b"], x.detach(), None,
                                     ops.Lora(*(p[k] for k in ops.LORA_NAMES), alpha=8.0))
        g = ops.layer_backward(saved, dy, wanted | {"m_a", "m_g"}, dx_dtype=torch.bfloat16)
        for k in named:
            got = getattr(layer, k).grad
            assert (got is None) == (k not in wanted), k
            assert got is None or torch.equal(got, g[k].to(got.dtype)), k  # autograd casts to the dtype
        assert (x.grad is None) == ("dx" not in wanted)
        assert x.grad is None or torch.equal(x.grad, g["dx"])
        assert torch.equal(st.m_a, g["m_a"]) and torch.equal(st.m_g, g["m_g"])


@pytest.mark.parametrize("op", ["layer", "experts"])
def test_gradients_under_create_graph_refuse_a_second_backward(op, rng):
    """create_graph=True gives the same first-order gradients, and differentiating them again
    raises (once_differentiable) instead of silently missing this op's second derivative."""
    layer = mt.MoELayer(8, H, I, K, rank=RANK, alpha=8.0, max_tokens=T)
    x = torch.randn(T, H, generator=rng).bfloat16().requires_grad_()
    dy = torch.randn(T, H, generator=rng)
    layer(x.detach())  # packs
    if op == "layer":
        run = lambda: layer(x)
    else:
        ids = torch.stack([torch.randperm(8, generator=rng)[:K] for _ in range(T)]).int()
        w = torch.rand(T, K, generator=rng)
        run = lambda: mt.experts(x, ids, w, layer._packed, layer.lora())
    (plain,) = torch.autograd.grad(run(), x, dy)
    (graphed,) = torch.autograd.grad(run(), x, dy.requires_grad_(), create_graph=True)
    assert torch.equal(plain, graphed)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        graphed.float().sum().backward()


def test_moelayer_two_forwards_before_one_backward(rng):
    """Two micro-batches (different token counts) through one graph: each forward keeps its own
    state, and the accumulated gradients are the sums of the two steps' (bitwise)."""
    layer = mt.MoELayer(8, H, I, K, rank=RANK, alpha=8.0, max_tokens=T)
    with torch.no_grad():
        for k in ("b_gate", "b_up", "b_down"):
            getattr(layer, k).normal_(0, 0.3)
    named = ("router_w", "router_b") + ops.LORA_NAMES
    xs = [torch.randn(n, H, generator=rng).bfloat16() for n in (T, 4)]
    dys = [torch.randn(n, H, generator=rng) for n in (T, 4)]
    alone = []
    for x, dy in zip(xs, dys):
        layer.zero_grad(set_to_none=True)
        layer(x).backward(dy)
        alone.append({k: getattr(layer, k).grad.clone() for k in named})
    layer.zero_grad(set_to_none=True)
    ys = [layer(x) for x in xs]
    sum((y * dy).sum() for y, dy in zip(ys, dys)).backward()
    for k in named:
        assert torch.equal(getattr(layer, k).grad, alone[0][k] + alone[1][k]), k
