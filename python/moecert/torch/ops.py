"""moecert's ops on torch tensors, without autograd: the one-to-one layer over
the C ABI that the autograd Functions and modules are built on. Inputs are
checked here (CPU, dtype, shape, contiguity, aliasing) before any work;
outputs are allocated here.

Shapes (torch layout, per expert out x in as nn.Linear):
  w_gate, w_up [E, I, H], w_down [E, H, I] bf16
  LoRA a_gate, a_up [E, r, H], b_gate, b_up [E, I, r], a_down [E, r, I], b_down [E, H, r]
  x [T, H] bf16; expert ids [T, K] int32 (or int64); weights [T, K] fp32; y [T, H] fp32
"""
import ctypes
from dataclasses import dataclass

import torch

from .. import _abi
from .._abi import EXPERTS_GRADS, LAYER_GRADS
from ..errors import InvalidArgument
from . import keys
from ._tensors import check, check_no_alias, describe, grad_input, index_tensor, ref, signature

BF16, F32 = (torch.bfloat16,), (torch.float32,)
LORA_NAMES = ("a_gate", "b_gate", "a_up", "b_up", "a_down", "b_down")
BASE_NAMES = ("w_gate", "w_up", "w_down")
ROUTERS = _abi.names("router")  # the C ABI's numbering
KEY_WEIGHTS = _abi.names("key_weights")


def isa_number(isa):
    """The C ABI's number of a kernel level named in moecert.ISAS (None: -1, the default); a
    number is returned as it is."""
    if isa is None:
        return -1
    if isinstance(isa, int):
        return isa
    from .. import ISAS
    if isa not in ISAS:
        raise InvalidArgument("isa {!r}: expected one of {}".format(isa, ", ".join(ISAS)))
    return ISAS.index(isa)


class SavedPool:
    """Saved states whose backward has run, for later forwards to reuse: a state's arena (the
    saved activations, megabytes to gigabytes) is then allocated and first touched once, not per
    step, as in a C++ training loop. Holds at most `limit` idle states."""

    def __init__(self, make, limit=4):
        self._make, self._idle, self._limit = make, [], limit

    def take(self):
        try:
            return self._idle.pop()
        except IndexError:
            return self._make()

    def give(self, saved):
        if len(self._idle) < self._limit and all(saved is not s for s in self._idle):
            self._idle.append(saved)


def _op(name, outputs, *args):
    """Calls op `name` of the ABI; when a precondition failed under observe (the handler reported
    it and the op wrote nothing) fills `outputs` with NaN (-1 for indices) and returns the failed
    clause's id, else None."""
    if _abi.call(name, *args):
        return None
    for t in outputs:
        if t is not None and t.numel():
            t.fill_(-1 if not t.is_floating_point() else float("nan"))
    return (_abi.lib.moecert_last_error().contents.clause or b"").decode() or name


def check_generation(saved, generation):
    """Raises unless `saved` still holds the forward that wrote `generation`, and that forward
    computed (it did not fail a precondition under observe)."""
    if saved.failed is not None:
        raise InvalidArgument("the forward failed {} under observe (its outputs are NaN): it has no "
                              "backward".format(saved.failed))
    if saved.generation != generation:
        raise InvalidArgument("the forward's saved state was reused by a later forward after this graph's "
                              "backward ran: a second backward through one graph is not supported")


