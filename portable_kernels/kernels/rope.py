"""rope: rotary position embeddings applied to queries and keys, forward and backward.

``q`` (B, S, H, D) and ``k`` (B, S, H_kv, D), or packed (T, H, D) and (T, H_kv, D) (any
H_kv: GQA), are rotated by the angles of ``cos``/``sin`` (max_positions, R/2), the tables
FlashAttention's rotary takes: the first ``R = rotary_dim <= D`` columns of each head are
rotated in pairs, the rest pass through unchanged. Pair ``j`` of a head at position ``p``:

    (x1, x2) -> (x1 cos[p, j] - x2 sin[p, j],  x2 cos[p, j] + x1 sin[p, j])

with the pair ``(j, j + R/2)`` (half rotation: GPT-NeoX, Llama) or ``(2j, 2j + 1)``
(``INTERLEAVED``: GPT-J). Positions are 0..S-1 along each sequence (packed: 0..T-1), or
one per token from ``positions`` (packed batches, decoding). Arithmetic in fp32.

The rotation is orthogonal, so its backward is the inverse rotation of the upstream
gradients: the same kernel with ``INVERSE`` set, which negates sin.

Each (token, head) of q and then of k is a row; one launch covers both, a program taking
``BLOCK_M`` rows of one of them. A position outside the tables reads NaN for cos and sin
(a masked load), so such a row comes out NaN rather than from memory past the tables;
``PK_CHECK_VALUES=1`` turns it into an error before the launch.

Constexpr switches: ``HAS_POS`` (positions read from a tensor), ``INTERLEAVED``,
``INVERSE``. Config: ``TILE`` (pairs per program: ``BLOCK_M = TILE // BLOCK_R``) and
``num_warps``.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import _replay
from ..registry import KernelSpec, Variant
from . import _host

NAME = "rope"

_POSITION_DTYPES = (torch.int32, torch.int64)


# --- helpers --------------------------------------------------------------------------------

@triton.jit
def _rope_rows(
    x_ptr, out_ptr, cos_ptr, sin_ptr, pos_ptr,
    block, n_rows, n_heads, seq_len, half, head_dim, max_pos,
    x_sb, x_ss, x_sh, x_sd,           # x strides: batch, sequence, head, column
    pos_sb, pos_ss,                   # positions strides (batch 0 when packed)
    cos_s0, cos_s1, sin_s0, sin_s1,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    HAS_POS: tl.constexpr, INTERLEAVED: tl.constexpr, INVERSE: tl.constexpr,
):
    """Rotate rows ``block * BLOCK_M ...`` of one tensor (row = token * n_heads + head)
    into ``out``, a contiguous (rows, head_dim) buffer."""
    # --- rows to (batch, position in the sequence, head), in int64: a row times a stride
    # can pass 2**31 elements ---
    rows = block.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    tok = rows // n_heads
    head = rows % n_heads
    b = tok // seq_len
    s = tok % seq_len
    base = b * x_sb + s * x_ss + head * x_sh
    out_base = rows * head_dim
    if HAS_POS:
        pos = tl.load(pos_ptr + b * pos_sb + s * pos_ss, mask=row_mask, other=0).to(tl.int64)
    else:
        pos = s

    # --- the angles of each pair; NaN for a position outside the tables ---
    j = tl.arange(0, BLOCK_R)
    mask = row_mask[:, None] & (j < half)[None, :]
    table_mask = mask & ((pos >= 0) & (pos < max_pos))[:, None]
    c = tl.load(cos_ptr + pos[:, None] * cos_s0 + j[None, :] * cos_s1, mask=table_mask,
                other=float("nan")).to(tl.float32)
    sn = tl.load(sin_ptr + pos[:, None] * sin_s0 + j[None, :] * sin_s1, mask=table_mask,
                 other=float("nan")).to(tl.float32)
    if INVERSE:  # the transpose of a rotation is the rotation by minus the angle
        sn = -sn

    # --- the pairs: (j, j + R/2), or (2j, 2j + 1) interleaved ---
    if INTERLEAVED:
        c1 = 2 * j
        c2 = 2 * j + 1
    else:
        c1 = j
        c2 = j + half
    x1 = tl.load(x_ptr + base[:, None] + c1[None, :].to(tl.int64) * x_sd, mask=mask).to(tl.float32)
    x2 = tl.load(x_ptr + base[:, None] + c2[None, :].to(tl.int64) * x_sd, mask=mask).to(tl.float32)
    o1 = x1 * c - x2 * sn
    o2 = x2 * c + x1 * sn
    ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + out_base[:, None] + c1[None, :], o1.to(ty), mask=mask)
    tl.store(out_ptr + out_base[:, None] + c2[None, :], o2.to(ty), mask=mask)

    # --- columns past the rotary dims pass through (a copy: no arithmetic, any dtype) ---
    for start in range(2 * half, head_dim, BLOCK_P):
        cols = start + tl.arange(0, BLOCK_P)
        m = row_mask[:, None] & (cols < head_dim)[None, :]
        v = tl.load(x_ptr + base[:, None] + cols[None, :].to(tl.int64) * x_sd, mask=m)
        tl.store(out_ptr + out_base[:, None] + cols[None, :], v, mask=m)


# --- kernels --------------------------------------------------------------------------------

@triton.jit
def _rope_fwd_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr,   # q, k strided; outputs contiguous
    cos_ptr, sin_ptr, pos_ptr,            # tables (max_pos, half); positions (B, S) or (T,)
    n_q_rows, n_k_rows, q_heads, k_heads, seq_len, half, head_dim, max_pos,
    q_sb, q_ss, q_sh, q_sd,
    k_sb, k_ss, k_sh, k_sd,
    pos_sb, pos_ss,
    cos_s0, cos_s1, sin_s0, sin_s1,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    HAS_POS: tl.constexpr = False,
    INTERLEAVED: tl.constexpr = False,
    INVERSE: tl.constexpr = False,        # backward: rotate by minus the angle
):
    # --- program id to a block of q's rows, then of k's ---
    pid = tl.program_id(0)
    q_blocks = tl.cdiv(n_q_rows, BLOCK_M)
    if pid < q_blocks:
        _rope_rows(q_ptr, q_out_ptr, cos_ptr, sin_ptr, pos_ptr, pid, n_q_rows, q_heads,
                   seq_len, half, head_dim, max_pos, q_sb, q_ss, q_sh, q_sd, pos_sb, pos_ss,
                   cos_s0, cos_s1, sin_s0, sin_s1, BLOCK_M, BLOCK_R, BLOCK_P, HAS_POS,
                   INTERLEAVED, INVERSE)
    else:
        _rope_rows(k_ptr, k_out_ptr, cos_ptr, sin_ptr, pos_ptr, pid - q_blocks, n_k_rows,
                   k_heads, seq_len, half, head_dim, max_pos, k_sb, k_ss, k_sh, k_sd, pos_sb,
                   pos_ss, cos_s0, cos_s1, sin_s0, sin_s1, BLOCK_M, BLOCK_R, BLOCK_P, HAS_POS,
                   INTERLEAVED, INVERSE)


# --- host launcher --------------------------------------------------------------------------

class Problem(NamedTuple):
    device: torch.device
    dtype: torch.dtype


def problem(q, k, cos, sin, positions=None, interleaved=False) -> Problem:
    """Selection key of a ``rope(q, k, cos, sin, positions, interleaved)`` call."""
    return Problem(_host.same_device(NAME, q=q, k=k, cos=cos, sin=sin), q.dtype)


def _heads_layout(arg: str, t: torch.Tensor) -> tuple:
    """(B, S, H, D) and the four strides of ``t``; packed (T, H, D) is B = 1, S = T."""
    if t.dim() == 4:
        return tuple(t.shape), tuple(t.stride())
    if t.dim() == 3:
        (n, h, d), (sn, sh, sd) = t.shape, t.stride()
        return (1, n, h, d), (0, sn, sh, sd)
    raise _host.InputError(f"{NAME}: {arg} must be (B, S, H, D) or packed (T, H, D), got shape "
                           f"{tuple(t.shape)}")


def _check(q, k, cos, sin, positions, interleaved) -> None:
    _host.same_device(NAME, q=q, k=k, cos=cos, sin=sin)
    for arg, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        _host.check_dtype(NAME, arg, t)
    _host.check_same_dtype(NAME, q=q, k=k)
    _host.check_same_dtype(NAME, cos=cos, sin=sin)
    _host.check_bool(NAME, "interleaved", interleaved)
    (b, s, _, d), _ = _heads_layout("q", q)
    _heads_layout("k", k)
    if q.dim() != k.dim() or q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        lead = "(B, S)" if q.dim() == 4 else "(T,)"
        raise _host.InputError(
            f"{NAME}: q and k must share their leading dims {lead} and head dim D, got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}")
    if cos.dim() != 2 or cos.shape != sin.shape:
        raise _host.InputError(
            f"{NAME}: cos and sin must both be (max_positions, rotary_dim / 2), got cos "
            f"{tuple(cos.shape)}, sin {tuple(sin.shape)}")
    max_pos, half = cos.shape
    if half < 1 or 2 * half > d:
        raise _host.InputError(
            f"{NAME}: rotary_dim = 2 * cos.shape[1] = {2 * half} must be in 2..D (D={d}), from "
            f"cos {tuple(cos.shape)}")
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise _host.InputError(f"{NAME}: cos and sin take no gradient; pass them detached")
    if positions is None:
        if s > max_pos:
            what = "tokens T" if q.dim() == 3 else "sequence length S"
            raise _host.InputError(
                f"{NAME}: cos and sin have {max_pos} positions, fewer than the {what}={s} that "
                f"the default positions 0..{s - 1} need (pass positions, or longer tables)")
        return
    _host.tensor_device(NAME, "positions", positions)
    if positions.device != q.device:
        raise _host.InputError(f"{NAME}: positions must be on {q.device} (q's device), got "
                               f"{positions.device}")
    _host.check_dtype(NAME, "positions", positions, _POSITION_DTYPES)
    want = (b, s) if q.dim() == 4 else (s,)
    if tuple(positions.shape) != want:
        raise _host.InputError(
            f"{NAME}: positions must have shape {want} (one per token of q), got "
            f"{tuple(positions.shape)}")
    if _host.check_values() and positions.numel():
        low, high = int(positions.min()), int(positions.max())
        if low < 0 or high >= max_pos:
            raise _host.InputError(
                f"{NAME}: positions must lie in 0..{max_pos - 1} (the rows of cos and sin), "
                f"got {low}..{high}")


def _apply(plan, q, k, cos, sin, positions, interleaved: bool, inverse: bool = False):
    """(q_out, k_out): new contiguous tensors of q's and k's shapes, rotated (``inverse``:
    by minus the angles). Arguments already checked."""
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    (_, s, hq, d), q_st = _heads_layout("q", q)
    (_, _, hk, _), k_st = _heads_layout("k", k)
    n_q, n_k = q.numel() // d, k.numel() // d
    if not (q_out.numel() or k_out.numel()):
        return q_out, k_out
    max_pos, half = cos.shape
    if positions is None:
        pos, pos_st = cos, (0, 0)  # unread: HAS_POS is off
    else:
        pos = positions
        pos_st = tuple(positions.stride()) if positions.dim() == 2 else (0, positions.stride(0))
    cfg = plan.config
    block_r = _host.next_power_of_2(half)
    block_m = max(1, min(cfg.kwargs["TILE"] // block_r, _host.next_power_of_2(max(n_q, n_k))))
    block_p = min(_host.next_power_of_2(max(d - 2 * half, 1)), 1024)
    grid = (_host.cdiv(n_q, block_m) + _host.cdiv(n_k, block_m),)
    plan.direct(_rope_fwd_kernel)[grid](
        q, k, q_out, k_out, cos, sin, pos,
        n_q, n_k, hq, hk, s, half, d, max_pos, *q_st, *k_st, *pos_st, *cos.stride(), *sin.stride(),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_P=block_p, HAS_POS=positions is not None,
        INTERLEAVED=bool(interleaved), INVERSE=inverse,
        num_warps=max(1, min(cfg.num_warps, block_m * block_r // 256)), **plan.switches,
    )
    return q_out, k_out


def launch(plan, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           positions: torch.Tensor | None = None, interleaved: bool = False):
    """Rotary embeddings of ``q`` and ``k``; returns ``(q_out, k_out)``.

    ``q`` (B, S, H, D) and ``k`` (B, S, H_kv, D), or packed (T, H, D) and (T, H_kv, D),
    of one dtype (fp16, bf16, fp32), any strides. ``cos``, ``sin``: (max_positions, R/2)
    of one float dtype; the first ``R = rotary_dim <= D`` columns of each head rotate,
    the rest pass through. ``positions``: int32/int64 (B, S) (packed: (T,)), one per
    token; default 0..S-1 (packed: 0..T-1). ``interleaved``: pairs (2j, 2j+1) (GPT-J)
    instead of (j, j + R/2) (GPT-NeoX, Llama). Computed in fp32. The outputs are new
    contiguous tensors of q's and k's shapes and dtype; the inputs are not modified.
    Differentiable in q and k (not in cos and sin).
    """
    _check(q, k, cos, sin, positions, interleaved)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return _RoPEFunction.call(q, k, cos, sin, positions, interleaved, plan)
    return _apply(plan, q, k, cos, sin, positions, interleaved)


# --- autograd -------------------------------------------------------------------------------

class _RoPEFunction(_host.Function):
    """Saves only the tables and positions: the backward rotates the gradients back."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, positions, interleaved, plan):
        ctx.save_for_backward(cos, sin, positions)
        ctx.plan, ctx.interleaved = plan, interleaved
        return _replay.stage(plan, _apply, (), q, k, cos, sin, positions, interleaved)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        cos, sin, positions = ctx.saved_tensors
        with _host.launching(grad_q.device):
            dq, dk = _replay.stage(ctx.plan, _apply, (True,), grad_q, grad_k, cos, sin,
                                   positions, ctx.interleaved)
        return dq, dk, None, None, None, None, None


