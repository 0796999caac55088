"""Quantized base weights: the quantizer, packing, reading back, and the experts
op over them, against the tests' own float64 dequantization written from the
formats' definitions."""
import copy
import pickle

import pytest
import torch

import moecert
import moecert.torch as mt
from moecert.torch import formats, ops

from conftest import ISAS

E, H, I, K, RANK, T = 3, 160, 136, 2, 4, 9  # H, I past one 128-block: partial blocks
FORMATS = ("int8_channel", "int4_group", "fp8_e4m3_block128")
BLOCKS = {"int8_channel": (1, 0), "int4_group": (1, 128), "fp8_e4m3_block128": (128, 128)}


def code_values(fmt, codes, cols):
    """float64 values of codes [.., rows, row bytes] uint8, from the format's definition."""
    if fmt == "int8_channel":
        return codes.view(torch.int8).double()
    if fmt == "int4_group":
        nibbles = torch.stack([codes & 15, codes >> 4], dim=-1).reshape(*codes.shape[:-1], -1)[..., :cols]
        nibbles = nibbles.to(torch.int16)
        return torch.where(nibbles >= 8, nibbles - 16, nibbles).double()
    c = codes.to(torch.int64)
    e, m = (c >> 3) & 15, (c & 7).double()
    mag = torch.where(e == 0, m * 2.0 ** -9, (8 + m) * torch.pow(2.0, (e - 10).double()))
    return torch.where((c >> 7) == 1, -mag, mag)


def exact(q):
    """[E, rows, cols] float64: code * scale, each block's scale spread over its block."""
    out = []
    for c, s in zip(q.codes, q.scales):
        v = code_values(q.format, c, q.cols)
        br, bc = BLOCKS[q.format]
        rows = v.shape[0]
        spread = s.double().repeat_interleave(br or rows, 0)[:rows].repeat_interleave(bc or q.cols, 1)[:, :q.cols]
        out.append(v * spread)
    return torch.stack(out)


def kernel_weights(q):
    """What the kernels compute with: the exact weights rounded to fp32, then to bf16."""
    return exact(q).float().bfloat16()