class PackedExperts:
    """Expert weights packed for moecert's kernels: the experts' storage. w_gate, w_up [E, I, H],
    w_down [E, H, I] bf16 are copied in; later changes to those tensors do not reach the pack
    (pack again, or let MoELayer hold the weights). Quantized base weights (formats.Quantized,
    all three of one format: gate and up [I x H], down [H x I] per expert) are packed as codes
    and scales, the kernels computing with bf16(fp32(code * scale)). backward=True also packs the
    orientations a backward multiplies by. unpack() reads the weights back bitwise (a quantized
    pack: the dequantized weights; unpack_quantized() its codes and scales); a copy, a pickle or
    torch.save of a PackedExperts holds them and packs them again when loaded."""

    def __init__(self, w_gate, w_up, w_down, backward=True):
        from .formats import Quantized
        ptr = ctypes.c_void_p()
        self.backward = bool(backward)
        if isinstance(w_gate, Quantized):
            self.format = w_gate.format
            packed = self._pack_quantized(w_gate, w_up, w_down, ptr)
        else:
            self.format = "bf16"
            packed = self._pack(w_gate, w_up, w_down, ptr)
        if not packed:
            raise InvalidArgument("w_gate, w_up, w_down: packing failed {} under observe".format(
                (_abi.lib.moecert_last_error().contents.clause or b"").decode()))
        self._handle = _abi.Handle(ptr, "moecert_experts_free")
        self.experts_pool = SavedPool(ExpertsSaved)
        self.layer_pool = SavedPool(LayerSaved)
        self._memo = {}
        keys.key_of(self)

    @property
    def key(self):
        """The key naming these packed experts in the ops' schemas (keys.py)."""
        return self._key

    def _pack(self, w_gate, w_up, w_down, ptr):
        if not isinstance(w_gate, torch.Tensor) or w_gate.dim() != 3:
            raise InvalidArgument("w_gate: expected a [E, I, H] tensor (or formats.Quantized)")
        E, I, H = w_gate.shape
        check(w_gate, "w_gate", BF16, (E, I, H))
        check(w_up, "w_up", BF16, (E, I, H))
        check(w_down, "w_down", BF16, (E, H, I))
        self.experts, self.inter, self.hidden = E, I, H
        with torch.no_grad():
            return _abi.call("moecert_experts_pack", E, ref(describe(w_gate)), ref(describe(w_up)),
                             ref(describe(w_down)), int(self.backward), ctypes.byref(ptr))

    def _pack_quantized(self, w_gate, w_up, w_down, ptr):
        from .formats import Quantized, descriptors, format_number
        for name, q in (("w_up", w_up), ("w_down", w_down)):
            if not isinstance(q, Quantized) or q.format != w_gate.format:
                raise InvalidArgument("{}: {}, expected formats.Quantized of w_gate's format {}".format(
                    name, type(q).__name__ if not isinstance(q, Quantized) else q.format, w_gate.format))
        kept = [descriptors(q) for q in (w_gate, w_up, w_down)]  # the arrays and the tensors they name
        g, u, d = (array for array, _ in kept)
        E, I, H = len(g), g[0].codes.shape[0], w_gate.cols
        if len(u) != E or len(d) != E:
            raise InvalidArgument("w_gate, w_up, w_down: {}, {} and {} experts, expected as many".format(
                E, len(u), len(d)))
        self.experts, self.inter, self.hidden = E, I, H
        return _abi.call("moecert_experts_pack_quantized", format_number(self.format), E, g, u, d,
                         int(self.backward), ctypes.byref(ptr))

    def unpack_quantized(self):
        """A quantized pack's (w_gate, w_up, w_down) as formats.Quantized of new tensors holding
        its codes and scales, bitwise those it was given."""
        from .formats import Quantized, descriptors, shapes
        if self.format == "bf16":
            raise InvalidArgument("unpack_quantized: a bf16 pack (unpack() reads it)")
        out = []
        for rows, cols in ((self.inter, self.hidden), (self.inter, self.hidden), (self.hidden, self.inter)):
            code_shape, scale_shape = shapes(self.format, rows, cols)
            out.append(Quantized(self.format, torch.zeros((self.experts,) + code_shape, dtype=torch.uint8),
                                 torch.empty((self.experts,) + scale_shape, dtype=torch.float32), cols))
        arrays = [descriptors(q)[0] for q in out]
        _abi.call("moecert_experts_unpack_quantized", self.ptr, *arrays)
        return tuple(out)

    def unpack(self):
        """(w_gate, w_up, w_down): new bf16 tensors holding the packed weights, bitwise (a quantized
        pack's dequantized weights)."""
        E, I, H = self.experts, self.inter, self.hidden
        out = (torch.empty(E, I, H, dtype=torch.bfloat16), torch.empty(E, I, H, dtype=torch.bfloat16),
               torch.empty(E, H, I, dtype=torch.bfloat16))
        _abi.call("moecert_experts_unpack", self.ptr, *(ref(describe(t)) for t in out))
        return out

    def __reduce__(self):
        weights = self.unpack() if self.format == "bf16" else self.unpack_quantized()
        return PackedExperts, weights + (self.backward,)

    def adopt_pools(self, other):
        """Takes `other`'s idle saved states (their arenas stay allocated across a repack)."""
        self.experts_pool, self.layer_pool = other.experts_pool, other.layer_pool

    def memo(self, name, key, make):
        """make(), or what it returned for `name` at the last call with an equal key (a key of
        None is never equal): the checked descriptors of the tensors a training loop passes at
        every step (LoRA factors, router weights), which stay where they are between steps."""
        if key is not None:
            hit = self._memo.get(name)
            if hit is not None and hit[0] == key:
                return hit[1]
        value = make()
        if key is not None:
            self._memo[name] = (key, value)
        return value

    @property
    def ptr(self):
        return self._handle.ptr

    def nbytes(self):
        b = ctypes.c_int64()
        _abi.call("moecert_experts_shape", self.ptr, None, None, None, None, ctypes.byref(b))
        return b.value


@dataclass
class Lora:
    """LoRA factors of every expert (fp32 or bf16; fp32 ones are rounded to bf16 for the kernel,
    which is what the op then computes with) and alpha; scale = float(alpha / r)."""
    a_gate: torch.Tensor
    b_gate: torch.Tensor
    a_up: torch.Tensor
    b_up: torch.Tensor
    a_down: torch.Tensor
    b_down: torch.Tensor
    alpha: float

    @property
    def rank(self):
        return self.a_gate.shape[1]

    def factors(self):
        return tuple(getattr(self, n) for n in LORA_NAMES)


