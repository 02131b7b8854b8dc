"""Every family captured in a CUDA graph after one warm call (GPU only).

Per family, one conformance shape (the largest of the quick ones, so that the launch takes
its multi-program path): a warm eager call compiles, tunes and allocates; the call is
captured on a side stream; new input values are copied into the captured inputs; a replay
must then give what an eager call on those values gives, and differ from the first values'
result (so a replay that ran nothing, or one that baked the first values in, fails).
Families with a backward are captured a second time, forward and backward together.

A capture fails where the call synchronises with the host (``.item()``, a value-dependent
allocation or grid) or allocates outside the graph's pool: what serving engines need to
replay decode steps without the host.
"""
from __future__ import annotations

import importlib

import pytest
import torch

import portable_kernels as pk
from portable_kernels import testing
from portable_kernels.conformance.harness import Inputs
from portable_kernels.conformance.harness import _flatten as _flat  # the suites' own flattening

from conftest import DEVICE, ON_CPU

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(ON_CPU, reason="CUDA-graph capture needs a CUDA device (the interpreter has "
                       "no streams or graphs)"),
]


def _families() -> list[str]:
    names = []
    for name in sorted(pk.list_kernels()):
        try:
            importlib.import_module(f"portable_kernels.conformance.test_{name}")
        except ModuleNotFoundError:
            continue
        names.append(name)
    return names


def _suite(name: str):
    return importlib.import_module(f"portable_kernels.conformance.test_{name}").SUITE


def _size(inputs: Inputs) -> int:
    return sum(t.numel() for t in _flat([*inputs.args, *inputs.kwargs.values()])
               if isinstance(t, torch.Tensor))


def _case(suite):
    """(shape, dtype, inputs maker): the largest quick shape, fp16 where the suite has it."""
    dtype = torch.float16 if torch.float16 in suite.dtypes else suite.dtypes[0]

    def make(shape, seed):
        inputs = suite.make_inputs(shape, dtype, DEVICE, torch.Generator().manual_seed(seed))
        return inputs if isinstance(inputs, Inputs) else Inputs(tuple(inputs))

    shapes = [s for s in suite.shapes if s.quick and (s.dtypes is None or dtype in s.dtypes)]
    shape = max(shapes, key=lambda s: _size(make(s, 0)))
    return shape, dtype, make


def _clone(inputs: Inputs) -> Inputs:
    def one(v):
        if isinstance(v, (list, tuple)):
            return type(v)(one(x) for x in v)
        return v.clone() if isinstance(v, torch.Tensor) else v
    return Inputs(tuple(one(a) for a in inputs.args), {k: one(v) for k, v in inputs.kwargs.items()})


def _copy_into(static: Inputs, fresh: Inputs) -> None:
    pairs = [*zip(static.args, fresh.args), *((static.kwargs[k], fresh.kwargs[k]) for k in static.kwargs)]
    for s, f in pairs:
        if isinstance(s, (list, tuple)):
            _copy_into(Inputs(tuple(s)), Inputs(tuple(f)))
        elif isinstance(s, torch.Tensor):
            s.copy_(f)
        else:
            assert s == f, "the shape's non-tensor arguments must not depend on the seed"


def _captured(run, static: Inputs):
    """``run(static)`` captured on a side stream after a warm call there; the graph and its
    output tensors."""
    stream = torch.cuda.Stream(DEVICE)
    stream.wait_stream(torch.cuda.current_stream(DEVICE))
    with torch.cuda.stream(stream):
        run(_clone(static))  # warm on the capturing stream: its workspaces, autograd's state
    torch.cuda.current_stream(DEVICE).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        outs = run(static)
    return graph, outs


def _check_replay(run, suite, shape, dtype, make, kind: str, refresh=lambda: None) -> None:
    """``refresh()`` gives the call's other static inputs (an upstream gradient) new values
    where the new inputs do."""
    first, fresh = make(shape, 0), make(shape, 1)
    run(_clone(first))  # the warm call: compile, tune, allocate
    torch.cuda.synchronize(DEVICE)
    static = _clone(first)
    graph, outs = _captured(run, static)
    graph.replay()
    before = [o.clone() for o in outs]
    _copy_into(static, fresh)
    refresh()
    graph.replay()
    torch.cuda.synchronize(DEVICE)
    expected = run(_clone(fresh))
    assert len(outs) == len(expected)
    tol = testing.tolerance(dtype, kind)
    changed = False
    for i, (out, exp, old) in enumerate(zip(outs, expected, before)):
        torch.testing.assert_close(out, exp, atol=tol.atol, rtol=tol.rtol, equal_nan=True,
                                   msg=lambda m, i=i: f"{suite.kernel}: replayed output {i}: {m}")
        changed |= not torch.equal(out.nan_to_num(), old.nan_to_num())
    assert changed, f"{suite.kernel}: the replay with new inputs gave the first inputs' result"


@pytest.mark.parametrize("name", _families())
def test_forward_replays_with_new_inputs(name):
    suite = _suite(name)
    shape, dtype, make = _case(suite)
    kernel = pk.get_kernel(name)

    def run(inputs):
        return [o for o in _flat(suite.call(kernel, inputs)) if isinstance(o, torch.Tensor)]

    _check_replay(run, suite, shape, dtype, make, suite.tolerance)


@pytest.mark.parametrize("name", [n for n in _families() if _suite(n).grad_args])
def test_forward_and_backward_replay_with_new_inputs(name):
    suite = _suite(name)
    shape, dtype, make = _case(suite)
    kernel = pk.get_kernel(name)
    gen = torch.Generator().manual_seed(2)
    grads = []  # the upstream gradients: made by the first call, refreshed with the inputs

    def run(inputs):
        args = list(inputs.args)
        leaves = []
        for i in suite.grad_args:
            if isinstance(args[i], torch.Tensor):
                args[i] = args[i].detach().requires_grad_(True)
                leaves.append(args[i])
        outs = [o for o in _flat(suite.call(kernel, Inputs(tuple(args), inputs.kwargs)))
                if isinstance(o, torch.Tensor) and o.requires_grad]
        if not grads:
            grads.extend(torch.randn(o.shape, generator=gen).to(o.device, o.dtype) for o in outs)
        return list(torch.autograd.grad(outs, leaves, grads))

    def refresh():
        for g in grads:
            g.copy_(torch.randn(g.shape, generator=gen))

    _check_replay(run, suite, shape, dtype, make, suite.grad_tolerance or suite.tolerance, refresh)
