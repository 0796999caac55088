"""Judge another implementation's router, experts or layer outputs with moecert's clauses
(docs/JUDGE.md).

    import moecert.check as check
    v = check.product_key_backward(sx, sy, idx, g, dsx, dsy)   # torch tensors or numpy arrays
    v.passed, v.failed, v.ties, v.clauses
    v.write("report-dir")                                     # report.json and report.md

The same judge as `moecert check` (the C ABI's moecert_check): every clause of the op at level
full, ties in any order (each named in `ties`), outputs stored in bf16 or fp16 judged with that
rounding. Indices may be int64 (torch.topk's) and are narrowed to int32; -1 marks an empty slot.
"""
import ctypes
import json
import os

import numpy as np

from . import _abi
from .errors import InvalidArgument

__all__ = ["Verdict", "softmax_topk_forward", "softmax_topk_backward", "sigmoid_topk_forward",
           "sigmoid_topk_backward", "product_key_forward", "product_key_backward", "experts_forward",
           "experts_backward", "layer_forward", "layer_backward"]


class Verdict:
    """The judge's verdict: `passed`, `clauses` (id, verdict pass|fail|not evaluated, and for a
    failure its location, observed, expected and message), `ties` (t, chosen, other, score,
    kind: exact or near), `failed` (the ids of the failed clauses) and `errors` (per output judged
    against the experts model: relative_error = ||v - ref||_F / ||ref||_F, and relative_worst,
    relative_probable: the same ratio for the worst-case and the probabilistic bound of the
    declared precision, None where not formed)."""

    def __init__(self, report):
        self.report = report
        self.op = report["op"]
        self.passed = report["verdict"] == "pass"
        self.clauses = report["clauses"]
        self.ties = report["ties"]
        self.failed = [c["id"] for c in self.clauses if c["verdict"] == "fail"]
        self.errors = report.get("errors", [])

    def __bool__(self):
        return self.passed

    def __repr__(self):
        return "Verdict({}: {}{})".format(self.op, "pass" if self.passed else "fail",
                                         "; failed " + ", ".join(self.failed) if self.failed else "")

    def write(self, folder):
        """report.json (schema moecert-check/1) and report.md in `folder`."""
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "report.json"), "w") as f:
            json.dump(self.report, f)
        lines = ["# moecert.check: {} - {}".format(self.op, "pass" if self.passed else "FAIL"), "",
                 "| clause | verdict | first failure |", "|---|---|---|"]
        lines += ["| `{}` | {} | {} |".format(c["id"], c["verdict"], c.get("message", "")) for c in self.clauses]
        lines += ["", "Ties the implementation ordered its own way (allowed): {}".format(len(self.ties))]
        lines += ["- t={t}: expert {chosen} before expert {other}, ".format(**t) +
                  ("both score {score}" if t["kind"] == "exact" else
                   "within the fp32 scores' rounding of each other (score {score})").format(**t)
                  for t in self.ties]
        if self.errors:
            lines += ["", "| output | relative error | worst-case bound | probabilistic bound |", "|---|---|---|---|"]
            lines += ["| {} | {} | {} | {} |".format(e["output"], *("{:.3g}".format(e[k]) if e[k] is not None else "-"
                                                                 for k in ("relative_error", "relative_worst",
                                                                           "relative_probable")))
                      for e in self.errors]
        with open(os.path.join(folder, "report.md"), "w") as f:
            f.write("\n".join(lines) + "\n")


def _array(x, name, index):
    """(a contiguous 2-D numpy array the ABI reads, stored_as) for a torch tensor or array."""
    stored = 0
    if hasattr(x, "detach"):  # a torch tensor
        import torch
        x = x.detach().cpu()
        if x.dtype == torch.bfloat16:
            x, stored = x.float(), 1
        elif x.dtype == torch.float16:
            x, stored = x.float(), 2
        x = x.numpy()
    a = np.asarray(x)
    if a.ndim == 1:  # a vector (the sigmoid router's bias) as one row
        a = a.reshape(1, -1)
    elif a.ndim > 2:  # stacked weights [E, I, H]: E*I rows of H
        a = a.reshape(-1, a.shape[-1])
    if a.ndim != 2:
        raise InvalidArgument("{}: {} dimensions, expected 2".format(name, a.ndim))
    if index:
        if a.dtype.kind not in "iu":
            raise InvalidArgument("{}: dtype {}, expected integer indices".format(name, a.dtype))
        if a.size and (a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max):
            raise InvalidArgument("{}: an index outside int32".format(name))
        return np.ascontiguousarray(a, dtype=np.int32), 0
    if a.dtype == np.float16:
        a, stored = a.astype(np.float32), 2
    if a.dtype not in (np.float32, np.float64):
        raise InvalidArgument("{}: dtype {}, expected float values".format(name, a.dtype))
    return np.ascontiguousarray(a), stored