def _lora_shapes(E, H, I, r):
    return {"a_gate": (E, r, H), "b_gate": (E, I, r), "a_up": (E, r, H), "b_up": (E, I, r), "a_down": (E, r, I),
            "b_down": (E, H, r)}


def kernel_lora(lora, E, H, I):
    """The factors as the ABI takes them: checked, detached, all bf16 or all fp32 (None: no
    LoRA). The ABI rounds fp32 factors to bf16 on moecert's threads and keeps that rounding in
    the saved state for the backward."""
    if lora is None:
        return None
    if not isinstance(lora.a_gate, torch.Tensor) or lora.a_gate.dim() != 3:
        raise InvalidArgument("lora.a_gate: expected a [E, r, H] tensor")
    out = []
    for name, shape in _lora_shapes(E, H, I, lora.rank).items():
        t = getattr(lora, name)
        check(t, "lora." + name, (torch.float32, torch.bfloat16), shape)
        if t.dtype != lora.a_gate.dtype:
            raise InvalidArgument("lora.{}: dtype {}, lora.a_gate's is {}; give the six factors in one dtype".format(
                name, str(t.dtype).replace("torch.", ""), str(lora.a_gate.dtype).replace("torch.", "")))
        out.append(t.detach())
    return Lora(*out, alpha=float(lora.alpha))


def _lora_struct(k):
    s = _abi.Lora()
    if k is not None:
        for name in LORA_NAMES:
            setattr(s, name, describe(getattr(k, name)))
        s.rank, s.alpha = k.rank, k.alpha
    return s


def _lora_key(lora):
    """The memo key of LoRA factors: their signature and alpha (None: no LoRA, or not tensors)."""
    if lora is None:
        return ()
    sig = signature(lora.factors())
    return None if sig is None else (sig, lora.alpha)


def _checked_lora(lora, E, H, I):
    """(the kernel's factors, their ABI struct, their byte spans), the factors checked. a_up may be
    a_gate itself (one A shared by gate and up, as PEFT's gate_up_proj adapter has): the op only
    reads them; any other overlap between factors is refused."""
    k = kernel_lora(lora, E, H, I)
    if k is None:
        return k, _lora_struct(k), []
    shared = signature((k.a_gate,)) == signature((k.a_up,))
    spans = check_no_alias([("lora." + n, getattr(k, n)) for n in LORA_NAMES if not (shared and n == "a_up")])
    return k, _lora_struct(k), spans


_OPTIONS = {}


def _options(isa, training=True):
    """The ABI's TrainOptions (one struct per value; the ABI only reads it)."""
    key = (isa, bool(training))
    options = _OPTIONS.get(key)
    if options is None:
        options = _OPTIONS[key] = _abi.TrainOptions(isa_number(isa), int(training), 0)
    return options


# ---- experts --------------------------------------------------------------

def experts_forward(packed, x, expert_ids, weights, isa=None):
    """Inference forward: y [T, H] fp32."""
    T, K = _routing_shape(packed, x, expert_ids)
    ids = index_tensor(expert_ids, "expert_ids", (T, K))
    check(weights, "weights", F32, (T, K))
    y = torch.empty(T, packed.hidden, dtype=torch.float32)
    check_no_alias([("x", x), ("expert_ids", ids), ("weights", weights)])
    _op("moecert_experts_forward", (y,), packed.ptr, ref(describe(x)), ref(describe(ids)), ref(describe(weights)),
        ref(describe(y)), isa_number(isa))
    return y


def _routing_shape(packed, x, expert_ids):
    if not isinstance(packed, PackedExperts):
        raise InvalidArgument("packed: {}, expected moecert.torch.PackedExperts".format(type(packed).__name__))
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise InvalidArgument("x: expected a [T, H] tensor")
    check(x, "x", BF16, (None, packed.hidden))
    if not isinstance(expert_ids, torch.Tensor) or expert_ids.dim() != 2:
        raise InvalidArgument("expert_ids: expected a [T, K] tensor")
    return x.shape[0], expert_ids.shape[1]


class ExpertsSaved:
    """What a training forward keeps for its backward (the C++ experts::Saved, and the inputs the
    backward reads again). `generation` counts the forwards that wrote it."""

    def __init__(self):
        self._handle = _abi.Handle(_abi.new_handle("moecert_experts_saved_new"), "moecert_experts_saved_free")
        self.packed = self._lora = self._lora_struct = self.x = self.failed = None
        self.tokens = self.topk = self.generation = 0

    @property
    def ptr(self):
        return self._handle.ptr

    @property
    def lora(self):
        """The forward's LoRA factors (Lora, detached) or None."""
        return self._lora

    @lora.setter
    def lora(self, k):
        self._lora, self._lora_struct = k, None

    def lora_descriptors(self, struct=None):
        """The ABI struct of `lora` (formed at the first call after `lora` was set, or given)."""
        if struct is not None:
            self._lora_struct = struct
        elif self._lora_struct is None:
            self._lora_struct = _lora_struct(self._lora)
        return self._lora_struct


