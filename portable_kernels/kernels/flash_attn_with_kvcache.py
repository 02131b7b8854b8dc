"""flash_attn_with_kvcache: attention of a few new queries over a KV cache (decode,
speculative decoding, chunked prefill), in FlashAttention's ``flash_attn_with_kvcache``
layout, forward only.

Layouts: ``q`` (B, Nq, H, D); the cache either contiguous, ``k_cache``/``v_cache``
(B, N_max, H_kv, D), or paged, (num_blocks, block_size, H_kv, D) with ``block_table``
(B, max_blocks) int32 naming each sequence's blocks in order (block_size a multiple of 16).
``cache_seqlens`` (int32 (B,) tensor, or an int for every sequence; None: the whole
capacity, N_max or max_blocks * block_size) says how many keys each sequence holds. New
tokens ``k``/``v`` (B, N_new, H_kv, D) are first stored into the cache in place at
positions ``cache_seqlens[b] ...`` (``kv_cache_write``'s kernel, slots computed on the
device), and attention then covers ``Nk = cache_seqlens[b] + N_new`` keys. Semantics are
``_attn_mods``': causal is aligned bottom-right (query ``i`` sees keys up to
``i + Nk - Nq``), window, softcap, ALiBi and sinks as FlashAttention's; the LSE is the
natural log, (B, H, Nq) fp32; a row that sees no key gives zeros and an LSE of -inf (the
sink's logit with sinks).

Split-K (flash-decoding). A decode step has one query per sequence: a grid over queries
alone would be a few programs each streaming a long cache, far from filling the GPU. So
the keys are split too: the grid is ``(num_splits, B * H_kv, cdiv(Nq * GROUP, BLOCK_M))``.
The ``GROUP = H / H_kv`` query heads that share a K/V head and the ``Nq`` queries are packed
into the M dimension of one tile (row ``r`` is query ``r // GROUP`` of head
``hk * GROUP + r % GROUP``), so each K/V tile is read once per group, not once per query
head: decode reads the cache about once, which is what bounds it. Each program runs the
online softmax (exp2, running max and sum, ``_attn_mods`` for visibility and scores) over
its share of the key blocks that its rows can see (the window's and the causal diagonal's
bounds skip the rest) and writes a partial: the normalised output and its log2-sum-exp,
fp32, to scratch. A combine kernel merges the splits of each row by their LSEs and adds
the sink there, once (``o = Σ 2^(lse_s - M) o_s / (Σ 2^(lse_s - M) + 2^(sink - M))``).
With one split the attention kernel applies the same finish itself and writes the output
directly (no scratch, no combine).

The split count comes from shapes only, never from ``cache_seqlens``' values, so nothing
syncs with the host and the call can be captured in a CUDA graph (the scratch size is
fixed by shapes too). Each split takes an equal share of the blocks the sequence actually
holds, computed on the device: short sequences in a long cache cost little.
``num_splits=0`` picks (:func:`pick_splits`): enough programs for about two waves of the
device's multiprocessors (``DeviceInfo.num_sms``), never more splits than key blocks in
the capacity, at most :data:`MAX_SPLITS`.

Paged caches: each block of ``BLOCK_N`` keys gathers its rows through ``block_table``, key
by key (page ``table[b, j // block_size]``, row ``j % block_size``), so a block may span
several pages or part of one. Rows past a sequence's length and pages it does not use are
never read (their contents may be anything, NaN included). The table entries of a key
block are loaded one step ahead of its K/V tiles (``TABLE_AHEAD``, on by default): were
they loaded in the same step, every K/V load would wait on a table load, and Triton's
pipeliner, which shares ``num_stages - 1`` steps of lead among the levels of such a chain,
would leave the K/V tiles one step of lead, a single buffer that no dot overlaps (at
``num_stages=3``; it takes 5 to get the two that a contiguous cache gets at 3). Carried in
registers by the loop instead, the entries are ready a whole step before the K/V loads
that use them, which the pipeliner then prefetches as deep as in a contiguous cache.

Constexpr switches (see ``SWITCHES``):
    UPCAST: convert loaded tiles to fp32 before the dots (the CPU backend sets it: the
        interpreter keeps bf16 as raw bits). Off on GPUs: fp16/bf16 tensor-core dots with
        fp32 accumulation, P rounded to the cache's dtype for P·V.
    TMA (nvidia.hopper, below generic until timed: forced only): on a contiguous cache, K
        and V tiles move through tensor descriptors (the copy engine; device-side
        descriptors of each program's (sequence, K/V head) (Nk, D) matrix, built once per
        program, with scratch memory lent by the launcher) instead of pointer loads. The
        copy engine reads rows past Nk and columns past D as zeros, so unwritten cache rows
        (NaN, say) never reach the dots; the score mask stays, for keys past this split's
        share and outside the window. Needs a unit stride along D and 16-byte aligned base
        addresses and batch, row and head strides: the launcher turns the switch off for a
        call whose cache has not (:func:`_describable`). Paged caches keep pointer loads: a
        key block gathers rows of several pages, and a descriptor tile is one rectangle of
        one matrix.

Config (backend tuning tables): ``BLOCK_M`` (the most packed rows a tile holds; the launcher
uses the smallest power of two >= 16 that covers ``Nq * GROUP`` up to it), ``BLOCK_N`` (keys
per step), optional ``BLOCK_R`` (rows per combine program, default 16), ``WRITE_BLOCK_T``
(tokens per append program, default 16) and ``TABLE_AHEAD`` (0: a paged cache's table
entries loaded in the step that uses them; default :data:`TABLE_AHEAD`), ``num_warps``,
``num_stages`` (lowered where its K/V buffers would not fit the device's shared memory:
:func:`_stages`); any other keyword goes to the attention kernel's launch as a compiler
option (``matrix_instr_nonkdim`` on ROCm). The launcher takes the first config and does not
autotune: a decode step's time depends on the lengths in the cache, which a tuner keyed on
shapes does not see, and a first call that benchmarked would not be capturable.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from ..registry import KernelSpec, Variant
from . import _attn_mods, _host, flash_attn, kv_cache_write

NAME = "flash_attn_with_kvcache"

SWITCHES = {"UPCAST": False, "TMA": False}
#: Programs for about this many waves of the multiprocessors, when ``num_splits=0``.
WAVES = 2
#: The most splits :func:`pick_splits` chooses (each adds a partial row to merge).
MAX_SPLITS = 128
#: Paged caches: load each key block's block-table entries one step ahead of its K/V
#: tiles (module docstring), where a config does not say (its ``TABLE_AHEAD`` key).
TABLE_AHEAD = True
# Config keys the launcher reads itself; the others are compiler options.
_HOST_KEYS = frozenset({"BLOCK_M", "BLOCK_N", "BLOCK_R", "WRITE_BLOCK_T", "TABLE_AHEAD"})

LOG2E = tl.constexpr(_attn_mods.LOG2E)
LN2 = tl.constexpr(0.6931471805599453)


# --- device helpers ---------------------------------------------------------------------------

@triton.jit
def _finish(acc, m, l, sink2):
    """Normalise a row state (``acc``, running max ``m``, sum ``l``, log2 units) with one
    more logit ``sink2`` (-inf: none) that takes mass and adds no value. Returns
    ``(out, lse2)``; a row with no key and no sink gives ``(0, -inf)``, never NaN."""
    big = tl.maximum(m, sink2)
    safe = tl.where(big == float("-inf"), 0.0, big)
    scale = tl.math.exp2(m - safe)  # 0 where m is -inf
    total = l * scale + tl.math.exp2(sink2 - safe)
    ok = total > 0
    inv = tl.where(ok, scale / tl.where(ok, total, 1.0), 0.0)
    lse2 = tl.where(ok, safe + tl.math.log2(tl.where(ok, total, 1.0)), float("-inf"))
    return acc * inv[:, None], lse2


@triton.jit
def _pages(table_row, s_t1, start_n, end, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The page of each key ``start_n + [0, BLOCK_N)`` (int32, its block-table entry),
    0 for keys at or past ``end``: their entries are not read (past a sequence's blocks
    they may name no block at all)."""
    offs = start_n + tl.arange(0, BLOCK_N)
    return tl.load(table_row + (offs // PAGE) * s_t1, mask=offs < end, other=0)


# --- attention over a share of the keys ----------------------------------------------------

@triton.jit
def _flash_attn_with_kvcache_kernel(
    # pointers
    Q, K, V, Out, Lse, PartO, Seqlens, Table, Alibi, Sinks,
    # sizes; the element offset of the split LSEs, which follow the split outputs in PartO
    B, H_KV, Nq, D, seqlen_const, n_new, sm_scale2, part_lse_off,
    # strides: q (b, n, h, d), caches (block or batch, row, head, dim), block table,
    # output (b, n, h, d), LSE (b, h, n), ALiBi slopes (b, h)
    s_qb, s_qn, s_qh, s_qd, s_kb, s_kn, s_kh, s_kd, s_vb, s_vn, s_vh, s_vd,
    s_t0, s_t1, s_ob, s_on, s_oh, s_od, s_lb, s_lh, s_ln, s_ab, s_ah,
    # the options (_attn_mods: window edges, softcap in log2 units)
    left, right, softcap2,
    # meta-parameters
    GROUP: tl.constexpr, PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HAS_SEQLENS: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, SINKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    TABLE_AHEAD: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr,
    STORE_LSE: tl.constexpr = True,
):
    # --- program id to (split, sequence, K/V head, packed rows) -------------------------------
    split = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H_KV
    hk = pid_bh % H_KV
    offs_r = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    qi = offs_r // GROUP                 # the query (position among the Nq new ones)
    h = hk * GROUP + offs_r % GROUP      # its head
    row_ok = qi < Nq
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D

    if HAS_SEQLENS:
        n_k = tl.load(Seqlens + b) + n_new
    else:
        n_k = seqlen_const + n_new
    diag = n_k - Nq  # bottom-right alignment

    # --- the keys these rows can see, and this split's share of them --------------------------
    q_lo = tl.program_id(2) * BLOCK_M // GROUP
    q_hi = tl.minimum((tl.program_id(2) * BLOCK_M + BLOCK_M - 1) // GROUP, Nq - 1)
    lo = 0
    hi = n_k
    if WINDOW:
        lo = tl.maximum(q_lo + diag - left, 0)
        hi = tl.minimum(q_hi + diag + right + 1, n_k)
    elif CAUSAL:
        hi = tl.minimum(q_hi + diag + 1, n_k)
    lo = (lo // BLOCK_N) * BLOCK_N       # block-aligned; the masks drop the keys before it
    n_blocks = tl.maximum(tl.cdiv(hi - lo, BLOCK_N), 0)
    per_split = tl.cdiv(n_blocks, NUM_SPLITS)
    start = lo + split * per_split * BLOCK_N
    end = tl.minimum(start + per_split * BLOCK_N, hi)

    # --- the query tile: [BLOCK_M, BLOCK_D], rows of several heads ----------------------------
    q_ptrs = (Q + b.to(tl.int64) * s_qb + qi[:, None].to(tl.int64) * s_qn
              + h[:, None].to(tl.int64) * s_qh + offs_d[None, :] * s_qd)
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    if ALIBI:
        alibi2 = (tl.load(Alibi + b * s_ab + h * s_ah, mask=row_ok, other=0.0) * LOG2E)[:, None]
    else:
        alibi2 = 0.0

    # --- K/V sources: pointers, or tensor descriptors -----------------------------------------
    # With TMA, descriptors of this (sequence, K/V head)'s (n_k, D) matrices of K and V,
    # built once here. Their shape stops at n_k, so the copy engine reads rows past the
    # sequence (unwritten slots, maybe NaN) and columns past D as zeros, and the tiles need
    # no load masks. A paged cache keeps pointer loads even with TMA on: a key block
    # gathers rows from several pages (16-row pages under 32- or 64-key blocks), and a
    # descriptor tile is one rectangle of one matrix.
    DESCRIPTORS: tl.constexpr = TMA and PAGE == 0
    if DESCRIPTORS:
        k_src = flash_attn._seq_source(K + b.to(tl.int64) * s_kb + hk.to(tl.int64) * s_kh,
                                       n_k, s_kn, D, BLOCK_N, BLOCK_D, True)
        v_src = flash_attn._seq_source(V + b.to(tl.int64) * s_vb + hk.to(tl.int64) * s_vh,
                                       n_k, s_vn, D, BLOCK_N, BLOCK_D, True)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # --- main loop over key blocks --------------------------------------------------------------
    # With TABLE_AHEAD the pages of the next key block are loaded a step ahead and carried
    # by the loop (module docstring: the K/V addresses then depend on no load of their own
    # step, and the pipeliner prefetches the K/V tiles as deep as a contiguous cache's).
    table_row = Table + b.to(tl.int64) * s_t0
    if PAGE > 0 and TABLE_AHEAD:
        pages_next = _pages(table_row, s_t1, start, end, PAGE, BLOCK_N)
    else:
        pages_next = tl.zeros([BLOCK_N], tl.int32)  # unused; the loop carries a constant
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        # Where each key lives: (page, row in page) through the block table, or
        # (sequence, position) in a contiguous cache. Masked keys read nothing. int64:
        # a page times its stride may pass 2^31 elements in a large cache.
        if PAGE > 0:
            if TABLE_AHEAD:
                blk = pages_next.to(tl.int64)
                pages_next = _pages(table_row, s_t1, start_n + BLOCK_N, end, PAGE, BLOCK_N)
            else:
                blk = _pages(table_row, s_t1, start_n, end, PAGE, BLOCK_N).to(tl.int64)
            row = (offs_n % PAGE).to(tl.int64)
        else:
            blk = tl.zeros([BLOCK_N], tl.int64) + b
            row = offs_n.to(tl.int64)
        # K is loaded transposed ([BLOCK_D, BLOCK_N], a strided view; with descriptors a
        # view of the copied [BLOCK_N, BLOCK_D] buffer) so that q·kᵀ needs no tl.trans.
        # Descriptor tiles may hold keys past this split's end (the next split's, real and
        # finite): the score mask below drops them, as it drops the masked pointer loads.
        if DESCRIPTORS:
            kt = flash_attn._read_seq_tile(k_src, start_n, 0, offs_n, offs_d, s_kn, s_kd, n_k,
                                           D, True, True, True, False, True)
        else:
            kt = tl.load(K + blk[None, :] * s_kb + row[None, :] * s_kn + hk * s_kh
                         + offs_d[:, None] * s_kd, mask=n_ok[None, :] & d_ok[:, None],
                         other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
        s2 = tl.dot(q, kt) * sm_scale2
        s2 = _attn_mods.modify_scores(s2, qi[:, None], offs_n[None, :], diag, softcap2, alibi2,
                                      SOFTCAP, ALIBI)
        ok = _attn_mods.visible(qi[:, None], offs_n[None, :], n_k, diag, left, right,
                                CAUSAL, WINDOW) & n_ok[None, :]
        s2 = tl.where(ok, s2, float("-inf"))

        # Online softmax: rescale the state when the running max grows. A row that has
        # seen no key yet keeps m = -inf; shifting by 0 instead keeps exp2 away from NaN.
        m_new = tl.maximum(m, tl.max(s2, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s2 - shift[:, None])
        alpha = tl.math.exp2(m - shift)
        l = l * alpha + tl.sum(p, 1)
        if DESCRIPTORS:
            v = flash_attn._read_seq_tile(v_src, start_n, 0, offs_n, offs_d, s_vn, s_vd, n_k, D,
                                          True, True, False, False, True)
        else:
            v = tl.load(V + blk[:, None] * s_vb + row[:, None] * s_vn + hk * s_vh
                        + offs_d[None, :] * s_vd, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32))
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new

    # --- write-back ----------------------------------------------------------------------------
    out_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        # The whole row is here: finish with the sink and store the output.
        if SINKS:
            sink2 = tl.load(Sinks + h, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
        else:
            sink2 = tl.full([BLOCK_M], float("-inf"), tl.float32)
        out, lse2 = _finish(acc, m, l, sink2)
        o_ptrs = (Out + b.to(tl.int64) * s_ob + qi[:, None].to(tl.int64) * s_on
                  + h[:, None].to(tl.int64) * s_oh + offs_d[None, :] * s_od)
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=out_mask)
        if STORE_LSE:
            tl.store(Lse + b.to(tl.int64) * s_lb + h.to(tl.int64) * s_lh + qi * s_ln,
                     lse2 * LN2, mask=row_ok)
    else:
        # A partial: this split's normalised output and log2-sum-exp (0 and -inf when it
        # saw no key), in fp32 scratch laid out (split, b, n, h, d); the sink waits for
        # the combine, so that it counts once.
        out, lse2 = _finish(acc, m, l, tl.full([BLOCK_M], float("-inf"), tl.float32))
        prow = ((split * B + b) * Nq + qi).to(tl.int64) * (GROUP * H_KV) + h
        tl.store(PartO + prow[:, None] * BLOCK_D + offs_d[None, :], out, mask=row_ok[:, None])
        tl.store(PartO + part_lse_off + prow, lse2, mask=row_ok)


# --- the merge of the splits -------------------------------------------------------------------

@triton.jit
def _flash_attn_with_kvcache_combine_kernel(
    PartO, Out, Lse, Sinks,
    R, Nq, H, D, part_lse_off,
    s_ob, s_on, s_oh, s_od, s_lb, s_lh, s_ln,
    NUM_SPLITS: tl.constexpr, SINKS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, STORE_LSE: tl.constexpr = True,
):
    # Rows r = (b * Nq + n) * H + h of every split, merged by their LSEs: the running max
    # of the log2-sum-exps keeps every weight 2^(lse_s - M) <= 1.
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    r_ok = offs_r < R
    h = offs_r % H
    n = (offs_r // H) % Nq
    b = offs_r // (H * Nq)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for s in range(NUM_SPLITS):
        prow = s * R + offs_r.to(tl.int64)
        lse_s = tl.load(PartO + part_lse_off + prow, mask=r_ok, other=float("-inf"))
        o_s = tl.load(PartO + prow[:, None] * BLOCK_D + offs_d[None, :], mask=r_ok[:, None],
                      other=0.0)
        m_new = tl.maximum(m, lse_s)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m - shift)
        w = tl.math.exp2(lse_s - shift)
        l = l * alpha + w
        acc = acc * alpha[:, None] + o_s * w[:, None]
        m = m_new
    # Each partial is normalised, so l is the merged sum over keys in units of 2^m; the
    # sink joins it here, exactly once.
    if SINKS:
        sink2 = tl.load(Sinks + h, mask=r_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    else:
        sink2 = tl.full([BLOCK_R], float("-inf"), tl.float32)
    out, lse2 = _finish(acc, m, l, sink2)
    o_ptrs = (Out + b[:, None].to(tl.int64) * s_ob + n[:, None].to(tl.int64) * s_on
              + h[:, None].to(tl.int64) * s_oh + offs_d[None, :] * s_od)
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=r_ok[:, None] & (offs_d[None, :] < D))
    if STORE_LSE:
        tl.store(Lse + b.to(tl.int64) * s_lb + h.to(tl.int64) * s_lh + n * s_ln,
                 lse2 * 0.6931471805599453, mask=r_ok)


# --- host side ---------------------------------------------------------------------------------

class Problem(NamedTuple):
    device: torch.device
    dtype: torch.dtype
    head_dim: int
    paged: bool
    options: str = ""  # the options set beyond causal, "" for none


class Checked(NamedTuple):
    """A validated call, in what the launcher needs."""
    paged: bool
    capacity: int        # keys a sequence can hold (N_max, or max_blocks * block_size)
    n_new: int
    seqlen_const: int    # cache_seqlens as an int (or the capacity for None)
    seqlens: Any         # the int32 (B,) tensor, or None
    options: _attn_mods.Options
    scale: float


def _check_seqlens(cache_seqlens, batch: int, device) -> tuple[Any, int | None]:
    if cache_seqlens is None:
        return None, None
    if isinstance(cache_seqlens, torch.Tensor):
        _host.check_aux(NAME, "cache_seqlens", cache_seqlens, device, torch.int32)
        if tuple(cache_seqlens.shape) != (batch,):
            raise _host.InputError(f"{NAME}: cache_seqlens must have shape ({batch},) (one length "
                                   f"per sequence), got {tuple(cache_seqlens.shape)}")
        return cache_seqlens, None
    _host.check_int(NAME, "cache_seqlens", cache_seqlens)
    if cache_seqlens < 0:
        raise _host.InputError(f"{NAME}: cache_seqlens must be >= 0, got {cache_seqlens}")
    return None, int(cache_seqlens)


def check(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None,
          causal=True, sm_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
          sinks=None, num_splits=0, return_lse=False) -> Checked:
    """Validate a call (errors name the argument; value checks only under
    ``PK_CHECK_VALUES=1``)."""
    device = _host.same_device(NAME, q=q, k_cache=k_cache, v_cache=v_cache)
    _host.check_ndim(NAME, "q", q, 4, "(B, Nq, H, D)")
    _host.check_dtype(NAME, "q", q)
    kv_cache_write.check_cache(NAME, k_cache, v_cache)
    _host.check_same_dtype(NAME, q=q, k_cache=k_cache)
    batch, n_q, h, d = q.shape
    rows, page, h_kv, dk = k_cache.shape
    if d != dk:
        raise _host.InputError(f"{NAME}: q and k_cache must have the same head dim D, got q {d}, "
                               f"k_cache {dk}")
    _attn_mods.check_heads(NAME, h, h_kv, d, ", k_cache's dim 2")
    if (k is None) != (v is None):
        raise _host.ArgumentError(f"{NAME}: k and v must be given together (new tokens to "
                                  "append), got only " + ("k" if v is None else "v"))
    n_new = 0
    if k is not None:
        _host.same_device(NAME, q=q, k=k, v=v)
        kv_cache_write.check_new(NAME, k, v, k_cache, 4, "(B, N_new, H_kv, D)")
        if k.shape[0] != batch:
            raise _host.InputError(f"{NAME}: k and v must have q's batch size {batch} in dim 0, "
                                   f"got {k.shape[0]}")
        n_new = k.shape[1]

    paged = block_table is not None
    if paged:
        _host.check_aux(NAME, "block_table", block_table, device, torch.int32)
        if block_table.dim() != 2 or block_table.shape[0] != batch:
            raise _host.InputError(f"{NAME}: block_table must have shape ({batch}, max_blocks), "
                                   f"got {tuple(block_table.shape)}")
        if page % kv_cache_write.PAGE_MULTIPLE:
            raise _host.InputError(
                f"{NAME}: a paged cache's block_size (k_cache's dim 1) must be a multiple of "
                f"{kv_cache_write.PAGE_MULTIPLE}, got {page}")
        capacity = block_table.shape[1] * page
    else:
        if rows != batch:
            raise _host.InputError(f"{NAME}: a contiguous k_cache must have q's batch size "
                                   f"{batch} in dim 0, got {rows} (pass block_table for a paged "
                                   "cache)")
        capacity = page
    seqlens, const = _check_seqlens(cache_seqlens, batch, device)
    if seqlens is None and const is None:
        # Every slot holds a key: nothing can be appended.
        if n_new:
            raise _host.InputError(f"{NAME}: cache_seqlens=None means every cache slot holds a "
                                   f"key, so the {n_new} new tokens of k/v do not fit; pass "
                                   "cache_seqlens")
        const = capacity
    if const is not None and const + n_new > capacity:
        raise _host.InputError(f"{NAME}: cache_seqlens ({const}) + new tokens ({n_new}) exceed "
                               f"the cache's capacity of {capacity} keys per sequence")
    _attn_mods.check_scale(NAME, sm_scale)
    _host.check_int(NAME, "num_splits", num_splits)
    if num_splits < 0:
        raise _host.InputError(f"{NAME}: num_splits must be >= 0 (0: chosen from the device and "
                               f"the shapes), got {num_splits}")
    _host.check_bool(NAME, "return_lse", return_lse)
    checked = derive(q, k_cache, k, cache_seqlens, block_table, causal, sm_scale, window_size,
                     softcap, alibi_slopes, sinks)  # it checks the options
    if _host.check_values():
        _check_values(seqlens, const, n_new, capacity, block_table, page, rows)
    return checked


def derive(q, k_cache, k, cache_seqlens, block_table, causal, sm_scale, window_size, softcap,
           alibi_slopes, sinks) -> Checked:
    """What the launcher needs of a call :func:`check` (through :func:`problem`) has
    validated, without validating it again: the eager path checks each call once."""
    paged = block_table is not None
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    if isinstance(cache_seqlens, torch.Tensor):
        seqlens, const = cache_seqlens, 0
    else:
        seqlens, const = None, capacity if cache_seqlens is None else int(cache_seqlens)
    options = _attn_mods.check_options(
        NAME, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, sinks=sinks, batch=q.shape[0], heads=q.shape[2],
        device=q.device)
    scale = 1.0 / math.sqrt(q.shape[3]) if sm_scale is None else float(sm_scale)
    return Checked(paged, capacity, 0 if k is None else k.shape[1], const, seqlens, options, scale)


def _check_values(seqlens, const, n_new, capacity, block_table, page, num_blocks) -> None:
    """``PK_CHECK_VALUES=1``: lengths fit the cache; the blocks they use are in the cache."""
    lengths = seqlens.tolist() if seqlens is not None else None
    if lengths is not None:
        bad = [n for n in lengths if n < 0 or n + n_new > capacity]
        if bad:
            raise _host.InputError(f"{NAME}: cache_seqlens + new tokens ({n_new}) must lie in "
                                   f"[0, {capacity}] (the cache's capacity per sequence), got "
                                   f"cache_seqlens {bad[0]}")
    if block_table is None:
        return
    table = block_table.tolist()
    for b, blocks in enumerate(table):
        used = _host.cdiv((lengths[b] if lengths is not None else const) + n_new, page)
        out = [x for x in blocks[:used] if not 0 <= x < num_blocks]
        if out:
            raise _host.InputError(f"{NAME}: block_table[{b}] names block {out[0]}, outside the "
                                   f"cache's {num_blocks} blocks")


#: Problems of calls already checked, by :func:`_signature`: a decode loop repeats one
#: call, whose checks cost more host time than its launches (8 of 24 µs of Python per call
#: on the CPU machine).
_CHECKED = _host.CheckedCalls()


def _signature(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, sm_scale,
               window_size, softcap, alibi_slopes, sinks, num_splits, return_lse) -> tuple | None:
    """Everything :func:`check` reads of a call, or None for a call not to memoise: with
    ALiBi slopes or sinks (their options hold the tensors), or arguments check() must
    reject."""
    if alibi_slopes is not None or sinks is not None or type(window_size) is not tuple:
        return None
    try:
        described = _host.described  # no alignment: check() reads none
        seqlens = (described(cache_seqlens, False) if isinstance(cache_seqlens, torch.Tensor)
                   else _host.typed(cache_seqlens))
        return (described(q, False), described(k_cache, False), described(v_cache, False),
                described(k, False), described(v, False), seqlens, described(block_table, False),
                _host.typed(causal, sm_scale, softcap, num_splits, return_lse),
                _host.typed(*window_size))
    except (AttributeError, TypeError):  # not tensors, or unhashable: check() says what
        return None


def problem(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None,
            causal=True, sm_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
            sinks=None, num_splits=0, return_lse=False) -> Problem:
    """Check a call and return its selection key (a call seen before, by its signature, is
    not checked again; value checks under ``PK_CHECK_VALUES=1`` run on every call)."""
    args = (q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, sm_scale,
            window_size, softcap, alibi_slopes, sinks, num_splits, return_lse)
    return _CHECKED.lookup(None if _host.check_values() else _signature(*args), _checked_problem, *args)


def _checked_problem(*args) -> Problem:
    c = check(*args)
    o = c.options
    words = ",".join(w for w, on in (("window", o.window), ("softcap", o.softcap2 > 0),
                                      ("alibi", o.alibi is not None),
                                      ("sinks", o.sinks is not None)) if on)
    q = args[0]
    return Problem(q.device, q.dtype, q.shape[-1], c.paged, words)


def pick_splits(programs: int, key_blocks: int, num_sms: int) -> int:
    """The split count for ``num_splits=0``: ``programs`` (one split's grid: sequences x K/V
    heads x query tiles) times the splits should fill about :data:`WAVES` waves of
    ``num_sms`` multiprocessors; never more splits than ``key_blocks`` (the capacity's
    key blocks: an extra split would have nothing to read) or :data:`MAX_SPLITS`, at
    least 1. Shapes only, so that the choice is the same on every call of a captured
    graph."""
    want = _host.cdiv(WAVES * max(num_sms, 1), max(programs, 1))
    return max(1, min(want, key_blocks, MAX_SPLITS))


def _tiles(plan, n_rows: int) -> tuple[int, int, dict, int]:
    """(BLOCK_M, BLOCK_N, compiler options, num_warps) for ``n_rows`` packed rows."""
    cfg = plan.config
    block_m = min(cfg.kwargs.get("BLOCK_M", 64), max(16, _host.next_power_of_2(max(n_rows, 1))))
    extra = {k: val for k, val in cfg.kwargs.items() if k not in _HOST_KEYS}
    return max(16, block_m), cfg.kwargs.get("BLOCK_N", 64), extra, cfg.num_warps


def _shared_bytes(kv_buffers: int, block_m: int, block_n: int, block_d: int,
                  itemsize: int) -> int:
    """About the attention kernel's shared memory: ``kv_buffers`` tiles of K and of V
    beside the Q and P tiles."""
    return kv_buffers * 2 * block_n * block_d * itemsize + block_m * (block_d + block_n) * itemsize


def _stages(plan, block_m: int, block_n: int, block_d: int, itemsize: int) -> int:
    """The config's ``num_stages``, lowered (to 2 at least) while its K/V buffers, about
    ``num_stages - 1`` tiles of K and of V beside the Q and P tiles, would pass the device's
    shared memory: a config is per device, not per head dim, and three stages of D = 256
    (or fp32) tiles need more than the 99 KB of sm_89 and sm_120."""
    stages = plan.config.num_stages
    budget = plan.device.shared_memory  # 0: unknown (the CPU), nothing to fit
    while budget and stages > 2 and _shared_bytes(stages - 1, block_m, block_n, block_d,
                                                  itemsize) > budget:
        stages -= 1
    return stages


def _fit_keys(plan, block_m: int, block_n: int, block_d: int, itemsize: int) -> int:
    """The config's ``BLOCK_N``, halved (to 16 at least) while two stages of K and V tiles
    beside the Q and P tiles would pass the device's shared memory, counting a buffer per
    stage: :func:`_stages` can lower the stages no further than 2, and AMD's stream
    pipeliner keeps ``num_stages`` buffers where NVIDIA's keeps ``num_stages - 1`` (fp32
    D = 256 at 64 keys took 256 KB of gfx950's 160 KB, 128 KB of gfx942's 64 KB)."""
    budget = plan.device.shared_memory  # 0: unknown (the CPU), nothing to fit
    while budget and block_n > 16 and _shared_bytes(2, block_m, block_n, block_d,
                                                    itemsize) > budget:
        block_n //= 2
    return block_n


def _grid(plan, n_rows: int, heads: int, capacity: int, d: int, itemsize: int,
          num_splits: int) -> tuple:
    """The tiles, query tiles, split count, BLOCK_D, stages and TABLE_AHEAD of a call's
    shapes (memoised per plan: a decode loop repeats one shape)."""
    block_m, block_n, extra, warps = _tiles(plan, n_rows)
    block_d = max(16, _host.next_power_of_2(d))
    block_n = _fit_keys(plan, block_m, block_n, block_d, itemsize)
    m_tiles = _host.cdiv(n_rows, block_m)
    splits = num_splits or pick_splits(heads * m_tiles, _host.cdiv(capacity, block_n),
                                       plan.device.num_sms)
    stages = _stages(plan, block_m, block_n, block_d, itemsize)
    ahead = bool(plan.config.kwargs.get("TABLE_AHEAD", TABLE_AHEAD))
    return block_m, block_n, extra, warps, m_tiles, splits, block_d, stages, ahead


def _describable(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether tensor descriptors (the ``TMA`` switch) fit each (sequence, K/V head)'s
    (N_max, D) matrix of contiguous caches (B, N_max, H_kv, D): ``flash_attn``'s test of
    its (B, H, N, D) operands, with the strides in the cache's order. Runs on every call of
    the variant."""
    batch, _, h_kv, d = k_cache.shape
    for t in (k_cache, v_cache):
        s_b, s_n, s_h, s_d = t.stride()
        if flash_attn.matrix_issue(t, d, s_b, s_h, s_n, s_d, batch, h_kv):
            return False
    return True


def launch(plan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           k: torch.Tensor | None = None, v: torch.Tensor | None = None,
           cache_seqlens: torch.Tensor | int | None = None,
           block_table: torch.Tensor | None = None, causal: bool = True,
           sm_scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
           softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
           sinks: torch.Tensor | None = None, num_splits: int = 0, return_lse: bool = False):
    """Attention of ``q`` (B, Nq, H, D) over a KV cache, after appending ``k``/``v``
    (module docstring).

    ``k_cache``/``v_cache``: (B, N_max, H_kv, D), or (num_blocks, block_size, H_kv, D) with
    ``block_table`` (B, max_blocks) int32; ``k``/``v``: None or (B, N_new, H_kv, D), stored
    into the caches in place; ``cache_seqlens``: int32 (B,), an int, or None (full);
    fp16/bf16/fp32, all one dtype; H % H_kv == 0; D <= 256. ``causal`` is bottom-right
    aligned; options as ``flash_attn``'s; ``num_splits`` 0 picks the split from the device.
    Returns a new (B, Nq, H, D) tensor of q's dtype, and with ``return_lse`` also the fp32
    (B, H, Nq) natural log-sum-exp.
    """
    # problem() checked the call (the handle calls it to select the plan).
    c = derive(q, k_cache, k, cache_seqlens, block_table, causal, sm_scale, window_size,
               softcap, alibi_slopes, sinks)
    out, lse = run(plan, q, k_cache, v_cache, k, v, block_table, c, num_splits, return_lse)
    return (out, lse) if return_lse else out


def run(plan, q, k_cache, v_cache, k, v, block_table, c: Checked, num_splits: int,
        keep_lse: bool = True):
    """Append, attend and (with several splits) combine, for a checked call ``c``:
    ``(out, lse)``, lse None without ``keep_lse`` (then neither allocated nor stored: a
    decode step's host time is mostly allocations and launches)."""
    batch, n_q, h, d = q.shape
    h_kv = k_cache.shape[2]
    group = h // h_kv
    cfg = plan.config
    if c.n_new:
        kv_cache_write.write(plan, k, v, k_cache, v_cache, seqlens=c.seqlens,
                             seqlen_const=c.seqlen_const, block_table=block_table,
                             block_t=cfg.kwargs.get("WRITE_BLOCK_T", 16),
                             num_warps=min(cfg.num_warps, 4))
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((batch, h, n_q), device=q.device, dtype=torch.float32) if keep_lse else None
    if out.numel() == 0:
        return out, lse
    block_m, block_n, extra, warps, m_tiles, splits, block_d, stages, ahead = plan.cached(
        (NAME, "grid", n_q * group, batch * h_kv, c.capacity, d, q.dtype, num_splits),
        lambda: _grid(plan, n_q * group, batch * h_kv, c.capacity, d, q.element_size(),
                      num_splits))
    o = c.options
    rows = batch * n_q * h
    if splits > 1:
        # The splits' fp32 outputs (split, b, n, h, d), then their LSEs (split, b, n, h):
        # one allocation.
        part_o = torch.empty(splits * rows * (block_d + 1), device=q.device, dtype=torch.float32)
        part_lse_off = splits * rows * block_d
    else:
        part_o, part_lse_off = out, 0  # unused
    placeholder = out  # for the pointers a switch leaves unread
    lse_strides = (0, 0, 0) if lse is None else lse.stride()
    switches = plan.switches
    # TMA applies to contiguous caches only (the kernel ignores it for a paged one); one
    # whose layout no descriptor fits takes pointer loads for this call.
    tma = switches["TMA"] and not c.paged
    if tma and not _describable(k_cache, v_cache):
        tma = False
        switches = {**switches, "TMA": False}
    # Device-side descriptors need global scratch memory at launch.
    with _host.scratch(q.device, tma):
        _host.launcher(plan, _flash_attn_with_kvcache_kernel)[(splits, batch * h_kv, m_tiles)](
            q, k_cache, v_cache, out, placeholder if lse is None else lse, part_o,
            placeholder if c.seqlens is None else c.seqlens,
            placeholder if block_table is None else block_table,
            placeholder if o.alibi is None else o.alibi,
            placeholder if o.sinks is None else o.sinks,
            batch, h_kv, n_q, d, c.seqlen_const, c.n_new, c.scale * _attn_mods.LOG2E, part_lse_off,
            *q.stride(), *k_cache.stride(), *v_cache.stride(),
            *((0, 0) if block_table is None else block_table.stride()),
            *out.stride(), *lse_strides, *((0, 0) if o.alibi is None else o.alibi.stride()),
            o.left, o.right, o.softcap2,
            GROUP=group, PAGE=k_cache.shape[1] if c.paged else 0, NUM_SPLITS=splits,
            HAS_SEQLENS=c.seqlens is not None, CAUSAL=o.causal, WINDOW=o.window,
            SOFTCAP=o.softcap2 > 0, ALIBI=o.alibi is not None, SINKS=o.sinks is not None,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, TABLE_AHEAD=ahead and c.paged,
            STORE_LSE=lse is not None, num_warps=warps, num_stages=stages, **switches, **extra)
    if splits > 1:
        block_r = cfg.kwargs.get("BLOCK_R", 16)
        _host.launcher(plan, _flash_attn_with_kvcache_combine_kernel)[(_host.cdiv(rows, block_r),)](
            part_o, out, placeholder if lse is None else lse,
            placeholder if o.sinks is None else o.sinks,
            rows, n_q, h, d, part_lse_off, *out.stride(), *lse_strides,
            NUM_SPLITS=splits, SINKS=o.sinks is not None, BLOCK_R=block_r, BLOCK_D=block_d,
            STORE_LSE=lse is not None, num_warps=min(warps, 4))
    return out, lse


def reference(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None,
              causal=True, sm_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
              sinks=None, num_splits=0, return_lse=False):
    """The call in float64 through ``_attn_mods.reference``, one sequence at a time: the
    new tokens appended (into the given caches, as the kernel does), the paged cache
    gathered into a dense one. Returns (B, Nq, H, D), and with ``return_lse`` the
    (B, H, Nq) LSE."""
    batch, n_q, h, d = q.shape
    page = k_cache.shape[1]
    if block_table is not None:
        capacity = block_table.shape[1] * page
    else:
        capacity = page
    if cache_seqlens is None:
        lengths = [capacity] * batch
    elif isinstance(cache_seqlens, torch.Tensor):
        lengths = cache_seqlens.tolist()
    else:
        lengths = [int(cache_seqlens)] * batch
    n_new = 0 if k is None else k.shape[1]
    outs, lses = [], []
    for b in range(batch):
        n = lengths[b] + n_new
        if block_table is not None:
            pages = block_table[b, :_host.cdiv(n, page)].long()
            positions = torch.arange(lengths[b], n, device=q.device)
            if n_new:
                for new, cache in ((k, k_cache), (v, v_cache)):
                    cache[pages[positions // page], positions % page] = new[b]
            dense_k = k_cache[pages].flatten(0, 1)[:n]
            dense_v = v_cache[pages].flatten(0, 1)[:n]
        else:
            if n_new:
                k_cache[b, lengths[b]:n] = k[b]
                v_cache[b, lengths[b]:n] = v[b]
            dense_k, dense_v = k_cache[b, :n], v_cache[b, :n]
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]
        o, lse = _attn_mods.reference(
            q[b].transpose(0, 1)[None], dense_k.transpose(0, 1)[None],
            dense_v.transpose(0, 1)[None], causal=causal, diag=n - n_q,
            window_size=window_size, softcap=softcap, alibi_slopes=slopes, sinks=sinks,
            sm_scale=sm_scale)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    out = torch.stack(outs) if outs else q.double().new_zeros(q.shape)
    lse = torch.stack(lses) if lses else q.double().new_zeros((0, h, n_q))
    return (out, lse) if return_lse else out


def inputs(shape: str, dtype: torch.dtype, device) -> tuple:
    """A random decode step (shape string ``"BxNqxHxH_KVxKEYSxD"``): a paged cache of
    16-key blocks holding ``KEYS`` keys per sequence, one new token appended."""
    batch, n_q, h, h_kv, keys, d = _host.parse_shape(NAME, shape, "BxNqxHxH_KVxKEYSxD")
    page = 16
    blocks = _host.cdiv(keys + n_q, page)
    q = torch.randn(batch, n_q, h, d, device=device).to(dtype)
    k_cache, v_cache = (torch.randn(batch * blocks, page, h_kv, d, device=device).to(dtype)
                        for _ in range(2))
    table = torch.randperm(batch * blocks, device=device).to(torch.int32).view(batch, blocks)
    k, v = (torch.randn(batch, n_q, h_kv, d, device=device).to(dtype) for _ in range(2))
    seqlens = torch.full((batch,), keys, dtype=torch.int32, device=device)
    return (q, k_cache, v_cache, k, v, seqlens, table), {}


def default_configs(device) -> list:
    return [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=2)]


def variant(name: str, *, switches: dict[str, Any] | None = None, **kwargs: Any) -> Variant:
    """A variant of this family: ``switches`` override :data:`SWITCHES`; ``kwargs`` are
    :class:`Variant` fields."""
    switches = dict(switches or {})
    unknown = sorted(set(switches) - SWITCHES.keys())
    if unknown:
        raise ValueError(f"{NAME}: unknown switches {unknown}; known: {sorted(SWITCHES)}")
    kwargs.setdefault("accepts", _host.dtype_supported)
    kwargs.setdefault("configs", default_configs)
    kwargs.setdefault("replay", True)
    return Variant(NAME, name, launch, switches={**SWITCHES, **switches}, **kwargs)


def register(registry) -> None:
    registry.add_kernel(KernelSpec(
        NAME, "(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, **options) -> out",
        problem,
        "decode attention over a contiguous or paged KV cache (FlashAttention's layout), new "
        "tokens appended in place, split-K merged by LSE; bottom-right causal, window, "
        "softcap, ALiBi, sinks", reference, inputs, "BxNqxHxH_KVxKEYSxD"))
    registry.add_variant(variant(
        "generic",
        description="split-K (flash-decoding): GQA heads and queries packed into one tile, "
        "pointer loads gathered through the block table, partials merged by LSE"))
