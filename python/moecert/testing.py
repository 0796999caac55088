"""The conformance suite's data classes against your own implementation: moecert builds the
inputs, calls your function, judges its outputs with moecert's judge (moecert.check, under the
precision you declare) and reports per case.

    import moecert.testing as mtest
    report = mtest.experts_forward(my_experts, precision="bf16")
    report.write("conformance")          # report.json, report.md, report.html, junit.xml
    mtest.assert_conforms(report)        # in a pytest test: fails naming each case and clause

Suites (each a function taking your callable; the data classes below):

    router_forward(kind, fn, k=None, **params)     kind softmax_topk: fn(z, k) -> (idx, w);
                                                  sigmoid_topk: fn(z, bias, k) -> (idx, w);
                                                  product_key: fn(sx, sy, k) -> (idx, w)
    router_backward(kind, fn, **params)            softmax_topk, sigmoid_topk: fn(z, idx, g) -> dz;
                                                  product_key: fn(sx, sy, idx, g) -> (dsx, dsy)
    experts_forward(fn, precision, lora=True)      fn(x, idx, weights, w_gate, w_up, w_down,
                                                  lora=None, alpha=None) -> y
    experts_backward(fn, precision, lora=True)     fn(x, idx, weights, w_gate, w_up, w_down, dy,
                                                  lora=None, alpha=None) -> (dx, dweights) or
                                                  (dx, dweights, {name: gradient}) with the LoRA
                                                  factors' and base weights' gradients (a_gate, ...,
                                                  w_down; those given are judged)
    layer_forward(fn, precision, router="softmax_topk", lora=True, **router_params)
                                                  fn(x, router_w, router_b, w_gate, w_up, w_down, k,
                                                  router_bias=None, lora=None, alpha=None)
                                                  -> (z, idx, weights, y)
    layer_backward(fn, precision, router="softmax_topk", lora=True, **router_params)
                                                  fn(the same, dy) -> {"z", "idx", "weights", "dx",
                                                  "dweights", "dz"; optionally "router_w_grad",
                                                  "router_b_grad", "weight_grads": {a_gate, ...,
                                                  w_down: gradient}}
    c_experts_forward(function)                    a C function (ctypes) as experts_forward's fn:
                                                  int32_t f(const moecert_tensor* x, idx, weights,
                                                  w_gate, w_up, w_down, const moecert_lora* lora,
                                                  moecert_tensor* y) over moecert.h's descriptors
    c_experts_backward(function)                   the same for experts_backward: int32_t f(x, idx,
                                                  weights, w_gate, w_up, w_down, lora,
                                                  const moecert_tensor* dy, moecert_tensor* dx,
                                                  moecert_tensor* dweights)
    c_router_forward(function)                     router_forward's fn: int32_t f(const moecert_tensor*
                                                  a, const moecert_tensor* b, int64_t k,
                                                  moecert_tensor* idx, moecert_tensor* w); (a, b) =
                                                  (z, bias or NULL) or (sx, sy)
    c_router_backward(function, kind)              router_backward's fn: int32_t f(z, idx, g, dz);
                                                  product_key f(sx, sy, idx, g, dsx, dsy)
    c_layer_forward(function)                      layer_forward's fn (the softmax_topk layer without a
                                                  router bias): int32_t f(x, router_w, router_b,
                                                  w_gate, w_up, w_down, lora, int64_t k, z, idx,
                                                  weights, y)
    c_layer_backward(function)                     layer_backward's fn: int32_t f(x, router_w,
                                                  router_b, w_gate, w_up, w_down, lora, k, dy, z,
                                                  idx, weights, dx, dweights, dz, router_w_grad,
                                                  router_b_grad)

Router params are the judge's (renormalize, groups, topk_group, scaling, weights, sorted,
backward; docs/JUDGE.md). Tensors are torch tensors in the layouts docs/JUDGE.md gives: x, the
base weights and LoRA factors bf16 (as moecert takes them), routing weights and logits fp32,
ids int64 (as torch.topk gives them) with -1 for an empty slot. A callable that raises on a case
fails that case with its message.

Data classes: normal; ties (many exactly equal scores); one_token; peaked (logits spread
over +-60: near one-hot softmax); minus1_slots (rows whose last slots are empty); one_expert
(every token routed to expert 0, the others idle); idle_experts (half the experts get no
token); wide_exponents (rows of x scaled by 2^-20 .. 2^20); realistic (E16 H512 I384 K4 r8
T64 for the experts and the layer, E64 K8 T64 for the routers). Routing weights are
bf16-representable (a bf16 model's router hands them over in bf16). The layer's router weights are
N(0, 1/H), its bias N(0, 0.1²) (sigmoid_topk: a correction bias too); it is judged stage by stage
on the implementation's own z, idx and weights (docs/JUDGE.md). sigmoid_topk's logits must stay
at or above -87 (sigma(z) normal: its scores_finite clause), so its layer suite leaves out
wide_exponents, whose rows of x reach 2^20.
"""
import ctypes
import json
import math
import os
from xml.sax.saxutils import escape, quoteattr

