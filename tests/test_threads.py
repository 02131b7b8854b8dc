"""Kernels called from several threads at once (data loaders, servers), on every backend.

Triton's interpreter keeps a launch's grid in process-global state: 8 threads calling
``softmax`` on CPU tensors made 14-16 of 40 calls fail (``x >= grid_dim[0]``, "Did you
forget to add @triton.jit"). Interpreted launches now hold one lock
(``launch.launch_guard``); on GPUs the threads share plans, tuning and compiled binaries.
"""
from __future__ import annotations

import threading

import pytest
import torch

import portable_kernels as pk
from portable_kernels import ops

from conftest import DEVICE

THREADS = 8
CALLS = 5


def _run_in_threads(work) -> list:
    """``work(i)`` in each of THREADS threads at once, started together; returns the
    exceptions raised (each thread's first)."""
    barrier = threading.Barrier(THREADS)
    errors: list = []

    def body(i):
        barrier.wait()
        try:
            work(i)
        except BaseException as exc:  # collected, asserted on below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    return errors


def test_one_kernel_from_many_threads():
    torch.manual_seed(0)
    inputs = [torch.randn(16, 33, device=DEVICE) for _ in range(THREADS)]
    expected = [torch.softmax(x.double(), -1) for x in inputs]
    softmax = pk.get_kernel("softmax")
    wrong = []

    def work(i):
        for _ in range(CALLS):
            out = softmax(inputs[i])
            if not torch.allclose(out.double(), expected[i], atol=1e-6, rtol=1e-5):
                wrong.append(i)

    errors = _run_in_threads(work)
    assert not errors, f"{len(errors)} of {THREADS} threads raised, first: {errors[0]!r}"
    assert not wrong, f"wrong results in threads {sorted(set(wrong))}"


def test_several_kernels_and_a_backward_from_many_threads():
    """Different families at once, each thread with its own first call of some of them
    (selection, plans and compilation happen concurrently too), and an autograd backward
    through the ops."""
    torch.manual_seed(1)
    x = torch.randn(8, 40, device=DEVICE)
    w, b = torch.randn(40, device=DEVICE), torch.randn(40, device=DEVICE)
    a, m = torch.randn(24, 40, device=DEVICE), torch.randn(40, 12, device=DEVICE)
    ref = {
        "vector_add": x.double() * 2,
        "layer_norm": torch.nn.functional.layer_norm(x.double(), (40,), w.double(), b.double()),
        "matmul": a.double() @ m.double(),
    }
    calls = {
        "vector_add": lambda: pk.get_kernel("vector_add")(x, x),
        "layer_norm": lambda: pk.get_kernel("layer_norm")(x, w, b),
        "matmul": lambda: pk.get_kernel("matmul")(a, m),
    }
    names = list(calls)
    wrong = []

    def work(i):
        for j in range(CALLS):
            name = names[(i + j) % len(names)]
            out = calls[name]()
            # fp32 dots may run as tf32 on GPUs.
            if not torch.allclose(out.double(), ref[name], atol=2e-2, rtol=2e-2):
                wrong.append(name)
        leaf = x.clone().requires_grad_(True)
        ops.softmax(leaf, -1).square().sum().backward()
        s = torch.softmax(x.double(), -1)
        g = 2 * s
        expected = s * (g - (g * s).sum(-1, keepdim=True))
        if not torch.allclose(leaf.grad.double(), expected, atol=1e-5, rtol=1e-4):
            wrong.append("softmax backward")

    errors = _run_in_threads(work)
    assert not errors, f"{len(errors)} of {THREADS} threads raised, first: {errors[0]!r}"
    assert not wrong, f"wrong results: {sorted(set(wrong))}"


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the interpreter's lock exists on the CPU only")
def test_interpreted_launches_hold_one_reentrant_lock():
    """The guard serializes and nests (an op's launch inside another op's)."""
    from portable_kernels import _interpreter
    from portable_kernels.launch import launch_guard

    outer = launch_guard(torch.device("cpu"))
    with outer:
        with launch_guard(torch.device("cpu")):
            assert _interpreter._LOCK._is_owned()
        assert _interpreter._LOCK._is_owned()
    held = threading.Event()
    release = threading.Event()

    def holder():
        with launch_guard(torch.device("cpu")):
            held.set()
            release.wait(10)

    t = threading.Thread(target=holder)
    t.start()
    assert held.wait(10)
    assert not _interpreter._LOCK.acquire(blocking=False), "a second thread got the lock"
    release.set()
    t.join(10)
    assert _interpreter._LOCK.acquire(blocking=False)
    _interpreter._LOCK.release()
