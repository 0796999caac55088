"""Live PyTorch peer: moecert's layer and experts op against a straightforward
PyTorch eager bf16 implementation of the same layer, in one process.

    python3 -m moecert.bench [--tokens 48 1024 4096] [--reps 5] [--json FILE] [--shape tiny]

For each T, forward+backward of each case: moecert (through moecert.torch, as a
user calls it) and the eager peer in alternation (moecert, peer, moecert, ...),
so both meet the same moments of a shared machine, each timed run after 20 ms
of untimed runs of the same side (as the C++ bench); median times and the median
of the per-repetition ratios (paired). The two results are compared (largest
difference relative to the largest magnitude of each output). Cases:

  layer    MoELayer: router linear + softmax top-k (renormalised) + experts with
           LoRA on gate, up and down; the peer routes with the same logits in
           fp32 and loops over the experts in bf16 (index_add_ combine); LoRA and
           router parameters trained (base frozen), x requires grad.
  experts  moecert.torch.experts on the caller's routing (K distinct experts per
           token, uniform; weights in [0, 1)) against the peer's expert loop.
  overhead a training step (forward+backward) through MoELayer against the bare
           ops calls doing the same work in C (ctypes, outputs allocated): the
           Python layer's cost per step; within MoELayer's steps, the time
           outside the C calls over the time in them (python_share); and the
           step's time with the C calls replaced by no-ops (python_alone_ms):
           the same Python work on warm caches. The difference is the refill
           of caches and TLB that the op's weight streams (about 1 GB per step
           at T = 48) leave cold for whatever code runs next. floor_share: the
           same measure for a bare autograd.Function making the same two C
           calls with every argument formed before the steps (torch's and
           ctypes' own cost, the least any package over the ABI pays);
           floor1_share: the same with x and one parameter as the Function's
           only inputs (the least any autograd integration has);
           experts_share: python_share of moecert.torch.experts on the
           caller's routing.
           raw_ratio: MoELayer's step against those two C calls made back to
           back with their outputs reused, as the C++ bench runs the op
           (paired, alternating; raw_ms: their time; inside_ms: the time in
           the C calls within MoELayer's step).
"""
import argparse
import contextlib
import ctypes
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import moecert
import moecert.torch as mt
from moecert import _abi
from moecert.torch import ops

SHAPES = {"paper": dict(experts=64, hidden=2048, inter=1408, topk=6, rank=8),
          "tiny": dict(experts=8, hidden=128, inter=256, topk=2, rank=4)}


class EagerMoE:
    """The layer as a PyTorch user writes it in eager mode, bf16, autograd for the backward."""

    def __init__(self, layer):
        c = layer.config
        self.E, self.K, self.s = c.experts, c.topk, float(c.lora_alpha / c.lora_rank)
        clone = lambda t, grad: t.detach().to(torch.bfloat16).clone().requires_grad_(grad)
        self.wg, self.wu, self.wd = (clone(getattr(layer, n), False) for n in ops.BASE_NAMES)
        self.lora = {n: clone(getattr(layer, n), True) for n in ops.LORA_NAMES}
        self.router_w = layer.router_w.detach().clone().requires_grad_(True)
        self.router_b = layer.router_b.detach().clone().requires_grad_(True)

    def params(self):
        return list(self.lora.values()) + [self.router_w, self.router_b]

    def route(self, x):
        z = x.float() @ self.router_w.T + self.router_b
        sel, idx = torch.topk(z, self.K, dim=1)
        return idx, torch.softmax(sel, dim=1)

    def experts(self, x, idx, w):
        L, s = self.lora, self.s
        y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
        for e in range(self.E):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            xe = x[tok]
            g = xe @ self.wg[e].T + s * (xe @ L["a_gate"][e].T) @ L["b_gate"][e].T
            u = xe @ self.wu[e].T + s * (xe @ L["a_up"][e].T) @ L["b_up"][e].T
            h = F.silu(g) * u
            o = h @ self.wd[e].T + s * (h @ L["a_down"][e].T) @ L["b_down"][e].T
            y = y.index_add(0, tok, o.float() * w[tok, slot].unsqueeze(1))
        return y

    def layer(self, x):
        idx, w = self.route(x)
        return self.experts(x, idx, w)


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1e3, out


