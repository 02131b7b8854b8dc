"""add_rms_norm: the residual add and the RMS norm of a pre-norm block in one pass.

    new_residual = x + residual                       (in x's dtype, as transformers adds)
    out = rms_norm(new_residual, weight, eps, offset)

The norm reads the sum rounded to x's dtype, so both outputs are what the unfused
``residual = x + residual; out = norm(residual)`` of a bf16 or fp16 model computes. It runs
``layer_norm``'s kernels with their ``RMS`` and ``ADD`` switches on: a row that fits one
column chunk (``MAX_BLOCK_N``, the usual hidden sizes) is read once from x and once from
residual and written once to each output (``ONE_CHUNK``); longer rows stream their chunks
twice, as rms_norm's passes. The backward is rms_norm's, over the new residual, with the
new residual's own gradient added to dx inside the kernel:

    dx = dresidual = rms_norm_backward(dout) + dnew_residual
    dweight = sum over rows of dout * new_residual * rstd

Configs are layer_norm's (``MAX_BLOCK_N``, ``TILE``, ``GROUPS``).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .. import _replay
from ..registry import KernelSpec, Variant
from . import _host, layer_norm, rms_norm

NAME = "add_rms_norm"


class Problem(NamedTuple):
    device: torch.device
    dtype: torch.dtype


def problem(x, residual, weight, eps=1e-6, offset=0.0) -> Problem:
    """Selection key of an ``add_rms_norm(x, residual, weight, eps, offset)`` call."""
    return Problem(_host.same_device(NAME, x=x, residual=residual, weight=weight), x.dtype)


def _check(x, residual, weight, eps, offset) -> None:
    _host.same_device(NAME, x=x, residual=residual, weight=weight)
    _host.check_dtype(NAME, "x", x)
    _host.check_same_dtype(NAME, x=x, residual=residual, weight=weight)
    _host.check_same_shape(NAME, x=x, residual=residual)
    rms_norm._check(x, weight, eps, offset, NAME)


def _forward(plan, x, residual, weight, eps, offset, stats: bool = True):
    """(out, new_residual as (M, N), rstd); ``rstd`` None without ``stats``."""
    out, summed, _, rstd = layer_norm._forward(plan, x, weight, None, eps, offset, residual,
                                               stats=stats)
    return out, summed, rstd


def _backward(plan, dy, dres, summed, weight, rstd, offset):
    """(dx as (M, N), dweight) for the gradients ``dy`` of out and ``dres`` of the new
    residual (M, N each); ``summed`` is the new residual (M, N)."""
    dx, dw, _ = layer_norm._backward(plan, dy, summed, weight, rstd, rstd, rms=True,
                                     offset=offset, dres=dres)
    return dx, dw


def launch(plan, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
           eps: float = 1e-6, offset: float = 0.0):
    """``(out, new_residual)``: ``new_residual = x + residual`` and its RMS norm over the
    last dimension times ``weight + offset``.

    ``x`` and ``residual`` (..., N) of one shape and dtype (fp16, bf16, fp32), ``weight``
    (N,) of that dtype. The sum is rounded to that dtype and the norm computed from it in
    fp32. Both outputs are new contiguous tensors of x's shape and dtype. Differentiable
    in ``x``, ``residual`` and ``weight`` (through both outputs).
    """
    _check(x, residual, weight, eps, offset)
    if torch.is_grad_enabled() and (x.requires_grad or residual.requires_grad
                                    or weight.requires_grad):
        return _AddRMSNormFunction.call(x, residual, weight, eps, offset, plan)
    out, summed, _ = _forward(plan, x, residual, weight.contiguous(), eps, offset, stats=False)
    return out, _host.as_shape(summed, x.shape)


class _AddRMSNormFunction(_host.Function):
    """Saves the new residual (as rows), weight and the per-row 1/rms."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, offset, plan):
        weight = weight.contiguous()
        out, summed, rstd = _replay.stage(plan, _forward, (), x, residual, weight, eps, offset)
        ctx.save_for_backward(summed, weight, rstd)
        ctx.plan, ctx.offset = plan, offset
        return out, _host.as_shape(summed, x.shape)

    @staticmethod
    def backward(ctx, grad_out, grad_res):
        summed, weight, rstd = ctx.saved_tensors
        with _host.launching(grad_out.device):
            dx, dw = _replay.stage(ctx.plan, _backward, (), _host.as_shape(grad_out, summed.shape),
                                   _host.as_shape(grad_res, summed.shape), summed, weight, rstd, ctx.offset)
        dx = _host.as_shape(dx, grad_out.shape)
        return dx, dx, dw, None, None, None


def reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
              offset: float = 0.0):
    """``(out, new_residual)`` in float64, the sum rounded to x's dtype first as the kernel
    does (differentiable, for gradient references: float64 inputs round nothing)."""
    summed = (x.double() + residual.double()).to(x.dtype).double()
    return rms_norm.reference(summed, weight, eps, offset), summed


def inputs(shape: str, dtype: torch.dtype, device) -> tuple:
    """Random ``x``, ``residual`` (M, N) and ``weight`` (N,) (shape string ``"MxN"``)."""
    rows, cols = _host.parse_shape(NAME, shape, "MxN")
    x = torch.randn(rows, cols, device=device).to(dtype)
    residual = torch.randn(rows, cols, device=device).to(dtype)
    weight = (1 + 0.1 * torch.randn(cols, device=device)).to(dtype)
    return (x, residual, weight), {}


def register(registry) -> None:
    registry.add_kernel(KernelSpec(
        NAME, "(x, residual, weight, eps=1e-6, offset=0.0) -> (out, new_residual)", problem,
        "residual add then RMS norm in one pass (sum in x's dtype, fp32 statistics); "
        "differentiable", reference, inputs, "MxN"))
    registry.add_variant(Variant(
        NAME, "generic", launch, accepts=_host.dtype_supported,
        configs=layer_norm.default_configs,
        replay=True, description="layer_norm's kernels with RMS and ADD on: rows that fit one chunk read "
        "once; the new residual's gradient added inside the dx kernel"))
