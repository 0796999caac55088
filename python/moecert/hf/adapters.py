"""Adapters of a patched model's experts in PEFT's format for LoRA on expert parameters
(LoraConfig(target_parameters=["gate_up_proj", "down_proj"])): adapter_model.safetensors and
adapter_config.json, written and read.

PEFT wraps each targeted parameter of an experts module in a ParamWrapper, nested when both are
targeted: the parameter declared first (gate_up_proj) is wrapped first, so its factors sit one
`base_layer.` deeper. For a parameter of E experts stored [E, out, in] the factors are
lora_A.weight [E r, in] (row e r + k: expert e's k-th row of A) and lora_B.weight [out, r E]
(column k E + e: expert e's k-th column of B), ΔW[e] = s B[:, k E + e] A[e r + k] summed over k;
gate_up_proj's out rows are the gate's and the up projection's (Experts.gate_up_rows), so gate and
up share A. A parameter stored transposed ([E, in, out]) has the same factors."""
import json
import os

import torch

from ..errors import InvalidArgument
from .experts import BASE, FACTORS, TARGET_ALIASES, experts_of

PREFIX = "base_model.model."
WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"
# LoraConfig fields moecert computes only at these values (any other is refused on load).
FIXED = {"lora_dropout": 0.0, "bias": "none", "lora_bias": False, "use_dora": False, "fan_in_fan_out": False,
         "rank_pattern": {}, "alpha_pattern": {}, "target_modules": [], "modules_to_save": None,
         "layers_to_transform": None, "layer_replication": None}


def _adapted(model):
    """[(name, Experts)] of the patched model's experts modules (InvalidArgument if none)."""
    found = experts_of(model)
    if not found:
        raise InvalidArgument("{}: no moecert.hf.Experts; patch the model first".format(type(model).__name__))
    return found


def _wrapped(experts, parameters):
    """The PEFT-wrapped parameters of `experts` among `parameters`, innermost first."""
    return [p for p in getattr(experts, "peft_order", BASE) if p in parameters]


def _parameters_of(targets):
    return [p for p, projections in TARGET_ALIASES.items() if set(projections) & set(targets)]


def _to_peft(experts, parameter):
    """(lora_A.weight, lora_B.weight) of one parameter in PEFT's layout."""
    f = {n: getattr(experts, n).detach() for n in FACTORS}
    if parameter == "gate_up_proj":
        gate, up = experts.gate_up_rows()
        a, b = f["lora_A_gate_up"], f["lora_B_gate"].new_empty((experts.num_experts, 2 * experts.inter, experts.rank))
        b[:, gate], b[:, up] = f["lora_B_gate"], f["lora_B_up"]
    else:
        a, b = f["lora_A_down"], f["lora_B_down"]
    E, r = a.shape[0], a.shape[1]
    return a.reshape(E * r, a.shape[2]).contiguous(), b.permute(1, 2, 0).reshape(b.shape[1], r * E).contiguous()


def adapter_state_dict(model):
    """({PEFT key: tensor}, LoraConfig fields as a dict) of a patched model's adapters: what
    save_adapter() writes. Every Experts must hold an unmerged adapter of one configuration (PEFT's
    config is one per model)."""
    adapted = _adapted(model)
    configs = {(m.rank, m.alpha, m.rslora, m.targets) for _, m in adapted}
    if any(m.merged for _, m in adapted) or any(not m.rank for _, m in adapted):
        raise InvalidArgument("every experts module needs an unmerged adapter to save (rank > 0, not merged)")
    if len(configs) != 1:
        raise InvalidArgument("experts modules hold adapters of {} configurations; PEFT's format holds one".format(
            len(configs)))
    rank, alpha, rslora, targets = configs.pop()
    tensors = {}
    for name, experts in adapted:
        wrapped = _wrapped(experts, _parameters_of(targets))
        for depth, parameter in enumerate(reversed(wrapped)):
            prefix = PREFIX + name + "." + "base_layer." * depth
            tensors[prefix + "lora_A.weight"], tensors[prefix + "lora_B.weight"] = _to_peft(experts, parameter)
    config = dict(FIXED, peft_type="LORA", r=rank, lora_alpha=int(alpha) if alpha == int(alpha) else alpha,
                  use_rslora=rslora, target_parameters=_parameters_of(targets), init_lora_weights=True,
                  inference_mode=True, task_type=None, revision=None,
                  base_model_name_or_path=getattr(getattr(model, "config", None), "_name_or_path", None) or None,
                  auto_mapping={"base_model_class": type(model).__name__, "parent_library": type(model).__module__})
    return tensors, config


