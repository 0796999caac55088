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


@pytest.mark.parametrize("name, value", [("MOECERT_CONTRACTS", "bogus"), ("MOECERT_CONTRACTS", "of"),
                                         ("MOECERT_CONTRACT_GROUPS", "shap"), ("MOECERT_GUARD_PAGES", "End"),
                                         ("MOECERT_ISA", "avx3"), ("MOECERT_NUM_THREADS", "lots")])
def test_a_malformed_environment_setting_is_an_invalid_argument_naming_it(name, value):
    """Never an abort and never a silent default: the first call that reads the setting (the
    import for MOECERT_NUM_THREADS, the getters, the first op) raises InvalidArgument naming the
    variable and what it accepts."""
    import os
    import subprocess
    import sys
    script = "\n".join([
        "import moecert",
        "try:",
        "    import torch, moecert.torch as mt",
        "    moecert.contract_level(); moecert.contract_groups(); moecert.default_isa()",
        "    mt.MoELayer(4, 16, 8, 2, max_tokens=4)(torch.randn(4, 16))",
        "    print('ran')",
        "except moecert.InvalidArgument as e:",
        "    print('InvalidArgument:', e)",
    ])
    env = dict(os.environ, **{name: value})
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("InvalidArgument:") and "{}={}".format(name, value) in run.stdout.replace(
        "'", ""), run.stdout
    assert "expected" in run.stdout
