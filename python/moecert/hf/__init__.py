"""Hugging Face transformers' sparse-MoE blocks with their routed experts on moecert's kernels.

    import moecert.hf
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16)
    moecert.hf.patch(model, rank=8)   # each block's `experts` -> moecert.hf.Experts (LoRA r = 8)

transformers 5 keeps a block's routed experts in one module with stacked parameters,
gate_up_proj [E, 2I, H] (the gate's I rows, then the up projection's) and down_proj [E, H, I],
called as experts(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) by the block
after its router (`gate`). patch() replaces that module and, where moecert's router ops compute
the family's router maths (moecert.hf.routers), the gate's selection on the gate's own logits;
attention, norms and shared experts stay the model's, and output_router_logits and the model's
load-balancing loss see the same router logits. Families whose experts are not a plain SwiGLU
(an activation other than silu, biases, a clamped gate as gpt-oss's) are refused, naming what
moecert does not compute. The adapters are PEFT's LoRA on expert parameters, saved and loaded in
its format (moecert.hf.adapters).
"""
import torch
from torch import nn

from ..errors import InvalidArgument
from ..torch import formats
from ..torch.modules import _what
from .experts import BASE, PROJECTIONS, Experts, check_lora_arguments, experts_of, split_stacked
from . import routers
from .adapters import adapter_state_dict, load_adapter, load_adapter_state_dict, save_adapter

__all__ = ["BASE", "PROJECTIONS", "Experts", "patch", "merge", "unmerge", "save_adapter", "load_adapter",
           "adapter_state_dict", "load_adapter_state_dict"]


