"""moecert.hf over quantized frozen base weights (no transformers needed; CI runs it): patch()
quantizing each block's stacked experts (every transformers layout) or reading DeepSeek-V3's FP8
experts from a checkpoint without the model's own expert tensors (meta device); y within the
op's derived bound of a float64 evaluation of the dequantized weights (the tests' own
dequantization, test_formats.exact); codes and scales in the state dict, reloaded bitwise;
what is refused, and that a refusal changes nothing."""
import copy
import pickle

import pytest
import torch
from torch import nn

import moecert
import moecert.hf as hf
from moecert.torch import formats

from conftest import within
from test_formats import FORMATS, _deepseek_checkpoint, kernel_weights
from test_hf_layout import E, H, I, R, Block, Qwen3MoeTopKRouter, bound_of, case, evaluate, lora_weights, \
    stored_as, trained


def stacked_block(transposed=False, concatenated=True, device=None):
    """A Block whose experts hold case()'s weights in a transformers layout (on `device`: their
    values then unknown, as a model built on the meta device has them)."""
    block = Block(Qwen3MoeTopKRouter(True))
    gate_up, down = stored_as(*case()[:2], transposed, concatenated)
    if device is not None:
        gate_up, down = torch.empty_like(gate_up, device=device), torch.empty_like(down, device=device)
    block.experts.gate_up_proj, block.experts.down_proj = nn.Parameter(gate_up), nn.Parameter(down)
    block.experts.is_transposed, block.experts.is_concatenated = transposed, concatenated
    return block


def dequantized(experts):
    """(gate_up [E, 2I, H], down [E, H, I]) float64 the kernels compute with: the module's own
    codes and scales (its state dict) dequantized by the tests' definition of each format."""
    sd = experts.state_dict()
    fmt = moecert.FORMATS[int(sd["base_format"])]
    w = [kernel_weights(formats.Quantized(fmt, sd[n + ".codes"], sd[n + ".scales"], cols)).double()
         for n, cols in (("w_gate", H), ("w_up", H), ("w_down", I))]
    return torch.cat(w[:2], 1), w[2]


def check_y_and_step(experts, scale):
    """y within its derived bound of the float64 evaluation of the dequantized weights with
    LoRA; a backward reaches the LoRA factors and leaves the base weights' codes alone."""
    _, _, x, idx, w = case()
    before = {k: v.clone() for k, v in experts.state_dict().items() if k.startswith("w_")}
    y = experts(x, idx, w)
    within("y", y, evaluate(*lora_weights(*dequantized(experts), experts, scale), x, idx, w),
           bound_of(experts, x, idx, w))
    y.square().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in experts.parameters())
    assert all(torch.equal(v, before[k]) for k, v in experts.state_dict().items() if k.startswith("w_"))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("transposed,concatenated", [(False, True), (True, False)])
def test_patch_quantizes_each_blocks_experts(fmt, transposed, concatenated):
    model = nn.Sequential(stacked_block(transposed, concatenated))
    hf.patch(model, rank=R, alpha=8.0, init=False, base_format=fmt)
    experts = trained(model[0].experts)
    assert experts.base_format == fmt and "gate_up_proj" not in experts.state_dict()
    # the gate's, the up projection's and down's codes: those of the canonical layout's rows
    gate_up, down = case()[:2]
    sd = experts.state_dict()
    for name, w in (("w_gate", gate_up[:, :I]), ("w_up", gate_up[:, I:]), ("w_down", down)):
        q = formats.quantize(w, fmt)  # from the model's values as they are (fp32 here)
        assert torch.equal(sd[name + ".codes"], q.codes) and torch.equal(sd[name + ".scales"], q.scales), name
    check_y_and_step(experts, 8.0 / R)
    # the state dict reloads bitwise into a block quantized the same way
    other = nn.Sequential(stacked_block(transposed, concatenated))
    hf.patch(other, rank=R, alpha=8.0, base_format=fmt)
    other.load_state_dict(model.state_dict())
    _, _, x, idx, w = case()
    assert torch.equal(other[0].experts(x, idx, w), experts(x, idx, w))
    # ... and so do the adapters alone (strict=False), the quantized base kept
    again = nn.Sequential(stacked_block(transposed, concatenated))
    hf.patch(again, rank=R, alpha=8.0, base_format=fmt)
    result = again.load_state_dict({k: v for k, v in model.state_dict().items() if "lora_" in k}, strict=False)
    assert sorted(k for k in result.missing_keys if ".experts." in k) == sorted(
        "0.experts." + n for n in ("base_format", "w_gate.codes", "w_gate.scales", "w_up.codes", "w_up.scales",
                                   "w_down.codes", "w_down.scales"))
    assert torch.equal(again[0].experts(x, idx, w), experts(x, idx, w))
    for twin in (copy.deepcopy(experts), pickle.loads(pickle.dumps(experts))):
        assert twin.base_format == fmt and torch.equal(twin(x, idx, w), experts(x, idx, w))
    with pytest.raises(moecert.InvalidArgument, match="merge: the base weights are " + fmt):
        experts.merge()