import torch

from . import check

ROUTER_KINDS = ("softmax_topk", "sigmoid_topk", "product_key")


class Case:
    """One input of a suite: its data class, the inputs by name, and the shape it was built at."""

    def __init__(self, name, inputs, shape):
        self.name, self.inputs, self.shape = name, inputs, shape

    def __repr__(self):
        return "Case({}, {})".format(self.name, self.shape)


class Result:
    """A case's outcome: the judge's verdict (None where the callable raised) or the error."""

    def __init__(self, case, verdict=None, error=None):
        self.case, self.verdict, self.error = case, verdict, error

    @property
    def passed(self):
        return self.error is None and self.verdict is not None and self.verdict.passed

    def failures(self):
        """The failing clauses with their messages, or the callable's error."""
        if self.error is not None:
            return ["raised: {}".format(self.error)]
        return ["{}: {}".format(c["id"], c.get("message", "")) for c in self.verdict.clauses
                if c["verdict"] == "fail"]


class Report:
    """A suite's results: passed, results (Result per case), summary(), write(folder)."""

    def __init__(self, op, params, results):
        self.op, self.params, self.results = op, params, results

    @property
    def passed(self):
        return all(r.passed for r in self.results)

    def summary(self):
        failed = [r for r in self.results if not r.passed]
        lines = ["{}: {} of {} cases passed".format(self.op, len(self.results) - len(failed), len(self.results))]
        for r in failed:
            lines.append("  {} ({}):".format(r.case.name, r.case.shape))
            lines.extend("    " + f for f in r.failures())
        return "\n".join(lines)

    def as_json(self):
        return {"schema": "moecert-testing/1", "op": self.op, "params": self.params,
                "verdict": "pass" if self.passed else "fail",
                "cases": [{"name": r.case.name, "shape": r.case.shape, "verdict": "pass" if r.passed else "fail",
                           "failures": [] if r.passed else r.failures(),
                           "report": r.verdict.report if r.verdict is not None else None} for r in self.results]}

    def write(self, folder):
        """report.json, report.md, report.html and junit.xml in `folder` (created)."""
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "report.json"), "w") as f:
            json.dump(self.as_json(), f, indent=1)
        rows = ["| case | shape | verdict | failures |", "|---|---|---|---|"]
        rows += ["| {} | {} | {} | {} |".format(r.case.name, r.case.shape, "pass" if r.passed else "**fail**",
                                                "; ".join(r.failures()).replace("|", "\\|") if not r.passed else "")
                 for r in self.results]
        with open(os.path.join(folder, "report.md"), "w") as f:
            f.write("# {}: {}\n\n{}\n".format(self.op, "pass" if self.passed else "fail", "\n".join(rows)))
        cells = "".join("<tr><td>{}</td><td>{}</td><td class={}>{}</td><td>{}</td></tr>".format(
            escape(r.case.name), escape(r.case.shape), "pass" if r.passed else "fail", "pass" if r.passed else "fail",
            "<br>".join(escape(x) for x in ([] if r.passed else r.failures()))) for r in self.results)
        with open(os.path.join(folder, "report.html"), "w") as f:
            f.write("<!doctype html><meta charset=utf-8><title>{0}</title><style>.fail{{color:#b00}}"
                    "td{{padding:2px 8px;vertical-align:top}}</style><h1>{0}: {1}</h1><table><tr><th>case<th>shape"
                    "<th>verdict<th>failures</tr>{2}</table>".format(escape(self.op),
                                                                     "pass" if self.passed else "fail", cells))
        cases = []
        for r in self.results:
            body = "" if r.passed else "<failure message={}>{}</failure>".format(
                quoteattr(r.failures()[0][:200]), escape("\n".join(r.failures())))
            cases.append("<testcase classname={} name={}>{}</testcase>".format(
                quoteattr(self.op), quoteattr("{} {}".format(r.case.name, r.case.shape)), body))
        with open(os.path.join(folder, "junit.xml"), "w") as f:
            f.write('<?xml version="1.0" encoding="UTF-8"?>\n<testsuite name={} tests="{}" failures="{}">{}'
                    "</testsuite>\n".format(quoteattr(self.op), len(self.results),
                                            sum(not r.passed for r in self.results), "".join(cases)))


