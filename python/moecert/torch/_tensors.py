"""torch tensors as ABI tensor descriptors, checked before any work: CPU,
dtype, shape, contiguity, and no argument overlapping another."""
import ctypes

import torch

from .. import _abi
from ..errors import InvalidArgument

DTYPES = {torch.bfloat16: _abi.BF16, torch.float32: _abi.F32, torch.int32: _abi.I32, torch.float64: _abi.F64,
          torch.uint8: _abi.U8, torch.int64: _abi.I64}
ABSENT = _abi.Tensor()


def check(t, name, dtypes, shape):
    """Raises InvalidArgument unless t is a contiguous CPU tensor of one of `dtypes` and of `shape`
    (None in it: any size)."""
    if not isinstance(t, torch.Tensor):
        raise InvalidArgument("{}: {}, expected a torch.Tensor".format(name, type(t).__name__))
    if t.device.type != "cpu":
        raise InvalidArgument("{}: on {}, expected a CPU tensor".format(name, t.device))
    if t.dtype not in dtypes:
        raise InvalidArgument("{}: dtype {}, expected {}".format(
            name, str(t.dtype).replace("torch.", ""), " or ".join(str(d).replace("torch.", "") for d in dtypes)))
    if t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape)):
        want = " x ".join("?" if s is None else str(s) for s in shape)
        raise InvalidArgument("{}: shape {}, expected [{}]".format(name, list(t.shape), want))
    if not t.is_contiguous():
        raise InvalidArgument("{}: not contiguous (strides {}); pass {}.contiguous()".format(name, t.stride(), name))
    if t.is_sparse or t.is_quantized:
        raise InvalidArgument("{}: sparse or quantized, expected a dense tensor".format(name))


def describe(t):
    """The descriptor of a checked tensor of at most 2 dimensions (None: absent); a contiguous
    3-D [E, m, n] tensor as the ABI's stacked 2-D [E*m, n]."""
    if t is None:
        return _abi.Tensor()
    data = t.data_ptr() if t.numel() else None
    if t.dim() == 3:
        E, m, n = t.shape
        return _abi.Tensor(data, DTYPES[t.dtype], 2, (E * m, n), (n, 1))
    if not t.numel():  # no elements: torch's strides are arbitrary (an expanded gradient's are 0)
        return _abi.Tensor(None, DTYPES[t.dtype], t.dim(), tuple(t.shape), (t.shape[-1], 1)[-t.dim():])
    return _abi.Tensor(data, DTYPES[t.dtype], t.dim(), tuple(t.shape), t.stride())


def signature(tensors):
    """What the checks of these tensors depend on (address, shape, strides, dtype, device; None for
    an absent one), to compare with an earlier call's; None where one is not a dense tensor."""
    try:
        return tuple(None if t is None else (t.data_ptr(), t.shape, t.stride(), t.dtype, t.is_cpu) for t in tensors)
    except (AttributeError, RuntimeError):
        return None


def ref(d):
    return ctypes.byref(d)


def byte_range(t):
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def check_no_alias(named, checked=()):
    """Raises InvalidArgument if two of the (name, tensor) pairs, or one of them and one of the
    `checked` spans (an earlier call's result), share a byte; returns the (start, end, name) byte
    spans of `named`, sorted."""
    spans = sorted((byte_range(t) + (n,)) for n, t in named if t is not None and t.numel())
    every = sorted(spans + list(checked)) if checked else spans
    for (a0, a1, an), (b0, b1, bn) in zip(every, every[1:]):
        if b0 < a1:
            raise InvalidArgument("{} and {} overlap in memory; pass separate tensors".format(an, bn))
    return spans


def index_tensor(t, name, shape):
    """Expert ids as int32: int32 as is, int64 (torch.topk's) converted when every value fits int32
    (the op then judges them as int32 ids); a value that does not fit is refused naming it."""
    check(t, name, (torch.int32, torch.int64), shape)
    if t.dtype == torch.int64:
        wide = (t < -2 ** 31) | (t >= 2 ** 31)
        if t.numel() and bool(wide.any()):
            at = tuple(int(i) for i in torch.nonzero(wide)[0])
            raise InvalidArgument("{}[{}] = {}: expected -1 <= id < the expert count (an int32)".format(
                name, ", ".join(map(str, at)), int(t[at])))
        return t.to(torch.int32)
    return t


def grad_input(dy, name, shape):
    """An incoming gradient as the kernels read it: contiguous fp32 (autograd hands over any layout)."""
    if dy.device.type != "cpu":
        raise InvalidArgument("{}: on {}, expected a CPU tensor".format(name, dy.device))
    dy = dy.to(torch.float32).contiguous()
    check(dy, name, (torch.float32,), shape)
    return dy
