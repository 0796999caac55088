"""transformers' own MoE routers judged: Qwen3-MoE's and Mixtral's gates (a softmax over all
experts in fp32, top-k, renormalised) differentiated by autograd pass as backward="dense" and
their forward passes as it stands (an unsorted top-k is a legitimate slot order); without the
declaration the noise autograd leaves at unselected experts is named (and the selected experts'
dense-graph errors exceed the masked computation's bound). Skipped where transformers
is not installed."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import moecert.check as check  # noqa: E402

E, H, T = 8, 32, 64
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=E, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=E, num_experts_per_tok=2)),
}
COMMON = dict(vocab_size=64, hidden_size=H, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8)


def gate_of(family):
    cfg_name, model_name, extra = FAMILIES[family]
    if not hasattr(transformers, cfg_name):
        pytest.skip("transformers {} has no {}".format(transformers.__version__, cfg_name))
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, cfg_name)(**dict(COMMON, **extra)))
    gate = next(m for n, m in model.named_modules() if n.endswith("mlp.gate"))
    with torch.no_grad():  # logits = x W^T with W = [I | 0]: z lands in the logits exactly
        gate.weight.zero_()
        gate.weight[:, :E] = torch.eye(E)
    return gate


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_transformers_router_passes_as_a_dense_softmax(family):
    gate = gate_of(family)
    rng = torch.Generator().manual_seed(3)
    z = torch.randn(T, E, generator=rng) * 3
    x = torch.zeros(T, H)
    x[:, :E] = z
    x.requires_grad_()
    out = gate(x)
    logits, w, idx = out[0], out[1], out[2]
    assert torch.equal(logits.detach(), z)
    g = torch.randn(w.shape, generator=rng)
    w.backward(g)
    dz = x.grad[:, :E]
    assert check.softmax_topk_forward(z, idx, w.detach().float(), renormalize=True).passed
    dense = check.softmax_topk_backward(z, idx, g, dz, renormalize=True, backward="dense")
    assert dense.passed, dense.failed
    # Judged as a masked gradient, the noise at unselected experts is named, and the selected
    # experts' errors (those of the dense graph) exceed the masked computation's bound.
    masked = check.softmax_topk_backward(z, idx, g, dz, renormalize=True)
    noise = bool((dz != 0).sum() > 2 * T)  # more than the selected slots
    assert not noise or "router.softmax_topk_backward.unselected_grad" in masked.failed


@pytest.mark.parametrize("dtype,precision", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
def test_a_transformers_experts_module_passes_in_its_precision(dtype, precision):
    """Qwen3-MoE's own experts module (transformers 5's stacked gate_up_proj [E, 2I, H] and
    down_proj [E, H, I]) on the caller's routing: y, dx and dL/dw pass under the precision it
    computes in."""
    cfg_name, model_name, extra = FAMILIES["qwen3_moe"]
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, cfg_name)(**dict(COMMON, **extra))).to(dtype)
    experts = next(m for n, m in model.named_modules() if n.endswith("mlp.experts"))
    rng = torch.Generator().manual_seed(5)
    K = 2
    idx = torch.stack([torch.randperm(E, generator=rng)[:K] for _ in range(T)])
    x = torch.randn(T, H, generator=rng).to(dtype).requires_grad_()
    w = torch.rand(T, K, generator=rng).to(dtype).requires_grad_()
    y = experts(x, idx, w)
    dy = torch.randn(T, H, generator=rng).to(dtype)
    y.backward(dy)
    gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
    inter = gate_up.shape[1] // 2
    base = dict(w_gate=gate_up[:, :inter].contiguous(), w_up=gate_up[:, inter:].contiguous(), w_down=down)
    fwd = check.experts_forward(x.detach(), idx, w.detach(), y=y.detach(), precision=precision, **base)
    assert fwd.passed, fwd.failed
    bwd = check.experts_backward(x.detach(), idx, w.detach(), dy=dy, precision=precision, dx=x.grad,
                                 dweights=w.grad, **base)
    assert bwd.passed, bwd.failed


def test_a_transformers_experts_module_off_by_5_percent_fails_along_y():
    """Qwen3-MoE's experts module in bf16 at E16 H512 I384 K4, 64 tokens: its y passes every clause
    declared bf16 (the probabilistic ones included); y * 1.05 fails scale_explained, the error along
    the exact y, where every element's own bound still holds it."""
    cfg_name, model_name, extra = FAMILIES["qwen3_moe"]
    torch.manual_seed(0)
    cfg = dict(COMMON, **extra)
    cfg.update(hidden_size=512, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=384)
    model = getattr(transformers, model_name)(getattr(transformers, cfg_name)(**cfg)).to(torch.bfloat16)
    experts = next(m for n, m in model.named_modules() if n.endswith("mlp.experts"))
    rng = torch.Generator().manual_seed(6)
    idx = torch.stack([torch.randperm(16, generator=rng)[:4] for _ in range(T)])
    x = torch.randn(T, 512, generator=rng).to(torch.bfloat16)
    w = torch.softmax(torch.randn(T, 4, generator=rng), -1).to(torch.bfloat16)
    with torch.no_grad():
        y = experts(x, idx, w)
    gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
    inter = gate_up.shape[1] // 2
    base = dict(w_gate=gate_up[:, :inter].contiguous(), w_up=gate_up[:, inter:].contiguous(), w_down=down)
    v = check.experts_forward(x, idx, w, y=y, precision="bf16", **base)
    assert v.passed, v.failed
    off = check.experts_forward(x, idx, w, y=y.float() * 1.05, precision="bf16", **base)
    assert "experts.forward.scale_explained" in off.failed, off.failed
    assert "experts.forward.within_bound" not in off.failed


