"""swiglu and geglu against torch in float64: separate and fused gate-up inputs, forward and
backward, strided views, poisoned outputs, and errors that name the argument."""
from __future__ import annotations

import pytest
import torch

import portable_kernels as pk
from portable_kernels.testing import assert_close, tolerance

FAMILIES = ["swiglu", "geglu"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _ref(name, gate, up):
    g = gate.double()
    act = torch.nn.functional.gelu(g, approximate="tanh") if name == "geglu" else torch.nn.functional.silu(g)
    return act * up.double()


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (7, 13, 37), (3, 5000)], ids=["one", "odd-3d", "wide"])
def test_separate_gate_and_up(name, dtype, shape, gen, device, nan_empty):
    gate = (3 * torch.randn(shape, generator=gen)).to(device, dtype).requires_grad_()
    up = torch.randn(shape, generator=gen).to(device, dtype).requires_grad_()
    out = pk.get_kernel(name)(gate, up)
    g64, u64 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    ref = _ref(name, g64, u64)
    tol = tolerance(dtype, "elementwise")
    assert out.dtype == dtype and out.is_contiguous()
    assert_close(out, ref, tol, "out")
    dy = torch.randn(shape, generator=gen).to(device, dtype)
    dg, du = torch.autograd.grad(out, (gate, up), dy)
    dg64, du64 = torch.autograd.grad(ref, (g64, u64), dy.double())
    assert_close(du, du64, tol, "dup")
    # dgate's terms grow as |gate|^3 for geglu (see conformance/_glu_suite.py).
    from portable_kernels.conformance import _glu_suite
    from portable_kernels.conformance.harness import Inputs

    assert_close(dg, dg64, _glu_suite.tolerance_for(tol, "dgate", dg64, Inputs((gate, up)), [dy]), "dgate")


@pytest.mark.parametrize("name", FAMILIES)
def test_fused_gate_up_reads_in_place_and_returns_one_gradient(name, gen, device, nan_empty):
    """One (B, S, 2I) projection, gate first: the same result as its two halves, and one
    (B, S, 2I) gradient whose halves are dgate and dup."""
    gu = (2 * torch.randn(2, 9, 140, generator=gen)).to(device).requires_grad_()
    out = pk.get_kernel(name)(gu)
    assert out.shape == (2, 9, 70)
    gate, up = gu.detach()[..., :70], gu.detach()[..., 70:]
    assert torch.equal(out, pk.get_kernel(name)(gate, up))
    dy = torch.randn(out.shape, generator=gen).to(device)
    (dgu,) = torch.autograd.grad(out, (gu,), dy)
    g2, u2 = gate.clone().requires_grad_(), up.clone().requires_grad_()
    dg, du = torch.autograd.grad(pk.get_kernel(name)(g2, u2), (g2, u2), dy)
    assert dgu.shape == gu.shape
    assert torch.equal(dgu[..., :70], dg) and torch.equal(dgu[..., 70:], du)


@pytest.mark.parametrize("name", FAMILIES)
def test_strided_views(name, gen, device):
    gate = torch.randn(40, 24, generator=gen).to(device).t()           # column stride 24
    up = torch.randn(24, 80, generator=gen).to(device)[:, ::2]          # column stride 2
    out = pk.get_kernel(name)(gate, up)
    assert_close(out, _ref(name, gate, up), tolerance(torch.float32, "elementwise"), "out")


def test_empty(device):
    for shape in ((0, 8), (4, 0)):
        out = pk.get_kernel("swiglu")(torch.empty(shape, device=device), torch.empty(shape, device=device))
        assert out.shape == shape


@pytest.mark.parametrize("args, match", [
    (lambda d: (torch.randn(3, 8, device=d), torch.randn(3, 9, device=d)), "swiglu: .*shape"),
    (lambda d: (torch.randn(3, 7, device=d),), "swiglu: a fused gate-up tensor needs an even last dimension"),
    (lambda d: (torch.randn(3, 8, device=d), torch.randn(3, 8, device=d).half()), "swiglu"),
    (lambda d: (torch.ones(3, 8, dtype=torch.int32, device=d),), "swiglu: gate"),
    (lambda d: (torch.tensor(1.0, device=d),), "swiglu: gate must have at least one dimension"),
])
def test_errors_name_the_argument(args, match, device):
    with pytest.raises(pk.PortableKernelsError, match=match):
        pk.get_kernel("swiglu")(*args(device))
