"""The experts op with the caller's routing against float64 PyTorch autograd,
within moecert's derived bounds, on every usable kernel and routing class."""
import gc
import weakref

import pytest
import torch

import moecert
import moecert.torch as mt
from moecert.torch import keys, ops

import reference as R
from conftest import ISAS, within

E, H, I, K, RANK, T = 4, 32, 48, 2, 4, 7
ALL = ("dx", "dweights") + ops.LORA_NAMES + ops.BASE_NAMES + ("m_a", "m_g")


def routing(kind, g):
    """expert ids and weights of one data class: normal, tails (-1 slots), one_expert, idle."""
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    if kind == "one_expert":
        ids[:, 0] = 0
        ids[:, 1] = 1 + torch.randint(0, E - 1, (T,), generator=g).to(torch.int32)
    elif kind == "idle":
        ids = torch.tensor([[0, 1] if t % 2 else [1, 0] for t in range(T)], dtype=torch.int32)
    w = torch.rand(T, K, generator=g)
    if kind == "tails":
        ids[1, 1] = ids[4, 1] = -1
        ids[5, :] = -1
        w[ids < 0] = 0
    return ids, w


def problem(g, lora=True):
    n = lambda *s, sd=1.0: torch.randn(*s, generator=g) * sd
    base = {"w_gate": n(E, I, H, sd=H ** -0.5).bfloat16(), "w_up": n(E, I, H, sd=H ** -0.5).bfloat16(),
            "w_down": n(E, H, I, sd=I ** -0.5).bfloat16()}
    factors = None
    if lora:
        shapes = ops._lora_shapes(E, H, I, RANK)
        factors = ops.Lora(*(n(*shapes[k], sd=0.3) for k in ops.LORA_NAMES), alpha=8.0)
    return base, factors, n(T, H).bfloat16(), n(T, H)


def reference(base, lora, x, ids, w, dy):
    """y and every gradient in float64; the LoRA factors as the kernel reads them (bf16)."""
    p = {k: R.f64(v) for k, v in base.items()}
    if lora is not None:
        p.update({k: R.f64(getattr(lora, k).bfloat16()) for k in ops.LORA_NAMES})
    s = R.scale_of(lora.alpha, lora.rank) if lora is not None else 0.0
    x64, w64 = R.f64(x), R.f64(w)
    y, _ = R.experts(x64, ids, w64, p, s)
    names = ops.BASE_NAMES + (ops.LORA_NAMES if lora is not None else ())
    gs = torch.autograd.grad((dy.double() * y).sum(), [x64, w64] + [p[k] for k in names], allow_unused=True)
    out = {"y": y, "dx": gs[0], "dweights": gs[1]}
    out.update({k: (g if g is not None else torch.zeros_like(p[k])) for k, g in zip(names, gs[2:])})
    trainable = ops.LORA_NAMES if lora is not None else ops.BASE_NAMES
    out["m_a"], out["m_g"] = R.stats(x64, ids, w64, p, s, dy.double(), trainable)
    return out


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", ["normal", "tails", "one_expert", "idle"])
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "base"])
def test_forward_backward_within_bounds(isa, kind, lora, rng):
    base, factors, x, dy = problem(rng, lora)
    ids, w = routing(kind, rng)
    packed = ops.PackedExperts(base["w_gate"], base["w_up"], base["w_down"])
    want = ALL if lora else tuple(n for n in ALL if n not in ops.LORA_NAMES)
    y, saved = ops.experts_forward_train(packed, x, ids, w, factors, isa=isa)
    got = ops.experts_backward(saved, dy, want)
    got["y"] = y
    bounds = ops.experts_bounds(saved, dy, want)
    ref = reference(base, factors, x, ids, w, dy)
    for name in ("y",) + want:
        within(name, got[name], ref[name], bounds[name])
    assert torch.all(got["dweights"][ids < 0] == 0)
    for e in range(E):
        if not (ids == e).any():  # an idle expert: gradients exactly 0
            assert all(torch.all(got[n][e] == 0) for n in want if n in ops.LORA_NAMES + ops.BASE_NAMES)


