"""moecert.hf.Experts on tensors built here (no transformers needed; CI runs it): transformers 5's
stacked layout (gate_up_proj [E, 2I, H]: the gate's rows then the up projection's; down_proj
[E, H, I]) read right and stored back bitwise; LoRA in PEFT's parametrisation (one A shared by
gate and up) within the op's derived bound of a float64 evaluation, its scale (alpha / r,
rank-stabilised alpha / sqrt(r)), its targets and initialisations; adapters in PEFT's tensor
layout (evaluated here by PEFT's documented formula, not moecert's conversion), read back
bitwise and refused when malformed; merge and unmerge; the per-expert token counts."""
import math
import pickle

import pytest
import torch
from torch import nn

import moecert
import moecert.hf as hf
from moecert.torch import ops

E, H, I, K, T, R = 6, 32, 24, 2, 9, 4
PATH = "model.layers.0.mlp.experts"


def case(seed=3):
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(E, 2 * I, H, generator=g) / math.sqrt(H)
    down = torch.randn(E, H, I, generator=g) / math.sqrt(I)
    x = torch.randn(T, H, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    return gate_up, down, x, idx, w


def evaluate(gate_up, down, x, idx, w):
    """float64 sum_j w * (h Wd^T), h = silu(x Wg^T) * (x Wu^T) rounded to bf16 (the kernel feeds
    bf16 h to down), of float64 weights (gate_up's first I rows: the gate)."""
    x = x.detach().bfloat16().double()
    y = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(K):
            e = int(idx[t, j])
            g, u = gate_up[e, :I] @ x[t], gate_up[e, I:] @ x[t]
            h = (torch.nn.functional.silu(g) * u).bfloat16().double()
            y[t] += float(w[t, j]) * (down[e] @ h)
    return y


def d(t):
    return t.detach().bfloat16().double()


def lora_weights(gate_up, down, experts, scale):
    """The effective float64 weights W + scale B A of the module's factors (bf16-rounded, as the
    kernels read them), from the factors' own names."""
    a, bg, bu = d(experts.lora_A_gate_up), d(experts.lora_B_gate), d(experts.lora_B_up)
    gu = d(gate_up) + scale * torch.cat([bg @ a, bu @ a], 1)
    return gu, d(down) + scale * d(experts.lora_B_down) @ d(experts.lora_A_down)


def peft_weights(gate_up, down, tensors, key, scale, r=R):
    """The effective float64 weights by PEFT's formula for LoRA on 3-D expert parameters:
    ΔW[e] = scale B.reshape(out, r, E)[:, :, e] A.reshape(E, r, in)[e]."""
    out = []
    for base, prefix in ((gate_up, key + ".base_layer."), (down, key + ".")):
        A, B = d(tensors[prefix + "lora_A.weight"]), d(tensors[prefix + "lora_B.weight"])
        A3, B3 = A.reshape(E, r, A.shape[1]), B.reshape(B.shape[0], r, E)
        out.append(d(base) + scale * torch.stack([B3[:, :, e] @ A3[e] for e in range(E)]))
    return out


def trained(experts, std=0.3):
    with torch.no_grad():
        for n, p in experts.named_parameters():
            if n.startswith("lora_B"):
                p.normal_(0, std)
    return experts


def bound_of(experts, x, idx, w):
    if experts.train_base:
        experts.pack_parameters()  # the parameters' current values, packed
    _, saved = ops.experts_forward_train(experts._packed, x.bfloat16(), idx, w, experts.lora())
    return ops.experts_bounds(saved)["y"]


class Model(nn.Module):
    """A module tree with a patched experts module where transformers' Qwen3-MoE has it."""

    def __init__(self, experts):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([nn.Module()])
        self.model.layers[0].mlp = nn.Module()
        self.model.layers[0].mlp.experts = experts


@pytest.mark.parametrize("rslora", [False, True])
def test_stacked_layout_and_lora_within_the_bound(rslora):
    gate_up, down, x, idx, w = case()
    experts = trained(hf.Experts(gate_up, down, rank=R, alpha=8.0, rslora=rslora))
    y = experts(x, idx, w)
    assert y.dtype == torch.float32
    scale = 8.0 / math.sqrt(R) if rslora else 8.0 / R
    assert experts.scale == pytest.approx(scale)
    bound = bound_of(experts, x, idx, w)
    err = (y.double() - evaluate(*lora_weights(gate_up, down, experts, scale), x, idx, w)).abs()
    assert torch.all(err <= bound), float((err - bound).max())
    # (the scale matters: the other one's reference is outside the bound)
    other = 8.0 / R if rslora else 8.0 / math.sqrt(R)
    assert not torch.all((y.double() - evaluate(*lora_weights(gate_up, down, experts, other), x, idx, w)).abs()
                         <= bound)
    assert torch.equal(experts.token_counts, torch.bincount(idx.reshape(-1), minlength=E))


def test_the_shared_a_gets_the_gradients_of_gate_and_up_within_their_bounds():
    gate_up, down, x, idx, w = case()
    experts = trained(hf.Experts(gate_up, down, rank=R, alpha=8.0))
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(5))
    experts(x, idx, w).backward(dy)
    # float64 autograd of the same maths, A used by gate and up
    f = {n: d(getattr(experts, n)).requires_grad_() for n in hf.experts.FACTORS}
    gu = d(gate_up) + 2.0 * torch.cat([f["lora_B_gate"] @ f["lora_A_gate_up"], f["lora_B_up"] @ f["lora_A_gate_up"]], 1)
    dn = d(down) + 2.0 * f["lora_B_down"] @ f["lora_A_down"]
    xs = x.bfloat16().double()
    y = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(K):
            e = int(idx[t, j])
            h = torch.nn.functional.silu(gu[e, :I] @ xs[t]) * (gu[e, I:] @ xs[t])
            y = y.index_add(0, torch.tensor([t]), (float(w[t, j]) * (dn[e] @ h))[None])
    (y * dy.double()).sum().backward()
    _, saved = ops.experts_forward_train(experts._packed, x.bfloat16(), idx, w, experts.lora())
    bounds = ops.experts_bounds(saved, dy, want=("a_gate", "a_up", "b_down"))
    err = (experts.lora_A_gate_up.grad.double() - f["lora_A_gate_up"].grad).abs()
    assert torch.all(err <= bounds["a_gate"] + bounds["a_up"]), float((err - bounds["a_gate"] - bounds["a_up"]).max())
    err = (experts.lora_B_down.grad.double() - f["lora_B_down"].grad).abs()
    assert torch.all(err <= bounds["b_down"])