def assert_conforms(report):
    """Raises AssertionError with report.summary() unless every case passed."""
    if not report.passed:
        raise AssertionError(report.summary())


# ---- inputs -------------------------------------------------------------------------------

def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _scores(name, T, E, g):
    """Router logits [T, E] of data class `name`."""
    if name == "ties":
        return (torch.randint(-2, 3, (T, E), generator=g) * 0.5).float()
    z = torch.randn(T, E, generator=g)
    return z * 20 if name == "peaked" else z


ROUTER_CLASSES = {"normal": (13, 16, 3), "ties": (13, 16, 4), "one_token": (1, 16, 3), "peaked": (13, 16, 3),
                  "realistic": (64, 64, 8)}


def router_cases(kind, k=None, seed=0):
    """The router suites' cases: inputs z [T, E] (bias [E] for sigmoid_topk) or sx, sy [T, n]
    (product_key, E = n^2), and K."""
    out = []
    for i, (name, (T, E, K)) in enumerate(ROUTER_CLASSES.items()):
        g = _gen(seed * 100 + i)
        K = k or K
        if kind == "product_key":
            n = int(math.isqrt(E))
            sx, sy = _scores(name, T, n, g), _scores(name, T, n, g)
            out.append(Case(name, {"sx": sx, "sy": sy, "k": K}, "T{} n{} K{}".format(T, n, K)))
        else:
            inputs = {"z": _scores(name, T, E, g), "k": K}
            if kind == "sigmoid_topk":
                inputs["bias"] = torch.randn(E, generator=g) * 0.1
            out.append(Case(name, inputs, "T{} E{} K{}".format(T, E, K)))
    return out