def test_autograd_function_gives_the_ops_bits(rng):
    base, factors, x, dy = problem(rng)
    ids, w = routing("tails", rng)
    packed = ops.PackedExperts(base["w_gate"], base["w_up"], base["w_down"])
    y0, saved = ops.experts_forward_train(packed, x, ids, w, factors)
    g0 = ops.experts_backward(saved, dy, ALL)

    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    lora = ops.Lora(*(getattr(factors, k).clone().requires_grad_() for k in ops.LORA_NAMES), alpha=factors.alpha)
    bs = tuple(base[k].requires_grad_() for k in ops.BASE_NAMES)
    st = mt.stats()
    y = mt.experts(xs, ids.long(), ws, None, lora, base=bs, stats=st)
    y.backward(dy)
    assert torch.equal(y, y0)
    assert torch.equal(xs.grad, g0["dx"].bfloat16())  # autograd casts dx to x's dtype
    assert torch.equal(ws.grad, g0["dweights"])
    for k in ops.LORA_NAMES:
        assert torch.equal(getattr(lora, k).grad, g0[k]), k
    for k, b in zip(ops.BASE_NAMES, bs):
        assert torch.equal(b.grad, g0[k].bfloat16()), k
    assert torch.equal(st.m_a, g0["m_a"]) and torch.equal(st.m_g, g0["m_g"])


def test_bitwise_the_same_for_any_thread_count(rng):
    base, factors, x, dy = problem(rng)
    ids, w = routing("normal", rng)
    packed = ops.PackedExperts(base["w_gate"], base["w_up"], base["w_down"])
    runs = []
    before = moecert.num_threads()
    try:
        for threads in (1, 2, 3):
            moecert.set_num_threads(threads)
            y, saved = ops.experts_forward_train(packed, x, ids, w, factors)
            runs.append([y] + list(ops.experts_backward(saved, dy, ALL).values()))
    finally:
        moecert.set_num_threads(before)
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))


def test_inference_forward_equals_the_training_forward_without_lora(rng):
    base, _, x, _ = problem(rng, lora=False)
    ids, w = routing("tails", rng)
    packed = ops.PackedExperts(base["w_gate"], base["w_up"], base["w_down"], backward=False)
    y = ops.experts_forward(packed, x, ids, w)
    bounds = None
    packed_bwd = ops.PackedExperts(base["w_gate"], base["w_up"], base["w_down"])
    y_train, saved = ops.experts_forward_train(packed_bwd, x, ids, w)
    bounds = ops.experts_bounds(saved)
    ref = reference(base, None, x, ids, w, torch.zeros(T, H))
    within("y (inference)", y, ref["y"], bounds["y"])
    within("y (training)", y_train, ref["y"], bounds["y"])


needs_library = pytest.mark.skipif(not mt.library.registered(), reason="torch.library.custom_op needs torch >= 2.4")


@needs_library
def test_registered_op_and_torch_compile_give_the_functions_bits(rng):
    base, factors, x, dy = problem(rng)
    ids, w = routing("tails", rng)
    packed = ops.PackedExperts(base["w_gate"], base["w_up"], base["w_down"])
    leaves = lambda: ([x.clone().requires_grad_(), w.clone().requires_grad_()] +
                      [getattr(factors, k).clone().requires_grad_() for k in ops.LORA_NAMES])

    def run(fn):
        xs, ws, *fs = leaves()
        y = fn(xs, ws, ops.Lora(*fs, alpha=factors.alpha))
        y.backward(dy)
        return [y.detach(), xs.grad, ws.grad] + [f.grad for f in fs]

    function = run(lambda xs, ws, lora: mt.EXPERTS.function.apply(
        xs, ids, ws, *lora.factors(), None, None, None, lora.alpha, packed.key, 0, -1, True)[0])
    mt.library.always = True
    try:
        registered = run(lambda xs, ws, l: mt.experts(xs, ids, ws, packed, l))
    finally:
        mt.library.always = False
    compiled = run(torch.compile(lambda xs, ws, l: mt.experts(xs, ids, ws, packed, l), fullgraph=True))
    for a, b, c in zip(function, registered, compiled):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("frozen", ["nothing", "x and weights", "lora", "no lora"])