def _base(w_gate, w_up, w_down, params):
    """The base weights as inputs: tensors, or moecert.torch.formats.Quantized of one format
    (`<name>.codes` and `<name>.scales` stacked by expert, and param format)."""
    named = {"w_gate": w_gate, "w_up": w_up, "w_down": w_down}
    kinds = {getattr(w, "format", None) for w in named.values()}
    if kinds == {None}:
        return named
    if None in kinds or len(kinds) != 1:
        raise InvalidArgument("w_gate, w_up, w_down: tensors, or formats.Quantized of one format, all three")
    import torch
    inputs = {}
    for name, q in named.items():
        mats = q.matrices()
        inputs[name + ".codes"] = torch.stack([c for c, _ in mats])
        inputs[name + ".scales"] = torch.stack([s for _, s in mats])
    params["format"] = kinds.pop()
    return inputs


def _named(tensors, keep):
    out = (_abi.NamedTensor * len(tensors))()
    for i, (name, x) in enumerate(tensors.items()):
        a, stored = _array(x, name, name == "idx" or name.endswith(".codes"))
        keep.append(a)
        dtype = {np.dtype(np.float32): _abi.F32, np.dtype(np.float64): _abi.F64,
                 np.dtype(np.int32): _abi.I32}[a.dtype]
        out[i] = _abi.NamedTensor(name.encode(), _abi.Tensor(a.ctypes.data if a.size else None, dtype, 2,
                                                             a.shape, (a.shape[1], 1)), stored)
    return out


def judge(op, inputs, outputs, **params):
    """The verdict on `outputs` of op for `inputs` (dicts of name -> tensor; names: docs/JUDGE.md)."""
    keep = []
    ins, outs = _named(inputs, keep), _named(outputs, keep)
    ps = [("{}={}".format(k, str(v).lower() if isinstance(v, bool) else v)).encode() for k, v in params.items()]
    c_params = (ctypes.c_char_p * max(len(ps), 1))(*ps)
    result = ctypes.c_void_p()
    _abi.call("moecert_check", op.encode(), ins, len(inputs), outs, len(outputs), c_params, len(ps),
              ctypes.byref(result))
    try:
        return Verdict(json.loads(ctypes.string_at(result.value).decode()))
    finally:
        _abi.lib.moecert_free_string(result)


def softmax_topk_forward(z, idx, w, renormalize=True, sorted=False):
    """sorted=True declares each row's slots in the total order (score descending, then index):
    router.softmax_topk.sorted is judged only then; otherwise the selection is judged as a set."""
    return judge("router.softmax_topk.forward", {"z": z}, {"idx": idx, "w": w}, renormalize=renormalize,
                 sorted=sorted)


def softmax_topk_backward(z, idx, g, dz, renormalize=True, backward="masked"):
    """backward="dense": dz is autograd's through a dense softmax (docs/JUDGE.md)."""
    return judge("router.softmax_topk.backward", {"z": z, "idx": idx, "g": g}, {"dz": dz}, renormalize=renormalize,
                 backward=backward)


def sigmoid_topk_forward(z, bias, idx, w, groups=1, topk_group=1, scaling=1.0, sorted=False):
    return judge("router.sigmoid_topk.forward", {"z": z, "bias": bias}, {"idx": idx, "w": w}, groups=groups,
                 topk_group=topk_group, scaling=scaling, sorted=sorted)


def sigmoid_topk_backward(z, idx, g, dz, scaling=1.0):
    return judge("router.sigmoid_topk.backward", {"z": z, "idx": idx, "g": g}, {"dz": dz}, scaling=scaling)