def experts_forward_train(packed, x, expert_ids, weights, lora=None, saved=None, isa=None, training=True):
    """Training forward: (y [T, H] fp32, saved). lora: Lora or None."""
    _routing_shape(packed, x, expert_ids)
    saved = saved or ExpertsSaved()
    return _experts_forward(packed, _experts_lora(packed, lora), x, expert_ids, weights, saved,
                            _options(isa, training)), saved


def _experts_lora(packed, lora):
    """(the kernel's factors, their ABI struct, their byte spans) of lora, checked; the same
    objects as at the last call while the factors stay where they were."""
    return packed.memo("experts.lora", _lora_key(lora),
                       lambda: _checked_lora(lora, packed.experts, packed.hidden, packed.inter))


def _experts_forward(packed, lora_args, x, expert_ids, weights, saved, options):
    """y of x (checked as _routing_shape does) routed by expert_ids and weights (checked, and apart
    from each other and the factors' spans), the forward recorded in saved."""
    T, K = x.shape[0], expert_ids.shape[1]
    ids = index_tensor(expert_ids, "expert_ids", (T, K))
    check(weights, "weights", F32, (T, K))
    k, lora_struct, lora_spans = lora_args
    check_no_alias([("x", x), ("expert_ids", ids), ("weights", weights)], lora_spans)
    y = torch.empty(T, packed.hidden, dtype=torch.float32)
    saved.failed = _op("moecert_experts_forward_train", (y,), packed.ptr, ref(lora_struct), ref(describe(x)),
                       ref(describe(ids)), ref(describe(weights)), ref(describe(y)), saved.ptr, ref(options))
    saved.packed, saved.lora, saved.x, saved.tokens, saved.topk = packed, k, x, T, K
    saved.lora_descriptors(lora_struct)
    saved.generation += 1
    return y


def _experts_grad_shapes(p, T, K, r):
    E, H, I = p.experts, p.hidden, p.inter
    shapes = {"dx": (T, H), "dweights": (T, K), "w_gate": (E, I, H), "w_up": (E, I, H), "w_down": (E, H, I),
              "m_a": (T, E), "m_g": (T, E)}
    shapes.update(_lora_shapes(E, H, I, r))
    return shapes


_LAYOUTS = {}


def _fill(cls, names, shapes_of, want, dtype, dx_dtype=None, key=None):
    """(a fresh `cls` struct with the wanted outputs allocated into it, them by name; dx as
    dx_dtype if given); shapes_of() -> {name: shape}. With a `key` that fixes the other arguments,
    the struct's layout is formed once per key (up to 64 keys are kept)."""
    layout = _LAYOUTS.get(key) if key is not None else None
    if layout is None:
        layout = _layout(cls, names, shapes_of(), want, dtype, dx_dtype)
        if key is not None:
            if len(_LAYOUTS) >= 64:
                _LAYOUTS.clear()
            _LAYOUTS[key] = layout
    return _allocate(cls, layout)


def _layout(cls, names, shapes, want, dtype, dx_dtype=None):
    """(the bytes of a `cls` struct describing the wanted outputs but for their data addresses,
    (name, the address's offset, shape, dtype) of each): what a training loop's steps share."""
    template, slots = cls(), []
    for name in names:
        if name in want:
            t = torch.empty(shapes[name], dtype=dx_dtype if name == "dx" and dx_dtype else dtype)
            setattr(template, name, describe(t))
            slots.append((name, getattr(cls, name).offset + _abi.Tensor.data.offset, t.shape, t.dtype))
    return bytes(template), tuple(slots)


def _allocate(cls, layout):
    """(a `cls` struct of `layout` with its outputs allocated and their addresses written, them by
    name)."""
    struct, out = cls.from_buffer_copy(layout[0]), {}
    for name, offset, shape, dt in layout[1]:
        t = out[name] = torch.empty(shape, dtype=dt)
        ctypes.c_void_p.from_buffer(struct, offset).value = t.data_ptr() if t.numel() else None
    return struct, out


def _want(want, names, lora):
    want = set(want)
    unknown = want - set(names)
    if unknown:
        raise InvalidArgument("unknown outputs {}: expected some of {}".format(sorted(unknown), ", ".join(names)))
    if lora is None and want & set(LORA_NAMES):
        raise InvalidArgument("LoRA gradients asked for a forward without LoRA")
    return want


