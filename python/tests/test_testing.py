"""moecert.testing: the suites' data classes against the PyTorch implementations in
examples/judge — the correct ones conform on every case, each seeded bug fails the case and clause
that name it; reports in four formats; assert_conforms."""
import functools
import json
import os
import sys
from xml.etree import ElementTree

import pytest
import torch

import moecert.testing as mtest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "examples", "judge"))
import experts  # noqa: E402
import layer  # noqa: E402
import routers  # noqa: E402


def test_correct_routers_conform_on_every_case():
    for report in (mtest.router_forward("softmax_topk", routers.softmax_topk_forward),
                   mtest.router_forward("softmax_topk", routers.softmax_topk_forward_dense),
                   mtest.router_backward("softmax_topk", routers.softmax_topk_backward),
                   mtest.router_forward("product_key", routers.product_key_forward),
                   mtest.router_backward("product_key", routers.product_key_backward),
                   mtest.router_forward("sigmoid_topk", functools.partial(routers.sigmoid_topk_forward, groups=2,
                                                                          topk_group=1, scaling=2.5),
                                        groups=2, topk_group=1, scaling=2.5)):
        mtest.assert_conforms(report)
        assert [r.case.name for r in report.results] == list(mtest.ROUTER_CLASSES)


def test_router_bugs_fail_their_cases():
    unmasked = mtest.router_backward("softmax_topk", routers.softmax_topk_backward_unmasked)
    assert not unmasked.passed
    assert all("router.softmax_topk_backward.unselected_grad" in " ".join(r.failures())
               for r in unmasked.results if not r.passed)
    with pytest.raises(AssertionError, match="unselected_grad"):
        mtest.assert_conforms(unmasked)
    bias = mtest.router_forward("sigmoid_topk", functools.partial(routers.sigmoid_topk_forward, groups=1, topk_group=1,
                                                                  bias_in_weights=True))
    assert not bias.passed and "router.sigmoid_topk.within_bound" in bias.summary()
    # a callable that raises fails its cases with the message
    raising = mtest.router_forward("softmax_topk", lambda z, k: (_ for _ in ()).throw(ValueError("no")))
    assert not raising.passed and all(r.failures() == ["raised: ValueError: no"] for r in raising.results)


@pytest.mark.parametrize("lora", [False, True])
def test_experts_implementations_judged_on_every_data_class(lora):
    fp32 = functools.partial(experts.experts_forward, dtype=torch.float32)
    mtest.assert_conforms(mtest.experts_forward(fp32, "fp32", lora=lora))
    mtest.assert_conforms(mtest.experts_forward(experts.experts_forward, "bf16", lora=lora))
    mtest.assert_conforms(mtest.experts_backward(functools.partial(experts.experts_backward, dtype=torch.float32),
                                                 "fp32", lora=lora))
    swapped = mtest.experts_forward(functools.partial(experts.experts_forward_swapped, dtype=torch.float32), "fp32",
                                    lora=lora)
    failed = [r for r in swapped.results if not r.passed]
    assert {r.case.name for r in failed} >= {"normal", "realistic", "wide_exponents"}
    assert all(any(".within_bound" in f for f in r.failures()) for r in failed)


