"""add_rms_norm against float64 and against the unfused add and rms_norm: both outputs,
the three gradients, one-chunk and chunked rows, strided inputs, poisoned outputs, and
errors that name the argument."""
from __future__ import annotations

import pytest
import torch

import portable_kernels as pk
from portable_kernels.conformance.harness import Inputs
from portable_kernels.conformance.test_add_rms_norm import tolerance_for
from portable_kernels.kernels.add_rms_norm import reference
from portable_kernels.testing import assert_close, tolerance

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (7, 13, 37): tails, rows in one chunk (read once); (5, 2500): rows in several of the
# interpreter's 1024-wide chunks; (3, 700, 37): more row tiles than partial rows.
SHAPES = [(7, 13, 37), (5, 2500), (3, 700, 37)]


def add_rms_norm(*args, **kwargs):
    return pk.get_kernel("add_rms_norm")(*args, **kwargs)


def _inputs(shape, gen, device, dtype, w_mean=1.0):
    x = (2 * torch.randn(shape, generator=gen) + 0.5).to(device, dtype)
    r = (2 * torch.randn(shape, generator=gen)).to(device, dtype)
    w = (w_mean + 0.5 * torch.randn(shape[-1], generator=gen)).to(device, dtype)
    return x, r, w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=["one-chunk", "chunked", "shared-lock"])
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["plain", "gemma"])
def test_forward_and_backward(shape, dtype, offset, gen, device, nan_empty):
    x, r, w = _inputs(shape, gen, device, dtype, w_mean=1.0 - offset)
    leaves = [t.detach().requires_grad_() for t in (x, r, w)]
    out, summed = add_rms_norm(*leaves, 1e-6, offset)
    for t in (out, summed):
        assert t.dtype == dtype and t.shape == x.shape and t.is_contiguous()
    leaves64 = [t.double().requires_grad_() for t in (x, r, w)]
    refs = reference(*leaves64, 1e-6, offset)
    tol = tolerance(dtype, "reduction")
    assert_close(out, refs[0], tol, "out")
    assert_close(summed, refs[1], tolerance(dtype, "elementwise"), "new_residual")

    grads = [torch.randn(shape, generator=gen).to(device, dtype) for _ in range(2)]
    got = torch.autograd.grad((out, summed), leaves, grads)
    want = torch.autograd.grad(refs, leaves64, [g.double() for g in grads])
    inputs = Inputs((x, r, w), {"eps": 1e-6, "offset": offset})
    for name, g, ref in zip(("dx", "dresidual", "dweight"), got, want):
        assert_close(g, ref, tolerance_for(tol, name, ref, inputs, grads), name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES[:2], ids=["one-chunk", "chunked"])
def test_is_the_unfused_add_then_rms_norm(shape, dtype, gen, device):
    """The sum is torch's ``x + residual`` in x's dtype, and the norm is rms_norm's of it,
    bit for bit (the same fp32 operations, read once instead of streamed). bf16 is left
    out: the interpreter rounds its downcasts toward zero, torch to nearest."""
    x, r, w = _inputs(shape, gen, device, dtype)
    out, summed = add_rms_norm(x, r, w, 1e-5, 0.5)
    assert torch.equal(summed, x + r)
    assert torch.equal(out, pk.get_kernel("rms_norm")(x + r, w, 1e-5, 0.5))


def test_gradient_through_either_output(gen, device):
    """The backward takes the new residual's gradient (added inside the kernel), also when
    only one output is used; x and residual get the same gradient."""
    x, r, w = (t.requires_grad_() for t in _inputs((6, 40), gen, device, torch.float32))
    out, summed = add_rms_norm(x, r, w)
    x64, r64, w64 = (t.detach().double().requires_grad_() for t in (x, r, w))
    ref_out, ref_summed = reference(x64, r64, w64)
    tol = tolerance(torch.float32, "reduction")

    # Through out alone: the new residual's gradient is zero.
    dx, dr, dw = torch.autograd.grad(out.sum(), (x, r, w), retain_graph=True)
    ref_dx, ref_dw = torch.autograd.grad(ref_out.sum(), (x64, w64), retain_graph=True)
    assert torch.equal(dx, dr)
    grads = [torch.ones_like(x), torch.zeros_like(x)]
    inputs = Inputs((x, r, w), {"eps": 1e-6, "offset": 0.0})
    assert_close(dx, ref_dx, tolerance_for(tol, "dx", ref_dx, inputs, grads), "dx")
    assert_close(dw, ref_dw, tolerance_for(tol, "dweight", ref_dw, inputs, grads), "dweight")

    # Through the new residual alone: d(sum of squares) = 2 (x + residual), no weight grad.
    dx, dr, dw = torch.autograd.grad(summed.square().sum(), (x, r, w), allow_unused=True)
    assert_close(dx, 2 * (x64 + r64).detach(), tolerance(torch.float32, "elementwise"), "dx")
    assert torch.equal(dx, dr) and (dw is None or not dw.any())


def test_strided_inputs_and_every_element_written(gen, device, nan_empty):
    x = torch.randn(40, 24, generator=gen).to(device).t()            # column stride 24
    r = torch.randn(24, 80, generator=gen).to(device)[:, ::2]         # column stride 2
    w = (1 + torch.randn(40, generator=gen)).to(device)
    out, summed = add_rms_norm(x, r, w)
    assert not out.isnan().any() and not summed.isnan().any()
    assert_close(out, reference(x, r, w)[0], tolerance(torch.float32, "reduction"), "out")
    assert torch.equal(summed, x + r)


def test_empty_rows_and_columns(device):
    for shape in ((0, 5), (4, 0)):
        x = torch.empty(shape, device=device)
        out, summed = add_rms_norm(x, x, torch.ones(shape[-1], device=device))
        assert out.shape == shape and summed.shape == shape


@pytest.mark.parametrize("call, match", [
    (lambda x, r, w: add_rms_norm(x, r[:, :-1], w), r"add_rms_norm: shapes must match, got x \(3, 8\), residual \(3, 7\)"),
    (lambda x, r, w: add_rms_norm(x, r[:2], w), r"add_rms_norm: shapes must match"),
    (lambda x, r, w: add_rms_norm(x, r, w[:-1]), r"add_rms_norm: weight must have shape \(8,\)"),
    (lambda x, r, w: add_rms_norm(x, r.half(), w), r"add_rms_norm: dtypes must match.*residual is float16"),
    (lambda x, r, w: add_rms_norm(x, r, w.half()), r"add_rms_norm: dtypes must match.*weight is float16"),
    (lambda x, r, w: add_rms_norm(x, r, w, "1e-6"), "add_rms_norm: eps must be a float, got str"),
    (lambda x, r, w: add_rms_norm(x, r, w, -1.0), "add_rms_norm: eps must be finite and >= 0"),
    (lambda x, r, w: add_rms_norm(x, r, w, 1e-6, float("inf")), "add_rms_norm: offset must be finite"),
    (lambda x, r, w: add_rms_norm(x.int(), r.int(), w.int()), "add_rms_norm: x has dtype int32"),
    (lambda x, r, w: add_rms_norm(x, r.tolist(), w), "add_rms_norm: residual must be a torch.Tensor"),
])
def test_errors_name_the_argument(call, match, device):
    x, r, w = torch.randn(3, 8, device=device), torch.randn(3, 8, device=device), torch.ones(8, device=device)
    with pytest.raises(pk.PortableKernelsError, match=match):
        call(x, r, w)