# ---- transformers' blocks through moecert.testing's suite ------------------------------------------

import functools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402

import moecert.testing as mtest  # noqa: E402

MLA = dict(kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
           num_key_value_heads=4)
BLOCKS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  lambda E, I, K: dict(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=I,
                                       norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                lambda E, I, K: dict(num_local_experts=E, num_experts_per_tok=K, intermediate_size=I)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    lambda E, I, K: dict(n_routed_experts=E, num_experts_per_tok=K, moe_intermediate_size=I, n_group=1,
                                         topk_group=1, first_k_dense_replace=0, n_shared_experts=1, **MLA)),
}


@functools.lru_cache(maxsize=None)
def block_module(family, suffix, E, H, I, K, dtype):
    """The module named *.mlp.<suffix> (experts or gate) of a one-layer model of the family."""
    cfg_name, model_name, extra = BLOCKS[family]
    if not hasattr(transformers, cfg_name):
        pytest.skip("transformers {} has no {}".format(transformers.__version__, cfg_name))
    cfg = dict(vocab_size=64, hidden_size=H, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8)
    cfg.update(extra(E, I, K))
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, cfg_name)(**cfg)).to(dtype)
    return next(m for n, m in model.named_modules() if n.endswith("mlp." + suffix))


def hf_experts(family, dtype):
    """The suite's callable over the family's own experts module (transformers 5's stacked
    gate_up_proj, down_proj) in `dtype`, its weights set to the case's. transformers' experts take
    K ids a row: an empty (-1) slot goes to expert 0 with its weight 0 (the same y), and dL/dw
    there is set to 0 (the glue a caller writes)."""
    def fn(x, idx, weights, w_gate, w_up, w_down, lora=None, alpha=None, dy=None):
        E, I, H = w_gate.shape
        module = block_module(family, "experts", E, H, I, idx.shape[1], dtype)
        with torch.no_grad():
            module.gate_up_proj.copy_(torch.cat([w_gate, w_up], 1))
            module.down_proj.copy_(w_down)
        x = x.to(dtype).requires_grad_(dy is not None)
        w = weights.to(dtype).requires_grad_(dy is not None)
        y = module(x, idx.clamp(min=0), w)
        if dy is None:
            return y.detach()
        y.backward(dy.to(dtype))
        return x.grad, w.grad.masked_fill(idx < 0, 0)
    return fn