SETTLE_S = 0.020


def settled(fn):
    """One timed call of fn after untimed calls of it for at least SETTLE_S, as the C++ bench
    does (bench/bench.cpp): the other side's threads keep spinning after their last parallel
    region (torch's OpenMP pool, moecert's oneTBB workers) and its data fills the caches."""
    until = time.perf_counter() + SETTLE_S
    fn()
    while time.perf_counter() < until:
        fn()
    return timed(fn)[0]


def alternate(reps, ours, peer):
    """Times ours() and peer() in alternation, each settled: (ours ms, peer ms) lists."""
    a, b = [], []
    for _ in range(reps):
        a.append(settled(ours))
        b.append(settled(peer))
    return a, b


def rel_diff(ours, theirs):
    ours, theirs = ours.detach().double(), theirs.detach().double()
    scale = float(theirs.abs().max()) or 1.0
    return float((ours - theirs).abs().max()) / scale


def summary(name, T, a, b, diffs):
    ratios = [y / x for x, y in zip(a, b)]
    worst = max(diffs, key=lambda kv: kv[1])
    return {"case": name, "tokens": T, "moecert_ms": statistics.median(a), "peer_ms": statistics.median(b),
            "speedup": statistics.median(b) / statistics.median(a), "paired_speedup": statistics.median(ratios),
            "moecert_runs_ms": a, "peer_runs_ms": b, "largest_rel_diff": worst[1], "largest_rel_diff_of": worst[0]}


def layer_case(layer, peer, x, dy, reps):
    xm = x.clone().requires_grad_(True)
    xp = x.clone().requires_grad_(True)
    trainable = [p for p in layer.parameters() if p.requires_grad]

    def ours():
        for p in trainable + [xm]:
            p.grad = None
        y = layer(xm)
        y.backward(dy)
        return y

    def theirs():
        for p in peer.params() + [xp]:
            p.grad = None
        y = peer.layer(xp)
        y.backward(dy)
        return y

    a, b = alternate(reps, ours, theirs)
    ym, yp = ours(), theirs()
    diffs = [("y", rel_diff(ym, yp)), ("dx", rel_diff(xm.grad, xp.grad)),
             ("router_w", rel_diff(layer.router_w.grad, peer.router_w.grad))]
    diffs += [(n, rel_diff(getattr(layer, n).grad, peer.lora[n].grad)) for n in ops.LORA_NAMES]
    return a, b, diffs


def experts_case(layer, peer, x, dy, reps, gen):
    c = layer.config
    T = x.shape[0]
    idx = torch.stack([torch.randperm(c.experts, generator=gen)[:c.topk] for _ in range(T)])
    w = torch.rand(T, c.topk, generator=gen)
    lora = layer.lora()
    xm, xp = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    wm, wp = w.clone().requires_grad_(True), w.clone().requires_grad_(True)
    idx32 = idx.to(torch.int32)
    params = [getattr(layer, n) for n in ops.LORA_NAMES]

    def ours():
        for p in params + [xm, wm]:
            p.grad = None
        y = mt.experts(xm, idx32, wm, layer._packed, lora)
        y.backward(dy)
        return y

    def theirs():
        for p in list(peer.lora.values()) + [xp, wp]:
            p.grad = None
        y = peer.experts(xp, idx, wp)
        y.backward(dy)
        return y

    a, b = alternate(reps, ours, theirs)
    ym, yp = ours(), theirs()
    diffs = [("y", rel_diff(ym, yp)), ("dx", rel_diff(xm.grad, xp.grad)), ("dweights", rel_diff(wm.grad, wp.grad))]
    diffs += [(n, rel_diff(getattr(layer, n).grad, peer.lora[n].grad)) for n in ops.LORA_NAMES]
    return a, b, diffs


