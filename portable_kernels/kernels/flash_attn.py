"""flash_attn: ``out = softmax(q·kᵀ·sm_scale [causal]) · v`` without an Nq × Nk matrix
(FlashAttention-2), forward and backward.

Layouts follow torch SDPA: ``q`` (B, H, Nq, D); ``k``, ``v`` (B, H_kv, Nk, D) with
``H % H_kv == 0`` (grouped-query attention: query head ``h`` reads K/V head
``h // (H // H_kv)``); ``out`` (B, H, Nq, D). Every tensor is addressed through its four
strides, so (B, N, H, D) tensors viewed as (B, H, N, D) need no copy. ``D`` is any size up
to 256: tiles are ``BLOCK_D = next_power_of_2(D)`` wide (at least 16, ``tl.dot``'s minimum)
and the padded columns are masked to zero, which adds nothing to either dot.

Forward. One program per ``BLOCK_M`` query rows of one (batch, head). It loads its query
tile once and streams the K/V tiles of ``BLOCK_N`` keys:
``s = q·kᵀ · sm_scale·log2(e)`` (the log2(e) folded into the scale lets ``exp2``, one
hardware instruction, replace ``exp``), a running row max ``m``, a running row sum ``l`` and
the output accumulator ``acc`` both rescaled by ``exp2(m_old - m_new)`` whenever the max
grows, plus ``p = exp2(s - m)`` and ``acc += p·v``. After the loop ``out = acc / l`` and
``LSE = (m + log2 l)·ln 2`` (the natural log-sum-exp of the scaled scores) is stored in fp32,
(B, H, Nq), for the backward. The key loop runs in two stages through one helper: the key
blocks every row of the tile sees in full (no mask at all), then the causal diagonal and
the Nk tail (masked); with ``WARP_SPECIALIZE``, one stage over all blocks, masked. For a
positive scale (``RAW_MAX``, every default one) the row max is taken over the raw scores and
scaled once per row, so that each score costs one FMA (``s·scale - m``) before its exp2
instead of a multiply and a subtraction; a zero or negative scale, where scaling does not
commute with the max, scales the scores first.

``causal`` is SDPA's ``is_causal``, top-left aligned: query ``i`` sees keys ``j <= i``
whatever Nq and Nk. Key 0 is visible to every row, so no row is empty; with ``Nk == 0``
the output is zeros, as SDPA's math backend returns.

FlashAttention's options (semantics in ``_attn_mods``) are per-call constexpr switches, so a
call that sets none compiles to the kernel above: ``ALIGN_BR`` (the diagonal at ``Nk - Nq``,
FlashAttention's bottom-right alignment), ``WINDOW`` (a sliding window; the key loop then
runs in three stages, the blocks across the window's left edge masked too), ``SOFTCAP``,
``ALIBI`` (both need the scores scaled before the max, so they turn ``RAW_MAX`` off),
``SINKS`` (the running state starts as if the sink had been seen: max = its logit, sum = 1)
and ``MAY_EMPTY`` (rows may see no key: the max subtracted in exp2 is then 0 and the output
0, the LSE -inf). ``VARLEN`` is ``flash_attn_varlen``'s packed batch: each program reads its
sequence's start and lengths from ``cu_seqlens`` and returns at once past its end; the
LSE is then FlashAttention's (H, total_q). The backward kernels take the same switches
(the softcap's derivative ``1 - (s / c)²`` is applied to dS; a sink's gradient,
``-sum p_sink · delta``, is added up on the host).

Constexpr switches (each variant sets them all; see ``SWITCHES``):
    UPCAST: convert loaded tiles to fp32 before the dots and keep P in fp32. The CPU
        backend sets it: the interpreter keeps bf16 as raw bits. Off on GPUs: fp16/bf16
        tensor-core dots with fp32 accumulation, P rounded to the input dtype for P·V.
    DEFERRED (iluvatar.v1, iluvatar.v2): the seeds' deferred reduction. The row sums of P
        are kept as an elementwise [BLOCK_M, BLOCK_N] accumulator (rescaled and added each
        step) and reduced across the tile once after the loop, instead of a cross-thread
        ``tl.sum`` every step. The running max still needs its per-step reduction: the
        rescale factor depends on it.
    HEAD_SPLIT (1 or 2; iluvatar.v1: 2): the seeds' head_dim split. The head dimension is
        processed in chunks of ``BLOCK_D // HEAD_SPLIT`` columns: q·kᵀ as a sum of chunk
        dots, one output accumulator (a narrower MMA strip) per chunk. Falls back to 1 when
        a chunk would be narrower than 16.
    TRANSPOSED (iluvatar.v2): the seeds' transposed view. The score tile is computed as
        ``Sᵀ = K·Qᵀ`` [BLOCK_N, BLOCK_M] (Qᵀ loaded as a view through strides), its
        reductions run along axis 0, and the accumulator is kept as ``accᵀ`` [D, BLOCK_M]
        with ``accᵀ += Vᵀ·Pᵀ`` (Vᵀ a strided view), so the first dot's result feeds the
        second without changing operand layout; ``out`` is stored through transposed
        strides. The V0/V1/V2 loops are one loop: the orientation helpers below pick the
        axis and the operand order.
    TMA (nvidia.hopper): Q, K, V and O tiles move through tensor descriptors (the copy
        engine; device-side ``tl.make_tensor_descriptor`` of each head's (N, D) matrix, with
        scratch memory lent by the launcher) instead of masked pointer loads. The copy
        engine zero-fills rows and columns past the ends and drops them on stores, so tiles
        need no load masks (scores of keys past Nk still are). Needs a unit stride along D
        and 16-byte aligned addresses and strides; :func:`tma_accepts` sends other
        problems, fp32 and head dims other than 64 and 128 to the pointer path. Composes
        with the switches above (tested under the interpreter), though no variant does so.
        A config of a descriptor variant may set ``TMA: False`` for its forward (see
        ``_autotuned_forward``): on sm_90 some pointer-load tiles, pipelined through
        cp.async, time faster than any descriptor tile.
    WARP_SPECIALIZE (nvidia.hopper; a config may set it, see ``_autotuned_forward``): the
        key loop is ``tl.range(..., warp_specialize=True)``: the compiler splits the program
        into a producer warpgroup issuing the K/V copies and consumer warpgroups doing the
        dots and the softmax, decoupled by ``num_stages`` shared-memory buffers. Triton 3.6
        does this for sm_90 only for a kernel with one loop and no branch in it, so this
        switch also turns the two stages into one loop over every block, each masked. No
        sm_90 config sets it, and ``nvidia.hopper``'s default is off: on the H200 with
        triton 3.6 it computed wrong outputs (see ``backends/nvidia/tuning.py``).

Backward, shared by every variant (of the switches above, UPCAST and TMA apply to it too): a
preprocess kernel computes ``delta = rowsum(dO ∘ O)``; the dk/dv kernel runs one program per
``BLOCK_N`` keys of one K/V head and loops over the query heads of its group and their query
blocks, rebuilding ``Pᵀ`` from the stored LSE (so GQA gradients are summed in fp32
registers, with no per-query-head buffers); the dq kernel runs one program per ``BLOCK_M``
queries and loops over key blocks in two stages, as the forward does (the blocks every query
sees in full without a mask, then the causal diagonal and the Nk tail; on the H200, against
masking every block, 4-10% faster through pointers but at D=64 causal N=1024, where it was
level to 4% slower); the dk/dv kernel masks every block (split the same way, it ran 10-22%
slower; docs/performance.md, flash_attn backward). ``dS = P ∘ (dP - delta)`` is the
gradient of the scaled scores, hence the final ``· sm_scale`` on dq and dk. Each kernel
holds one block and streams the other, so each has its own tile: dk/dv holds keys and
streams few queries, dq holds at least 64 queries (sm_90's warpgroup MMAs work on 64-row
blocks: a 32 x 128 dq tile ran 3.4 times slower than 128 x 64 on the H200, D=128). With TMA
(from the config's ``BWD_TMA_MIN_SEQ`` positions on), every tile of both kernels moves
through descriptors; an incoming gradient they cannot describe (autograd may hand over an
expanded or strided view) is copied once first. The loops are software-pipelined, not
warp-specialized (the dk/dv kernel's loop nest is outside what triton 3.6 specializes for
sm_90).

Config (from the backend's tuning table): ``BLOCK_M``, ``BLOCK_N`` (forward tile),
optional ``BWD_BLOCK_M``, ``BWD_BLOCK_N``, ``BWD_NUM_WARPS``, ``BWD_NUM_STAGES`` (the dk/dv
kernel; default: the forward's), optional ``DQ_BLOCK_M``, ``DQ_BLOCK_N``, ``DQ_NUM_WARPS``,
``DQ_NUM_STAGES`` (the dq kernel; default: the dk/dv kernel's), optional
``BWD_TMA_MIN_SEQ`` (with ``TMA``: the backward moves tiles through descriptors only when
the longer sequence has at least this many positions, else through pointers), optional
``ROW_BYTES_MAX`` (the config applies when one padded K/V row, ``BLOCK_D`` × element size,
fits in it; the launcher takes the first config that fits, else the last), ``num_warps``,
``num_stages``, and any other keyword (e.g. ``waves_per_eu`` on ROCm) goes to every launch
as a compiler option. The TMA path autotunes its forward instead, among the configs of the
tightest ``ROW_BYTES_MAX`` that fits (optional ``TMA`` and ``WARP_SPECIALIZE`` per
config), keyed on the sequence-length bucket, D, causal and dtype; its backward takes the
first that fits.
"""
from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import torch
import triton
import triton.language as tl

from .. import _replay
from ..registry import KernelSpec, Variant
from . import _attn_mods, _counters, _host

NAME = "flash_attn"

#: The constexpr switches of the forward kernel and their portable defaults (the generic
#: variant); a variant overrides some of them.
SWITCHES = {"UPCAST": False, "DEFERRED": False, "HEAD_SPLIT": 1, "TRANSPOSED": False,
            "TMA": False, "WARP_SPECIALIZE": False}
#: Switches a descriptor variant's config may set for its (autotuned) forward.
_CONFIG_SWITCHES = ("TMA", "WARP_SPECIALIZE")

#: What the descriptor path (``TMA``) takes: 16-bit inputs and head dims whose tiles need no
#: padding, for which its sm_90 configs are compiled and tuned.
TMA_DTYPES = (torch.float16, torch.bfloat16)
TMA_HEAD_DIMS = (64, 128)

_MAX_HEAD_DIM = _attn_mods.MAX_HEAD_DIM
_LOG2E = 1.4426950408889634
# Config keys the launcher reads itself; every other config kwarg is a compiler option.
_HOST_KEYS = frozenset({"BLOCK_M", "BLOCK_N", "BWD_BLOCK_M", "BWD_BLOCK_N", "BWD_NUM_WARPS",
                        "BWD_NUM_STAGES", "DQ_BLOCK_M", "DQ_BLOCK_N", "DQ_NUM_WARPS",
                        "DQ_NUM_STAGES", "BWD_TMA_MIN_SEQ", "ROW_BYTES_MAX",
                        *_CONFIG_SWITCHES})
# ... of which the forward kernel does not take these (the autotuned path drops them).
_NOT_FORWARD_KEYS = _HOST_KEYS - {"BLOCK_M", "BLOCK_N", *_CONFIG_SWITCHES}
# Sequence-length buckets below this are not autotuned: the first config that fits runs.
# Such launches are short and few-programmed, so tuning would cost more than it gains.
_TUNE_MIN_BUCKET = 512