def _refusal(experts, devices_allowed=("cpu",)):
    """Why moecert cannot compute these experts (None: it can)."""
    devices = {p.device.type for p in experts.parameters(recurse=False)}
    if devices - set(devices_allowed):
        return "on {}: moecert computes on the CPU".format(", ".join(sorted(devices - {"cpu"})))
    extra = [n for n, _ in experts.named_parameters(recurse=False) if n not in BASE]
    if extra:
        return "parameters {} besides gate_up_proj and down_proj (biases: moecert's experts have none)".format(
            ", ".join(extra))
    if getattr(experts, "has_bias", False):
        return "biases (has_bias): moecert's experts have none"
    if any(hasattr(experts, a) for a in ("limit", "swiglu_limit")):
        return "a clamped SwiGLU (gpt-oss style); moecert computes silu(g) * u"
    act = getattr(experts, "act_fn", None)
    if act is None or not (isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")):
        return "activation {}, moecert computes SwiGLU with silu".format(type(act).__name__)
    for name in BASE:
        p = getattr(experts, name, None)
        if not isinstance(p, torch.Tensor) or p.dim() != 3:
            return "{}: {}, expected a stacked 3-D tensor".format(name, _what(p))
    return None


def _stacked_experts(module):
    """Whether `module` is a transformers 5 experts module (stacked gate_up_proj and down_proj)."""
    return (not isinstance(module, Experts) and isinstance(getattr(module, "gate_up_proj", None), torch.Tensor) and
            isinstance(getattr(module, "down_proj", None), torch.Tensor))


def _quantized_base(name, experts, base_format, checkpoint):
    """The (w_gate, w_up, w_down) Quantized of block `name`'s experts: read from `checkpoint`
    (DeepSeek-V3's FP8 experts as stored) or quantized from the module's tensors (None: neither
    asked)."""
    transposed, concatenated = getattr(experts, "is_transposed", False), getattr(experts, "is_concatenated", True)
    gate, up, down = split_stacked(experts.gate_up_proj, experts.down_proj, transposed, concatenated)
    if checkpoint is None:
        return None if base_format is None else tuple(formats.quantize(t, base_format) for t in (gate, up, down))
    prefix = "{}.experts.{{expert}}.".format(name) if name else "experts.{expert}."

    def get(key):
        try:
            return checkpoint(key)
        except Exception as e:  # the reader's own error (KeyError, safetensors' SafetensorError, ...)
            raise InvalidArgument("checkpoint: {}: {} (expected DeepSeek-V3's FP8 experts: per expert gate_proj, "
                                  "up_proj, down_proj .weight in e4m3 and .weight_scale_inv)".format(
                                      key, type(e).__name__)) from None

    base = formats.deepseek_v3_experts(get, None, gate.shape[0], prefix=prefix)
    for proj, q, want in zip(("gate_proj", "up_proj", "down_proj"), base, (gate.shape, up.shape, down.shape)):
        try:
            mats = q.matrices()  # each expert's codes and scales against the format's shapes
        except InvalidArgument as e:
            raise InvalidArgument("checkpoint: {}: {}".format(prefix.format(expert="*") + proj, e)) from None
        if (len(mats), q.rows(), q.cols) != tuple(want):
            raise InvalidArgument("checkpoint: {}: {} x {} x {}, the model's are {} x {} x {}".format(
                prefix.format(expert="*") + proj, len(mats), q.rows(), q.cols, *want))
    return base


def patch(model, rank=0, alpha=None, train_base=False, isa=None, rslora=False, targets=PROJECTIONS, init=True,
          dropout=0.0, freeze=True, router="auto", base_format=None, checkpoint=None):
    """Replaces the routed experts of every sparse-MoE block of `model` (transformers 5: a
    block's `experts` module with stacked gate_up_proj and down_proj) by an Experts holding the
    same weights (rounded to bf16; the originals are released), with LoRA of `rank`, `alpha`,
    `rslora`, `targets`, `init` and `dropout` as Experts documents them. With `freeze` (as PEFT's
    get_peft_model), every other parameter of the model stops requiring gradients, so what
    requires them is the experts' adapters (and their base weights with train_base).
    router: "auto" puts moecert's router op on the blocks whose router maths it computes (on the
    model's own logits: moecert.hf.routers), "moecert" requires it of every block, "model"
    keeps the model's; each Experts' `routed_by` says which ran.
    base_format: quantize each block's frozen base weights into this format of moecert.FORMATS
    (round to nearest, formats.quantize, from the tensors in their own dtype) as they are replaced;
    no bf16 pack is made.
    checkpoint: get(name) -> tensor over a DeepSeek-V3-style FP8 checkpoint (safetensors'
    safe_open(...).get_tensor, moecert.torch.formats.checkpoint(directory), a dict's
    __getitem__): each block's experts are read from it as stored, per expert
    `{block}.experts.{e}.gate_proj.weight` (float8_e4m3fn, or its bytes as uint8) with
    `.weight_scale_inv`, likewise up_proj and down_proj, never widened to bf16; the model's own
    expert tensors are not read (they may be on the meta device, as accelerate's
    init_empty_weights leaves them). Quantized base weights are frozen (train_base=False).
    Returns the names of the modules replaced. Raises moecert.InvalidArgument naming the block
    and what is missing when a block's experts are not a plain SwiGLU (nothing is replaced then),
    or when the model has no such block (transformers 4's ModuleList of experts included)."""
    routers.check_mode(router)
    if base_format is not None:
        formats.format_number(base_format)
    if checkpoint is not None and base_format not in (None, "fp8_e4m3_block128"):
        raise InvalidArgument("base_format={!r} with a checkpoint: its experts are read as stored "
                              "(fp8_e4m3_block128)".format(base_format))
    if train_base and (base_format is not None or checkpoint is not None):
        raise InvalidArgument("train_base=True with quantized base weights: those are frozen")
    found = []
    for name, module in model.named_modules():
        experts = getattr(module, "experts", None)
        if isinstance(experts, nn.Module) and _stacked_experts(experts):
            why = _refusal(experts, ("cpu", "meta") if checkpoint is not None else ("cpu",))
            if why is not None:
                raise InvalidArgument("{}.experts ({}): {}".format(name, type(experts).__name__, why))
            if router == "moecert":
                routers.attach_check(name, getattr(module, "gate", None))
            found.append((name, module, experts))
        elif isinstance(experts, nn.ModuleList):
            raise InvalidArgument("{}.experts: a ModuleList of experts (transformers 4's layout); moecert.hf reads "
                                  "transformers 5's stacked gate_up_proj and down_proj".format(name))
    if not found:
        raise InvalidArgument("{}: no sparse-MoE block with stacked experts (gate_up_proj, down_proj)".format(
            type(model).__name__))
    check_lora_arguments(rank, targets, init, dropout)
    with torch.no_grad():  # all read (or quantized) before the model changes
        bases = [_quantized_base(name, experts, base_format, checkpoint) for name, _, experts in found]
    if freeze:
        for p in model.parameters():
            p.requires_grad_(False)
    for (name, module, experts), base in zip(found, bases):
        order = [n for n, _ in experts.named_parameters(recurse=False) if n in BASE]
        layout = (getattr(experts, "is_transposed", False), getattr(experts, "is_concatenated", True))
        with torch.no_grad():
            stacked = (experts.gate_up_proj, experts.down_proj) if base is None else (None, None)
            module.experts = Experts(*stacked, rank, alpha, train_base, isa, rslora, targets, init, dropout, *layout,
                                     base=base)
        module.experts.peft_order = order  # PEFT nests its wrappers in the parameters' declaration order
        module.experts.routed_by = "moecert" if routers.attach(getattr(module, "gate", None), router) else "model"
    return [(name + ".experts") if name else "experts" for name, _, _ in found]


def merge(model, keep=True):
    """Experts.merge(keep) on every patched experts module of `model`."""
    for _, experts in experts_of(model):
        experts.merge(keep)


def unmerge(model):
    """Experts.unmerge() on every patched experts module of `model`."""
    for _, experts in experts_of(model):
        experts.unmerge()
