"""vector_add: ``out = x + y`` elementwise, the smallest kernel through the whole stack.

One program adds ``BLOCK_SIZE`` consecutive elements; the mask covers the tail of the last
block. Values are added in fp32 and rounded once to the output dtype: that is what torch
does for fp16/bf16, and it sidesteps the interpreter's raw-bits bf16 arithmetic.

Constexpr switches: none. Config: ``BLOCK_SIZE`` and ``num_warps`` (from the backend).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..registry import KernelSpec, Variant
from . import _host

NAME = "vector_add"


# --- kernel ---------------------------------------------------------------------------------

@triton.jit
def _vector_add_kernel(
    x_ptr, y_ptr, out_ptr,  # pointers to contiguous tensors
    n_elements,             # size
    BLOCK_SIZE: tl.constexpr,
):
    pid = tl.program_id(0)
    # int64 so tensors past 2**31 elements index correctly.
    offsets = pid.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    y = tl.load(y_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(out_ptr + offsets, (x + y).to(out_ptr.dtype.element_ty), mask=mask)


# --- host launcher --------------------------------------------------------------------------

class Problem(NamedTuple):
    device: torch.device
    dtype: torch.dtype


def problem(x, y) -> Problem:
    """Selection key of a ``vector_add(x, y)`` call."""
    return Problem(_host.same_device(NAME, x=x, y=y), x.dtype)


def launch(plan, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x + y`` for two tensors of one shape and float dtype (fp16, bf16, fp32).

    Non-contiguous inputs are copied to contiguous ones first (a documented copy: an
    elementwise kernel gains nothing from strided loads). Returns a new contiguous tensor.
    """
    if not (x.dtype in _host.FLOAT_DTYPES and y.dtype is x.dtype and y.shape == x.shape):
        # The checks that name what is wrong, off the common path (each costs host time).
        _host.check_dtype(NAME, "x", x)
        _host.check_dtype(NAME, "y", y)
        _host.check_same_dtype(NAME, x=x, y=y)
        _host.check_same_shape(NAME, x=x, y=y)
    x, y = x.contiguous(), y.contiguous()
    out = torch.empty_like(x)
    n = out.numel()
    if n == 0:
        return out
    grid, meta = _host.elementwise_launch(plan, n)
    plan.direct(_vector_add_kernel)[grid](x, y, out, n, **meta)
    return out


# --- reference ------------------------------------------------------------------------------

def reference(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x + y`` in float64."""
    return x.double() + y.double()


def inputs(shape: str, dtype: torch.dtype, device) -> tuple:
    """Random ``(x, y)`` of ``N`` elements (shape string ``"N"``)."""
    (n,) = _host.parse_shape(NAME, shape, "N")
    return (torch.randn(n, device=device).to(dtype), torch.randn(n, device=device).to(dtype)), {}


def register(registry) -> None:
    registry.add_kernel(KernelSpec(
        NAME, "(x, y) -> out", problem, "elementwise x + y, same shape, any size", reference,
        inputs, "N"))
    registry.add_variant(Variant(
        NAME, "generic", launch, accepts=_host.dtype_supported, configs=_host.elementwise_configs,
        description="pointer loads with a tail mask", replay=True))
