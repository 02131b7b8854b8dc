"""flash_attn's Hopper forward and backward written in Gluon (FlashAttention-3's schedules),
for ``nvidia.hopper_gluon``.

Why second kernels: the family's Triton kernels (``portable_kernels/kernels/flash_attn.py``)
cannot get sm_90's overlap of the softmax with the matrix products from Triton 3.6. Its
warp-specialized loop (``WARP_SPECIALIZE``) computed wrong outputs on the H200, and without
it the compiler runs each program's warpgroups in lockstep, one CTA barrier per key block
(see docs/performance.md). Gluon, Triton's lower-level language that ships with it, states
the partitions, barriers and asynchronous MMAs by hand, so these kernels are written in it.
The math is the family's: the same online softmax with exp2 and the scale folded in, the
same ``out`` and ``lse`` (fp32, natural log, (B, H, Nq)) contract and the same ``delta``
(the family's preprocess kernel computes it), so either side runs with the family's other.

Forward (:func:`forward`). A tile is 128 query rows (192 with three consumers) of one
(batch, head). A program takes one tile, or with a persistent grid (:data:`PERSISTENT`,
one program per SM) a first tile and then the next one left in the launch's order each
time it frees up, drawn from an atomic counter. A program is split in partitions:

- a producer warp issues the copy-engine (TMA) loads: a tile's query blocks (once the
  consumers' last scores of the previous tile have read theirs; the tile's number goes to
  the consumers with the query barrier), then the K and V tiles of each 128-key block into
  ``STAGES`` shared-memory buffers, each guarded by a "ready" barrier (the copy's bytes
  arrived) and an "empty" barrier (every consumer is done); the buffer ring's position and
  the barriers' phases run on over the program's tiles;
- two consumer warpgroups (three at D=64 for long key loops, :data:`D64_CONSUMERS`), each
  its own partition with 64 query rows. Their barriers and arrivals involve only their own
  four warps, so one warpgroup's softmax runs while the other's products occupy the tensor
  cores, instead of both waiting at a CTA barrier; they take turns to issue their products
  (:data:`PINGPONG`). With the two warpgroups in one 8-warp partition the kernel ran at
  0.82× the split one at D=128 (H200, triton 3.6).

A tile takes its last key block first when that block needs the mask (the causal
diagonal, the key tail), then the others in key order (:data:`KEY_ORDER`), so a causal
tile masks its diagonal only. In each consumer, key block i runs FlashAttention-3's
intra-warpgroup order: the scores ``q·kᵢᵀ`` are issued, the output rescaled for block
i-1, ``P₍ᵢ₋₁₎·V₍ᵢ₋₁₎`` issued behind them, and waiting until one MMA group is outstanding
returns the scores while the PV product still runs. ``P`` stays in registers as the MMA's
A operand, converted two scores per register (:data:`PACK_P`).

The copies go through 4-D host descriptors of the (B, H, N, D) tensors with one head's rows
per box, so any 16-byte aligned strides work and rows past Nq or Nk read as zeros: keys
masked in the key tail, rows not stored. (Descriptors built per (batch, head)
on the device, as ``nvidia.hopper`` does, ran at 0.95 and 0.99x cuDNN at D=128 in a separate
run, against 0.98 for these; each program waits for its own before its first copy.)

Backward (:func:`backward`, below the forward). One program per 128 keys of one (batch,
KV head), a producer warp streaming the query side (Q and dO blocks of 64 rows, every head
of the GQA group) past two consumer warpgroups of 64 keys each, which keep dk and dv in
registers. A step computes the transposed scores (keys as MMA rows), so that Pᵀ and dSᵀ
are register A operands of dv += Pᵀ·dO and dk += dSᵀ·Q. With ``FUSED_DQ`` (the variant's
``GLUON_DQ``), dq is added up in the same kernel, 5 products instead of the family's 7:
dSᵀ goes through shared memory, each warpgroup takes half of dq's columns over the tile's
keys, and the copy engine adds the fp32 block into a zeroed (B, H, Nq, D) buffer, so dq's
bits depend on the order the tiles' adds land in.

Limits (``accepts`` in this package's ``flash_attn.py``, the variant's predicate, and
``keys_issue``): sm_90 CUDA tensors (Gluon does not run under Triton's interpreter), Triton
3.6, the descriptor predicate of the family (fp16/bf16, D 64 or 128, 16-byte aligned
strides), and at least :data:`MIN_KEYS` keys (by head dim). Other problems go to
``nvidia.hopper``. The backward runs here from :data:`BWD_MIN_KEYS` keys
(:func:`backward_takes`), below them in the family's Triton kernels.
``causal`` is top-left aligned as in the rest of the family.
"""
from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton._C.libtriton import ir
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from portable_kernels.kernels import _counters, _host, flash_attn

from ._common import FixedTile, descriptor
from ._common import tma_load as _tma_load