def _selection(kind, inputs, params):
    """A valid selection for a backward's inputs, by float64 torch (not moecert's router): the K
    best scores (sigmoid_topk: of sigmoid(z) + bias within the best groups), ties by index."""
    K = inputs["k"]
    if kind == "product_key":
        s = (inputs["sx"].double()[:, :, None] + inputs["sy"].double()[:, None, :]).flatten(1)
    elif kind == "sigmoid_topk":
        s = torch.sigmoid(inputs["z"].double()) + inputs["bias"].double()
        groups, topk_group = int(params.get("groups", 1)), int(params.get("topk_group", 1))
        T, E = s.shape
        grouped = s.reshape(T, groups, E // groups)
        best = grouped.topk(min(2, E // groups), -1).values.sum(-1).topk(topk_group, -1).indices
        keep = torch.zeros(T, groups, dtype=torch.bool).scatter_(1, best, True)
        s = torch.where(keep.repeat_interleave(E // groups, 1), s, torch.full_like(s, -math.inf))
    else:
        s = inputs["z"].double()
    return torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :K]  # ties: lower index first


def _judged(case, judge):
    """The Result of judge(case.inputs) -> Verdict; what it raises (the callable's failure, or its
    outputs refused by the judge) is the case's failure."""
    try:
        return Result(case, judge(case.inputs))
    except Exception as e:
        return Result(case, error="{}: {}".format(type(e).__name__, e))


def router_forward(kind, fn, k=None, seed=0, **params):
    """Report of fn's router forward on every data class (see the module docstring)."""
    def judge(c):
        if kind == "softmax_topk":
            idx, w = fn(c["z"], c["k"])
            return check.softmax_topk_forward(c["z"], idx, w, **params)
        if kind == "sigmoid_topk":
            idx, w = fn(c["z"], c["bias"], c["k"])
            return check.sigmoid_topk_forward(c["z"], c["bias"], idx, w, **params)
        idx, w = fn(c["sx"], c["sy"], c["k"])
        return check.product_key_forward(c["sx"], c["sy"], idx, w, **params)

    return Report("router.{}.forward".format(kind), params,
                  [_judged(case, judge) for case in router_cases(kind, k, seed)])


def router_backward(kind, fn, seed=0, **params):
    """Report of fn's router backward on every data class, for a valid selection and an
    upstream gradient g [T, K]."""
    def judge(c):
        idx = _selection(kind, c, params)
        g = torch.randn(idx.shape, generator=_gen(seed + 7))
        if kind == "product_key":
            dsx, dsy = fn(c["sx"], c["sy"], idx, g)
            return check.product_key_backward(c["sx"], c["sy"], idx, g, dsx, dsy, **params)
        judged = check.softmax_topk_backward if kind == "softmax_topk" else check.sigmoid_topk_backward
        return judged(c["z"], idx, g, fn(c["z"], idx, g), **params)

    return Report("router.{}.backward".format(kind), params,
                  [_judged(case, judge) for case in router_cases(kind, None, seed)])


EXPERTS_CLASSES = {"normal": (12, 6, 40, 24, 2, 4), "minus1_slots": (12, 6, 40, 24, 3, 4),
                   "one_token": (1, 6, 40, 24, 2, 4), "one_expert": (12, 6, 40, 24, 1, 4),
                   "idle_experts": (12, 8, 40, 24, 2, 4), "wide_exponents": (12, 6, 40, 24, 2, 4),
                   "realistic": (64, 16, 512, 384, 4, 8)}


def _routing(name, T, E, K, g):
    if name == "one_expert":
        return torch.zeros(T, K, dtype=torch.int64), (torch.rand(T, K, generator=g) + 0.1).bfloat16().float()
    pool = E // 2 if name == "idle_experts" else E
    idx = torch.stack([torch.randperm(pool, generator=g)[:K] for _ in range(T)])
    if name == "minus1_slots":
        idx[::2, K - 1] = -1
        idx[::4, K - 2] = -1
        idx[::4, K - 1] = -1
    w = ((torch.rand(T, K, generator=g) + 0.1) * (idx >= 0)).bfloat16().float()  # as a bf16 router hands them over
    return idx, w


def experts_cases(lora=True, seed=0):
    """The experts suites' cases: x [T, H], idx, weights [T, K], w_gate, w_up [E, I, H], w_down
    [E, H, I], LoRA (rank r, alpha 2r) and dy [T, H]."""
    out = []
    for i, (name, (T, E, H, I, K, r)) in enumerate(EXPERTS_CLASSES.items()):
        g = _gen(seed * 100 + 50 + i)
        bf = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).bfloat16()  # noqa: E731
        x = torch.randn(T, H, generator=g)
        if name == "wide_exponents":
            x = x * torch.pow(2.0, torch.randint(-20, 21, (T, 1), generator=g).float())
        inputs = {"x": x.bfloat16(), "w_gate": bf(E, I, H, scale=H ** -0.5), "w_up": bf(E, I, H, scale=H ** -0.5),
                  "w_down": bf(E, H, I, scale=I ** -0.5)}
        inputs["idx"], inputs["weights"] = _routing(name, T, E, K, g)
        inputs["dy"] = torch.randn(T, H, generator=g)
        if lora:
            inputs["lora"] = {"a_gate": bf(E, r, H, scale=H ** -0.5), "b_gate": bf(E, I, r, scale=0.3),
                              "a_up": bf(E, r, H, scale=H ** -0.5), "b_up": bf(E, I, r, scale=0.3),
                              "a_down": bf(E, r, I, scale=I ** -0.5), "b_down": bf(E, H, r, scale=0.3)}
            inputs["alpha"] = 2.0 * r
        out.append(Case(name, inputs, "T{} E{} H{} I{} K{}{}".format(T, E, H, I, K, " r{}".format(r) if lora else "")))
    return out


def _experts_args(c):
    base = {n: c[n] for n in ("x", "idx", "weights", "w_gate", "w_up", "w_down")}
    return base, {"lora": c.get("lora"), "alpha": c.get("alpha")}


def experts_forward(fn, precision, lora=True, seed=0):
    """Report of fn's experts forward (experts.forward_train with LoRA, else experts.forward)
    on every data class under the declared precision (fp32, mixed or bf16)."""
    def judge(c):
        base, extra = _experts_args(c)
        return check.experts_forward(**base, y=fn(**base, **extra), precision=precision, **extra)

    return Report("experts.forward_train" if lora else "experts.forward", {"precision": precision},
                  [_judged(case, judge) for case in experts_cases(lora, seed)])


def experts_backward(fn, precision, lora=True, seed=0):
    """Report of fn's experts backward (dx, dL/dw and the weight gradients it returns, for dy) on
    every data class."""
    def judge(c):
        base, extra = _experts_args(c)
        dx, dweights, *grads = fn(**base, dy=c["dy"], **extra)
        return check.experts_backward(**base, dy=c["dy"], precision=precision, dx=dx, dweights=dweights,
                                      weight_grads=grads[0] if grads else None, **extra)

    return Report("experts.backward", {"precision": precision},
                  [_judged(case, judge) for case in experts_cases(lora, seed)])


LAYER_CLASSES = ("normal", "one_token", "idle_experts", "wide_exponents", "realistic")


def layer_cases(router="softmax_topk", lora=True, seed=0):
    """The layer suites' cases: the experts cases of LAYER_CLASSES with router weights; the
    routing comes from the implementation."""
    out = []
    for case in experts_cases(lora, seed):
        if case.name not in LAYER_CLASSES or (router == "sigmoid_topk" and case.name == "wide_exponents"):
            continue
        c = dict(case.inputs)
        E, H = c["w_gate"].shape[0], c["x"].shape[1]
        K = c.pop("idx").shape[1]
        c.pop("weights")
        g = _gen(seed * 100 + 90 + len(out))
        c["router_w"] = torch.randn(E, H, generator=g) * H ** -0.5
        c["router_b"] = torch.randn(E, generator=g) * 0.1
        if router == "sigmoid_topk":
            c["router_bias"] = torch.randn(E, generator=g) * 0.1
        c["k"] = K
        out.append(Case(case.name, c, case.shape))
    return out


def _layer_args(c):
    return {n: c[n] for n in ("x", "router_w", "router_b", "w_gate", "w_up", "w_down")}, {
        "router_bias": c.get("router_bias"), "lora": c.get("lora"), "alpha": c.get("alpha")}


def layer_forward(fn, precision, router="softmax_topk", lora=True, seed=0, **router_params):
    """Report of fn's layer forward on every layer data class: its z, selection and y judged
    stage by stage under the declared precision."""
    def judge(c):
        base, extra = _layer_args(c)
        z, idx, weights, y = fn(**base, k=c["k"], **extra)
        return check.layer_forward(**base, z=z, idx=idx, weights=weights, y=y, precision=precision, router=router,
                                   **extra, **router_params)

    return Report("layer.forward", dict(router_params, precision=precision, router=router),
                  [_judged(case, judge) for case in layer_cases(router, lora, seed)])


def layer_backward(fn, precision, router="softmax_topk", lora=True, seed=0, **router_params):
    """Report of fn's layer backward (with its own forward's z, idx and weights) on every layer
    data class."""
    def judge(c):
        base, extra = _layer_args(c)
        out = fn(**base, k=c["k"], dy=c["dy"], **extra)
        grads = {n: out.get(n) for n in ("router_w_grad", "router_b_grad", "weight_grads")}
        return check.layer_backward(**base, z=out["z"], idx=out["idx"], weights=out["weights"], dy=c["dy"],
                                    dx=out["dx"], dweights=out["dweights"], dz=out["dz"], precision=precision,
                                    router=router, **grads, **extra, **router_params)

    return Report("layer.backward", dict(router_params, precision=precision, router=router),
                  [_judged(case, judge) for case in layer_cases(router, lora, seed)])


def _c_inputs(x, idx, weights, w_gate, w_up, w_down, lora, alpha):
    """The C ABI's descriptors of an experts case (and the tensors they point into)."""
    from . import _abi
    from .torch._tensors import describe
    tensors = [x.bfloat16().contiguous(), idx.int().contiguous(), weights.float().contiguous()] + [
        w.bfloat16().contiguous() for w in (w_gate, w_up, w_down)]
    factors = [lora[n].bfloat16().contiguous() for n in ("a_gate", "b_gate", "a_up", "b_up", "a_down", "b_down")] \
        if lora else []
    c_lora = _abi.Lora(*(describe(f) for f in factors), factors[0].shape[1], float(alpha)) if lora else None
    args = [ctypes.byref(describe(t)) for t in tensors] + [ctypes.byref(c_lora) if lora else None]
    return args, (tensors, factors, c_lora)


def _c_function(function, outputs):
    """`function` given the C signature of six tensors, a LoRA and `outputs` tensors."""
    from . import _abi
    function.restype = ctypes.c_int32
    function.argtypes = [ctypes.POINTER(_abi.Tensor)] * 6 + [ctypes.POINTER(_abi.Lora)] + [
        ctypes.POINTER(_abi.Tensor)] * outputs
    return function


def _c_status(function, status):
    if status != 0:
        raise RuntimeError("{} returned {}".format(getattr(function, "__name__", "the C function"), status))


def c_experts_forward(function):
    """experts_forward's fn over a C function through the C ABI's descriptors
    (include/moecert/moecert.h): `function` a ctypes function (e.g. ctypes.CDLL(path).name) of
    the signature

        int32_t f(const moecert_tensor* x, const moecert_tensor* idx, const moecert_tensor* weights,
                  const moecert_tensor* w_gate, const moecert_tensor* w_up, const moecert_tensor* w_down,
                  const moecert_lora* lora, moecert_tensor* y);

    x and the weights bf16 ([T, H], stacked [E*I, H], [E*I, H], [E*H, I]), idx int32 and weights
    fp32 [T, K] (-1: an empty slot), lora NULL without LoRA (else its factors bf16 stacked as the
    experts op takes them, rank and alpha), y fp32 [T, H] to write (NaN until written); a nonzero
    return fails the case."""
    from .torch._tensors import describe
    _c_function(function, 1)

    def call(x, idx, weights, w_gate, w_up, w_down, lora=None, alpha=None):
        args, keep = _c_inputs(x, idx, weights, w_gate, w_up, w_down, lora, alpha)
        y = torch.full((x.shape[0], x.shape[1]), math.nan)
        _c_status(function, function(*args, ctypes.byref(describe(y))))
        return y

    return call


def c_experts_backward(function):
    """experts_backward's fn over a C function of the signature

        int32_t f(x, idx, weights, w_gate, w_up, w_down, const moecert_lora* lora,
                  const moecert_tensor* dy, moecert_tensor* dx, moecert_tensor* dweights);

    the inputs as c_experts_forward's, dy fp32 [T, H], dx fp32 [T, H] and dweights fp32 [T, K]
    to write."""
    from .torch._tensors import describe
    _c_function(function, 3)

    def call(x, idx, weights, w_gate, w_up, w_down, dy, lora=None, alpha=None):
        args, keep = _c_inputs(x, idx, weights, w_gate, w_up, w_down, lora, alpha)
        dy = dy.float().contiguous()
        dx, dweights = torch.full(tuple(x.shape), math.nan), torch.full(tuple(idx.shape), math.nan)
        _c_status(function, function(*args, *(ctypes.byref(describe(t)) for t in (dy, dx, dweights))))
        return dx, dweights

    return call


def _c_tensor(t, dtype):
    from .torch._tensors import describe
    t = t.to(dtype).contiguous()
    return t, ctypes.byref(describe(t.reshape(1, -1) if t.dim() == 1 else t))


def c_router_forward(function):
    """router_forward's fn over a C function of the signature

        int32_t f(const moecert_tensor* a, const moecert_tensor* b, int64_t k,
                  moecert_tensor* idx, moecert_tensor* w);

    (a, b) = (z fp32 [T, E], NULL; sigmoid_topk: bias fp32 [1, E]) or, for product_key, (sx, sy)
    fp32 [T, n]; idx int32 and w fp32 [T, K] to write (idx -2 and w NaN until written)."""
    from . import _abi
    T = ctypes.POINTER(_abi.Tensor)
    function.restype, function.argtypes = ctypes.c_int32, [T, T, ctypes.c_int64, T, T]

    def call(*args):
        *scores, k = args
        ins = [_c_tensor(t, torch.float32) for t in scores]
        rows = scores[0].shape[0]
        idx, w = torch.full((rows, k), -2, dtype=torch.int32), torch.full((rows, k), math.nan)
        second = ins[1][1] if len(ins) > 1 else None
        outs = (_c_tensor(idx, torch.int32)[1], _c_tensor(w, torch.float32)[1])
        _c_status(function, function(ins[0][1], second, k, *outs))
        return idx.long(), w

    return call


def c_router_backward(function, kind="softmax_topk"):
    """router_backward's fn over a C function of the signature

        int32_t f(const moecert_tensor* z, const moecert_tensor* idx, const moecert_tensor* g,
                  moecert_tensor* dz);

    z fp32 [T, E], idx int32 and g fp32 [T, K], dz fp32 [T, E] to write; for product_key
    f(sx, sy, idx, g, dsx, dsy) with sx, sy, dsx, dsy fp32 [T, n]."""
    from . import _abi
    T = ctypes.POINTER(_abi.Tensor)
    function.restype = ctypes.c_int32
    function.argtypes = [T] * (6 if kind == "product_key" else 4)

    def call(*args):
        *scores, idx, g = args
        ins = [_c_tensor(t, torch.float32) for t in scores]
        ins += [_c_tensor(idx, torch.int32), _c_tensor(g, torch.float32)]
        outs = [torch.full(tuple(t.shape), math.nan) for t in scores]
        _c_status(function, function(*(d for _, d in ins), *(_c_tensor(t, torch.float32)[1] for t in outs)))
        return outs[0] if len(outs) == 1 else tuple(outs)

    return call


def c_layer_forward(function, correction_bias=False):
    """layer_forward's fn over a C function of the signature

        int32_t f(const moecert_tensor* x, const moecert_tensor* router_w,
                  const moecert_tensor* router_b, const moecert_tensor* w_gate,
                  const moecert_tensor* w_up, const moecert_tensor* w_down,
                  const moecert_lora* lora, int64_t k, moecert_tensor* z, moecert_tensor* idx,
                  moecert_tensor* weights, moecert_tensor* y);

    x and the experts' weights and LoRA as c_experts_forward's, router_w fp32 [R, H], router_b
    fp32 [1, R]; z fp32 [T, R], idx int32 and weights fp32 [T, K], y fp32 [T, H] to write. With
    correction_bias (a sigmoid_topk router), `const moecert_tensor* router_bias` (fp32 [1, E])
    follows router_b."""
    from . import _abi
    T = ctypes.POINTER(_abi.Tensor)
    function.restype = ctypes.c_int32
    function.argtypes = [T] * (7 if correction_bias else 6) + [ctypes.POINTER(_abi.Lora), ctypes.c_int64] + [T] * 4

    def call(x, router_w, router_b, w_gate, w_up, w_down, k, router_bias=None, lora=None, alpha=None):
        router = _c_router(router_w, router_b, router_bias, correction_bias, "c_layer_forward")
        rows = x.shape[0]
        idx, weights = torch.full((rows, k), -2, dtype=torch.int32), torch.full((rows, k), math.nan)
        args, keep = _c_inputs(x, idx, weights, w_gate, w_up, w_down, lora, alpha)
        z, y = torch.full((rows, router_w.shape[0]), math.nan), torch.full(tuple(x.shape), math.nan)
        outs = [_c_tensor(z, torch.float32)[1], _c_tensor(idx, torch.int32)[1], _c_tensor(weights, torch.float32)[1],
                _c_tensor(y, torch.float32)[1]]
        _c_status(function, function(args[0], *[r[1] for r in router], *args[3:6], args[6], k, *outs))
        return z, idx.long(), weights, y

    return call


def _c_router(router_w, router_b, router_bias, correction_bias, name):
    """The router's C tensors: W_r, b and, for a router with a correction bias, its bias."""
    if (router_bias is not None) != correction_bias:
        raise ValueError("{}: router_bias {} but the C function {} one (correction_bias={})".format(
            name, "given" if router_bias is not None else "missing", "takes" if correction_bias else "takes no",
            correction_bias))
    tensors = [router_w, router_b] + ([router_bias] if correction_bias else [])
    return [_c_tensor(t, torch.float32) for t in tensors]


def c_layer_backward(function, correction_bias=False):
    """layer_backward's fn over a C function of the signature

        int32_t f(x, router_w, router_b, w_gate, w_up, w_down, const moecert_lora* lora, int64_t k,
                  const moecert_tensor* dy, moecert_tensor* z, moecert_tensor* idx,
                  moecert_tensor* weights, moecert_tensor* dx, moecert_tensor* dweights,
                  moecert_tensor* dz, moecert_tensor* router_w_grad, moecert_tensor* router_b_grad);

    the inputs as c_layer_forward's (router_bias after router_b with correction_bias) and dy fp32
    [T, H]; it writes its forward's z, idx and weights and the gradients, fp32: dx [T, H],
    dweights [T, K], dz [T, R], router_w_grad [R, H], router_b_grad [1, R]."""
    from . import _abi
    T = ctypes.POINTER(_abi.Tensor)
    function.restype = ctypes.c_int32
    function.argtypes = [T] * (7 if correction_bias else 6) + [ctypes.POINTER(_abi.Lora), ctypes.c_int64] + [T] * 9

    def call(x, router_w, router_b, w_gate, w_up, w_down, k, dy, router_bias=None, lora=None, alpha=None):
        router = _c_router(router_w, router_b, router_bias, correction_bias, "c_layer_backward")
        rows, R = x.shape[0], router_w.shape[0]
        nan = lambda *shape: torch.full(shape, math.nan)  # noqa: E731
        out = {"z": nan(rows, R), "idx": torch.full((rows, k), -2, dtype=torch.int32), "weights": nan(rows, k),
               "dx": nan(*x.shape), "dweights": nan(rows, k), "dz": nan(rows, R), "router_w_grad": nan(R, x.shape[1]),
               "router_b_grad": nan(1, R)}
        args, keep = _c_inputs(x, out["idx"], out["weights"], w_gate, w_up, w_down, lora, alpha)
        d_y = _c_tensor(dy, torch.float32)
        outs = [_c_tensor(t, t.dtype)[1] for t in out.values()]
        _c_status(function, function(args[0], *[r[1] for r in router], *args[3:6], args[6], k, d_y[1], *outs))
        return dict(out, idx=out["idx"].long(), router_b_grad=out["router_b_grad"].reshape(-1))

    return call