def test_gradients_follow_what_requires_them(frozen, rng):
    """moecert.torch.experts gives the gradients of exactly the tensors that require one, equal to
    the ops' backward asked for those (bitwise), at two token counts, and the same y once a factor
    is another tensor of the same values."""
    base, factors, _, _ = problem(rng, lora=frozen != "no lora")
    packed = ops.PackedExperts(base["w_gate"], base["w_up"], base["w_down"])
    lora = None if factors is None else ops.Lora(
        *(getattr(factors, k).clone().requires_grad_(frozen != "lora") for k in ops.LORA_NAMES), alpha=factors.alpha)
    for tokens in (T, 3, T):
        x = torch.randn(tokens, H, generator=rng).bfloat16().requires_grad_(frozen != "x and weights")
        ids = torch.stack([torch.randperm(E, generator=rng)[:K] for _ in range(tokens)]).int()
        w = torch.rand(tokens, K, generator=rng).requires_grad_(frozen != "x and weights")
        dy = torch.randn(tokens, H, generator=rng)
        for f in (lora.factors() if lora is not None else ()):
            f.grad = None
        mt.experts(x, ids, w, packed, lora).backward(dy)
        leaves = {"dx": x, "dweights": w, **({k: getattr(lora, k) for k in ops.LORA_NAMES} if lora else {})}
        wanted = {k for k, t in leaves.items() if t.requires_grad}
        plain = None if lora is None else ops.Lora(*(f.detach() for f in lora.factors()), alpha=lora.alpha)
        _, saved = ops.experts_forward_train(packed, x.detach(), ids, w.detach(), plain)
        g = ops.experts_backward(saved, dy, wanted, dx_dtype=torch.bfloat16)
        for k, t in leaves.items():
            assert (t.grad is None) == (k not in wanted), k
            assert t.grad is None or torch.equal(t.grad, g[k]), k
    with torch.no_grad():
        y = mt.experts(x, ids, w, packed, lora)
    assert not y.requires_grad
    if lora is not None:  # another tensor for a factor: the same bits
        other = ops.Lora(*(f.detach().clone().requires_grad_(f.requires_grad) for f in lora.factors()),
                         alpha=lora.alpha)
        assert torch.equal(mt.experts(x, ids, w, packed, other), mt.experts(x, ids, w, packed, lora))


def test_a_saved_state_lives_as_long_as_its_graph(rng):
    """A training forward's saved state (its activations) is owned by the graph: dropped with a
    graph whose backward never runs (evaluation with grad mode on), back in the pool after a
    backward, and a state tensor that outlives its state names nothing."""
    base, factors, x, dy = problem(rng)
    ids, w = routing("normal", rng)
    packed = ops.PackedExperts(base["w_gate"], base["w_up"], base["w_down"])
    xs = x.clone().requires_grad_()
    y, state = mt.EXPERTS.function.apply(xs, ids, w, *(None,) * 9, 0.0, packed.key, 0, -1, True)
    saved = weakref.ref(keys.resume(state, ops.check_generation))
    del y, state
    gc.collect()
    assert saved() is None and not packed.experts_pool._idle
    mt.experts(xs, ids, w, packed).backward(dy)
    assert len(packed.experts_pool._idle) == 1
    state = keys.hold(ops.ExpertsSaved())
    copy = state.clone()  # the numbers alone, not the storage that owns the state
    del state
    gc.collect()
    with pytest.raises(moecert.InvalidArgument, match="kept no saved state"):
        keys.resume(copy, ops.check_generation)