def test_adapters_in_peft_layout_evaluate_to_the_module_and_read_back_bitwise():
    gate_up, down, x, idx, w = case()
    model = Model(trained(hf.Experts(gate_up, down, rank=R, alpha=8.0)))
    experts = model.model.layers[0].mlp.experts
    tensors, config = hf.adapter_state_dict(model)
    key = "base_model.model." + PATH
    assert {k: tuple(v.shape) for k, v in tensors.items()} == {
        key + ".base_layer.lora_A.weight": (E * R, H), key + ".base_layer.lora_B.weight": (2 * I, R * E),
        key + ".lora_A.weight": (E * R, I), key + ".lora_B.weight": (H, R * E)}
    assert config["target_parameters"] == ["gate_up_proj", "down_proj"] and config["r"] == R
    assert config["lora_alpha"] == 8 and config["target_modules"] == [] and config["peft_type"] == "LORA"
    y = experts(x, idx, w)
    err = (y.double() - evaluate(*peft_weights(gate_up, down, tensors, key, 2.0), x, idx, w)).abs()
    bound = bound_of(experts, x, idx, w)
    assert torch.all(err <= bound), float((err - bound).max())
    fresh = Model(hf.Experts(gate_up, down))
    hf.load_adapter_state_dict(fresh, tensors, config)
    again = fresh.model.layers[0].mlp.experts
    assert again.rank == R and again.targets == hf.PROJECTIONS
    assert torch.equal(again(x, idx, w), y)
    for n, p in experts.named_parameters():
        assert torch.equal(getattr(again, n), p) and getattr(again, n).requires_grad, n


@pytest.mark.parametrize("targets,parameters", [(("gate",), ["gate_up_proj"]), (("down",), ["down_proj"]),
                                                (("up", "down"), ["gate_up_proj", "down_proj"])])
def test_targets_choose_the_adapted_projections(targets, parameters):
    gate_up, down, x, idx, w = case()
    experts = trained(hf.Experts(gate_up, down, rank=R, targets=targets, init=False))
    assert {n.split("_", 2)[2] for n, _ in experts.named_parameters()} <= {"gate_up", "gate", "up", "down"}
    for n, buf in experts.named_buffers():  # the factors of projections not adapted: zero, not trained
        assert not buf.any() and not set(hf.experts.FACTORS[n][1]) & set(targets), n
    tensors, config = hf.adapter_state_dict(Model(experts))
    assert config["target_parameters"] == parameters
    assert len(tensors) == 2 * len(parameters)
    if targets == ("gate",):  # PEFT's gate_up_proj adapter with the up rows of B zero
        b = tensors["base_model.model." + PATH + ".lora_B.weight"]
        assert not b[I:].any() and b[:I].any()


