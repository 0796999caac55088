"""`moecert check` judges four small PyTorch router implementations (examples/judge/routers.py):
the correct ones and the one that only orders ties its own way pass (the ties named), the ones
with failure mode 1's -1 decoding and failure mode 5's missing mask fail on the clause that names
the bug. The command is the build's (MOECERT_CLI, set by ctest)."""
import functools
import json
import os
import subprocess
import sys
from xml.etree import ElementTree

import pytest
import torch

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "examples", "judge"))
import experts  # noqa: E402
import layer  # noqa: E402
import routers  # noqa: E402

CLI = os.environ.get("MOECERT_CLI")
needs_cli = pytest.mark.skipif(not CLI, reason="MOECERT_CLI (the moecert program) not set")


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    out = tmp_path_factory.mktemp("judge")
    routers.write_cases(str(out))
    return out


def check(cases, case, op, *params):
    d = cases / case
    args = [CLI, "check", op, "--inputs", str(d / "inputs.safetensors"), "--outputs",
            str(d / "outputs.safetensors"), "--out", str(d / "report")]
    for p in params:
        args += ["--param", p]
    r = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert r.returncode in (0, 1), r.stderr
    with open(d / "report" / "report.json") as f:
        report = json.load(f)
    for name in ("report.md", "report.html", "junit.xml"):
        assert (d / "report" / name).stat().st_size > 0
    suite = ElementTree.parse(d / "report" / "junit.xml").getroot()  # well-formed, one case per clause
    assert int(suite.get("failures")) == sum(c["verdict"] == "fail" for c in report["clauses"])
    assert report["verdict"] == ("pass" if r.returncode == 0 else "fail")
    return report


def failed(report):
    return [c["id"] for c in report["clauses"] if c["verdict"] == "fail"]


@needs_cli
def test_correct_product_key_forward_passes(cases):
    for declared in ((), ("sorted=true",)):  # its slots are sorted: also when it declares so
        r = check(cases, "product_key_forward", "router.product_key.forward", *declared)
        assert r["verdict"] == "pass" and r["ties"] == []
        evaluated = {c["id"] for c in r["clauses"] if c["verdict"] == "pass"}
        assert {"router.product_key.topk_property", "router.product_key.within_bound"} <= evaluated
        assert ("router.product_key.sorted" in evaluated) == bool(declared)


@needs_cli
def test_tie_order_passes_and_names_the_ties(cases):
    r = check(cases, "product_key_forward_ties", "router.product_key.forward")
    assert r["verdict"] == "pass"
    assert r["ties"], "the implementation broke exact ties towards the higher index"
    assert all(t["chosen"] > t["other"] for t in r["ties"])  # the reverse of the declared order


@needs_cli
def test_minus1_decoding_fails_on_unused_zero(cases):
    r = check(cases, "product_key_backward_minus1", "router.product_key.backward")
    assert "router.product_key_backward.unused_zero" in failed(r)
    assert check(cases, "product_key_backward", "router.product_key.backward")["verdict"] == "pass"


@needs_cli
def test_unmasked_softmax_backward_fails_on_unselected_grad(cases):
    r = check(cases, "softmax_topk_backward_unmasked", "router.softmax_topk.backward")
    assert failed(r)[0] == "router.softmax_topk_backward.unselected_grad"
    first = next(c for c in r["clauses"] if c["verdict"] == "fail")
    assert first["location"].startswith("t=") and "expert" in first["location"]
    assert check(cases, "softmax_topk_backward", "router.softmax_topk.backward")["verdict"] == "pass"
    # The same outputs judged as the non-renormalised op: the formula is right there.
    r = check(cases, "softmax_topk_backward_unmasked", "router.softmax_topk.backward",
              "renormalize=false")
    assert r["verdict"] == "pass"


@needs_cli
def test_sigmoid_router_bias_in_weights_fails_within_bound(cases):
    params = ("groups=4", "topk_group=2", "scaling=2.5")
    assert check(cases, "sigmoid_topk_forward", "router.sigmoid_topk.forward", *params)["verdict"] == "pass"
    r = check(cases, "sigmoid_topk_forward_bias_in_weights", "router.sigmoid_topk.forward", *params)
    assert "router.sigmoid_topk.within_bound" in failed(r)