# --- reference ------------------------------------------------------------------------------

def reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              positions: torch.Tensor | None = None, interleaved: bool = False):
    """``(q_out, k_out)`` in float64 (differentiable, for gradient references)."""
    half = cos.shape[1]

    def rotate(x):
        x = x.double()
        pos = positions.long() if positions is not None else torch.arange(x.shape[-3], device=x.device)
        c = cos.double()[pos].unsqueeze(-2)  # (..., 1, half): broadcast over heads
        s = sin.double()[pos].unsqueeze(-2)
        rot, rest = x[..., : 2 * half], x[..., 2 * half:]
        if interleaved:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        else:
            x1, x2 = rot[..., :half], rot[..., half:]
        o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
        out = torch.stack((o1, o2), -1).flatten(-2) if interleaved else torch.cat((o1, o2), -1)
        return torch.cat((out, rest), -1)

    return rotate(q), rotate(k)


def tables(max_positions: int, rotary_dim: int, base: float = 10000.0, device=None,
           dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each (max_positions, rotary_dim / 2): the standard angles
    ``p * base ** (-2j / rotary_dim)``, computed in float64 and rounded to ``dtype``."""
    inv_freq = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    return angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)


def inputs(shape: str, dtype: torch.dtype, device) -> tuple:
    """Random ``q`` (B, S, H, D), ``k`` (B, S, max(1, H // 4), D) and full-width tables of
    S positions (shape string ``"BxSxHxD"``, D even)."""
    b, s, h, d = _host.parse_shape(NAME, shape, "BxSxHxD")
    q = torch.randn(b, s, h, d, device=device).to(dtype)
    k = torch.randn(b, s, max(1, h // 4), d, device=device).to(dtype)
    cos, sin = tables(s, 2 * (d // 2), device=device)
    return (q, k, cos, sin), {}


def default_configs(device) -> list:
    return [triton.Config({"TILE": 2048}, num_warps=4)]


def register(registry) -> None:
    registry.add_kernel(KernelSpec(
        NAME, "(q, k, cos, sin, positions=None, interleaved=False) -> (q_out, k_out)", problem,
        "rotary embeddings of q and k (half or interleaved pairs, partial rotary_dim, GQA, "
        "packed, positions), fp32 arithmetic; differentiable", reference, inputs, "BxSxHxD"))
    registry.add_variant(Variant(
        NAME, "generic", launch, accepts=_host.dtype_supported, configs=default_configs,
        replay=True, description="rows of (token, head) pairs, q and k in one launch; the backward is the "
        "same kernel rotating by minus the angles"))
