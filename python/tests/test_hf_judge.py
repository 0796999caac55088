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