@needs_cli
def test_outputs_stored_in_bf16_are_judged_with_their_rounding(tmp_path):
    sx, sy = torch.randn(4, 3), torch.randn(4, 3)
    idx, w = routers.product_key_forward(sx, sy, 2)
    routers.save(str(tmp_path / "inputs.safetensors"), sx=sx, sy=sy)
    routers.save(str(tmp_path / "outputs.safetensors"), idx=idx.int(), w=w.bfloat16())
    r = subprocess.run([CLI, "check", "router.product_key.forward", "--inputs",
                        str(tmp_path / "inputs.safetensors"), "--outputs",
                        str(tmp_path / "outputs.safetensors"), "--out", str(tmp_path / "r")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_cli
def test_a_missing_tensor_is_named(cases, tmp_path):
    routers.save(str(tmp_path / "o.safetensors"), idx=torch.zeros(2, 2, dtype=torch.int32))
    r = subprocess.run([CLI, "check", "router.product_key.forward", "--inputs",
                        str(cases / "product_key_forward" / "inputs.safetensors"), "--outputs",
                        str(tmp_path / "o.safetensors")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no tensor 'w'" in r.stderr


# ---- the same judge from Python (moecert.check, the C ABI's moecert_check): no files, no CLI ----

def _cases_in_memory():
    gen = torch.Generator().manual_seed(7)
    t, n, k = 6, 4, 3
    sx, sy = torch.randn(t, n, generator=gen), torch.randn(t, n, generator=gen)
    tx, ty = (torch.randint(0, 3, (t, n), generator=gen) / 4.0 for _ in range(2))
    g = torch.randn(t, k, generator=gen)
    bidx = torch.tensor([[5, 6, -1], [9, -1, -1], [13, 10, 5], [6, 14, -1], [10, 9, -1], [5, -1, -1]])
    z = torch.randn(t, 12, generator=gen)
    return sx, sy, tx, ty, g, bidx, z, k


def test_python_check_gives_the_same_verdicts():
    import moecert.check as check
    sx, sy, tx, ty, g, bidx, z, k = _cases_in_memory()
    assert check.product_key_forward(sx, sy, *routers.product_key_forward(sx, sy, k)).passed
    v = check.product_key_forward(tx, ty, *routers.product_key_forward_ties(tx, ty, k))
    assert v.passed and v.ties and all(t["chosen"] > t["other"] for t in v.ties)
    assert check.product_key_backward(sx, sy, bidx, g, *routers.product_key_backward(sx, sy, bidx, g)).passed
    v = check.product_key_backward(sx, sy, bidx, g, *routers.product_key_backward_minus1(sx, sy, bidx, g))
    assert not v.passed and "router.product_key_backward.unused_zero" in v.failed
    zidx, _ = routers.softmax_topk_forward(z, k)
    assert check.softmax_topk_backward(z, zidx, g, routers.softmax_topk_backward(z, zidx, g)).passed
    v = check.softmax_topk_backward(z, zidx, g, routers.softmax_topk_backward_unmasked(z, zidx, g))
    assert v.failed[0] == "router.softmax_topk_backward.unselected_grad"
    fail = next(c for c in v.clauses if c["verdict"] == "fail")
    assert fail["observed"].startswith("dz=") and fail["expected"]


def _sigmoid_case(near_ties):
    """16 tokens, 8 experts in 4 groups, 2 groups kept, K = 3; with near_ties, each group holds
    two adjacent floats and equal biases: exact scores closer than fp32 sigma resolves."""
    gen = torch.Generator().manual_seed(11)
    z = torch.randn(16, 8, generator=gen)
    bias = torch.randn(8, generator=gen) / 8
    if near_ties:
        z[:, 1::2] = torch.nextafter(z[:, 0::2], torch.full_like(z[:, 0::2], -9.0))
        bias[1::2] = bias[0::2]
    return z, bias


@pytest.mark.parametrize("near_ties", [False, True])
def test_python_check_judges_a_torch_sigmoid_router(near_ties):
    import moecert.check as check
    z, bias = _sigmoid_case(near_ties)
    idx, w = routers.sigmoid_topk_forward(z, bias, 3, groups=4, topk_group=2, scaling=2.5)
    v = check.sigmoid_topk_forward(z, bias, idx, w, groups=4, topk_group=2, scaling=2.5)
    assert v.passed, v.failed
    assert all(t["kind"] == "near" for t in v.ties)  # inputs are distinct: no exact ties
    assert bool(v.ties) == near_ties  # torch's order within a near tie, named where not the exact one
    # Exchanging every row's first and last slots puts experts out of order beyond any rounding
    # (with near ties, slots 0 and 1 hold one; slot 2 another group's best).
    swapped = idx.clone()
    swapped[:, [0, 2]] = swapped[:, [2, 0]]
    w2 = w.clone()
    w2[:, [0, 2]] = w2[:, [2, 0]]
    v = check.sigmoid_topk_forward(z, bias, swapped, w2, groups=4, topk_group=2, scaling=2.5, sorted=True)
    assert "router.sigmoid_topk.sorted" in v.failed
    v = check.sigmoid_topk_forward(z, bias, swapped, w2, groups=4, topk_group=2, scaling=2.5)
    assert v.passed, v.failed  # undeclared, the slots' order is the implementation's
    # The bias in the weights: within_bound names it.
    idx, w = routers.sigmoid_topk_forward(z, bias, 3, groups=4, topk_group=2, scaling=2.5,
                                          bias_in_weights=True)
    v = check.sigmoid_topk_forward(z, bias, idx, w, groups=4, topk_group=2, scaling=2.5)
    assert "router.sigmoid_topk.within_bound" in v.failed


@pytest.mark.parametrize("k", [1, 3, 6])
def test_a_dense_softmax_with_unsorted_topk_passes_unless_it_declares_sorted(k):
    """transformers' way (softmax over all experts, topk(sorted=False), renormalised): the
    selection is judged as a set with each id's own weight; `sorted` only when declared."""
    import moecert.check as check
    z = torch.randn(24, 12, generator=torch.Generator().manual_seed(5))
    idx, w = routers.softmax_topk_forward_dense(z, k)
    v = check.softmax_topk_forward(z, idx.int(), w)
    assert v.passed, v.failed
    assert "router.softmax_topk.sorted" not in {c["id"] for c in v.clauses if c["verdict"] in ("pass", "fail")}
    if k > 1:
        assert "router.softmax_topk.sorted" in check.softmax_topk_forward(z, idx.int(), w, sorted=True).failed
        # A weight paired with another slot's id fails the weights' bound, sorted or not.
        idx, w = routers.softmax_topk_forward_dense(z, k, unpaired=True)
        assert "router.softmax_topk.within_bound" in check.softmax_topk_forward(z, idx.int(), w).failed
    # A wrong selection still fails the top-k property in any order.
    idx, w = routers.softmax_topk_forward_dense(z, k)
    wrong = idx.clone()
    wrong[:, 0] = torch.argsort(z, dim=1)[:, 0]  # the row's lowest logit in place of its K-th
    assert "router.softmax_topk.topk_property" in check.softmax_topk_forward(z, wrong.int(), w).failed


def test_python_check_numpy_and_bf16_outputs(tmp_path):
    import moecert.check as check
    sx, sy, *_ = _cases_in_memory()
    idx, w = routers.product_key_forward(sx, sy, 2)
    assert check.product_key_forward(sx.numpy(), sy.numpy(), idx.numpy(), w.numpy()).passed
    v = check.product_key_forward(sx, sy, idx, w.bfloat16())  # judged with bf16's rounding
    assert v.passed
    v.write(str(tmp_path / "r"))
    assert json.load(open(tmp_path / "r" / "report.json"))["verdict"] == "pass"
    assert "router.product_key.topk_property" in (tmp_path / "r" / "report.md").read_text()
    # A weight moved to another slot: within_bound names it.
    w2 = w.clone()
    w2[0] = w2[0].flip(0)
    assert "router.product_key.within_bound" in check.product_key_forward(sx, sy, idx, w2).failed


def test_python_check_refuses_bad_arguments():
    import moecert
    import moecert.check as check
    sx, sy, *_ = _cases_in_memory()
    idx, w = routers.product_key_forward(sx, sy, 2)
    with pytest.raises(moecert.InvalidArgument, match="no tensor 'w'"):
        check.judge("router.product_key.forward", {"sx": sx, "sy": sy}, {"idx": idx})
    with pytest.raises(moecert.InvalidArgument, match="not an op"):
        check.judge("router.nope.forward", {"sx": sx}, {"idx": idx, "w": w})
    with pytest.raises(moecert.InvalidArgument, match="weights=cubic"):
        check.product_key_forward(sx, sy, idx, w, weights="cubic")
    with pytest.raises(moecert.InvalidArgument, match="expected integer indices"):
        check.product_key_forward(sx, sy, idx.float(), w)


# ---- the experts op: the declared precision's model (proofs/experts.md §4) ----

@pytest.mark.parametrize("with_lora", [False, True])
def test_torch_experts_judged_under_their_declared_precision(with_lora):
    import moecert.check as check
    inputs, lora = experts.random_case()
    lora, alpha = (lora, 8.0) if with_lora else (None, None)
    for dtype, precision in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        y = experts.experts_forward(**inputs, lora=lora, alpha=alpha, dtype=dtype)
        v = check.experts_forward(**inputs, y=y, precision=precision, lora=lora, alpha=alpha)
        assert v.passed, (precision, v.failed, [c.get("message") for c in v.clauses if c["verdict"] == "fail"])
        within = next(c for c in v.clauses if c["id"].endswith(".within_bound"))
        assert within["verdict"] == "pass"
    # PyTorch's bf16 rounding after every op is not an fp32 implementation's.
    y16 = experts.experts_forward(**inputs, lora=lora, alpha=alpha, dtype=torch.bfloat16)
    v = check.experts_forward(**inputs, y=y16, precision="fp32", lora=lora, alpha=alpha)
    assert [f for f in v.failed if f.endswith(".within_bound")]
    # silu on u instead of g: within_bound names it, in any declaration.
    bad = experts.experts_forward_swapped(**inputs, lora=lora, alpha=alpha, dtype=torch.float32)
    v = check.experts_forward(**inputs, y=bad, precision="bf16", lora=lora, alpha=alpha)
    assert [f for f in v.failed if f.endswith(".within_bound")]


def test_the_verdict_summarises_each_outputs_error(tmp_path):
    """Per output: ||v - ref|| / ||ref|| beside the worst-case and the probabilistic bounds' ratios.
    A correct bf16 implementation sits within them; y off by 5% shows 5%, several times the correct
    one's error (though still inside bf16's bounds at this size)."""
    import moecert.check as check
    inputs, lora = experts.random_case()
    y = experts.experts_forward(**inputs, lora=lora, alpha=8.0, dtype=torch.bfloat16)
    v = check.experts_forward(**inputs, y=y, precision="bf16", lora=lora, alpha=8.0)
    (e,) = v.errors
    assert e["output"] == "y" and 0 < e["relative_error"] <= e["relative_probable"] <= e["relative_worst"]
    off = check.experts_forward(**inputs, y=y.float() * 1.05, precision="bf16", lora=lora, alpha=8.0)
    assert off.errors[0]["relative_error"] == pytest.approx(0.05, rel=0.2)
    assert off.errors[0]["relative_error"] > 5 * e["relative_error"]
    dy = torch.randn(12, 40, generator=torch.Generator().manual_seed(4))
    dx, dw, grads = experts.experts_backward(**inputs, dy=dy, lora=lora, alpha=8.0, dtype=torch.float32,
                                             weight_grads=True)
    v = check.experts_backward(**inputs, dy=dy, precision="fp32", dx=dx, dweights=dw, lora=lora, alpha=8.0,
                               weight_grads={"b_down": grads["b_down"]})
    assert [e["output"] for e in v.errors] == ["dx", "dweights", "b_down_grad"]
    assert all(e["relative_error"] <= e["relative_worst"] for e in v.errors)
    assert check.experts_forward(**inputs, y=y, precision="bf16", lora=lora, alpha=8.0,
                                 ).errors[0]["relative_probable"] is not None
    v.write(str(tmp_path))
    assert "| b_down_grad |" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("with_lora", [False, True])
def test_torch_experts_backward_judged(with_lora):
    import moecert.check as check
    inputs, lora = experts.random_case()
    lora, alpha = (lora, 8.0) if with_lora else (None, None)
    dy = torch.randn(inputs["x"].shape, generator=torch.Generator().manual_seed(3))
    for dtype, precision in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        dx, dw = experts.experts_backward(**inputs, dy=dy, lora=lora, alpha=alpha, dtype=dtype)
        v = check.experts_backward(**inputs, dy=dy, dx=dx, dweights=dw, precision=precision, lora=lora,
                                   alpha=alpha)
        assert v.passed, (precision, [c.get("message") for c in v.clauses if c["verdict"] == "fail"])
        assert next(c for c in v.clauses if c["id"] == "experts.backward.within_bound")["verdict"] == "pass"
    if with_lora:  # dx without the LoRA path: within_bound names dx
        dx, dw = experts.experts_backward_no_lora_dx(**inputs, dy=dy, lora=lora, alpha=alpha,
                                                     dtype=torch.float32)
        v = check.experts_backward(**inputs, dy=dy, dx=dx, precision="fp32", lora=lora, alpha=alpha)
        fail = next(c for c in v.clauses if c["verdict"] == "fail")
        assert fail["id"] == "experts.backward.within_bound" and fail["location"].startswith("dx[")
    # A gradient at a -1 slot: dweights_masked names it.
    dx, dw = experts.experts_backward(**inputs, dy=dy, lora=lora, alpha=alpha, dtype=torch.float32)
    t, j = (inputs["idx"] < 0).nonzero()[0].tolist()
    dw[t, j] = 0.5
    v = check.experts_backward(**inputs, dy=dy, dweights=dw, precision="fp32", lora=lora, alpha=alpha)
    assert "experts.backward.dweights_masked" in v.failed


def test_torch_experts_weight_gradients_judged():
    import moecert.check as check
    inputs, lora = experts.random_case()
    dy = torch.randn(inputs["x"].shape, generator=torch.Generator().manual_seed(3))
    for dtype, precision in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        dx, dw, grads = experts.experts_backward(**inputs, dy=dy, lora=lora, alpha=8.0, dtype=dtype,
                                                 weight_grads=True)
        v = check.experts_backward(**inputs, dy=dy, dx=dx, weight_grads=grads, precision=precision,
                                   lora=lora, alpha=8.0)
        assert v.passed, (precision, _messages(v))
    # B_gate's gradient without the LoRA scale s = alpha / r = 2: within_bound names it.
    bad = dict(grads, b_gate=grads["b_gate"] / 2)
    v = check.experts_backward(**inputs, dy=dy, weight_grads=bad, precision="fp32", lora=lora, alpha=8.0)
    fail = next(c for c in v.clauses if c["verdict"] == "fail")
    assert v.failed == ["experts.backward.within_bound", "experts.backward.spread_explained"]
    assert fail["location"].startswith("b_gate_grad[")


def test_an_intermediate_rounded_to_bf16_is_caught_by_the_spread():
    """h stored in bf16 in a float32 implementation declared fp32: at I = 4096 the fp32 worst-case
    bound (n u over 4096 terms) still holds it, the probabilistic one (10 sqrt(n) u) does not."""
    import moecert.check as check
    inputs, _ = experts.random_case(T=8, E=2, H=64, I=4096, K=1)
    y = experts.experts_forward(**inputs, dtype=torch.float32)
    assert check.experts_forward(**inputs, y=y, precision="fp32").passed
    y = experts.experts_forward(**inputs, dtype=torch.float32, h_bf16=True)
    v = check.experts_forward(**inputs, y=y, precision="fp32")
    assert v.failed == ["experts.forward.spread_explained", "experts.forward.scale_explained"], _messages(v)
    # Declared mixed (bf16 GEMM operands), the same outputs are explained.
    assert check.experts_forward(**inputs, y=y, precision="mixed").passed


def test_y_off_by_5_percent_fails_the_probabilistic_bound_where_the_worst_case_holds_it():
    """Declared mixed at H = 256, I = 128, K = 4: the worst case (every rounding of one sign) holds
    y * 1.05; the probabilistic model (roundings independent across the terms of a sum, LoRA's
    through their exact coefficients) does not, while a correct implementation passes it."""
    import moecert.check as check
    inputs, lora = experts.random_case(T=64, E=8, H=256, I=128, K=4)
    y = experts.experts_forward(**inputs, lora=lora, alpha=8.0, dtype=torch.bfloat16)
    assert check.experts_forward(**inputs, y=y, precision="mixed", lora=lora, alpha=8.0).passed
    v = check.experts_forward(**inputs, y=y.float() * 1.05, precision="mixed", lora=lora, alpha=8.0)
    assert "experts.forward_train.spread_explained" in v.failed, v.failed
    assert "experts.forward_train.within_bound" not in v.failed
    (e,) = v.errors
    assert e["relative_probable"] < 0.5 * e["relative_worst"]


def test_y_off_by_2_percent_declared_bf16_fails_along_y():
    """Declared bf16 (every intermediate in bf16), the per-element bounds hold y * 1.05; the error
    along the exact y, <y - ref, ref>, has a bound a few times bf16's u, and y * 1.02 fails it."""
    import moecert.check as check
    inputs, _ = experts.random_case(T=64, E=8, H=256, I=128, K=4)
    y = experts.experts_forward(**inputs, dtype=torch.bfloat16)
    assert check.experts_forward(**inputs, y=y, precision="bf16").passed
    for factor in (1.02, 0.95):
        v = check.experts_forward(**inputs, y=y.float() * factor, precision="bf16")
        assert "experts.forward.scale_explained" in v.failed, v.failed
        assert "experts.forward.within_bound" not in v.failed
        assert "<y - ref, ref> / <ref, ref> = " in _messages(v)[v.failed.index("experts.forward.scale_explained")]


def test_y_off_by_5_percent_fails_along_y_under_every_declaration_with_large_lora():
    """moecert.testing's realistic class (E16 H512 I384 K4 r8, 64 tokens; B entries 0.3, so each
    LoRA term is about as large as the base one): a correct implementation in each declaration's
    arithmetic passes; y * 1.05 fails scale_explained under bf16, mixed and fp32 alike."""
    import moecert.check as check
    import moecert.testing as mtest
    c = next(c for c in mtest.experts_cases() if c.name == "realistic").inputs
    base = {k: c[k] for k in ("x", "idx", "weights", "w_gate", "w_up", "w_down")}
    for precision, dtype in (("bf16", torch.bfloat16), ("mixed", torch.float32), ("fp32", torch.float32)):
        y = experts.experts_forward(**base, lora=c["lora"], alpha=c["alpha"], dtype=dtype)
        judged = functools.partial(check.experts_forward, **base, precision=precision, lora=c["lora"],
                                   alpha=c["alpha"])
        assert judged(y=y).passed, precision
        v = judged(y=y.float() * 1.05)
        assert "experts.forward_train.scale_explained" in v.failed, (precision, v.failed)


def test_y_off_by_5_percent_fails_a_bound_declared_bf16_on_every_suite_class():
    """moecert.testing's experts classes without LoRA, down to one token (H40 I24): a bf16
    implementation passes, and its y * 1.05 fails a bound clause declared bf16 on each one but
    wide_exponents (rows of x spread over 2^+-20: each row's bound along y is its own):
    scale_explained, or at one token (a bound along y of 4.3%, less the implementation's own
    error) within_bound."""
    import moecert.check as check
    import moecert.testing as mtest
    for case in mtest.experts_cases(lora=False):
        if case.name == "wide_exponents":
            continue
        base = {k: case.inputs[k] for k in ("x", "idx", "weights", "w_gate", "w_up", "w_down")}
        y = experts.experts_forward(**base, dtype=torch.bfloat16)
        assert check.experts_forward(**base, y=y, precision="bf16").passed, case.name
        v = check.experts_forward(**base, y=y.float() * 1.05, precision="bf16")
        along = "experts.forward.scale_explained" in v.failed
        assert along or (case.name == "one_token" and "experts.forward.within_bound" in v.failed), (
            case.name, v.failed)


def test_dx_off_fails_along_dx_without_lora():
    """moecert.testing's normal and realistic experts classes without LoRA: a correct backward in
    each declaration's arithmetic passes; dx * 1.05 fails experts.backward.scale_explained declared
    mixed or fp32, dx * 1.1 declared bf16 (where every element's worst-case bound still holds it)."""
    import moecert.check as check
    import moecert.testing as mtest
    for case in mtest.experts_cases(lora=False):
        if case.name not in ("normal", "realistic"):
            continue
        base = {k: case.inputs[k] for k in ("x", "idx", "weights", "w_gate", "w_up", "w_down")}
        for precision, dtype, factor in (("bf16", torch.bfloat16, 1.1), ("mixed", torch.bfloat16, 1.05),
                                         ("fp32", torch.float32, 1.05)):
            dx, dw = experts.experts_backward(**base, dy=case.inputs["dy"], dtype=dtype)[:2]
            judged = functools.partial(check.experts_backward, **base, dy=case.inputs["dy"], precision=precision,
                                       dweights=dw)
            assert judged(dx=dx).passed, (case.name, precision)
            v = judged(dx=dx.float() * factor)
            assert "experts.backward.scale_explained" in v.failed, (case.name, precision, v.failed)
            if precision == "bf16":
                assert "experts.backward.within_bound" not in v.failed, case.name


@pytest.mark.parametrize("factor", ["b_gate", "b_up", "b_down"])
def test_a_lora_scale_dropped_fails_the_probabilistic_bounds_under_every_declaration(factor):
    """The LoRA scale s = alpha / r left out of one projection, in a bf16 or an fp32 implementation:
    declared bf16, mixed or fp32, the error fails spread_explained and scale_explained."""
    import moecert.check as check
    inputs, lora = experts.random_case(T=64, E=8, H=256, I=128, K=4)
    bad = dict(lora, **{factor: lora[factor] / (8.0 / lora["a_gate"].shape[1])})
    for precision, dtype in (("bf16", torch.bfloat16), ("mixed", torch.bfloat16), ("fp32", torch.float32)):
        y = experts.experts_forward(**inputs, lora=bad, alpha=8.0, dtype=dtype)
        v = check.experts_forward(**inputs, y=y, precision=precision, lora=lora, alpha=8.0)
        assert {"experts.forward_train.spread_explained", "experts.forward_train.scale_explained"} <= set(
            v.failed), (precision, v.failed)


def test_router_weights_without_renormalisation_or_scaling_fail_the_routers_bound():
    """A softmax top-k not renormalised, a sigmoid router's routed scaling factor (2.5) dropped: the
    router's within_bound names the weights, whatever the experts' declared precision."""
    import moecert.check as check
    case = layer.random_case()
    lora = dict(case["lora"])
    base = {k: case[k] for k in ("x", "router_w", "router_b", "w_gate", "w_up", "w_down")}
    z = torch.nn.functional.linear(case["x"].float(), case["router_w"], case["router_b"])

    def y_of(idx, w, dtype):
        return experts.experts_forward(case["x"], idx, w, case["w_gate"], case["w_up"], case["w_down"], lora,
                                       case["alpha"], dtype)
    top, idx = torch.topk(torch.softmax(z, -1), case["K"], -1)
    sig, sig_idx = torch.topk(torch.sigmoid(z), case["K"], -1)
    normalised = sig / sig.sum(-1, keepdim=True)
    for precision, dtype in (("bf16", torch.bfloat16), ("mixed", torch.bfloat16), ("fp32", torch.float32)):
        kw = dict(base, z=z, precision=precision, lora=lora, alpha=case["alpha"])
        v = check.layer_forward(**kw, idx=idx.int(), weights=top, y=y_of(idx.int(), top, dtype),
                                router="softmax_topk")
        assert "router.softmax_topk.within_bound" in v.failed, (precision, v.failed)
        sigmoid = dict(kw, idx=sig_idx.int(), router="sigmoid_topk", router_bias=torch.zeros(z.shape[1]),
                       scaling=2.5)
        right = normalised * 2.5
        assert check.layer_forward(**sigmoid, weights=right, y=y_of(sig_idx.int(), right, dtype)).passed
        v = check.layer_forward(**sigmoid, weights=normalised, y=y_of(sig_idx.int(), normalised, dtype))
        assert v.failed == ["router.sigmoid_topk.within_bound"], (precision, v.failed)


def test_truncation_to_bf16_is_caught_by_the_rounding_audit():
    import moecert.check as check
    inputs, lora = experts.random_case(T=48)
    y = experts.experts_forward(**inputs, lora=lora, alpha=8.0, dtype=torch.float32)
    truncated = (y.view(torch.int32) & -65536).view(torch.float32)  # fp32 -> bf16 by >> 16
    nearest = y.bfloat16().float()
    v = check.experts_forward(**inputs, y=nearest, precision="bf16", lora=lora, alpha=8.0)
    assert v.passed, v.failed
    v = check.experts_forward(**inputs, y=truncated, precision="bf16", lora=lora, alpha=8.0)
    assert v.failed == ["experts.forward_train.rounding_unbiased"]  # within its bound, biased


def test_a_truncating_conversion_in_a_weight_gradient_is_caught_by_the_rounding_audit():
    """dL/dg cut to bf16 by truncation before the gate's gradients (a float32 implementation
    declared mixed, whose GEMM operands are bf16), and a weight gradient stored by truncation:
    within every bound, biased toward zero. The audit reads one element per row and column of
    each expert (a row shares one operand row's roundings)."""
    import moecert.check as check
    inputs, lora = experts.random_case(T=64, E=8, H=256, I=128, K=4)
    dy = torch.randn(inputs["x"].shape, generator=torch.Generator().manual_seed(3))
    judged = functools.partial(check.experts_backward, **inputs, dy=dy, lora=lora, alpha=8.0)
    _, _, grads = experts.experts_backward(**inputs, dy=dy, lora=lora, alpha=8.0, dtype=torch.float32,
                                           weight_grads=True)
    assert judged(weight_grads=grads, precision="mixed").passed
    for bad, precision in ((experts.experts_backward(**inputs, dy=dy, lora=lora, alpha=8.0, dtype=torch.float32,
                                                     weight_grads=True, dg_truncated=True)[2], "mixed"),
                           (dict(grads, w_gate=(grads["w_gate"].view(torch.int32) & -65536).view(torch.float32)),
                            "bf16")):
        v = judged(weight_grads=bad, precision=precision)
        assert v.failed == ["experts.backward.rounding_unbiased"], _messages(v)
        assert next(c for c in v.clauses if c["verdict"] == "fail")["location"].startswith("w_gate_grad")


def test_experts_judge_refuses_what_it_cannot_model():
    import moecert
    import moecert.check as check
    inputs, lora = experts.random_case()
    y = experts.experts_forward(**inputs, dtype=torch.float32)
    with pytest.raises(moecert.InvalidArgument, match="precision"):
        check.judge("experts.forward", inputs, {"y": y})
    with pytest.raises(moecert.InvalidArgument, match="precision=fp16"):
        check.experts_forward(**inputs, y=y, precision="fp16")
    with pytest.raises(moecert.InvalidArgument, match="alpha"):
        check.judge("experts.forward_train", dict(inputs, **lora), {"y": y}, precision="fp32")
    with pytest.raises(moecert.InvalidArgument, match="forward_train"):
        check.judge("experts.forward", dict(inputs, **lora), {"y": y}, precision="fp32")
    bad = dict(inputs, idx=inputs["idx"].clone())
    bad["idx"][0, 0] = 99
    v = check.experts_forward(**bad, y=y, precision="fp32")
    assert v.failed == ["experts.forward.idx_in_range"]


# ---- quantized base weights: judged as fp32(code * scale) ----

QUANTIZED = ("int8_channel", "int4_group", "fp8_e4m3_block128")


def _quantized_case(fmt):
    """random_case with H, I past one 128-block, its base weights quantized (formats.quantize),
    and the fp32 values a PyTorch implementation dequantizes them to (examples/judge/experts.py)."""
    from moecert.torch import formats
    inputs, lora = experts.random_case(H=160, I=136)
    q = {n: formats.quantize(inputs[n], fmt) for n in ("w_gate", "w_up", "w_down")}
    dense = dict(inputs, **{n: experts.dequantize(fmt, v.codes, v.scales, v.cols) for n, v in q.items()})
    return dict(inputs, **q), dense, lora, q


def _wrong_dequantization(fmt, q):
    """A bug of each format: int8 a scale applied twice, int4 the nibbles of a byte swapped, fp8
    the 128 x 128 scales read per row."""
    if fmt == "int8_channel":
        return experts.dequantize(fmt, q.codes, q.scales * q.scales, q.cols)
    if fmt == "int4_group":
        return experts.dequantize(fmt, (q.codes << 4) | (q.codes >> 4), q.scales, q.cols)
    return experts.dequantize(fmt, q.codes, q.scales, q.cols, scale_block_rows=1)


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_torch_experts_over_quantized_weights_judged(fmt):
    import moecert.check as check
    quantized, dense, lora, q = _quantized_case(fmt)
    for dtype, precision in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        y = experts.experts_forward(**dense, lora=lora, alpha=8.0, dtype=dtype)
        v = check.experts_forward(**quantized, y=y, precision=precision, lora=lora, alpha=8.0)
        assert v.passed, (precision, _messages(v))
        passed = {c["id"] for c in v.clauses if c["verdict"] == "pass"}
        assert {"gemm.pack.q_code", "gemm.pack.q_scale", "experts.forward_train.within_bound"} <= passed
    dy = torch.randn(12, 160, generator=torch.Generator().manual_seed(9)).bfloat16()
    dx, dw = experts.experts_backward(**dense, dy=dy, lora=lora, alpha=8.0, dtype=torch.float32)
    v = check.experts_backward(**quantized, dy=dy, precision="fp32", dx=dx, dweights=dw, lora=lora, alpha=8.0)
    assert v.passed, _messages(v)
    # One projection dequantized wrong: y fails within_bound under fp32, and fails under the
    # wider declarations too (there by the statistical clauses where the worst-case bound is wide).
    name = "w_down" if fmt != "fp8_e4m3_block128" else "w_gate"  # fp8: I = 136 rows past one block
    wrong = dict(dense, **{name: _wrong_dequantization(fmt, q[name])})
    y = experts.experts_forward(**wrong, lora=lora, alpha=8.0, dtype=torch.float32)
    for precision in ("fp32", "mixed", "bf16"):
        v = check.experts_forward(**quantized, y=y, precision=precision, lora=lora, alpha=8.0)
        assert not v.passed and ("experts.forward_train.within_bound" in v.failed or precision != "fp32"), (
            precision, v.failed)


def test_bad_quantized_weights_fail_their_clauses():
    import moecert.check as check
    quantized, dense, _, q = _quantized_case("int8_channel")
    y = experts.experts_forward(**dense, dtype=torch.float32)
    codes = q["w_up"].codes.clone()
    codes[2, 5, 7] = 0x80  # -128: outside the format's [-127, 127]
    bad = dict(quantized, w_up=type(q["w_up"])("int8_channel", codes, q["w_up"].scales, q["w_up"].cols))
    v = check.experts_forward(**bad, y=y, precision="fp32")
    assert v.failed == ["gemm.pack.q_code"]
    assert "w_up.codes[277, 7]" in _messages(v)[0] and "0x80" in _messages(v)[0]
    scales = q["w_down"].scales.clone()
    scales[1, 3] = 0
    bad = dict(quantized, w_down=type(q["w_down"])("int8_channel", q["w_down"].codes, scales, q["w_down"].cols))
    assert check.experts_forward(**bad, y=y, precision="fp32").failed == ["gemm.pack.q_scale"]
    # int4: each element's nibble judged, -8 (nibble 8) named with its element
    q4 = _quantized_case("int4_group")[3]["w_gate"]
    codes = q4.codes.clone()
    codes[0, 3, 5] = (codes[0, 3, 5] & 15) | 0x80
    bad = dict(quantized, **{n: _quantized_case("int4_group")[3][n] for n in ("w_up", "w_down")},
               w_gate=type(q4)("int4_group", codes, q4.scales, q4.cols))
    v = check.experts_forward(**bad, y=y, precision="fp32")
    assert v.failed == ["gemm.pack.q_code"] and "w_gate.codes[3, 5]" in _messages(v)[0]
    assert "(element 11)" in _messages(v)[0]
    inputs = {"x": quantized["x"], "idx": quantized["idx"], "weights": quantized["weights"]}
    for n in ("w_gate", "w_up", "w_down"):
        inputs[n + ".codes"], inputs[n + ".scales"] = q[n].codes, q[n].scales
    inputs["w_up.scales"] = q["w_up"].scales[:, :-1]
    v = check.judge("experts.forward", inputs, {"y": y}, precision="fp32", format="int8_channel")
    assert v.failed == ["experts.forward.shape"] and "w_up.scales 810x1, expected 816x1" in _messages(v)[0]
    import moecert
    with pytest.raises(moecert.InvalidArgument, match="format=int3: expected one of"):
        check.judge("experts.forward", inputs, {"y": y}, precision="fp32", format="int3")


@needs_cli
def test_cli_judges_fp8_codes_stored_as_float8(tmp_path):
    quantized, dense, _, q = _quantized_case("fp8_e4m3_block128")
    y = experts.experts_forward(**dense, dtype=torch.float32)
    (tmp_path / "fp8").mkdir()
    tensors = {"x": quantized["x"], "idx": quantized["idx"], "weights": quantized["weights"]}
    for n in ("w_gate", "w_up", "w_down"):
        tensors[n + ".codes"], tensors[n + ".scales"] = q[n].codes, q[n].scales
    routers.save(str(tmp_path / "fp8" / "inputs.safetensors"),
                 dtypes={n + ".codes": "F8_E4M3" for n in ("w_gate", "w_up", "w_down")}, **tensors)
    routers.save(str(tmp_path / "fp8" / "outputs.safetensors"), y=y)
    params = ("precision=fp32", "format=fp8_e4m3_block128")
    report = check(tmp_path, "fp8", "experts.forward", *params)
    assert report["verdict"] == "pass", failed(report)
    routers.save(str(tmp_path / "fp8" / "outputs.safetensors"), y=y * 1.05)
    assert "experts.forward.within_bound" in failed(check(tmp_path, "fp8", "experts.forward", *params))


# ---- the layer: stage by stage on the implementation's intermediates (proofs/layer.md §7) ----

def _messages(v):
    return [c.get("message") for c in v.clauses if c["verdict"] == "fail"]


@pytest.mark.parametrize("dtype,precision", [(torch.bfloat16, "bf16"), (torch.float32, "fp32")])
def test_torch_layer_judged_stage_by_stage(dtype, precision):
    import moecert.check as check
    case = layer.random_case()
    inputs, fwd, bwd_in, bwd_out = layer.layer_step(case, dtype)
    params = dict(precision=precision, router="softmax_topk", alpha=case["alpha"])
    v = check.judge("layer.forward", inputs, fwd, **params)
    assert v.passed, _messages(v)
    judged = {c["id"] for c in v.clauses if c["verdict"] == "pass"}
    assert {"layer.router_linear.within_bound", "router.softmax_topk.within_bound",
            "router.softmax_topk.topk_property", "layer.forward.within_bound"} <= judged
    assert [e["output"] for e in v.errors] == ["z", "y"]
    assert all(e["relative_error"] <= e["relative_worst"] and e["relative_probable"] is None for e in v.errors)
    v = check.judge("layer.backward", bwd_in, bwd_out, **params)
    assert v.passed, _messages(v)
    judged = {c["id"] for c in v.clauses if c["verdict"] == "pass"}
    assert {"router.softmax_topk_backward.within_bound", "router.softmax_topk_backward.unselected_grad",
            "layer.backward.within_bound", "layer.backward.router_masked"} <= judged


@pytest.mark.parametrize("softmax_all", [False, True])
def test_a_bf16_router_judged_stage_by_stage(softmax_all):
    """The router as a model cast to bf16 computes it (router_w, router_b and z in bf16, the softmax
    in fp32 over the bf16 logits, the weights stored in bf16; with softmax_all over all E, then
    the K largest renormalised, differentiated densely): passes declared bf16; the K largest of
    the softmax over all E not renormalised fails the router's bound."""
    import moecert.check as check
    case = layer.random_case()
    params = dict(precision="bf16", router="softmax_topk", alpha=case["alpha"],
                  backward="dense" if softmax_all else "masked")
    inputs, fwd, bwd_in, bwd_out = layer.layer_step(case, router_dtype=torch.bfloat16, softmax_all=softmax_all)
    assert fwd["z"].dtype == fwd["weights"].dtype == bwd_out["dz"].dtype == torch.bfloat16
    for op, ins, outs in (("layer.forward", inputs, fwd), ("layer.backward", bwd_in, bwd_out)):
        v = check.judge(op, ins, outs, **params)
        assert v.passed, (op, _messages(v))
    if softmax_all:
        inputs, fwd, _, _ = layer.layer_step(case, router_dtype=torch.bfloat16, softmax_all=True, renormalize=False)
        v = check.judge("layer.forward", inputs, fwd, **params)
        assert "router.softmax_topk.within_bound" in v.failed and "layer.forward.within_bound" not in v.failed


def test_torch_layer_over_quantized_weights_judged():
    """The layer's judge takes quantized base weights as the experts op's does."""
    import moecert.check as check
    from moecert.torch import formats
    case = layer.random_case()
    q = {n: formats.quantize(case[n], "int4_group") for n in ("w_gate", "w_up", "w_down")}
    case.update({n: experts.dequantize("int4_group", v.codes, v.scales, v.cols) for n, v in q.items()})
    inputs, fwd, bwd_in, bwd_out = layer.layer_step(case, torch.float32)
    for n in q:
        del inputs[n], bwd_in[n]
        inputs[n + ".codes"], inputs[n + ".scales"] = bwd_in[n + ".codes"], bwd_in[n + ".scales"] = \
            q[n].codes, q[n].scales
    params = dict(precision="fp32", router="softmax_topk", alpha=case["alpha"], format="int4_group")
    for op, ins, outs in (("layer.forward", inputs, fwd), ("layer.backward", bwd_in, bwd_out)):
        v = check.judge(op, ins, outs, **params)
        assert v.passed, (op, _messages(v))
        assert {"gemm.pack.q_code", "gemm.pack.q_scale", op + ".within_bound"} <= {
            c["id"] for c in v.clauses if c["verdict"] == "pass"}
    v = check.judge("layer.forward", inputs, dict(fwd, y=fwd["y"] * 1.05), **params)
    assert v.failed == ["layer.forward.within_bound", "layer.forward.spread_explained",
                        "layer.forward.scale_explained", "layer.forward.rounding_unbiased"]


def test_torch_layer_bugs_fail_on_their_stage():
    import moecert.check as check
    case = layer.random_case()
    kw = dict(precision="fp32", router="softmax_topk", lora={k: case["lora"][k] for k in case["lora"]},
              alpha=case["alpha"])
    # The router bias left out of z: the router linear (the router and the experts are right on that z).
    inputs, fwd, _, _ = layer.layer_step(case, torch.float32, bias=False)
    base = {k: inputs[k] for k in ("x", "router_w", "router_b", "w_gate", "w_up", "w_down")}
    v = check.layer_forward(**base, **fwd, **kw)
    assert v.failed == ["layer.router_linear.within_bound"]
    # dx without the router's path: dx alone.
    _, _, bwd_in, bwd_out = layer.layer_step(case, torch.float32, router_dx=False)
    fwd_named = {k: bwd_in[k] for k in ("z", "idx", "weights", "dy")}
    v = check.layer_backward(**base, **fwd_named, **bwd_out, **kw)
    assert v.failed == ["layer.backward.within_bound", "layer.backward.spread_explained"]
    fail = next(c for c in v.clauses if c["verdict"] == "fail")
    assert fail["location"].startswith("dx[")
    # The softmax over all experts, then renormalised: dz at unselected experts is not 0 (failure mode 5).
    _, _, bwd_in, bwd_out = layer.layer_step(case, torch.float32, softmax_all=True)
    fwd_named = {k: bwd_in[k] for k in ("z", "idx", "weights", "dy")}
    v = check.layer_backward(**base, **fwd_named, **bwd_out, **kw)
    assert "router.softmax_topk_backward.unselected_grad" in v.failed
    # ... unless it declares so: a dense softmax's gradient, its rounding noise bounded (router.md §4.4).
    v = check.layer_backward(**base, **fwd_named, **bwd_out, backward="dense", **kw)
    assert v.failed == [], v.failed


@needs_cli
def test_a_layer_truncating_its_outputs_fails_the_rounding_audit():
    """y and dx of a float32 layer stored in bf16 by truncation, declared bf16: within every bound,
    biased toward zero."""
    import moecert.check as check
    case = layer.random_case()
    inputs, fwd, bwd_in, bwd_out = layer.layer_step(case, torch.float32)
    params = dict(precision="bf16", router="softmax_topk", alpha=case["alpha"])
    truncate = lambda t: (t.float().view(torch.int32) & -65536).view(torch.float32)  # noqa: E731
    assert check.judge("layer.forward", inputs, fwd, **params).passed
    v = check.judge("layer.forward", inputs, dict(fwd, y=truncate(fwd["y"])), **params)
    assert v.failed == ["layer.forward.rounding_unbiased"], _messages(v)
    assert check.judge("layer.backward", bwd_in, bwd_out, **params).passed
    v = check.judge("layer.backward", bwd_in, dict(bwd_out, dx=truncate(bwd_out["dx"])), **params)
    assert v.failed == ["layer.backward.rounding_unbiased"], _messages(v)


def test_cli_judges_the_layer(tmp_path):
    case = layer.random_case()
    inputs, fwd, bwd_in, bwd_out = layer.layer_step(case, torch.bfloat16)
    params = ("precision=bf16", "router=softmax_topk", "alpha={}".format(case["alpha"]))
    for name, ins, outs in (("forward", inputs, fwd), ("backward", bwd_in, bwd_out)):
        (tmp_path / name).mkdir()
        routers.save(str(tmp_path / name / "inputs.safetensors"), **ins)
        routers.save(str(tmp_path / name / "outputs.safetensors"), **outs)
        report = check(tmp_path, name, "layer." + name, *params)
        assert report["verdict"] == "pass", failed(report)
    # A y off by far more than its bound.
    routers.save(str(tmp_path / "forward" / "outputs.safetensors"), **dict(fwd, y=fwd["y"] + 1))
    assert failed(check(tmp_path, "forward", "layer.forward", *params))[0] == "layer.forward.within_bound"


# ---- untrusted outputs: out-of-range expert ids never read through ----

@pytest.mark.parametrize("bad", [10 ** 8, 12, -2, -(2 ** 31)])
def test_an_out_of_range_id_fails_its_index_clause_and_its_row_is_skipped(bad):
    """An implementation's id outside [-1, E) (far outside, E itself, -2) fails the index clause
    of each router's forward and of the layer's; the clauses that read scores or weights through
    the ids skip that row (the verdict lists it) instead of reading outside the tensors."""
    import moecert.check as check
    gen = torch.Generator().manual_seed(3)
    t, e, k = 5, 12, 3
    z = torch.randn(t, e, generator=gen)
    w, idx = torch.topk(torch.softmax(z, 1), k)
    w = w / w.sum(1, keepdim=True)
    idx = idx.int()
    idx[2, 0] = bad
    v = check.softmax_topk_forward(z, idx, w)
    assert v.failed == ["router.softmax_topk.idx_valid"], v.failed
    assert v.report["skipped_rows"] == [2]
    bias = torch.zeros(e)
    s = torch.sigmoid(z)
    sw, sidx = torch.topk(s, k)
    sidx = sidx.int()
    sidx[2, 1] = bad
    v = check.sigmoid_topk_forward(z, bias, sidx, sw / sw.sum(1, keepdim=True))
    assert "router.sigmoid_topk.idx_valid" in v.failed and 2 in v.report["skipped_rows"]
    n = 4
    sx, sy = torch.randn(t, n, generator=gen), torch.randn(t, n, generator=gen)
    scores = (sx[:, :, None] + sy[:, None, :]).reshape(t, n * n)
    pw, pidx = torch.topk(scores, k)
    pidx = pidx.int()
    pidx[2, 2] = bad if bad != 12 else n * n
    v = check.product_key_forward(sx, sy, pidx, torch.softmax(pw, 1))
    assert "router.product_key.idx_valid" in v.failed and 2 in v.report["skipped_rows"]


def test_the_layer_judge_skips_y_on_rejected_ids():
    import moecert.check as check
    case = layer.random_case()
    inputs, fwd, _, _ = layer.layer_step(case, torch.float32)
    params = dict(precision="fp32", router="softmax_topk", alpha=case["alpha"])
    idx = fwd["idx"].clone()
    idx[1, 0] = 10 ** 8
    v = check.judge("layer.forward", inputs, dict(fwd, idx=idx), **params)
    assert v.failed == ["router.softmax_topk.idx_valid"], v.failed
    assert 1 in v.report["skipped_rows"]


def test_unknown_parameters_are_refused_with_the_valid_names():
    import moecert
    import moecert.check as check
    z = torch.randn(4, 8)
    w, idx = torch.topk(torch.softmax(z, 1), 2)
    with pytest.raises(moecert.InvalidArgument, match="unknown parameter renormalise=false, expected one of "
                                                      "precision, renormalize"):
        check.judge("router.softmax_topk.forward", {"z": z}, {"idx": idx.int(), "w": w / w.sum(1, keepdim=True)},
                    renormalise=False)


def _raw_safetensors(path, header, data):
    import struct
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


@needs_cli
def test_cli_refuses_untrusted_files_and_params_with_exit_2(cases, tmp_path):
    """Files that are not regular (a device, a FIFO with no writer, a directory), shapes whose
    element count wraps or exceeds the data, a misspelt --param and a report that cannot be
    written: each exits 2 with its reason, at once (no read of /dev/zero, no wait on the FIFO,
    no allocation beyond the file), never passing."""
    d = cases / "product_key_forward"
    good_in, good_out = str(d / "inputs.safetensors"), str(d / "outputs.safetensors")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    wrap, huge = tmp_path / "wrap.safetensors", tmp_path / "huge.safetensors"
    _raw_safetensors(wrap, {"sx": {"dtype": "F32", "shape": [2305843009213693956, 8], "data_offsets": [0, 128]}},
                     bytes(128))
    _raw_safetensors(huge, {"sx": {"dtype": "F32", "shape": [2 ** 31, 0], "data_offsets": [0, 0]}}, bytes(200))
    (tmp_path / "blocked").mkdir()
    (tmp_path / "blocked" / "report.json").mkdir()  # a directory where a report file goes
    runs = {
        "device": (["--inputs", "/dev/zero", "--outputs", good_out], "/dev/zero: not a regular file"),
        "fifo": (["--inputs", str(fifo), "--outputs", good_out], "fifo: not a regular file"),
        "directory": (["--inputs", str(tmp_path), "--outputs", good_out], "not a regular file"),
        "wrap": (["--inputs", str(wrap), "--outputs", good_out], "larger than its 128 data bytes"),
        "huge": (["--inputs", str(huge), "--outputs", good_out], "larger than its 0 data bytes"),
        "param": (["--inputs", good_in, "--outputs", good_out, "--param", "renormalise=false"],
                  "unknown parameter renormalise=false, expected one of precision, weights"),
        "report": (["--inputs", good_in, "--outputs", good_out, "--out", str(tmp_path / "blocked")],
                   "cannot write"),
    }
    for name, (args, message) in runs.items():
        r = subprocess.run([CLI, "check", "router.product_key.forward", "--out", str(tmp_path / "r" / name)] + args
                           if name != "report" else [CLI, "check", "router.product_key.forward"] + args,
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 2 and message in r.stderr, (name, r.returncode, r.stderr)


# ---- errors only a correct judge sees ----------------------------------------------------------

def _last_row_outputs():
    """(name, judge(outputs) -> Verdict, the correct outputs, the output to corrupt) per judged
    output, each of several rows; the judge declared fp32."""
    import moecert.check as check
    inputs, lora = experts.random_case(T=12, E=3, K=3)
    inputs["idx"][-1] = torch.tensor([2, 0, 1], dtype=inputs["idx"].dtype)  # the last row: every slot
    inputs["weights"][-1] = torch.tensor([0.5, 0.3, 0.2])
    dy = torch.randn(inputs["x"].shape, generator=torch.Generator().manual_seed(3))
    dx, dw, grads = experts.experts_backward(**inputs, dy=dy, lora=lora, alpha=8.0, dtype=torch.float32,
                                             weight_grads=True)
    z = torch.randn(9, 16, generator=torch.Generator().manual_seed(4))
    idx, w = routers.softmax_topk_forward(z, 3)
    g = torch.randn(idx.shape, generator=torch.Generator().manual_seed(5))
    case = layer.random_case()
    _, fwd, _, _ = layer.layer_step(case, dtype=torch.float32)
    lin = {k: case[k] for k in ("x", "router_w", "router_b", "w_gate", "w_up", "w_down")}
    experts_bwd = functools.partial(check.experts_backward, **inputs, dy=dy, precision="fp32", lora=lora, alpha=8.0)
    return [
        ("y", lambda o: check.experts_forward(**inputs, precision="fp32", lora=lora, alpha=8.0, **o),
         {"y": experts.experts_forward(**inputs, lora=lora, alpha=8.0, dtype=torch.float32)}, "y"),
        ("dx", lambda o: experts_bwd(**o), {"dx": dx}, "dx"),
        ("dweights", lambda o: experts_bwd(**o), {"dweights": dw}, "dweights"),
        ("b_down_grad", lambda o: experts_bwd(weight_grads=o), {"b_down": grads["b_down"]}, "b_down"),
        ("w_down_grad", lambda o: experts_bwd(weight_grads=o), {"w_down": grads["w_down"]}, "w_down"),
        ("w", lambda o: check.softmax_topk_forward(z, idx, **o), {"w": w}, "w"),
        ("dz", lambda o: check.softmax_topk_backward(z, idx, g, **o), {"dz": routers.softmax_topk_backward(z, idx, g)},
         "dz"),
        ("z", lambda o: check.layer_forward(**lin, **o, precision="fp32", router="softmax_topk", lora=case["lora"],
                                            alpha=case["alpha"]), dict(fwd), "z"),
    ]


@pytest.mark.parametrize("which", range(8))
def test_a_wrong_last_row_fails_its_bound(which):
    """The last element of the last row 1% off (by an exact multiple of its bound's scale, not
    rounding): a judge that stops a row short, or reads rows with a wrong stride, passes it."""
    name, judged, outputs, key = _last_row_outputs()[which]
    assert judged(outputs).passed, name
    bad = {k: v.clone() for k, v in outputs.items()}
    last = bad[key].reshape(-1, bad[key].shape[-1])
    if key == "dweights":
        last[-1, -1] = last[-1, -1] * 1.01 + 0.01
    else:
        last[-1, -1] = last[-1, -1] * 1.01 + 0.01 * float(last.abs().max())
    v = judged(bad)
    assert not v.passed, name
    rows = last.shape[0]
    located = [c.get("location", "") for c in v.clauses if c["verdict"] == "fail"]
    r, c = rows - 1, last.shape[1] - 1
    assert any("[{}, {}]".format(r, c) in loc or loc.startswith("t={} ".format(r)) for loc in located), (name, located)


def test_output_storage_rounding_is_the_outputs_not_the_inputs():
    """The rounding an output's storage adds is the output's dtype's: weights computed in fp32 and
    stored in bf16 pass beside fp32 logits; the same bf16 values stored in fp32 fail beside bf16
    logits (a judge that took the rounding from the inputs would pass them). Likewise y."""
    import moecert.check as check
    z = torch.randn(64, 16, generator=torch.Generator().manual_seed(6))
    idx, w = routers.softmax_topk_forward(z, 4)
    assert check.softmax_topk_forward(z, idx, w.bfloat16()).passed
    zb = z.bfloat16()
    idx, w = routers.softmax_topk_forward(zb.float(), 4)
    assert check.softmax_topk_forward(zb, idx, w).passed
    v = check.softmax_topk_forward(zb, idx, w.bfloat16().float())
    assert "router.softmax_topk.within_bound" in v.failed, v.failed
    inputs, lora = experts.random_case(T=64, E=8, H=256, I=128, K=4)
    y = experts.experts_forward(**inputs, dtype=torch.float32)
    assert check.experts_forward(**inputs, y=y.bfloat16(), precision="fp32").passed
    v = check.experts_forward(**inputs, y=y.bfloat16().float(), precision="fp32")
    assert {"experts.forward.within_bound", "experts.forward.spread_explained"} & set(v.failed), v.failed