def test_initialisations():
    gate_up, down, _, _, _ = case()
    torch.manual_seed(0)
    zero_b = hf.Experts(gate_up, down, rank=R)
    assert not zero_b.lora_B_gate.any() and zero_b.lora_A_down.abs().max() <= 1 / math.sqrt(I)
    assert zero_b.lora_A_gate_up.abs().max() <= 1 / math.sqrt(H) and zero_b.lora_A_gate_up.std() > 0.5 / math.sqrt(3 * H)
    gaussian = hf.Experts(gate_up, down, rank=R, init="gaussian")
    assert not gaussian.lora_B_down.any() and abs(float(gaussian.lora_A_gate_up.std()) - 1 / R) < 0.05
    random_b = hf.Experts(gate_up, down, rank=R, init=False)
    assert random_b.lora_B_up.any() and random_b.lora_B_up.abs().max() <= 1 / math.sqrt(R * E)
    for kwargs, match in ((dict(dropout=0.1), "dropout=0.1: LoRA dropout"), (dict(init="pissa"), "init='pissa'"),
                          (dict(targets=("q_proj",)), "targets: 'q_proj', expected some of gate, up, down"),
                          (dict(rank=-1), "rank=-1")):
        with pytest.raises(moecert.InvalidArgument, match=match):
            hf.Experts(gate_up, down, **dict(dict(rank=R), **kwargs))


def test_malformed_adapters_are_refused_and_change_nothing():
    gate_up, down, x, idx, w = case()
    tensors, config = hf.adapter_state_dict(Model(trained(hf.Experts(gate_up, down, rank=R))))
    key = "base_model.model." + PATH + ".lora_A.weight"
    target = Model(trained(hf.Experts(gate_up, down, rank=2), 0.1))
    before = target.model.layers[0].mlp.experts(x, idx, w)
    bad = [(dict(tensors, **{key: tensors[key][:-1]}), config, "lora_A.weight: shape .* expected .* \\[24, 24\\]"),
           (dict(tensors, **{key: tensors[key] * float("nan")}), config, "lora_A.weight: not finite"),
           ({k: v for k, v in tensors.items() if k != key}, config, "missing .*experts.lora_A.weight"),
           (dict(tensors, extra=tensors[key]), config, "1 unexpected key \\(extra\\)"),
           (tensors, dict(config, lora_dropout=0.1), "lora_dropout=0.1"),
           (tensors, dict(config, use_dora=True), "use_dora=True"),
           (tensors, dict(config, target_modules=["q_proj"]), "target_modules=\\['q_proj'\\]"),
           (tensors, dict(config, rank_pattern={"x": 2}), "rank_pattern"),
           (tensors, dict(config, r=0), "r=0"),
           (tensors, dict(config, target_parameters=["w1"]), "target_parameters=\\['w1'\\]"),
           (tensors, dict(config, peft_type="IA3"), "peft_type 'IA3'")]
    for t, c, match in bad:
        with pytest.raises(moecert.InvalidArgument, match=match):
            hf.load_adapter_state_dict(target, t, c)
        assert target.model.layers[0].mlp.experts.rank == 2
        assert torch.equal(target.model.layers[0].mlp.experts(x, idx, w), before)


@pytest.mark.parametrize("train_base", [False, True])
def test_merge_folds_the_adapter_and_unmerge_restores_it_bitwise(train_base):
    gate_up, down, x, idx, w = case()
    experts = trained(hf.Experts(gate_up, down, rank=R, alpha=8.0, train_base=train_base))
    y, state = experts(x, idx, w), {k: v.clone() for k, v in experts.state_dict().items()}
    factors = dict(experts.named_parameters())
    gu, dn = lora_weights(gate_up, down, experts, 2.0)
    experts.merge()
    assert experts.merged and experts.lora() is None
    merged = experts.state_dict()  # what the module computes: merged weights, no factors
    assert not any(k.startswith("lora") for k in merged)
    assert torch.equal(merged["gate_up_proj"], gu.bfloat16()) and torch.equal(merged["down_proj"], dn.bfloat16())
    y_merged = experts(x, idx, w)
    bound = bound_of(experts, x, idx, w)
    err = (y_merged.double() - evaluate(gu.bfloat16().double(), dn.bfloat16().double(), x, idx, w)).abs()
    assert torch.all(err <= bound), float((err - bound).max())
    experts.unmerge()
    assert not experts.merged and torch.equal(experts(x, idx, w), y)
    for k, v in experts.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert all(getattr(experts, n) is p for n, p in factors.items())  # the same parameters, for an optimizer
    experts.merge(keep=False)
    assert experts.rank == 0 and torch.equal(experts(x, idx, w), y_merged)
    with pytest.raises(moecert.InvalidArgument, match="merged with keep=False"):
        experts.unmerge()