def experts_backward(saved, dy, want=("dx", "dweights") + LORA_NAMES, dx_dtype=torch.float32):
    """Backward from dy [T, H]: a dict of the outputs named in `want` (fp32; names as
    moecert_experts_grads: dx, dweights, a_gate .. b_down, w_gate, w_up, w_down, m_a, m_g). dx in
    dx_dtype: bf16 is the fp32 dx rounded to nearest even on moecert's threads."""
    want = _want(want, EXPERTS_GRADS, saved.lora)
    dy = grad_input(dy, "dy", (saved.tokens, saved.packed.hidden))
    r = saved.lora.rank if saved.lora is not None else 0
    p, T, K = saved.packed, saved.tokens, saved.topk
    g, out = _fill(_abi.ExpertsGrads, EXPERTS_GRADS, lambda: _experts_grad_shapes(p, T, K, r), want, torch.float32,
                   dx_dtype, key=("experts", p.experts, p.hidden, p.inter, T, K, r, frozenset(want), dx_dtype))
    _op("moecert_experts_backward", out.values(), saved.packed.ptr, ref(saved.lora_descriptors()),
        ref(describe(saved.x)), ref(describe(dy)), saved.ptr, ref(g))
    return out


def experts_bounds(saved, dy=None, want=()):
    """The derived element-wise bounds |moecert - exact| (fp64) of y and, with dy, of the outputs
    in `want` of the backward from dy (proofs/experts.md): a dict with "y" and those names."""
    want = _want(want, EXPERTS_GRADS, saved.lora)
    r = saved.lora.rank if saved.lora is not None else 0
    g, out = _fill(_abi.ExpertsGrads, EXPERTS_GRADS,
                   lambda: _experts_grad_shapes(saved.packed, saved.tokens, saved.topk, r), want, torch.float64)
    out["y"] = torch.empty(saved.tokens, saved.packed.hidden, dtype=torch.float64)
    dy = None if dy is None else grad_input(dy, "dy", (saved.tokens, saved.packed.hidden))
    _op("moecert_experts_bounds", out.values(), saved.packed.ptr, ref(saved.lora_descriptors()),
        ref(describe(saved.x)), ref(describe(dy)), saved.ptr, ref(describe(out["y"])), ref(g))
    return out


# ---- routers -------------------------------------------------------------

def _scores(z, name, bf16_ok=True):
    if not isinstance(z, torch.Tensor) or z.dim() != 2:
        raise InvalidArgument("{}: expected a [T, n] tensor".format(name))
    check(z, name, (torch.float32, torch.bfloat16) if bf16_ok else F32, (None, None))
    return z


def _router_outputs(T, K):
    return torch.empty(T, K, dtype=torch.int32), torch.empty(T, K, dtype=torch.float32)


def softmax_topk(z, k, renormalize=True):
    """(idx [T, k] int32, w [T, k] fp32) of z [T, E] fp32 or bf16."""
    z = _scores(z, "z")
    idx, w = _router_outputs(z.shape[0], k)
    _op("moecert_softmax_topk_forward", (idx, w), ref(describe(z)), ref(describe(idx)), ref(describe(w)),
        int(renormalize))
    return idx, w


def softmax_topk_backward(z, idx, g, renormalize=True):
    """dz [T, E] from g = dL/dw [T, K]."""
    z = _scores(z.float(), "z", False)
    idx = index_tensor(idx, "idx", (z.shape[0], None))
    g = grad_input(g, "g", tuple(idx.shape))
    dz = torch.empty(z.shape, dtype=torch.float32)
    _op("moecert_softmax_topk_backward", (dz,), ref(describe(z)), ref(describe(idx)), ref(describe(g)),
        ref(describe(dz)), int(renormalize))
    return dz


def sigmoid_topk(z, bias, k, groups=1, topk_group=1, scaling=1.0):
    """(idx, w) of z [T, E]; bias [E] fp32 enters the selection only."""
    z = _scores(z, "z")
    check(bias, "bias", F32, (z.shape[1],))
    idx, w = _router_outputs(z.shape[0], k)
    _op("moecert_sigmoid_topk_forward", (idx, w), ref(describe(z)), ref(describe(bias)), groups, topk_group, scaling,
        ref(describe(idx)), ref(describe(w)))
    return idx, w


def sigmoid_topk_backward(z, idx, g, groups=1, topk_group=1, scaling=1.0):
    z = _scores(z.float(), "z", False)
    idx = index_tensor(idx, "idx", (z.shape[0], None))
    g = grad_input(g, "g", tuple(idx.shape))
    dz = torch.empty(z.shape, dtype=torch.float32)
    _op("moecert_sigmoid_topk_backward", (dz,), ref(describe(z)), ref(describe(idx)), ref(describe(g)), groups,
        topk_group, scaling, ref(describe(dz)))
    return dz


