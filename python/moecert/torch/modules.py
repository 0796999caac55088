"""nn.Modules over moecert's ops."""
import math

import torch
from torch import nn

from .. import FORMATS
from ..errors import ContractViolation, InvalidArgument
from . import functions, keys, ops
from .formats import Quantized, quantize
from .ops import BASE_NAMES, LORA_NAMES


def _storage(t):
    return (t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()).data_ptr()


class FrozenWeight(torch.Tensor):
    """A read-only copy of base weights that live packed in a module (MoELayer.w_gate, ...):
    computing with it works as with any tensor; an in-place change of it or of a view of it
    (.data included) raises, since it would not reach the packed weights."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        mine = [a for a in tuple(args) + tuple((kwargs or {}).values()) if isinstance(a, FrozenWeight)]
        setter = getattr(getattr(func, "__self__", None), "__name__", "") if name == "__set__" else ""
        if (name.endswith("_") and not name.endswith("__")) or name == "__setitem__" or \
                setter in ("data", "requires_grad"):
            name = setter or name
            weight = getattr(mine[0], "weight_name", "base weight") if mine else "base weight"
            raise InvalidArgument("{0}: a read-only copy of the packed base weights ({1} would not reach them); "
                                  "assign layer.{0} = tensor, or use set_base_weights() or load_state_dict(), "
                                  "or construct with train_base=True".format(weight, name))
        with torch._C.DisableTorchFunction():
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.layout == torch.strided and mine and \
                    _storage(out) == _storage(mine[0]):
                view = out.as_subclass(cls)  # a view of the copy stays read-only
                view.weight_name = getattr(mine[0], "weight_name", "base weight")
                return view
        return out


def _frozen(t, name):
    t = t.as_subclass(FrozenWeight)
    t.weight_name = name
    return t


def _base_property(name):
    def get(self):
        if self.train_base:
            p = self._parameters.get(name)
            if p is None:
                raise AttributeError(name)
            return p
        return _frozen(self._stored(self._packed.unpack())[name], name)

    def set(self, value):
        self.set_base_weights(**{name: value})

    return property(get, set, doc="{} bf16: a parameter with train_base, else a read-only copy of the packed weights "
                                  "(assigning packs the new value).".format(name))


class PackedBase(nn.Module):
    """A module whose SwiGLU experts' base weights (stored under the names BASE, in the shapes
    base_shapes() gives; split() maps them to w_gate, w_up [E, I, H], w_down [E, H, I] and
    stored() back) live in moecert's packed experts:

    * frozen (train_base=False): the pack is their only storage. Reading one gives a read-only
      copy (FrozenWeight); assigning one, set_base_weights() and load_state_dict() pack new
      values; state_dict() holds them as plain bf16 tensors. Nothing changes them without
      packing, so no forward computes with stale weights.
    * train_base=True: they are parameters, packed again from their current values at every
      forward (pack_parameters()).

    deepcopy, pickle and torch.save keep them (the copy packs them again); moving the module off
    the CPU raises."""

    BASE = BASE_NAMES

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name in cls.BASE:
            if name not in cls.__dict__:
                setattr(cls, name, _base_property(name))

    def _init_base(self, named, train_base):
        """Stores the base weights `named` (stored names -> tensors, any float dtype, rounded to
        bf16) as parameters (train_base) or as the pack."""
        self.train_base = bool(train_base)
        self._packed = None
        named = {n: t.detach().to(torch.bfloat16).contiguous() for n, t in named.items()}
        if self.train_base:
            for name in self.BASE:
                self.register_parameter(name, nn.Parameter(named[name]))
        else:
            self._set_pack(ops.PackedExperts(*self.split(named), backward=True))

    def base_shapes(self):
        """{stored name: shape}."""
        raise NotImplementedError

    def dims(self):
        """(experts E, hidden H, intermediate I)."""
        raise NotImplementedError

    def split(self, named):
        """(w_gate, w_up, w_down) of the stored tensors `named`."""
        return tuple(named[n] for n in BASE_NAMES)

    def _stored(self, base):
        """{stored name: tensor} of (w_gate, w_up, w_down)."""
        return dict(zip(BASE_NAMES, base))

    def set_base_weights(self, **named):
        """Replaces the base weights given by their names (CPU tensors of their shapes, any float
        dtype, rounded to bf16 by .to(torch.bfloat16)); frozen ones are packed at once,
        parameters copied into. Frozen base weights may also be quantized: all of them given as
        formats.Quantized of one format (see quantize_base)."""
        if any(isinstance(t, Quantized) for t in named.values()):
            return self._set_quantized(named)
        shapes = self.base_shapes()
        for name, t in named.items():
            if name not in shapes:
                raise InvalidArgument("{}: not a base weight, expected one of {}".format(name, ", ".join(shapes)))
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise InvalidArgument("{}: {}, expected a floating-point tensor".format(name, _what(t)))
            if t.device.type != "cpu":
                raise InvalidArgument("{}: on {}, expected a CPU tensor".format(name, t.device))
            if tuple(t.shape) != tuple(shapes[name]):
                raise InvalidArgument("size mismatch for {}: got {}, expected {}".format(
                    name, list(t.shape), list(shapes[name])))
        with torch.no_grad():
            if self.train_base:
                for name, t in named.items():
                    self._parameters[name].copy_(t)
                return
            new = {n: t.detach().to(torch.bfloat16).contiguous() for n, t in named.items()}
            if len(new) < len(self.BASE):
                if self.base_format != "bf16":
                    raise InvalidArgument("{}: the base weights are {}; give all of {} (bf16 tensors or "
                                          "formats.Quantized)".format(", ".join(new), self.base_format,
                                                                      ", ".join(self.BASE)))
                new = dict(self._stored(self._packed.unpack()), **new)
            self._set_pack(ops.PackedExperts(*self.split(new), backward=True))

    @property
    def base_format(self):
        """The frozen base weights' format: "bf16" or a quantized one (moecert.FORMATS)."""
        return self._packed.format if self._packed is not None else "bf16"

    def quantize_base(self, format):
        """Quantizes the frozen base weights (their current bf16 values, formats.quantize: round to
        nearest per block) into `format` and packs the codes and scales: the module then computes
        with bf16(fp32(code * scale)) and its state_dict() holds the codes and scales."""
        if self.train_base:
            raise InvalidArgument("quantize_base: the base weights are trained (train_base=True); quantized "
                                  "base weights are frozen")
        self._set_quantized({n: quantize(t, format) for n, t in zip(BASE_NAMES, self._packed.unpack())})

    def _set_quantized(self, named):
        """Packs quantized base weights given by name (all of them, formats.Quantized of one format)."""
        if self.train_base:
            raise InvalidArgument("quantized base weights are frozen: construct with train_base=False")
        if set(named) != set(BASE_NAMES) or not all(isinstance(t, Quantized) for t in named.values()):
            raise InvalidArgument("quantized base weights: give all of w_gate, w_up, w_down (moecert's layout: "
                                  "[E, I, H], [E, I, H], [E, H, I]) as formats.Quantized (got {})".format(
                                      ", ".join("{}: {}".format(n, type(t).__name__) for n, t in named.items())))
        packed = ops.PackedExperts(named["w_gate"], named["w_up"], named["w_down"], backward=True)
        E, H, I = self.dims()
        got, want = (packed.experts, packed.hidden, packed.inter), (E, H, I)
        if got != want:
            raise InvalidArgument("size mismatch for the quantized experts: got E, H, I = {}, expected {}".format(
                got, want))
        self._set_pack(packed)

    def _set_pack(self, packed):
        if self._packed is not None:
            packed.adopt_pools(self._packed)
        self._packed = packed

    def pack_parameters(self):
        """train_base: the base parameters' current values, packed; returns the parameters."""
        base = [self._parameters[n] for n in self.BASE]
        for name, t in zip(self.BASE, base):
            if not isinstance(t, torch.Tensor):
                raise InvalidArgument("{}: {}, expected a parameter".format(name, _what(t)))
        with torch.no_grad():
            named = {n: t.detach().to(torch.bfloat16).contiguous() for n, t in zip(self.BASE, base)}
            self._set_pack(ops.PackedExperts(*self.split(named), backward=True))
        return base

    def __setattr__(self, name, value):
        if name in self.BASE and not self.__dict__.get("train_base", True):
            self.set_base_weights(**{name: value})
        else:
            super().__setattr__(name, value)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.train_base:
            return
        if self.base_format == "bf16":
            for name, t in self._stored(self._packed.unpack()).items():
                destination[prefix + name] = t
            return
        for name, q in zip(BASE_NAMES, self._packed.unpack_quantized()):  # codes and scales as they are
            destination[prefix + name + ".codes"], destination[prefix + name + ".scales"] = q.codes, q.scales
        destination[prefix + "base_format"] = torch.tensor(FORMATS.index(self.base_format))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if self.train_base:
            return
        if prefix + "base_format" in state_dict:
            return self._load_quantized(state_dict, prefix, missing_keys, unexpected_keys, error_msgs)
        given = {n: state_dict[prefix + n] for n in self.BASE if prefix + n in state_dict}
        if not given:  # e.g. only the adapters, strict=False: the base weights stay as they are
            missing_keys.extend(self._quantized_keys(prefix) if self.base_format != "bf16" else
                                [prefix + n for n in self.BASE])
            return
        unexpected_keys[:] = [k for k in unexpected_keys if k[len(prefix):] not in given or not k.startswith(prefix)]
        missing_keys.extend(prefix + n for n in self.BASE if n not in given)
        try:
            self.set_base_weights(**given)
        except InvalidArgument as e:
            error_msgs.append(str(e))

    @staticmethod
    def _quantized_keys(prefix):
        """The state dict keys of quantized base weights."""
        return [prefix + "base_format"] + [prefix + n + part for n in BASE_NAMES for part in (".codes", ".scales")]

    def _load_quantized(self, state_dict, prefix, missing_keys, unexpected_keys, error_msgs):
        """load_state_dict of quantized base weights: codes and scales, and their format."""
        keys = self._quantized_keys(prefix)
        unexpected_keys[:] = [k for k in unexpected_keys if k not in keys]
        missing_keys.extend(k for k in keys if k not in state_dict)
        if any(k not in state_dict for k in keys):
            return
        try:
            number = int(state_dict[prefix + "base_format"])
            if not 0 < number < len(FORMATS):
                raise InvalidArgument("{}base_format: {}, expected 1..{}".format(prefix, number, len(FORMATS) - 1))
            _, H, I = self.dims()
            cols = {"w_gate": H, "w_up": H, "w_down": I}
            self._set_quantized({n: Quantized(FORMATS[number], state_dict[prefix + n + ".codes"],
                                              state_dict[prefix + n + ".scales"], cols[n]) for n in BASE_NAMES})
        except (InvalidArgument, ContractViolation) as e:
            error_msgs.append(str(e))

    def _apply(self, fn, *args, **kwargs):
        try:
            device = fn(torch.zeros(1)).device
        except Exception as e:  # e.g. torch without CUDA
            raise InvalidArgument("{} runs on the CPU only: {}".format(type(self).__name__, e)) from None
        if device.type != "cpu":
            raise InvalidArgument("{} runs on the CPU only: cannot move it to {}".format(type(self).__name__, device))
        return super()._apply(fn, *args, **kwargs)


