"""flash_attn's Hopper forward written in Gluon (FlashAttention-3's schedule), for
``nvidia.hopper_gluon``.

Why a second forward kernel: the family's Triton forward (``flash_attn.py``) cannot get
sm_90's overlap of the softmax with the matrix products from Triton 3.6. Its
warp-specialized loop (``WARP_SPECIALIZE``) computed wrong outputs on the H200, and without
it the compiler runs each program's warpgroups in lockstep, one CTA barrier per key block
(see docs/performance.md). Gluon, Triton's lower-level language that ships with it, states
the partitions, barriers and asynchronous MMAs by hand, so this kernel is written in it.
The math is the family's: the same online softmax with exp2 and the scale folded in, the
same ``out`` and ``lse`` (fp32, natural log, (B, H, Nq)) contract, so the family's
backward kernels run unchanged after it.

One program per 128 query rows of one (batch, head), split in three partitions:

- a producer warp issues the copy-engine (TMA) loads: the query tile once, then the K and V
  tiles of each 128-key block into ``STAGES`` shared-memory buffers, each guarded by a
  "ready" barrier (the copy's bytes arrived) and an "empty" barrier (every consumer is done);
- two consumer warpgroups, each its own partition with 64 query rows. Their barriers and
  arrivals involve only their own four warps, so one warpgroup's softmax runs while the
  other's products occupy the tensor cores, instead of both waiting at a CTA barrier. With
  the two warpgroups in one 8-warp partition the kernel ran at 0.82× the split one at D=128
  (H200, 2026-11-30).

In each consumer, key block i runs FlashAttention-3's intra-warpgroup order: the scores
``q·kᵢᵀ`` are issued, the output rescaled for block i-1, ``P₍ᵢ₋₁₎·V₍ᵢ₋₁₎`` issued behind
them, and waiting until one MMA group is outstanding returns the scores while the PV product
still runs. ``P`` stays in registers as the MMA's A operand.

The copies go through 4-D host descriptors of the (B, H, N, D) tensors with one head's rows
per box, so any 16-byte aligned strides work and rows past Nq or Nk read as zeros: keys
masked in the first and last blocks, rows not stored. (Descriptors built per (batch, head)
on the device, as ``nvidia.hopper`` does, ran at 0.95 and 0.99x cuDNN at D=128 in a separate
run, against 0.98 for these; each program waits for its own before its first copy.)

Limits (``gluon_accepts`` in ``flash_attn.py``, the NVIDIA backend's ``accepts`` and
:func:`issue`): sm_90 CUDA tensors (Gluon does not run under Triton's interpreter), Triton
3.6, the descriptor predicate of the family (fp16/bf16, D 64 or 128, 16-byte aligned
strides), and at least :data:`MIN_KEYS` keys. Other problems go to ``nvidia.hopper``.
``causal`` is top-left aligned as in the rest of the family.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from . import _host

#: Query rows per consumer warpgroup (sm_90's MMA works on 64-row blocks).
BLOCK_M = 64
#: A program's query rows: one block per consumer warpgroup, two of them.
TILE_M = 2 * BLOCK_M
#: Keys per block, and the K/V buffers in flight. A 128-key block with two buffers measured
#: fastest at D=64 and D=128 (64-key blocks with 3 or 4 buffers: 10-12% slower, 2026-11-30).
BLOCK_N = 128
STAGES = 2
#: Registers per thread of each consumer warpgroup. Four warps per partition, rounded up for
#: the 1-warp producer: 12 warps of 170 registers at launch; with the producer at 24 and a
#: worker consumer at 232, the default consumer gets the remaining 256 (24 + 232 + 256 = 512
#: = 65536 / 128), so no partition's register increase can wait forever.
CONSUMER_REGS = 232
PRODUCER_REGS = 24
#: The fewest keys a call must have for the variant to take it. Each program streams all
#: Nk keys after a fixed set-up (barriers, the query tile, the first block's scores alone)
#: and before a fixed epilogue, which a short key loop does not amortize. On the H200
#: (B=4, H=32, fp16, 2026-11-30) at Nk=1024 it ran below nvidia.hopper at D=64 (0.70 and
#: 0.95x cuDNN against 0.90 and 1.29x) and level at D=128, also with direct launches; from
#: Nk=4096 on it ran 1.05-1.25x nvidia.hopper at D=128 and 0.94-1.04x at D=64. Nk=2048 was
#: not measured.
MIN_KEYS = 4096
_LOG2E = 1.4426950408889634
# Gluon is experimental: Triton 3.7+ renamed the TMA load (3.9 removed the old name).
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
#: The Triton releases this kernel has run and been checked on. It also compiles for sm_90
#: under 3.9 (``ci/sm90_compile.py``, as CI installs it), but Gluon is experimental and its
#: lowering may change what the kernel relies on (one mbarrier arrival per consumer
#: partition, as 3.6 lowers it), so elsewhere the variant declines and nvidia.hopper serves
#: until a GPU run checks it.
TRITON_OK = triton.__version__.startswith("3.6.")


def issue(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """Why the variant declines q (B, H, Nq, D), k, v (B, H_kv, Nk, D) beyond the descriptor
    predicate (dtype, D, alignment), or "". Runs on every CUDA call; the message does not
    name Nk, so that the selection cache keeps one entry for every short sequence."""
    if k.shape[2] < MIN_KEYS:
        return (f"Nk is below MIN_KEYS={MIN_KEYS}, where its fixed set-up per program "
                "measured slower than nvidia.hopper")
    return ""


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty,
              v_ready, v_empty, b, h, kvh, tile_m, n_blocks, TILE_M: gl.constexpr,
              BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr):
    # The descriptors are 4-D, (B, H, N, D) with [1, 1, rows, D] boxes: the copy engine
    # reads zeros past each head's N, so a tile never reads into the next head. The
    # buffers are 2-D for the MMAs; the copies write them through 4-D views.
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    _tma_load(q_desc, [b, h, tile_m, 0], q_bar, q_smem.reshape([1, 1, TILE_M, HEAD_D]))
    for i in range(n_blocks):
        s = i % STAGES
        # Barriers start in phase 1 done, so the first pass through the buffers waits on
        # nothing.
        ph = ((i // STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(s), ph)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        _tma_load(k_desc, [b, kvh, i * BLOCK_N, 0], k_ready.index(s),
                  k_bufs.index(s).reshape([1, 1, BLOCK_N, HEAD_D]))
        mbarrier.wait(v_empty.index(s), ph)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        _tma_load(v_desc, [b, kvh, i * BLOCK_N, 0], v_ready.index(s),
                  v_bufs.index(s).reshape([1, 1, BLOCK_N, HEAD_D]))


@gluon.jit
def _issue_scores(q_smem, k_bufs, k_ready, i, s_layout: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Queue ``q·kᵢᵀ`` [BLOCK_M, BLOCK_N] fp32 once K block ``i`` has arrived."""
    s = i % STAGES
    mbarrier.wait(k_ready.index(s), (i // STAGES) & 1)
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    return warpgroup_mma(q_smem, k_bufs.index(s).permute((1, 0)), zero, use_acc=False,
                         is_async=True)


@gluon.jit
def _softmax(qk, m_i, l_i, qk_scale, start_m, start_n, N_K, MASK: gl.constexpr,
             CAUSAL: gl.constexpr, RAW_MAX: gl.constexpr, s_layout: gl.constexpr,
             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """One online-softmax step: ``(p, m, l, alpha)``; m and l are in log2 units of the
    scaled scores. ``MASK``: keys past ``N_K`` (zeros the copy engine read) and, when
    ``CAUSAL``, keys after the row's query are hidden. ``RAW_MAX`` (positive scale): the max
    is taken over raw scores and scaled once per row, so each score costs one FMA before its
    exp2, as in the Triton forward. Otherwise the scores are scaled before the mask: a
    masked -inf times a negative scale would turn into +inf."""
    if not RAW_MAX:
        qk = qk * qk_scale
    if MASK:
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        keep = gl.expand_dims(offs_n < N_K, 0)
        if CAUSAL:
            offs_m = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
            keep = keep & (gl.expand_dims(offs_m, 1) >= gl.expand_dims(offs_n, 0))
        qk = gl.where(keep, qk, -float("inf"))
    if RAW_MAX:
        m_new = gl.maximum(m_i, gl.max(qk, 1) * qk_scale)
        p = gl.exp2(qk * qk_scale - gl.expand_dims(m_new, 1))
    else:
        m_new = gl.maximum(m_i, gl.max(qk, 1))
        p = gl.exp2(qk - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def _rescale(o, alpha, o_layout: gl.constexpr):
    return o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)


@gluon.jit
def _issue_pv(p_op, v_bufs, v_ready, o, j, STAGES: gl.constexpr):
    """Queue ``o += P_j·V_j`` once V block ``j`` has arrived."""
    s = j % STAGES
    mbarrier.wait(v_ready.index(s), (j // STAGES) & 1)
    return warpgroup_mma(p_op, v_bufs.index(s), o, is_async=True)


@gluon.jit
def _step(q_smem, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, i, o, p_op, alpha, m_i,
          l_i, qk_scale, start_m, N_K, MASK: gl.constexpr, CAUSAL: gl.constexpr,
          RAW_MAX: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
          p_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
          STAGES: gl.constexpr):
    qk = _issue_scores(q_smem, k_bufs, k_ready, i, s_layout, BLOCK_M, BLOCK_N, STAGES)
    o = _rescale(o, alpha, o_layout)
    o = _issue_pv(p_op, v_bufs, v_ready, o, i - 1, STAGES)
    qk = warpgroup_mma_wait(1, deps=[qk])
    mbarrier.arrive(k_empty.index(i % STAGES), count=1)
    p, m_i, l_i, alpha = _softmax(qk, m_i, l_i, qk_scale, start_m, i * BLOCK_N, N_K, MASK,
                                  CAUSAL, RAW_MAX, s_layout, BLOCK_M, BLOCK_N)
    # P(i-1) is the running MMA's operand: its registers are free only after this wait.
    o = warpgroup_mma_wait(0, deps=[o])
    mbarrier.arrive(v_empty.index((i - 1) % STAGES), count=1)
    p_op = gl.convert_layout(p.to(v_bufs.dtype), p_layout)
    return o, p_op, alpha, m_i, l_i


@gluon.jit
def _consumer(q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty, o_base,
              stride_on, lse_base, tile_m, N_Q, N_K, n_blocks, n_full, qk_scale,
              WG: gl.constexpr, CAUSAL: gl.constexpr, RAW_MAX: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
              STAGES: gl.constexpr):
    """Warpgroup ``WG``'s 64 query rows: the key loop, then ``out`` and ``lse``."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    q_wg = q_smem.slice(WG * BLOCK_M, BLOCK_M, dim=0)
    start_m = tile_m + WG * BLOCK_M

    m_i = gl.full([BLOCK_M], -float("inf"), gl.float32, row_layout)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_layout)
    o = gl.zeros([BLOCK_M, HEAD_D], gl.float32, o_layout)

    # Block 0, masked: with top-left alignment it holds the causal diagonal of the first
    # tile, and it is the key tail when Nk < BLOCK_N (elsewhere the mask keeps every key).
    mbarrier.wait(q_bar, 0)
    qk = _issue_scores(q_wg, k_bufs, k_ready, 0, s_layout, BLOCK_M, BLOCK_N, STAGES)
    qk = warpgroup_mma_wait(0, deps=[qk])
    mbarrier.arrive(k_empty.index(0), count=1)
    p, m_i, l_i, alpha = _softmax(qk, m_i, l_i, qk_scale, start_m, 0, N_K, True, CAUSAL,
                                  RAW_MAX, s_layout, BLOCK_M, BLOCK_N)
    p_op = gl.convert_layout(p.to(v_bufs.dtype), p_layout)
    # Blocks every row of the tile sees in full, then the causal diagonal and the key tail.
    for i in range(1, n_full):
        o, p_op, alpha, m_i, l_i = _step(q_wg, k_bufs, v_bufs, k_ready, k_empty, v_ready,
                                         v_empty, i, o, p_op, alpha, m_i, l_i, qk_scale,
                                         start_m, N_K, False, CAUSAL, RAW_MAX, s_layout,
                                         o_layout, p_layout, BLOCK_M, BLOCK_N, STAGES)
    for i in range(gl.maximum(n_full, 1), n_blocks):
        o, p_op, alpha, m_i, l_i = _step(q_wg, k_bufs, v_bufs, k_ready, k_empty, v_ready,
                                         v_empty, i, o, p_op, alpha, m_i, l_i, qk_scale,
                                         start_m, N_K, True, CAUSAL, RAW_MAX, s_layout,
                                         o_layout, p_layout, BLOCK_M, BLOCK_N, STAGES)
    last = n_blocks - 1
    o = _rescale(o, alpha, o_layout)
    o = _issue_pv(p_op, v_bufs, v_ready, o, last, STAGES)
    o = warpgroup_mma_wait(0, deps=[o])
    mbarrier.arrive(v_empty.index(last % STAGES), count=1)

    # Rows past Nq (zeros the copy engine read) are computed and not stored.
    o = o / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), 1)
    offs_m = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    offs_d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, o_layout))
    ptrs = o_base + gl.expand_dims(offs_m, 1) * stride_on + gl.expand_dims(offs_d, 0)
    gl.store(ptrs, o.to(o_base.dtype.element_ty), mask=gl.expand_dims(offs_m < N_Q, 1))
    offs_r = start_m + gl.arange(0, BLOCK_M, layout=row_layout)
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453  # log2 units to natural
    gl.store(lse_base + offs_r, lse, mask=offs_r < N_Q)


@gluon.jit
def _flash_attn_fwd_gluon_kernel(
        q_desc, k_desc, v_desc, Out, Lse, stride_ob, stride_oh, stride_on,
        H, GROUP, N_Q, N_K, qk_scale,
        CAUSAL: gl.constexpr, RAW_MAX: gl.constexpr, BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    # Causal tiles near the end of the sequence see the most keys: launch them first.
    pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    kvh = h // GROUP
    TILE_M: gl.constexpr = 2 * BLOCK_M  # two consumer warpgroups
    tile_m = pid_m * TILE_M
    if CAUSAL:
        n_blocks = gl.minimum(gl.cdiv(tile_m + TILE_M, BLOCK_N), gl.cdiv(N_K, BLOCK_N))
        n_full = gl.minimum(tile_m // BLOCK_N, N_K // BLOCK_N)
    else:
        n_blocks = gl.cdiv(N_K, BLOCK_N)
        n_full = N_K // BLOCK_N

    dtype: gl.constexpr = q_desc.dtype
    # The swizzle the descriptors' layout has, for 2-D buffers (rows of 128 or 256 bytes).
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                                rank=2)
    q_smem = gl.allocate_shared_memory(dtype, [TILE_M, HEAD_D], layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        # One arrival per consumer partition: Triton 3.6 synchronizes the partition's
        # warps and arrives from its first thread.
        mbarrier.init(k_empty.index(s), count=2)
        mbarrier.init(v_empty.index(s), count=2)

    o_base = Out + b * stride_ob + h * stride_oh
    lse_base = Lse + bh * N_Q
    gl.warp_specialize([
        (_consumer, (q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty, o_base,
                     stride_on, lse_base, tile_m, N_Q, N_K, n_blocks, n_full, qk_scale, 0,
                     CAUSAL, RAW_MAX, BLOCK_M, BLOCK_N, HEAD_D, STAGES)),
        (_consumer, (q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty, o_base,
                     stride_on, lse_base, tile_m, N_Q, N_K, n_blocks, n_full, qk_scale, 1,
                     CAUSAL, RAW_MAX, BLOCK_M, BLOCK_N, HEAD_D, STAGES)),
        (_producer, (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty,
                     v_ready, v_empty, b, h, kvh, tile_m, n_blocks, TILE_M, BLOCK_N, HEAD_D,
                     STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


#: The descriptors' shared-memory layout: 128-byte swizzle for 16-bit rows of 64 or 128.
_DESCRIPTOR_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)


def _descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """A host descriptor of ``t`` (B, H, N, D) with [1, 1, rows, D] boxes."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, t.shape[3]],
                            _DESCRIPTOR_LAYOUT)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, H, Nq, D) in q's dtype, lse fp32 (B, H, Nq)) for q (B, H, Nq, D), k and v
    (B, H_kv, Nk, D), Nq and Nk positive, fp16 or bf16, D 64 or 128, on an sm_90 device,
    strides a descriptor takes (the family's ``tma_accepts``)."""
    b, h, n_q, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    out = torch.empty((b, h, n_q, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, n_q), dtype=torch.float32, device=q.device)
    # Through Triton's JIT launch: the plan's direct launches key on tensors, and these
    # arguments are descriptors (built per call: they hold the tensors' addresses).
    _flash_attn_fwd_gluon_kernel[(_host.cdiv(n_q, TILE_M), b * h)](
        _descriptor(q, TILE_M), _descriptor(k, BLOCK_N), _descriptor(v, BLOCK_N), out, lse,
        *out.stride()[:3], h, h // h_kv, n_q, n_k, scale * _LOG2E,
        CAUSAL=causal, RAW_MAX=scale > 0, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_D=d,
        STAGES=STAGES, CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS,
        num_warps=4)
    return out, lse
