"""The routers of transformers 5's MoE families on moecert's router ops: one registered
description per router class, each stating the family's maths and when moecert computes it.

A block's router (`gate`) returns (router_logits, top_k_weights, top_k_index). moecert keeps the
gate and its logits (the model's own linear layer, in the dtype the family computes them) and
replaces the selection and the weights by moecert's router on those logits, through a forward
hook on the gate: the gate stays the module the model's output recorders and state dict know.
Ties between equal scores are broken by expert index (the lower first), where torch.topk's order
is unspecified; the weights' slot order is moecert's (score descending)."""
import torch

from ..errors import InvalidArgument
from ..torch import routers

MODES = ("auto", "moecert", "model")


class Routing:
    """A forward hook on a gate: its output's weights and ids replaced by moecert's router's on
    its logits (a module-level class, so the model still pickles)."""

    def __call__(self, gate, args, output):
        logits = output[0]
        weights, ids = self.route(gate, logits)
        return (logits, weights, ids.long()) + tuple(output[3:])


class SoftmaxRouting(Routing):
    def __init__(self, renormalize, cast, scaling=None):
        self.renormalize, self.cast, self.scaling = renormalize, cast, scaling

    def route(self, gate, logits):
        ids, w = routers.softmax_topk(logits.float(), gate.top_k, self.renormalize)
        if self.scaling is not None:
            w = w * self.scaling
        return (w.to(logits.dtype) if self.cast else w), ids


class SigmoidRouting(Routing):
    def __init__(self, scaling, groups, topk_group):
        self.scaling, self.groups, self.topk_group = scaling, groups, topk_group

    def route(self, gate, logits):
        bias = gate.e_score_correction_bias.detach().float()
        ids, w = routers.sigmoid_topk(logits.float(), bias, gate.top_k, self.groups, self.topk_group, self.scaling)
        return w, ids


def _qwen_style(gate):
    """softmax over the experts in fp32, top-k, renormalised when norm_topk_prob, weights cast
    to the logits' dtype (Qwen2-MoE, Qwen3-MoE, OLMoE)."""
    return SoftmaxRouting(bool(gate.norm_topk_prob), True), None


def _mixtral(gate):
    """softmax in fp32, top-k, always renormalised, fp32 weights."""
    return SoftmaxRouting(True, False), None


def _deepseek_v3(gate):
    """fp32 logits, s = sigmoid; selection by s + e_score_correction_bias within the topk_group
    groups of largest top-2 sums; w = routed_scaling_factor * s / sum of the selected s (the
    model adds 1e-20 to that sum: no change to an fp32 sum above 2^-42)."""
    if not gate.norm_topk_prob:
        return None, "norm_topk_prob=False (moecert's sigmoid_topk renormalises)"
    return SigmoidRouting(float(gate.routed_scaling_factor), int(gate.num_group), int(gate.topk_group)), None


def _deepseek_v2(gate):
    """fp32 logits, softmax, top-k not renormalised ("greedy"), times routed_scaling_factor."""
    if gate.topk_method != "greedy":
        return None, "topk_method={!r} (group score = the group's largest; moecert's groups sum the top 2)".format(
            gate.topk_method)
    return SoftmaxRouting(False, False, float(gate.routed_scaling_factor)), None


REGISTRY = {
    "Qwen3MoeTopKRouter": _qwen_style,
    "Qwen2MoeTopKRouter": _qwen_style,
    "OlmoeTopKRouter": _qwen_style,
    "MixtralTopKRouter": _mixtral,
    "DeepseekV3TopkRouter": _deepseek_v3,
    "DeepseekV2TopkRouter": _deepseek_v2,
}


def routing_of(gate):
    """(a Routing hook for the gate, None), or (None, why moecert does not compute this router's
    maths)."""
    describe = REGISTRY.get(type(gate).__name__)
    if describe is None:
        return None, "router {} is not one moecert.hf knows ({})".format(type(gate).__name__, ", ".join(REGISTRY))
    return describe(gate)


def _routing(gate):
    return routing_of(gate) if isinstance(gate, torch.nn.Module) else (None, "no gate module")


def attach_check(block_name, gate):
    """Raises InvalidArgument when moecert does not compute the gate's maths."""
    routing, why = _routing(gate)
    if routing is None:
        raise InvalidArgument("{}.gate: {}; use router='model'".format(block_name, why))


def attach(gate, mode):
    """Puts moecert's router on `gate` per `mode` (MODES; "moecert" checked by attach_check
    first); returns whether it did."""
    routing, _ = _routing(gate) if mode != "model" else (None, None)
    if routing is None:
        return False
    gate.register_forward_hook(routing)
    return True


def check_mode(mode):
    if mode not in MODES:
        raise InvalidArgument("router={!r}, expected one of {}".format(mode, ", ".join(MODES)))
