"""softmax: ``out = softmax(x, dim)`` row by row, any row length, computed in fp32.

One program per row. The row is read through its strides, so non-contiguous inputs (a
transposed view, a slice) need no copy when their leading dimensions collapse to one.

Constexpr switches:
    ONE_PASS: the whole row fits in one block of ``BLOCK_N`` columns: load it once, take
        max and sum in registers, store. Chosen per call by the launcher.
    Otherwise the row is streamed twice: pass 1 keeps a per-lane running max and a per-lane
    sum rescaled whenever the max grows (an online softmax with the lane-to-row reduction
    deferred until after the loop), pass 2 writes ``exp(x - max) / sum``.

Config: ``MAX_BLOCK_N`` (the widest block a program handles in registers) and ``num_warps``.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..registry import KernelSpec, Variant
from . import _host

NAME = "softmax"


# --- kernel ---------------------------------------------------------------------------------

@triton.jit
def _softmax_kernel(
    out_ptr, in_ptr,                      # pointers
    n_cols,                               # row length
    in_row_stride, in_col_stride,         # input strides (elements)
    out_row_stride,                       # output rows are contiguous
    BLOCK_N: tl.constexpr,
    ONE_PASS: tl.constexpr,
):
    # --- program id to row ---
    row = tl.program_id(0).to(tl.int64)
    in_row = in_ptr + row * in_row_stride
    out_row = out_ptr + row * out_row_stride
    # int64 columns: in a transposed view (softmax over dim 0) the column stride is a row
    # length, and column times stride passes 2**31 elements in large inputs.
    cols = tl.arange(0, BLOCK_N).to(tl.int64)

    if ONE_PASS:
        mask = cols < n_cols
        # -inf in the masked lanes: they add exp(-inf) = 0 to the sum and never win the max.
        x = tl.load(in_row + cols * in_col_stride, mask=mask, other=float("-inf")).to(tl.float32)
        e = tl.exp(x - tl.max(x, axis=0))
        tl.store(out_row + cols, (e / tl.sum(e, axis=0)).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # --- pass 1: per-lane running max and rescaled sum ---
        m = tl.full([BLOCK_N], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK_N], tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            x = tl.load(in_row + c * in_col_stride, mask=c < n_cols, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, x)
            # A lane that has seen only -inf keeps m_new = -inf; subtracting it would give
            # exp(-inf - -inf) = NaN, so such lanes subtract 0 and keep a zero sum.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp(m - m_safe) + tl.exp(x - m_safe)
            m = m_new
        # --- reduce lanes to the row once, after the loop ---
        m_row = tl.max(m, axis=0)
        s_row = tl.sum(s * tl.exp(m - m_row), axis=0)
        # --- pass 2: write normalized values ---
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            mask = c < n_cols
            x = tl.load(in_row + c * in_col_stride, mask=mask, other=float("-inf")).to(tl.float32)
            y = tl.exp(x - m_row) / s_row
            tl.store(out_row + c, y.to(out_ptr.dtype.element_ty), mask=mask)


# --- host launcher --------------------------------------------------------------------------

class Problem(NamedTuple):
    device: torch.device
    dtype: torch.dtype


def problem(x, dim: int = -1) -> Problem:
    """Selection key of a ``softmax(x, dim)`` call."""
    device = _host.tensor_device(NAME, "x", x)
    _host.check_int(NAME, "dim", dim)
    return Problem(device, x.dtype)


def launch(plan, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax of ``x`` along ``dim`` (any shape with at least one dimension; fp16, bf16,
    fp32 in and out, computed in fp32). Returns a tensor of ``x``'s shape and dtype."""
    _host.check_dtype(NAME, "x", x)
    if x.dim() == 0:
        raise _host.InputError(f"{NAME}: x must have at least one dimension, got a scalar")
    if not -x.dim() <= dim < x.dim():
        raise _host.InputError(f"{NAME}: dim {dim} is out of range for a {x.dim()}-D tensor")
    # Each view op costs a microsecond or two of host time, as much as the rest of a small
    # call: a 2-D softmax over its last dimension takes none.
    last = dim == -1 or dim == x.dim() - 1
    moved = x if last else x.movedim(dim, -1)
    if moved.numel() == 0:  # no rows or no columns (reshape(-1, 0) is ambiguous)
        out = torch.empty(moved.shape, dtype=x.dtype, device=x.device)
        return out if last else out.movedim(-1, dim)
    n_cols = moved.shape[-1]
    # A view when the leading dims collapse, else a copy.
    rows = moved if moved.dim() == 2 else moved.reshape(-1, n_cols)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    cfg = plan.config
    block = min(_host.next_power_of_2(n_cols), cfg.kwargs["MAX_BLOCK_N"])
    # Roughly 8 fp32 values per thread: fewer warps for short rows, the config's cap for long.
    num_warps = max(1, min(cfg.num_warps, block // 256))
    plan.direct(_softmax_kernel)[(rows.shape[0],)](
        out, rows, n_cols, rows.stride(0), rows.stride(1), out.stride(0),
        BLOCK_N=block, ONE_PASS=n_cols <= block, num_warps=num_warps, **plan.switches,
    )
    if moved.dim() != 2:
        out = out.view(moved.shape)
    return out if last else out.movedim(-1, dim)


# --- reference ------------------------------------------------------------------------------

def reference(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax in float64."""
    return torch.softmax(x.double(), dim=dim)


def inputs(shape: str, dtype: torch.dtype, device) -> tuple:
    """A random ``(R, C)`` input (shape string ``"RxC"``), softmax over C."""
    rows, cols = _host.parse_shape(NAME, shape, "RxC")
    return (torch.randn(rows, cols, device=device).to(dtype),), {}


def default_configs(device) -> list:
    return [triton.Config({"MAX_BLOCK_N": 4096}, num_warps=8)]


def register(registry) -> None:
    registry.add_kernel(KernelSpec(
        NAME, "(x, dim=-1) -> out", problem, "softmax along a dimension, any row length",
        reference, inputs, "RxC"))
    registry.add_variant(Variant(
        NAME, "generic", launch, accepts=_host.dtype_supported, configs=default_configs,
        replay=True, description="one program per row; one pass when the row fits a block, else an "
        "online two-pass"))
