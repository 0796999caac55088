"""moecert ops for PyTorch: autograd Functions, nn.Modules, per-token statistics.

    import moecert.torch as mt
    layer = mt.MoELayer(experts=64, hidden=2048, inter=1408, topk=6, rank=8)
    y = layer(x.bfloat16())                       # x [T, H]
    y = mt.experts(x, expert_ids, weights, packed, lora)  # your router, moecert's experts

Tensors are CPU tensors of the dtypes the ops document; anything else raises
moecert.InvalidArgument before any work. Threads: importing this module sets
moecert's worker threads to torch.get_num_threads() (unless MOECERT_NUM_THREADS
is set): moecert's oneTBB workers and torch's intra-op threads take turns on
the same cores instead of oversubscribing them.
"""
import os

import torch

from .. import set_num_threads
from ..errors import InvalidArgument
from . import formats, functions, library, ops, routers
from .formats import Quantized, quantize
from .functions import EXPERTS, LAYER, Stats, experts, stats
from .modules import MoELayer
from .routers import product_key, sigmoid_topk, softmax_topk
from .ops import LayerConfig, Lora, PackedExperts

__all__ = ["ops", "functions", "formats", "library", "routers", "Quantized", "quantize", "experts", "softmax_topk", "sigmoid_topk", "product_key", "stats",
           "Stats", "EXPERTS", "LAYER", "MoELayer", "PackedExperts", "Lora", "LayerConfig"]

library.register()


def _threads():
    """MOECERT_NUM_THREADS (an integer >= 0), else torch's intra-op thread count."""
    text = os.environ.get("MOECERT_NUM_THREADS")
    if text is None:
        return torch.get_num_threads()
    try:
        threads = int(text)
    except ValueError:
        threads = -1
    if threads < 0:
        raise InvalidArgument("MOECERT_NUM_THREADS={!r}: expected an integer >= 0 (0: every core)".format(text))
    return threads


set_num_threads(_threads())
