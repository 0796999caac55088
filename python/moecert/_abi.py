"""ctypes bindings of libmoecert_c.so (include/moecert/moecert.h), one to one.

The library is found, first match wins, at: $MOECERT_LIBRARY; moecert/_lib/
beside this file (what `make python` links); build/release/ of the source tree
this package sits in.
"""
import ctypes
import os
from ctypes import (POINTER, Structure, c_char_p, c_double, c_float, c_int32, c_int64, c_size_t, c_uint32, c_uint64,
                    c_void_p)

from .errors import raise_for

ABI_VERSION = 3


class Tensor(Structure):
    _fields_ = [("data", c_void_p), ("dtype", c_int32), ("ndim", c_int32), ("shape", c_int64 * 2),
                ("stride", c_int64 * 2)]


_LORA = ("a_gate", "b_gate", "a_up", "b_up", "a_down", "b_down")
_BASE = ("w_gate", "w_up", "w_down")


class Lora(Structure):
    _fields_ = [(n, Tensor) for n in _LORA] + [("rank", c_int64), ("alpha", c_double)]


class Quant(Structure):
    _fields_ = [("codes", Tensor), ("scales", Tensor), ("cols", c_int64)]


class TrainOptions(Structure):
    _fields_ = [("isa", c_int32), ("training", c_int32), ("memory_cap", c_uint64)]


EXPERTS_GRADS = ("dx", "dweights") + _LORA + _BASE + ("m_a", "m_g")
LAYER_GRADS = ("dx", "router_w", "router_b") + _LORA + _BASE + ("m_a", "m_g")


class ExpertsGrads(Structure):
    _fields_ = [(n, Tensor) for n in EXPERTS_GRADS]


class LayerGrads(Structure):
    _fields_ = [(n, Tensor) for n in LAYER_GRADS]


class Config(Structure):
    _fields_ = [("experts", c_int64), ("hidden", c_int64), ("inter", c_int64), ("topk", c_int64),
                ("lora_rank", c_int64), ("lora_alpha", c_double), ("router", c_int32), ("renormalize", c_int32),
                ("groups", c_int64), ("topk_group", c_int64), ("scaling", c_double), ("max_tokens", c_int64)]


class LayerWeights(Structure):
    _fields_ = [("experts", c_void_p), ("router_w", Tensor), ("router_b", Tensor), ("router_bias", Tensor),
                ("lora", Lora)]


class Error(Structure):
    _fields_ = [("status", c_int32)] + [(n, c_char_p) for n in (
        "op", "clause", "kind", "group", "level", "location", "observed", "expected", "message", "file")] + [
        ("line", c_int32)]


class NamedTensor(Structure):
    _fields_ = [("name", c_char_p), ("tensor", Tensor), ("stored_as", c_int32)]


T = POINTER(Tensor)
H = c_void_p  # an opaque handle
OUT_H = POINTER(c_void_p)

# name: (argument types, return type); status-returning unless noted.
_PROTOTYPES = {
    "moecert_last_error": ([], POINTER(Error)),
    "moecert_abi_version": ([], c_int32),
    "moecert_version": ([], c_char_p),
    "moecert_build_info": ([], c_char_p),
    "moecert_set_contract_level": ([c_int32], c_int32),
    "moecert_set_contract_semantic": ([c_int32], c_int32),
    "moecert_set_contract_groups": ([c_uint32], c_int32),
    "moecert_contract_level": ([], c_int32),
    "moecert_contract_semantic": ([], c_int32),
    "moecert_contract_groups": ([], c_uint32),
    "moecert_contract_level_cap": ([], c_int32),
    "moecert_contract_scope_push": ([c_int32, c_int32, c_uint32], c_int32),
    "moecert_contract_scope_pop": ([], c_int32),
    "moecert_set_num_threads": ([c_int32], c_int32),
    "moecert_num_threads": ([], c_int32),
    "moecert_default_isa": ([], c_int32),
    "moecert_isa_usable": ([c_int32], c_int32),
    "moecert_isa_name": ([c_int32], c_char_p),
    "moecert_enum_name": ([c_int32, c_int32], c_char_p),
    "moecert_experts_pack": ([c_int64, T, T, T, c_int32, OUT_H], c_int32),
    "moecert_experts_free": ([H], None),
    "moecert_format_info": ([c_int32, POINTER(c_int32), POINTER(c_int64), POINTER(c_int64)], c_int32),
    "moecert_quantize": ([c_int32, T, POINTER(Quant)], c_int32),
    "moecert_experts_pack_quantized": ([c_int32, c_int64, POINTER(Quant), POINTER(Quant), POINTER(Quant), c_int32,
                                        OUT_H], c_int32),
    "moecert_experts_unpack_quantized": ([H, POINTER(Quant), POINTER(Quant), POINTER(Quant)], c_int32),
    "moecert_experts_format": ([H, POINTER(c_int32)], c_int32),
    "moecert_experts_unpack": ([H, T, T, T], c_int32),
    "moecert_experts_shape": ([H, POINTER(c_int64), POINTER(c_int64), POINTER(c_int64), POINTER(c_int32),
                               POINTER(c_int64)], c_int32),
    "moecert_experts_saved_new": ([OUT_H], c_int32),
    "moecert_experts_saved_free": ([H], None),
    "moecert_experts_forward": ([H, T, T, T, T, c_int32], c_int32),
    "moecert_experts_forward_train": ([H, POINTER(Lora), T, T, T, T, H, POINTER(TrainOptions)], c_int32),
    "moecert_experts_backward": ([H, POINTER(Lora), T, T, H, POINTER(ExpertsGrads)], c_int32),
    "moecert_softmax_topk_forward": ([T, T, T, c_int32], c_int32),
    "moecert_softmax_topk_backward": ([T, T, T, T, c_int32], c_int32),
    "moecert_sigmoid_topk_forward": ([T, T, c_int64, c_int64, c_float, T, T], c_int32),
    "moecert_sigmoid_topk_backward": ([T, T, T, c_int64, c_int64, c_float, T], c_int32),
    "moecert_product_key_forward": ([T, T, c_int32, T, T], c_int32),
    "moecert_product_key_backward": ([T, T, T, T, c_int32, T, T], c_int32),
    "moecert_config_validate": ([POINTER(Config)], c_int32),
    "moecert_config_router_width": ([POINTER(Config), POINTER(c_int64)], c_int32),
    "moecert_layer_saved_new": ([OUT_H], c_int32),
    "moecert_layer_saved_free": ([H], None),
    "moecert_layer_saved_routing": ([H, T, T], c_int32),
    "moecert_layer_saved_router": ([H, T, T, T], c_int32),
    "moecert_layer_forward": ([POINTER(Config), POINTER(LayerWeights), T, T, H, POINTER(TrainOptions)], c_int32),
    "moecert_layer_backward": ([POINTER(Config), POINTER(LayerWeights), T, T, H, POINTER(LayerGrads), c_int32,
                                c_int32], c_int32),
    "moecert_router_linear_forward": ([T, T, T, T, c_int32], c_int32),
    "moecert_router_linear_backward": ([T, T, T, T, T, T, c_int32], c_int32),
    "moecert_experts_bounds": ([H, POINTER(Lora), T, T, H, T, POINTER(ExpertsGrads)], c_int32),
    "moecert_layer_bounds": ([POINTER(Config), POINTER(LayerWeights), T, T, H, T, POINTER(LayerGrads)], c_int32),
    "moecert_router_bounds": ([c_int32, c_double, T, T, T, T, T], c_int32),
    "moecert_check": ([c_char_p, POINTER(NamedTensor), c_size_t, POINTER(NamedTensor), c_size_t, POINTER(c_char_p),
                       c_size_t, POINTER(c_void_p)], c_int32),
    "moecert_free_string": ([c_void_p], None),
}