#: Query rows per consumer warpgroup (sm_90's MMA works on 64-row blocks).
BLOCK_M = 64
#: Consumer warpgroups per program at D=64 (a program's query rows: one 64-row block per
#: consumer) when a program's mean key loop, Nk or Nk / 2 when causal, reaches
#: ``D64_CONSUMERS_MIN_KEYS``; below it, and at D=128 (three would not fit the registers),
#: two. Three share each K/V block among 192 queries, FlashAttention-3's D=64 tile: timed in
#: alternation with two on the H200 (fp16, B·H·N = 128·4096 and 32·16384, triton 3.6,
#: ``bench/flash_attn_gluon_ab.py --knob D64_CONSUMERS=2,3 --dims 64``), 10-13% faster for
#: full attention and 6% for causal at N=16384, 4% slower causal at N=4096, where programs
#: average 2048 keys and the fewer, longer tiles balance worse.
D64_CONSUMERS = 3
D64_CONSUMERS_MIN_KEYS = 4096
#: Keys per block, and the K/V buffers in flight. A 128-key block with two buffers measured
#: fastest at D=64 and D=128 (64-key blocks with 3 or 4 buffers: 10-12% slower; three
#: 128-key buffers: level at D=64, 0-2% slower at D=128; H200, triton 3.6). 256-key blocks
#: at D=64 do not fit a consumer's 232 registers (ptxas spills and serializes the MMAs).
BLOCK_N = 128
STAGES = 2
#: Registers per thread of each worker consumer warpgroup, by consumer count. Four warps
#: per partition, rounded up for the 1-warp producer: with two consumers 12 warps of 170
#: registers at launch; with the producer at 24 and the worker consumer at 232, the default
#: consumer gets the remaining 256 (24 + 232 + 256 = 512 = 65536 / 128), so no partition's
#: register increase can wait forever. With three: 24 + 2 × 160 + 168.
CONSUMER_REGS = {2: 232, 3: 160}
PRODUCER_REGS = 24
#: The consumers take turns to issue their products (FlashAttention-3's ping-pong). Timed
#: in alternation on the H200 (fp16, triton 3.6): 1-5% faster at D=64 (3 of 4 rows), within
#: 1% either way at D=128 (``bench/flash_attn_gluon_ab.py --knob PINGPONG=0,1``).
PINGPONG = True
#: How the softmax's P becomes the 16-bit A operand of P·V. 0: ``p.to(dtype)``. Triton 3.6
#: converts each score alone and packs the pairs afterwards, and ptxas then swaps the two
#: halves of every packed register: one PRMT per register, 32 a step in a 64-row
#: warpgroup (the D=64 unmasked step: 452 SASS instructions, 426 without them; with the
#: loops' code order reversed, two PRMTs a register, which is why that order ran 2-7%
#: slower). 1: one ``cvt.rn.f16x2.f32`` (``bf16x2``) per pair in inline PTX, no swaps
#: (:func:`_pack_p`). Timed in alternation on the H200 (fp16, CUDA-graph replays,
#: ``bench/flash_attn_gluon_ab.py --knob PACK_P=0,1 --graphs``): faster in
#: all 8 rows (N=4096 and 16384, D=64 and 128, full and causal), by 0.4-4%.
PACK_P = 1
#: The order in which a tile takes its key blocks. 0: key order; the first block is
#: masked whenever the tile is causal, as it holds the first causal tile's diagonal, so
#: causal tiles have two masked blocks, not one. 1: the last block first when it needs the
#: mask (the causal diagonal, the key tail), then the rest in key order: one masked block
#: per 128-row causal tile. Timed in alternation on the H200 (fp16, CUDA-graph replays,
#: ``bench/flash_attn_gluon_ab.py --knob KEY_ORDER=0,1 --graphs``): causal
#: N=1024 12% faster at D=64, 5% at D=128; other rows -2% to +3%. Every block from the
#: last down (FlashAttention-3's order), or the masked blocks' loop placed before the
#: unmasked one in the code, ran full attention 1-7% slower.
KEY_ORDER = 1
#: A persistent grid: one program per SM, each taking its first tile, then the next one
#: left in the launch's order when it frees up (``_next_tile``: an atomic counter, as
#: FlashAttention-3 schedules its tiles), so the producer loads a tile's first blocks while
#: the consumers finish the last one. Only where there are more tiles than SMs, with two
#: consumers, and while a program's mean key loop (Nk, Nk / 2 causal) is shorter than
#: ``PERSISTENT_MAX_KEYS``, which amortizes the set-up it hides. Timed in alternation with
#: one program per tile on the H200 (fp16, ``bench/flash_attn_gluon_ab.py --knob
#: PERSISTENT=0,1``, two runs): with two consumers at N=2048 and 4096, causal
#: 3-6% faster (D=128 N=4096: 0.97 -> 1.00x cuDNN), full attention 2-3% faster at D=128;
#: at N=16384, D=128, causal 2% slower in both runs, full attention 1% faster. With three
#: consumers the walk makes the causal build spill (8 B a thread at their 160 registers)
#: and it ran 7% slower at N=16384. (A fixed stride instead of the counter, timed the same
#: way: causal 1-15% slower, as programs got unequal work.)
PERSISTENT = 1
PERSISTENT_MAX_KEYS = 8192
#: The fewest keys a call must have for the variant to take it, by head dim. Each program
#: streams all Nk keys after a fixed set-up (barriers, the query tile, the first block's
#: scores alone) and before a fixed epilogue, which a short key loop does not amortize, and
#: an eager call spends more host time than nvidia.hopper's (three host descriptors).
#: Timed eagerly in alternation with nvidia.hopper and cuDNN on the H200 (B=4, H=32, fp16,
#: ``bench/variants_ab.py --set "flash_attn_gluon.MIN_KEYS={}" --backward``): before the
#: persistent forward (two runs) at D=128 ahead from Nk=2048 in
#: both passes, at Nk=1024 forward ahead, backward mixed; at D=64 forward behind at 1024
#: and 2048. With it: forward at D=128, Nk=1024, 0.90x
#: cuDNN full and 0.82 causal against 0.75 and 0.70; at D=64, Nk=2048, level (0.98 and
#: 0.88 against 0.96 and 0.87), its backward ahead there (0.81 and 0.88 against 0.77 and
#: 0.82); at D=64, Nk=1024, behind in both passes (forward 0.70 against 0.94 cuDNN).
MIN_KEYS = {64: 2048, 128: 1024}
#: The fewest keys for the Gluon backward, by head dim; below them the variant's backward is
#: the family's Triton kernels, nvidia.hopper's. In the same runs at D=128, Nk=1024, the
#: Gluon backward ran level with them for full attention (0.80x cuDNN both) and behind for
#: causal (0.71 against 0.81).
BWD_MIN_KEYS = {64: 2048, 128: 2048}
_LOG2E = 1.4426950408889634


@builtin
def _tma_add_36(tensor_desc, coord, src, _semantic=None):
    """Triton 3.6's copy-engine reduction (``cp.reduce.async.bulk.tensor`` add): its
    builder has the op, its Gluon no function for it (later releases: async_atomic_add)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle,
                                              coord, src.handle)


_tma_add = getattr(tma, "async_atomic_add", None) or _tma_add_36


def tile() -> FixedTile:
    """The forward's tile, as ``portable-kernels tune`` reports it."""
    return FixedTile(f"Gluon forward: BLOCK_M: {BLOCK_M} per consumer warpgroup, BLOCK_N: "
                     f"{BLOCK_N}, STAGES: {STAGES} (fixed)")


def backward_takes(n_k: int, d: int) -> bool:
    """Whether the Gluon backward takes a call with ``n_k`` keys of head dim ``d`` that the
    variant took (:data:`BWD_MIN_KEYS`)."""
    return n_k >= BWD_MIN_KEYS.get(d, 0)


