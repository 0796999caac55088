"""Four small PyTorch router implementations for `moecert check` to judge.

    product_key_forward          correct: top-K of sx[ix] + sy[iy], ties by expert index
    product_key_forward_ties     correct too, but breaks exact ties towards the higher index
                                 (failure mode 2: two correct kernels "disagree")
    product_key_backward_minus1  decodes a -1 slot as ix = 0, iy = -1 (failure mode 1): the
                                 gradient lands on a real expert
    product_key_backward         correct: -1 slots skipped
    softmax_topk_backward_unmasked  renormalised softmax top-k backward that forgets the mask
                                 (failure mode 5): unselected experts get -p * sum(w g)
    softmax_topk_forward, softmax_topk_backward   correct
    softmax_topk_forward_dense   correct, written as transformers' Qwen and Mixtral blocks: a
                                 softmax over every expert, torch.topk(sorted=False), the K
                                 weights renormalised; slots in whatever order topk leaves them
                                 (here lowest score first)
    softmax_topk_forward_unpaired  the same with each row's weights in the reverse slot order
                                 of its ids: every weight belongs to another expert
    sigmoid_topk_forward         correct: DeepSeek-V3 group-limited routing in fp32 with
                                 torch.topk (its own order among equal scores)
    sigmoid_topk_forward_bias_in_weights   weights from sigma(z) + bias instead of sigma(z)

`save(path, **tensors)` writes a safetensors file with nothing but json and torch (the format:
an 8-byte little-endian header length, a JSON header, the raw bytes).
    python3 examples/judge/routers.py OUT_DIR   writes every case's inputs and outputs
"""
import json
import struct
import sys

import torch

_DTYPES = {torch.float32: "F32", torch.float64: "F64", torch.bfloat16: "BF16",
           torch.float16: "F16", torch.int64: "I64", torch.int32: "I32", torch.int8: "I8",
           torch.uint8: "U8"}


