"""A small PyTorch MoE layer (router linear, softmax top-k router renormalised over the K selected,
the SwiGLU experts with LoRA of experts.py) for `moecert check` to judge, with its intermediates:

    layer_step(case, dtype)            correct: the router in fp32 (z = x W_r^T + b, the K largest
                                       logits, their softmax), y = experts(x, idx, w) in `dtype`;
                                       backward by autograd: dx, dL/dw, dz, the router linear's
                                       gradients
    layer_step(..., bias=False)        the router bias left out of z
    layer_step(..., router_dx=False)   dx without the router's path (x detached where it meets W_r)
    layer_step(..., softmax_all=True)  the softmax over all E, then the top K renormalised: the same
                                       weights, but autograd's dz at the unselected experts is
                                       rounding noise where the maths gives exactly 0
    layer_step(..., router_dtype=torch.bfloat16)  the router linear in bf16, as a model cast to
                                       bf16 computes it (router_w and router_b bf16 parameters, z
                                       stored in bf16), its softmax in fp32 over the bf16 logits,
                                       the weights stored in bf16
    layer_step(..., softmax_all=True, renormalize=False)  the K largest of the softmax over all E
                                       without renormalising them: another router (a layer declared
                                       renormalised fails it)

Returns (inputs, forward outputs, backward inputs, backward outputs) as the judge names them
(docs/JUDGE.md).
"""
import torch

import experts


def random_case(T=16, E=8, H=40, I=24, K=2, r=4, seed=7):
    """x, the experts' weights and LoRA in bf16; router weights and bias in fp32; dy."""
    inputs, lora = experts.random_case(T=T, E=E, H=H, I=I, K=K, r=r, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    router_w = torch.randn(E, H, generator=gen) * H ** -0.5
    router_b = torch.randn(E, generator=gen) * 0.1
    dy = torch.randn(T, H, generator=gen)
    base = {k: inputs[k] for k in ("x", "w_gate", "w_up", "w_down")}
    return dict(base, router_w=router_w, router_b=router_b, dy=dy, lora=lora, alpha=2.0 * r, K=K)


def layer_step(case, dtype=torch.bfloat16, bias=True, router_dx=True, softmax_all=False, router_dtype=torch.float32,
               renormalize=True):
    x = case["x"].detach().to(dtype).requires_grad_()
    router_w = case["router_w"].detach().to(router_dtype).requires_grad_()
    router_b = case["router_b"].detach().to(router_dtype).requires_grad_()
    xr = (x if router_dx else x.detach()).to(router_dtype)
    z = torch.nn.functional.linear(xr, router_w, router_b if bias else None)
    z.retain_grad()
    if softmax_all:
        top, idx = torch.topk(torch.softmax(z, dim=-1, dtype=torch.float32), case["K"], dim=-1)
        weights = (top / top.sum(dim=-1, keepdim=True) if renormalize else top).to(router_dtype)
    else:
        top, idx = torch.topk(z, case["K"], dim=-1)
        weights = torch.softmax(top.float(), dim=-1).to(router_dtype)
    weights.retain_grad()
    y = experts.experts_forward(x, idx, weights, case["w_gate"], case["w_up"], case["w_down"], case["lora"],
                                case["alpha"], dtype)
    y.backward(case["dy"].to(dtype))
    inputs = {k: case[k] for k in ("x", "w_gate", "w_up", "w_down")}
    inputs.update(router_w=router_w.detach(), router_b=router_b.detach())
    inputs.update(case["lora"])
    forward_out = {"z": z.detach(), "idx": idx.int(), "weights": weights.detach(), "y": y.detach()}
    backward_in = dict(inputs, z=forward_out["z"], idx=forward_out["idx"], weights=forward_out["weights"],
                       dy=case["dy"])
    backward_out = {"dx": x.grad, "dweights": weights.grad, "dz": z.grad, "router_w_grad": router_w.grad,
                    "router_b_grad": router_b.grad}
    return inputs, forward_out, backward_in, backward_out
