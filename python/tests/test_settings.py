"""Settings through the C ABI: contract level, semantic, groups, scopes, threads, kernels."""
import pytest

import moecert


def test_version_and_build():
    assert moecert.version() == moecert.__version__ and moecert.version().count(".") == 2
    assert "contract cap" in moecert.build_info()


def test_scopes_nest_and_restore():
    outer = moecert.contract_level()  # conftest: full
    assert outer == "full"
    with moecert.contracts("check", "observe", groups=("shape", "finite")):
        assert moecert.contract_level() == "check" and moecert.contract_semantic() == "observe"
        assert moecert.contract_groups() == ("shape", "finite")
        with moecert.contracts("off"):
            assert moecert.contract_level() == "off"
        assert moecert.contract_level() == "check"
    assert moecert.contract_level() == outer and moecert.contract_groups() == moecert.GROUPS


def test_process_wide_settings_under_no_scope():
    import threading
    seen = {}

    def other_thread():  # no scope there: the process-wide settings
        seen["level"] = moecert.contract_level()

    moecert.set_contract_level("audit")
    try:
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        assert seen["level"] == "audit"
    finally:
        moecert.set_contract_level("off")


def test_bad_settings_raise():
    with pytest.raises(moecert.InvalidArgument, match="level 'loud'"):
        moecert.set_contract_level("loud")
    with pytest.raises(moecert.InvalidArgument, match="group 'speed'"):
        moecert.set_contract_groups(["speed"])
    with pytest.raises(moecert.InvalidArgument, match="threads -1"):
        moecert.set_num_threads(-1)
    import threading
    errors = []

    def pop_unpushed():  # a fresh thread has no scope (this one has conftest's)
        try:
            moecert._abi.call("moecert_contract_scope_pop")
        except moecert.InvalidArgument as e:
            errors.append(str(e))

    t = threading.Thread(target=pop_unpushed)
    t.start()
    t.join()
    assert errors == ["moecert_contract_scope_pop: no scope pushed on this thread"]


def test_threads_and_kernels():
    before = moecert.num_threads()
    moecert.set_num_threads(1)
    assert moecert.num_threads() == 1
    moecert.set_num_threads(before)
    assert moecert.num_threads() == before
    assert moecert.isa_usable("scalar") and moecert.isa_usable("amx_emu")
    assert moecert.default_isa() in moecert.ISAS
