"""Shared fixtures: every test runs with moecert's contracts at `full` (every
clause, every output against moecert's own reference as well), enforce."""
import pytest
import torch

import moecert

ISAS = [i for i in moecert.ISAS if moecert.isa_usable(i)]


@pytest.fixture(autouse=True)
def full_contracts():
    with moecert.contracts("full"):
        yield


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(1234)


def within(name, got, ref, bound):
    """Asserts |got - ref| <= bound element-wise, naming the worst element."""
    got, ref, bound = got.detach().double(), ref.detach().double(), bound.double()
    assert got.shape == ref.shape == bound.shape, (name, got.shape, ref.shape, bound.shape)
    excess = (got - ref).abs() - bound
    worst = int(excess.argmax()) if excess.numel() else 0
    assert not excess.numel() or float(excess.flatten()[worst]) <= 0, (
        "{}[{}]: got {!r}, float64 reference {!r}, bound {!r}".format(
            name, worst, float(got.flatten()[worst]), float(ref.flatten()[worst]), float(bound.flatten()[worst])))