def overhead_case(layer, x, dy, reps):
    """A training step through MoELayer (checks, autograd) against the bare ops calls doing the
    same work in C (the fp32 LoRA factors, dx in bf16, one reused saved state): what the Python
    layer adds per step."""
    lora = layer.lora()
    factors = ops.Lora(*(f.detach() for f in lora.factors()), alpha=lora.alpha)
    rw, rb = layer.router_w.detach(), layer.router_b.detach()
    saved = ops.LayerSaved()
    want = ("dx", "router_w", "router_b") + ops.LORA_NAMES

    def bare():
        ops.layer_forward(layer.config, layer._packed, rw, rb, x, None, factors, saved)
        ops.layer_backward(saved, dy, want, dx_dtype=x.dtype)

    return alternate(reps, _module_step(layer, x, dy), bare)


def _module_step(layer, x, dy):
    """A training step through MoELayer: gradients cleared, forward, backward from dy."""
    xm = x.clone().requires_grad_(True)
    trainable = [p for p in layer.parameters() if p.requires_grad]

    def step():
        for p in trainable + [xm]:
            p.grad = None
        layer(xm).backward(dy)

    return step


def python_share(layer, x, dy, reps):
    """Per training step through MoELayer: the time outside moecert's C calls over the time in
    them (each ABI call timed where the package makes it), and that time (ms), per step."""
    with _timed_calls() as inside:
        return _shares(lambda xm, *_: layer(xm), [p for p in layer.parameters() if p.requires_grad], x, dy,
                       inside, reps)


