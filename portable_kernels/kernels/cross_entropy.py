"""cross_entropy: the loss of a language model's logits against target token ids.

``logits`` (T, V) fp16/bf16/fp32, ``target`` (T,) int64 or int32. Per counted row (target
!= ``ignore_index``), with ``z = softcap * tanh(x / softcap)`` (Gemma 2's final-logit cap;
``z = x`` without it), ``lse = logsumexp(z)`` and label smoothing ``e``:

    loss = lse - (1 - e) * z[target] - (e / V) * sum(z) + z_loss * lse**2

which is torch's ``F.cross_entropy(label_smoothing=e)`` plus PaLM's z-loss. Ignored rows
lose 0. Reductions: ``"none"`` ((T,) fp32), ``"sum"``, ``"mean"`` (over counted rows, as
torch: NaN when none is counted, with a zero gradient, again as torch). A target that is
neither ``ignore_index`` nor in [0, V) makes its row's loss and gradient NaN, so a bad id
is never silently a number; ``PK_CHECK_VALUES=1`` also raises on the host.

One kernel, a program per ``ROWS`` rows, the vocabulary in ``BLOCK_V`` chunks:

- pass 1 (``LOSS``): an online max and sum of exponentials over the chunks in fp32 (no
  (T, V) fp32 copy exists anywhere), the sum of ``z`` for smoothing, the target's logit
  by one gathered load; stores the row's loss and ``lse``.
- pass 2 (``GRAD``): ``dz = p * (1 + 2 z_loss lse) - e / V - (1 - e) [j == target]`` with
  ``p = exp(z - lse)``, times ``1 - (z / softcap)**2`` under the cap, times the row's scale
  (the upstream gradient; ``1 / counted rows`` for ``"mean"``).

The backward is pass 2 alone, from the saved logits and ``lse``: the forward reads the
logits once and writes no (T, V) gradient that must live until backward, the backward
reads them once and writes the gradient once, and a per-row upstream gradient
(``"none"``) needs no host sync. (Computing the gradient in the forward, as Liger does,
reads the logits twice there and holds a (T, V) gradient between the passes.) The logits
are never overwritten. ``fused_linear_cross_entropy`` runs both passes in one launch
(``LOSS`` and ``GRAD``) on its own logits chunk, the gradient written in its place, and
adds its bias in the kernel (``BIAS``).

Configs: ``MAX_BLOCK_V`` (widest vocabulary chunk), ``TILE`` (elements per program and
chunk: narrow vocabularies put several rows in a program).
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
from ._attn_mods import tanh

NAME = "cross_entropy"
REDUCTIONS = ("mean", "sum", "none")
TARGET_DTYPES = (torch.int64, torch.int32)


@triton.jit
def _logits(x_ptr, bias_ptr, rows, cols, row_mask, n_cols, stride_xt, stride_xv, softcap,
            BIAS: tl.constexpr, SOFTCAP: tl.constexpr):
    """The (ROWS, BLOCK_V) tile of ``z`` in fp32 (loaded values converted first: the
    interpreter keeps bf16 as raw bits) and its column mask; past the vocabulary ``z`` is
    -inf, so it adds nothing to the max or the sum of exponentials. Rows past the end read
    0, not -inf, so that their (unstored) statistics stay finite."""
    col_mask = cols < n_cols
    x = tl.load(x_ptr + rows[:, None] * stride_xt + cols[None, :] * stride_xv,
                mask=row_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
    if BIAS:
        x += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if SOFTCAP:
        x = softcap * tanh(x / softcap)
    return tl.where(col_mask[None, :], x, float("-inf")), col_mask


@triton.jit
def _cross_entropy_kernel(
    # pointers
    x_ptr, target_ptr, bias_ptr, loss_ptr, lse_ptr, grad_ptr, scale_ptr,
    # sizes and strides
    n_rows, n_cols, stride_xt, stride_xv, stride_gt, stride_target, stride_scale,
    # options
    ignore_index, smoothing, z_loss, softcap,
    # meta-parameters
    ROWS: tl.constexpr, BLOCK_V: tl.constexpr, LOSS: tl.constexpr, GRAD: tl.constexpr,
    BIAS: tl.constexpr, SOFTCAP: tl.constexpr, SMOOTH: tl.constexpr, Z_LOSS: tl.constexpr,
    STORE_LSE: tl.constexpr = True,  # pass 1 stores the LSE (a later backward reads it)
):
    # --- this program's rows; int64, since row * stride passes 2**31 for large T x V ---
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    target = tl.load(target_ptr + rows * stride_target, mask=row_mask, other=ignore_index).to(tl.int64)
    counted = target != ignore_index
    in_range = (target >= 0) & (target < n_cols)
    offs = tl.arange(0, BLOCK_V)

    if LOSS:
        # --- pass 1: online max and sum of exp over the vocabulary chunks, in fp32 ---
        m = tl.full((ROWS,), float("-inf"), tl.float32)
        s = tl.zeros((ROWS,), tl.float32)
        z_sum = tl.zeros((ROWS,), tl.float32)
        for start in range(0, n_cols, BLOCK_V):
            z, col_mask = _logits(x_ptr, bias_ptr, rows, start + offs, row_mask, n_cols,
                                  stride_xt, stride_xv, softcap, BIAS, SOFTCAP)
            # Every chunk holds at least one column, so m_new is finite and the rescale
            # exp(m - m_new) is exp(-inf) = 0 on the first chunk, never NaN.
            m_new = tl.maximum(m, tl.max(z, 1))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), 1)
            m = m_new
            if SMOOTH:
                z_sum += tl.sum(tl.where(col_mask[None, :], z, 0.0), 1)
        lse = m + tl.log(s)

        # --- the target's logit: one gathered element per row (masked where the id is
        # ignored or out of range, so no read leaves the row) ---
        safe = tl.where(in_range, target, 0)
        gather = row_mask & counted & in_range
        z_t = tl.load(x_ptr + rows * stride_xt + safe * stride_xv, mask=gather, other=0.0).to(tl.float32)
        if BIAS:
            z_t += tl.load(bias_ptr + safe, mask=gather, other=0.0).to(tl.float32)
        if SOFTCAP:
            z_t = softcap * tanh(z_t / softcap)

        loss = lse - (1.0 - smoothing) * z_t
        if SMOOTH:
            loss -= smoothing / n_cols * z_sum
        if Z_LOSS:
            loss += z_loss * lse * lse
        loss = tl.where(counted, tl.where(in_range, loss, float("nan")), 0.0)
        tl.store(loss_ptr + rows, loss, mask=row_mask)
        if STORE_LSE:
            tl.store(lse_ptr + rows, lse, mask=row_mask)
    else:
        lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)

    if GRAD:
        # --- pass 2: d loss / d x, times the row's upstream scale ---
        scale = tl.load(scale_ptr + rows * stride_scale, mask=row_mask, other=0.0).to(tl.float32)
        p_scale = 1.0 + 2.0 * z_loss * lse  # d(lse + z_loss lse^2)/d lse
        for start in range(0, n_cols, BLOCK_V):
            cols = start + offs
            z, col_mask = _logits(x_ptr, bias_ptr, rows, cols, row_mask, n_cols,
                                  stride_xt, stride_xv, softcap, BIAS, SOFTCAP)
            g = tl.exp(z - lse[:, None])
            if Z_LOSS:
                g = g * p_scale[:, None]
            if SMOOTH:
                g -= smoothing / n_cols
            g = tl.where(cols[None, :] == target[:, None], g - (1.0 - smoothing), g)
            if SOFTCAP:
                t = z / softcap
                g = g * (1.0 - t * t)
            # Ignored rows are exactly 0 (also when "mean" over no counted rows makes the
            # scale inf: torch's gradient is 0 there too).
            g = tl.where(counted[:, None], tl.where(in_range[:, None], g * scale[:, None], float("nan")), 0.0)
            # In place for fused_linear_cross_entropy: each element is read above before
            # it is written here, and programs own disjoint rows.
            tl.store(grad_ptr + rows[:, None] * stride_gt + cols[None, :],
                     g.to(grad_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _reduce_kernel(loss_ptr, target_ptr, out_ptr, n_rows, stride_target, ignore_index,
                   MEAN: tl.constexpr, BLOCK: tl.constexpr, UPSTREAM: tl.constexpr = 0):
    """The "sum" or "mean" (over counted rows) of the (T,) fp32 row losses, in one program:
    one launch where torch's sum, compare, count and divide took four (a small call's host
    time is its launches), and one summation order, so every call gives the same bits.
    A mean over no counted row is 0 / 0 = NaN, as torch's.

    ``UPSTREAM`` 1 or 2: the gradient pass's row scale for a reduced loss instead, 1 (1)
    or the 0-d upstream gradient at ``loss_ptr`` (2), over the counted rows for "mean":
    one launch where torch's compare, count and divide (operators a replay cannot record)
    took three."""
    offs = tl.arange(0, BLOCK)
    total = tl.zeros((BLOCK,), tl.float32)
    count = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, n_rows, BLOCK):
        rows = start + offs
        mask = rows < n_rows
        if UPSTREAM == 0:
            total += tl.load(loss_ptr + rows, mask=mask, other=0.0)
        if MEAN:
            t = tl.load(target_ptr + rows.to(tl.int64) * stride_target, mask=mask, other=ignore_index)
            count += (t != ignore_index).to(tl.int32)
    if UPSTREAM == 0:
        result = tl.sum(total, 0)
    elif UPSTREAM == 1:
        result = tl.full((), 1.0, tl.float32)
    else:
        result = tl.load(loss_ptr).to(tl.float32)
    if MEAN:
        result = result / tl.sum(count, 0).to(tl.float32)
    tl.store(out_ptr, result)


# --- host -----------------------------------------------------------------------------------

class Problem(NamedTuple):
    device: torch.device
    dtype: torch.dtype


def problem(logits, target, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None,
            reduction="mean") -> Problem:
    """Selection key of a ``cross_entropy(logits, target, ...)`` call."""
    return Problem(_host.tensor_device(NAME, "logits", logits), logits.dtype)


def check_options(kernel: str, ignore_index, label_smoothing, z_loss, softcap, reduction) -> None:
    """``ArgumentError``/``InputError`` naming the bad option (shared with
    ``fused_linear_cross_entropy``)."""
    _host.check_int(kernel, "ignore_index", ignore_index)
    for arg, value in (("label_smoothing", label_smoothing), ("z_loss", z_loss)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise _host.ArgumentError(f"{kernel}: {arg} must be a float, got {type(value).__name__}")
    if not 0.0 <= label_smoothing <= 1.0:  # also rejects NaN
        raise _host.InputError(f"{kernel}: label_smoothing must be in [0, 1], got "
                               f"label_smoothing={label_smoothing}")
    if not 0.0 <= z_loss < math.inf:
        raise _host.InputError(f"{kernel}: z_loss must be finite and >= 0, got z_loss={z_loss}")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
            raise _host.ArgumentError(f"{kernel}: softcap must be a float or None, got "
                                      f"{type(softcap).__name__}")
        if not 0.0 < softcap < math.inf:
            raise _host.InputError(f"{kernel}: softcap must be finite and > 0 (None: off), got "
                                   f"softcap={softcap}")
    if reduction not in REDUCTIONS:
        raise _host.InputError(f"{kernel}: reduction must be one of {', '.join(map(repr, REDUCTIONS))}, "
                               f"got {reduction!r}")


def check_target(kernel: str, target, rows: int, n_classes: int, ignore_index: int,
                 rows_from: str) -> None:
    """``target`` is (rows,) int64/int32; under ``PK_CHECK_VALUES=1`` also every id is
    ``ignore_index`` or in [0, n_classes) (a device sync, so never by default)."""
    _host.tensor_device(kernel, "target", target)
    _host.check_dtype(kernel, "target", target, TARGET_DTYPES)
    if tuple(target.shape) != (rows,):
        raise _host.InputError(f"{kernel}: target must have shape ({rows},) (one id per row of "
                               f"{rows_from}), got {tuple(target.shape)}")
    if _host.check_values() and target.numel():
        bad = (target != ignore_index) & ((target < 0) | (target >= n_classes))
        if bool(bad.any()):
            first = int(bad.nonzero()[0, 0])
            raise _host.InputError(
                f"{kernel}: target[{first}] = {int(target[first])} is neither ignore_index "
                f"({ignore_index}) nor a class in [0, {n_classes})")


def _check(logits, target, ignore_index, label_smoothing, z_loss, softcap, reduction) -> None:
    _host.check_dtype(NAME, "logits", logits)
    _host.check_ndim(NAME, "logits", logits, 2, "(T, V)")
    if logits.shape[1] == 0:
        raise _host.InputError(f"{NAME}: logits need at least one class, got shape {tuple(logits.shape)}")
    _host.same_device(NAME, logits=logits, target=target)
    check_options(NAME, ignore_index, label_smoothing, z_loss, softcap, reduction)
    check_target(NAME, target, logits.shape[0], logits.shape[1], ignore_index, "logits")


def _meta(plan, n_rows: int, n_cols: int) -> tuple[tuple[int], dict]:
    """Grid and block sizes: a chunk of up to ``MAX_BLOCK_V`` columns, and as many rows per
    program as fill ``TILE`` elements."""
    cfg = plan.config
    block_v = min(cfg.kwargs["MAX_BLOCK_V"], _host.next_power_of_2(n_cols))
    rows = max(1, min(cfg.kwargs["TILE"] // block_v, _host.next_power_of_2(max(n_rows, 1))))
    return (_host.cdiv(n_rows, rows),), {"ROWS": rows, "BLOCK_V": block_v, "num_warps": cfg.num_warps}


def _switches(label_smoothing, z_loss, softcap) -> dict:
    return {"SOFTCAP": softcap is not None, "SMOOTH": label_smoothing > 0, "Z_LOSS": z_loss > 0}


def run(plan, logits, target, *, loss=None, lse=None, grad=None, scale=None, bias=None,
        ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None) -> None:
    """Launch the kernel on checked arguments: pass 1 when ``loss`` is given (writing
    ``loss`` and, when given, ``lse``, (T,) fp32), else reading ``lse``; pass 2 when
    ``grad`` is given (contiguous rows; may be ``logits`` itself), scaled per row by
    ``scale`` (fp32, (T,) or 0-d for one scale). For the launchers of this family and of
    ``fused_linear_cross_entropy``."""
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    if lse is None and loss is None:
        raise ValueError("cross_entropy.run: a gradient pass without pass 1 reads lse")
    grid, meta = _meta(plan, n_rows, n_cols)
    dummy = loss if lse is None else lse  # an fp32 tensor for the pointers left unread
    _host.launcher(plan, _cross_entropy_kernel)[grid](
        logits, target, dummy if bias is None else bias, dummy if loss is None else loss, dummy,
        dummy if grad is None else grad, dummy if scale is None else scale,
        n_rows, n_cols, logits.stride(0), logits.stride(1), 0 if grad is None else grad.stride(0),
        target.stride(0), 0 if scale is None or scale.dim() == 0 else scale.stride(0),
        ignore_index, float(label_smoothing), float(z_loss), float(softcap or 1.0),
        LOSS=loss is not None, GRAD=grad is not None, BIAS=bias is not None,
        STORE_LSE=lse is not None, **_switches(label_smoothing, z_loss, softcap), **meta,
        **plan.switches)


#: Rows the reduction program adds per step.
REDUCE_BLOCK = 1024


def reduce(plan, rows: torch.Tensor, target: torch.Tensor, ignore_index: int,
           reduction: str) -> torch.Tensor:
    """The (T,) fp32 row losses reduced as ``reduction`` says ("mean": over counted rows,
    NaN for none, as torch): a 0-d fp32 tensor from one launch of :func:`_reduce_kernel`."""
    if reduction == "none":
        return rows
    out = torch.empty((), dtype=torch.float32, device=rows.device)
    _host.launcher(plan, _reduce_kernel)[(1,)](
        rows, target, out, rows.shape[0], target.stride(0) if target.dim() else 1, ignore_index,
        MEAN=reduction == "mean", BLOCK=REDUCE_BLOCK, num_warps=4)
    return out


def upstream_scale(plan, grad: torch.Tensor | None, target: torch.Tensor, ignore_index: int,
                   reduction: str) -> torch.Tensor:
    """The per-row factor of pass 2 for the upstream gradient ``grad`` of a reduced loss
    (None: 1, "mean" and "sum" only): fp32, 0-d for "mean" and "sum" (one launch), (T,)
    for "none". No host sync."""
    if reduction == "none":
        return grad.to(torch.float32)
    out = torch.empty((), dtype=torch.float32, device=target.device)
    _host.launcher(plan, _reduce_kernel)[(1,)](
        out if grad is None else grad, target, out, target.shape[0],
        target.stride(0) if target.dim() else 1, ignore_index,
        MEAN=reduction == "mean", BLOCK=REDUCE_BLOCK, UPSTREAM=1 if grad is None else 2,
        num_warps=4)
    return out


def _forward(plan, logits, target, ignore_index, label_smoothing, z_loss, softcap, reduction,
             keep_lse: bool = True):
    """(loss, lse): the reduced fp32 loss and the (T,) fp32 log-sum-exp of ``z`` (None
    without ``keep_lse``: an inference call's backward never comes, and the allocation
    costs about as much host time as a launch)."""
    n_rows = logits.shape[0]
    rows = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty(n_rows, dtype=torch.float32, device=logits.device) if keep_lse else None
    run(plan, logits, target, loss=rows, lse=lse, ignore_index=ignore_index,
        label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap)
    return reduce(plan, rows, target, ignore_index, reduction), lse


def _backward(plan, grad, logits, target, lse, ignore_index, label_smoothing, z_loss, softcap,
              reduction):
    """The (T, V) gradient of the logits (their dtype, contiguous) for the upstream
    gradient ``grad`` of the reduced loss."""
    dlogits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    scale = upstream_scale(plan, grad, target, ignore_index, reduction)
    run(plan, logits, target, lse=lse, grad=dlogits, scale=scale, ignore_index=ignore_index,
        label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap)
    return dlogits


def launch(plan, logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
           label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float | None = None,
           reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of ``logits`` (T, V) (fp16, bf16, fp32; any strides) against
    ``target`` (T,) (int64 or int32 class ids; ``ignore_index`` rows count for nothing).

    ``label_smoothing`` in [0, 1] as torch's; ``z_loss >= 0`` adds ``z_loss * lse**2`` per
    counted row; ``softcap > 0`` caps the logits to ``softcap * tanh(logits / softcap)``
    first. Returns an fp32 loss: a scalar for ``"mean"`` (over counted rows; NaN when none
    is counted, as torch) and ``"sum"``, (T,) for ``"none"`` (0 at ignored rows).
    Differentiable in ``logits``; the logits are never modified.
    """
    _check(logits, target, ignore_index, label_smoothing, z_loss, softcap, reduction)
    args = (ignore_index, float(label_smoothing), float(z_loss),
            None if softcap is None else float(softcap), reduction)
    if torch.is_grad_enabled() and logits.requires_grad:
        return _CrossEntropyFunction.call(logits, target, plan, *args)
    return _forward(plan, logits, target, *args, keep_lse=False)[0]


