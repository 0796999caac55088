"""moecert.hf.Experts on tensors built here (no transformers needed; CI runs it): transformers 5's
stacked layout (gate_up_proj [E, 2I, H]: the gate's rows then the up projection's; down_proj
[E, H, I]) read right — y with LoRA within the op's derived bound of a float64 evaluation of the
same maths — stored back bitwise, the LoRA scale (alpha / r, rank-stabilised alpha / sqrt(r)),
the per-expert token counts."""
import math

import pytest
import torch

import moecert
import moecert.hf as hf
from moecert.torch import ops

E, H, I, K, T, R = 6, 32, 24, 2, 9, 4


def case(seed=3):
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(E, 2 * I, H, generator=g) / math.sqrt(H)
    down = torch.randn(E, H, I, generator=g) / math.sqrt(I)
    x = torch.randn(T, H, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    return gate_up, down, x, idx, w


def reference(gate_up, down, lora, scale, x, idx, w):
    """float64 y of the bf16-rounded weights, x and LoRA factors: per slot
    w * ((silu(g) * u) Wd^T + scale (h Ad^T) Bd^T), g = x Wg^T + scale (x Ag^T) Bg^T, likewise u."""
    d = lambda t: t.detach().bfloat16().double()
    gu, dn, x = d(gate_up), d(down), d(x)
    f = {n: d(getattr(lora, n)) for n in ops.LORA_NAMES}
    y = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(K):
            e = int(idx[t, j])
            g = gu[e, :I] @ x[t] + scale * f["b_gate"][e] @ (f["a_gate"][e] @ x[t])
            u = gu[e, I:] @ x[t] + scale * f["b_up"][e] @ (f["a_up"][e] @ x[t])
            h = (torch.nn.functional.silu(g) * u).bfloat16().double()  # the kernel feeds bf16 h to down
            y[t] += float(w[t, j]) * (dn[e] @ h + scale * f["b_down"][e] @ (f["a_down"][e] @ h))
    return y


@pytest.mark.parametrize("rslora", [False, True])
def test_stacked_layout_and_lora_within_the_bound(rslora):
    gate_up, down, x, idx, w = case()
    experts = hf.Experts(gate_up, down, rank=R, alpha=8.0, rslora=rslora)
    with torch.no_grad():
        for n in ("b_gate", "b_up", "b_down"):
            getattr(experts, n).normal_(0, 0.3)
    y = experts(x, idx, w)
    assert y.dtype == torch.float32
    scale = 8.0 / math.sqrt(R) if rslora else 8.0 / R
    lora = experts.lora()
    _, saved = ops.experts_forward_train(experts._packed, x.bfloat16(), idx, w, lora)
    bound = ops.experts_bounds(saved)["y"]
    err = (y.double() - reference(gate_up, down, lora, scale, x, idx, w)).abs()
    assert torch.all(err <= bound), float((err - bound).max())
    # (the scale matters: the other one's reference is outside the bound)
    other = 8.0 / R if rslora else 8.0 / math.sqrt(R)
    assert not torch.all((y.double() - reference(gate_up, down, lora, other, x, idx, w)).abs() <= bound)
    assert torch.equal(experts.token_counts, torch.bincount(idx.reshape(-1), minlength=E))


def test_the_layout_is_stored_back_bitwise():
    gate_up, down, x, idx, w = case()
    experts = hf.Experts(gate_up, down)
    sd = experts.state_dict()
    assert torch.equal(sd["gate_up_proj"], gate_up.bfloat16()) and torch.equal(sd["down_proj"], down.bfloat16())
    assert torch.equal(experts.gate_up_proj, gate_up.bfloat16())
    trained = hf.Experts(gate_up, down, train_base=True)
    assert torch.equal(trained(x, idx, w), experts(x, idx, w))
    with pytest.raises(moecert.InvalidArgument, match="down_proj: .* expected \\[6, 32, 24\\]"):
        hf.Experts(gate_up, down.transpose(1, 2))