LOG2E = tl.constexpr(_LOG2E)
LN2 = tl.constexpr(0.6931471805599453)


# --- tile helpers ---------------------------------------------------------------------------

@triton.jit
def _load_tile(base, offs_r, offs_c, stride_r, stride_c, n_r, n_c,
               CHECK_R: tl.constexpr, CHECK_C: tl.constexpr):
    """The [R, C] tile ``base[r * stride_r + c * stride_c]``, 0 where a checked index is out
    of range. Unchecked dimensions must be in range: an unmasked load past the end reads
    garbage (and masks along the contiguous dimension cost vectorized loads).

    The offsets are int64: within one head, rows times the sequence stride pass 2**31
    elements for long sequences in a (B, N, H, D) layout (2**19 keys at H·D = 4096). Only
    the [R] and [C] vectors are widened; the [R, C] sum is a 64-bit add either way."""
    ptrs = base + offs_r[:, None].to(tl.int64) * stride_r + offs_c[None, :].to(tl.int64) * stride_c
    if CHECK_R:
        if CHECK_C:
            tile = tl.load(ptrs, mask=(offs_r[:, None] < n_r) & (offs_c[None, :] < n_c), other=0.0)
        else:
            tile = tl.load(ptrs, mask=offs_r[:, None] < n_r, other=0.0)
    elif CHECK_C:
        tile = tl.load(ptrs, mask=offs_c[None, :] < n_c, other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def _load_seq_tile(base, offs_s, offs_d, stride_s, stride_d, n_s, D,
                   CHECK_S: tl.constexpr, PAD_D: tl.constexpr, D_MAJOR: tl.constexpr,
                   UPCAST: tl.constexpr):
    """Rows ``offs_s`` × head-dim columns ``offs_d`` of a (N, D) matrix: a [S, Dc] tile, or
    with ``D_MAJOR`` its transpose [Dc, S] read as a strided view (no copy, no tl.trans).
    Positions past ``n_s`` (when ``CHECK_S``) or ``D`` (when ``PAD_D``) read as 0."""
    if D_MAJOR:
        t = _load_tile(base, offs_d, offs_s, stride_d, stride_s, D, n_s, PAD_D, CHECK_S)
    else:
        t = _load_tile(base, offs_s, offs_d, stride_s, stride_d, n_s, D, CHECK_S, PAD_D)
    if UPCAST:
        t = t.to(tl.float32)
    return t


@triton.jit
def _store_seq_tile(base, tile, offs_s, offs_d, stride_s, stride_d, n_s, D,
                    PAD_D: tl.constexpr, D_MAJOR: tl.constexpr):
    """Store a [S, Dc] tile (or [Dc, S] with ``D_MAJOR``) in the output's dtype, rows past
    ``n_s`` and padded head-dim columns dropped."""
    # int64 offsets, as in _load_tile.
    offs_s64 = offs_s.to(tl.int64)
    offs_d64 = offs_d.to(tl.int64)
    if D_MAJOR:
        ptrs = base + offs_d64[:, None] * stride_d + offs_s64[None, :] * stride_s
        mask = offs_s[None, :] < n_s
        if PAD_D:
            mask = mask & (offs_d[:, None] < D)
    else:
        ptrs = base + offs_s64[:, None] * stride_s + offs_d64[None, :] * stride_d
        mask = offs_s[:, None] < n_s
        if PAD_D:
            mask = mask & (offs_d[None, :] < D)
    tl.store(ptrs, tile.to(base.dtype.element_ty), mask=mask)


# --- load paths: masked pointers, or tensor descriptors (TMA) ----------------------------------
# A "source" is what the tile helpers below read from: the (N, D) matrix's base pointer, or
# with TMA a tensor descriptor of it. The kernels build their sources once and pass them
# around, so the loops read the same whichever path the variant takes.

@triton.jit
def _seq_source(base, n_s, stride_s, D, BLOCK_S: tl.constexpr, BLOCK_DC: tl.constexpr,
                TMA: tl.constexpr):
    """``base`` for pointer loads; with ``TMA`` a device-side tensor descriptor of the
    (n_s, D) matrix at ``base`` (unit stride along D) that moves [BLOCK_S, BLOCK_DC] tiles.

    The copy engine reads rows past ``n_s`` and columns past ``D`` as zeros and drops them
    on stores, so descriptor tiles need no masks. It needs a 16-byte aligned ``base`` and
    ``stride_s``; :func:`tma_accepts` sends other problems to the pointer path."""
    if TMA:
        src = tl.make_tensor_descriptor(base, shape=[n_s, D], strides=[stride_s, 1],
                                        block_shape=[BLOCK_S, BLOCK_DC])
    else:
        src = base
    return src


@triton.jit
def _read_seq_tile(src, start_s, start_d, offs_s, offs_d, stride_s, stride_d, n_s, D,
                   CHECK_S: tl.constexpr, PAD_D: tl.constexpr, D_MAJOR: tl.constexpr,
                   UPCAST: tl.constexpr, TMA: tl.constexpr):
    """:func:`_load_seq_tile` from a source: rows ``start_s + [0, S)`` and columns
    ``start_d + [0, Dc)`` (= ``offs_s``, ``offs_d``). With ``TMA`` one bulk copy into shared
    memory; the transpose for ``D_MAJOR`` is a view of that buffer (the MMA reads 16-bit
    operands from shared memory in either order), not a data movement."""
    if TMA:
        t = src.load([start_s, start_d])
        if D_MAJOR:
            t = t.T
        if UPCAST:
            t = t.to(tl.float32)
    else:
        t = _load_seq_tile(src, offs_s, offs_d, stride_s, stride_d, n_s, D,
                           CHECK_S, PAD_D, D_MAJOR, UPCAST)
    return t


@triton.jit
def _write_seq_tile(dst, tile, start_s, start_d, offs_s, offs_d, stride_s, stride_d, n_s, D,
                    PAD_D: tl.constexpr, D_MAJOR: tl.constexpr, TMA: tl.constexpr):
    """:func:`_store_seq_tile` to a source (see :func:`_read_seq_tile`)."""
    if TMA:
        if D_MAJOR:
            tile = tile.T
        dst.store([start_s, start_d], tile.to(dst.dtype))
    else:
        _store_seq_tile(dst, tile, offs_s, offs_d, stride_s, stride_d, n_s, D, PAD_D, D_MAJOR)


# --- orientation helpers: the normal tile is [queries, keys], the transposed one [keys, queries]

@triton.jit
def _per_query(x, TRANSPOSED: tl.constexpr):
    """Broadcast a per-query vector [BLOCK_M] against a score tile or accumulator."""
    if TRANSPOSED:
        y = x[None, :]
    else:
        y = x[:, None]
    return y


@triton.jit
def _max_over_keys(s, TRANSPOSED: tl.constexpr):
    return tl.max(s, axis=0 if TRANSPOSED else 1)


@triton.jit
def _sum_over_keys(s, TRANSPOSED: tl.constexpr):
    return tl.sum(s, axis=0 if TRANSPOSED else 1)


@triton.jit
def _visible(offs_m, offs_n, N_K, diag, left, right,
             CAUSAL: tl.constexpr, WINDOW: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Which (query, key) pairs of a score tile count (``_attn_mods``: keys below ``N_K``;
    causal: ``j <= i + diag``; a window: ``-left <= j - i - diag <= right``). Causal alone is
    one compare per score: it folds both limits into a per-query last key,
    ``min(i + diag, N_K - 1)`` (loop-invariant, so hoisted)."""
    if TRANSPOSED:
        kj = offs_n[:, None]
    else:
        kj = offs_n[None, :]
    if WINDOW:
        ok = _attn_mods.visible(_per_query(offs_m, TRANSPOSED), kj, N_K, diag, left, right,
                                False, True)
    elif CAUSAL:
        ok = kj <= _per_query(tl.minimum(offs_m + diag, N_K - 1), TRANSPOSED)
    else:
        ok = kj < N_K
    return ok


@triton.jit
def _key_bounds(start_m, N_K, diag, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """The key range of a tile of queries ``[start_m, start_m + BLOCK_M)`` in three stages:
    ``[lo, full_lo)`` masked (blocks across a window's left edge), ``[full_lo, full_hi)``
    visible to every row of the tile (no mask), ``[full_hi, hi)`` masked (the causal
    diagonal or a window's right edge, and the Nk tail). Each bound but ``hi`` is a multiple
    of ``BLOCK_N``; an empty stage has equal ends. The set of queries that see a key is an
    interval, so a block the tile's first and last rows see in full, every row sees."""
    if WINDOW:
        last = start_m + BLOCK_M - 1
        lo = tl.maximum(start_m + diag - left, 0) // BLOCK_N * BLOCK_N
        hi = tl.minimum(last + diag + right + 1, N_K)
        full_lo = tl.cdiv(tl.maximum(last + diag - left, 0), BLOCK_N) * BLOCK_N
        full_hi = tl.maximum(tl.minimum(start_m + diag + right + 1, N_K), 0) // BLOCK_N * BLOCK_N
        full_lo = tl.maximum(tl.minimum(full_lo, hi), lo)
        full_hi = tl.maximum(full_hi, full_lo)
    elif CAUSAL:
        lo = 0
        full_lo = 0
        hi = tl.minimum(start_m + BLOCK_M + diag, N_K)
        full_hi = tl.maximum(tl.minimum(start_m + diag + 1, N_K), 0) // BLOCK_N * BLOCK_N
    else:
        lo = 0
        full_lo = 0
        hi = N_K
        full_hi = N_K // BLOCK_N * BLOCK_N
    return lo, full_lo, full_hi, hi


@triton.jit
def _query_bounds(start_n, N_Q, diag, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """``[lo, hi)``: the queries that may see a key of ``[start_n, start_n + BLOCK_N)``
    (``lo`` a multiple of ``BLOCK_M``): query ``i`` sees key ``j`` only for
    ``j - diag - right <= i <= j - diag + left``."""
    if WINDOW:
        lo = tl.maximum(start_n - diag - right, 0) // BLOCK_M * BLOCK_M
        hi = tl.minimum(start_n + BLOCK_N - diag + left, N_Q)
    elif CAUSAL:
        lo = tl.maximum(start_n - diag, 0) // BLOCK_M * BLOCK_M
        hi = N_Q
    else:
        lo = 0
        hi = N_Q
    return lo, hi


@triton.jit
def _capped_scores(qk, qk_scale, offs_m, offs_n, diag, softcap2, alibi2, SOFTCAP: tl.constexpr,
                   ALIBI: tl.constexpr, TRANSPOSED: tl.constexpr):
    """``(scores, capped)`` in the log2 domain from raw scores ``qk``: scaled, softcapped,
    then ALiBi (``_attn_mods``); ``capped`` is the score after the cap and before ALiBi,
    which the backward's chain rule through the cap needs."""
    if TRANSPOSED:
        kj = offs_n[:, None]
    else:
        kj = offs_n[None, :]
    qi = _per_query(offs_m, TRANSPOSED)
    if SOFTCAP:
        capped = _attn_mods.capped(qk, qk_scale, softcap2)
    else:
        capped = qk * qk_scale
    return _attn_mods.modify_scores(capped, qi, kj, diag, softcap2, alibi2, False, ALIBI), capped


@triton.jit
def _seq_bounds(Cu, b, VARLEN: tl.constexpr):
    """``(start, length)`` of sequence ``b`` of a packed batch (``cu_seqlens``), or
    ``(0, 0)`` without ``VARLEN`` (the caller keeps its dense length)."""
    if VARLEN:
        start = tl.load(Cu + b)
        length = tl.load(Cu + b + 1) - start
    else:
        start = 0
        length = 0
    return start, length


@triton.jit
def _mma(a, b, acc, SWAP: tl.constexpr):
    """``acc + a·b``, or ``acc + b·a`` with ``SWAP``: each dot of the transposed view is the
    normal view's dot with its operands exchanged (Sᵀ = K·Qᵀ, accᵀ += Vᵀ·Pᵀ)."""
    if SWAP:
        r = tl.dot(b, a, acc)
    else:
        r = tl.dot(a, b, acc)
    return r


# --- forward inner loop (V0, V1 and V2 alike) -------------------------------------------------

@triton.jit
def _finite_max(m, MAY_EMPTY: tl.constexpr):
    """The running max to subtract in exp2: ``m``, or 0 where a row has seen no key yet
    (``m = -inf``; only possible with ``MAY_EMPTY``), so that ``exp2(-inf - m)`` is 0 and not
    NaN."""
    if MAY_EMPTY:
        m = tl.where(m == float("-inf"), 0.0, m)
    return m


@triton.jit
def _attn_fwd_inner(
    acc0, acc1, l_i, m_i,                         # running state (see the kernel)
    q0, q1,                                       # query tile, one chunk per head-dim split
    k_src, v_src,                                 # this (batch, kv head)'s K and V sources
    stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, offs_d0, offs_d1,
    lo, hi, N_K, D, qk_scale,
    BLOCK_N: tl.constexpr, BLOCK_DC: tl.constexpr,
    MASKED: tl.constexpr,                         # blocks on the causal diagonal or the Nk tail
    CAUSAL: tl.constexpr, PAD_D: tl.constexpr,
    UPCAST: tl.constexpr, DEFERRED: tl.constexpr,
    HEAD_SPLIT: tl.constexpr, TRANSPOSED: tl.constexpr,
    TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    RAW_MAX: tl.constexpr,                        # qk_scale > 0 and no score mods (the kernel)
    diag, left, right, softcap2, alibi2,          # the options (_attn_mods; the kernel)
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    MAY_EMPTY: tl.constexpr,                      # a row may see no key at all
):
    # K is the right operand of q·kᵀ (so loaded as a Kᵀ view) in the normal orientation and
    # the left operand of K·Qᵀ in the transposed one; V the other way round.
    K_D_MAJOR: tl.constexpr = TRANSPOSED == False  # noqa: E712 (a constexpr, not a bool)
    # warp_specialize: the compiler gives the K/V copies to a producer warpgroup and the dots
    # and softmax to consumer warpgroups, decoupled by a ring of num_stages K/V buffers.
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        # -- scores (fp32), in the variant's orientation, one dot per head-dim chunk --
        k0 = _read_seq_tile(k_src, start_n, 0, offs_n, offs_d0, stride_kn, stride_kd, N_K, D,
                            MASKED, PAD_D, K_D_MAJOR, UPCAST, TMA)
        s = _mma(q0, k0, None, TRANSPOSED)
        if HEAD_SPLIT == 2:
            k1 = _read_seq_tile(k_src, start_n, BLOCK_DC, offs_n, offs_d1, stride_kn, stride_kd,
                                N_K, D, MASKED, PAD_D, K_D_MAJOR, UPCAST, TMA)
            s = _mma(q1, k1, s, TRANSPOSED)
        if SOFTCAP or ALIBI:
            s, _ = _capped_scores(s, qk_scale, offs_m, offs_n, diag, softcap2, alibi2, SOFTCAP,
                                  ALIBI, TRANSPOSED)
        elif not RAW_MAX:
            s = s * qk_scale
        if MASKED:
            # -inf: exp2 gives exactly 0, and the max never comes from a hidden key. Every
            # row sees key 0, so m_new below is finite and exp2(-inf - m_new) is no NaN.
            # (Descriptor loads read keys past Nk as zeros: finite scores, so masked too.)
            s = tl.where(_visible(offs_m, offs_n, N_K, diag, left, right, CAUSAL, WINDOW,
                                  TRANSPOSED), s, float("-inf"))
        # -- online softmax: rescale what was accumulated under the old max --
        if RAW_MAX:
            # A positive scale commutes with the max: take it over the raw scores and fold
            # the scale into the exponent's one FMA (s·scale - m), one multiply per score
            # fewer (-inf stays -inf). The FMA is written out (here and in the backward's
            # exp2): Triton may stop contracting mul+add by default (triton-lang/triton#11270).
            m_new = tl.maximum(m_i, _max_over_keys(s, TRANSPOSED) * qk_scale)
            m_use = _finite_max(m_new, MAY_EMPTY)
            p = tl.math.exp2(tl.fma(s, qk_scale, -_per_query(m_use, TRANSPOSED)))
        else:
            m_new = tl.maximum(m_i, _max_over_keys(s, TRANSPOSED))
            m_use = _finite_max(m_new, MAY_EMPTY)
            p = tl.math.exp2(s - _per_query(m_use, TRANSPOSED))
        alpha = tl.math.exp2(m_i - m_use)  # 0 on the first block (m_i = -inf)
        if DEFERRED:
            # Elementwise partial sums: no cross-thread reduction inside the loop.
            l_i = l_i * _per_query(alpha, TRANSPOSED) + p
        else:
            l_i = l_i * alpha + _sum_over_keys(p, TRANSPOSED)
        # -- acc += P·V per chunk (accᵀ += Vᵀ·Pᵀ when transposed) --
        v0 = _read_seq_tile(v_src, start_n, 0, offs_n, offs_d0, stride_vn, stride_vd, N_K, D,
                            MASKED, PAD_D, TRANSPOSED, UPCAST, TMA)
        # Tensor cores take both operands in the input dtype (fp32 under UPCAST).
        p = p.to(v0.dtype)
        acc0 = _mma(p, v0, acc0 * _per_query(alpha, TRANSPOSED), TRANSPOSED)
        if HEAD_SPLIT == 2:
            v1 = _read_seq_tile(v_src, start_n, BLOCK_DC, offs_n, offs_d1, stride_vn, stride_vd,
                                N_K, D, MASKED, PAD_D, TRANSPOSED, UPCAST, TMA)
            acc1 = _mma(p, v1, acc1 * _per_query(alpha, TRANSPOSED), TRANSPOSED)
        m_i = m_new
    return acc0, acc1, l_i, m_i


# --- kernels --------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["N_BUCKET"])
def _flash_attn_fwd_kernel(
    Q, K, V, Out, Lse,                                        # pointers; Lse: fp32 (B, H, Nq)
    CuQ, CuK, Alibi, Sinks,                                   # the options' (_mod_args)
    stride_qb, stride_qh, stride_qm, stride_qd,               # strides (elements)
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    H, GROUP, N_Q, N_K, D,                                    # sizes; GROUP = H // H_kv
    qk_scale,                                                 # sm_scale * log2(e)
    stride_ab, stride_ah, lse_stride_h, left, right, softcap2,
    N_BUCKET,                                                 # autotuning key only (_bucket)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, PAD_D: tl.constexpr,                # per call
    UPCAST: tl.constexpr, DEFERRED: tl.constexpr,             # per variant (module docstring)
    HEAD_SPLIT: tl.constexpr, TRANSPOSED: tl.constexpr,
    TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    RAW_MAX: tl.constexpr,                                    # per call: qk_scale > 0
    WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False,  # per call: the options
    ALIBI: tl.constexpr = False, SINKS: tl.constexpr = False,
    VARLEN: tl.constexpr = False, ALIGN_BR: tl.constexpr = False,
    MAY_EMPTY: tl.constexpr = False,
):
    # --- program id to tile ---
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP  # the K/V head this query head shares with its group
    # A packed batch (VARLEN): sequence b's rows start at cu_seqlens[b] of one long (N, D)
    # matrix per head; its lengths replace the dense ones (the grid covers the longest).
    q_start, n_q = _seq_bounds(CuQ, b, VARLEN)
    k_start, n_k = _seq_bounds(CuK, b, VARLEN)
    if VARLEN:
        N_Q = n_q
        N_K = n_k
        if start_m >= N_Q:
            return
    # int64 bases: batch and head strides times indices can pass 2**31 elements.
    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    o_base = Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    if VARLEN:
        q_base += q_start.to(tl.int64) * stride_qm
        o_base += q_start.to(tl.int64) * stride_om
        k_base += k_start.to(tl.int64) * stride_kn
        v_base += k_start.to(tl.int64) * stride_vn
    offs_m = start_m + tl.arange(0, BLOCK_M)
    BLOCK_DC: tl.constexpr = BLOCK_D // HEAD_SPLIT
    offs_d0 = tl.arange(0, BLOCK_DC)
    offs_d1 = offs_d0 + BLOCK_DC  # the second chunk; unused without a split
    # Pointers, or with TMA descriptors of this head's (N, D) matrices (built once here, so
    # the producer side of a warp-specialized loop only issues copies).
    q_src = _seq_source(q_base, N_Q, stride_qm, D, BLOCK_M, BLOCK_DC, TMA)
    k_src = _seq_source(k_base, N_K, stride_kn, D, BLOCK_N, BLOCK_DC, TMA)
    v_src = _seq_source(v_base, N_K, stride_vn, D, BLOCK_N, BLOCK_DC, TMA)
    o_src = _seq_source(o_base, N_Q, stride_om, D, BLOCK_M, BLOCK_DC, TMA)
    # The options: alignment of the diagonal, this head's ALiBi slope (log2 units).
    if ALIGN_BR:
        diag = N_K - N_Q
    else:
        diag = 0
    if ALIBI:
        alibi2 = tl.load(Alibi + b * stride_ab + h * stride_ah) * LOG2E
    else:
        alibi2 = 0.0

    # --- query tile: loaded once, held for the whole key loop ---
    # Rows past Nq read as 0: their scores are finite and their outputs are never stored.
    q0 = _read_seq_tile(q_src, start_m, 0, offs_m, offs_d0, stride_qm, stride_qd, N_Q, D,
                        True, PAD_D, TRANSPOSED, UPCAST, TMA)
    q1 = q0
    if HEAD_SPLIT == 2:
        q1 = _read_seq_tile(q_src, start_m, BLOCK_DC, offs_m, offs_d1, stride_qm, stride_qd,
                            N_Q, D, True, PAD_D, TRANSPOSED, UPCAST, TMA)

    # --- running state: max and row sum in the exp2 domain, fp32 accumulators ---
    # A sink is a key with logit sink[h] and value 0: the state starts as if it had been
    # seen (max = its logit, sum = exp2(0) = 1), so it takes its share and adds nothing.
    if SINKS:
        m_i = tl.full([BLOCK_M], 0.0, tl.float32) + tl.load(Sinks + h).to(tl.float32) * LOG2E
        l_init = 1.0
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_init = 0.0
    if DEFERRED:
        # The sink's 1 spread over the partial sums (BLOCK_N is a power of two: exact).
        if TRANSPOSED:
            l_i = tl.full([BLOCK_N, BLOCK_M], l_init / BLOCK_N, tl.float32)
        else:
            l_i = tl.full([BLOCK_M, BLOCK_N], l_init / BLOCK_N, tl.float32)
    else:
        l_i = tl.full([BLOCK_M], l_init, tl.float32)
    if TRANSPOSED:
        acc0 = tl.zeros([BLOCK_DC, BLOCK_M], tl.float32)
    else:
        acc0 = tl.zeros([BLOCK_M, BLOCK_DC], tl.float32)
    acc1 = acc0

    # --- key loop: blocks across a window's left edge (masked), blocks every row sees in
    # full (no mask), then the diagonal or the window's right edge and the tail (masked) ---
    lo, full_lo, full_hi, hi = _key_bounds(start_m, N_K, diag, left, right, BLOCK_M, BLOCK_N,
                                           CAUSAL, WINDOW)
    if WARP_SPECIALIZE:
        # One warp-specialized loop over every block, each masked: Triton 3.6 cannot
        # warp-specialize for sm_90 a kernel with dots outside the specialized loop (the
        # compiler fails) or a loop body with a branch (it silently does not specialize).
        acc0, acc1, l_i, m_i = _attn_fwd_inner(
            acc0, acc1, l_i, m_i, q0, q1, k_src, v_src,
            stride_kn, stride_kd, stride_vn, stride_vd, offs_m, offs_d0, offs_d1,
            lo, hi, N_K, D, qk_scale,
            BLOCK_N, BLOCK_DC, True, CAUSAL, PAD_D, UPCAST, DEFERRED, HEAD_SPLIT, TRANSPOSED,
            TMA, True, RAW_MAX, diag, left, right, softcap2, alibi2,
            WINDOW, SOFTCAP, ALIBI, MAY_EMPTY)
    else:
        if WINDOW:
            acc0, acc1, l_i, m_i = _attn_fwd_inner(
                acc0, acc1, l_i, m_i, q0, q1, k_src, v_src,
                stride_kn, stride_kd, stride_vn, stride_vd, offs_m, offs_d0, offs_d1,
                lo, full_lo, N_K, D, qk_scale,
                BLOCK_N, BLOCK_DC, True, CAUSAL, PAD_D, UPCAST, DEFERRED, HEAD_SPLIT,
                TRANSPOSED, TMA, False, RAW_MAX, diag, left, right, softcap2, alibi2,
                WINDOW, SOFTCAP, ALIBI, MAY_EMPTY)
        acc0, acc1, l_i, m_i = _attn_fwd_inner(
            acc0, acc1, l_i, m_i, q0, q1, k_src, v_src,
            stride_kn, stride_kd, stride_vn, stride_vd, offs_m, offs_d0, offs_d1,
            full_lo, full_hi, N_K, D, qk_scale,
            BLOCK_N, BLOCK_DC, False, CAUSAL, PAD_D, UPCAST, DEFERRED, HEAD_SPLIT, TRANSPOSED,
            TMA, False, RAW_MAX, diag, left, right, softcap2, alibi2,
            WINDOW, SOFTCAP, ALIBI, MAY_EMPTY)
        acc0, acc1, l_i, m_i = _attn_fwd_inner(
            acc0, acc1, l_i, m_i, q0, q1, k_src, v_src,
            stride_kn, stride_kd, stride_vn, stride_vd, offs_m, offs_d0, offs_d1,
            full_hi, hi, N_K, D, qk_scale,
            BLOCK_N, BLOCK_DC, True, CAUSAL, PAD_D, UPCAST, DEFERRED, HEAD_SPLIT, TRANSPOSED,
            TMA, False, RAW_MAX, diag, left, right, softcap2, alibi2,
            WINDOW, SOFTCAP, ALIBI, MAY_EMPTY)

    # --- write-back: normalize, store out (through transposed strides if so) and LSE ---
    if DEFERRED:
        l_i = _sum_over_keys(l_i, TRANSPOSED)  # the one cross-thread reduction of the sums
    if MAY_EMPTY:
        # A row that saw no key has acc = 0 and l = 0: its output is 0, not 0/0.
        inv_l = _per_query(tl.where(l_i > 0, 1.0 / l_i, 0.0), TRANSPOSED)
    else:
        inv_l = _per_query(1.0 / l_i, TRANSPOSED)
    _write_seq_tile(o_src, acc0 * inv_l, start_m, 0, offs_m, offs_d0, stride_om, stride_od,
                    N_Q, D, PAD_D, TRANSPOSED, TMA)
    if HEAD_SPLIT == 2:
        _write_seq_tile(o_src, acc1 * inv_l, start_m, BLOCK_DC, offs_m, offs_d1, stride_om,
                        stride_od, N_Q, D, PAD_D, TRANSPOSED, TMA)
    # -inf for a row that saw nothing (m = -inf, log2 0 = -inf).
    lse = (m_i + tl.math.log2(l_i)) * LN2
    tl.store(Lse + _lse_row(bh, h, N_Q, q_start, lse_stride_h, VARLEN) + offs_m, lse,
             mask=offs_m < N_Q)


@triton.jit
def _lse_row(bh, h, N_Q, q_start, lse_stride_h, VARLEN: tl.constexpr):
    """Where (batch, head)'s row of the LSE (and delta) starts: (B, H, Nq) dense, or
    FlashAttention's (H, total_q) for a packed batch."""
    if VARLEN:
        row = h.to(tl.int64) * lse_stride_h + q_start
    else:
        row = bh.to(tl.int64) * N_Q
    return row


@triton.jit
def _flash_attn_bwd_preprocess_kernel(
    Out, DO, Delta,                                           # Delta: fp32, the LSE's layout
    CuQ,                                                      # a packed batch (VARLEN)
    stride_ob, stride_oh, stride_om, stride_od,
    stride_dob, stride_doh, stride_dom, stride_dod,
    H, N_Q, D,
    lse_stride_h,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, PAD_D: tl.constexpr,
    VARLEN: tl.constexpr = False,
):
    # --- program id to tile ---
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    q_start, n_q = _seq_bounds(CuQ, b, VARLEN)
    o_base = Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    do_base = DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
    if VARLEN:
        N_Q = n_q
        if start_m >= N_Q:
            return
        o_base += q_start.to(tl.int64) * stride_om
        do_base += q_start.to(tl.int64) * stride_dom
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    # --- delta = rowsum(dO * O), in fp32 whatever the dtype (an elementwise product) ---
    o = _load_seq_tile(o_base, offs_m, offs_d, stride_om, stride_od, N_Q, D, True, PAD_D, False,
                       True)
    do = _load_seq_tile(do_base, offs_m, offs_d, stride_dom, stride_dod, N_Q, D, True, PAD_D,
                        False, True)
    tl.store(Delta + _lse_row(bh, h, N_Q, q_start, lse_stride_h, VARLEN) + offs_m,
             tl.sum(o * do, axis=1), mask=offs_m < N_Q)


@triton.jit
def _bwd_probs(qk, lse2, qk_scale, offs_m, offs_n, diag, softcap2, alibi2,
               SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, TRANSPOSED: tl.constexpr):
    """``(p, dcap)`` from raw scores ``qk`` and the rows' LSE (log2 units): the
    probabilities the forward used, and the factor that carries a score's gradient back
    through the softcap (1 without one)."""
    if SOFTCAP or ALIBI:
        s2, capped = _capped_scores(qk, qk_scale, offs_m, offs_n, diag, softcap2, alibi2,
                                    SOFTCAP, ALIBI, TRANSPOSED)
        p = tl.math.exp2(s2 - _per_query(lse2, TRANSPOSED))
    else:
        capped = qk
        p = tl.math.exp2(tl.fma(qk, qk_scale, -_per_query(lse2, TRANSPOSED)))
    return p, _attn_mods.softcap_grad(capped, softcap2, SOFTCAP)


@triton.jit
def _flash_attn_bwd_dkdv_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV,                          # pointers
    CuQ, CuK, Alibi, Sinks,                                   # the options' (_mod_args)
    stride_qb, stride_qh, stride_qm, stride_qd,               # strides (elements)
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    H, H_KV, GROUP, N_Q, N_K, D,                              # sizes
    sm_scale, qk_scale,
    stride_ab, stride_ah, lse_stride_h, left, right, softcap2,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, PAD_D: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr,
    WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
    ALIBI: tl.constexpr = False, SINKS: tl.constexpr = False,
    VARLEN: tl.constexpr = False, ALIGN_BR: tl.constexpr = False,
    MAY_EMPTY: tl.constexpr = False,
):
    # --- program id to tile: BLOCK_N keys of one (batch, kv head) ---
    start_n = tl.program_id(0) * BLOCK_N
    bhk = tl.program_id(1)
    b = bhk // H_KV
    hk = bhk % H_KV
    q_start, n_q = _seq_bounds(CuQ, b, VARLEN)
    k_start, n_k = _seq_bounds(CuK, b, VARLEN)
    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    dk_base = DK + b.to(tl.int64) * stride_dkb + hk.to(tl.int64) * stride_dkh
    dv_base = DV + b.to(tl.int64) * stride_dvb + hk.to(tl.int64) * stride_dvh
    q_off = b.to(tl.int64) * stride_qb
    do_off = b.to(tl.int64) * stride_dob
    if VARLEN:
        N_Q = n_q
        N_K = n_k
        if start_n >= N_K:
            return
        k_base += k_start.to(tl.int64) * stride_kn
        v_base += k_start.to(tl.int64) * stride_vn
        dk_base += k_start.to(tl.int64) * stride_dkn
        dv_base += k_start.to(tl.int64) * stride_dvn
        q_off += q_start.to(tl.int64) * stride_qm
        do_off += q_start.to(tl.int64) * stride_dom
    if ALIGN_BR:
        diag = N_K - N_Q
    else:
        diag = 0
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k_src = _seq_source(k_base, N_K, stride_kn, D, BLOCK_N, BLOCK_D, TMA)
    v_src = _seq_source(v_base, N_K, stride_vn, D, BLOCK_N, BLOCK_D, TMA)
    k = _read_seq_tile(k_src, start_n, 0, offs_n, offs_d, stride_kn, stride_kd, N_K, D,
                       True, PAD_D, False, UPCAST, TMA)
    v = _read_seq_tile(v_src, start_n, 0, offs_n, offs_d, stride_vn, stride_vd, N_K, D,
                       True, PAD_D, False, UPCAST, TMA)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    # Causal or a window: only the query blocks that may see these keys. One loop, masked
    # throughout, unlike the forward and the dq kernel: split into the diagonal blocks
    # (masked) and the rest (no mask), this kernel ran 10-22% slower on the H200 (causal,
    # fp16, D=64 and 128, N=1024 and 4096, triton 3.6).
    lo, hi = _query_bounds(start_n, N_Q, diag, left, right, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)

    # --- main loop: every query head of the GQA group, every query block ---
    # Summing the group here, in fp32 registers, is the GQA reduction of dk and dv.
    for g in range(0, GROUP):
        h = hk * GROUP + g
        q_src = _seq_source(Q + q_off + h.to(tl.int64) * stride_qh, N_Q, stride_qm, D, BLOCK_M,
                            BLOCK_D, TMA)
        do_src = _seq_source(DO + do_off + h.to(tl.int64) * stride_doh, N_Q, stride_dom, D,
                             BLOCK_M, BLOCK_D, TMA)
        row = _lse_row(b * H + h, h, N_Q, q_start, lse_stride_h, VARLEN)
        if ALIBI:
            alibi2 = tl.load(Alibi + b * stride_ab + h * stride_ah) * LOG2E
        else:
            alibi2 = 0.0
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            # The transposed orientation is natural here: Pᵀ [keys, queries] = exp(K·Qᵀ - LSE).
            qT = _read_seq_tile(q_src, start_m, 0, offs_m, offs_d, stride_qm, stride_qd, N_Q, D,
                                True, PAD_D, True, UPCAST, TMA)
            do = _read_seq_tile(do_src, start_m, 0, offs_m, offs_d, stride_dom, stride_dod, N_Q,
                                D, True, PAD_D, False, UPCAST, TMA)
            # Rows past Nq get LSE = +inf so their probabilities are exactly 0.
            lse = tl.load(Lse + row + offs_m, mask=offs_m < N_Q, other=float("inf"))
            delta = tl.load(Delta + row + offs_m, mask=offs_m < N_Q, other=0.0)
            pT, dcap = _bwd_probs(tl.dot(k, qT), lse * LOG2E, qk_scale, offs_m, offs_n, diag,
                                  softcap2, alibi2, SOFTCAP, ALIBI, True)
            if CAUSAL or WINDOW:
                # A select, not a multiply: a hidden key's exp2 may be inf (a row that sees
                # no key has LSE = -inf).
                pT = tl.where(_visible(offs_m, offs_n, N_K, diag, left, right, CAUSAL, WINDOW,
                                       True), pT, 0.0)
            dv = tl.dot(pT.to(do.dtype), do, dv)
            dpT = tl.dot(v, tl.trans(do))
            dsT = pT * (dpT - _per_query(delta, True)) * dcap
            dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk)

    # --- write-back (rows past Nk dropped) ---
    dk_dst = _seq_source(dk_base, N_K, stride_dkn, D, BLOCK_N, BLOCK_D, TMA)
    dv_dst = _seq_source(dv_base, N_K, stride_dvn, D, BLOCK_N, BLOCK_D, TMA)
    _write_seq_tile(dk_dst, dk * sm_scale, start_n, 0, offs_n, offs_d, stride_dkn, stride_dkd,
                    N_K, D, PAD_D, False, TMA)
    _write_seq_tile(dv_dst, dv, start_n, 0, offs_n, offs_d, stride_dvn, stride_dvd, N_K, D,
                    PAD_D, False, TMA)


@triton.jit
def _bwd_dq_inner(
    dq, q, do, lse2, delta,                       # one query block: accumulator, tiles, rows
    k_src, v_src, stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, offs_d, lo, hi, N_K, D, qk_scale,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,                         # blocks on the causal diagonal or the Nk tail
    CAUSAL: tl.constexpr, PAD_D: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr,
    diag, left, right, softcap2, alibi2,          # the options (the forward kernel)
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
):
    """The key blocks ``[lo, hi)`` added into a query block's dq. Without ``MASKED`` every
    key of every block is below ``N_K`` and visible to every query of the block."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kT = _read_seq_tile(k_src, start_n, 0, offs_n, offs_d, stride_kn, stride_kd, N_K, D,
                            MASKED, PAD_D, True, UPCAST, TMA)
        vT = _read_seq_tile(v_src, start_n, 0, offs_n, offs_d, stride_vn, stride_vd, N_K, D,
                            MASKED, PAD_D, True, UPCAST, TMA)
        p, dcap = _bwd_probs(tl.dot(q, kT), lse2, qk_scale, offs_m, offs_n, diag, softcap2,
                             alibi2, SOFTCAP, ALIBI, False)
        if MASKED:
            # A select, not a multiply: exp2 of a hidden key's score may overflow to inf.
            p = tl.where(_visible(offs_m, offs_n, N_K, diag, left, right, CAUSAL, WINDOW,
                                  False), p, 0.0)
        dp = tl.dot(do, vT)
        ds = p * (dp - delta[:, None]) * dcap
        dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq)
    return dq


@triton.jit
def _flash_attn_bwd_dq_kernel(
    Q, K, V, DO, Lse, Delta, DQ,                              # pointers
    CuQ, CuK, Alibi, Sinks,                                   # the options' (_mod_args)
    stride_qb, stride_qh, stride_qm, stride_qd,               # strides (elements)
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    H, GROUP, N_Q, N_K, D,                                    # sizes
    sm_scale, qk_scale,
    stride_ab, stride_ah, lse_stride_h, left, right, softcap2,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, PAD_D: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr,
    WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
    ALIBI: tl.constexpr = False, SINKS: tl.constexpr = False,
    VARLEN: tl.constexpr = False, ALIGN_BR: tl.constexpr = False,
    MAY_EMPTY: tl.constexpr = False,
):
    # --- program id to tile: BLOCK_M queries of one (batch, head) ---
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP
    q_start, n_q = _seq_bounds(CuQ, b, VARLEN)
    k_start, n_k = _seq_bounds(CuK, b, VARLEN)
    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    do_base = DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
    dq_base = DQ + b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh
    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    if VARLEN:
        N_Q = n_q
        N_K = n_k
        if start_m >= N_Q:
            return
        q_base += q_start.to(tl.int64) * stride_qm
        do_base += q_start.to(tl.int64) * stride_dom
        dq_base += q_start.to(tl.int64) * stride_dqm
        k_base += k_start.to(tl.int64) * stride_kn
        v_base += k_start.to(tl.int64) * stride_vn
    if ALIGN_BR:
        diag = N_K - N_Q
    else:
        diag = 0
    if ALIBI:
        alibi2 = tl.load(Alibi + b * stride_ab + h * stride_ah) * LOG2E
    else:
        alibi2 = 0.0
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    k_src = _seq_source(k_base, N_K, stride_kn, D, BLOCK_N, BLOCK_D, TMA)
    v_src = _seq_source(v_base, N_K, stride_vn, D, BLOCK_N, BLOCK_D, TMA)
    q_src = _seq_source(q_base, N_Q, stride_qm, D, BLOCK_M, BLOCK_D, TMA)
    do_src = _seq_source(do_base, N_Q, stride_dom, D, BLOCK_M, BLOCK_D, TMA)
    q = _read_seq_tile(q_src, start_m, 0, offs_m, offs_d, stride_qm, stride_qd, N_Q, D,
                       True, PAD_D, False, UPCAST, TMA)
    do = _read_seq_tile(do_src, start_m, 0, offs_m, offs_d, stride_dom, stride_dod, N_Q, D,
                        True, PAD_D, False, UPCAST, TMA)
    row = _lse_row(bh, h, N_Q, q_start, lse_stride_h, VARLEN)
    lse = tl.load(Lse + row + offs_m, mask=offs_m < N_Q, other=float("inf"))
    delta = tl.load(Delta + row + offs_m, mask=offs_m < N_Q, other=0.0)
    lse2 = lse * LOG2E
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # --- key blocks in three stages, as the forward: across a window's left edge (masked),
    # those every query of the tile sees in full (no mask), then the causal diagonal or the
    # window's right edge and the Nk tail (masked) ---
    lo, full_lo, full_hi, hi = _key_bounds(start_m, N_K, diag, left, right, BLOCK_M, BLOCK_N,
                                           CAUSAL, WINDOW)
    if WINDOW:
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_src, v_src,
                           stride_kn, stride_kd, stride_vn, stride_vd, offs_m, offs_d,
                           lo, full_lo, N_K, D, qk_scale,
                           BLOCK_N, True, CAUSAL, PAD_D, UPCAST, TMA,
                           diag, left, right, softcap2, alibi2, WINDOW, SOFTCAP, ALIBI)
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_src, v_src,
                       stride_kn, stride_kd, stride_vn, stride_vd, offs_m, offs_d,
                       full_lo, full_hi, N_K, D, qk_scale,
                       BLOCK_N, False, CAUSAL, PAD_D, UPCAST, TMA,
                       diag, left, right, softcap2, alibi2, WINDOW, SOFTCAP, ALIBI)
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_src, v_src,
                       stride_kn, stride_kd, stride_vn, stride_vd, offs_m, offs_d,
                       full_hi, hi, N_K, D, qk_scale,
                       BLOCK_N, True, CAUSAL, PAD_D, UPCAST, TMA,
                       diag, left, right, softcap2, alibi2, WINDOW, SOFTCAP, ALIBI)

    # --- write-back ---
    dq_dst = _seq_source(dq_base, N_Q, stride_dqm, D, BLOCK_M, BLOCK_D, TMA)
    _write_seq_tile(dq_dst, dq * sm_scale, start_m, 0, offs_m, offs_d, stride_dqm, stride_dqd,
                    N_Q, D, PAD_D, False, TMA)


# --- host launcher --------------------------------------------------------------------------

class Problem(NamedTuple):
    device: torch.device
    dtype: torch.dtype
    head_dim: int
    causal: bool
    gqa: bool
    descriptor_issue: str  # why tensor descriptors cannot describe q, k, v ("" when they can)
    keys: int  # Nk rounded down to a power of two (0: no keys), for predicates about length
    options: str = ""  # the options set beyond causal (window, softcap, ...), "" for none


class Mods(NamedTuple):
    """What a call asks of the kernels beyond ``causal`` and the scale: FlashAttention's
    options (``_attn_mods.Options``), the diagonal's alignment, and for a packed batch
    (``flash_attn_varlen``) its ``cu_seqlens``, number of sequences, longest lengths and
    ``total_q`` (the LSE's row stride: it is (H, total_q) there)."""
    options: _attn_mods.Options
    align_br: bool = False
    cu_q: Any = None
    cu_k: Any = None
    batch: int = 0
    max_q: int = 0
    max_k: int = 0
    total_q: int = 0

    @property
    def varlen(self) -> bool:
        return self.cu_q is not None

    @property
    def plain(self) -> bool:
        """Nothing but SDPA's attention: no option, top-left diagonal, no packed batch."""
        return self.options is _attn_mods.plain(self.options.causal) and not (
            self.align_br or self.varlen)


def _mods(causal: bool) -> Mods:
    return _PLAIN_MODS[causal]


_PLAIN_MODS = {c: Mods(_attn_mods.plain(c)) for c in (False, True)}
#: ``align`` values of :func:`launch` and what they mean for the diagonal.
ALIGNMENTS = {"top_left": False, "bottom_right": True}


def _mod_args(mods: Mods, placeholder: torch.Tensor) -> tuple[tuple, tuple, dict]:
    """The kernels' option arguments: their pointers (after the kernel's own), their
    scalars (after the scale) and their constexpr switches. ``placeholder`` stands in for
    pointers the switches leave unread. Pointers lead a launch's arguments, as direct
    launches (``portable_kernels._direct``) need: a tensor among the scalars keeps
    Triton's JIT launch on every call."""
    o = mods.options
    alibi = o.alibi
    pointers = (placeholder if mods.cu_q is None else mods.cu_q,
                placeholder if mods.cu_k is None else mods.cu_k,
                placeholder if alibi is None else alibi,
                placeholder if o.sinks is None else o.sinks)
    args = (*((0, 0) if alibi is None else alibi.stride()),
            mods.total_q, o.left, o.right, o.softcap2 or 1.0)
    flags = {"WINDOW": o.window, "SOFTCAP": o.softcap2 > 0, "ALIBI": alibi is not None,
             "SINKS": o.sinks is not None, "VARLEN": mods.varlen, "ALIGN_BR": mods.align_br,
             # Rows that see no key: bottom-right causal with Nq > Nk, a window, or a packed
             # sequence without keys (a sink is always seen).
             "MAY_EMPTY": o.sinks is None and ((mods.align_br and o.causal) or o.window
                                               or mods.varlen)}
    return pointers, args, flags


def _strides(t: torch.Tensor, mods: Mods) -> tuple:
    """A 4-D operand's strides; a packed batch's (1, H, total, D) view has no batch stride
    (the kernels find each sequence through ``cu_seqlens``)."""
    return (0, *t.stride()[1:]) if mods.varlen else t.stride()


def _descriptor_issue(d: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """Why a tensor descriptor cannot describe each (batch, head)'s (N, D) matrix of q, k
    or v (head dim ``d``), or "". The copy engine needs unit stride along D, and 16-byte
    aligned base addresses and strides (batch and head strides too: they offset the base).
    It runs on every call, so contiguous tensors (strides are multiples of D) take one test,
    and its fixed messages keep the selection cache small."""
    align = 16 // q.element_size()  # one dtype (problem checked it); a power of two
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.is_contiguous() and d % align == 0 and t.data_ptr() % 16 == 0:
            continue
        sb, sh, sn, sd = t.stride()
        issue = matrix_issue(t, d, sb, sh, sn, sd, t.shape[0], t.shape[1])
        if issue:
            return f"{name}'s {issue}"
    return ""


def matrix_issue(t: torch.Tensor, d: int, sb: int, sh: int, sn: int, sd: int, nb: int,
                 nh: int) -> str:
    """Why a tensor descriptor cannot describe each of ``t``'s ``nb`` x ``nh`` (N, D)
    matrices (``sb``, ``sh``: the strides between them; ``sn`` between rows, ``sd`` along
    D; head dim ``d``), or "": unit stride along D, and 16-byte aligned base address and
    strides. The batch and head strides offset each matrix's base, so they count where
    there is more than one batch or head. Shared with flash_attn_with_kvcache, whose
    caches hold the same matrices in (B, N, H, D) order."""
    if sd != 1 and d > 1:
        return "head dim is not contiguous (stride(-1) != 1)"
    align = 16 // t.element_size()  # a power of two
    if (t.data_ptr() % 16 or sn % align or sn < d or (nb > 1 and sb % align)
            or (nh > 1 and sh % align)):
        return ("base address or batch/head/sequence strides are not multiples of 16 bytes "
                "(or its rows overlap)")
    return ""


def options_key(options: _attn_mods.Options, align_br: bool) -> str:
    """The options a call sets, as a short word list for selection keys and predicates."""
    if options is _attn_mods.plain(options.causal) and not align_br:
        return ""
    words = [w for w, on in (("bottom-right", align_br), ("window", options.window),
                             ("softcap", options.softcap2 > 0),
                             ("alibi", options.alibi is not None),
                             ("sinks", options.sinks is not None)) if on]
    return ",".join(words) or "options"


def problem(q, k, v, causal: bool = False, sm_scale: float | None = None, *,
            window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None, sinks=None,
            align: str = "top_left", return_lse: bool = False) -> Problem:
    """Check a ``flash_attn`` call and return its selection key.

    All input validation happens here, before selection and launch: ``ValueError``
    (``InputError``) for shapes, ``TypeError`` (``DTypeError``) for dtypes and types.
    """
    device = _host.same_device(NAME, q=q, k=k, v=v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _host.check_ndim(NAME, name, t, 4, "(B, H, N, D)")
        _host.check_dtype(NAME, name, t)
    dtype = _host.check_same_dtype(NAME, q=q, k=k, v=v)
    (bq, h, _, d), (bk, h_kv, n_k, dk), (bv, h_v, n_v, dv) = q.shape, k.shape, v.shape
    if not bq == bk == bv:
        raise _host.InputError(
            f"{NAME}: q, k and v must have the same batch size, got q {bq}, k {bk}, v {bv}")
    if not d == dk == dv:
        raise _host.InputError(
            f"{NAME}: q, k and v must have the same head dim D, got q {d}, k {dk}, v {dv}")
    if h_kv != h_v:
        raise _host.InputError(
            f"{NAME}: k and v must have the same number of heads, got k {h_kv}, v {h_v}")
    if n_k != n_v:
        raise _host.InputError(
            f"{NAME}: k and v must have the same sequence length, got k {n_k}, v {n_v}")
    _attn_mods.check_heads(NAME, h, h_kv, d)
    _host.check_bool(NAME, "causal", causal)
    _attn_mods.check_scale(NAME, sm_scale)
    options = _attn_mods.check_options(
        NAME, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, sinks=sinks, batch=bq, heads=h, device=device)
    _host.check_bool(NAME, "return_lse", return_lse)
    return Problem(device, dtype, d, bool(causal), h != h_kv, _descriptor_issue(d, q, k, v),
                   key_class(n_k), options_key(options, _align(align)))


def key_class(n_k: int) -> int:
    """``Problem.keys``: the largest power of two not above ``n_k`` (0 for none). Coarse, so
    that a growing KV cache meets few selection-cache entries; a predicate with a
    power-of-two threshold on Nk decides exactly on it."""
    return 1 << (n_k.bit_length() - 1) if n_k > 0 else 0


def _align(align: Any) -> bool:
    """``align`` as the kernels' ``ALIGN_BR`` (an error naming it otherwise)."""
    try:
        return ALIGNMENTS[align]
    except (KeyError, TypeError):
        raise _host.ArgumentError(f"{NAME}: align must be one of {sorted(ALIGNMENTS)}, got "
                                  f"{align!r}") from None


def tma_accepts(problem: Problem, device) -> str | None:
    """Predicate of descriptor (TMA) variants; what they cannot take goes elsewhere."""
    if problem.dtype not in TMA_DTYPES:
        return (f"{_host._dtype_name(problem.dtype)} inputs stay on pointer loads: the "
                "descriptor path takes float16 and bfloat16 (tf32 MMAs read only K-major "
                "operands from shared memory, which V's tiles are not)")
    if problem.head_dim not in TMA_HEAD_DIMS:
        return (f"head dim {problem.head_dim} stays on pointer loads: the descriptor path "
                f"takes D in {TMA_HEAD_DIMS} (other sizes need padded, masked columns)")
    if problem.descriptor_issue:
        return f"no tensor descriptor fits: {problem.descriptor_issue}"
    return _host.dtype_supported(problem, device)


def _block_d(d: int) -> int:
    return max(16, _host.next_power_of_2(d))


def _config(plan, block_d: int, itemsize: int) -> triton.Config:
    """The first config whose ``ROW_BYTES_MAX`` fits one padded K/V row, else the last."""
    row = block_d * itemsize

    def pick() -> triton.Config:
        _ = plan.config  # a clear error when the plan has no configs
        for cfg in plan.configs:
            if cfg.kwargs.get("ROW_BYTES_MAX", row) >= row:
                return cfg
        return plan.configs[-1]

    return plan.cached((NAME, "config", row), pick)


def _options(cfg: triton.Config, kernel: str = "forward") -> dict[str, Any]:
    """Launch options of a config for ``kernel`` ("forward", "dkdv" or "dq"): warps,
    stages and backend compiler options."""
    opts = {k: v for k, v in cfg.kwargs.items() if k not in _HOST_KEYS}
    opts.update(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if kernel != "forward":
        kw = cfg.kwargs
        warps = kw.get("BWD_NUM_WARPS", cfg.num_warps)
        stages = kw.get("BWD_NUM_STAGES", cfg.num_stages)
        if kernel == "dq":
            warps, stages = kw.get("DQ_NUM_WARPS", warps), kw.get("DQ_NUM_STAGES", stages)
        opts.update(num_warps=warps, num_stages=stages)
    return opts


def _backward_blocks(cfg: triton.Config) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N)`` of the dk/dv kernel, then of the dq kernel. Each kernel
    holds one block in registers and streams the other, so their best shapes differ:
    dk/dv holds ``BLOCK_N`` keys, dq holds ``BLOCK_M`` queries (64 at least, for sm_90's
    warpgroup MMA). The dq kernel's default is the dk/dv shape."""
    kw = cfg.kwargs
    m = kw.get("BWD_BLOCK_M", kw["BLOCK_M"])
    n = kw.get("BWD_BLOCK_N", kw["BLOCK_N"])
    return m, n, kw.get("DQ_BLOCK_M", m), kw.get("DQ_BLOCK_N", n)


def _switches(plan, block_d: int) -> dict[str, Any]:
    def build() -> dict[str, Any]:
        switches = {k: plan.switches.get(k, default) for k, default in SWITCHES.items()}
        # tl.dot needs chunks of at least 16 columns.
        if switches["HEAD_SPLIT"] != 1 and block_d // switches["HEAD_SPLIT"] < 16:
            switches["HEAD_SPLIT"] = 1
        return switches

    return plan.cached((NAME, "switches", block_d), build)


def _bucket(n_q: int, n_k: int) -> int:
    """The autotuning key of a sequence-length pair: the next power of two of the longer
    one, so that lengths of one bucket share a tuning result."""
    return _host.next_power_of_2(max(n_q, n_k))


def _candidates(configs: list, classes: dict, row: int, bucket: int) -> list:
    """The configs to autotune among for a padded row of ``row`` bytes and a sequence
    bucket: those of the tightest row class (``classes[config]``: the ``ROW_BYTES_MAX``
    values it was listed under) that fits, as :func:`_config` takes the first config that
    fits (none fitting: the last config); below ``_TUNE_MIN_BUCKET`` only the first."""
    fitting = [r for c in configs for r in classes.get(c, {math.inf}) if r >= row]
    if not fitting:
        return configs[-1:]
    tight = min(fitting)
    fit = [c for c in configs if tight in classes.get(c, {math.inf})]
    return fit if bucket >= _TUNE_MIN_BUCKET else fit[:1]


def _autotuned_forward(plan):
    """The forward kernel autotuned among the plan's configs (descriptor path).

    Each config's forward part (``BLOCK_M``, ``BLOCK_N``, warps, stages, compiler options,
    and the ``_CONFIG_SWITCHES``: a config may set them, else the variant's switches hold)
    is a candidate, without the keys only the launcher reads; :func:`_candidates` prunes
    them per problem. The backward keeps :func:`_config`'s choice (and the variant's ``TMA``).

    ``TMA`` is per config because the fastest forward tile on sm_90 is at some sizes a
    pointer-load one (``bench/flash_attn_sweep.py``), so the autotuner weighs both; the
    problem passed :func:`tma_accepts` either way.

    ``WARP_SPECIALIZE`` is per config because it works only with some warp counts: for
    sm_90, Triton 3.6 turns ``num_warps=4`` into a producer warpgroup and two consumer
    warpgroups of 64 query rows, and with 8 warps silently does not specialize, where the
    two-loop shape (unmasked blocks, then the diagonal) is the better one."""
    defaults = {name: plan.switches.get(name, False) for name in _CONFIG_SWITCHES}

    def build():
        # Forward candidates in the plan's order, each with the row classes it appears in
        # (one tile may be listed for several, with different backward settings).
        classes: dict[triton.Config, set] = {}
        for cfg in plan.configs:
            kwargs = {k: v for k, v in cfg.kwargs.items() if k not in _NOT_FORWARD_KEYS}
            kwargs = {**defaults, **kwargs}
            fwd = triton.Config(kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                maxnreg=cfg.maxnreg)
            classes.setdefault(fwd, set()).add(cfg.kwargs.get("ROW_BYTES_MAX", math.inf))

        def prune(configs, nargs, **kwargs):
            return _candidates(configs, classes, kwargs["BLOCK_D"] * nargs["Q"].element_size(),
                               nargs["N_BUCKET"])

        _ = plan.config  # a clear error when the plan has no configs
        return plan.autotuned(_flash_attn_fwd_kernel, key=["N_BUCKET", "BLOCK_D", "CAUSAL"],
                              configs=list(classes), prune_configs_by={"early_config_prune": prune})

    return plan.cached((NAME, "autotuned forward"), build)


def _forward_setup(plan, block_d: int, itemsize: int) -> tuple[int, int, dict]:
    """``(BLOCK_M, BLOCK_N, launch options)`` of the pointer-path forward, derived once per
    plan and row size."""
    def build() -> tuple[int, int, dict]:
        cfg = _config(plan, block_d, itemsize)
        return cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"], _options(cfg)

    return plan.cached((NAME, "forward", block_d, itemsize), build)


def output_like(q: torch.Tensor) -> torch.Tensor:
    """A new (B, H, Nq, D) attention output laid out in memory as ``q`` is where ``q`` is
    dense with a unit D stride, else contiguous. transformers (and FlashAttention's callers)
    hand q over as a (B, Nq, H, D) buffer seen as (B, H, Nq, D) and turn the output back
    with ``transpose(1, 2).contiguous()``: in q's order that is no copy, and autograd keeps
    one tensor where the backward's saved output and the next projection's saved input
    were two (16 MiB a layer at 4096 tokens, H = 16, D = 128). SDPA's flash and cuDNN
    outputs are laid out so too. The kernels write through the output's strides."""
    if q.stride(-1) == 1:
        return torch.empty_like(q)  # torch's preserve_format: q's strides where q is dense
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def _outputs(q: torch.Tensor, mods: Mods,
             keep_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """New ``(out, lse)`` for ``q``: (B, H, Nq, D) (:func:`output_like`) and (B, H, Nq); for
    a packed batch ``out`` is a (total, H, D) tensor seen as q's (1, H, total, D) view,
    ``lse`` (H, total). Without ``keep_lse`` (nothing will read it) the LSE is a view of
    the stream's kept scratch (``_counters.kept_scratch``): an inference call's replay
    then allocates its output alone."""
    b, h, n_q, d = q.shape
    shape = (h, n_q) if mods.varlen else (b, h, n_q)
    if keep_lse:
        lse = torch.empty(shape, dtype=torch.float32, device=q.device)
    else:
        n = math.prod(shape)
        lse = _counters.kept_scratch(q.device, n)[:n].view(shape)
    if mods.varlen:
        out = torch.empty((n_q, h, d), dtype=q.dtype, device=q.device).transpose(0, 1)[None]
        return out, lse
    return output_like(q), lse


def _no_keys_lse(lse: torch.Tensor, mods: Mods) -> torch.Tensor:
    """The LSE of rows that see no key: -inf, or the sink's logit."""
    sinks = mods.options.sinks
    if sinks is None:
        return lse.fill_(float("-inf"))
    return lse.copy_(sinks.float()[:, None].expand_as(lse) if mods.varlen
                     else sinks.float()[None, :, None].expand_as(lse))


def _forward(plan, q, k, v, causal: bool, scale: float, mods: Mods | None = None,
             keep_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, H, Nq, D) in q's dtype, lse fp32 (B, H, Nq)). With ``mods`` of a packed
    batch, q, k and v are (1, H, total, D) views and so is ``out``; lse is (H, total_q).
    Without ``keep_lse`` the LSE returned is scratch the next call may overwrite."""
    mods = _mods(causal) if mods is None else mods
    b, h, n_q, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    out, lse = _outputs(q, mods, keep_lse)
    if out.numel() == 0:
        return out, lse
    if n_k == 0:  # no keys: SDPA's math backend returns zeros
        return out.zero_(), _no_keys_lse(lse, mods)
    if mods.varlen:
        b, n_q, n_k = mods.batch, mods.max_q, mods.max_k
    block_d = _block_d(d)
    switches = _switches(plan, block_d)
    mod_ptrs, mod_args, flags = _mod_args(mods, lse)
    args = (q, k, v, out, lse, *mod_ptrs, *_strides(q, mods), *_strides(k, mods),
            *_strides(v, mods), *_strides(out, mods), h, h // h_kv, n_q, n_k, d,
            scale * _LOG2E, *mod_args)
    # A positive scale commutes with the max (see the kernel); a softcap or ALiBi bias
    # does not.
    raw_max = scale > 0 and not (flags["SOFTCAP"] or flags["ALIBI"])
    if switches["TMA"]:
        # Descriptor path: autotuned among the plan's tiles, each config setting the
        # _CONFIG_SWITCHES (see _autotuned_forward); device-side descriptors need scratch
        # memory for the launch.
        tma_switches = plan.cached((NAME, "tma switches", block_d), lambda: {
            name: value for name, value in switches.items() if name not in _CONFIG_SWITCHES})
        bucket = _bucket(n_q, n_k)
        with _host.scratch_allocator(q.device):
            # The autotuner's key: N_BUCKET, BLOCK_D, CAUSAL and the dtypes (Lse: fp32).
            plan.run_tuned(
                _autotuned_forward(plan), (bucket, block_d, causal, q.dtype),
                lambda meta: (_host.cdiv(n_q, meta["BLOCK_M"]), b * h),
                *args, bucket, BLOCK_D=block_d, CAUSAL=causal, PAD_D=d != block_d,
                RAW_MAX=raw_max, **tma_switches, **flags,
            )
        return out, lse
    block_m, block_n, opts = _forward_setup(plan, block_d, q.element_size())
    plan.direct(_flash_attn_fwd_kernel)[(_host.cdiv(n_q, block_m), b * h)](
        *args, 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, CAUSAL=causal, PAD_D=d != block_d,
        RAW_MAX=raw_max, **switches, **flags, **opts,
    )
    return out, lse


class _BackwardSetup(NamedTuple):
    blocks: tuple[int, int, int, int]   # see _backward_blocks
    dkdv_options: dict
    dq_options: dict
    tma_min_seq: int


def _backward_setup(plan, block_d: int, itemsize: int) -> _BackwardSetup:
    """What the backward reads from its config, derived once per plan and row size (the
    launch path runs it on every call)."""
    def build() -> _BackwardSetup:
        cfg = _config(plan, block_d, itemsize)
        return _BackwardSetup(_backward_blocks(cfg), _options(cfg, "dkdv"), _options(cfg, "dq"),
                              cfg.kwargs.get("BWD_TMA_MIN_SEQ", 0))

    return plan.cached((NAME, "backward", block_d, itemsize), build)


def _backward(plan, do, q, k, v, out, lse, causal: bool, scale: float, mods: Mods | None = None,
              return_delta: bool = False):
    """(dq, dk, dv) in the inputs' dtype; dk and dv summed over each GQA group. Layouts as
    :func:`_forward`'s. With ``return_delta``, also ``delta`` = rowsum(dO · O) in the LSE's
    layout (the sinks' gradient needs it)."""
    mods = _mods(causal) if mods is None else mods
    b, h, n_q, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    if mods.varlen:  # (total, H_kv, D) tensors seen as (1, H_kv, total, D), as k and v
        dk = torch.empty((n_k, h_kv, d), dtype=k.dtype, device=k.device).transpose(0, 1)[None]
        dv = torch.empty((n_k, h_kv, d), dtype=v.dtype, device=v.device).transpose(0, 1)[None]
    if q.numel() == 0 or dk.numel() == 0:  # no queries or no keys: nothing flows back
        delta = torch.zeros_like(lse)
        dq = torch.zeros_like(q, memory_format=torch.contiguous_format)
        return (dq, dk.zero_(), dv.zero_(), delta) if return_delta else (dq, dk.zero_(), dv.zero_())
    block_d = _block_d(d)
    setup = _backward_setup(plan, block_d, q.element_size())
    dkdv_m, dkdv_n, dq_m, dq_n = setup.blocks
    dkdv_opts, dq_opts = setup.dkdv_options, setup.dq_options
    upcast = plan.switches["UPCAST"]
    # Each program builds its tensor descriptors once; over a short sequence its loop is
    # too short to repay that, and a descriptor variant's config may say from which length
    # on the backward takes descriptors.
    longest = max(mods.max_q, mods.max_k) if mods.varlen else max(n_q, n_k)
    tma = plan.switches["TMA"] and longest >= setup.tma_min_seq
    if tma:
        do = describable_grad(do, d, mods)
    delta = torch.empty_like(lse)
    _launch_preprocess(out, do, delta, dq_m, dq_opts, plan, mods)
    if mods.varlen:
        dq = torch.empty((n_q, h, d), dtype=q.dtype, device=q.device).transpose(0, 1)[None]
    else:
        dq = torch.empty((b, h, n_q, d), dtype=q.dtype, device=q.device)
    with _host.scratch(q.device, tma):
        _launch_dkdv(q, k, v, do, lse, delta, dk, dv, causal, scale, dkdv_m, dkdv_n,
                     upcast, tma, dkdv_opts, plan, mods)
        _launch_dq(q, k, v, do, lse, delta, dq, causal, scale, dq_m, dq_n, upcast, tma, dq_opts,
                   plan, mods)
    return (dq, dk, dv, delta) if return_delta else (dq, dk, dv)


def describable_grad(do: torch.Tensor, d: int, mods: Mods) -> torch.Tensor:
    """``do`` as tensor descriptors take it. The forward's inputs passed
    :func:`tma_accepts`; the incoming gradient may be any view (an expanded scalar's
    gradient has zero strides, a slice of a larger buffer can start off a 16-byte
    boundary): one copy into a new buffer makes it describable (``contiguous()`` would
    return a contiguous but misaligned view as it is)."""
    if not _descriptor_issue(d, do, do, do):
        return do
    do = do.clone(memory_format=torch.contiguous_format)
    if mods.varlen:
        do = do[0].transpose(0, 1).contiguous().transpose(0, 1)[None]
    return do


def sinks_grad(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor,
               varlen: bool = False) -> torch.Tensor:
    """The gradient of the per-head sink logits: a sink takes ``p = exp(sink - lse)`` of each
    row's mass and adds no value, so ``dsink = -sum over rows of p · delta`` with
    ``delta = rowsum(dO · O)``. ``lse``/``delta``: (B, H, Nq), or (H, total_q) packed."""
    sink = sinks.float()[:, None] if varlen else sinks.float()[None, :, None]
    dims = (1,) if varlen else (0, 2)
    return (-(torch.exp(sink - lse) * delta).sum(dims)).to(sinks.dtype)


def _launch_preprocess(out, do, delta, block_m: int, opts: dict, plan,
                       mods: Mods | None = None) -> None:
    """``delta`` (the LSE's layout) fp32 = rowsum(out · do), ``block_m`` query rows per
    program (``bench/host_backward.py`` times this launch alone)."""
    b, h, n_q, d = out.shape
    cu_q, total_q = delta, 0
    if mods is not None and mods.varlen:
        b, n_q, cu_q, total_q = mods.batch, mods.max_q, mods.cu_q, mods.total_q
    plain = mods is None or not mods.varlen
    block_d = _block_d(d)
    plan.direct(_flash_attn_bwd_preprocess_kernel)[(_host.cdiv(n_q, block_m), b * h)](
        out, do, delta, cu_q, *(out.stride() if plain else _strides(out, mods)),
        *(do.stride() if plain else _strides(do, mods)), h, n_q, d, total_q,
        BLOCK_M=block_m, BLOCK_D=block_d, PAD_D=d != block_d, VARLEN=not plain, **opts,
    )


def _bwd_args(mods: Mods | None, causal: bool, lse: torch.Tensor, q, k) -> tuple:
    """``(mods, mod_ptrs, mod_args, flags, batch, n_q, n_k)`` of a backward launch."""
    mods = _mods(causal) if mods is None else mods
    mod_ptrs, mod_args, flags = _mod_args(mods, lse)
    if mods.varlen:
        return mods, mod_ptrs, mod_args, flags, mods.batch, mods.max_q, mods.max_k
    return mods, mod_ptrs, mod_args, flags, q.shape[0], q.shape[2], k.shape[2]


def _launch_dkdv(q, k, v, do, lse, delta, dk, dv, causal: bool, scale: float,
                 block_m: int, block_n: int, upcast: bool, tma: bool, opts: dict, plan=None,
                 mods: Mods | None = None) -> None:
    """The dk/dv kernel on ``block_n`` keys per program, streaming ``block_m`` queries
    (``bench/flash_attn_sweep.py`` times it alone through this, without a ``plan``: then
    through Triton's JIT launch)."""
    h, d, h_kv = q.shape[1], q.shape[3], k.shape[1]
    mods, mod_ptrs, mod_args, flags, b, n_q, n_k = _bwd_args(mods, causal, lse, q, k)
    block_d = _block_d(d)
    _host.launcher(plan, _flash_attn_bwd_dkdv_kernel)[(_host.cdiv(n_k, block_n), b * h_kv)](
        q, k, v, do, lse, delta, dk, dv, *mod_ptrs,
        *_strides(q, mods), *_strides(k, mods), *_strides(v, mods), *_strides(do, mods),
        *_strides(dk, mods), *_strides(dv, mods),
        h, h_kv, h // h_kv, n_q, n_k, d, scale, scale * _LOG2E, *mod_args,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, CAUSAL=causal, PAD_D=d != block_d,
        UPCAST=upcast, TMA=tma, **flags, **opts,
    )


def _launch_dq(q, k, v, do, lse, delta, dq, causal: bool, scale: float,
               block_m: int, block_n: int, upcast: bool, tma: bool, opts: dict, plan=None,
               mods: Mods | None = None) -> None:
    """The dq kernel on ``block_m`` queries per program, streaming ``block_n`` keys."""
    h, d, h_kv = q.shape[1], q.shape[3], k.shape[1]
    mods, mod_ptrs, mod_args, flags, b, n_q, n_k = _bwd_args(mods, causal, lse, q, k)
    block_d = _block_d(d)
    _host.launcher(plan, _flash_attn_bwd_dq_kernel)[(_host.cdiv(n_q, block_m), b * h)](
        q, k, v, do, lse, delta, dq, *mod_ptrs,
        *_strides(q, mods), *_strides(k, mods), *_strides(v, mods), *_strides(do, mods),
        *_strides(dq, mods),
        h, h // h_kv, n_q, n_k, d, scale, scale * _LOG2E, *mod_args,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, CAUSAL=causal, PAD_D=d != block_d,
        UPCAST=upcast, TMA=tma, **flags, **opts,
    )


def launch(plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           causal: bool = False, sm_scale: float | None = None, *,
           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
           alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
           align: str = "top_left", return_lse: bool = False):
    """Attention of ``q`` (B, H, Nq, D) over ``k``, ``v`` (B, H_kv, Nk, D), fp16/bf16/fp32.

    ``causal`` is SDPA's ``is_causal``; ``align="bottom_right"`` aligns its diagonal (and
    ALiBi's, and the window's) to the end of the keys instead, as FlashAttention does: query
    ``i`` sees keys up to ``i + Nk - Nq`` (decode, chunked prefill). ``window_size=(left,
    right)`` (-1: unbounded), ``softcap`` (0: off), ``alibi_slopes`` fp32 (H,) or (B, H) and
    ``sinks`` (H,) follow FlashAttention (``_attn_mods``). Returns a new (B, H, Nq, D)
    tensor of q's dtype laid out as q (contiguous for a contiguous q; :func:`output_like`), differentiable with respect to q, k, v and sinks;
    with ``return_lse`` also the fp32 (B, H, Nq) natural log-sum-exp of the scores (-inf for
    a row that sees no key). The inputs were checked by :func:`problem` (selection runs it
    first).
    """
    causal = bool(causal)
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
    mods = dense_mods(q, causal, window_size, softcap, alibi_slopes, sinks, align)
    return run(plan, q, k, v, causal, scale, mods, return_lse)


def dense_mods(q, causal: bool, window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
               sinks=None, align: str = "top_left") -> Mods:
    """The :class:`Mods` of a (B, H, N, D) call (checked: errors name the argument)."""
    options = _attn_mods.check_options(
        NAME, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, sinks=sinks, batch=q.shape[0], heads=q.shape[1],
        device=q.device)
    align_br = _align(align)
    if align_br or options is not _attn_mods.plain(bool(causal)):
        return Mods(options, align_br)
    return _mods(bool(causal))


def run(plan, q, k, v, causal: bool, scale: float, mods: Mods, return_lse: bool = False):
    """The forward (through autograd when a gradient is needed) of checked operands:
    ``out``, or ``(out, lse)`` with ``return_lse``. Layouts as :func:`_forward`'s."""
    sinks = mods.options.sinks
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or (sinks is not None and sinks.requires_grad)):
        out, lse = _FlashAttnFunction.call(plan, q, k, v, sinks, causal, scale, mods)
    else:  # an LSE no one asks for may go to scratch (keep_lse)
        out, lse = stages(plan).forward(plan, q, k, v, causal, scale, mods, return_lse)
    return (out, lse) if return_lse else out


class Stages(NamedTuple):
    """A variant's forward and backward, with :func:`_forward`'s and :func:`_backward`'s
    signatures and contract: ``forward`` returns ``(out, lse)`` (with ``keep_lse`` False
    the LSE may be scratch: no caller reads it), ``backward`` takes them with the incoming
    gradient and returns ``(dq, dk, dv)``, and with ``return_delta`` also ``delta`` =
    rowsum(dO ∘ O) in the LSE's layout (the sinks' gradient reads it)."""
    forward: Callable[..., tuple]
    backward: Callable[..., tuple]


def stages(plan) -> Stages:
    """The stages ``plan``'s variant runs: those of a launcher :func:`launcher` made, else
    this module's (looked up when called, as tools that stand in for them expect).
    ``portable_kernels.ops``, which runs forward and backward as separate operators, finds
    them here."""
    own = getattr(plan.variant.launch, "stages", None)
    return Stages(_forward, _backward) if own is None else own


def launcher(own: Stages) -> Callable[..., Any]:
    """The launch function of a variant that runs kernels of its own (a backend's, for one
    architecture): :func:`launch`'s argument checks, options and autograd around ``own``,
    whose stages may hand any call they do not take to :func:`_forward` and
    :func:`_backward`."""
    def launch_own(plan, *args, **kwargs):
        return launch(plan, *args, **kwargs)

    launch_own.stages = own
    return launch_own


# --- autograd -------------------------------------------------------------------------------

def _run_stage(plan, which: str, mods: Mods, *args, extra: tuple = ()):
    """``stages(plan).<which>(plan, *args, mods, *extra)``, replayed per signature
    (``_replay.stage``) where the options hold no tensor (no ALiBi slopes, no sinks): the
    ``Mods`` values key the replay beside the tensors, and a packed batch's ``cu_seqlens``
    go as tensor arguments (:func:`_packed_forward`, :func:`_packed_backward`)."""
    options = mods.options
    if options.alibi is not None or options.sinks is not None:
        return getattr(stages(plan), which)(plan, *args, mods, *extra)
    if mods.cu_q is None:
        return _replay.stage(plan, getattr(stages(plan), which), (mods, *extra), *args)
    return _replay.stage(plan, _PACKED[which], (mods._replace(cu_q=None, cu_k=None), *extra),
                         *args, mods.cu_q, mods.cu_k)


def _packed_forward(plan, q, k, v, causal, scale, cu_q, cu_k, mods):
    return stages(plan).forward(plan, q, k, v, causal, scale,
                                mods._replace(cu_q=cu_q, cu_k=cu_k))


def _packed_backward(plan, do, q, k, v, out, lse, causal, scale, cu_q, cu_k, mods, return_delta):
    return stages(plan).backward(plan, do, q, k, v, out, lse, causal, scale,
                                 mods._replace(cu_q=cu_q, cu_k=cu_k), return_delta)


_PACKED = {"forward": _packed_forward, "backward": _packed_backward}


class _FlashAttnFunction(_host.Function):
    """Forward saves (q, k, v, out, lse); backward runs the three backward kernels (and
    adds up the sinks' gradient from the LSE and delta). The LSE is an output too, not
    differentiable."""

    @staticmethod
    def forward(ctx, plan, q, k, v, sinks, causal, scale, mods):
        out, lse = _run_stage(plan, "forward", mods, q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.causal, ctx.scale, ctx.mods = plan, causal, scale, mods
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        mods = ctx.mods
        sinks = mods.options.sinks
        with _host.launching(dout.device):
            dq, dk, dv, delta = _run_stage(ctx.plan, "backward", mods, dout, q, k, v, out, lse,
                                           ctx.causal, ctx.scale, extra=(True,))
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[4]:
            dsinks = sinks_grad(sinks, lse, delta, mods.varlen)
        return None, dq, dk, dv, dsinks, None, None, None


# --- reference ------------------------------------------------------------------------------

def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              causal: bool = False, sm_scale: float | None = None, *,
              window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None, sinks=None,
              align: str = "top_left", return_lse: bool = False):
    """``flash_attn`` in float64, written out (``_attn_mods.reference``): GQA by repeating
    each K/V head over its query heads, causal top-left aligned (SDPA's ``is_causal``)
    unless ``align="bottom_right"``. Not SDPA itself: its math backend scales q and k by
    ``sqrt(sm_scale)`` each, which is NaN for the negative scales this kernel takes."""
    diag = k.shape[2] - q.shape[2] if align == "bottom_right" else 0
    out, lse = _attn_mods.reference(q, k, v, causal=causal, diag=diag, window_size=window_size,
                                    softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                                    sm_scale=sm_scale)
    return (out, lse) if return_lse else out


# --- registration ---------------------------------------------------------------------------

def default_configs(device) -> list:
    return [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=2)]


def variant(name: str, *, switches: dict[str, Any] | None = None, **kwargs: Any) -> Variant:
    """A ``flash_attn`` variant running this module's kernels: ``switches`` override
    :data:`SWITCHES`; ``kwargs`` are :class:`Variant` fields (priority, configs, ...).
    Backends register their variants through this, so they hold no kernel code."""
    switches = dict(switches or {})
    unknown = sorted(set(switches) - SWITCHES.keys())
    if unknown:
        raise ValueError(f"{NAME}: unknown switches {unknown}; known: {sorted(SWITCHES)}")
    if switches.get("HEAD_SPLIT", 1) not in (1, 2):
        raise ValueError(f"{NAME}: HEAD_SPLIT must be 1 or 2, got {switches['HEAD_SPLIT']}")
    kwargs.setdefault("accepts", _host.dtype_supported)
    kwargs.setdefault("configs", default_configs)
    kwargs.setdefault("replay", True)
    return Variant(NAME, name, launch, switches={**SWITCHES, **switches}, **kwargs)


def register(registry) -> None:
    registry.add_kernel(KernelSpec(
        NAME, "(q, k, v, causal=False, sm_scale=None, **options) -> out", problem,
        "attention, (B, H, N, D), GQA, causal, window, softcap, ALiBi, sinks, D <= 256; "
        "differentiable",
        reference))
    registry.add_variant(variant(
        "generic",
        description="online softmax with exp2, pointer loads masked for sequence tails and "
        "padded head dims; LSE stored for the backward"))