def weights(g, scale=1.0):
    n = lambda *s, sd: torch.randn(*s, generator=g) * sd * scale
    return n(E, I, H, sd=H ** -0.5), n(E, I, H, sd=H ** -0.5), n(E, H, I, sd=I ** -0.5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_quantizer_picks_the_nearest_code(fmt, rng):
    w = weights(rng)[2]
    w[1, 5] = 0  # an all-zero row: scale 1
    q = formats.quantize(w, fmt)
    top = {"int8_channel": 127, "int4_group": 7, "fp8_e4m3_block128": 448}[fmt]
    values = code_values(fmt, q.codes, q.cols)
    br, bc = BLOCKS[fmt]
    for e in range(E):
        for r0 in range(0, H, br or H):
            for c0 in range(0, I, bc or I):
                blk = w[e, r0:r0 + (br or H), c0:c0 + (bc or I)].double()
                s = q.scales[e, r0 // (br or H), c0 // (bc or I)]
                amax = blk.abs().max()
                assert float(s) == (float(torch.tensor(float(amax / top), dtype=torch.float32)) if amax > 0 else 1.0)
                got = values[e, r0:r0 + (br or H), c0:c0 + (bc or I)]
                target = blk / float(s)
                # no code of the format is nearer the target than the chosen one
                if fmt == "fp8_e4m3_block128":
                    table = code_values(fmt, torch.arange(256, dtype=torch.uint8), 1).flatten()
                    table = table[~torch.isnan(table) & (table.abs() <= 448)]
                else:
                    table = torch.arange(-top, top + 1, dtype=torch.float64)
                best = (table.view(-1, 1) - target.flatten().view(1, -1)).abs().min(0).values
                assert bool(((got.flatten() - target.flatten()).abs() <= best + 1e-12).all())


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_quantized_pack_reads_back_and_survives_copies(fmt, rng):
    q = [formats.quantize(w, fmt) for w in weights(rng)]
    packed = ops.PackedExperts(*q)
    assert packed.format == fmt and (packed.experts, packed.inter, packed.hidden) == (E, I, H)
    for got, want in zip(packed.unpack(), q):
        assert torch.equal(got.view(torch.int16), kernel_weights(want).view(torch.int16))
    for other in (copy.deepcopy(packed), pickle.loads(pickle.dumps(packed)), packed):
        for got, want in zip(other.unpack_quantized(), q):
            assert torch.equal(got.codes, want.codes) and torch.equal(got.scales, want.scales)
    per_expert = formats.Quantized(fmt, list(q[0].codes), [s.bfloat16().float() for s in q[0].scales], q[0].cols)
    assert ops.PackedExperts(per_expert, q[1], q[2]).format == fmt  # a checkpoint's per-expert tensors


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_experts_op_over_quantized_weights_is_the_bf16_op_of_the_dequantized_weights(fmt, isa, rng):
    """y and every gradient bit for bit those of the bf16 pack of the weights the kernels compute
    with (the bf16 op's own tests hold it to float64 within its bounds)."""
    q = [formats.quantize(w, fmt) for w in weights(rng)]
    quantized = ops.PackedExperts(*q)
    dense = ops.PackedExperts(*(kernel_weights(x) for x in q))
    shapes = ops._lora_shapes(E, H, I, RANK)
    factors = {k: torch.randn(*shapes[k], generator=rng) * 0.3 for k in ops.LORA_NAMES}
    x = torch.randn(T, H, generator=rng).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=rng)[:K] for _ in range(T)]).int()
    w = torch.rand(T, K, generator=rng)
    dy = torch.randn(T, H, generator=rng)

    def run(packed):
        leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()] + \
                 [factors[k].clone().requires_grad_() for k in ops.LORA_NAMES]
        st = mt.stats()
        y = mt.experts(leaves[0], ids, leaves[1], packed, ops.Lora(*leaves[2:], alpha=8.0), stats=st, isa=isa)
        y.backward(dy)
        return [y.detach()] + [t.grad for t in leaves] + [st.m_a, st.m_g]

    for a, b in zip(run(quantized), run(dense)):
        assert torch.equal(a, b)


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="torch.float8_e4m3fn needs torch >= 2.1")
def test_float8_codes_are_taken_as_their_bytes(rng):
    q = [formats.quantize(w, "fp8_e4m3_block128") for w in weights(rng)]
    as_fp8 = formats.Quantized("fp8_e4m3_block128", q[0].codes.view(torch.float8_e4m3fn), q[0].scales, q[0].cols)
    assert torch.equal(q[0].codes.view(torch.float8_e4m3fn).float().double(), code_values(
        "fp8_e4m3_block128", q[0].codes, q[0].cols))  # torch's e4m3 is the format's
    a, b = ops.PackedExperts(as_fp8, q[1], q[2]), ops.PackedExperts(*q)
    assert all(torch.equal(x, y) for x, y in zip(a.unpack(), b.unpack()))


def test_bad_quantized_weights_are_refused_precisely(rng):
    q = [formats.quantize(w, "int8_channel") for w in weights(rng)]
    with pytest.raises(moecert.InvalidArgument, match="format 'int3'"):
        formats.quantize(weights(rng)[0], "int3")
    bad = formats.Quantized("int8_channel", q[0].codes.clone(), q[0].scales, q[0].cols)
    bad.codes[2, 7, 11] = 0x80  # -128: not a symmetric int8 code
    with pytest.raises(moecert.ContractViolation) as e:
        ops.PackedExperts(bad, q[1], q[2])
    assert e.value.clause == "gemm.pack.q_code" and e.value.location == "w[7, 11]"
    bad = formats.Quantized("int8_channel", q[0].codes, q[0].scales.clone(), q[0].cols)
    bad.scales[0, 3, 0] = -1.0
    with pytest.raises(moecert.ContractViolation) as e:
        ops.PackedExperts(bad, q[1], q[2])
    assert e.value.clause == "gemm.pack.q_scale"
    with pytest.raises(moecert.InvalidArgument, match=r"scales\[0\]: shape"):
        ops.PackedExperts(formats.Quantized("int8_channel", q[0].codes, q[0].scales[:, :5], q[0].cols), q[1], q[2])
    with pytest.raises(moecert.InvalidArgument, match="expected formats.Quantized of w_gate's format"):
        ops.PackedExperts(q[0], formats.quantize(weights(rng)[1], "int4_group"), q[2])
    with pytest.raises(moecert.ContractViolation) as e:  # down's shape is not gate's transposed
        ops.PackedExperts(q[0], q[1], formats.quantize(weights(rng)[0], "int8_channel"))
    assert e.value.clause == "experts.pack.shape"


