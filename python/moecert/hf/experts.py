"""moecert.hf.Experts: a transformers 5 experts module (stacked gate_up_proj, down_proj) on
moecert's experts op, with LoRA in PEFT's parametrisation of those parameters, merge and unmerge."""
import math

import torch
from torch import nn

from ..errors import InvalidArgument
from ..torch import functions, ops
from ..torch.formats import Quantized
from ..torch.modules import PackedBase, _what
from ..torch.ops import BASE_NAMES

BASE = ("gate_up_proj", "down_proj")
PROJECTIONS = ("gate", "up", "down")
TARGET_ALIASES = {"gate_up_proj": ("gate", "up"), "down_proj": ("down",)}
# The LoRA factors: name -> (their shape from (E, H, I, r), the projections they serve).
FACTORS = {
    "lora_A_gate_up": (lambda E, H, I, r: (E, r, H), ("gate", "up")),
    "lora_B_gate": (lambda E, H, I, r: (E, I, r), ("gate",)),
    "lora_B_up": (lambda E, H, I, r: (E, I, r), ("up",)),
    "lora_A_down": (lambda E, H, I, r: (E, r, I), ("down",)),
    "lora_B_down": (lambda E, H, I, r: (E, H, r), ("down",)),
}
INITS = (True, False, "gaussian")


def targets_of(targets):
    """The projections `targets` names ("gate", "up", "down", or PEFT's parameter names
    "gate_up_proj" and "down_proj"), in PROJECTIONS order."""
    if isinstance(targets, str):
        targets = (targets,)
    chosen = set()
    for t in targets:
        if t not in PROJECTIONS and t not in TARGET_ALIASES:
            raise InvalidArgument("targets: {!r}, expected some of {}".format(
                t, ", ".join(PROJECTIONS + tuple(TARGET_ALIASES))))
        chosen.update(TARGET_ALIASES.get(t, (t,)))
    return tuple(p for p in PROJECTIONS if p in chosen)


def check_lora_arguments(rank, targets, init, dropout):
    """Raises InvalidArgument for LoRA arguments Experts does not take."""
    if dropout:
        raise InvalidArgument("dropout={}: LoRA dropout needs the adapter's input apart from the base "
                              "projection's, which moecert's kernels share; use dropout=0".format(dropout))
    if init not in INITS:
        raise InvalidArgument("init={!r}, expected one of {}".format(init, ", ".join(map(repr, INITS))))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise InvalidArgument("rank={!r}, expected an integer >= 0".format(rank))
    targets_of(targets)


def gate_up_rows(inter, concatenated):
    """Experts.gate_up_rows() of a module of `inter` and `concatenated`."""
    if concatenated:
        return slice(0, inter), slice(inter, 2 * inter)
    return slice(0, 2 * inter, 2), slice(1, 2 * inter, 2)


