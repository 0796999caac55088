"""moecert's ops as torch.library custom ops (torch >= 2.4), so that
torch.compile keeps each as one op in its graphs: the experts op and the layer
(functions.py) and the routers (routers.py), each registered from its single
definition (define.py) as torch.ops.moecert.<name> and <name>_backward, joined
by register_autograd. Packed experts, layer configs and Stats recorders are
named by key and the saved state by a state tensor (keys.py). moecert.torch's
functions and modules call these ops while torch.compile traces; eagerly, and
on older torch, the definitions' autograd.Functions, with the same bits (the
Functions cost less dispatch per call).
"""
import torch

from . import define, functions, routers

_registered = None


def register():
    """Registers the ops once; False where torch lacks torch.library.custom_op (before 2.4)."""
    global _registered
    if _registered is not None:
        return _registered
    lib = getattr(torch, "library", None)
    if lib is None or not hasattr(lib, "custom_op") or not hasattr(lib, "register_autograd"):
        _registered = False
        return False
    define.register(lib, functions.DEFINITIONS + routers.DEFINITIONS)
    _registered = True
    return True


def registered():
    """Whether register() registered the ops."""
    return bool(_registered)


always = False  # call the registered ops eagerly too (tests)


def in_graph():
    """Whether calls should be the registered ops: while torch.compile traces, or `always`."""
    return bool(_registered) and (always or compiling())


def compiling():
    """Whether torch.compile is tracing (checks that read tensor versions are left to eager runs)."""
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(is_compiling and is_compiling())
