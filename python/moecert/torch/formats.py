"""Quantized base weights in moecert's weight formats (moecert.FORMATS): codes
and scales as checkpoints store them, and the quantizer for weights that
start in bf16 or fp32. The formats (include/moecert/formats.hpp):

  int8_channel       int8 codes in [-127, 127], one scale per row (output)
  int4_group         int4 codes in [-7, 7], two per byte (element 2j in the low
                     nibble of byte j), one scale per row and 128 columns
  fp8_e4m3_block128  float8 e4m3 (e4m3fn) codes, one scale per 128 x 128 block:
                     DeepSeek-V3's weight and weight_scale_inv as stored

A matrix W [rows x cols] (rows = outputs, as nn.Linear's weight) is
w = code * scale; the kernels compute with bf16(fp32(code * scale)).
"""
import ctypes
from dataclasses import dataclass

import torch

from .. import FORMATS, _abi
from ..errors import InvalidArgument
from ._tensors import check, describe


def format_number(name):
    """The C ABI's number of a quantized format named in moecert.FORMATS."""
    if name not in FORMATS or name == "bf16":
        raise InvalidArgument("format {!r}: expected one of {}".format(
            name, ", ".join(f for f in FORMATS if f != "bf16")))
    return FORMATS.index(name)


def info(name):
    """(code bits, rows and columns of a matrix per scale (0: all of them)) of format `name`, as the
    library defines it."""
    bits, r, c = ctypes.c_int32(), ctypes.c_int64(), ctypes.c_int64()
    _abi.call("moecert_format_info", FORMATS.index(name), ctypes.byref(bits), ctypes.byref(r), ctypes.byref(c))
    return bits.value, r.value, c.value


