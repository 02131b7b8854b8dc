"""layer_norm: ``out = (x - mean) / sqrt(var + eps) * weight + bias`` over the last dim.

``x`` is viewed as ``(M, N)`` rows (every leading dimension folded into M). Each program
normalizes a tile of ``BLOCK_M`` rows, streaming the columns in ``BLOCK_N``-wide chunks, so
any row length works; short rows get several per program instead of idle lanes. Mean and
variance are taken in fp32 in two passes (the variance about the mean, not E[x^2] -
E[x]^2, which cancels catastrophically for rows with a large mean). The forward also
stores each row's mean and 1/std (fp32) for the backward.

Backward (as Triton's tutorial 05): with ``xhat = (x - mean) * rstd`` and ``g = dy *
weight``,

    dx = (g - (xhat * mean(g * xhat) + mean(g))) * rstd          (per row)
    dweight = sum over rows of dy * xhat,  dbias = sum over rows of dy

Rows that fit one chunk (up to ``MAX_BLOCK_N`` columns: every LLM hidden size the tables
serve) take the dx kernel's ``ONE_CHUNK`` path, which reads x and dy once and writes dx
once: a few programs per multiprocessor, each holding a whole row tile in registers,
keeping its column sums of ``dy * xhat`` and ``dy`` in registers across its tiles and
writing them once to a partial row of its own (no locks), which the dwdb kernel adds up.
Longer rows stream their chunks twice (the row means first, then dx):
``_layer_norm_bwd_dx_kernel`` writes dx and folds its tile's column sums of ``dy * xhat``
and ``dy`` into one of ``G`` partial rows, chosen by program id modulo G, under a spin lock
per partial row (``tl.atomic_cas`` to take it, ``tl.atomic_xchg`` to release). G is far
below the number of programs, so ``_layer_norm_bwd_dwdb_kernel`` has only G rows to add
into dweight and dbias, while spreading programs over G locks keeps them from queueing on
one. A row longer than one chunk updates its partial row chunk by chunk, so the lock is
taken per chunk and the partial rows start at zero (instead of the tutorial's first-writer
flag, which would be needed per chunk). Under Triton's interpreter programs run one at a
time, so the lock is never contended and never waits on a later program.

Constexpr switches: ``RMS`` (rms_norm.py: no mean, no bias), ``ADD`` (add_rms_norm.py:
the norm of ``x + residual``, which the forward also stores, and in the backward the new
residual's gradient added to dx) and ``ONE_CHUNK`` (a row that fits one chunk is read once
and kept in registers, in the forward and in the backward; every norm takes it). Config:
``MAX_BLOCK_N`` (widest column chunk), ``TILE`` (elements per program tile, so
``BLOCK_M = TILE // BLOCK_N`` rows),
``GROUPS`` (most partial rows for dweight/dbias of rows longer than a chunk),
``PROGRAMS_PER_SM`` (optional, default :data:`PROGRAMS_PER_SM`: the ``ONE_CHUNK``
backward's programs per multiprocessor) and ``num_warps`` (the most a program uses; small
tiles use fewer; a row wider than ``TILE`` takes :data:`WIDE_ROW_WARPS` where set).
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import _replay
from ..registry import KernelSpec, Variant
from . import _host

NAME = "layer_norm"


# --- helpers --------------------------------------------------------------------------------

@triton.jit
def _load_tile(ptr, rows, cols, row_stride, col_stride, mask):
    """A (BLOCK_M, BLOCK_N) tile in fp32; masked lanes read 0 (neutral in every sum).
    ``rows`` are int64, and so are the column offsets: a transposed view's column stride
    times its column index can pass 2**31 elements."""
    offs = rows[:, None] * row_stride + cols[None, :].to(tl.int64) * col_stride
    return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


# --- kernels --------------------------------------------------------------------------------

@triton.jit
def _load_input(x_ptr, r_ptr, s_ptr, rows, c, x_row_stride, x_col_stride, r_row_stride,
                r_col_stride, s_row_stride, mask, ADD: tl.constexpr, STORE_SUM: tl.constexpr):
    """The tile the norm reads, in fp32: ``x``, or with ``ADD`` the new residual ``x +
    residual`` rounded to the output's dtype (as transformers adds in the model's dtype and
    normalizes that sum), stored to ``s_ptr`` when ``STORE_SUM``."""
    x = _load_tile(x_ptr, rows, c, x_row_stride, x_col_stride, mask)
    if ADD:
        total = (x + _load_tile(r_ptr, rows, c, r_row_stride, r_col_stride, mask)).to(
            s_ptr.dtype.element_ty)
        if STORE_SUM:
            tl.store(s_ptr + rows[:, None] * s_row_stride + c[None, :], total, mask=mask)
        x = total.to(tl.float32)
    return x


@triton.jit
def _layer_norm_fwd_kernel(
    x_ptr, w_ptr, b_ptr,              # inputs: x (M, N) strided, weight and bias (N,)
    y_ptr, mean_ptr, rstd_ptr,        # outputs: y (M, N) contiguous rows, mean/rstd (M,) fp32
    r_ptr, s_ptr,                     # ADD: residual (M, N) strided; new residual (M, N) out
    n_rows, n_cols,                   # sizes
    x_row_stride, x_col_stride,       # x strides (elements)
    r_row_stride, r_col_stride,       # residual strides
    y_row_stride,                     # y's and the new residual's row stride
    eps,
    w_offset,                         # added to weight (rms_norm's Gemma offset; 0 here)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RMS: tl.constexpr = False,        # rms_norm: no mean, no bias (rms_norm.py)
    ADD: tl.constexpr = False,        # add_rms_norm: normalize x + residual, store the sum
    ONE_CHUNK: tl.constexpr = False,  # the row fits one BLOCK_N chunk: read it once
    STATS: tl.constexpr = True,       # store mean and rstd (a backward reads them)
):
    # --- program id to a tile of rows ---
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    cols = tl.arange(0, BLOCK_N)

    if ONE_CHUNK:
        # --- the whole row in registers: one read of the inputs, one write per output ---
        col_mask = cols < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        x = _load_input(x_ptr, r_ptr, s_ptr, rows, cols, x_row_stride, x_col_stride,
                        r_row_stride, r_col_stride, y_row_stride, mask, ADD, True)
        if RMS:
            mean = tl.zeros([BLOCK_M], dtype=tl.float32)
        else:
            mean = tl.sum(x, axis=1) / n_cols
        d = tl.where(mask, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=1) / n_cols + eps)
        if STATS:
            if not RMS:
                tl.store(mean_ptr + rows, mean, mask=row_mask)
            tl.store(rstd_ptr + rows, rstd, mask=row_mask)
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + w_offset
        y = d * rstd[:, None] * w[None, :]
        if not RMS:
            y += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rows[:, None] * y_row_stride + cols[None, :],
                 y.to(y_ptr.dtype.element_ty), mask=mask)
        return

    # --- pass 1: mean (per-lane partial sums, reduced once after the loop) ---
    if RMS:
        mean = tl.zeros([BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            mask = row_mask[:, None] & (c < n_cols)[None, :]
            acc += _load_input(x_ptr, r_ptr, s_ptr, rows, c, x_row_stride, x_col_stride,
                               r_row_stride, r_col_stride, y_row_stride, mask, ADD, False)
        mean = tl.sum(acc, axis=1) / n_cols

    # --- pass 2: variance about the mean (RMS: the mean square); ADD stores the sum ---
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        c = start + cols
        mask = row_mask[:, None] & (c < n_cols)[None, :]
        x = _load_input(x_ptr, r_ptr, s_ptr, rows, c, x_row_stride, x_col_stride,
                        r_row_stride, r_col_stride, y_row_stride, mask, ADD, True)
        # Masked lanes read 0, but 0 - mean is not 0: zero them before squaring.
        d = tl.where(mask, x - mean[:, None], 0.0)
        acc += d * d
    var = tl.sum(acc, axis=1) / n_cols
    rstd = 1.0 / tl.sqrt(var + eps)
    if STATS:
        if not RMS:
            tl.store(mean_ptr + rows, mean, mask=row_mask)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)

    # --- pass 3: normalize, scale, shift, write back ---
    # ADD sums the inputs again rather than read back the stored sum: another thread of
    # this program may have stored it, with no barrier between.
    for start in range(0, n_cols, BLOCK_N):
        c = start + cols
        col_mask = c < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        x = _load_input(x_ptr, r_ptr, s_ptr, rows, c, x_row_stride, x_col_stride,
                        r_row_stride, r_col_stride, y_row_stride, mask, ADD, False)
        w = tl.load(w_ptr + c, mask=col_mask, other=0.0).to(tl.float32) + w_offset
        y = (x - mean[:, None]) * rstd[:, None] * w[None, :]
        if not RMS:
            y += tl.load(b_ptr + c, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rows[:, None] * y_row_stride + c[None, :],
                 y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_chunk(x_ptr, dy_ptr, w_ptr, w_offset, rows, c, row_mask, n_cols, mean, rstd,
               x_row_stride, x_col_stride, dy_row_stride, dy_col_stride):
    """One column chunk of the backward's terms, in fp32: dy, xhat, g = dy * w, and the
    masks. Both passes of the dx kernel recompute these rather than keep the row around.
    Masked lanes have dy = 0, hence g = 0, whatever xhat is there."""
    col_mask = c < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    x = _load_tile(x_ptr, rows, c, x_row_stride, x_col_stride, mask)
    dy = _load_tile(dy_ptr, rows, c, dy_row_stride, dy_col_stride, mask)
    w = tl.load(w_ptr + c, mask=col_mask, other=0.0).to(tl.float32) + w_offset
    xhat = (x - mean[:, None]) * rstd[:, None]
    return dy, xhat, dy * w[None, :], col_mask, mask


@triton.jit
def _bwd_dx_rows_in_registers(
    dx_ptr, dy_ptr, x_ptr, w_ptr, dres_ptr, mean_ptr, rstd_ptr, dw_part_ptr, db_part_ptr,
    n_rows, n_cols, x_row_stride, x_col_stride, dy_row_stride, dy_col_stride,
    dres_row_stride, dres_col_stride, dx_row_stride, w_offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RMS: tl.constexpr, ADD: tl.constexpr,
):
    """The dx kernel for rows that fit one chunk (``n_cols <= BLOCK_N``), reading x and dy
    once and writing dx once: a grid of a few programs per multiprocessor, each taking the
    row tiles ``pid, pid + P, ...`` whole into registers (both row means come from the
    tile in hand) and adding their column sums of ``dy * xhat`` and ``dy`` into fp32
    accumulators it keeps across its tiles. It writes them once, to its own partial row
    ``pid`` (no lock, no zero-initialised buffer); the dwdb kernel adds the P rows up."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + w_offset
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for tile in range(pid, tl.cdiv(n_rows, BLOCK_M), n_programs):
        # Row indices fit int32; their products with strides are taken in int64.
        rows = (tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        # Rows past the end read mean = rstd = 0 and dy = 0: they add nothing.
        if RMS:
            mean = tl.zeros([BLOCK_M], dtype=tl.float32)
        else:
            mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        x = _load_tile(x_ptr, rows, cols, x_row_stride, x_col_stride, mask)
        dy = _load_tile(dy_ptr, rows, cols, dy_row_stride, dy_col_stride, mask)
        # Masked lanes: dy = 0, so g = 0 and dy * xhat = 0 whatever xhat is there.
        xhat = (x - mean[:, None]) * rstd[:, None]
        g = dy * w[None, :]
        c1 = tl.sum(g * xhat, axis=1) / n_cols
        if RMS:  # the output does not depend on a mean: no mean(g) term
            dx = (g - xhat * c1[:, None]) * rstd[:, None]
        else:
            c2 = tl.sum(g, axis=1) / n_cols
            dx = (g - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        if ADD:  # x and residual reach the output through their sum, and reach it alone too
            dx += _load_tile(dres_ptr, rows, cols, dres_row_stride, dres_col_stride, mask)
        tl.store(dx_ptr + rows[:, None] * dx_row_stride + cols[None, :],
                 dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw_acc += tl.sum(dy * xhat, axis=0)
        if not RMS:
            db_acc += tl.sum(dy, axis=0)
    part = pid.to(tl.int64) * n_cols + cols
    tl.store(dw_part_ptr + part, dw_acc, mask=col_mask)
    if not RMS:
        tl.store(db_part_ptr + part, db_acc, mask=col_mask)


@triton.jit
def _layer_norm_bwd_dx_kernel(
    dx_ptr, dy_ptr, x_ptr, w_ptr,     # dx (M, N) contiguous rows; dy, x (M, N) strided; w (N,)
    dres_ptr,                         # ADD: the new residual's gradient (M, N) strided
    mean_ptr, rstd_ptr,               # per-row statistics from the forward (fp32)
    dw_part_ptr, db_part_ptr,         # (GROUPS, N) fp32 partial sums, zero-initialized
    lock_ptr,                         # (GROUPS,) int32 spin locks, zero-initialized
    n_rows, n_cols, n_groups,
    x_row_stride, x_col_stride,
    dy_row_stride, dy_col_stride,
    dres_row_stride, dres_col_stride,
    dx_row_stride,
    w_offset,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RMS: tl.constexpr = False,        # rms_norm: xhat = x * rstd, no dbias
    ADD: tl.constexpr = False,        # add_rms_norm: x is the new residual; dx += its gradient
    ONE_CHUNK: tl.constexpr = False,  # rows fit one chunk: the persistent, lock-free path
):
    if ONE_CHUNK:
        _bwd_dx_rows_in_registers(
            dx_ptr, dy_ptr, x_ptr, w_ptr, dres_ptr, mean_ptr, rstd_ptr, dw_part_ptr,
            db_part_ptr, n_rows, n_cols, x_row_stride, x_col_stride, dy_row_stride,
            dy_col_stride, dres_row_stride, dres_col_stride, dx_row_stride, w_offset,
            BLOCK_M, BLOCK_N, RMS, ADD)
    else:
        # Under ``else``, not after a ``return``: Triton generates the code after a
        # return in a taken constexpr branch too, and this path's atomic_cas must not
        # see the one-chunk launch's placeholder lock pointer.
        # --- program id to a tile of rows, and to its partial row for dweight/dbias ---
        pid = tl.program_id(0)
        rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < n_rows
        cols = tl.arange(0, BLOCK_N)
        group = pid % n_groups
        lock = lock_ptr + group
        dw_part = dw_part_ptr + group.to(tl.int64) * n_cols
        db_part = db_part_ptr + group.to(tl.int64) * n_cols
        # Rows past the end read mean = rstd = 0, so their xhat and dx are 0.
        if RMS:
            mean = tl.zeros([BLOCK_M], dtype=tl.float32)
        else:
            mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)

        # --- pass 1: the row means of g * xhat and g (g = dy * w) ---
        acc_gx = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            dy, xhat, g, col_mask, mask = _bwd_chunk(
                x_ptr, dy_ptr, w_ptr, w_offset, rows, c, row_mask, n_cols, mean, rstd,
                x_row_stride, x_col_stride, dy_row_stride, dy_col_stride)
            acc_gx += g * xhat
            acc_g += g
        c1 = tl.sum(acc_gx, axis=1) / n_cols
        c2 = tl.sum(acc_g, axis=1) / n_cols

        # --- pass 2: dx, and this tile's column sums into the group's partial row ---
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            dy, xhat, g, col_mask, mask = _bwd_chunk(
                x_ptr, dy_ptr, w_ptr, w_offset, rows, c, row_mask, n_cols, mean, rstd,
                x_row_stride, x_col_stride, dy_row_stride, dy_col_stride)
            if RMS:  # the output does not depend on a mean: no mean(g) term
                dx = (g - xhat * c1[:, None]) * rstd[:, None]
            else:
                dx = (g - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
            if ADD:  # x and residual reach the output through their sum, and reach it alone too
                dx += _load_tile(dres_ptr, rows, c, dres_row_stride, dres_col_stride, mask)
            tl.store(dx_ptr + rows[:, None] * dx_row_stride + c[None, :],
                     dx.to(dx_ptr.dtype.element_ty), mask=mask)
            # Reduce the tile over its rows first, so the lock guards one row of adds.
            part_dw = tl.sum(dy * xhat, axis=0)
            if not RMS:
                part_db = tl.sum(dy, axis=0)
            # Take the lock: atomic_cas swaps 0 -> 1 and returns the old value, so a 1 back
            # means another program holds it.
            while tl.atomic_cas(lock, 0, 1) == 1:
                pass
            part_dw += tl.load(dw_part + c, mask=col_mask, other=0.0)
            if not RMS:
                part_db += tl.load(db_part + c, mask=col_mask, other=0.0)
            tl.store(dw_part + c, part_dw, mask=col_mask)
            if not RMS:
                tl.store(db_part + c, part_db, mask=col_mask)
            # Release: atomic_xchg orders the stores above before the lock reads 0 again.
            tl.atomic_xchg(lock, 0)


@triton.jit
def _layer_norm_bwd_dwdb_kernel(
    dw_part_ptr, db_part_ptr,         # (n_groups, N) fp32 partial sums
    dw_ptr, db_ptr,                   # outputs (N,), weight's dtype
    n_groups, n_cols,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RMS: tl.constexpr = False,        # rms_norm: no dbias
):
    # --- program id to a block of columns; sum the partial rows down each column ---
    c = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = c < n_cols
    acc_dw = tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32)
    acc_db = tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32)
    for start in range(0, n_groups, BLOCK_G):
        g = start + tl.arange(0, BLOCK_G)
        mask = (g < n_groups)[:, None] & col_mask[None, :]
        offs = g[:, None].to(tl.int64) * n_cols + c[None, :]
        acc_dw += tl.load(dw_part_ptr + offs, mask=mask, other=0.0)
        if not RMS:
            acc_db += tl.load(db_part_ptr + offs, mask=mask, other=0.0)
    tl.store(dw_ptr + c, tl.sum(acc_dw, axis=0).to(dw_ptr.dtype.element_ty), mask=col_mask)
    if not RMS:
        tl.store(db_ptr + c, tl.sum(acc_db, axis=0).to(db_ptr.dtype.element_ty), mask=col_mask)


# --- host launcher --------------------------------------------------------------------------

class Problem(NamedTuple):
    device: torch.device
    dtype: torch.dtype


def problem(x, weight, bias, eps=1e-5) -> Problem:
    """Selection key of a ``layer_norm(x, weight, bias, eps)`` call (its signature is the
    kernel's, so that a call missing an argument is told so; ``_check`` checks them)."""
    return Problem(_host.tensor_device(NAME, "x", x), x.dtype)


def _check(x, weight, bias, eps) -> None:
    # Every call runs this: the common valid call passes one inline test (a few µs less
    # than the checks below, which name what is wrong).
    try:
        dtype, n = x.dtype, x.shape[-1]
        if (type(eps) is float and 0.0 <= eps < _INF and dtype in _host.FLOAT_DTYPES
                and weight.dtype is dtype and bias.dtype is dtype
                and weight.shape == (n,) and bias.shape == (n,)
                and weight.device == x.device and bias.device == x.device):
            return
    except (AttributeError, IndexError):
        pass
    _host.same_device(NAME, x=x, weight=weight, bias=bias)
    _host.check_dtype(NAME, "x", x)
    _host.check_same_dtype(NAME, x=x, weight=weight, bias=bias)
    if x.dim() == 0:
        raise _host.InputError(f"{NAME}: x must have at least one dimension, got a scalar")
    n = x.shape[-1]
    for arg, t in (("weight", weight), ("bias", bias)):
        if tuple(t.shape) != (n,):
            raise _host.InputError(
                f"{NAME}: {arg} must have shape ({n},) (x's last dimension), "
                f"got {tuple(t.shape)}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise _host.ArgumentError(f"{NAME}: eps must be a float, got {type(eps).__name__}")
    if not 0.0 <= eps < float("inf"):  # also rejects NaN
        raise _host.InputError(f"{NAME}: eps must be finite and >= 0, got eps={eps}")


_INF = float("inf")

#: The one-chunk backward's programs per multiprocessor where the config has no
#: ``PROGRAMS_PER_SM``.
PROGRAMS_PER_SM = 4

#: Warps of a program whose one row is wider than the config's ``TILE`` (8192 columns
#: under a 4096-element tile), or None for the config's ``num_warps``. At 8 warps such a
#: row leaves each thread 32 columns of x, dy, w and the dweight/dbias accumulators: for
#: sm_90 the one-chunk dx kernel compiles to 242 registers (layer_norm; rms_norm 198), one
#: program of 8 warps per multiprocessor, against 128 registers and two programs at 4096
#: columns; at 16 warps to 128 (106), no spills. The 8192-column backwards run 0.93-0.96x
#: Liger's (docs/performance.md). Not yet timed: ``bench/layers.py --backward --set
#: layer_norm.WIDE_ROW_WARPS=16`` is the A/B.
WIDE_ROW_WARPS: int | None = None


def _blocks(plan, n_rows: int, n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for rows of ``n_cols`` from the plan's config."""
    cfg = plan.config
    block_n = min(_host.next_power_of_2(n_cols), cfg.kwargs["MAX_BLOCK_N"])
    block_m = max(1, min(cfg.kwargs["TILE"] // block_n, _host.next_power_of_2(n_rows)))
    # Roughly 8 fp32 values per thread per tile: fewer warps for small tiles.
    num_warps = max(1, min(cfg.num_warps, block_m * block_n // 256))
    if WIDE_ROW_WARPS is not None and block_n > cfg.kwargs["TILE"]:
        num_warps = min(WIDE_ROW_WARPS, plan.device.max_warps)
    return block_m, block_n, num_warps


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as (M, N) rows, a view where strides allow."""
    if t.dim() == 2:  # no view to make (a view op costs host time on every call)
        return t
    n_cols = t.shape[-1]
    # reshape(-1, 0) is ambiguous (torch refuses it): with no columns, count the rows.
    return t.reshape(-1, n_cols) if n_cols else t.reshape(math.prod(t.shape[:-1]), 0)


def _forward(plan, x, weight, bias, eps, offset: float = 0.0, residual=None, stats: bool = True):
    """(y, rows, mean, rstd): ``rows`` is ``x`` as (M, N), a view where strides allow.
    ``bias`` None: rms_norm (no mean, no bias; ``mean`` is ``rstd`` itself), with
    ``offset`` added to the weight. ``residual`` (``x``'s shape): add_rms_norm, which
    normalizes ``x + residual`` (in ``x``'s dtype); ``rows`` is then that sum, a new
    contiguous (M, N) tensor. ``stats`` False (no backward to come): no mean or rstd is
    allocated or stored, and both are None (two allocations are about a quarter of a small
    call's host time)."""
    rows = _as_rows(x)
    n_rows, n_cols = rows.shape
    y = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    if stats:
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        # rms_norm stores no mean: its kernel gets rstd's pointer there and never writes it.
        mean = rstd if bias is None else torch.empty(n_rows, dtype=torch.float32, device=x.device)
    else:
        mean = rstd = None
    add = residual is not None
    res_rows = _as_rows(residual) if add else rows
    out_rows = torch.empty_like(y) if add else rows  # the new residual (ADD); else unread
    if y.numel() == 0:
        return y.reshape(x.shape), out_rows, mean, rstd
    # Memoised per power-of-two row bucket (what _blocks reads of n_rows), not per count.
    block_m, block_n, num_warps = plan.cached(("blocks", (n_rows - 1).bit_length(), n_cols),
                                              lambda: _blocks(plan, n_rows, n_cols))
    rms = bias is None
    plan.direct(_layer_norm_fwd_kernel)[(_host.cdiv(n_rows, block_m),)](
        rows, weight, weight if rms else bias, y, y if mean is None else mean,  # STATS off:
        y if rstd is None else rstd, res_rows, out_rows if add else y,        # never written
        n_rows, n_cols, rows.stride(0), rows.stride(1), res_rows.stride(0), res_rows.stride(1),
        y.stride(0), float(eps), float(offset),
        BLOCK_M=block_m, BLOCK_N=block_n, RMS=rms, ADD=add,
        # A row that fits one chunk is read once (the streamed passes read it three times).
        ONE_CHUNK=n_cols <= block_n, STATS=stats, num_warps=num_warps, **plan.switches,
    )
    return (y if x.dim() == 2 else y.view(x.shape)), out_rows, mean, rstd


def _backward(plan, dy, rows, weight, mean, rstd, rms: bool = False, offset: float = 0.0,
              dres=None):
    """(dx as (M, N), dweight, dbias) for the upstream gradient ``dy`` (M, N); with
    ``rms``, rms_norm's (``mean`` unread, dbias None); with ``dres`` (M, N), the gradient
    of add_rms_norm's new residual ``rows``, added to dx."""
    n_rows, n_cols = rows.shape
    dx = torch.empty((n_rows, n_cols), dtype=rows.dtype, device=rows.device)
    if dx.numel() == 0:
        return dx, torch.zeros_like(weight), None if rms else torch.zeros_like(weight)
    block_m, block_n, num_warps = _blocks(plan, n_rows, n_cols)
    n_tiles = _host.cdiv(n_rows, block_m)
    one_chunk = n_cols <= block_n
    if one_chunk:
        # One partial row per program, each program a few tiles: enough programs to keep
        # every multiprocessor busy (PROGRAMS_PER_SM), few enough that the partial rows
        # stay a small fraction of the traffic.
        n_programs = min(n_tiles, plan.config.kwargs.get("PROGRAMS_PER_SM", PROGRAMS_PER_SM)
                         * max(1, plan.device.num_sms))
        n_groups = n_programs
        new = torch.empty
    else:
        n_programs = n_tiles
        n_groups = max(1, min(plan.config.kwargs["GROUPS"], n_programs))
        new = torch.zeros  # chunk by chunk under the locks: the partial rows start at 0
    dw_part = new((n_groups, n_cols), dtype=torch.float32, device=rows.device)
    db_part = dw_part if rms else new((n_groups, n_cols), dtype=torch.float32, device=rows.device)
    locks = dw_part if one_chunk else torch.zeros(n_groups, dtype=torch.int32, device=rows.device)
    add = dres is not None
    dres = dres if add else dy  # unread without ADD
    plan.direct(_layer_norm_bwd_dx_kernel)[(n_programs,)](
        dx, dy, rows, weight, dres, mean, rstd, dw_part, db_part, locks,
        n_rows, n_cols, n_groups, rows.stride(0), rows.stride(1),
        dy.stride(0), dy.stride(1), dres.stride(0), dres.stride(1), dx.stride(0), float(offset),
        BLOCK_M=block_m, BLOCK_N=block_n, RMS=rms, ADD=add, ONE_CHUNK=one_chunk,
        num_warps=num_warps, **plan.switches,
    )
    dw = torch.empty_like(weight)
    db = dw if rms else torch.empty_like(weight)
    # Column blocks narrow enough for about two programs per multiprocessor: 4096 columns
    # in 128-wide blocks left 32 programs to sum 528 partial rows of dweight and dbias
    # (31.5 µs on an H100, 14.9 in 16-wide blocks, against 157 µs for the dx kernel).
    per_program = _host.cdiv(n_cols, 2 * max(1, plan.device.num_sms))
    block_c = min(block_n, max(16, _host.next_power_of_2(per_program)))
    block_g = max(1, min(_host.next_power_of_2(n_groups), plan.config.kwargs["TILE"] // block_c))
    plan.direct(_layer_norm_bwd_dwdb_kernel)[(_host.cdiv(n_cols, block_c),)](
        dw_part, db_part, dw, db, n_groups, n_cols,
        BLOCK_G=block_g, BLOCK_N=block_c, RMS=rms,
        num_warps=max(1, min(num_warps, block_g * block_c // 256)), **plan.switches,
    )
    return dx, dw, None if rms else db


def launch(plan, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
           eps: float = 1e-5) -> torch.Tensor:
    """Layer norm of ``x`` (..., N) over its last dimension, then ``* weight + bias``.

    ``weight`` and ``bias`` have shape (N,) and ``x``'s dtype (fp16, bf16 or fp32) and
    device; statistics are computed in fp32. Returns a new contiguous tensor of ``x``'s
    shape and dtype. Inputs whose leading dimensions do not fold into one stride are
    copied first. Differentiable in ``x``, ``weight`` and ``bias``.
    """
    _check(x, weight, bias, eps)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or bias.requires_grad):
        return _LayerNormFunction.call(x, weight, bias, eps, plan)
    return _forward(plan, x, weight.contiguous(), bias.contiguous(), eps, stats=False)[0]


# --- autograd -------------------------------------------------------------------------------

class _LayerNormFunction(_host.Function):
    """Saves x (as rows), weight and the per-row mean and 1/std."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, plan):
        weight = weight.contiguous()
        y, rows, mean, rstd = _replay.stage(plan, _forward, (), x, weight, bias.contiguous(), eps)
        ctx.save_for_backward(rows, weight, mean, rstd)
        ctx.plan = plan
        return y

    @staticmethod
    def backward(ctx, grad_out):
        rows, weight, mean, rstd = ctx.saved_tensors
        dy = _host.as_shape(grad_out, rows.shape)
        with _host.launching(dy.device):
            dx, dw, db = _replay.stage(ctx.plan, _backward, (), dy, rows, weight, mean, rstd)
        return _host.as_shape(dx, grad_out.shape), dw, db, None, None


# --- reference ------------------------------------------------------------------------------

def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
              eps: float = 1e-5) -> torch.Tensor:
    """Layer norm in float64 (differentiable, for gradient references)."""
    return torch.nn.functional.layer_norm(
        x.double(), (x.shape[-1],), weight.double(), bias.double(), eps)


def inputs(shape: str, dtype: torch.dtype, device) -> tuple:
    """Random ``x`` (M, N), ``weight`` and ``bias`` (N,) (shape string ``"MxN"``)."""
    rows, cols = _host.parse_shape(NAME, shape, "MxN")
    x = torch.randn(rows, cols, device=device).to(dtype)
    weight = (1 + 0.1 * torch.randn(cols, device=device)).to(dtype)
    bias = (0.1 * torch.randn(cols, device=device)).to(dtype)
    return (x, weight, bias), {}


def default_configs(device) -> list:
    return [triton.Config({"MAX_BLOCK_N": 4096, "TILE": 4096, "GROUPS": 64}, num_warps=8)]


def register(registry) -> None:
    registry.add_kernel(KernelSpec(
        NAME, "(x, weight, bias, eps=1e-5) -> out", problem,
        "layer norm over the last dim, fp32 statistics; differentiable", reference,
        inputs, "MxN"))
    registry.add_variant(Variant(
        NAME, "generic", launch, accepts=_host.dtype_supported, configs=default_configs,
        replay=True, description="row tiles streamed in column chunks; backward dweight/dbias partials "
        "under an atomic_cas spin lock, reduced by a second kernel"))