def _checked_config(config):
    """(r, lora_alpha, use_rslora, target_parameters) of a PEFT LoRA config moecert computes."""
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise InvalidArgument("adapter config: peft_type {!r}, expected 'LORA'".format(
            config.get("peft_type") if isinstance(config, dict) else config))
    for key, value in FIXED.items():
        given = config.get(key, value)
        if given != value and not (value in ([], {}, None) and not given):
            raise InvalidArgument("adapter config: {}={!r}; moecert.hf computes LoRA on expert parameters with "
                                  "{}={!r}".format(key, given, key, value))
    parameters = config.get("target_parameters") or []
    unknown = [p for p in parameters if p not in BASE]
    if not parameters or unknown:
        raise InvalidArgument("adapter config: target_parameters={!r}, expected some of {}".format(
            parameters, ", ".join(BASE)))
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise InvalidArgument("adapter config: r={!r}, expected a positive integer".format(r))
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise InvalidArgument("adapter config: lora_alpha={!r}, expected a number".format(alpha))
    return r, float(alpha), bool(config.get("use_rslora", False)), parameters


def _from_peft(experts, parameter, a, b, r, key):
    """{factor name: tensor} of one parameter's PEFT factors, their shapes checked."""
    E, H, I = experts.num_experts, experts.hidden, experts.inter
    out, inp = (2 * I, H) if parameter == "gate_up_proj" else (H, I)
    for what, t, shape in (("lora_A", a, (E * r, inp)), ("lora_B", b, (out, r * E))):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or tuple(t.shape) != shape:
            raise InvalidArgument("{}{}.weight: {}, expected a floating-point tensor of shape {}".format(
                key, what, _described(t), list(shape)))
        if not torch.isfinite(t).all():
            raise InvalidArgument("{}{}.weight: not finite".format(key, what))
    a3, b3 = a.reshape(E, r, inp), b.reshape(out, r, E).permute(2, 0, 1)
    if parameter == "gate_up_proj":
        gate, up = experts.gate_up_rows()
        return {"lora_A_gate_up": a3, "lora_B_gate": b3[:, gate], "lora_B_up": b3[:, up]}
    return {"lora_A_down": a3, "lora_B_down": b3}


def _described(t):
    return "shape {} {}".format(list(t.shape), str(t.dtype).replace("torch.", "")) if isinstance(
        t, torch.Tensor) else type(t).__name__


def load_adapter_state_dict(model, tensors, config):
    """Sets every Experts' adapter of a patched model from PEFT tensors and config (what
    load_adapter() reads): its rank, alpha, rsLoRA and targets from the config, its factors
    (fp32 parameters) from the tensors. Everything is checked before any module changes:
    InvalidArgument names a config field PEFT's ParamWrapper or moecert does not compute with, a
    missing or unexpected key, a shape, a non-finite value."""
    r, alpha, rslora, parameters = _checked_config(config)
    tensors, plan = dict(tensors), []
    for name, experts in _adapted(model):
        if experts.merged:
            raise InvalidArgument("{}: the adapter is merged; unmerge() before loading another".format(name))
        factors = {}
        wrapped = _wrapped(experts, parameters)
        for depth, parameter in enumerate(reversed(wrapped)):
            key = PREFIX + name + "." + "base_layer." * depth
            missing = [key + w + ".weight" for w in ("lora_A", "lora_B") if key + w + ".weight" not in tensors]
            if missing:
                raise InvalidArgument("adapter: missing {} (target_parameters {})".format(missing[0], parameters))
            factors.update(_from_peft(experts, parameter, tensors.pop(key + "lora_A.weight"),
                                      tensors.pop(key + "lora_B.weight"), r, key))
        plan.append((experts, factors))
    if tensors:
        keys = sorted(tensors)
        raise InvalidArgument("adapter: {} unexpected key{} ({}{}); moecert.hf loads the experts' adapters "
                              "only".format(len(keys), "s" if len(keys) > 1 else "", ", ".join(keys[:3]),
                                            ", ..." if len(keys) > 3 else ""))
    targets = sum((TARGET_ALIASES[p] for p in parameters), ())
    for experts, factors in plan:
        experts.set_lora(r, alpha, rslora, targets)
        with torch.no_grad():
            for n, t in factors.items():
                getattr(experts, n).copy_(t)


def save_adapter(model, directory):
    """Writes the patched model's adapters to directory/adapter_model.safetensors and
    directory/adapter_config.json, as PEFT's save_pretrained does for LoRA on expert parameters:
    PeftModel.from_pretrained(model, directory) loads them."""
    tensors, config = adapter_state_dict(model)
    save_file, directory = _safetensors().save_file, os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(directory, CONFIG), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def load_adapter(model, directory):
    """Reads an adapter PEFT saved for LoRA on expert parameters (or save_adapter() wrote) into
    a patched model (load_adapter_state_dict)."""
    directory = os.fspath(directory)
    try:
        with open(os.path.join(directory, CONFIG)) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise InvalidArgument("{}: {}".format(os.path.join(directory, CONFIG), e)) from None
    load_file = _safetensors().load_file
    try:
        tensors = load_file(os.path.join(directory, WEIGHTS))
    except Exception as e:  # the safetensors package's own error type included
        raise InvalidArgument("{}: {}".format(os.path.join(directory, WEIGHTS), e)) from None
    load_adapter_state_dict(model, tensors, config)


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise InvalidArgument("adapters are read and written with the safetensors package, which is not "
                              "installed") from None
    return safetensors.torch