def product_key(sx, sy, k, weights="softmax"):
    """(idx, w) of the halves sx, sy [T, n]; expert ix*n + iy; weights "raw", "exp" or "softmax"."""
    sx, sy = _scores(sx, "sx"), _scores(sy, "sy")
    if sy.shape != sx.shape or sy.dtype != sx.dtype:
        raise InvalidArgument("sy: {} {}, expected sx's {} {}".format(list(sy.shape), sy.dtype, list(sx.shape), sx.dtype))
    idx, w = _router_outputs(sx.shape[0], k)
    _op("moecert_product_key_forward", (idx, w), ref(describe(sx)), ref(describe(sy)), _key_mode(weights),
        ref(describe(idx)), ref(describe(w)))
    return idx, w


def _key_mode(weights):
    if weights not in KEY_WEIGHTS:
        raise InvalidArgument("weights {!r}: expected raw, exp or softmax".format(weights))
    return KEY_WEIGHTS.index(weights)


def product_key_backward(sx, sy, idx, g, weights="softmax"):
    """(dsx, dsy) [T, n] from g = dL/dw."""
    sx, sy = _scores(sx.float(), "sx", False), _scores(sy.float(), "sy", False)
    idx = index_tensor(idx, "idx", (sx.shape[0], None))
    g = grad_input(g, "g", tuple(idx.shape))
    dsx, dsy = torch.empty(sx.shape, dtype=torch.float32), torch.empty(sy.shape, dtype=torch.float32)
    _op("moecert_product_key_backward", (dsx, dsy), ref(describe(sx)), ref(describe(sy)), ref(describe(idx)),
        ref(describe(g)), _key_mode(weights), ref(describe(dsx)), ref(describe(dsy)))
    return dsx, dsy


def router_bounds(router, param, z, idx, g=None):
    """(w_bound [T, K], dz_bound [T, cols] or None): fp64 bounds |moecert - exact| of a router's
    weights and, with g, of its backward (proofs/router.md). param: renormalize (softmax_topk),
    scaling (sigmoid_topk) or the weights mode name (product_key, z = [sx | sy])."""
    kind = ROUTERS.index(router)
    if router == "product_key":
        param = _key_mode(param)
    z = _scores(z.float(), "z", False)
    idx = index_tensor(idx, "idx", (z.shape[0], None))
    wb = torch.empty(idx.shape, dtype=torch.float64)
    db = torch.empty(z.shape, dtype=torch.float64) if g is not None else None
    g = None if g is None else grad_input(g, "g", tuple(idx.shape))
    _op("moecert_router_bounds", (wb, db), kind, float(param), ref(describe(z)), ref(describe(idx)), ref(describe(g)),
        ref(describe(wb)), ref(describe(db)))
    return wb, db


# ---- layer ---------------------------------------------------------------

@dataclass(frozen=True)
class LayerConfig:
    """moecert::MoeConfig, immutable. router: "softmax_topk", "sigmoid_topk" or "product_key"
    (E = n*n)."""
    experts: int
    hidden: int
    inter: int
    topk: int
    lora_rank: int = 0
    lora_alpha: float = 0.0
    router: str = "softmax_topk"
    renormalize: bool = True
    groups: int = 1
    topk_group: int = 1
    scaling: float = 1.0
    max_tokens: int = 4096

    def router_outputs(self):
        """R: the router linear's outputs (E, or 2n for product_key), as the library's router kind
        defines it (the config validated)."""
        width = self.__dict__.get("_width")
        if width is None:
            w = ctypes.c_int64()
            _abi.call("moecert_config_router_width", ctypes.byref(self.struct()), ctypes.byref(w))
            width = w.value
            object.__setattr__(self, "_width", width)
        return width

    def struct(self):
        """The ABI's struct, validated (at the first call; the config is immutable)."""
        c = self.__dict__.get("_struct")
        if c is None:
            if self.router not in ROUTERS:
                raise InvalidArgument("router {!r}: expected one of {}".format(self.router, ", ".join(ROUTERS)))
            c = _abi.Config(self.experts, self.hidden, self.inter, self.topk, self.lora_rank, float(self.lora_alpha),
                            ROUTERS.index(self.router), int(self.renormalize), self.groups, self.topk_group,
                            float(self.scaling), self.max_tokens)
            _abi.call("moecert_config_validate", ctypes.byref(c))
            object.__setattr__(self, "_struct", c)
        return c


class LayerSaved:
    """What a layer forward keeps for its backward (moecert::layer::Saved) and its inputs."""

    def __init__(self):
        self._handle = _abi.Handle(_abi.new_handle("moecert_layer_saved_new"), "moecert_layer_saved_free")
        self.cfg = self.weights = self.x = self.failed = None
        self.keep = ()
        self.tokens = self.generation = 0

    @property
    def ptr(self):
        return self._handle.ptr