def _twin_layers(rng, fmt):
    """A MoELayer with quantized base weights and one with their dequantized bf16 values, the same
    router and LoRA parameters."""
    torch.manual_seed(5)
    quantized = mt.MoELayer(E, H, I, K, rank=RANK, alpha=8.0, max_tokens=T, out_dtype=torch.float32)
    with torch.no_grad():
        for k in ("b_gate", "b_up", "b_down"):
            getattr(quantized, k).normal_(0, 0.3)
    dense = copy.deepcopy(quantized)
    quantized.quantize_base(fmt)
    q = quantized._packed.unpack_quantized()
    dense.set_base_weights(**{n: kernel_weights(x) for n, x in zip(ops.BASE_NAMES, q)})
    return quantized, dense


@pytest.mark.parametrize("fmt", FORMATS)
def test_moelayer_over_quantized_base_weights(fmt, rng):
    """MoELayer.quantize_base: the layer then computes bit for bit as over the dequantized weights;
    its state_dict holds the codes and scales (and the format), which load_state_dict, deepcopy
    and pickle restore."""
    quantized, dense = _twin_layers(rng, fmt)
    assert quantized.base_format == fmt and dense.base_format == "bf16"
    x = torch.randn(T, H, generator=rng).bfloat16()
    dy = torch.randn(T, H, generator=rng)

    def step(layer):
        xs = x.clone().requires_grad_()
        y = layer(xs)
        y.backward(dy)
        return [y.detach(), xs.grad] + [getattr(layer, n).grad for n in ("router_w",) + ops.LORA_NAMES]

    for a, b in zip(step(quantized), step(dense)):
        assert torch.equal(a, b)
    assert torch.equal(quantized.w_down, dense.w_down)  # the read-only copy: the dequantized weights
    sd = quantized.state_dict()
    assert {"w_gate.codes", "w_gate.scales", "base_format"} <= set(sd) and "w_gate" not in sd
    fresh = mt.MoELayer(E, H, I, K, rank=RANK, alpha=8.0, max_tokens=T, out_dtype=torch.float32)
    result = fresh.load_state_dict(sd)
    assert not result.missing_keys and not result.unexpected_keys and fresh.base_format == fmt
    for other in (fresh, copy.deepcopy(quantized), pickle.loads(pickle.dumps(quantized))):
        assert torch.equal(other(x), quantized(x))
        for got, want in zip(other._packed.unpack_quantized(), quantized._packed.unpack_quantized()):
            assert torch.equal(got.codes, want.codes) and torch.equal(got.scales, want.scales)