def _candidates():
    env = os.environ.get("MOECERT_LIBRARY")
    if env:
        yield env
    here = os.path.dirname(os.path.abspath(__file__))
    yield os.path.join(here, "_lib", "libmoecert_c.so")
    yield os.path.join(here, "..", "..", "build", "release", "libmoecert_c.so")


def _load():
    tried = []
    for path in _candidates():
        if os.path.exists(path):
            lib = ctypes.CDLL(os.path.abspath(path))
            break
        tried.append(path)
    else:
        raise ImportError("moecert: libmoecert_c.so not found (tried {}); run `make python` or set "
                          "MOECERT_LIBRARY".format(", ".join(tried)))
    lib.moecert_abi_version.argtypes, lib.moecert_abi_version.restype = [], c_int32
    if lib.moecert_abi_version() != ABI_VERSION:
        raise ImportError("moecert: {} has ABI version {}, this package expects {}".format(
            lib._name, lib.moecert_abi_version(), ABI_VERSION))
    for name, (args, res) in _PROTOTYPES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


lib = _load()


def _names(which):
    out = []
    while True:
        name = lib.moecert_enum_name(which, len(out))
        if name is None:
            return tuple(out)
        out.append(name.decode())


ENUMS = _names(-1)


def names(enum):
    """The names of the values of the C header's enum `enum` ("status", "dtype", "level",
    "semantic", "group", "isa", "router", "key_weights"), in value order: read from the library,
    which static_asserts them against the C++ enums."""
    return _names(ENUMS.index(enum))


STATUS = names("status")
BF16, F32, I32, F64, U8, I64 = (names("dtype").index(n) for n in ("bf16", "f32", "i32", "f64", "u8", "i64"))
PRECONDITION_OBSERVED = STATUS.index("precondition_observed")


def status_name(status):
    return STATUS[status] if 0 <= status < len(STATUS) else "status {}".format(status)


def call(name, *args):
    """Calls a status-returning ABI function: True on OK; False when a precondition failed under
    observe (the handler reported it; the op wrote nothing); raises on any other status."""
    status = getattr(lib, name)(*args)
    if status == 0:
        return True
    if status == PRECONDITION_OBSERVED:
        return False
    raise_for(status_name(status), lib.moecert_last_error().contents)


def new_handle(name):
    h = c_void_p()
    call(name, ctypes.byref(h))
    return h


def value(name, failed=-1):
    """Calls a getter of the ABI; its failure value (a malformed MOECERT_* setting) raises the
    error it recorded."""
    v = getattr(lib, name)()
    if v == failed:
        err = lib.moecert_last_error().contents
        raise_for(status_name(err.status), err)
    return v


class Handle:
    """Owns one opaque handle; frees it with `free` when collected."""

    def __init__(self, ptr, free):
        self.ptr, self._free = ptr, free

    def __del__(self):
        if getattr(self, "ptr", None) and self.ptr.value:
            getattr(lib, self._free)(self.ptr)
            self.ptr = None
