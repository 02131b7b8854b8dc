"""rms_norm: ``out = x / sqrt(mean(x**2) + eps) * (weight + offset)`` over the last dim.

The normalization of Llama, Mistral, Qwen and Gemma (``offset=1.0``: Gemma's ``(1 + w)``
with weights stored zero-centred). Statistics in fp32. It runs ``layer_norm``'s kernels
with their ``RMS`` switch on (one kernel source for both norms): the forward skips the
mean pass and the bias, stores 1/rms per row; the backward, with ``xhat = x * rstd`` and
``g = dy * (weight + offset)``,

    dx = (g - xhat * mean(g * xhat)) * rstd          (per row)
    dweight = sum over rows of dy * xhat

with the column sums folded into a few partial rows under spin locks, as layer_norm's.
Configs are layer_norm's (``MAX_BLOCK_N``, ``TILE``, ``GROUPS``).
"""
from __future__ import annotations

import numbers
from typing import NamedTuple

import torch

from .. import _replay
from ..registry import KernelSpec, Variant
from . import _host, layer_norm

NAME = "rms_norm"


class Problem(NamedTuple):
    device: torch.device
    dtype: torch.dtype


def problem(x, weight, eps=1e-6, offset=0.0) -> Problem:
    """Selection key of a ``rms_norm(x, weight, eps, offset)`` call."""
    return Problem(_host.tensor_device(NAME, "x", x), x.dtype)


_INF = float("inf")


def _check(x, weight, eps, offset, name: str = NAME) -> None:
    """Errors named for ``name`` (add_rms_norm checks its norm's arguments here too)."""
    # The common valid call passes one inline test (layer_norm._check says why).
    try:
        dtype = x.dtype
        if (type(eps) is float and 0.0 <= eps < _INF and type(offset) is float
                and -_INF < offset < _INF and dtype in _host.FLOAT_DTYPES
                and weight.dtype is dtype and weight.shape == (x.shape[-1],)
                and weight.device == x.device):
            return
    except (AttributeError, IndexError):
        pass
    _host.same_device(name, x=x, weight=weight)
    _host.check_dtype(name, "x", x)
    _host.check_same_dtype(name, x=x, weight=weight)
    if x.dim() == 0:
        raise _host.InputError(f"{name}: x must have at least one dimension, got a scalar")
    n = x.shape[-1]
    if tuple(weight.shape) != (n,):
        raise _host.InputError(f"{name}: weight must have shape ({n},) (x's last dimension), "
                               f"got {tuple(weight.shape)}")
    for arg, value in (("eps", eps), ("offset", offset)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise _host.ArgumentError(f"{name}: {arg} must be a float, got {type(value).__name__}")
    if not 0.0 <= eps < float("inf"):  # also rejects NaN
        raise _host.InputError(f"{name}: eps must be finite and >= 0, got eps={eps}")
    if offset != offset or abs(offset) == float("inf"):
        raise _host.InputError(f"{name}: offset must be finite, got offset={offset}")


def _forward(plan, x, weight, eps, offset, stats: bool = True):
    """(y, rows, rstd): ``rows`` is ``x`` as (M, N); ``rstd`` None without ``stats``."""
    y, rows, _, rstd = layer_norm._forward(plan, x, weight, None, eps, offset, stats=stats)
    return y, rows, rstd


def _backward(plan, dy, rows, weight, rstd, offset):
    """(dx as (M, N), dweight) for the upstream gradient ``dy`` (M, N)."""
    dx, dw, _ = layer_norm._backward(plan, dy, rows, weight, rstd, rstd, rms=True, offset=offset)
    return dx, dw


def launch(plan, x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
           offset: float = 0.0) -> torch.Tensor:
    """RMS norm of ``x`` (..., N) over its last dimension, times ``weight + offset``.

    ``weight`` has shape (N,) and ``x``'s dtype (fp16, bf16 or fp32) and device; the mean
    square and the scaling are computed in fp32. Returns a new contiguous tensor of ``x``'s
    shape and dtype. Differentiable in ``x`` and ``weight``.
    """
    _check(x, weight, eps, offset)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNormFunction.call(x, weight, eps, offset, plan)
    return _forward(plan, x, weight.contiguous(), eps, offset, stats=False)[0]


class _RMSNormFunction(_host.Function):
    """Saves x (as rows), weight and the per-row 1/rms."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset, plan):
        weight = weight.contiguous()
        y, rows, rstd = _replay.stage(plan, _forward, (), x, weight, eps, offset)
        ctx.save_for_backward(rows, weight, rstd)
        ctx.plan, ctx.offset = plan, offset
        return y

    @staticmethod
    def backward(ctx, grad_out):
        rows, weight, rstd = ctx.saved_tensors
        with _host.launching(grad_out.device):
            dx, dw = _replay.stage(ctx.plan, _backward, (), _host.as_shape(grad_out, rows.shape), rows,
                                   weight, rstd, ctx.offset)
        return _host.as_shape(dx, grad_out.shape), dw, None, None, None


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
              offset: float = 0.0) -> torch.Tensor:
    """RMS norm in float64 (differentiable, for gradient references)."""
    x64 = x.double()
    rstd = torch.rsqrt(x64.square().mean(-1, keepdim=True) + eps)
    return x64 * rstd * (weight.double() + offset)


def inputs(shape: str, dtype: torch.dtype, device) -> tuple:
    """Random ``x`` (M, N) and ``weight`` (N,) (shape string ``"MxN"``)."""
    rows, cols = _host.parse_shape(NAME, shape, "MxN")
    x = torch.randn(rows, cols, device=device).to(dtype)
    weight = (1 + 0.1 * torch.randn(cols, device=device)).to(dtype)
    return (x, weight), {}


def register(registry) -> None:
    registry.add_kernel(KernelSpec(
        NAME, "(x, weight, eps=1e-6, offset=0.0) -> out", problem,
        "RMS norm over the last dim (Gemma's 1 + w with offset=1), fp32 statistics; "
        "differentiable", reference, inputs, "MxN"))
    registry.add_variant(Variant(
        NAME, "generic", launch, accepts=_host.dtype_supported,
        configs=layer_norm.default_configs,
        replay=True, description="layer_norm's kernels with RMS on: no mean pass, no bias; backward "
        "dweight partials under an atomic_cas spin lock"))
