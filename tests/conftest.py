"""Shared fixtures: the device under test and a fresh plugin host per test that needs one.

Tests run on ``PK_TEST_DEVICE`` (default: ``cuda`` when torch sees a GPU, else ``cpu``
under Triton's interpreter), so the same suite checks the CPU backend in CI and the
compiled kernels on a GPU machine.
"""
from __future__ import annotations

import os

import portable_kernels as pk  # first: it chooses the interpreter before triton is imported

import pytest
import torch

from portable_kernels import plugins


def _test_device() -> torch.device:
    name = os.environ.get("PK_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


DEVICE = _test_device()
ON_CPU = DEVICE.type == "cpu"


@pytest.fixture
def device() -> torch.device:
    """The device kernels are tested on."""
    return DEVICE


@pytest.fixture
def gen() -> torch.Generator:
    """A generator seeded per test, so failures reproduce while inputs stay random-looking."""
    g = torch.Generator(device="cpu")
    g.manual_seed(int.from_bytes(os.urandom(4), "little") if os.environ.get("PK_TEST_RANDOM") else 1234)
    return g


@pytest.fixture
def fresh_host():
    """Install a new plugin host (re-reading PK_* variables) for the test; restore after."""
    created: list[plugins.PluginHost] = []

    def make(*plugin_objects, **kwargs) -> plugins.PluginHost:
        h = plugins.PluginHost(plugin_objects, **kwargs)
        plugins.install_host(h)
        created.append(h)
        return h

    old = plugins.install_host(None)
    yield make
    plugins.install_host(old)


@pytest.fixture
def nan_empty(monkeypatch):
    """Make ``torch.empty`` return NaN-filled float tensors for the test, so an output
    element a launcher allocates but its kernel never writes shows up as NaN instead of as
    whatever the memory held."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)


def assert_checked_descriptor(desc) -> None:
    """A host descriptor the Gluon launchers built without the constructor's checks
    (``kernels._gluon.descriptor``) passes them: Gluon's ``TensorDescriptor`` accepts the
    same fields."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    checked = TensorDescriptor(desc.base, list(desc.shape), list(desc.strides),
                               list(desc.block_shape), desc.layout, desc.padding)
    assert type(desc) is TensorDescriptor and checked.padding == "zero"


def pytest_report_header(config):
    return f"portable-kernels test device: {DEVICE} ({'interpreter' if ON_CPU else 'compiled'})"