def shapes(name, rows, cols):
    """(codes' shape, scales' shape) of one rows x cols matrix of format `name`."""
    bits, br, bc = info(name)
    return (rows, (cols * bits + 7) // 8), (-(-rows // br) if br else 1, -(-cols // bc) if bc else 1)


def _codes(t, name):
    """A code tensor as uint8 (float8_e4m3fn's bytes as they are)."""
    if isinstance(t, torch.Tensor) and str(t.dtype) == "torch.float8_e4m3fn":
        return t.view(torch.uint8)
    return t


@dataclass
class Quantized:
    """E quantized matrices [rows x cols] of `format` (a name in moecert.FORMATS other than
    "bf16"): codes [E, rows, row bytes] uint8 (int4: ceil(cols / 2) bytes a row; fp8: the e4m3
    bytes, or a torch.float8_e4m3fn tensor) and scales [E, scale rows, scale columns] fp32 (bf16
    is widened exactly), or lists of E 2-D tensors each (a checkpoint's per-expert tensors, used
    where they are)."""
    format: str
    codes: object
    scales: object
    cols: int

    def matrices(self):
        """[(codes [rows, row bytes] uint8, scales fp32)] per expert, checked (CPU, contiguous,
        the format's shapes)."""
        format_number(self.format)
        codes = [_codes(c, self.format) for c in (self.codes if isinstance(self.codes, (list, tuple))
                                                  else list(_codes(self.codes, self.format)))]
        scales = list(self.scales) if isinstance(self.scales, (list, tuple)) else list(self.scales)
        if len(codes) != len(scales) or not codes:
            raise InvalidArgument("{}: {} code and {} scale matrices, expected as many (>= 1)".format(
                self.format, len(codes), len(scales)))
        out = []
        for e, (c, s) in enumerate(zip(codes, scales)):
            if not isinstance(c, torch.Tensor) or c.dim() != 2:
                raise InvalidArgument("codes[{}]: expected a 2-D tensor".format(e))
            code_shape, scale_shape = shapes(self.format, c.shape[0], self.cols)
            check(c, "codes[{}]".format(e), (torch.uint8,), code_shape)
            if isinstance(s, torch.Tensor) and s.dtype == torch.bfloat16:
                s = s.float()
            check(s, "scales[{}]".format(e), (torch.float32,), scale_shape)
            out.append((c, s))
        return out

    def rows(self):
        return self.matrices()[0][0].shape[0]


def descriptors(quantized):
    """The ABI's moecert_quant array of `quantized` (Quantized), and the tensors it points into."""
    mats = quantized.matrices()
    array = (_abi.Quant * len(mats))()
    for q, (c, s) in zip(array, mats):
        q.codes, q.scales, q.cols = describe(c), describe(s), quantized.cols
    return array, mats


def quantize(w, format):
    """Quantized weights of w [E, rows, cols] or [rows, cols] (any float dtype, read as fp32) in
    `format`: per block of the format, scale = fp32(max |w| / code_max) (127, 7 or 448; 1 for an
    all-zero block) and each code the nearest to w / scale, ties to even (moecert::quantize).
    Returns a Quantized of E = 1 for a 2-D w."""
    number = format_number(format)
    if not isinstance(w, torch.Tensor) or w.dim() not in (2, 3) or not w.is_floating_point():
        raise InvalidArgument("w: expected a [E, rows, cols] or [rows, cols] floating-point tensor")
    w3 = (w if w.dim() == 3 else w.unsqueeze(0)).detach().float().contiguous()
    E, rows, cols = w3.shape
    code_shape, scale_shape = shapes(format, rows, cols)
    codes = torch.zeros((E,) + code_shape, dtype=torch.uint8)
    scales = torch.empty((E,) + scale_shape, dtype=torch.float32)
    for e in range(E):
        out = _abi.Quant(describe(codes[e]), describe(scales[e]), cols)
        _abi.call("moecert_quantize", number, ctypes.byref(describe(w3[e])), ctypes.byref(out))
    return Quantized(format, codes, scales, cols)


def deepseek_v3_experts(get, layer, experts, prefix="model.layers.{layer}.mlp.experts.{expert}."):
    """The routed experts of layer `layer` of a DeepSeek-V3 (V2, R1) FP8 checkpoint as (gate, up,
    down) Quantized of fp8_e4m3_block128: per expert `{prefix}gate_proj.weight` (float8_e4m3fn, or
    its bytes as uint8) with `.weight_scale_inv` (fp32), likewise up_proj and down_proj. get(name)
    reads one tensor: safetensors' safe_open(...).get_tensor, checkpoint(directory), or a dict's
    __getitem__. The codes and scales are used as read, never widened to bf16."""
    out = []
    for proj in ("gate_proj", "up_proj", "down_proj"):
        codes, scales = [], []
        for e in range(experts):
            name = prefix.format(layer=layer, expert=e) + proj
            codes.append(get(name + ".weight"))
            scales.append(get(name + ".weight_scale_inv"))
        if not isinstance(codes[0], torch.Tensor) or codes[0].dim() != 2:
            raise InvalidArgument("{}: expected a 2-D tensor of e4m3 codes".format(
                prefix.format(layer=layer, expert=0) + proj + ".weight"))
        out.append(Quantized("fp8_e4m3_block128", codes, scales, codes[0].shape[1]))
    return tuple(out)


def checkpoint(directory):
    """get(name) -> tensor over a safetensors checkpoint in `directory` (sharded, with
    model.safetensors.index.json, or one model.safetensors), read with the safetensors package."""
    import json
    import os
    try:
        from safetensors import safe_open
    except ImportError:
        raise InvalidArgument("checkpoint: reading safetensors needs the safetensors package") from None
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            where = json.load(f)["weight_map"]
    else:
        where = None
    opened = {}

    def get(name):
        file = where.get(name) if where is not None else "model.safetensors"
        if file is None:
            raise InvalidArgument("{}: not in {}".format(name, index))
        if file not in opened:
            opened[file] = safe_open(os.path.join(directory, file), framework="pt")
        return opened[file].get_tensor(name)

    return get