def experts_share(layer, x, dy, reps, gen):
    """python_share's measure for moecert.torch.experts on the caller's routing (as the experts
    case: K distinct experts per token, weights in [0, 1)), x, the weights and the LoRA factors
    trained."""
    c, T = layer.config, x.shape[0]
    idx = torch.stack([torch.randperm(c.experts, generator=gen)[:c.topk] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, c.topk, generator=gen).requires_grad_(True)
    lora = layer.lora()
    with _timed_calls() as inside:
        return _shares(lambda xm, *_: mt.experts(xm, idx, w, layer._packed, lora), [w] + list(lora.factors()), x,
                       dy, inside, reps)


@contextlib.contextmanager
def _timed_calls():
    """Within the block, each ABI call's time adds to inside[0] (the list yielded)."""
    inside, real = [0.0], _abi.call

    def timed(name, *args):
        t0 = time.perf_counter()
        try:
            return real(name, *args)
        finally:
            inside[0] += time.perf_counter() - t0

    _abi.call = timed
    try:
        yield inside
    finally:
        _abi.call = real


def _shares(step, trainable, x, dy, inside, reps):
    """Per training step step(x, *trainable).backward(dy): the time outside the C calls over
    inside[0], the time in them (which the calls add to), and that time in ms; the first step
    warms up."""
    xm = x.clone().requires_grad_(True)
    shares, ms = [], []
    for i in range(reps + 1):
        for p in trainable + [xm]:
            p.grad = None
        inside[0] = 0.0
        t0 = time.perf_counter()
        step(xm, *trainable).backward(dy)
        total = time.perf_counter() - t0
        if i:
            shares.append((total - inside[0]) / inside[0])
            ms.append(inside[0] * 1e3)
    return shares, ms


class _RawCalls:
    """moecert_layer_forward and moecert_layer_backward through ctypes with every argument struct
    formed once (x, dy, the weights and the outputs): the least any package over the ABI can do.
    forward(y) and backward(grads) take the output tensors' addresses; run() reuses its own, as the
    C++ bench reuses its outputs."""

    def __init__(self, layer, x, dy):
        lora = layer.lora()
        self.w, _, _ = ops._layer_weights(layer.config, layer._packed, layer.router_w, layer.router_b, None, lora)
        self.cfg, self.saved = layer.config.struct(), ops.LayerSaved()
        self.shapes = ops._layer_grad_shapes(layer.config, x.shape[0])
        self.names = ("router_w", "router_b") + ops.LORA_NAMES
        self.x, self.dy, self.hidden = x, dy, layer.config.hidden
        self.xd, self.dyd = ops.describe(x), ops.describe(dy)
        self.y = torch.empty(x.shape[0], layer.config.hidden)
        self.yd = ops.describe(self.y)
        self.grads = _abi.LayerGrads()
        self.outs = self.new_grads()
        self._point(self.outs)
        self.opts = ops._options(None)
        self.fwd, self.bwd = _abi.lib.moecert_layer_forward, _abi.lib.moecert_layer_backward
        self.args_f = (ctypes.byref(self.cfg), ctypes.byref(self.w), ctypes.byref(self.xd), ctypes.byref(self.yd),
                       self.saved.ptr, ctypes.byref(self.opts))
        self.args_b = (ctypes.byref(self.cfg), ctypes.byref(self.w), ctypes.byref(self.xd), ctypes.byref(self.dyd),
                       self.saved.ptr, ctypes.byref(self.grads), 1, 1)

    def new_grads(self):
        return [torch.empty(self.shapes["dx"], dtype=self.x.dtype)] + [torch.empty(self.shapes[n])
                                                                        for n in self.names]

    def _point(self, outs):
        self.grads.dx = ops.describe(outs[0])
        for n, t in zip(self.names, outs[1:]):
            setattr(self.grads, n, ops.describe(t))

    def forward(self, y):
        self.yd.data = y.data_ptr()
        status = self.fwd(*self.args_f)
        if status:
            _abi.raise_for(_abi.status_name(status), _abi.lib.moecert_last_error().contents)

    def backward(self, outs):
        self.grads.dx.data = outs[0].data_ptr()
        for n, t in zip(self.names, outs[1:]):
            getattr(self.grads, n).data = t.data_ptr()
        status = self.bwd(*self.args_b)
        if status:
            _abi.raise_for(_abi.status_name(status), _abi.lib.moecert_last_error().contents)

    def run(self):
        self.forward(self.y)
        self.backward(self.outs)


def raw_case(layer, x, dy, reps):
    """A training step through MoELayer against the same two C calls made back to back with every
    argument formed once and the outputs reused (_RawCalls.run), alternating: the step's time over
    the op's as run from C."""
    return alternate(reps, _module_step(layer, x, dy), _RawCalls(layer, x, dy).run)


def floor_share(layer, x, dy, reps, inputs=None):
    """python_share's measure for the least a torch.autograd.Function can do around the same two C
    calls: every argument struct formed before the steps, per step only the outputs allocated and
    their addresses written; what is left is torch's (autograd, allocation) and ctypes'. inputs:
    the parameters autograd sees besides x (default: the router's and the six LoRA factors; one
    gives the least any autograd integration has, x and a single parameter)."""
    raw, inside = _RawCalls(layer, x, dy), [0.0]
    lora = layer.lora()
    trainable = [layer.router_w, layer.router_b] + list(lora.factors())
    given = trainable[:inputs] if inputs else trainable

    class Bare(torch.autograd.Function):
        @staticmethod
        def forward(ctx, xin, *params):
            y = torch.empty(xin.shape[0], raw.hidden)
            t0 = time.perf_counter()
            raw.forward(y)
            inside[0] += time.perf_counter() - t0
            return y

        @staticmethod
        def backward(ctx, g):
            out = raw.new_grads()
            t0 = time.perf_counter()
            raw.backward(out)
            inside[0] += time.perf_counter() - t0
            return tuple(out[:1 + len(given)])

    return _shares(Bare.apply, given, x, dy, inside, reps)


def python_alone(layer, x, dy, reps):
    """A training step through MoELayer with every C call a no-op (outputs left unwritten):
    the Python and torch bookkeeping alone, on warm caches; median ms over 20 * reps steps."""
    xm = x.clone().requires_grad_(True)
    trainable = [p for p in layer.parameters() if p.requires_grad]
    real, times = _abi.call, []
    _abi.call = lambda name, *args: True  # "OK", nothing written
    try:
        for i in range(20 * reps + 5):
            for p in trainable + [xm]:
                p.grad = None
            t0 = time.perf_counter()
            layer(xm).backward(dy)
            if i >= 5:
                times.append((time.perf_counter() - t0) * 1e3)
    finally:
        _abi.call = real
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python3 -m moecert.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[48, 1024, 4096])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="paper")
    ap.add_argument("--threads", type=int, default=0, help="torch's and moecert's threads (0: torch's default)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
        moecert.set_num_threads(args.threads)
    shape = SHAPES[args.shape]
    gen = torch.Generator().manual_seed(5)
    torch.manual_seed(5)
    layer = mt.MoELayer(**shape, max_tokens=max(args.tokens), out_dtype=torch.float32)
    with torch.no_grad():
        for n in ("b_gate", "b_up", "b_down"):  # nonzero B: every LoRA product does work
            getattr(layer, n).normal_(0, 1 / math.sqrt(shape["rank"]))
    peer = EagerMoE(layer)
    env = {"moecert": moecert.build_info(), "torch": torch.__version__, "python": sys.version.split()[0],
           "torch_threads": torch.get_num_threads(), "moecert_threads": moecert.num_threads(),
           "isa": moecert.default_isa(), "contract_level": moecert.contract_level(), "shape": shape,
           "reps": args.reps}
    print("# " + " ".join("{}={}".format(k, v) for k, v in env.items()))
    results = []
    print("{:<10} {:>6} {:>12} {:>12} {:>8} {:>8}  {}".format("case", "T", "moecert ms", "peer ms", "speedup",
                                                              "paired", "largest rel diff"))
    for T in args.tokens:
        x = torch.randn(T, shape["hidden"], generator=gen).to(torch.bfloat16)
        dy = torch.randn(T, shape["hidden"], generator=gen)
        for name, run in (("layer", lambda: layer_case(layer, peer, x, dy, args.reps)),
                          ("experts", lambda: experts_case(layer, peer, x, dy, args.reps, gen))):
            a, b, diffs = run()
            r = summary(name, T, a, b, diffs)
            results.append(r)
            print("{:<10} {:>6} {:>12.2f} {:>12.2f} {:>7.2f}x {:>7.2f}x  {:.2g} ({})".format(
                name, T, r["moecert_ms"], r["peer_ms"], r["speedup"], r["paired_speedup"], r["largest_rel_diff"],
                r["largest_rel_diff_of"]))
        a, b = overhead_case(layer, x, dy, args.reps)
        over = {"case": "overhead", "tokens": T, "module_ms": statistics.median(a), "ops_ms": statistics.median(b),
                "paired_ratio": statistics.median([p / q for p, q in zip(a, b)])}
        a, b = raw_case(layer, x, dy, args.reps)
        over["raw_ms"] = statistics.median(b)
        over["raw_ratio"] = statistics.median([p / q for p, q in zip(a, b)])
        shares, inside = python_share(layer, x, dy, args.reps)
        over["python_share"], over["inside_ms"] = statistics.median(shares), statistics.median(inside)
        over["floor_share"] = statistics.median(floor_share(layer, x, dy, args.reps)[0])
        over["floor1_share"] = statistics.median(floor_share(layer, x, dy, args.reps, inputs=1)[0])
        over["experts_share"] = statistics.median(experts_share(layer, x, dy, args.reps, gen)[0])
        over["python_alone_ms"] = python_alone(layer, x, dy, args.reps)
        results.append(over)
        print("{:<10} {:>6} {:>12.3f} {:>12.3f} {:>7.3f}x  MoELayer step / bare ops step; / raw C calls "
              "({:.3f} ms): {:.3f}x; outside the C calls: {:.2%} of the time in them (a bare Function: {:.2%}; with "
              "x and one parameter: {:.2%}; moecert.torch.experts: {:.2%}); Python alone {:.3f} ms".format(
                  "overhead", T, over["module_ms"], over["ops_ms"], over["paired_ratio"], over["raw_ms"],
                  over["raw_ratio"], over["python_share"], over["floor_share"], over["floor1_share"],
                  over["experts_share"], over["python_alone_ms"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"schema": "moecert-python-bench/1", "environment": env, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
