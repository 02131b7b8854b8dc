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


def _launch_hooks() -> tuple:
    """Triton's launch hooks as they stand (3.6 keeps chains of them)."""
    import triton

    runtime = triton.knobs.runtime
    return tuple((id(h), tuple(getattr(h, "calls", ()) or ()))
                 for h in (runtime.launch_enter_hook, runtime.launch_exit_hook))


#: Variables a test may not add: the library's own. Any variable that existed is watched;
#: other new ones are not, since torch and Triton add theirs lazily, once per process
#: (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR, TRITON_PTXAS_PATH at the first compile).
#: pytest's PYTEST_CURRENT_TEST is pytest's.
_WATCHED = ("PK_",)


@pytest.fixture(autouse=True)
def _no_leaked_state():
    """Fail the test that leaves the process changed for the tests after it: environment
    variables (PK_DIRECT_LAUNCH left at 0 turned direct launches off for every later test
    of a serial run) or Triton launch hooks (which also turn direct launches off). The
    state is put back either way, so one leak fails one test, not the ones after it.
    Autouse fixtures are set up first, so this checks after monkeypatch has undone its
    changes."""
    env = dict(os.environ)
    hooks = _launch_hooks()
    yield
    changed = sorted(k for k in env.keys() | os.environ.keys()
                     if env.get(k) != os.environ.get(k) and k != "PYTEST_CURRENT_TEST"
                     and (k in env or k.startswith(_WATCHED)))
    for k in changed:
        if k in env:
            os.environ[k] = env[k]
        else:
            del os.environ[k]
    leaked_hooks = _launch_hooks() != hooks
    if changed or leaked_hooks:
        what = [f"environment variables {changed}"] if changed else []
        what += ["Triton's launch hooks"] if leaked_hooks else []
        pytest.fail(f"the test left {' and '.join(what)} changed (use monkeypatch, or put "
                    "them back in a finally)", pytrace=False)


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
    (``portable_kernels_backends.nvidia.gluon._common.descriptor``) passes them: Gluon's ``TensorDescriptor`` accepts the
    same fields."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    checked = TensorDescriptor(desc.base, list(desc.shape), list(desc.strides),
                               list(desc.block_shape), desc.layout, desc.padding)
    assert type(desc) is TensorDescriptor and checked.padding == "zero"


def pytest_report_header(config):
    return f"portable-kernels test device: {DEVICE} ({'interpreter' if ON_CPU else 'compiled'})"