def experts_forward(x, idx, weights, w_gate, w_up, w_down, y, precision, lora=None, alpha=None):
    """experts.forward (or, with `lora` {a_gate, b_gate, a_up, b_up, a_down, b_down} and alpha,
    experts.forward_train); precision: fp32, mixed or bf16 (docs/JUDGE.md). The base weights may
    be moecert.torch.formats.Quantized of one format: judged as fp32(code * scale)."""
    params = {"precision": precision}
    inputs = dict({"x": x, "idx": idx, "weights": weights}, **_base(w_gate, w_up, w_down, params))
    if lora is not None:
        inputs.update(lora)
        params["alpha"] = alpha
    op = "experts.forward_train" if lora is not None else "experts.forward"
    return judge(op, inputs, {"y": y}, **params)


def experts_backward(x, idx, weights, w_gate, w_up, w_down, dy, precision, dx=None, dweights=None,
                     lora=None, alpha=None, weight_grads=None):
    """experts.backward: dx, dweights (dL/dw) and weight_grads ({a_gate, ..., w_down: gradient}), any
    of them, for dy; LoRA and quantized base weights as in experts_forward."""
    params = {"precision": precision}
    inputs = dict({"x": x, "idx": idx, "weights": weights, "dy": dy}, **_base(w_gate, w_up, w_down, params))
    if lora is not None:
        inputs.update(lora)
        params["alpha"] = alpha
    outputs = {name: v for name, v in (("dx", dx), ("dweights", dweights)) if v is not None}
    outputs.update({name + "_grad": v for name, v in (weight_grads or {}).items()})
    return judge("experts.backward", inputs, outputs, **params)


def product_key_forward(sx, sy, idx, w, weights="softmax", sorted=False):
    return judge("router.product_key.forward", {"sx": sx, "sy": sy}, {"idx": idx, "w": w}, weights=weights,
                 sorted=sorted)


def product_key_backward(sx, sy, idx, g, dsx, dsy, weights="softmax"):
    return judge("router.product_key.backward", {"sx": sx, "sy": sy, "idx": idx, "g": g}, {"dsx": dsx, "dsy": dsy},
                 weights=weights)


def _layer_inputs(x, router_w, router_b, w_gate, w_up, w_down, router_bias, lora, params):
    inputs = dict({"x": x, "router_w": router_w, "router_b": router_b}, **_base(w_gate, w_up, w_down, params))
    if router_bias is not None:
        inputs["router_bias"] = router_bias
    if lora is not None:
        inputs.update(lora)
    return inputs


def layer_forward(x, router_w, router_b, w_gate, w_up, w_down, z, idx, weights, y, precision, router,
                  router_bias=None, lora=None, alpha=None, **router_params):
    """layer.forward judged stage by stage on the implementation's own intermediates: its logits z
    against x W_r^T + b, its selection idx and weights by the router's clauses on that z, y by the
    experts model on that selection. router: softmax_topk (renormalize), sigmoid_topk (router_bias;
    groups, topk_group, scaling) or product_key (weights); precision: fp32, mixed or bf16; sorted=True
    declares the slots in the router's total order (judged then; otherwise any order)."""
    params = dict(router_params, precision=precision, router=router)
    if lora is not None:
        params["alpha"] = alpha
    inputs = _layer_inputs(x, router_w, router_b, w_gate, w_up, w_down, router_bias, lora, params)
    return judge("layer.forward", inputs, {"z": z, "idx": idx, "weights": weights, "y": y}, **params)


def layer_backward(x, router_w, router_b, w_gate, w_up, w_down, z, idx, weights, dy, dx, dweights, dz,
                   precision, router, router_w_grad=None, router_b_grad=None, router_bias=None, lora=None,
                   alpha=None, weight_grads=None, **router_params):
    """layer.backward for dy, with the forward's z, idx and weights: dweights (dL/dw) and
    weight_grads ({a_gate, ..., w_down: gradient}) by the experts model, dz by the router backward's
    clauses on that dL/dw, dx (and router_w_grad, router_b_grad when given) by the experts model's dx
    plus the router linear's sums of that dz."""
    params = dict(router_params, precision=precision, router=router)
    if lora is not None:
        params["alpha"] = alpha
    inputs = _layer_inputs(x, router_w, router_b, w_gate, w_up, w_down, router_bias, lora, params)
    inputs.update(z=z, idx=idx, weights=weights, dy=dy)
    outputs = {"dx": dx, "dweights": dweights, "dz": dz}
    if router_w_grad is not None:
        outputs["router_w_grad"] = router_w_grad
    if router_b_grad is not None:
        outputs["router_b_grad"] = router_b_grad
    outputs.update({name + "_grad": v for name, v in (weight_grads or {}).items()})
    return judge("layer.backward", inputs, outputs, **params)
