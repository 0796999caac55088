"""moecert: verified Mixture-of-Experts training operators for CPUs.

This package is pure Python over moecert's C ABI (libmoecert_c.so, ctypes):
one build serves every Python 3 and torch version. The torch ops and modules
are in `moecert.torch`.

    import moecert
    moecert.set_contract_level("check")      # process-wide
    with moecert.contracts("full"):          # this thread, for the block
        ...
"""
import contextlib

from . import _abi
from .errors import ContractViolation, Error, InvalidArgument

__all__ = ["ContractViolation", "Error", "InvalidArgument", "LEVELS", "SEMANTICS", "GROUPS", "ISAS", "FORMATS", "version",
           "build_info", "set_contract_level", "set_contract_semantic", "set_contract_groups", "contract_level",
           "contract_semantic", "contract_groups", "contract_level_cap", "contracts", "set_num_threads",
           "num_threads", "default_isa", "isa_usable"]

# Names in the C ABI's numbering, read from the library.
LEVELS = _abi.names("level")
SEMANTICS = _abi.names("semantic")
GROUPS = _abi.names("group")
ISAS = _abi.names("isa")
FORMATS = _abi.names("weight_format")

__version__ = _abi.lib.moecert_version().decode()


def version():
    return __version__


def build_info():
    """One line: build type, compiler, commit, contract cap of the loaded library."""
    return _abi.lib.moecert_build_info().decode()


def _index(name, names, what):
    if name not in names:
        raise InvalidArgument("{} {!r}: expected one of {}".format(what, name, ", ".join(names)))
    return names.index(name)


def _group_mask(groups):
    if groups == "all":
        return (1 << len(GROUPS)) - 1
    mask = 0
    for g in groups:
        mask |= 1 << _index(g, GROUPS, "group")
    return mask


def set_contract_level(level):
    """Process-wide contract level: "off", "check", "audit" or "full" (clamped to the build's cap)."""
    _abi.call("moecert_set_contract_level", _index(level, LEVELS, "level"))


def set_contract_semantic(semantic):
    """What a violation does: "ignore", "observe" (report, continue) or "enforce" (raise ContractViolation)."""
    _abi.call("moecert_set_contract_semantic", _index(semantic, SEMANTICS, "semantic"))


def set_contract_groups(groups):
    """Clause groups evaluated: "all" or an iterable of names from GROUPS."""
    _abi.call("moecert_set_contract_groups", _group_mask(groups))


def contract_level():
    """The level in effect on this thread (innermost `contracts` block, clamped to the cap)."""
    return LEVELS[_abi.value("moecert_contract_level")]


def contract_semantic():
    return SEMANTICS[_abi.value("moecert_contract_semantic")]


def contract_groups():
    mask = _abi.value("moecert_contract_groups", 2 ** 32 - 1)
    return tuple(g for i, g in enumerate(GROUPS) if mask >> i & 1)


def contract_level_cap():
    """The highest level compiled into the loaded library."""
    return LEVELS[_abi.lib.moecert_contract_level_cap()]


@contextlib.contextmanager
def contracts(level, semantic="enforce", groups="all"):
    """Contract settings for this thread inside the block (moecert::ContractScope); blocks nest.
    They hold for the whole of each call made in the block, on every worker thread it uses."""
    _abi.call("moecert_contract_scope_push", _index(level, LEVELS, "level"),
              _index(semantic, SEMANTICS, "semantic"), _group_mask(groups))
    try:
        yield
    finally:
        _abi.call("moecert_contract_scope_pop")


def set_num_threads(threads):
    """Worker threads of every moecert op (oneTBB); 0 restores oneTBB's default (all cores of the
    process's affinity mask). Results are bitwise the same for any count."""
    if not isinstance(threads, int) or threads < 0:
        raise InvalidArgument("threads {!r}: expected an int >= 0".format(threads))
    _abi.call("moecert_set_num_threads", threads)


def num_threads():
    return _abi.lib.moecert_num_threads()


def default_isa():
    """The kernel moecert uses by default on this machine."""
    return ISAS[_abi.value("moecert_default_isa")]


def isa_usable(isa):
    return bool(_abi.lib.moecert_isa_usable(_index(isa, ISAS, "isa")))