@gluon.jit
def _tile(t, n_m, H, GROUP, N_K, CAUSAL: gl.constexpr, TILE_M: gl.constexpr,
          BLOCK_N: gl.constexpr):
    """Tile ``t`` of the launch order: ``(b, h, kvh, first query row, key blocks, key blocks
    every row sees in full)``. Each (batch, head)'s query tiles in turn, the last first:
    causal tiles near the end of the sequence see the most keys. (A longest-first order
    over groups of 8 or 16 heads instead, timed in alternation on the H200 (triton 3.6):
    causal -5% to +2%, full attention at D=128 3-11% slower, probably as more heads' K/V
    at a time miss L2.)"""
    bh = t // n_m
    tile_m = (n_m - 1 - (t - bh * n_m)) * TILE_M
    b = bh // H
    h = bh - b * H
    if CAUSAL:
        n_blocks = gl.minimum(gl.cdiv(tile_m + TILE_M, BLOCK_N), gl.cdiv(N_K, BLOCK_N))
        n_full = gl.minimum(tile_m // BLOCK_N, N_K // BLOCK_N)
    else:
        n_blocks = gl.cdiv(N_K, BLOCK_N)
        n_full = N_K // BLOCK_N
    return b, h, h // GROUP, tile_m, n_blocks, n_full


@gluon.jit
def _next_tile(queue, n_tiles):
    """The launch's next tile, drawn from ``queue`` (an int32 that starts at zero): tiles
    ``grid``, ``grid + 1``, ... in the order programs ask, then ``n_tiles`` or more (none
    left). Every program draws until it gets none, so the launch makes ``n_tiles`` draws
    in all, and the last one resets the counter for the next launch on the stream."""
    drawn = gl.atomic_add(queue, 1, sem="relaxed", scope="gpu")
    if drawn == n_tiles - 1:
        gl.atomic_xchg(queue, 0, sem="relaxed", scope="gpu")
    return gl.num_programs(0) + drawn


@gluon.jit
def _publish_tile(tile_slot, t):
    """Leaves tile number ``t`` in shared memory for the consumers (the producer's warp);
    the query barrier's next phase publishes it."""
    one_warp: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    tile_slot.store(gl.full([1], t, gl.int32, one_warp))


@gluon.jit
def _read_tile(tile_slot):
    """The tile number the producer left (a consumer warpgroup, after the query barrier)."""
    one_warpgroup: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    return gl.max(tile_slot.load(one_warpgroup), 0)


@gluon.jit
def _produce_tile(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_bar, k_ready, k_empty,
                  v_ready, v_empty, b, h, kvh, tile_m, n_blocks, n_full, it,
                  KEY_ORDER: gl.constexpr, CONSUMERS: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr):
    """Loads one tile's query blocks, then its K and V blocks into the buffer ring from
    position ``it`` (blocks loaded by the program so far), in the consumers' order
    (``KEY_ORDER``); returns the next position."""
    # The descriptors are 4-D, (B, H, N, D) with [1, 1, rows, D] boxes: the copy engine
    # reads zeros past each head's N, so a tile never reads into the next head. The
    # buffers are 2-D for the MMAs; the copies write them through 4-D views. One query box
    # per consumer (a box's rows must be a power of two; three consumers hold 192).
    mbarrier.expect(q_bar, CONSUMERS * q_desc.block_type.nbytes)
    for w in gl.static_range(CONSUMERS):
        _tma_load(q_desc, [b, h, tile_m + w * BLOCK_M, 0], q_bar,
                  q_bufs.index(w).reshape([1, 1, BLOCK_M, HEAD_D]))
    moved = _moved_last(n_blocks, n_full, KEY_ORDER)
    for i in range(n_blocks):
        g = it + i
        s = g % STAGES
        start_n = _key_block(i, n_blocks, moved) * BLOCK_N
        # Barriers start in phase 1 done, so the first pass through the buffers waits on
        # nothing.
        ph = ((g // STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(s), ph)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        _tma_load(k_desc, [b, kvh, start_n, 0], k_ready.index(s),
                  k_bufs.index(s).reshape([1, 1, BLOCK_N, HEAD_D]))
        mbarrier.wait(v_empty.index(s), ph)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        _tma_load(v_desc, [b, kvh, start_n, 0], v_ready.index(s),
                  v_bufs.index(s).reshape([1, 1, BLOCK_N, HEAD_D]))
    return it + n_blocks


@gluon.jit
def _producer(q_desc, k_desc, v_desc, queue, smem, sizes, WALK: gl.constexpr,
              CAUSAL: gl.constexpr, KEY_ORDER: gl.constexpr, CONSUMERS: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
              STAGES: gl.constexpr):
    """The copies of each tile the program takes. ``smem`` and ``sizes``: the kernel's
    tuples of buffers and barriers, and of sizes."""
    (q_bufs, k_bufs, v_bufs, q_bar, q_empty, tile_slot, k_ready, k_empty, v_ready, v_empty,
     turn) = smem
    n_m, n_tiles, H, GROUP, N_Q, N_K, qk_scale = sizes
    TILE_M: gl.constexpr = CONSUMERS * BLOCK_M
    t = gl.program_id(0)
    if WALK:
        it = 0  # K/V blocks loaded: the position in the buffer ring, over the tiles
        n = 0  # tiles so far: the query barriers' phases
        while t < n_tiles:
            b, h, kvh, tile_m, n_blocks, n_full = _tile(t, n_m, H, GROUP, N_K, CAUSAL,
                                                        TILE_M, BLOCK_N)
            # The consumers' last scores of the previous tile have read its query blocks
            # (and its number). Fresh barriers' phase 1 counts as done.
            mbarrier.wait(q_empty, (n & 1) ^ 1)
            _publish_tile(tile_slot, t)
            it = _produce_tile(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_bar, k_ready,
                               k_empty, v_ready, v_empty, b, h, kvh, tile_m, n_blocks, n_full,
                               it, KEY_ORDER, CONSUMERS, BLOCK_M, BLOCK_N, HEAD_D, STAGES)
            n += 1
            # Drawn once this tile's blocks are queued, a few blocks before its end: the
            # program that frees up first gets the next tile.
            t = _next_tile(queue, n_tiles)
        # No tile left: a number past the last, published by a plain arrival.
        mbarrier.wait(q_empty, (n & 1) ^ 1)
        _publish_tile(tile_slot, t)
        mbarrier.arrive(q_bar, count=1)
    else:
        b, h, kvh, tile_m, n_blocks, n_full = _tile(t, n_m, H, GROUP, N_K, CAUSAL, TILE_M,
                                                    BLOCK_N)
        _produce_tile(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_bar, k_ready, k_empty,
                      v_ready, v_empty, b, h, kvh, tile_m, n_blocks, n_full, 0, KEY_ORDER,
                      CONSUMERS, BLOCK_M, BLOCK_N, HEAD_D, STAGES)


@gluon.jit
def _moved_last(n_blocks, n_full, KEY_ORDER: gl.constexpr):
    """1 when the tile's last block goes first (``KEY_ORDER`` 1 and a block needs the
    mask), else 0."""
    if KEY_ORDER == 0:
        return 0
    else:
        return (n_blocks > n_full).to(gl.int32)


@gluon.jit
def _key_block(i, n_blocks, moved):
    """The key block a tile's step ``i`` takes: the last first when ``moved``
    (:func:`_moved_last`), then the others in key order."""
    return gl.where(i == 0, moved * (n_blocks - 1), i - moved)


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
    else:
        m_new = gl.maximum(m_i, gl.max(qk, 1))
    m_sub = m_new
    if MASK:
        # A row can have seen no key yet: with the last block first (KEY_ORDER), the first
        # rows of a 192-row causal tile come before every key of its first block.
        # Subtracting 0 then keeps p and alpha at 0, where -inf - -inf would make NaN.
        m_sub = gl.where(m_new == -float("inf"), 0.0, m_new)
    if RAW_MAX:
        p = gl.exp2(qk * qk_scale - gl.expand_dims(m_sub, 1))
    else:
        p = gl.exp2(qk - gl.expand_dims(m_sub, 1))
    alpha = gl.exp2(m_i - m_sub)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def _pack_p(p, dtype: gl.constexpr, PACK_P: gl.constexpr):
    """``p`` (fp32) in ``dtype`` (fp16 or bf16), with ``PACK_P`` two elements per 32-bit
    register in one conversion: ``cvt`` puts its first source in the upper half, so the
    second element goes first."""
    if not PACK_P:
        return p.to(dtype)
    elif dtype == gl.float16:
        return gl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [p],
                                         dtype=gl.float16, is_pure=True, pack=2)
    else:
        return gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [p],
                                         dtype=gl.bfloat16, is_pure=True, pack=2)


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
def _step(q_smem, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, turn, g, start_n, tt, o,
          p_op, alpha, m_i, l_i, qk_scale, start_m, N_K, WG: gl.constexpr,
          CONSUMERS: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr,
          RAW_MAX: gl.constexpr, PINGPONG: gl.constexpr, PACK_P: gl.constexpr,
          s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr,
          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The key block at ring position ``g`` (keys from ``start_n``), the warpgroup's turn
    ``tt`` (steps counted over the program's tiles), with ``P·V`` of the block before it."""
    if PINGPONG:
        # The warpgroups take turns to issue their two products, so that one's softmax
        # runs while the other's products do (warpgroup 0 goes first: the fresh barrier's
        # phase 1 counts as done).
        mbarrier.wait(turn.index(WG), (tt & 1) ^ (WG > 0))
    qk = _issue_scores(q_smem, k_bufs, k_ready, g, s_layout, BLOCK_M, BLOCK_N, STAGES)
    o = _rescale(o, alpha, o_layout)
    o = _issue_pv(p_op, v_bufs, v_ready, o, g - 1, STAGES)
    if PINGPONG:
        mbarrier.arrive(turn.index((WG + 1) % CONSUMERS), count=1)
    qk = warpgroup_mma_wait(1, deps=[qk])
    mbarrier.arrive(k_empty.index(g % STAGES), count=1)
    p, m_i, l_i, alpha = _softmax(qk, m_i, l_i, qk_scale, start_m, start_n, N_K, MASK,
                                  CAUSAL, RAW_MAX, s_layout, BLOCK_M, BLOCK_N)
    # P(g-1) is the running MMA's operand: its registers are free only after this wait.
    o = warpgroup_mma_wait(0, deps=[o])
    mbarrier.arrive(v_empty.index((g - 1) % STAGES), count=1)
    p_op = gl.convert_layout(_pack_p(p, v_bufs.dtype, PACK_P), p_layout)
    return o, p_op, alpha, m_i, l_i


@gluon.jit
def _consume_tile(q_wg, k_bufs, v_bufs, q_empty, k_ready, k_empty, v_ready, v_empty, turn,
                  Out, Lse, stride_ob, stride_oh, stride_on, b, h, H, tile_m, n_blocks, n_full,
                  it, turns, N_Q, N_K, qk_scale, WALK: gl.constexpr, WG: gl.constexpr,
                  CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr, RAW_MAX: gl.constexpr,
                  PINGPONG: gl.constexpr, PACK_P: gl.constexpr, KEY_ORDER: gl.constexpr,
                  MASK_FIRST: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  HEAD_D: gl.constexpr, STAGES: gl.constexpr):
    """Warpgroup ``WG``'s 64 query rows of one tile, its K/V blocks from ring position
    ``it`` and its turns from ``turns``: the key loop, then ``out`` and ``lse``."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    start_m = tile_m + WG * BLOCK_M

    m_i = gl.full([BLOCK_M], -float("inf"), gl.float32, row_layout)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_layout)
    o = gl.zeros([BLOCK_M, HEAD_D], gl.float32, o_layout)

    # The first block alone (no P·V behind its scores yet), masked when it needs to be
    # (MASK_FIRST, the host's), then the blocks every row of the tile sees in full, then
    # the rest (causal diagonal, key tail), masked. With KEY_ORDER 1 the last block goes
    # first when it needs the mask, so a 128-row causal tile masks its diagonal only.
    moved = _moved_last(n_blocks, n_full, KEY_ORDER)
    qk = _issue_scores(q_wg, k_bufs, k_ready, it, s_layout, BLOCK_M, BLOCK_N, STAGES)
    qk = warpgroup_mma_wait(0, deps=[qk])
    mbarrier.arrive(k_empty.index(it % STAGES), count=1)
    p, m_i, l_i, alpha = _softmax(qk, m_i, l_i, qk_scale, start_m,
                                  moved * (n_blocks - 1) * BLOCK_N, N_K, MASK_FIRST, CAUSAL,
                                  RAW_MAX, s_layout, BLOCK_M, BLOCK_N)
    p_op = gl.convert_layout(_pack_p(p, v_bufs.dtype, PACK_P), p_layout)
    for i in range(1, n_full + moved):
        o, p_op, alpha, m_i, l_i = _step(q_wg, k_bufs, v_bufs, k_ready, k_empty, v_ready,
                                         v_empty, turn, it + i, (i - moved) * BLOCK_N,
                                         turns + i, o, p_op, alpha, m_i, l_i, qk_scale,
                                         start_m, N_K, WG, CONSUMERS, False, CAUSAL, RAW_MAX,
                                         PINGPONG, PACK_P, s_layout, o_layout, p_layout, BLOCK_M,
                                         BLOCK_N, STAGES)
    for i in range(gl.maximum(n_full + moved, 1), n_blocks):
        o, p_op, alpha, m_i, l_i = _step(q_wg, k_bufs, v_bufs, k_ready, k_empty, v_ready,
                                         v_empty, turn, it + i, (i - moved) * BLOCK_N,
                                         turns + i, o, p_op, alpha, m_i, l_i, qk_scale,
                                         start_m, N_K, WG, CONSUMERS, True, CAUSAL, RAW_MAX,
                                         PINGPONG, PACK_P, s_layout, o_layout, p_layout, BLOCK_M,
                                         BLOCK_N, STAGES)
    if WALK:
        # Every scores product of the tile has completed: the producer may load the next
        # tile's query blocks while this one's last P·V and epilogue run.
        mbarrier.arrive(q_empty, count=1)
    last = it + n_blocks - 1
    o = _rescale(o, alpha, o_layout)
    o = _issue_pv(p_op, v_bufs, v_ready, o, last, STAGES)
    o = warpgroup_mma_wait(0, deps=[o])
    mbarrier.arrive(v_empty.index(last % STAGES), count=1)

    # Rows past Nq (zeros the copy engine read) are computed and not stored. The offsets
    # are int64: batch times its stride passes 2**31 elements in large calls (B=33, H=32,
    # N=16384, D=128 wrapped to a negative offset and faulted), and within a head rows
    # times the sequence stride can too.
    o = o / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), 1)
    offs_m = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    offs_d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, o_layout))
    o_base = Out + b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
    ptrs = o_base + gl.expand_dims(offs_m.to(gl.int64), 1) * stride_on + gl.expand_dims(offs_d, 0)
    gl.store(ptrs, o.to(Out.dtype.element_ty), mask=gl.expand_dims(offs_m < N_Q, 1))
    offs_r = start_m + gl.arange(0, BLOCK_M, layout=row_layout)
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453  # log2 units to natural
    gl.store(Lse + (b * H + h).to(gl.int64) * N_Q + offs_r, lse, mask=offs_r < N_Q)


@gluon.jit
def _consumer(smem, outputs, sizes, WG: gl.constexpr, WALK: gl.constexpr,
              CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr, RAW_MAX: gl.constexpr,
              PINGPONG: gl.constexpr, PACK_P: gl.constexpr, KEY_ORDER: gl.constexpr,
              MASK_FIRST: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              HEAD_D: gl.constexpr, STAGES: gl.constexpr):
    """Warpgroup ``WG``'s 64 query rows of each tile the program takes. ``smem``,
    ``outputs`` and ``sizes``: the kernel's tuples of buffers and barriers, output
    pointers and strides, and sizes."""
    (q_bufs, k_bufs, v_bufs, q_bar, q_empty, tile_slot, k_ready, k_empty, v_ready, v_empty,
     turn) = smem
    Out, Lse, stride_ob, stride_oh, stride_on = outputs
    n_m, n_tiles, H, GROUP, N_Q, N_K, qk_scale = sizes
    TILE_M: gl.constexpr = CONSUMERS * BLOCK_M
    q_wg = q_bufs.index(WG)
    if WALK:
        # Counted over the program's tiles, as the producer counts them: K/V blocks (the
        # ring position), tiles (the query barrier's phase) and steps (the turns' phases).
        it = 0
        n = 0
        turns = 0
        mbarrier.wait(q_bar, 0)
        t = _read_tile(tile_slot)
        while t < n_tiles:
            b, h, kvh, tile_m, n_blocks, n_full = _tile(t, n_m, H, GROUP, N_K, CAUSAL, TILE_M,
                                                        BLOCK_N)
            _consume_tile(q_wg, k_bufs, v_bufs, q_empty, k_ready, k_empty, v_ready, v_empty,
                          turn, Out, Lse, stride_ob, stride_oh, stride_on, b, h, H, tile_m,
                          n_blocks, n_full, it, turns, N_Q, N_K, qk_scale, WALK, WG, CONSUMERS,
                          CAUSAL, RAW_MAX, PINGPONG, PACK_P, KEY_ORDER, MASK_FIRST, BLOCK_M,
                          BLOCK_N, HEAD_D, STAGES)
            it += n_blocks
            turns += n_blocks - 1
            n += 1
            mbarrier.wait(q_bar, n & 1)
            t = _read_tile(tile_slot)
    else:
        b, h, kvh, tile_m, n_blocks, n_full = _tile(gl.program_id(0), n_m, H, GROUP, N_K,
                                                    CAUSAL, TILE_M, BLOCK_N)
        mbarrier.wait(q_bar, 0)
        _consume_tile(q_wg, k_bufs, v_bufs, q_empty, k_ready, k_empty, v_ready, v_empty, turn,
                      Out, Lse, stride_ob, stride_oh, stride_on, b, h, H, tile_m, n_blocks,
                      n_full, 0, 0, N_Q, N_K, qk_scale, WALK, WG, CONSUMERS, CAUSAL, RAW_MAX,
                      PINGPONG, PACK_P, KEY_ORDER, MASK_FIRST, BLOCK_M, BLOCK_N, HEAD_D, STAGES)


@gluon.jit
def _flash_attn_fwd_gluon_kernel(
        q_desc, k_desc, v_desc, Out, Lse, queue, stride_ob, stride_oh, stride_on,
        BH, H, GROUP, N_Q, N_K, qk_scale,
        WALK: gl.constexpr, CAUSAL: gl.constexpr, RAW_MAX: gl.constexpr,
        PINGPONG: gl.constexpr, PACK_P: gl.constexpr, KEY_ORDER: gl.constexpr,
        MASK_FIRST: gl.constexpr, CONSUMERS: gl.constexpr, BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    # Tiles in the launch order of ``_tile``: one per program, or with WALK (a persistent
    # grid) program p takes tile p, then tiles drawn from ``queue`` as it frees up.
    TILE_M: gl.constexpr = CONSUMERS * BLOCK_M
    n_m = gl.cdiv(N_Q, TILE_M)
    n_tiles = n_m * BH

    dtype: gl.constexpr = q_desc.dtype
    # The swizzle the descriptors' layout has, for 2-D buffers (rows of 128 or 256 bytes).
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                                rank=2)
    q_bufs = gl.allocate_shared_memory(dtype, [CONSUMERS, BLOCK_M, HEAD_D], layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], layout)
    tile_slot = gl.allocate_shared_memory(gl.int32, [1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    # One arrival per consumer partition: Triton 3.6 synchronizes the partition's warps
    # and arrives from its first thread.
    mbarrier.init(q_empty, count=CONSUMERS)
    for w in gl.static_range(CONSUMERS):
        mbarrier.init(turn.index(w), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(k_empty.index(s), count=CONSUMERS)
        mbarrier.init(v_empty.index(s), count=CONSUMERS)

    # The partitions' runtime arguments go in tuples. Triton 3.6's Gluon takes each
    # partition as a literal (function, arguments) tuple, and constexprs in a tuple built by
    # concatenation lose their constness, so the lists are written out per consumer count.
    smem = (q_bufs, k_bufs, v_bufs, q_bar, q_empty, tile_slot, k_ready, k_empty, v_ready,
            v_empty, turn)
    outputs = (Out, Lse, stride_ob, stride_oh, stride_on)
    sizes = (n_m, n_tiles, H, GROUP, N_Q, N_K, qk_scale)
    if CONSUMERS == 3:
        gl.warp_specialize([
            (_consumer, (smem, outputs, sizes, 0, WALK, CONSUMERS, CAUSAL, RAW_MAX, PINGPONG,
                         PACK_P, KEY_ORDER, MASK_FIRST, BLOCK_M, BLOCK_N, HEAD_D, STAGES)),
            (_consumer, (smem, outputs, sizes, 1, WALK, CONSUMERS, CAUSAL, RAW_MAX, PINGPONG,
                         PACK_P, KEY_ORDER, MASK_FIRST, BLOCK_M, BLOCK_N, HEAD_D, STAGES)),
            (_consumer, (smem, outputs, sizes, 2, WALK, CONSUMERS, CAUSAL, RAW_MAX, PINGPONG,
                         PACK_P, KEY_ORDER, MASK_FIRST, BLOCK_M, BLOCK_N, HEAD_D, STAGES)),
            (_producer, (q_desc, k_desc, v_desc, queue, smem, sizes, WALK, CAUSAL, KEY_ORDER,
                         CONSUMERS, BLOCK_M, BLOCK_N, HEAD_D, STAGES)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (smem, outputs, sizes, 0, WALK, CONSUMERS, CAUSAL, RAW_MAX, PINGPONG,
                         PACK_P, KEY_ORDER, MASK_FIRST, BLOCK_M, BLOCK_N, HEAD_D, STAGES)),
            (_consumer, (smem, outputs, sizes, 1, WALK, CONSUMERS, CAUSAL, RAW_MAX, PINGPONG,
                         PACK_P, KEY_ORDER, MASK_FIRST, BLOCK_M, BLOCK_N, HEAD_D, STAGES)),
            (_producer, (q_desc, k_desc, v_desc, queue, smem, sizes, WALK, CAUSAL, KEY_ORDER,
                         CONSUMERS, BLOCK_M, BLOCK_N, HEAD_D, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# --- backward: dk, dv and (FUSED_DQ) dq; the module docstring has the layout of the work ---

#: Keys per consumer warpgroup, queries per step, and the Q/dO buffers in flight.
BWD_BLOCK_N = 64
BWD_BLOCK_M = 64
BWD_STAGES = 2
#: dk and dv take 128 of a D=128 consumer's registers; the step's scores, dP and operands
#: the rest (24 + 240 + 248 = 512, the producer's warpgroup included).
BWD_CONSUMER_REGS = 240


@gluon.jit
def _bwd_producer(q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_bufs, do_bufs, kv_bar,
                  ready, empty, b, kvh, start_n, GROUP, j_lo, n_j, TILE_N: gl.constexpr,
                  BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr):
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    _tma_load(k_desc, [b, kvh, start_n, 0], kv_bar, k_smem.reshape([1, 1, TILE_N, HEAD_D]))
    _tma_load(v_desc, [b, kvh, start_n, 0], kv_bar, v_smem.reshape([1, 1, TILE_N, HEAD_D]))
    for it in range(GROUP * n_j):
        s = it % STAGES
        mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
        g = it // n_j
        row = (j_lo + it - g * n_j) * BLOCK_M
        h = kvh * GROUP + g
        mbarrier.expect(ready.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        _tma_load(q_desc, [b, h, row, 0], ready.index(s),
                  q_bufs.index(s).reshape([1, 1, BLOCK_M, HEAD_D]))
        _tma_load(do_desc, [b, h, row, 0], ready.index(s),
                  do_bufs.index(s).reshape([1, 1, BLOCK_M, HEAD_D]))


@gluon.jit
def _bwd_step(k_smem, k_wg, v_wg, q_bufs, do_bufs, ds_bufs, dq_smem, dq_desc, ready, empty,
              ds_full, it, dk, dv, lse_row, delta_row, b, h, H, start_m, start_key, N_Q,
              sm_scale, qk_scale, WG: gl.constexpr, MASK: gl.constexpr,
              FUSED_DQ: gl.constexpr, s_layout: gl.constexpr,
              a_layout: gl.constexpr, dq_layout: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr):
    """One query block against the warpgroup's keys: dk and dv updated; with ``FUSED_DQ``
    the block's dq share, dS·K over the tile's keys, added into dq's fp32 buffer."""
    s = it % STAGES
    mbarrier.wait(ready.index(s), (it // STAGES) & 1)
    q_buf = q_bufs.index(s)
    do_buf = do_bufs.index(s)
    zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    s_t = warpgroup_mma(k_wg, q_buf.permute((1, 0)), zero, use_acc=False, is_async=True)
    dp_t = warpgroup_mma(v_wg, do_buf.permute((1, 0)), zero, use_acc=False, is_async=True)
    s_t = warpgroup_mma_wait(1, deps=[s_t])
    # Queries past Nq (zeros the copy engine read) get LSE = +inf: their P is exactly 0.
    offs_m = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    lse = gl.load(lse_row + offs_m, mask=offs_m < N_Q, other=float("inf")) * 1.4426950408889634
    delta = gl.load(delta_row + offs_m, mask=offs_m < N_Q, other=0.0)
    p_t = gl.exp2(s_t * qk_scale - gl.expand_dims(lse, 0))
    if MASK:  # causal: a key after the query is hidden
        offs_n = start_key + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
        p_t = gl.where(gl.expand_dims(offs_m, 0) >= gl.expand_dims(offs_n, 1), p_t, 0.0)
    p_op = gl.convert_layout(p_t.to(q_bufs.dtype), a_layout)
    dv = warpgroup_mma(p_op, do_buf, dv, is_async=True)
    dp_t = warpgroup_mma_wait(1, deps=[dp_t])
    ds_t = (p_t * (dp_t - gl.expand_dims(delta, 0))).to(q_bufs.dtype)
    if FUSED_DQ:
        # dq needs dS with queries as the MMA's rows: the transpose of what the registers
        # hold, so dSᵀ goes through shared memory, both warpgroups' halves into one buffer.
        ds_buf = ds_bufs.index(it % 2)
        ds_buf.slice(WG * BLOCK_N, BLOCK_N, dim=0).store(ds_t)
        fence_async_shared()
    dk = warpgroup_mma(gl.convert_layout(ds_t, a_layout), q_buf, dk, is_async=True)
    if FUSED_DQ:
        # Each warpgroup takes half of dq's columns over all the tile's keys, once both
        # halves of dSᵀ are in. Two buffers: a warpgroup writes buffer it % 2 only after
        # passing this barrier at it - 1, so the other is done reading it at it - 2.
        mbarrier.arrive(ds_full.index(it % 2), count=1)
        mbarrier.wait(ds_full.index(it % 2), (it // 2) & 1)
        HALF_D: gl.constexpr = HEAD_D // 2
        dq = warpgroup_mma(ds_buf.permute((1, 0)), k_smem.slice(WG * HALF_D, HALF_D, dim=1),
                           gl.zeros([BLOCK_M, HALF_D], gl.float32, dq_layout), use_acc=False,
                           is_async=True)
        dq, dk, dv = warpgroup_mma_wait(0, deps=[dq, dk, dv])
        mbarrier.arrive(empty.index(s), count=1)
        # The copy engine adds the block into dq's fp32 buffer while the warpgroup goes on
        # (atomic adds from registers ran 15-25% slower, H200, triton 3.6); it must have
        # read the last step's block first.
        tma.store_wait(0)
        dq_smem.store(dq * sm_scale)
        fence_async_shared()
        # 128-byte swizzled rows (conflict-free stores) take one copy per 32 columns.
        # dq's buffer is seen as (B·H·Nq, D): a block's rows past Nq spill into the next
        # head's and add zeros there (their dS rows are 0: P is, and dO read as 0).
        for c in gl.static_range(HALF_D // 32):
            _tma_add(dq_desc, [(b * H + h) * N_Q + start_m, WG * HALF_D + c * 32],
                     dq_smem.slice(c * 32, 32, dim=1))
    else:
        dk, dv = warpgroup_mma_wait(0, deps=[dk, dv])
        mbarrier.arrive(empty.index(s), count=1)
    return it + 1, dk, dv


@gluon.jit
def _bwd_consumer(k_smem, v_smem, q_bufs, do_bufs, ds_bufs, dq_bufs, dq_desc, kv_bar, ready,
                  empty, ds_full, dk_base, dv_base, stride_dkn, stride_dvn, lse_base,
                  delta_base, H, b, kvh, start_n, GROUP, j_lo, n_j, N_Q, N_K, sm_scale,
                  qk_scale, WG: gl.constexpr, CAUSAL: gl.constexpr, FUSED_DQ: gl.constexpr,
                  TILE_N: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                  STAGES: gl.constexpr):
    """Warpgroup ``WG``'s 64 keys: every query block of the group's heads, then dk, dv."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_D // 2, 16])
    start_key = start_n + WG * BLOCK_N
    k_wg = k_smem.slice(WG * BLOCK_N, BLOCK_N, dim=0)
    v_wg = v_smem.slice(WG * BLOCK_N, BLOCK_N, dim=0)
    dq_smem = dq_bufs.index(WG)
    dk = gl.zeros([BLOCK_N, HEAD_D], gl.float32, kv_layout)
    dv = gl.zeros([BLOCK_N, HEAD_D], gl.float32, kv_layout)
    # Query blocks that reach below the tile's first key need the causal mask.
    n_masked = gl.minimum(gl.cdiv(TILE_N, BLOCK_M), n_j) if CAUSAL else 0
    mbarrier.wait(kv_bar, 0)
    it = 0
    for g in range(GROUP):
        row = (kvh * GROUP + g) * N_Q
        lse_row = lse_base + row
        delta_row = delta_base + row
        for j in range(j_lo, j_lo + n_masked):
            it, dk, dv = _bwd_step(
                k_smem, k_wg, v_wg, q_bufs, do_bufs, ds_bufs, dq_smem, dq_desc, ready, empty,
                ds_full, it, dk, dv, lse_row, delta_row, b, kvh * GROUP + g, H,
                j * BLOCK_M, start_key, N_Q, sm_scale, qk_scale, WG, True, FUSED_DQ,
                s_layout, a_layout, dq_layout, BLOCK_M, BLOCK_N, HEAD_D, STAGES)
        for j in range(j_lo + n_masked, j_lo + n_j):
            it, dk, dv = _bwd_step(
                k_smem, k_wg, v_wg, q_bufs, do_bufs, ds_bufs, dq_smem, dq_desc, ready, empty,
                ds_full, it, dk, dv, lse_row, delta_row, b, kvh * GROUP + g, H,
                j * BLOCK_M, start_key, N_Q, sm_scale, qk_scale, WG, False, FUSED_DQ,
                s_layout, a_layout, dq_layout, BLOCK_M, BLOCK_N, HEAD_D, STAGES)

    if FUSED_DQ:
        tma.store_wait(0)  # the last copy has read its block before the program ends

    # Keys past Nk (zeros the copy engine read) are computed and not stored.
    offs_n = start_key + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, kv_layout))
    offs_d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, kv_layout))
    keep = gl.expand_dims(offs_n < N_K, 1)
    rows = gl.expand_dims(offs_n.to(gl.int64), 1)  # int64: see the forward's store
    gl.store(dk_base + rows * stride_dkn + gl.expand_dims(offs_d, 0),
             (dk * sm_scale).to(dk_base.dtype.element_ty), mask=keep)
    gl.store(dv_base + rows * stride_dvn + gl.expand_dims(offs_d, 0),
             dv.to(dv_base.dtype.element_ty), mask=keep)


@gluon.jit
def _flash_attn_bwd_gluon_kernel(
        q_desc, k_desc, v_desc, do_desc, dq_desc, Lse, Delta, DK, DV, stride_dkb,
        stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn, H, H_KV, GROUP, N_Q, N_K,
        sm_scale, qk_scale, CAUSAL: gl.constexpr, FUSED_DQ: gl.constexpr, BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    TILE_N: gl.constexpr = 2 * BLOCK_N  # two consumer warpgroups
    start_n = gl.program_id(0) * TILE_N
    bhk = gl.program_id(1)
    b = bhk // H_KV
    kvh = bhk % H_KV
    # Causal, top-left aligned: queries before the tile's first key see none of its keys.
    j_lo = start_n // BLOCK_M if CAUSAL else 0
    n_j = gl.maximum(gl.cdiv(N_Q, BLOCK_M) - j_lo, 0)

    dtype: gl.constexpr = q_desc.dtype
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                                rank=2)
    k_smem = gl.allocate_shared_memory(dtype, [TILE_N, HEAD_D], layout)
    v_smem = gl.allocate_shared_memory(dtype, [TILE_N, HEAD_D], layout)
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], layout)
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], layout)
    # dSᵀ of the tile's keys for the dq product (a placeholder row when not FUSED_DQ).
    ds_bufs = gl.allocate_shared_memory(dtype, [2, TILE_N if FUSED_DQ else 1, BLOCK_M], layout)
    # Each warpgroup's fp32 dq block for the copy engine's reduction.
    dq_rows: gl.constexpr = BLOCK_M if FUSED_DQ else 1
    dq_bufs = gl.allocate_shared_memory(gl.float32, [2, dq_rows, HEAD_D // 2], _DQ_LAYOUT)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # one arrival per consumer partition
    for s in gl.static_range(2):
        mbarrier.init(ds_full.index(s), count=2)

    # int64: batch times its stride passes 2**31 elements in large calls.
    dk_base = DK + b.to(gl.int64) * stride_dkb + kvh.to(gl.int64) * stride_dkh
    dv_base = DV + b.to(gl.int64) * stride_dvb + kvh.to(gl.int64) * stride_dvh
    lse_base = Lse + b.to(gl.int64) * H * N_Q
    delta_base = Delta + b.to(gl.int64) * H * N_Q
    gl.warp_specialize([
        (_bwd_consumer, (k_smem, v_smem, q_bufs, do_bufs, ds_bufs, dq_bufs, dq_desc, kv_bar,
                         ready, empty, ds_full, dk_base, dv_base, stride_dkn, stride_dvn,
                         lse_base, delta_base, H, b, kvh, start_n, GROUP, j_lo, n_j,
                         N_Q, N_K, sm_scale, qk_scale, 0, CAUSAL, FUSED_DQ, TILE_N,
                         BLOCK_M, BLOCK_N, HEAD_D, STAGES)),
        (_bwd_consumer, (k_smem, v_smem, q_bufs, do_bufs, ds_bufs, dq_bufs, dq_desc, kv_bar,
                         ready, empty, ds_full, dk_base, dv_base, stride_dkn, stride_dvn,
                         lse_base, delta_base, H, b, kvh, start_n, GROUP, j_lo, n_j,
                         N_Q, N_K, sm_scale, qk_scale, 1, CAUSAL, FUSED_DQ, TILE_N,
                         BLOCK_M, BLOCK_N, HEAD_D, STAGES)),
        (_bwd_producer, (q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_bufs, do_bufs,
                         kv_bar, ready, empty, b, kvh, start_n, GROUP, j_lo, n_j, TILE_N,
                         BLOCK_M, HEAD_D, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


#: The descriptors' shared-memory layout: 128-byte swizzle for 16-bit rows of 64 or 128.
_DESCRIPTOR_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)
#: dq's fp32 blocks, copied 32 columns (128 bytes) at a time.
#: The kernel's buffer and the host descriptor share it (a kernel reads a global only as a
#: constexpr).
_DQ_LAYOUT = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32,
                                               rank=2))


def _descriptor(t: torch.Tensor, rows: int, cols: int | None = None,
                layout=_DESCRIPTOR_LAYOUT) -> TensorDescriptor:
    """A host descriptor of ``t`` (B, H, N, D) with [1, 1, rows, cols or D] boxes (the
    family's ``tma_accepts`` has checked ``t``)."""
    return descriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, cols or t.shape[3]],
                      layout)


def _num_sms(plan, device: torch.device) -> int:
    """SMs of the device a call runs on: its plan's, else a CUDA ``device``'s; the H200's
    132 for the CPU tensors of compile checks and host-logic tests, which launch nothing."""
    if plan is not None:
        return plan.device.num_sms
    if device.type != "cuda":
        return 132
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
            scale: float, plan=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, H, Nq, D) in q's dtype, lse fp32 (B, H, Nq)) for q (B, H, Nq, D), k and v
    (B, H_kv, Nk, D), Nq and Nk positive, fp16 or bf16, D 64 or 128, on an sm_90 device,
    strides a descriptor takes (the family's ``tma_accepts``). With a ``plan``
    (``LaunchPlan``), a call it has seen launches the compiled binary directly."""
    b, h, n_q, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    out = flash_attn.output_like(q)  # stored through its strides (see the epilogue)
    lse = torch.empty((b, h, n_q), dtype=torch.float32, device=q.device)
    mean_keys = n_k // 2 if causal else n_k
    consumers = D64_CONSUMERS if d == 64 and mean_keys >= D64_CONSUMERS_MIN_KEYS else 2
    tiles = _host.cdiv(n_q, consumers * BLOCK_M) * b * h
    num_sms = _num_sms(plan, q.device)
    walk = (bool(PERSISTENT) and tiles > num_sms and consumers == 2
            and mean_keys < PERSISTENT_MAX_KEYS)
    # The queue's counter starts at zero and the launch leaves it there (``_next_tile``).
    # Without the walk the kernel never reads the queue: any tensor stands in for it.
    queue = _counters.kept_zeros(q.device, 1) if walk else lse
    _host.launcher(plan, _flash_attn_fwd_gluon_kernel)[(num_sms if walk else tiles,)](
        _descriptor(q, BLOCK_M), _descriptor(k, BLOCK_N), _descriptor(v, BLOCK_N), out, lse,
        queue, *out.stride()[:3], b * h, h, h // h_kv, n_q, n_k, scale * _LOG2E,
        WALK=walk, CAUSAL=causal, RAW_MAX=scale > 0, PINGPONG=PINGPONG, PACK_P=PACK_P,
        KEY_ORDER=KEY_ORDER, MASK_FIRST=_first_block_masked(causal, n_k), CONSUMERS=consumers,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_D=d, STAGES=STAGES,
        CONSUMER_REGS=CONSUMER_REGS[consumers], PRODUCER_REGS=PRODUCER_REGS, num_warps=4)
    return out, lse


def _first_block_masked(causal: bool, n_k: int) -> bool:
    """Whether a tile's first key block needs the mask (``KEY_ORDER``): always when causal
    (in key order block 0 holds the first tile's diagonal, otherwise the first block is the
    diagonal); without ``causal`` when it is the key tail: the last block, or block 0 in
    key order when Nk < BLOCK_N."""
    if causal:
        return True
    return n_k % BLOCK_N != 0 if KEY_ORDER else n_k < BLOCK_N


def backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
             lse: torch.Tensor, delta: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
             causal: bool, scale: float, dq_acc: torch.Tensor | None = None, plan=None) -> None:
    """Writes dk and dv (B, H_kv, Nk, D), contiguous, in k's dtype, summed over each GQA
    group, for q and do (B, H, Nq, D), k and v (B, H_kv, Nk, D) as :func:`forward` takes
    them (do too), lse and delta fp32 (B, H, Nq) contiguous (delta = rowsum(dO ∘ O)).
    With ``dq_acc``, fp32 (B, H, Nq, D) contiguous and zeroed, it also adds dq into it
    (in no fixed order: the bits of dq may differ between runs). ``plan`` as for
    :func:`forward`."""
    b, h, n_q, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    tile_n = 2 * BWD_BLOCK_N
    q_desc = _descriptor(q, BWD_BLOCK_M)
    fused = dq_acc is not None
    dq_desc = (descriptor(dq_acc.view(-1, d), [b * h * n_q, d], [d, 1], [BWD_BLOCK_M, 32],
                          _DQ_LAYOUT.value) if fused else q_desc)
    _host.launcher(plan, _flash_attn_bwd_gluon_kernel)[(_host.cdiv(n_k, tile_n), b * h_kv)](
        q_desc, _descriptor(k, tile_n), _descriptor(v, tile_n), _descriptor(do, BWD_BLOCK_M),
        dq_desc, lse, delta, dk, dv,
        *dk.stride()[:3], *dv.stride()[:3], h, h_kv, h // h_kv, n_q, n_k, scale,
        scale * _LOG2E, CAUSAL=causal, FUSED_DQ=fused, BLOCK_M=BWD_BLOCK_M,
        BLOCK_N=BWD_BLOCK_N, HEAD_D=d, STAGES=BWD_STAGES, CONSUMER_REGS=BWD_CONSUMER_REGS,
        PRODUCER_REGS=PRODUCER_REGS, num_warps=4)