class _CrossEntropyFunction(_host.Function):
    """Saves the logits, the targets and the per-row lse; the backward is pass 2."""

    @staticmethod
    def forward(ctx, logits, target, plan, *args):
        loss, lse = _replay.stage(plan, _forward, (), logits, target, *args)
        ctx.save_for_backward(logits, target, lse)
        ctx.plan, ctx.args = plan, args
        return loss

    @staticmethod
    def backward(ctx, grad):
        logits, target, lse = ctx.saved_tensors
        with _host.launching(grad.device):
            dlogits = _replay.stage(ctx.plan, _backward, (), grad, logits, target, lse, *ctx.args)
        return (dlogits, None, None) + (None,) * len(ctx.args)


def reference(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
              label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float | None = None,
              reduction: str = "mean") -> torch.Tensor:
    """The loss in float64 through torch's own ``F.cross_entropy`` (its smoothing, ignored
    rows and mean), with the softcap and the z-loss written out; differentiable."""
    z = logits.double()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    loss = torch.nn.functional.cross_entropy(z, target.long(), ignore_index=ignore_index,
                                             label_smoothing=label_smoothing, reduction=reduction)
    if z_loss:
        counted = (target != ignore_index).double()
        extra = z_loss * torch.logsumexp(z, -1).square() * counted
        if reduction == "sum":
            extra = extra.sum()
        elif reduction == "mean":
            # Clamped: with no counted row torch's part is NaN already, and an unclamped
            # 0/0 here would make the (zero) gradient NaN.
            extra = extra.sum() / counted.sum().clamp(min=1)
        loss = loss + extra
    return loss


