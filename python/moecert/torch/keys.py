"""The objects moecert's op definitions name by integer (a torch.library schema
carries tensors and plain values, not Python objects): packed experts, layer
configs, Stats recorders, and the saved state a training forward hands to its
backward.

A saved state travels as a state tensor [key, generation] (int64) whose storage
owns the state: it lives while any tensor sharing that storage lives (the graph
that saved it, a view, a copy torch made of it), and no longer. A backward finds
it by key and checks the generation, so a retained graph's second backward works
until a later forward reuses the state.
"""
import ctypes
import dataclasses
import itertools
import threading
import weakref

import torch

from ..errors import InvalidArgument

_lock = threading.Lock()
_next = itertools.count(1)
_objects = weakref.WeakValueDictionary()  # key -> a packed pack, Stats or saved state, while it lives
_configs = {}      # key -> LayerConfig
_config_keys = {}  # the config's fields -> key


def key_of(obj):
    """The key naming `obj` (formed at the first call; kept on the object as `_key`)."""
    key = getattr(obj, "_key", None)
    if key is None:
        with _lock:
            key = next(_next)
            _objects[key] = obj
        obj._key = key
    return key


def lookup(key, what):
    """The object `key` names; raises naming `what` when it is gone."""
    obj = _objects.get(int(key)) if key else None
    if obj is None:
        raise InvalidArgument("{} key {}: names nothing alive (the object was collected)".format(what, int(key)))
    return obj


def config_key(cfg):
    """A key naming the layer config (equal configs share one)."""
    fields = dataclasses.astuple(cfg)
    with _lock:
        key = _config_keys.get(fields)
        if key is None:
            key = _config_keys[fields] = next(_next)
            _configs[key] = cfg
    return key


def config(key):
    return _configs[int(key)]


class _Cell(ctypes.Structure):
    """The state tensor's storage: [key, generation], and the state it keeps alive."""
    _fields_ = [("key", ctypes.c_int64), ("generation", ctypes.c_int64)]


def hold(saved):
    """The state tensor naming a training forward's saved state (owning it, see above)."""
    cell = _Cell(key_of(saved), saved.generation)
    cell.saved = saved
    return torch.frombuffer(cell, dtype=torch.int64)


def no_state():
    """The state tensor of a forward that kept none (training=False)."""
    return torch.zeros(2, dtype=torch.int64)


def resume(state, check_generation):
    """The saved state a state tensor names, after check_generation(saved, generation)."""
    key, generation = state.tolist()
    saved = _objects.get(key) if key else None
    if saved is None:
        raise InvalidArgument("the forward kept no saved state (training=False): it has no backward")
    check_generation(saved, generation)
    return saved
