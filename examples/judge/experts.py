"""Small PyTorch implementations of the experts op (SwiGLU experts with LoRA, the caller's
routing) for `moecert check` to judge.

    experts_forward(..., dtype)      correct: per expert, g = x W_g^T + s (x A_g^T) B_g^T, u likewise,
                                     h = silu(g) u, o = h W_d^T + s (h A_d^T) B_d^T, y = sum_j w_j o_j;
                                     every op in `dtype` (bfloat16: PyTorch eager's rounding after each)
    experts_forward_swapped          the bug of silu applied to u instead of g
    experts_forward(..., h_bf16=True)  h stored in bf16 in an otherwise float32 implementation
    experts_forward_stacked(x, idx, weights, gate_up_proj, down_proj, dtype)   correct, in
                                     transformers 5's stacked layout: gate_up_proj [E, 2I, H] holds
                                     W_g then W_u along its rows, down_proj [E, H, I]; gate and up
                                     are the two halves of x gate_up_proj[e]^T (no LoRA)
    experts_forward_stacked(..., halves_swapped=True)  the halves read the other way round (up,
                                     gate): silu applied to u
    stacked(forward)                 the suite's callable (moecert.testing) of a stacked-layout
                                     forward: W_g and W_u stacked into gate_up_proj, dx and dL/dw
                                     by autograd when dy is given
    experts_backward(..., dtype)     dx and dL/dw of experts_forward by autograd (and, asked, the
                                     LoRA factors' and base weights' gradients)
    experts_backward_no_lora_dx      the LoRA path left out of dx (x detached where it meets A)
    experts_backward(..., dg_truncated=True)  dL/dg cut to bf16 by truncation (>> 16) on its way to
                                     the gate's gradients, as a kernel that truncates an operand
    dequantize(format, codes, scales, cols)  quantized base weights (codes [E, rows, row bytes]
                                     uint8, scales fp32) as fp32 code * scale, from the formats'
                                     definitions: int8_channel (a scale per row), int4_group
                                     (two codes per byte, element 2j low; a scale per row and 128
                                     columns), fp8_e4m3_block128 (e4m3 codes, a scale per 128 x 128)
    dequantize(..., scale_block_rows=1)  the bug of reading fp8's 128 x 128 scales as per-row ones
                                     (rows past the scale rows take the last)

Weights are stacked by expert as moecert takes them: w_gate, w_up [E, I, H], w_down [E, H, I]; LoRA
a_gate, a_up [E, r, H], b_gate, b_up [E, I, r], a_down [E, r, I], b_down [E, H, r], scale alpha / r.
"""
import torch


