"""moecert.hf on transformers 5's own MoE models (tiny random configurations of each family):
the patched experts within moecert's derived bound of a float64 evaluation of the same weights,
the model's own router and load-balancing loss untouched, a LoRA training step, gradient
checkpointing (the op recomputed gives the same gradients bitwise), state_dict in transformers'
names and layout, deepcopy; adapters exchanged with PEFT both ways (PEFT's own merged float64
weights as the reference); families moecert cannot compute refused. Skipped without
transformers (Debian's Python); run on the AMX machine."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import moecert  # noqa: E402
import moecert.hf as hf  # noqa: E402
from moecert.torch import ops  # noqa: E402

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8)
MLA = dict(kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
           num_key_value_heads=4)  # multi-head latent attention: as many key/value heads as heads
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                       shared_expert_intermediate_size=32, norm_topk_prob=False)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=8, num_experts_per_tok=2)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_group=2, topk_group=1,
                         first_k_dense_replace=0, n_shared_experts=1, **MLA)),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                    dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=0,
                         n_shared_experts=1, **MLA)),
}


def model_of(family, dtype=torch.float32, **config):
    cfg_name, model_name, extra = FAMILIES[family]
    if not hasattr(transformers, cfg_name):
        pytest.skip("transformers {} has no {}".format(transformers.__version__, cfg_name))
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_name)(**dict(COMMON, **extra, **config))
    return getattr(transformers, model_name)(cfg).to(dtype)


def ids():
    return torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))


def first_experts(model):
    return next(m for n, m in model.named_modules() if n.endswith("mlp.experts"))


def y_and_bound(experts, x, idx, w):
    """The patched experts' y on (x, idx, w) and the op's derived bound of its error for that
    routing (proofs/experts.md)."""
    y = experts(x, idx, w)
    _, saved = ops.experts_forward_train(experts._packed, x.bfloat16(), idx, w.float(), experts.lora())
    return y, ops.experts_bounds(saved)["y"]


def reference(experts, x, idx, w):
    """float64 sum_j w * (silu(x Wg^T) * (x Wu^T)) Wd^T of the bf16 weights and x, LoRA included."""
    gate_up = experts.gate_up_proj.detach().double()
    down = experts.down_proj.detach().double()
    I = gate_up.shape[1] // 2
    x = x.detach().bfloat16().double()
    y = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            g, u = gate_up[e, :I] @ x[t], gate_up[e, I:] @ x[t]
            y[t] += float(w[t, j]) * (down[e] @ (torch.nn.functional.silu(g) * u))
    return y


@pytest.mark.parametrize("family", list(FAMILIES))
def test_patched_experts_within_the_derived_bound_and_the_model_trains(family):
    model = model_of(family)
    seen = {}
    hook = first_experts(model).register_forward_hook(lambda m, args, out: seen.update(args=args) or None)
    with torch.no_grad():
        model(ids())
    hook.remove()
    names = hf.patch(model)
    assert len(names) == 2 and all(n.endswith("mlp.experts") for n in names)
    experts = first_experts(model)
    assert isinstance(experts, hf.Experts) and not list(experts.parameters())  # the pack is the storage
    x, idx, w = seen["args"]
    with torch.no_grad():
        y, bound = y_and_bound(experts, x, idx, w)
    assert y.dtype == x.dtype
    err = (y.double() - reference(experts, x, idx, w.float())).abs()
    assert torch.all(err <= bound), float((err - bound).max())
    # The model's own router and auxiliary loss, a LoRA step.
    model = model_of(family)
    hf.patch(model, rank=4)
    trains = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trains) == 2 * 5 and all(".mlp.experts.lora_" in n for n in trains)  # the rest frozen, as PEFT does
    out = model(ids(), labels=ids(), output_router_logits=True)
    if not family.startswith("deepseek"):  # DeepSeek's model has no auxiliary loss in transformers
        assert len(out.router_logits) == 2 and torch.isfinite(out.aux_loss)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    b = first_experts(model).lora_B_up
    assert b.grad is not None and torch.isfinite(b.grad).all() and b.grad.abs().sum() > 0
    before = out.loss.item()
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1).step()
    assert model(ids(), labels=ids()).loss.item() != before


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_gradient_checkpointing_gives_the_same_gradients(family):
    model = model_of(family)
    hf.patch(model, rank=4)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    checkpointed = copy.deepcopy(model)
    checkpointed.gradient_checkpointing_enable()
    model.train(), checkpointed.train()
    for m in (model, checkpointed):
        m(ids(), labels=ids()).loss.backward()
    for (n, p), q in zip(model.named_parameters(), checkpointed.parameters()):
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), n


def test_state_dict_in_transformers_layout_and_copies():
    model = model_of("qwen3_moe")
    original = {k: v.clone() for k, v in model.state_dict().items() if k.endswith(hf.BASE)}
    hf.patch(model, rank=2)
    sd = model.state_dict()
    for k, v in original.items():
        assert torch.equal(sd[k], v.bfloat16()), k
    fresh = model_of("qwen3_moe")
    missing, unexpected = fresh.load_state_dict(sd, strict=False)
    assert not missing and unexpected and all(k.rsplit(".", 1)[1].startswith("lora_") for k in unexpected)
    again = model_of("qwen3_moe")
    hf.patch(again, rank=2)
    again.load_state_dict(sd)
    assert torch.equal(again(ids()).logits, model(ids()).logits)
    assert torch.equal(copy.deepcopy(model)(ids()).logits, model(ids()).logits)
    with pytest.raises(moecert.InvalidArgument, match="read-only copy"):
        first_experts(model).gate_up_proj.data.mul_(2)


def test_bf16_model_and_train_base():
    model = model_of("mixtral", torch.bfloat16)
    hf.patch(model, rank=2, train_base=True, freeze=False)
    assert model.model.embed_tokens.weight.requires_grad
    out = model(ids(), labels=ids())
    assert out.logits.dtype == torch.bfloat16
    out.loss.backward()
    experts = first_experts(model)
    assert experts.gate_up_proj.grad is not None and experts.gate_up_proj.grad.dtype == torch.bfloat16


def test_what_moecert_cannot_compute_is_refused():
    model = model_of("qwen3_moe", hidden_act="gelu")
    with pytest.raises(moecert.InvalidArgument, match="activation .*moecert computes SwiGLU with silu"):
        hf.patch(model)
    assert not isinstance(first_experts(model), hf.Experts)  # nothing replaced
    if hasattr(transformers, "GptOssConfig"):
        torch.manual_seed(0)
        cfg = transformers.GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                        num_experts_per_tok=2)
        with pytest.raises(moecert.InvalidArgument, match="besides gate_up_proj and down_proj|clamped"):
            hf.patch(transformers.GptOssForCausalLM(cfg))
    with pytest.raises(moecert.InvalidArgument, match="no sparse-MoE block"):
        hf.patch(torch.nn.Linear(4, 4))
    meta = model_of("olmoe").to("meta")
    with pytest.raises(moecert.InvalidArgument, match="on meta: moecert computes on the CPU"):
        hf.patch(meta)


def fp8_checkpoint(model):
    """The routed experts of `model` as DeepSeek-V3's FP8 checkpoint stores them: per layer and
    expert `...mlp.experts.{e}.{gate,up,down}_proj.weight` (torch.float8_e4m3fn) and
    `.weight_scale_inv`, quantized from the model's values by moecert's quantizer."""
    from moecert.torch import formats
    tensors = {}
    for name, m in model.named_modules():
        if not name.endswith("mlp.experts"):
            continue
        I = m.gate_up_proj.shape[1] // 2
        for proj, w in (("gate_proj", m.gate_up_proj[:, :I]), ("up_proj", m.gate_up_proj[:, I:]),
                        ("down_proj", m.down_proj)):
            q = formats.quantize(w.detach(), "fp8_e4m3_block128")
            for e in range(w.shape[0]):
                key = "{}.{}.{}.".format(name, e, proj)
                tensors[key + "weight"] = q.codes[e].view(torch.float8_e4m3fn)
                tensors[key + "weight_scale_inv"] = q.scales[e]
    return tensors


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="needs torch.float8_e4m3fn")
def test_deepseek_v3_from_its_fp8_checkpoint_without_bf16_experts():
    """A DeepSeek-V3 model built with empty expert weights (accelerate's init_empty_weights: on
    the meta device), everything else loaded, patched from the FP8 checkpoint's tensors: the same
    logits, bitwise, as the model quantized by patch(base_format=...) from its own weights (the
    same codes); it trains its LoRA."""
    accelerate = pytest.importorskip("accelerate")
    source = model_of("deepseek_v3")
    tensors = fp8_checkpoint(source)
    with accelerate.init_empty_weights(include_buffers=False):
        model = type(source)(source.config)
    rest = {k: v for k, v in source.state_dict().items() if ".mlp.experts." not in k}
    missing, _ = model.load_state_dict(rest, strict=False, assign=True)
    assert missing and all(".mlp.experts." in k for k in missing)
    assert first_experts(model).gate_up_proj.device.type == "meta"
    hf.patch(model, rank=4, init=False, checkpoint=tensors.__getitem__)
    assert all(t.device.type == "cpu" for t in list(model.parameters()) + list(model.buffers()))
    experts = first_experts(model)
    assert experts.base_format == "fp8_e4m3_block128"
    quantized = copy.deepcopy(source)
    hf.patch(quantized, rank=4, init=False, base_format="fp8_e4m3_block128")
    quantized.load_state_dict({k: v for k, v in model.state_dict().items() if "lora_" in k}, strict=False)
    assert torch.equal(model(ids()).logits, quantized(ids()).logits)
    out = model(ids(), labels=ids())
    out.loss.backward()
    assert experts.lora_B_up.grad is not None and experts.lora_B_up.grad.abs().sum() > 0


def bf16_valued(model):
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().to(p.dtype))
    return model


def expert_inputs(model):
    """(x, idx, w) the first experts module receives in a forward of ids()."""
    seen = {}
    hook = first_experts(model).register_forward_hook(lambda m, args, out: seen.update(args=args) or None)
    with torch.no_grad():
        model(ids())
    hook.remove()
    return seen["args"]


def peft_merged_experts(family, directory):
    """The first experts module of the family's model with PEFT's adapter from `directory`
    merged by PEFT into its weights, in float64."""
    peft = pytest.importorskip("peft")
    model = peft.PeftModel.from_pretrained(bf16_valued(model_of(family)).double(), str(directory))
    return first_experts(model.merge_and_unload())


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "mixtral"])
def test_adapters_round_trip_with_peft(family, tmp_path):
    peft = pytest.importorskip("peft")
    x, idx, w = expert_inputs(bf16_valued(model_of(family)))
    # moecert -> PEFT: what moecert computes is what PEFT computes from the saved adapter
    model = bf16_valued(model_of(family))
    hf.patch(model, rank=4, alpha=8, init=False)
    bf16_valued(model)  # LoRA factors too: PEFT's fp32 factors then equal what the kernels read
    hf.save_adapter(model, tmp_path / "ours")
    ours = first_experts(model)
    merged = peft_merged_experts(family, tmp_path / "ours")
    y, bound = y_and_bound(ours, x, idx, w)
    err = (y.double() - reference(merged, x, idx, w.float())).abs()
    assert torch.all(err <= bound), float((err - bound).max())
    # PEFT -> moecert, the same key names
    torch.manual_seed(4)
    theirs = peft.get_peft_model(bf16_valued(model_of(family)), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=[], target_parameters=["gate_up_proj", "down_proj"],
        init_lora_weights=False))
    bf16_valued(theirs)
    theirs.save_pretrained(str(tmp_path / "theirs"))
    from safetensors.torch import load_file
    assert set(load_file(str(tmp_path / "theirs" / "adapter_model.safetensors"))) == set(
        load_file(str(tmp_path / "ours" / "adapter_model.safetensors")))
    model = bf16_valued(model_of(family))
    hf.patch(model)
    hf.load_adapter(model, tmp_path / "theirs")
    loaded = first_experts(model)
    assert loaded.rank == 4 and loaded.scale == 2.0
    merged = peft_merged_experts(family, tmp_path / "theirs")
    y, bound = y_and_bound(loaded, x, idx, w)
    err = (y.double() - reference(merged, x, idx, w.float())).abs()
    assert torch.all(err <= bound), float((err - bound).max())
    # (PEFT's adapter differs from moecert's: the check can fail)
    assert not torch.all((y.double() - reference(peft_merged_experts(family, tmp_path / "ours"), x, idx,
                                                 w.float())).abs() <= bound)


def test_merged_model_saves_as_a_plain_transformers_checkpoint(tmp_path):
    model = model_of("qwen3_moe")
    hf.patch(model, rank=4, init=False)
    hf.merge(model)
    logits = model(ids()).logits
    model.save_pretrained(str(tmp_path))
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert not isinstance(first_experts(plain), hf.Experts)
    hf.patch(plain)
    assert torch.equal(plain(ids()).logits, logits)
    hf.unmerge(model)
    assert any("lora_" in n for n, _ in model.named_parameters())


def exact_weights(gate, logits, ids):
    """float64 weights of the family's router maths for the selected ids, from its logits."""
    z = logits.detach().double()
    if hasattr(gate, "e_score_correction_bias"):  # DeepSeek-V3: sigmoid, renormalised, scaled
        s = torch.sigmoid(z).gather(1, ids)
        return float(gate.routed_scaling_factor) * s / s.sum(1, keepdim=True), "sigmoid_topk", float(
            gate.routed_scaling_factor)
    p = torch.softmax(z, -1).gather(1, ids)
    renorm = bool(getattr(gate, "norm_topk_prob", True)) and not hasattr(gate, "topk_method")
    scaling = float(getattr(gate, "routed_scaling_factor", 1.0))
    return scaling * (p / p.sum(1, keepdim=True) if renorm else p), "softmax_topk", renorm