def test_quantized_base_weights_are_frozen_and_given_whole(rng):
    layer = mt.MoELayer(E, H, I, K, rank=RANK, max_tokens=T)
    q = [formats.quantize(w, "int8_channel") for w in weights(rng)]
    with pytest.raises(moecert.InvalidArgument, match="give all of w_gate, w_up, w_down"):
        layer.w_gate = q[0]
    layer.set_base_weights(w_gate=q[0], w_up=q[1], w_down=q[2])
    with pytest.raises(moecert.InvalidArgument, match="the base weights are int8_channel; give all"):
        layer.w_up = torch.zeros(E, I, H)
    with pytest.raises(moecert.InvalidArgument, match="quantized base weights are frozen"):
        mt.MoELayer(E, H, I, K, train_base=True).quantize_base("int4_group")
    small = mt.MoELayer(E, H, I // 2, K)
    with pytest.raises((moecert.InvalidArgument, moecert.ContractViolation)):
        small.set_base_weights(w_gate=q[0], w_up=q[1], w_down=q[2])
    sd = layer.state_dict()
    sd["base_format"] = torch.tensor(9)
    with pytest.raises(RuntimeError, match="base_format: 9"):
        mt.MoELayer(E, H, I, K, rank=RANK, max_tokens=T).load_state_dict(sd)


def _deepseek_checkpoint(rng, experts, hidden, inter):
    """A tiny DeepSeek-V3-style layer 3 of FP8 experts: name -> tensor (codes as uint8)."""
    tensors = {}
    for e in range(experts):
        for proj, (rows, cols) in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                                   ("down_proj", (hidden, inter))):
            q = formats.quantize(torch.randn(rows, cols, generator=rng) / cols ** 0.5, "fp8_e4m3_block128")
            name = "model.layers.3.mlp.experts.{}.{}".format(e, proj)
            tensors[name + ".weight"], tensors[name + ".weight_scale_inv"] = q.codes[0], q.scales[0]
    return tensors


def test_a_deepseek_v3_fp8_layer_from_its_checkpoint_tensors(rng):
    """MoELayer(base=formats.deepseek_v3_experts(...)) packs the checkpoint's e4m3 codes and
    weight_scale_inv as they are and computes as over the dequantized weights."""
    tensors = _deepseek_checkpoint(rng, E, H, I)
    base = formats.deepseek_v3_experts(tensors.__getitem__, layer=3, experts=E)
    layer = mt.MoELayer(E, H, I, K, rank=RANK, router="sigmoid_topk", groups=1, topk_group=1, scaling=2.5,
                        max_tokens=T, base=base)
    assert layer.base_format == "fp8_e4m3_block128"
    for got, want in zip(layer._packed.unpack_quantized(), base):
        assert torch.equal(got.codes, torch.stack(want.codes)) and torch.equal(got.scales, torch.stack(want.scales))
    dense = mt.MoELayer(E, H, I, K, rank=RANK, router="sigmoid_topk", scaling=2.5, max_tokens=T,
                        base=tuple(kernel_weights(formats.Quantized(q.format, torch.stack(q.codes),
                                                                    torch.stack(q.scales), q.cols)) for q in base))
    dense.load_state_dict({k: v for k, v in layer.state_dict().items()
                           if not k.startswith(("w_", "base_format"))}, strict=False)
    x = torch.randn(T, H, generator=rng).bfloat16()
    assert torch.equal(layer(x), dense(x))
    with pytest.raises(moecert.InvalidArgument, match="base w_gate"):
        mt.MoELayer(E, H, I, K, base=(torch.zeros(E, I, H + 1),) * 3)


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="float8 safetensors need torch >= 2.1")
def test_formats_checkpoint_reads_fp8_safetensors(rng, tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    tensors = _deepseek_checkpoint(rng, E, H, I)
    stored = {k: (v.view(torch.float8_e4m3fn) if k.endswith(".weight") else v) for k, v in tensors.items()}
    names = sorted(stored)
    safetensors.save_file({k: stored[k] for k in names[:len(names) // 2]}, str(tmp_path / "a.safetensors"))
    safetensors.save_file({k: stored[k] for k in names[len(names) // 2:]}, str(tmp_path / "b.safetensors"))
    weight_map = {k: ("a.safetensors" if i < len(names) // 2 else "b.safetensors") for i, k in enumerate(names)}
    (tmp_path / "model.safetensors.index.json").write_text(__import__("json").dumps({"weight_map": weight_map}))
    base = formats.deepseek_v3_experts(formats.checkpoint(str(tmp_path)), layer=3, experts=E)
    want = formats.deepseek_v3_experts(tensors.__getitem__, layer=3, experts=E)
    a, b = ops.PackedExperts(*base), ops.PackedExperts(*want)
    assert all(torch.equal(x, y) for x, y in zip(a.unpack(), b.unpack()))