def test_a_broken_adapter_is_not_merged():
    gate_up, down, x, idx, w = case()
    experts = trained(hf.Experts(gate_up, down, rank=R))
    with torch.no_grad():
        experts.lora_B_down[0, 0, 0] = 1e38
        experts.lora_A_down.fill_(1e10)
    before = experts.state_dict()
    with pytest.raises(moecert.InvalidArgument, match="down_proj: the merged weights are not finite"):
        experts.merge()
    assert not experts.merged
    assert all(torch.equal(v, before[k]) for k, v in experts.state_dict().items())


def test_the_layout_is_stored_back_bitwise():
    gate_up, down, x, idx, w = case()
    experts = hf.Experts(gate_up, down)
    sd = experts.state_dict()
    assert torch.equal(sd["gate_up_proj"], gate_up.bfloat16()) and torch.equal(sd["down_proj"], down.bfloat16())
    assert torch.equal(experts.gate_up_proj, gate_up.bfloat16())
    trained_base = hf.Experts(gate_up, down, train_base=True)
    assert torch.equal(trained_base(x, idx, w), experts(x, idx, w))
    with pytest.raises(moecert.InvalidArgument, match="down_proj: .* expected \\[6, 32, 24\\]"):
        hf.Experts(gate_up, down.transpose(1, 2))


class Qwen3MoeTopKRouter(nn.Module):
    """A gate with the name, attributes and outputs of transformers 5's Qwen3-MoE router; its
    own selection deliberately wrong (the last K experts), so only moecert's can pass."""

    def __init__(self, norm_topk_prob, dtype=torch.float32):
        super().__init__()
        self.top_k, self.norm_topk_prob = K, norm_topk_prob
        self.weight = nn.Parameter(torch.randn(E, H, generator=torch.Generator().manual_seed(7)).to(dtype))

    def forward(self, x):
        logits = torch.nn.functional.linear(x, self.weight)
        ids = torch.arange(E - K, E).expand(x.shape[0], K)
        return logits, torch.full((x.shape[0], K), 0.5, dtype=logits.dtype), ids


class DeepseekV3TopkRouter(Qwen3MoeTopKRouter):
    def __init__(self):
        super().__init__(True)
        self.num_group, self.topk_group, self.routed_scaling_factor = 2, 1, 2.5
        self.register_buffer("e_score_correction_bias", torch.linspace(-0.1, 0.1, E))


class Block(nn.Module):
    """A transformers 5 sparse-MoE block: `gate`, then stacked SwiGLU `experts` of case()'s weights."""

    def __init__(self, gate):
        super().__init__()
        gate_up, down = case()[:2]
        self.gate, self.experts = gate, nn.Module()
        self.experts.gate_up_proj, self.experts.down_proj = nn.Parameter(gate_up), nn.Parameter(down)
        self.experts.act_fn = nn.SiLU()

    def forward(self, x):
        _, w, ids = self.gate(x)
        return self.experts(x, ids, w)