def _gate(family, E, K):
    """The family's router with its weight [I | 0] (hidden 64 >= E): x = [z | 0] gives logits z."""
    gate = block_module(family, "gate", E, 64, 16, K, torch.float32)
    with torch.no_grad():
        gate.weight.zero_()
        gate.weight[:, :E] = torch.eye(E)
    return gate


def hf_router(family, dz=False):
    """The suite's router callable over the family's gate: (idx, w) of z, or with dz=True the
    gradient of its weights for dL/dw = g by autograd (its own selection must be the suite's)."""
    def route(z, k, bias=None, idx=None, g=None):
        gate = _gate(family, z.shape[1], k)
        if bias is not None:
            with torch.no_grad():
                gate.e_score_correction_bias.copy_(bias)
        x = torch.zeros(z.shape[0], 64)
        x[:, :z.shape[1]] = z
        x.requires_grad_(g is not None)
        logits, w, ids = gate(x)[:3]
        assert torch.equal(logits.detach().float(), z)
        if g is None:
            return ids, w.detach().float()
        if not torch.equal(ids.long().sort(-1).values, idx.long().sort(-1).values):
            raise AssertionError("the gate selected {} where the suite's selection is {}".format(
                ids.tolist(), idx.tolist()))
        w.backward(_in_slots_of(ids, idx, g))
        return x.grad[:, :z.shape[1]]
    if family == "deepseek_v3":  # the backward's selection needs the case's correction bias
        bias = {c.inputs["z"].numpy().tobytes(): c.inputs["bias"] for c in mtest.router_cases("sigmoid_topk")}
        return (lambda z, idx, g: route(z, idx.shape[1], bias[z.numpy().tobytes()], idx, g)) if dz else \
            (lambda z, b, k: route(z, k, b))
    return (lambda z, idx, g: route(z, idx.shape[1], None, idx, g)) if dz else (lambda z, k: route(z, k))


def _in_slots_of(ids, idx, g):
    """g [T, K] given per slot of idx, rearranged to the slots of ids (the same sets)."""
    out = torch.empty_like(g)
    for t in range(ids.shape[0]):
        where = {int(e): j for j, e in enumerate(idx[t])}
        for j, e in enumerate(ids[t]):
            out[t, j] = g[t, where[int(e)]]
    return out


def _record(name, report):
    folder = os.environ.get("MOECERT_HF_VERDICTS")
    if folder:
        os.makedirs(folder, exist_ok=True)
        report.write(os.path.join(folder, name))
        with open(os.path.join(folder, "summary.jsonl"), "a") as f:
            f.write(json.dumps({"suite": name, "passed": report.passed, "summary": report.summary()}) + "\n")
    return report


@pytest.mark.parametrize("family", list(BLOCKS))
@pytest.mark.parametrize("dtype,precision", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
def test_transformers_experts_modules_conform_on_the_suite(family, dtype, precision):
    fn = hf_experts(family, dtype)
    name = "{}-experts-{}".format(family, precision)
    mtest.assert_conforms(_record(name + "-forward", mtest.experts_forward(fn, precision, lora=False)))
    mtest.assert_conforms(_record(name + "-backward", mtest.experts_backward(fn, precision, lora=False)))


@pytest.mark.parametrize("family", list(BLOCKS))
def test_transformers_routers_conform_on_the_suite(family):
    """The gates' forwards as they stand; their backwards by autograd declared dense (the softmax
    over all experts); a case where the gate's own selection is not the suite's (exact ties) is
    reported as such."""
    kind = "sigmoid_topk" if family == "deepseek_v3" else "softmax_topk"
    params = {"scaling": float(_gate(family, 16, 3).routed_scaling_factor)} if kind == "sigmoid_topk" else {}
    fwd = _record("{}-router-forward".format(family), mtest.router_forward(kind, hf_router(family), **params))
    mtest.assert_conforms(fwd)
    if kind == "softmax_topk":
        params["backward"] = "dense"
    bwd = _record("{}-router-backward".format(family), mtest.router_backward(kind, hf_router(family, dz=True),
                                                                            **params))
    for r in bwd.results:
        assert r.passed or (r.case.name == "ties" and "selected" in " ".join(r.failures())), r.failures()