def split_stacked(gate_up_proj, down_proj, transposed, concatenated):
    """(w_gate, w_up [E, I, H], w_down [E, H, I]) views of transformers' stacked gate_up_proj and
    down_proj (transposed, concatenated: as Experts takes them)."""
    if transposed:
        gate_up_proj, down_proj = gate_up_proj.transpose(1, 2), down_proj.transpose(1, 2)
    gate, up = gate_up_rows(gate_up_proj.shape[1] // 2, concatenated)
    return gate_up_proj[:, gate], gate_up_proj[:, up], down_proj


def experts_of(model):
    """[(name, Experts)] of the modules of `model`."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, Experts)]


class Experts(PackedBase):
    """A transformers 5 experts module on moecert's experts op, with LoRA on its expert
    parameters as PEFT parametrises them (`target_parameters`).

    Args:
        gate_up_proj: [E, 2I, H], the gate's I rows then the up projection's (any float dtype:
            rounded to bf16, what the kernels compute with).
        down_proj: [E, H, I].
        transposed: the two are stored [E, H, 2I] and [E, I, H] (transformers' is_transposed).
        concatenated: False when gate_up_proj's 2I outputs interleave the gate's and the up
            projection's (gate 0, up 0, gate 1, ...; transformers' is_concatenated).
        rank, alpha: LoRA rank (0: none) and alpha (default 2r); scale alpha / r, or
            alpha / sqrt(r) with rslora (rank-stabilised LoRA).
        targets: the projections with LoRA, some of "gate", "up", "down" (PEFT's
            "gate_up_proj" = gate and up, "down_proj" = down). Gate and up share one A, as
            PEFT's adapter of gate_up_proj does: ΔW_gate = s B_gate A, ΔW_up = s B_up A with
            A = lora_A_gate_up [E, r, H], B_gate, B_up = lora_B_gate, lora_B_up [E, I, r];
            ΔW_down = s lora_B_down [E, H, r] lora_A_down [E, r, I]. The factors of a projection
            not targeted are zero buffers.
        init: True (A uniform in +-1/sqrt(in), B = 0: the module starts as its base weights),
            "gaussian" (A normal with std 1/r, B = 0) or False (B uniform too, in
            +-1/sqrt(r E): an adapter that changes the output from the start). fp32 parameters.
        dropout: only 0 (LoRA dropout needs the adapter's input apart from the base
            projection's, which the kernels share).
        train_base: the base weights are parameters too (packed at every forward); else the
            packed experts are their only storage (moecert.torch.modules.PackedBase).
        isa: force a kernel.
        base: frozen quantized base weights instead of gate_up_proj and down_proj (both None
            then): (w_gate, w_up, w_down) as moecert.torch.formats.Quantized of one format, in
            moecert's layout [E, I, H], [E, I, H], [E, H, I] (a checkpoint's per-projection
            tensors: DeepSeek-V3's FP8 experts as stored, formats.deepseek_v3_experts). The module
            then computes with bf16(fp32(code * scale)); quantize_base(format) quantizes bf16 base
            weights later. Its state_dict() holds the codes and scales (w_gate.codes, ...,
            base_format) in place of gate_up_proj and down_proj.

    forward(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H] in
    hidden_states' dtype: sum_j w[t, j] * expert_{idx[t, j]}(x_t), x rounded to bf16, the
    weights widened to fp32; differentiable in hidden_states, top_k_weights and the LoRA factors
    (and the base weights with train_base). state_dict() holds gate_up_proj and down_proj (bf16,
    transformers' names and layout) and the LoRA factors. After each forward, `token_counts` [E]
    int64 holds how many (token, slot) pairs each expert received."""

    BASE = BASE
    routed_by = "caller"  # patch() sets "moecert" or "model": whose router chose the experts

    def __init__(self, gate_up_proj, down_proj, rank=0, alpha=None, train_base=False, isa=None, rslora=False,
                 targets=PROJECTIONS, init=True, dropout=0.0, transposed=False, concatenated=True, base=None):
        """See the class docstring; raises moecert.InvalidArgument for shapes that do not fit."""
        super().__init__()
        self.transposed, self.concatenated = bool(transposed), bool(concatenated)
        if base is not None:
            self._init_quantized(gate_up_proj, down_proj, base, train_base, isa)
            self.set_lora(rank, alpha, rslora, targets, init, dropout)
            return
        two = (2, 1) if self.transposed else (1, 2)  # the dimension of 2I, then that of H
        if not isinstance(gate_up_proj, torch.Tensor) or gate_up_proj.dim() != 3 or gate_up_proj.shape[two[0]] % 2:
            raise InvalidArgument("gate_up_proj: {}, expected {}".format(
                _what(gate_up_proj), "[E, H, 2I]" if self.transposed else "[E, 2I, H]"))
        E, I, H = gate_up_proj.shape[0], gate_up_proj.shape[two[0]] // 2, gate_up_proj.shape[two[1]]
        self.num_experts, self.hidden, self.inter, self.isa = E, H, I, isa
        if not isinstance(down_proj, torch.Tensor) or tuple(down_proj.shape) != self.base_shapes()["down_proj"]:
            raise InvalidArgument("down_proj: {}, expected {}".format(
                _what(down_proj), list(self.base_shapes()["down_proj"])))
        self.token_counts, self._aside, self._unloaded = None, None, False
        self._init_base({"gate_up_proj": gate_up_proj, "down_proj": down_proj}, train_base)
        self.set_lora(rank, alpha, rslora, targets, init, dropout)

    def _init_quantized(self, gate_up_proj, down_proj, base, train_base, isa):
        if gate_up_proj is not None or down_proj is not None:
            raise InvalidArgument("base: quantized base weights replace gate_up_proj and down_proj; pass None for "
                                  "those")
        if not isinstance(base, (tuple, list)) or len(base) != 3 or not all(isinstance(q, Quantized) for q in base):
            raise InvalidArgument("base: {}, expected (w_gate, w_up, w_down) as formats.Quantized".format(
                _what(base)))
        self.num_experts, self.inter, self.hidden = len(base[0].matrices()), base[0].rows(), base[0].cols
        self.isa, self.token_counts, self._aside, self._unloaded = isa, None, None, False
        self.train_base, self._packed = bool(train_base), None
        self._set_quantized(dict(zip(BASE_NAMES, base)))

    def dims(self):
        return self.num_experts, self.hidden, self.inter

    def set_lora(self, rank, alpha=None, rslora=False, targets=PROJECTIONS, init=True, dropout=0.0):
        """Replaces the LoRA factors by fresh ones of this configuration (see the class
        docstring); rank 0 removes them."""
        check_lora_arguments(rank, targets, init, dropout)
        rank = int(rank)
        if self.merged:
            raise InvalidArgument("the adapter is merged: unmerge() before replacing it")
        for name in FACTORS:
            self._parameters.pop(name, None)
            self._buffers.pop(name, None)
        self._unloaded = False
        self.rank, self.alpha = rank, float(alpha if alpha is not None else 2 * rank)
        self.rslora, self.targets = bool(rslora), targets_of(targets) if rank else ()
        # The kernels' scale is alpha / r: rank-stabilised LoRA's alpha / sqrt(r) is alpha sqrt(r) / r.
        self._kernel_alpha = self.alpha * math.sqrt(rank) if rslora and rank else self.alpha
        if not rank:
            return
        E, H, I = self.num_experts, self.hidden, self.inter
        for name, (shape_of, serves) in FACTORS.items():
            shape = shape_of(E, H, I, rank)
            if not set(serves) & set(self.targets):
                self.register_buffer(name, torch.zeros(shape), persistent=False)
                continue
            self.register_parameter(name, nn.Parameter(_initial(name, shape, init, rank, E)))

    @property
    def scale(self):
        """The LoRA scale s: alpha / r, or alpha / sqrt(r) with rslora."""
        return self._kernel_alpha / self.rank if self.rank else 0.0

    @property
    def merged(self):
        """Whether merge() folded the adapter into the base weights (unmerge() undoes it)."""
        return self.__dict__.get("_aside") is not None

    def base_shapes(self):
        E, H, I = self.num_experts, self.hidden, self.inter
        if self.transposed:
            return {"gate_up_proj": (E, H, 2 * I), "down_proj": (E, I, H)}
        return {"gate_up_proj": (E, 2 * I, H), "down_proj": (E, H, I)}

    def gate_up_rows(self):
        """(the gate's rows, the up projection's rows) of gate_up_proj's 2I outputs: the first I
        and the last I (concatenated), or the even and the odd ones (interleaved)."""
        return gate_up_rows(self.inter, self.concatenated)

    def split(self, named):
        return tuple(t.contiguous() for t in split_stacked(named["gate_up_proj"], named["down_proj"],
                                                           self.transposed, self.concatenated))

    def _stored(self, base):
        w_gate, w_up, w_down = base
        gate, up = self.gate_up_rows()
        gate_up = w_gate.new_empty((self.num_experts, 2 * self.inter, self.hidden))
        gate_up[:, gate], gate_up[:, up] = w_gate, w_up
        if self.transposed:
            return {"gate_up_proj": gate_up.transpose(1, 2).contiguous(), "down_proj": w_down.transpose(1, 2).contiguous()}
        return {"gate_up_proj": gate_up, "down_proj": w_down}

    def lora(self):
        """The LoRA factors (ops.Lora of the module's tensors; a_up is a_gate: the shared A), or
        None (no adapter, or merged)."""
        if not self.rank or self.merged:
            return None
        f = {n: getattr(self, n) for n in FACTORS}
        a = f["lora_A_gate_up"]
        return ops.Lora(a, f["lora_B_gate"], a, f["lora_B_up"], f["lora_A_down"], f["lora_B_down"],
                        alpha=self._kernel_alpha)

    def delta_weights(self):
        """{"gate_up_proj", "down_proj"}: the adapter's ΔW in the base weights' layout, in float64
        of the factors as the kernels read them (rounded to bf16), s B A per expert."""
        f = {n: getattr(self, n).detach().to(torch.bfloat16).double() for n in FACTORS}
        s, a = self.scale, f["lora_A_gate_up"]
        return self._stored((torch.bmm(f["lora_B_gate"], a) * s, torch.bmm(f["lora_B_up"], a) * s,
                             torch.bmm(f["lora_B_down"], f["lora_A_down"]) * s))

    def merge(self, keep=True):
        """Folds the adapter into the base weights: W + ΔW (float64, delta_weights()) rounded to
        bf16 by .to(torch.bfloat16), packed again (train_base: written into the parameters).
        The adapter's factors then leave the module, so it computes what its state_dict() says
        (the merged weights, no LoRA); keep=True sets them and the unmerged weights aside for
        unmerge(), keep=False drops them (merge and unload). Raises InvalidArgument if a merged
        weight is not finite (nothing changed then)."""
        if not self.rank or self.merged:
            return
        if self.base_format != "bf16":
            raise InvalidArgument("merge: the base weights are {}; W + ΔW would be rounded to that format again "
                                  "and unmerge could not restore W. Keep the adapter apart, or give bf16 base "
                                  "weights first".format(self.base_format))
        with torch.no_grad():
            base = self._base_values()
            merged = {n: (base[n].double() + d).to(torch.bfloat16) for n, d in self.delta_weights().items()}
            for n, t in merged.items():
                if not torch.isfinite(t).all():
                    raise InvalidArgument("{}: the merged weights are not finite in bf16; the adapter is broken".format(
                        n))
            factors = {n: self._parameters.get(n, self._buffers.get(n)) for n in FACTORS}
            self._write_base(merged)
        for name in FACTORS:
            self._parameters.pop(name, None)
            self._buffers.pop(name, None)
        if keep:
            self._aside = (base, factors)
        else:
            self.set_lora(0)
            self._unloaded = True

    def unmerge(self):
        """Undoes merge(): the base weights as they were (bitwise) and the adapter's factors (the
        same parameters) back. Raises InvalidArgument after merge(keep=False)."""
        if not self.merged:
            if self._unloaded:
                raise InvalidArgument("merged with keep=False: the unmerged weights were not kept")
            return
        base, factors = self._aside
        with torch.no_grad():
            self._write_base(base)
        for name, t in factors.items():
            if isinstance(t, nn.Parameter):
                self.register_parameter(name, t)
            else:
                self.register_buffer(name, t, persistent=False)
        self._aside = None

    def _base_values(self):
        """{stored name: the base weights' current values} (copies)."""
        if self.train_base:
            return {n: self._parameters[n].detach().clone() for n in BASE}
        return self._stored(self._packed.unpack())

    def _write_base(self, named):
        if self.train_base:
            for n, t in named.items():
                self._parameters[n].copy_(t)
        else:
            self.set_base_weights(**named)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        """[T, H] in hidden_states' dtype (see the class docstring)."""
        x = hidden_states
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.hidden or not x.is_floating_point():
            raise InvalidArgument("hidden_states: {}, expected a [T, {}] floating-point tensor".format(
                _what(x), self.hidden))
        weights = top_k_weights
        if isinstance(weights, torch.Tensor) and weights.dtype not in (torch.float32, torch.bfloat16):
            weights = weights.float()
        with torch.no_grad():
            ids = top_k_index.reshape(-1) if isinstance(top_k_index, torch.Tensor) else None
            if ids is not None and not ids.is_floating_point():
                valid = ids[(ids >= 0) & (ids < self.num_experts)].long()
                self.token_counts = torch.bincount(valid, minlength=self.num_experts)
        if self.train_base:  # packed at this call from the parameters' values
            base = tuple(t.to(torch.bfloat16) for t in self.split({n: getattr(self, n) for n in BASE}))
            y = functions.experts(x, top_k_index, weights, None, self.lora(), base=base, isa=self.isa)
        else:
            y = functions.experts(x, top_k_index, weights, self._packed, self.lora(), isa=self.isa)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def extra_repr(self):
        return "num_experts={}, hidden={}, inter={}, rank={}, targets={}, train_base={}, base_format={}{}".format(
            self.num_experts, self.hidden, self.inter, self.rank, ",".join(self.targets) or "none", self.train_base,
            self.base_format, ", merged" if self.merged else "")


def _initial(name, shape, init, rank, E):
    """A factor's initial value (PEFT's initialisations of its nn.Linear factors)."""
    if name.startswith("lora_A"):
        if init == "gaussian":
            return torch.randn(shape) / rank
        bound = 1 / math.sqrt(shape[2])  # kaiming-uniform with a = sqrt(5): 1 / sqrt(fan_in)
        return torch.empty(shape).uniform_(-bound, bound)
    if init is False:
        bound = 1 / math.sqrt(rank * E)  # nn.Linear(r E, out)'s default
        return torch.empty(shape).uniform_(-bound, bound)
    return torch.zeros(shape)
