"""Launches run on the tensors' device, not on whichever device is current.

Triton compiles for and launches on the current device; ``launch.device_guard`` switches to
the call's device around a launch, as torch's own operators do. The CPU tests check the
guard's logic through a stand-in device type and that calls go through it; the GPU tests
need two devices and run every family on the second one while the first is current.
"""
from __future__ import annotations

import contextlib
import types

import pytest
import torch

import portable_kernels as pk
from portable_kernels import dispatch, launch, ops
from portable_kernels.kernels import flash_attn as fa
from portable_kernels.kernels import layer_norm as ln
from portable_kernels.kernels import matmul as mm
from portable_kernels.kernels import softmax as sm
from portable_kernels.testing import assert_close, tolerance

from conftest import ON_CPU
from test_flash_attn import _grad_tolerance
from test_layer_norm import _column_sum_tolerance, _dx_tolerance
from test_matmul import _rand

NEEDS_TWO_GPUS = pytest.mark.skipif(
    ON_CPU or not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="a launch on a device that is not current needs two CUDA devices")


@pytest.fixture
def standin(monkeypatch):
    """A device type ``privateuseone`` with ``state["count"]`` devices, whose current index
    is ``state["current"]`` and whose ``device(i)`` context is recorded in
    ``state["entered"]``."""
    state = {"count": 2, "current": 0, "entered": []}

    @contextlib.contextmanager
    def device(index):
        state["entered"].append(index)
        yield

    monkeypatch.setattr(torch, "privateuseone", types.SimpleNamespace(
        current_device=lambda: state["current"], device=device, device_count=lambda: state["count"]),
        raising=False)
    monkeypatch.setattr(launch, "_current_index", {})
    return state


def test_no_guard_where_the_device_is_current_or_has_no_index(standin):
    assert launch.device_guard(torch.device("cpu")) is None
    assert launch.device_guard(torch.device("privateuseone", 0)) is None
    assert launch.device_guard(torch.device("meta")) is None
    assert standin["entered"] == []


def test_guard_switches_to_a_device_that_is_not_current(standin):
    guard = launch.device_guard(torch.device("privateuseone", 1))
    assert guard is not None
    with guard:
        pass
    assert standin["entered"] == [1]
    standin["current"] = 1
    assert launch.device_guard(torch.device("privateuseone", 1)) is None


def test_one_device_of_a_type_needs_no_check(standin):
    # With a single device, a tensor's device is the current one: not even read per call.
    standin["count"] = 1
    standin["current"] = 5  # would be a mismatch if it were read
    assert launch.device_guard(torch.device("privateuseone", 0)) is None
    assert launch._current_index == {"privateuseone": None}


@pytest.fixture
def recorded(monkeypatch):
    """Every guard a call asks for, by device; a no-op context for each."""
    seen = []

    def guard(device):
        seen.append(device)
        return contextlib.nullcontext()

    monkeypatch.setattr(dispatch, "launch_guard", guard)
    monkeypatch.setattr(ops, "launch_guard", guard)
    return seen


def test_handle_calls_launch_inside_the_guard(recorded, device, gen):
    x, y = (torch.randn(300, generator=gen).to(device) for _ in range(2))
    out = pk.get_kernel("vector_add")(x, y)
    assert recorded == [x.device]
    assert torch.equal(out.cpu(), (x + y).cpu())


def test_staged_ops_launch_inside_the_guard(recorded, device, gen):
    """Ops that run a family's stages themselves (forward and backward as separate custom
    ops, as the operators run: ``ops.<name>`` in eager code takes the handle) guard each
    stage."""
    q, k, v = (torch.randn(1, 1, 16, 16, generator=gen).to(device).requires_grad_() for _ in range(3))
    torch.ops.portable_kernels.flash_attn(q, k, v).sum().backward()
    x = torch.randn(4, 32, generator=gen).to(device).requires_grad_()
    w, b = torch.ones(32, device=device), torch.zeros(32, device=device)
    torch.ops.portable_kernels.layer_norm(x, w, b).sum().backward()
    assert recorded == [q.device] * 2 + [x.device] * 2
    assert q.grad is not None and x.grad is not None


# --- two GPUs: every family on cuda:1 while cuda:0 is current ---------------------------------

@pytest.fixture
def second_gpu():
    previous = torch.cuda.current_device()
    torch.cuda.set_device(0)
    yield torch.device("cuda", 1)
    assert torch.cuda.current_device() == 0, "a call left another device current"
    torch.cuda.set_device(previous)


def _capture_default_stream_on_device_0():
    """Make torch's per-process default capture stream (created at the first
    ``torch.cuda.graph`` without a stream) one of device 0, as tuning there first does."""
    with torch.cuda.device(0), torch.cuda.graph(torch.cuda.CUDAGraph()):
        torch.zeros(8, device="cuda:0")