def test_a_registered_router_is_computed_by_moecert_on_the_gates_logits():
    x = case()[2]
    for gate, renorm in ((Qwen3MoeTopKRouter(True), True), (Qwen3MoeTopKRouter(False), False),
                         (Qwen3MoeTopKRouter(True, torch.bfloat16), True), (DeepseekV3TopkRouter(), None)):
        model = nn.Sequential(Block(gate))
        hf.patch(model, router="moecert")
        assert model[0].experts.routed_by == "moecert"
        xs = x.to(gate.weight.dtype)
        logits, w, ids = gate(xs)
        assert w.dtype == (torch.float32 if renorm is None else logits.dtype) and ids.dtype == torch.int64
        z = logits.detach().double()
        if renorm is None:  # DeepSeek-V3: sigmoid, bias for the choice within the best group, scaled
            s = torch.sigmoid(z)
            choice = (s + gate.e_score_correction_bias.double()).reshape(T, 2, E // 2)
            group = choice.topk(2, dim=-1)[0].sum(-1).argmax(-1)
            expected = torch.stack([choice[t, group[t]].topk(K)[1] + group[t] * (E // 2) for t in range(T)])
            exact = 2.5 * s.gather(1, ids) / s.gather(1, ids).sum(1, keepdim=True)
            param, kind = 2.5, "sigmoid_topk"
        else:
            p = torch.softmax(z, -1)
            expected = p.topk(K)[1]
            exact = p.gather(1, ids) / (p.gather(1, ids).sum(1, keepdim=True) if renorm else 1)
            param, kind = renorm, "softmax_topk"
        assert torch.equal(ids.sort(1)[0], expected.sort(1)[0])
        bound, _ = ops.router_bounds(kind, param, logits.float(), ids)
        if w.dtype == torch.bfloat16:  # the family casts its weights to the logits' dtype
            bound = bound + exact.abs() * 2.0 ** -8
        assert torch.all((w.double() - exact).abs() <= bound)
        y = model[0](xs)  # the experts get moecert's routing
        assert torch.equal(y, model[0].experts(xs, ids, w))
        again = pickle.loads(pickle.dumps(model))  # the routing hook travels with the model
        assert torch.equal(again[0](xs), y) and again[0].experts.routed_by == "moecert"
        assert torch.equal(model[0].experts.token_counts, torch.bincount(ids.reshape(-1), minlength=E))


def test_routers_moecert_does_not_compute_are_kept_or_refused():
    x = case()[2]
    odd = DeepseekV3TopkRouter()
    odd.norm_topk_prob = False
    with pytest.raises(moecert.InvalidArgument, match="0.gate: norm_topk_prob=False .*use router='model'"):
        hf.patch(nn.Sequential(Block(odd)), router="moecert")
    model = nn.Sequential(Block(odd))
    hf.patch(model)  # auto: the model's own router
    assert model[0].experts.routed_by == "model"
    assert torch.equal(model[0].gate(x)[2], torch.arange(E - K, E).expand(T, K))
    with pytest.raises(moecert.InvalidArgument, match="router 'mine', expected one of auto, moecert, model|"
                                                      "router='mine'"):
        hf.patch(nn.Sequential(Block(Qwen3MoeTopKRouter(True))), router="mine")


def stored_as(gate_up, down, transposed, concatenated):
    """transformers' other layouts of the same weights: gate and up rows interleaved
    (is_concatenated=False), [E, in, out] (is_transposed)."""
    if not concatenated:
        gate_up = torch.stack([gate_up[:, :I], gate_up[:, I:]], 2).reshape(E, 2 * I, H)
    if transposed:
        gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    return gate_up, down


@pytest.mark.parametrize("transposed,concatenated", [(True, True), (False, False), (True, False)])
def test_transposed_and_interleaved_layouts_are_the_same_experts(transposed, concatenated):
    gate_up, down, x, idx, w = case()
    canonical = trained(hf.Experts(gate_up, down, rank=R, init=False))
    stored = stored_as(gate_up, down, transposed, concatenated)
    other = hf.Experts(*stored, rank=R, transposed=transposed, concatenated=concatenated)
    with torch.no_grad():
        for n, p in canonical.named_parameters():
            getattr(other, n).copy_(p)
    assert torch.equal(other(x, idx, w), canonical(x, idx, w))
    sd = other.state_dict()
    assert torch.equal(sd["gate_up_proj"], stored[0].bfloat16()) and torch.equal(sd["down_proj"], stored[1].bfloat16())
    ours, _ = hf.adapter_state_dict(Model(canonical))
    theirs, _ = hf.adapter_state_dict(Model(other))
    key = "base_model.model." + PATH + ".base_layer.lora_B.weight"  # gate_up_proj's B: rows in the stored order
    b = ours[key] if concatenated else torch.stack([ours[key][:I], ours[key][I:]], 1).reshape(2 * I, -1)
    assert torch.equal(theirs[key], b) and all(torch.equal(theirs[k], v) for k, v in ours.items() if k != key)
    canonical.merge(), other.merge()
    merged = stored_as(canonical.state_dict()["gate_up_proj"], canonical.state_dict()["down_proj"], transposed,
                       concatenated)
    assert torch.equal(other.state_dict()["gate_up_proj"], merged[0])
    assert torch.equal(other.state_dict()["down_proj"], merged[1])
    trains = hf.Experts(*stored, transposed=transposed, concatenated=concatenated, train_base=True)
    assert torch.equal(trains(x, idx, w), hf.Experts(gate_up, down)(x, idx, w))
    with pytest.raises(moecert.InvalidArgument, match="down_proj: .* expected"):
        hf.Experts(stored[0], stored[1].transpose(1, 2), transposed=transposed, concatenated=concatenated)