def save(path, dtypes=None, **tensors):
    """A safetensors file of `tensors`; dtypes: {name: safetensors dtype} for tensors stored under
    another name of their bytes (e.g. uint8 e4m3 codes as F8_E4M3)."""
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        raw = t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t
        data = raw.numpy().tobytes()
        header[name] = {"dtype": (dtypes or {}).get(name, _DTYPES[t.dtype]), "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def _key_scores(sx, sy):
    n = sx.shape[1]
    return (sx[:, :, None] + sy[:, None, :]).reshape(sx.shape[0], n * n)


def product_key_forward(sx, sy, k, higher_index_first=False):
    """Top-K experts by sx[ix] + sy[iy] (ties: lower index first, or higher), softmax weights."""
    s = _key_scores(sx.double(), sy.double())  # exact: every float sum fits a double
    e = s.shape[1]
    rank = torch.arange(e, dtype=torch.float64)
    order = []
    for row in s:
        key = sorted(range(e), key=lambda i: (-row[i].item(), -i if higher_index_first else i))
        order.append(key[:k])
    idx = torch.tensor(order, dtype=torch.int64)
    del rank
    w = torch.softmax(torch.gather(s, 1, idx), dim=1).float()
    return idx, w


def product_key_forward_ties(sx, sy, k):
    return product_key_forward(sx, sy, k, higher_index_first=True)


def _product_key_backward(sx, sy, idx, g, minus1_bug):
    n = sx.shape[1]
    dsx, dsy = torch.zeros_like(sx), torch.zeros_like(sy)
    for t in range(idx.shape[0]):
        slots = [j for j in range(idx.shape[1]) if minus1_bug or idx[t, j] >= 0]
        ix = [int(torch.div(idx[t, j], n, rounding_mode="trunc")) for j in slots]
        iy = [int(idx[t, j]) - ix[q] * n for q, j in enumerate(slots)]
        s = torch.stack([sx[t, a].double() + sy[t, b].double() for a, b in zip(ix, iy)])
        w = torch.softmax(s, 0)
        gt = g[t, slots].double()
        ds = w * (gt - (w * gt).sum())
        for q in range(len(slots)):
            dsx[t, ix[q]] += float(ds[q])
            dsy[t, iy[q]] += float(ds[q])  # iy = -1 is the row's last element
    return dsx, dsy


def product_key_backward(sx, sy, idx, g):
    return _product_key_backward(sx, sy, idx, g, minus1_bug=False)


def product_key_backward_minus1(sx, sy, idx, g):
    return _product_key_backward(sx, sy, idx, g, minus1_bug=True)


def softmax_topk_forward(z, k):
    """Top-K by z (ties: lower index first), weights renormalised over the K."""
    e = z.shape[1]
    idx = torch.tensor([sorted(range(e), key=lambda i: (-row[i].item(), i))[:k] for row in z])
    w = torch.softmax(torch.gather(z.double(), 1, idx), dim=1).float()
    return idx, w


def softmax_topk_forward_dense(z, k, unpaired=False):
    """Top-K of softmax(z) over all E by torch.topk(sorted=False), renormalised over the K, slots
    reversed (any order is the implementation's to choose)."""
    p = torch.softmax(z, dim=1)
    w, idx = torch.topk(p, k, dim=1, sorted=False)
    w = w / w.sum(dim=1, keepdim=True)
    order = torch.argsort(torch.gather(z, 1, idx), dim=1, stable=True)  # lowest logit first
    idx, w = torch.gather(idx, 1, order), torch.gather(w, 1, order)
    return idx, (w.flip(1) if unpaired else w)


def softmax_topk_backward(z, idx, g):
    """dz of the renormalised weights: nonzero only at the selected experts."""
    w = torch.softmax(torch.gather(z.double(), 1, idx), dim=1)
    ds = w * (g.double() - (w * g.double()).sum(1, keepdim=True))
    return torch.zeros_like(z, dtype=torch.float64).scatter(1, idx, ds).float()


def softmax_topk_backward_unmasked(z, idx, g):
    """The bug: the softmax over all experts' gradient with g scattered, no mask re-applied."""
    p = torch.softmax(z.double(), 1)
    gfull = torch.zeros_like(p).scatter(1, idx, g.double())
    return (p * (gfull - (p * gfull).sum(1, keepdim=True))).float()


def sigmoid_topk_forward(z, bias, k, groups, topk_group, scaling=1.0, bias_in_weights=False):
    """Selection by sigma(z) + bias within the topk_group groups whose two best such scores sum
    highest; weights c s_j / sum s over the selected (bias steers the selection only)."""
    s = torch.sigmoid(z)
    sel = s + bias
    t, e = z.shape
    group_scores = sel.view(t, groups, e // groups).topk(min(2, e // groups), dim=2).values.sum(2)
    kept = group_scores.topk(topk_group, dim=1).indices
    mask = torch.zeros(t, groups, dtype=torch.bool).scatter(1, kept, True)
    masked = sel.masked_fill(~mask.repeat_interleave(e // groups, dim=1), float("-inf"))
    idx = masked.topk(k, dim=1).indices
    chosen = torch.gather(sel if bias_in_weights else s, 1, idx)
    return idx, (chosen / chosen.sum(1, keepdim=True) * scaling).float()


def write_cases(out):
    """Every implementation's inputs and outputs under out/<case>/{inputs,outputs}.safetensors."""
    import os
    gen = torch.Generator().manual_seed(7)
    t, n, k, e = 6, 4, 3, 12
    sx = torch.randn(t, n, generator=gen)
    sy = torch.randn(t, n, generator=gen)
    tied_x, tied_y = (torch.randint(0, 3, (t, n), generator=gen) / 4.0 for _ in range(2))
    g = torch.randn(t, k, generator=gen)
    # Backward routing with -1 tails; valid slots avoid ix = 0 and iy = n - 1, where the bug lands.
    bidx = torch.tensor([[5, 6, -1], [9, -1, -1], [13, 10, 5], [6, 14, -1], [10, 9, -1], [5, -1, -1]])
    z = torch.randn(t, e, generator=gen)
    zidx, _ = softmax_topk_forward(z, k)
    sz, sbias = torch.randn(t, 8, generator=gen), torch.randn(8, generator=gen) / 8
    sig = dict(groups=4, topk_group=2, scaling=2.5)
    cases = {
        "product_key_forward": (dict(sx=sx, sy=sy), dict(zip(("idx", "w"), product_key_forward(sx, sy, k)))),
        "product_key_forward_ties": (dict(sx=tied_x, sy=tied_y),
                                     dict(zip(("idx", "w"), product_key_forward_ties(tied_x, tied_y, k)))),
        "product_key_backward": (dict(sx=sx, sy=sy, idx=bidx, g=g),
                                 dict(zip(("dsx", "dsy"), product_key_backward(sx, sy, bidx, g)))),
        "product_key_backward_minus1": (dict(sx=sx, sy=sy, idx=bidx, g=g),
                                        dict(zip(("dsx", "dsy"), product_key_backward_minus1(sx, sy, bidx, g)))),
        "softmax_topk_backward": (dict(z=z, idx=zidx, g=g), dict(dz=softmax_topk_backward(z, zidx, g))),
        "softmax_topk_backward_unmasked": (dict(z=z, idx=zidx, g=g),
                                           dict(dz=softmax_topk_backward_unmasked(z, zidx, g))),
        "sigmoid_topk_forward": (dict(z=sz, bias=sbias),
                                 dict(zip(("idx", "w"), sigmoid_topk_forward(sz, sbias, k, **sig)))),
        "sigmoid_topk_forward_bias_in_weights": (
            dict(z=sz, bias=sbias),
            dict(zip(("idx", "w"), sigmoid_topk_forward(sz, sbias, k, bias_in_weights=True, **sig)))),
    }
    for name, (inputs, outputs) in cases.items():
        os.makedirs(os.path.join(out, name), exist_ok=True)
        save(os.path.join(out, name, "inputs.safetensors"), **inputs)
        save(os.path.join(out, name, "outputs.safetensors"), **outputs)
    return list(cases)


if __name__ == "__main__":
    print("\n".join(write_cases(sys.argv[1] if len(sys.argv) > 1 else "build/judge-cases")))