def test_patch_reads_fp8_experts_from_a_checkpoint_not_the_model(rng):
    tensors = {k.replace("model.layers.3.mlp", "0"): v for k, v in _deepseek_checkpoint(rng, E, H, I).items()}
    model = nn.Sequential(stacked_block(device="meta"))
    names = hf.patch(model, rank=R, alpha=8.0, init=False, checkpoint=tensors.__getitem__)
    experts = trained(model[0].experts)
    assert names == ["0.experts"] and experts.base_format == "fp8_e4m3_block128"
    sd = experts.state_dict()
    for name, proj in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
        key = "0.experts.{}." + proj
        assert torch.equal(sd[name + ".codes"], torch.stack([tensors[key.format(e) + ".weight"] for e in range(E)]))
        assert torch.equal(sd[name + ".scales"],
                           torch.stack([tensors[key.format(e) + ".weight_scale_inv"] for e in range(E)]))
    check_y_and_step(experts, 8.0 / R)


def test_a_checkpoint_that_does_not_fit_changes_nothing(rng):
    tensors = {k.replace("model.layers.3.mlp", "0"): v for k, v in _deepseek_checkpoint(rng, E, H, I).items()}
    for broken, match in (
            ({k: v for k, v in tensors.items() if k != "0.experts.2.up_proj.weight_scale_inv"},
             "checkpoint: 0.experts.2.up_proj.weight_scale_inv: KeyError"),
            ({k: (v[:, :-1].contiguous() if k.endswith("down_proj.weight") else v) for k, v in tensors.items()},
             "checkpoint: 0.experts.\\*.down_proj: 6 x 32 x 23, the model's are 6 x 32 x 24")):
        model = nn.Sequential(stacked_block(device="meta"))
        before = model[0].experts
        with pytest.raises(moecert.InvalidArgument, match=match):
            hf.patch(model, rank=R, checkpoint=broken.__getitem__)
        assert model[0].experts is before and before.gate_up_proj.requires_grad
    small = {k: v for k, v in _deepseek_checkpoint(rng, E - 1, H, I).items()}
    with pytest.raises(moecert.InvalidArgument, match="checkpoint: 0.experts.5.gate_proj.weight"):
        hf.patch(nn.Sequential(stacked_block(device="meta")),
                 checkpoint={k.replace("model.layers.3.mlp", "0"): v for k, v in small.items()}.__getitem__)


def test_quantized_base_weights_are_frozen_and_named_right():
    with pytest.raises(moecert.InvalidArgument, match="train_base=True with quantized base weights"):
        hf.patch(nn.Sequential(stacked_block()), train_base=True, base_format="int8_channel")
    with pytest.raises(moecert.InvalidArgument, match="format 'int3'"):
        hf.patch(nn.Sequential(stacked_block()), base_format="int3")
    with pytest.raises(moecert.InvalidArgument, match="with a checkpoint: its experts are read as stored"):
        hf.patch(nn.Sequential(stacked_block()), base_format="int4_group", checkpoint={}.__getitem__)
    with pytest.raises(moecert.InvalidArgument, match="on meta: moecert computes on the CPU"):
        hf.patch(nn.Sequential(stacked_block(device="meta")), base_format="int4_group")
    gate_up, down = case()[:2]
    q = [formats.quantize(w.bfloat16(), "int4_group") for w in (gate_up[:, :I], gate_up[:, I:], down)]
    with pytest.raises(moecert.InvalidArgument, match="quantized base weights replace gate_up_proj"):
        hf.Experts(gate_up, down, base=q)
    with pytest.raises(moecert.InvalidArgument, match="frozen"):
        hf.Experts(None, None, base=q, train_base=True)
    experts = hf.Experts(None, None, rank=R, base=q)
    assert experts.base_format == "int4_group" and (experts.num_experts, experts.inter, experts.hidden) == (E, I, H)
    bf16 = hf.Experts(gate_up, down, rank=R)
    bf16.quantize_base("int4_group")  # from its bf16 pack
    _, _, x, idx, w = case()
    assert torch.equal(bf16(x, idx, w), experts(x, idx, w))
    with pytest.raises(moecert.InvalidArgument, match="give all of w_gate, w_up, w_down"):
        experts.set_base_weights(w_gate=q[0])