def _layer_weights(cfg, packed, router_w, router_b, router_bias, lora):
    """(the ABI's LayerWeights, the tensors it points into, their byte spans), checked; the
    same objects as at the last call while the tensors stay where they were."""
    if not isinstance(packed, PackedExperts):
        raise InvalidArgument("packed: {}, expected moecert.torch.PackedExperts".format(type(packed).__name__))
    router_bias = router_bias if cfg.router == "sigmoid_topk" else None
    lora = lora if cfg.lora_rank else None
    sig, lora_key = signature((router_w, router_b, router_bias)), _lora_key(lora)
    key = None if sig is None or lora_key is None else (cfg, sig, lora_key)
    return packed.memo("layer.weights", key,
                       lambda: _checked_layer_weights(cfg, packed, router_w, router_b, router_bias, lora))


def _checked_layer_weights(cfg, packed, router_w, router_b, router_bias, lora):
    if (packed.experts, packed.hidden, packed.inter) != (cfg.experts, cfg.hidden, cfg.inter):
        raise InvalidArgument("packed: E={} H={} I={}, the config has E={} H={} I={}".format(
            packed.experts, packed.hidden, packed.inter, cfg.experts, cfg.hidden, cfg.inter))
    R, H = cfg.router_outputs(), cfg.hidden
    check(router_w, "router_w", F32, (R, H))
    check(router_b, "router_b", F32, (R,))
    if cfg.router == "sigmoid_topk":
        check(router_bias, "router_bias", F32, (cfg.experts,))
    k = kernel_lora(lora, cfg.experts, H, cfg.inter)
    if k is not None and (k.rank != cfg.lora_rank or k.alpha != cfg.lora_alpha):
        raise InvalidArgument("lora: r={} alpha={}, the config has r={} alpha={}".format(
            k.rank, k.alpha, cfg.lora_rank, cfg.lora_alpha))
    w = _abi.LayerWeights()
    w.experts = packed.ptr
    w.router_w, w.router_b, w.router_bias = describe(router_w), describe(router_b), describe(router_bias)
    w.lora = _lora_struct(k)
    named = [("router_w", router_w), ("router_b", router_b), ("router_bias", router_bias)]
    if k is not None:
        named += [("lora." + n, getattr(k, n)) for n in LORA_NAMES]
    return w, (packed, router_w, router_b, router_bias, k), check_no_alias(named)


def layer_forward(cfg, packed, router_w, router_b, x, router_bias=None, lora=None, saved=None, isa=None,
                  training=True):
    """The MoE layer's forward: (y [T, H] fp32, saved). router_w [R, H], router_b [R] fp32
    (R = E, or 2n for product_key); router_bias [E] for sigmoid_topk."""
    saved = saved or LayerSaved()
    w, keep, spans = _layer_weights(cfg, packed, router_w, router_b, router_bias, lora)
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise InvalidArgument("x: expected a [T, H] tensor")
    return _layer_forward(cfg, w, keep, spans, x, saved, _options(isa, training)), saved


def _layer_forward(cfg, weights, keep, spans, x, saved, options):
    """y of x (checked, and apart from the weights' byte spans), the forward recorded in saved."""
    check(x, "x", BF16, (None, cfg.hidden))
    check_no_alias([("x", x)], spans)
    c = cfg.struct()
    y = torch.empty(x.shape[0], cfg.hidden, dtype=torch.float32)
    saved.failed = _op("moecert_layer_forward", (y,), ctypes.byref(c), ctypes.byref(weights), ref(describe(x)),
                       ref(describe(y)), saved.ptr, ref(options))
    saved.cfg, saved.weights, saved.keep, saved.x, saved.tokens = c, weights, keep, x, x.shape[0]
    saved.config = cfg
    saved.generation += 1
    return y


