"""rms_norm against torch in float64: forward, gradients (dx, dweight), Gemma's offset,
strided inputs, poisoned outputs, and errors that name the argument."""
from __future__ import annotations

import pytest
import torch

import portable_kernels as pk
from portable_kernels.conformance.harness import Inputs
from portable_kernels.conformance.test_rms_norm import tolerance_for
from portable_kernels.kernels.rms_norm import reference
from portable_kernels.testing import assert_close, tolerance

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (1, 1): a one-element row; (7, 13, 37): tails in every dimension; (5, 2500): rows longer
# than the interpreter's 1024-wide chunk; (3, 1700, 37): more row tiles than partial rows.
SHAPES = [(1, 1), (7, 13, 37), (5, 2500), (3, 1700, 37)]


def rms_norm(*args, **kwargs):
    return pk.get_kernel("rms_norm")(*args, **kwargs)


def _inputs(shape, gen, device, dtype, w_mean=1.0):
    x = (2 * torch.randn(shape, generator=gen) + 0.5).to(device, dtype)
    w = (w_mean + 0.5 * torch.randn(shape[-1], generator=gen)).to(device, dtype)
    return x, w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=["1x1", "odd-3d", "multi-chunk", "shared-lock"])
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["plain", "gemma"])
def test_forward_and_backward(shape, dtype, offset, gen, device):
    x, w = _inputs(shape, gen, device, dtype, w_mean=1.0 - offset)
    xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
    out = rms_norm(xl, wl, 1e-6, offset)
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    ref = reference(x64, w64, 1e-6, offset)
    tol = tolerance(dtype, "reduction")
    assert_close(out, ref, tol, "out")

    dy = torch.randn(shape, generator=gen).to(device, dtype)
    dx, dw = torch.autograd.grad(out, (xl, wl), dy)
    dx64, dw64 = torch.autograd.grad(ref, (x64, w64), dy.double())
    inputs = Inputs((x, w), {"eps": 1e-6, "offset": offset})
    assert_close(dx, dx64, tolerance_for(tol, "dx", dx64, inputs, [dy]), "dx")
    assert_close(dw, dw64, tolerance_for(tol, "dweight", dw64, inputs, [dy]), "dweight")


def test_matches_torch_rms_norm(gen, device):
    x, w = _inputs((6, 300), gen, device, torch.float32)
    expected = torch.nn.functional.rms_norm(x.double(), (300,), w.double(), eps=1e-5)
    assert_close(rms_norm(x, w, 1e-5), expected, tolerance(torch.float32, "reduction"), "out")


def test_strided_input_and_every_element_written(gen, device, nan_empty):
    """A transposed view (column stride), outputs allocated NaN-filled: none may remain."""
    x, _ = _inputs((40, 24), gen, device, torch.float32)
    xt, w = x.t(), (1 + torch.randn(40, generator=gen)).to(device)
    out = rms_norm(xt, w)
    assert not out.isnan().any()
    assert_close(out, reference(xt, w), tolerance(torch.float32, "reduction"), "out")


def test_empty_rows_and_columns(device):
    for shape in ((0, 5), (4, 0)):
        x = torch.empty(shape, device=device)
        out = rms_norm(x, torch.ones(shape[-1], device=device))
        assert out.shape == shape


@pytest.mark.parametrize("call, match", [
    (lambda x, w: rms_norm(x, w[:-1]), r"rms_norm: weight must have shape \(8,\)"),
    (lambda x, w: rms_norm(x, w.half()), "rms_norm"),
    (lambda x, w: rms_norm(x, w, "1e-6"), "rms_norm: eps must be a float, got str"),
    (lambda x, w: rms_norm(x, w, -1.0), "rms_norm: eps must be finite and >= 0"),
    (lambda x, w: rms_norm(x, w, 1e-6, float("nan")), "rms_norm: offset must be finite"),
    (lambda x, w: rms_norm(x.int(), w.int()), "rms_norm"),
])
def test_errors_name_the_argument(call, match, device):
    x, w = torch.randn(3, 8, device=device), torch.ones(8, device=device)
    with pytest.raises(pk.PortableKernelsError, match=match):
        call(x, w)