@pytest.mark.parametrize("family", list(FAMILIES))
def test_moecert_router_computes_the_familys_router(family):
    model = model_of(family)
    gate = next(m for n, m in model.named_modules() if n.endswith("mlp.gate"))
    seen = {}
    hook = gate.register_forward_hook(lambda m, args, out: seen.update(x=args[0]) or None)
    with torch.no_grad():
        model(ids())
    hook.remove()
    hf.patch(model, rank=2, router="moecert")
    assert all(m.routed_by == "moecert" for _, m in hf.experts.experts_of(model))
    logits, w, idx = gate(seen["x"])
    logits0, w0, idx0 = gate.forward(seen["x"])  # the model's own (forward hooks bypassed)
    assert torch.equal(logits, logits0) and idx.dtype == idx0.dtype and w.dtype == w0.dtype
    assert torch.equal(idx.sort(1)[0], idx0.sort(1)[0])  # random fp32 logits: no ties
    exact, kind, param = exact_weights(gate, logits, idx)
    bound, _ = ops.router_bounds(kind, param, logits.float(), idx)
    if kind == "softmax_topk" and hasattr(gate, "topk_method"):
        bound = bound * float(gate.routed_scaling_factor) + exact.abs() * 2.0 ** -24  # the scaling in fp32
    assert torch.all((w.double() - exact).abs() <= bound), float(((w.double() - exact).abs() - bound).max())
    out = model(ids(), labels=ids(), output_router_logits=True)  # trains through moecert's router
    out.loss.backward()
    if not family.startswith("deepseek"):
        assert len(out.router_logits) == 2 and torch.isfinite(out.aux_loss)
    assert first_experts(model).lora_B_down.grad.abs().sum() > 0