def router_linear_forward(x, router_w, router_b, isa=None):
    """The layer's router linear alone, as layer_forward computes it: z = x router_w^T + router_b
    [T, R] fp32 (x [T, H] bf16, router_w [R, H], router_b [R] fp32); a row of z does not depend on
    the other rows."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise InvalidArgument("x: expected a [T, H] tensor")
    check(x, "x", BF16, (None, None))
    check(router_w, "router_w", F32, (None, x.shape[1]))
    check(router_b, "router_b", F32, (router_w.shape[0],))
    z = torch.empty(x.shape[0], router_w.shape[0], dtype=torch.float32)
    _op("moecert_router_linear_forward", (z,), ref(describe(x)), ref(describe(router_w)), ref(describe(router_b)),
        ref(describe(z)), isa_number(isa))
    return z


def router_linear_backward(x, router_w, dz, dx=None, want=("router_w", "router_b"), isa=None):
    """Backward of router_linear_forward from dz [T, R]: a dict with dx (given: an fp32 [T, H]
    tensor, to which dz router_w is added in place, and returned) and the router weights'
    gradients named in `want` (fp32; sums over the tokens in order)."""
    check(x, "x", BF16, (None, None))
    check(router_w, "router_w", F32, (None, x.shape[1]))
    dz = grad_input(dz, "dz", (x.shape[0], router_w.shape[0]))
    out = {}
    if dx is not None:
        check(dx, "dx", F32, tuple(x.shape))
        out["dx"] = dx
    unknown = set(want) - {"router_w", "router_b"}
    if unknown:
        raise InvalidArgument("unknown outputs {}: expected some of router_w, router_b".format(sorted(unknown)))
    for name, shape in (("router_w", tuple(router_w.shape)), ("router_b", (router_w.shape[0],))):
        if name in want:
            out[name] = torch.empty(shape, dtype=torch.float32)
    check_no_alias([("x", x), ("router_w", router_w), ("dz", dz)] +
                   [(n if n == "dx" else n + " grad", t) for n, t in out.items()])
    _op("moecert_router_linear_backward", [out.get("router_w"), out.get("router_b")], ref(describe(x)),
        ref(describe(router_w)), ref(describe(dz)), ref(describe(out.get("dx"))), ref(describe(out.get("router_w"))),
        ref(describe(out.get("router_b"))), isa_number(isa))
    return out


def layer_routing(saved):
    """(idx [T, K] int32, weights [T, K] fp32) the forward chose."""
    idx, w = _router_outputs(saved.tokens, saved.config.topk)
    _op("moecert_layer_saved_routing", (idx, w), saved.ptr, ref(describe(idx)), ref(describe(w)))
    return idx, w


def layer_router(saved, want=("z",)):
    """The router's intermediates named in `want` (fp32): z [T, R], the logits of the last training
    forward (until its backward); dweights [T, K] (dL/dw) and dz [T, R] of the last backward with
    the router path."""
    cfg, T = saved.config, saved.tokens
    shapes = {"z": (T, cfg.router_outputs()), "dweights": (T, cfg.topk), "dz": (T, cfg.router_outputs())}
    unknown = set(want) - set(shapes)
    if unknown:
        raise InvalidArgument("unknown outputs {}: expected some of z, dweights, dz".format(sorted(unknown)))
    out = {n: torch.empty(shapes[n], dtype=torch.float32) for n in shapes if n in want}
    _op("moecert_layer_saved_router", out.values(), saved.ptr, *(ref(describe(out.get(n))) for n in shapes))
    return out


def _layer_grad_shapes(cfg, T):
    E, H, I = cfg.experts, cfg.hidden, cfg.inter
    shapes = {"dx": (T, H), "router_w": (cfg.router_outputs(), H), "router_b": (cfg.router_outputs(),),
              "w_gate": (E, I, H), "w_up": (E, I, H), "w_down": (E, H, I), "m_a": (T, E), "m_g": (T, E)}
    shapes.update(_lora_shapes(E, H, I, cfg.lora_rank))
    return shapes


def layer_backward(saved, dy, want=("dx", "router_w", "router_b") + LORA_NAMES, expert_path=True, router_path=True,
                   dx_dtype=torch.float32):
    """Backward from dy [T, H]: a dict of the outputs in `want` (fp32, dx in dx_dtype; names as
    moecert_layer_grads)."""
    cfg = saved.config
    want = _want(want, LAYER_GRADS, saved.keep[4])
    dy = grad_input(dy, "dy", (saved.tokens, cfg.hidden))
    T = saved.tokens
    g, out = _fill(_abi.LayerGrads, LAYER_GRADS, lambda: _layer_grad_shapes(cfg, T), want, torch.float32, dx_dtype,
                   key=("layer", cfg.experts, cfg.hidden, cfg.inter, cfg.router_outputs(), cfg.lora_rank, T,
                        frozenset(want), dx_dtype))
    _op("moecert_layer_backward", out.values(), ctypes.byref(saved.cfg), ctypes.byref(saved.weights),
        ref(describe(saved.x)), ref(describe(dy)), saved.ptr, ref(g), int(expert_path), int(router_path))
    return out


def layer_bounds(saved, dy=None, want=()):
    """fp64 bounds |moecert - exact| of y and, with dy (after the backward from dy ran both paths),
    of the outputs in `want` (proofs/layer.md), conditioned on the routing the forward chose."""
    cfg = saved.config
    want = _want(want, LAYER_GRADS, saved.keep[4])
    g, out = _fill(_abi.LayerGrads, LAYER_GRADS, lambda: _layer_grad_shapes(cfg, saved.tokens), want, torch.float64)
    out["y"] = torch.empty(saved.tokens, cfg.hidden, dtype=torch.float64)
    dy = None if dy is None else grad_input(dy, "dy", (saved.tokens, cfg.hidden))
    _op("moecert_layer_bounds", out.values(), ctypes.byref(saved.cfg), ctypes.byref(saved.weights),
        ref(describe(saved.x)), ref(describe(dy)), saved.ptr, ref(describe(out["y"])), ref(g))
    return out