@NEEDS_TWO_GPUS
def test_tuning_timer_captures_on_the_launch_device(second_gpu, gen):
    _capture_default_stream_on_device_0()
    x, y = (_rand(gen, 4096, dtype=torch.float32, device=second_gpu) for _ in range(2))
    add = pk.get_kernel("vector_add")
    with torch.cuda.device(second_gpu):
        ms = launch._graph_replays(lambda: add(x, y), quantiles=(0.5, 0.2, 0.8))
    assert len(ms) == 3 and all(0 < t < 1 for t in ms)


@NEEDS_TWO_GPUS
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(16, 4096, 4096), (256, 512, 384)], ids=lambda s: "x".join(map(str, s)))
def test_matmul_on_a_device_that_is_not_current(second_gpu, gen, dtype, shape):
    # 16x4096x4096 tunes to split-K on the H200: the kept counters are the second device's.
    # Tuning here follows graph captures on device 0 (see the test above).
    _capture_default_stream_on_device_0()
    m, n, k = shape
    a, b = _rand(gen, m, k, dtype=dtype, device=second_gpu), _rand(gen, k, n, dtype=dtype, device=second_gpu)
    for _ in range(2):  # the tuning call, then the tuned launch
        out = pk.get_kernel("matmul")(a, b)
        assert out.device == second_gpu
        assert_close(out, mm.reference(a, b), tolerance(dtype, "dot"), f"{shape} {dtype}")
    assert torch.cuda.current_device() == 0


@NEEDS_TWO_GPUS
def test_grouped_matmul_on_a_device_that_is_not_current(second_gpu, gen):
    shapes = [(64, 96, 128), (128, 64, 64)]
    list_a = [_rand(gen, m, k, dtype=torch.float16, device=second_gpu) for m, _, k in shapes]
    list_b = [_rand(gen, k, n, dtype=torch.float16, device=second_gpu) for _, n, k in shapes]
    outs = pk.get_kernel("grouped_matmul")(list_a, list_b)
    for out, a, b in zip(outs, list_a, list_b):
        assert out.device == second_gpu
        assert_close(out, mm.reference(a, b), tolerance(torch.float16, "dot"))


@NEEDS_TWO_GPUS
def test_elementwise_and_row_families_on_a_device_that_is_not_current(second_gpu, gen):
    x = _rand(gen, 37, 1000, dtype=torch.float32, device=second_gpu)
    y = _rand(gen, 37, 1000, dtype=torch.float32, device=second_gpu)
    assert torch.equal(pk.get_kernel("vector_add")(x, y), x + y)
    assert_close(pk.get_kernel("softmax")(x), sm.reference(x), tolerance(torch.float32))
    u = (torch.rand(4096, generator=gen) * 1.8 - 0.9).to(second_gpu)
    assert_close(pk.get_kernel("asin")(u), torch.asin(u.double()), tolerance(torch.float32))
    kept = pk.get_kernel("dropout")(torch.ones(4096, device=second_gpu), 0.5, 7)
    assert kept.device == second_gpu and set(kept.unique().tolist()) <= {0.0, 2.0}
    assert 0.4 < float((kept == 0).float().mean()) < 0.6


@NEEDS_TWO_GPUS
@pytest.mark.parametrize("n", [256, 2048], ids=lambda n: f"n{n}")
def test_flash_attn_forward_and_backward_on_a_device_that_is_not_current(second_gpu, gen, n):
    # N=2048 takes the Hopper backward's descriptor path (BWD_TMA_MIN_SEQ).
    q, k, v = (_rand(gen, 1, 4, n, 64, dtype=torch.float16, device=second_gpu).requires_grad_()
               for _ in range(3))
    out = ops.flash_attn(q, k, v, causal=True)
    grad = _rand(gen, *out.shape, dtype=torch.float16, device=second_gpu)
    out.backward(grad)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = fa.reference(*leaves, causal=True)
    ref.backward(grad.double())
    tol = tolerance(torch.float16, "attention")
    assert_close(out, ref, tol, "out")
    for name, x, x64 in zip("qkv", (q, k, v), leaves):
        assert_close(x.grad, x64.grad, _grad_tolerance(tol, x64.grad), f"d{name}")


@NEEDS_TWO_GPUS
def test_layer_norm_forward_and_backward_on_a_device_that_is_not_current(second_gpu, gen):
    x = _rand(gen, 64, 768, dtype=torch.float32, device=second_gpu).requires_grad_()
    w = _rand(gen, 768, dtype=torch.float32, device=second_gpu).requires_grad_()
    b = _rand(gen, 768, dtype=torch.float32, device=second_gpu).requires_grad_()
    out = ops.layer_norm(x, w, b)
    dy = _rand(gen, 64, 768, dtype=torch.float32, device=second_gpu)
    out.backward(dy)
    leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
    ref = ln.reference(*leaves)
    ref.backward(dy.double())
    tol = tolerance(torch.float32, "reduction")
    assert_close(out, ref, tol)
    assert_close(x.grad, leaves[0].grad, _dx_tolerance(tol, x, w, dy), "dx")
    assert_close(w.grad, leaves[1].grad, _column_sum_tolerance(tol, x, dy), "dweight")
    assert_close(b.grad, leaves[2].grad, _column_sum_tolerance(tol, x, dy), "dbias")