def random_target(rows: int, n_classes: int, device, generator=None, ignored: float = 0.0,
                  ignore_index: int = -100) -> torch.Tensor:
    """Random int64 class ids, a fraction ``ignored`` of them ``ignore_index``."""
    target = torch.randint(n_classes, (rows,), generator=generator)
    if ignored:
        target[torch.rand(rows, generator=generator) < ignored] = ignore_index
    return target.to(device)


def inputs(shape: str, dtype: torch.dtype, device) -> tuple:
    """Random ``logits`` (T, V) and ``target`` (T,) (shape string ``"TxV"``)."""
    rows, cols = _host.parse_shape(NAME, shape, "TxV")
    return (torch.randn(rows, cols, device=device).to(dtype), random_target(rows, cols, device)), {}


def default_configs(device) -> list:
    return [triton.Config({"MAX_BLOCK_V": 4096, "TILE": 4096}, num_warps=8)]


def register(registry) -> None:
    registry.add_kernel(KernelSpec(
        NAME, "(logits, target, ignore_index=-100, **options) -> loss", problem,
        "cross-entropy over vocabulary chunks (online fp32 log-sum-exp); options "
        "label_smoothing, z_loss, softcap, reduction; differentiable", reference, inputs, "TxV"))
    registry.add_variant(Variant(
        NAME, "generic", launch, accepts=_host.dtype_supported, configs=default_configs,
        replay=True, description="a program per row block, vocabulary in chunks: online max/sum, then the "
        "gradient pass in the backward from the saved log-sum-exp"))
