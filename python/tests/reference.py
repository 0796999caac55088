"""The maths of moecert's ops in float64 PyTorch autograd, written from
docs/DESIGN.md independently of moecert (the tests' reference)."""
import numpy as np
import torch
import torch.nn.functional as F

D = torch.float64


def f64(t):
    return t.detach().to(D).clone().requires_grad_()


def scale_of(alpha, rank):
    """s = float(alpha / r): the fp32 scale the kernels use."""
    return float(np.float32(alpha / rank)) if rank else 0.0


def expert(e, x, p, s):
    """One expert's output o and intermediate h for rows x [n, H] (LoRA when p has a_gate)."""
    g = x @ p["w_gate"][e].T
    u = x @ p["w_up"][e].T
    if "a_gate" in p:
        g = g + s * (x @ p["a_gate"][e].T) @ p["b_gate"][e].T
        u = u + s * (x @ p["a_up"][e].T) @ p["b_up"][e].T
    h = F.silu(g) * u
    o = h @ p["w_down"][e].T
    if "a_down" in p:
        o = o + s * (h @ p["a_down"][e].T) @ p["b_down"][e].T
    return o, h


def experts(x, ids, w, p, s):
    """y [T, H] = sum_j w[t, j] o_{t, ids[t, j]}; -1 slots add nothing. Also h per (t, j) (or None)."""
    T, K = ids.shape
    y = torch.zeros(T, x.shape[1], dtype=D)
    hs = {}
    for t in range(T):
        for j in range(K):
            e = int(ids[t, j])
            if e < 0:
                continue
            o, h = expert(e, x[t:t + 1], p, s)
            y[t] = y[t] + w[t, j] * o[0]
            hs[t, e] = h[0]
    return y, hs


def stats(x, ids, w, p, s, dy, trainable):
    """M_A, M_G [T, E]: ||(x_t, h_te)|| and the norm of token t's own gradient of expert e's
    trainable matrices, by autograd of <dy_t, y_t> one token at a time."""
    T, K = ids.shape
    E = p["w_gate"].shape[0]
    m_a = torch.zeros(T, E, dtype=D)
    m_g = torch.zeros(T, E, dtype=D)
    for t in range(T):
        if bool((ids[t] < 0).all()):
            continue
        y, hs = experts(x[t:t + 1], ids[t:t + 1], w[t:t + 1], p, s)
        grads = torch.autograd.grad((dy[t:t + 1] * y).sum(), [p[n] for n in trainable], allow_unused=True)
        for j in range(K):
            e = int(ids[t, j])
            if e < 0:
                continue
            m_a[t, e] = torch.sqrt(x[t].square().sum() + hs[0, e].square().sum())
            m_g[t, e] = torch.sqrt(sum(g[e].square().sum() for g in grads if g is not None))
    return m_a, m_g


def softmax_topk_weights(z, idx, renormalize):
    """The router weights of the selection idx from logits z [T, E] (float64)."""
    sel = z.gather(1, idx.long())
    if renormalize:
        return torch.softmax(sel, dim=1)
    return torch.softmax(z, dim=1).gather(1, idx.long())


def sigmoid_topk_weights(z, idx, scaling):
    s = torch.sigmoid(z).gather(1, idx.long())
    return scaling * s / s.sum(dim=1, keepdim=True)


def product_key_weights(sx, sy, idx, mode):
    n = sx.shape[1]
    ix, iy = idx.long() // n, idx.long() % n
    s = sx.gather(1, ix) + sy.gather(1, iy)
    return {"raw": s, "exp": torch.exp(s), "softmax": torch.softmax(s, dim=1)}[mode]


def top_k(scores, k):
    """Selection under the total order (score desc, index asc), in float64."""
    order = sorted(range(scores.shape[0]), key=lambda i: (-float(scores[i]), i))
    return order[:k]


def softmax_topk_select(z, k):
    return torch.tensor([top_k(row, k) for row in z], dtype=torch.int32)


def sigmoid_topk_select(z, bias, k, groups, topk_group):
    out = []
    E = z.shape[1]
    per = E // groups
    for row in z:
        sel = torch.sigmoid(row) + bias.to(D)
        score = [float(torch.topk(sel[g * per:(g + 1) * per], min(2, per)).values.sum()) for g in range(groups)]
        kept = sorted(range(groups), key=lambda g: (-score[g], g))[:topk_group]
        masked = torch.full((E,), -float("inf"), dtype=D)
        for g in kept:
            masked[g * per:(g + 1) * per] = sel[g * per:(g + 1) * per]
        out.append(top_k(masked, k))
    return torch.tensor(out, dtype=torch.int32)


def product_key_select(sx, sy, k):
    n = sx.shape[1]
    s = (sx.unsqueeze(2) + sy.unsqueeze(1)).reshape(sx.shape[0], n * n)
    return torch.tensor([top_k(row, k) for row in s], dtype=torch.int32)