class MoELayer(PackedBase):
    """A Mixture-of-Experts layer: router linear, router, E SwiGLU experts with LoRA.

    z = x router_w^T + router_b (fp32), routed by `router`; y_t = sum_j w[t, j] *
    expert_{idx[t, j]}(x_t), expert_e(x) = (silu(x Wg^T) * (x Wu^T)) Wd^T with LoRA
    W + (alpha / r) B A on gate, up and down.

    Args:
        experts, hidden, inter, topk: E, H, I, K.
        rank, alpha: LoRA rank r (0: none) and alpha (default 2r); scale = alpha / r.
        router: "softmax_topk" (renormalize: weights over the K selected), "sigmoid_topk"
            (DeepSeek-V3: groups, topk_group, scaling, router_bias [E]) or "product_key" (E = n*n).
        max_tokens: the most tokens one call takes.
        train_base: train the base weights too (else they are frozen).
        out_dtype: y's dtype (None: x's).
        isa: force a kernel (a name in moecert.ISAS, e.g. "amx_emu"; moecert.isa_usable tells which run here).

    Parameters: router_w [R, H], router_b [R] (R = E, or 2n for product_key), fp32; the LoRA
    factors a_gate, a_up [E, r, H], a_down [E, r, I], b_gate, b_up [E, I, r], b_down [E, H, r],
    fp32 (b_* start at 0, so the layer starts as its base weights); buffer router_bias [E]
    (sigmoid_topk). Base weights w_gate, w_up [E, I, H], w_down [E, H, I] bf16:

    * frozen (default): the packed experts are their only storage. layer.w_gate reads a
      read-only copy; `layer.w_gate = t`, set_base_weights() and load_state_dict() pack new
      values; state_dict() holds them as plain tensors. Nothing can change them without
      repacking, so a forward never computes with stale weights.
    * train_base=True: they are parameters, packed again from their current values at every
      forward (the optimizer, .data, load_state_dict and .to() all reach the next forward).

    forward(x [..., H], stats=None) -> y [..., H]. x of any float dtype is rounded to bf16
    (x.to(torch.bfloat16)) for the experts and the router linear; y is in out_dtype, else x's
    dtype; dx in x's dtype (fp32 accumulated). Parameters of other dtypes (after .to(dtype),
    .half(), .double()) are read as fp32 (bf16 LoRA factors as they are); the gradients reach
    them in their own dtype. stats: a moecert.torch.Stats to receive M_A, M_G [T, E].

    Raises moecert.InvalidArgument (a wrong shape, dtype or device; a CPU is required; under
    torch.jit.trace, which cannot record the ops) and
    moecert.ContractViolation (a clause failed under enforce: NaN input, overlap, ...) before
    any work. Under semantic "observe" a failed precondition yields a y of NaN, and its
    backward raises."""

    def __init__(self, experts, hidden, inter, topk, rank=0, alpha=None, router="softmax_topk", renormalize=True,
                 groups=1, topk_group=1, scaling=1.0, max_tokens=4096, train_base=False, out_dtype=None, isa=None,
                 base=None):
        """Builds the layer (arguments in the class docstring): base weights N(0, 1/fan_in) rounded
        to bf16, or `base` = (w_gate, w_up, w_down) as set_base_weights takes them (tensors, or
        formats.Quantized: a checkpoint's quantized experts, never held in bf16); router_w and a_*
        uniform in +-1/sqrt(fan_in), router_b and b_* zero. Raises moecert.InvalidArgument or
        ContractViolation (config.*) for an invalid configuration."""
        super().__init__()
        alpha = float(alpha if alpha is not None else 2 * rank)
        self.config = ops.LayerConfig(experts, hidden, inter, topk, rank, alpha if rank else 0.0, router,
                                      renormalize, groups, topk_group, scaling, max_tokens)
        self.config.struct()  # validates
        self._config_key = keys.config_key(self.config)
        if out_dtype is not None and not (isinstance(out_dtype, torch.dtype) and out_dtype.is_floating_point):
            raise InvalidArgument("out_dtype {!r}: expected None or a floating torch.dtype".format(out_dtype))
        E, H, I, R = experts, hidden, inter, self.config.router_outputs()
        self.isa, self.out_dtype = isa, out_dtype
        if base is not None and isinstance(base[0], Quantized):
            self.train_base, self._packed = bool(train_base), None
            self._set_quantized(dict(zip(BASE_NAMES, base)))
        else:
            if base is not None:
                for name, t in zip(BASE_NAMES, base):
                    want = self.base_shapes()[name]
                    if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(want):
                        raise InvalidArgument("base {}: {}, expected a tensor of shape {}".format(
                            name, _what(t), list(want)))
            self._init_base(dict(zip(BASE_NAMES, base)) if base is not None else
                            {n: torch.randn(*shape) / math.sqrt(shape[2]) for n, shape in self.base_shapes().items()},
                            train_base)
        self.router_w = nn.Parameter(torch.empty(R, H).uniform_(-1 / math.sqrt(H), 1 / math.sqrt(H)))
        self.router_b = nn.Parameter(torch.zeros(R))
        self.register_buffer("router_bias", torch.zeros(E) if router == "sigmoid_topk" else None)
        if rank:
            for name, rows, cols in (("a_gate", rank, H), ("a_up", rank, H), ("a_down", rank, I)):
                setattr(self, name, nn.Parameter(torch.empty(E, rows, cols).uniform_(-1 / math.sqrt(cols),
                                                                                      1 / math.sqrt(cols))))
            for name, rows in (("b_gate", I), ("b_up", I), ("b_down", H)):
                setattr(self, name, nn.Parameter(torch.zeros(E, rows, rank)))

    def __setstate__(self, state):
        super().__setstate__(state)
        self._config_key = keys.config_key(self.config)  # keys name this process's objects

    def dims(self):
        return self.config.experts, self.config.hidden, self.config.inter

    def base_shapes(self):
        c = self.config
        return {"w_gate": (c.experts, c.inter, c.hidden), "w_up": (c.experts, c.inter, c.hidden),
                "w_down": (c.experts, c.hidden, c.inter)}

    def set_base_weights(self, w_gate=None, w_up=None, w_down=None):
        """Replaces the base weights given (CPU tensors of their shapes, any float dtype, rounded to
        bf16 by .to(torch.bfloat16)); frozen ones are packed at once, parameters copied into."""
        given = {n: t for n, t in zip(BASE_NAMES, (w_gate, w_up, w_down)) if t is not None}
        super().set_base_weights(**given)

    # ---- forward --------------------------------------------------------------

    def lora(self):
        """The LoRA factors as an ops.Lora (the parameters themselves), or None without LoRA."""
        if not self.config.lora_rank:
            return None
        return ops.Lora(*(getattr(self, n) for n in LORA_NAMES), alpha=self.config.lora_alpha)

    def forward(self, x, stats=None):
        """y [..., H] of x [..., H] (see the class docstring for dtypes and what raises)."""
        H = self.config.hidden
        if torch.jit.is_tracing():
            raise InvalidArgument("MoELayer: torch.jit.trace cannot record moecert's ops (ctypes calls); use "
                                  "eager mode or torch.compile (torch 2.4 on)")
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != H or not x.is_floating_point():
            raise InvalidArgument("x: {}, expected a [..., {}] floating-point tensor".format(_what(x), H))
        out_dtype = self.out_dtype or x.dtype
        base = self.pack_parameters() if self.train_base else None
        lead = x.shape[:-1]
        x2 = x.reshape(-1, H) if x.dim() != 2 else x
        p = self._parameters
        factors = tuple(p[n] for n in LORA_NAMES) if self.config.lora_rank else None
        y = functions.layer(x2, self._config_key, self._packed, p["router_w"], p["router_b"], self.router_bias,
                            factors, base, stats, self.isa)
        y = y if y.dtype == out_dtype else y.to(out_dtype)
        return y if x2 is x else y.reshape(*lead, H)  # a reshape is a node of the graph

    def extra_repr(self):
        c = self.config
        return "experts={}, hidden={}, inter={}, topk={}, rank={}, router={}, train_base={}".format(
            c.experts, c.hidden, c.inter, c.topk, c.lora_rank, c.router, self.train_base)


def _what(t):
    if isinstance(t, torch.Tensor):
        return "{} {}".format(list(t.shape), str(t.dtype).replace("torch.", ""))
    return type(t).__name__