class _TruncatedGrad(torch.autograd.Function):
    """The identity; its backward hands on the gradient cut to bf16 by truncation."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return (grad.float().view(torch.int32) & -65536).view(torch.float32).to(grad.dtype)


def experts_forward(x, idx, weights, w_gate, w_up, w_down, lora=None, alpha=None,
                    dtype=torch.bfloat16, swapped=False, lora_dx=True, h_bf16=False, dg_truncated=False):
    T, H = x.shape
    E = w_gate.shape[0]
    x = x.to(dtype)  # (the same tensor when already of dtype: autograd reaches the caller's)
    y = torch.zeros(T, H, dtype=dtype)
    s = alpha / lora["a_gate"].shape[1] if lora else 0.0
    for e in range(E):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        xe = x[tok]
        xl = xe if lora_dx else xe.detach()
        g = xe @ w_gate[e].to(dtype).T
        u = xe @ w_up[e].to(dtype).T
        if lora:
            g = g + ((xl @ lora["a_gate"][e].to(dtype).T) @ lora["b_gate"][e].to(dtype).T) * s
            u = u + ((xl @ lora["a_up"][e].to(dtype).T) @ lora["b_up"][e].to(dtype).T) * s
        if swapped:
            g, u = u, g
        if dg_truncated:
            g = _TruncatedGrad.apply(g)
        h = torch.nn.functional.silu(g) * u
        if h_bf16:
            h = h.bfloat16().to(dtype)
        o = h @ w_down[e].to(dtype).T
        if lora:
            o = o + ((h @ lora["a_down"][e].to(dtype).T) @ lora["b_down"][e].to(dtype).T) * s
        y.index_add_(0, tok, weights[tok, slot].to(dtype)[:, None] * o)
    return y


def experts_forward_stacked(x, idx, weights, gate_up_proj, down_proj, dtype=torch.bfloat16, halves_swapped=False):
    T, H = x.shape
    x = x.to(dtype)
    y = torch.zeros(T, H, dtype=dtype)
    for e in range(gate_up_proj.shape[0]):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gate, up = torch.nn.functional.linear(x[tok], gate_up_proj[e].to(dtype)).chunk(2, dim=-1)
        if halves_swapped:
            gate, up = up, gate
        o = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, down_proj[e].to(dtype))
        y.index_add_(0, tok, o * weights[tok, slot, None].to(dtype))
    return y


def stacked(forward):
    """fn(x, idx, weights, w_gate, w_up, w_down, lora=None, alpha=None, dy=None) of moecert.testing
    over `forward` (experts_forward_stacked with its options bound): y, or (dx, dweights) with dy."""
    def fn(x, idx, weights, w_gate, w_up, w_down, lora=None, alpha=None, dy=None):
        if lora is not None:
            raise ValueError("the stacked layout here has no LoRA")
        gate_up = torch.cat([w_gate, w_up], dim=1)
        if dy is None:
            return forward(x, idx, weights, gate_up, w_down)
        x, weights = x.detach().clone().requires_grad_(), weights.detach().clone().requires_grad_()
        y = forward(x, idx, weights, gate_up, w_down)
        y.backward(dy.to(y.dtype))
        return x.grad, weights.grad
    return fn


def experts_forward_swapped(*args, **kwargs):
    return experts_forward(*args, swapped=True, **kwargs)


def experts_backward(x, idx, weights, w_gate, w_up, w_down, dy, lora=None, alpha=None,
                     dtype=torch.bfloat16, lora_dx=True, weight_grads=False, dg_truncated=False):
    """(dx, dweights) of experts_forward for dy, by autograd in `dtype`; with weight_grads also
    {name: gradient} of the LoRA factors and the base weights (a_gate, ..., w_down)."""
    x = x.detach().to(dtype).requires_grad_()
    weights = weights.detach().clone().requires_grad_()
    leaves = {"w_gate": w_gate, "w_up": w_up, "w_down": w_down, **(lora or {})}
    if weight_grads:
        leaves = {k: v.detach().float().requires_grad_() for k, v in leaves.items()}  # fp32 gradients
    base = [leaves[k] for k in ("w_gate", "w_up", "w_down")]
    lora = {k: leaves[k] for k in lora} if lora else None
    y = experts_forward(x, idx, weights, *base, lora, alpha, dtype, lora_dx=lora_dx, dg_truncated=dg_truncated)
    y.backward(dy.to(dtype))
    if not weight_grads:
        return x.grad, weights.grad
    return x.grad, weights.grad, {k: v.grad for k, v in leaves.items()}


def experts_backward_no_lora_dx(*args, **kwargs):
    return experts_backward(*args, lora_dx=False, **kwargs)


def random_case(T=12, E=6, H=40, I=24, K=2, r=4, seed=5):
    """Inputs in bf16 (x, weights, LoRA), routing with -1 tails, fp32 routing weights."""
    gen = torch.Generator().manual_seed(seed)
    bf = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale).bfloat16()  # noqa: E731
    x = bf(T, H)
    w_gate, w_up = bf(E, I, H, scale=H ** -0.5), bf(E, I, H, scale=H ** -0.5)
    w_down = bf(E, H, I, scale=I ** -0.5)
    lora = {"a_gate": bf(E, r, H, scale=H ** -0.5), "b_gate": bf(E, I, r, scale=0.3),
            "a_up": bf(E, r, H, scale=H ** -0.5), "b_up": bf(E, I, r, scale=0.3),
            "a_down": bf(E, r, I, scale=I ** -0.5), "b_down": bf(E, H, r, scale=0.3)}
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).int()
    idx[::3, K - 1] = -1
    weights = torch.rand(T, K, generator=gen) * (idx >= 0)
    return dict(x=x, idx=idx, weights=weights, w_gate=w_gate, w_up=w_up, w_down=w_down), lora


def _code_values(fmt, codes, cols):
    """float64 values of codes [..., rows, row bytes] uint8."""
    if fmt == "int8_channel":
        return codes.view(torch.int8).double()
    if fmt == "int4_group":
        nib = torch.stack([codes & 15, codes >> 4], -1).reshape(*codes.shape[:-1], -1)[..., :cols].to(torch.int16)
        return torch.where(nib >= 8, nib - 16, nib).double()
    c = codes.to(torch.int64)  # e4m3: S.EEEE.MMM, bias 7, exponent 0 subnormal
    e, m = (c >> 3) & 15, (c & 7).double()
    mag = torch.where(e == 0, m * 2.0 ** -9, (8 + m) * torch.pow(2.0, (e - 10).double()))
    return torch.where((c >> 7) == 1, -mag, mag)


def dequantize(fmt, codes, scales, cols, scale_block_rows=None):
    """[E, rows, cols] fp32 of quantized weights (see the module docstring)."""
    br, bc = {"int8_channel": (1, cols), "int4_group": (1, 128), "fp8_e4m3_block128": (128, 128)}[fmt]
    v = _code_values(fmt, codes, cols)
    r = torch.clamp(torch.arange(v.shape[1]) // (scale_block_rows or br), max=scales.shape[1] - 1)
    return (v * scales.double()[:, r][:, :, torch.arange(cols) // bc]).float()