@pytest.mark.parametrize("dtype, precision", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
def test_weight_gradients_judged_on_every_data_class(dtype, precision):
    """The LoRA factors' and base weights' gradients (autograd's) conform; the gate's computed
    from dL/dg truncated to bf16 (declared mixed) fail the rounding audit where it has the
    elements to see it."""
    grads = functools.partial(experts.experts_backward, dtype=dtype, weight_grads=True)
    mtest.assert_conforms(mtest.experts_backward(grads, precision))
    if dtype == torch.bfloat16:
        return
    truncated = mtest.experts_backward(functools.partial(experts.experts_backward, dtype=torch.float32,
                                                         weight_grads=True, dg_truncated=True), "mixed")
    failed = {r.case.name: r.failures() for r in truncated.results if not r.passed}
    assert "realistic" in failed and all("rounding_unbiased" in " ".join(f) for f in failed.values()), failed


@pytest.mark.parametrize("dtype, precision", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
def test_the_stacked_layout_judged_on_every_data_class(dtype, precision):
    """transformers 5's stacked experts (gate_up_proj [E, 2I, H]) conform forward and backward;
    its halves read the other way round fail within_bound on every case with tokens."""
    forward = functools.partial(experts.experts_forward_stacked, dtype=dtype)
    mtest.assert_conforms(mtest.experts_forward(experts.stacked(forward), precision, lora=False))
    mtest.assert_conforms(mtest.experts_backward(experts.stacked(forward), precision, lora=False))
    swapped = mtest.experts_forward(experts.stacked(functools.partial(forward, halves_swapped=True)), precision,
                                    lora=False)
    assert not any(r.passed for r in swapped.results)
    assert all("experts.forward.within_bound" in " ".join(r.failures()) for r in swapped.results)


def test_a_missing_lora_path_in_dx_fails_the_backward():
    report = mtest.experts_backward(functools.partial(experts.experts_backward_no_lora_dx, dtype=torch.float32),
                                    "fp32")
    assert not report.passed and "experts.backward.within_bound" in report.summary()


def test_reports_in_four_formats(tmp_path):
    report = mtest.router_backward("softmax_topk", routers.softmax_topk_backward_unmasked)
    report.write(str(tmp_path))
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["schema"] == "moecert-testing/1" and data["verdict"] == "fail"
    assert [c["name"] for c in data["cases"]] == list(mtest.ROUTER_CLASSES)
    suite = ElementTree.parse(tmp_path / "junit.xml").getroot()
    assert int(suite.get("tests")) == len(report.results)
    assert int(suite.get("failures")) == sum(not r.passed for r in report.results) > 0
    assert "unselected_grad" in (tmp_path / "report.md").read_text()
    assert "<table>" in (tmp_path / "report.html").read_text()


def _layer(dtype, **options):
    """examples/judge/layer.py's layer step as the suites call a layer."""
    def step(x, router_w, router_b, w_gate, w_up, w_down, k, dy=None, router_bias=None, lora=None, alpha=None):
        case = dict(x=x, router_w=router_w, router_b=router_b, w_gate=w_gate, w_up=w_up, w_down=w_down, K=k,
                    lora=lora or {}, alpha=alpha, dy=dy if dy is not None else torch.zeros(x.shape))
        _, fwd, _, bwd = layer.layer_step(case, dtype, **options)
        return dict(fwd, **bwd) if dy is not None else (fwd["z"], fwd["idx"], fwd["weights"], fwd["y"])
    return step


def test_a_torch_layer_judged_on_every_layer_case():
    mtest.assert_conforms(mtest.layer_forward(_layer(torch.float32), "fp32"))
    mtest.assert_conforms(mtest.layer_backward(_layer(torch.float32), "fp32"))
    report = mtest.layer_forward(_layer(torch.bfloat16), "bf16")
    mtest.assert_conforms(report)
    assert [r.case.name for r in report.results] == list(mtest.LAYER_CLASSES)
    # the router's bias left out of its logits: the router linear's stage names it
    bad = mtest.layer_forward(_layer(torch.float32, bias=False), "fp32")
    assert not bad.passed and "layer.router_linear.within_bound" in bad.summary()
    # dx without the router's path: the backward's dx fails
    bad = mtest.layer_backward(_layer(torch.float32, router_dx=False), "fp32")
    assert not bad.passed and "layer.backward.within_bound" in bad.summary()


@pytest.fixture(scope="module")
def lib():
    """examples/judge's C implementations (libmoecert_example_experts.so, built by the tests; its
    path in MOECERT_EXAMPLE_C, which ctest sets)."""
    path = os.environ.get("MOECERT_EXAMPLE_C")
    if not path:
        pytest.skip("MOECERT_EXAMPLE_C (set by ctest) not set")
    import ctypes
    return ctypes.CDLL(path)


@pytest.mark.parametrize("lora", [False, True])
def test_a_c_function_judged_through_the_abi(lib, lora):
    """examples/judge/experts.c, built by ctest: its fp32 experts forward conforms; the variant that
    leaves out LoRA's alpha / r fails within_bound where LoRA counts."""
    report = mtest.experts_forward(mtest.c_experts_forward(lib.example_experts_forward), "fp32", lora=lora)
    mtest.assert_conforms(report)
    unscaled = mtest.experts_forward(mtest.c_experts_forward(lib.example_experts_forward_unscaled), "fp32",
                                     lora=lora)
    assert unscaled.passed != lora  # alpha / r = 2 here: wrong only with LoRA
    if lora:
        assert "experts.forward_train.within_bound" in unscaled.summary()


def test_a_c_backward_judged_through_the_abi(lib):
    mtest.assert_conforms(mtest.experts_backward(mtest.c_experts_backward(lib.example_experts_backward), "fp32"))
    bad = mtest.experts_backward(mtest.c_experts_backward(lib.example_experts_backward_no_lora_dx), "fp32")
    assert not bad.passed and "experts.backward.within_bound" in bad.summary()


def test_a_c_router_judged_through_the_abi(lib):
    mtest.assert_conforms(mtest.router_forward("softmax_topk", mtest.c_router_forward(lib.example_softmax_topk_forward),
                                               sorted=True))
    mtest.assert_conforms(mtest.router_backward("softmax_topk",
                                                mtest.c_router_backward(lib.example_softmax_topk_backward)))
    bad = mtest.router_backward("softmax_topk", mtest.c_router_backward(lib.example_softmax_topk_backward_unmasked))
    assert not bad.passed and "router.softmax_topk_backward.unselected_grad" in bad.summary()


def test_a_c_layer_judged_through_the_abi(lib):
    mtest.assert_conforms(mtest.layer_forward(mtest.c_layer_forward(lib.example_layer_forward), "fp32"))
    bad = mtest.layer_forward(mtest.c_layer_forward(lib.example_layer_forward_no_bias), "fp32")
    assert not bad.passed and "layer.router_linear.within_bound" in bad.summary()
    mtest.assert_conforms(mtest.layer_backward(mtest.c_layer_backward(lib.example_layer_backward), "fp32"))
    bad = mtest.layer_backward(mtest.c_layer_backward(lib.example_layer_backward_no_router_dx), "fp32")
    assert not bad.passed and "layer.backward.within_bound" in bad.summary()


def test_a_c_layer_with_a_correction_bias_judged_through_the_abi(lib):
    """A sigmoid top-k layer (DeepSeek-V3's router, one group) in C: router_bias after router_b."""
    fwd = mtest.c_layer_forward(lib.example_layer_forward_sigmoid, correction_bias=True)
    mtest.assert_conforms(mtest.layer_forward(fwd, "fp32", router="sigmoid_topk"))
    bwd = mtest.c_layer_backward(lib.example_layer_backward_sigmoid, correction_bias=True)
    mtest.assert_conforms(mtest.layer_backward(bwd, "fp32", router="sigmoid_topk"))
    # The signature says whether the bias is passed; a mismatch is refused before the call (and
    # fails each case with that message).
    report = mtest.layer_forward(fwd, "fp32", router="softmax_topk")
    assert not report.passed and "router_bias missing" in report.summary()
