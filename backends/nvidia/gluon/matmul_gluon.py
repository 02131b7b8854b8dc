"""matmul's Hopper kernel written in Gluon, for ``nvidia.hopper_gluon``: a persistent,
warp-specialized product with the partitions stated by hand (CUTLASS's "cooperative"
schedule).

Why a second kernel: Triton 3.6's warp-specialized loop (``WARP_SPECIALIZE`` in
``portable_kernels/kernels/matmul.py``) specializes only 4-warp configs with 64×128 tiles on
sm_90, and without it the compiler runs each program's warpgroups in lockstep: the copies
are issued by the warps that also issue the MMAs, and every program's epilogue stops its
MMAs (see docs/performance.md). In Gluon the roles are separate partitions:

- a producer warp walks the program's tiles and streams the A and B blocks of each K step
  into ``STAGES`` shared-memory buffers through the copy engine (TMA), each buffer guarded
  by a "ready" barrier (its bytes arrived) and an "empty" one (both consumers are done);
- two consumer warpgroups each own 64 rows of the ``BLOCK_M`` = 128 rows of a tile and
  issue asynchronous warpgroup MMAs (m64n256k16 for the 256-wide tile) on the shared
  buffers, one in flight while the next is queued, freeing a buffer as soon as the MMA that
  read it retires. At the end of a tile each converts its fp32 accumulator to the output
  dtype, writes it to its own shared buffer and hands it to the copy engine, whose store
  runs while the consumer starts the next tile; the producer has been filling the buffers
  for that tile all along. (Storing while the next tile's first MMA runs did not pay on
  the H200: the epilogue is not what holds the MMAs back.)

Tiles are visited in grouped order (``GROUP_M`` rows of tiles column by column, as
``_tiles.grouped_tile`` walks them), each program taking every ``grid``-th tile, with
``grid = min(SMs, tiles)``.

Operands: fp16 or bf16, ``a`` (M, K) and ``b`` (K, N) row- or column-major (a column-major
operand is described through its transpose, ``A_T``/``B_T``, and read transposed from shared
memory by the MMA), 16-byte aligned strides; the copy engine reads zeros past M, N and K and
clips the stores, so any sizes work. Limits (``accepts`` in this package's ``matmul.py``,
the variant's predicate): sm_90 CUDA tensors, Triton 3.6, and at least :data:`MIN_TILES`
output tiles. Smaller problems, fp32 and fp8 take the family's Triton kernel
(``nvidia.persistent_tma``'s switches and table), which has split-K for outputs with few
tiles.
"""
from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from portable_kernels.kernels import _host
from portable_kernels.kernels._tiles import grouped_tile

from ._common import FixedTile, descriptor, tma_load, tma_store

#: Output rows per tile: one 64-row block per consumer warpgroup (sm_90's MMA works on
#: 64-row blocks).
BLOCK_M = 128
#: Output columns per tile and the K depth of one step. 128×256 tiles with 64-deep steps
#: are cuBLAS's own tile for large 16-bit products on sm_90. Timed in alternation on the
#: H200 (triton 3.6, ``bench/matmul_gluon_ab.py``): 32-deep steps with 6 buffers 1-5%
#: slower, 128×128 tiles with 6 buffers 3-7% slower.
BLOCK_N = 256
BLOCK_K = 64
#: K steps in flight: 48 KB each at 128×256×64, plus 64 KB for the two consumers' output
#: blocks, within the 227 KB a block may use.
STAGES = 3
#: Rows of tiles walked column by column (see ``_tiles.grouped_tile``); 16 timed within 1%.
GROUP_M = 8
#: Registers per thread: 24 for the producer warp's warpgroup, ``CONSUMER_REGS`` for the
#: worker consumer warpgroup, and the default consumer gets the rest of the 512 (24 + 232 +
#: 256 = 65536 / 128). An accumulator of 64×256 fp32 takes 128 of them.
CONSUMER_REGS = 232
PRODUCER_REGS = 24
#: The fewest output tiles (``BLOCK_M`` × ``BLOCK_N``) a call must have for the kernel to
#: take it: one per SM of an H200. Below, some SMs would idle; the Triton kernel splits K
#: there (128×14336×14336, 56 tiles: 0.72x cuBLAS here, 0.91x that kernel's). At 128
#: tiles (2048³, 1024×4096×4096) this kernel's time varied up to 2x from run to run, also
#: with direct launches (0.45-0.97x cuBLAS at 2048³, where the Triton kernel held 0.73-0.78x;
#: H200, triton 3.6, ``bench/variants_ab.py``).
MIN_TILES = 132
#: Operand dtypes (sm_90's fp8 MMAs read only K-major operands and need their accumulation
#: promoted; the Triton kernel does both).
DTYPES = (torch.float16, torch.bfloat16)


def tile() -> FixedTile:
    """The kernel's tile, as ``portable-kernels tune`` reports it."""
    return FixedTile(f"Gluon: BLOCK_M: {BLOCK_M}, BLOCK_N: {BLOCK_N}, BLOCK_K: {BLOCK_K}, "
                     f"STAGES: {STAGES}, GROUP_M: {GROUP_M} (fixed)")


def tiles(m: int, n: int) -> int:
    """Output tiles of an M×N product."""
    return _host.cdiv(m, BLOCK_M) * _host.cdiv(n, BLOCK_N)


@gluon.jit
def _producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, A_T: gl.constexpr,
              B_T: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    it = 0
    for tile in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        for kk in range(k_steps):
            s = it % STAGES
            # Barriers start in phase 1 done, so the first pass through the buffers waits
            # on nothing.
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            off_k = kk * BLOCK_K
            if A_T:
                tma_load(a_desc, [off_k, off_m], bar, a_bufs.index(s))
            else:
                tma_load(a_desc, [off_m, off_k], bar, a_bufs.index(s))
            if B_T:
                tma_load(b_desc, [off_n, off_k], bar, b_bufs.index(s))
            else:
                tma_load(b_desc, [off_k, off_n], bar, b_bufs.index(s))
            it += 1


@gluon.jit
def _operands(a_bufs, b_bufs, s, WG: gl.constexpr, A_T: gl.constexpr, B_T: gl.constexpr,
              ROWS: gl.constexpr):
    """Warpgroup ``WG``'s A rows and the B block of buffer ``s``, as the MMA reads them (a
    column-major operand's buffer holds its transpose)."""
    if A_T:
        a_op = a_bufs.index(s).slice(WG * ROWS, ROWS, dim=1).permute((1, 0))
    else:
        a_op = a_bufs.index(s).slice(WG * ROWS, ROWS, dim=0)
    if B_T:
        b_op = b_bufs.index(s).permute((1, 0))
    else:
        b_op = b_bufs.index(s)
    return a_op, b_op


@gluon.jit
def _store(c_desc, c_smem, c, off_m, off_n):
    """Hands the output block ``c`` to the copy engine through ``c_smem``."""
    # The last store must have read the buffer before it is written again; it has had a
    # tile's K loop to do so.
    tma.store_wait(0)
    c_smem.store(c)
    fence_async_shared()
    tma_store(c_desc, [off_m, off_n], c_smem)


@gluon.jit
def _consumer(a_bufs, b_bufs, c_bufs, c_desc, ready, empty, M, N, K, WG: gl.constexpr,
              A_T: gl.constexpr, B_T: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
              STAGES: gl.constexpr):
    """Warpgroup ``WG``'s 64 rows of each of the program's tiles."""
    ROWS: gl.constexpr = BLOCK_M // 2
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    c_smem = c_bufs.index(WG)
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    # Each tile's first MMA ignores the accumulator's value (use_acc), so the last tile's
    # registers serve without zeroing.
    acc = gl.zeros([ROWS, BLOCK_N], gl.float32, acc_layout)
    it = 0
    for tile in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        for kk in range(k_steps):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            a_op, b_op = _operands(a_bufs, b_bufs, s, WG, A_T, B_T, ROWS)
            acc = warpgroup_mma(a_op, b_op, acc, use_acc=kk > 0, is_async=True)
            # One MMA stays in flight; the one before it has read its buffers.
            acc = warpgroup_mma_wait(1, deps=[acc])
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=kk > 0)
            it += 1
        acc = warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
        # The copy engine stores the block while the warpgroup starts its next tile.
        _store(c_desc, c_smem, acc.to(c_desc.dtype), pid_m * BLOCK_M + WG * ROWS,
               pid_n * BLOCK_N)
    tma.store_wait(0)


@gluon.jit(launch_metadata=_host.gemm_launch_metadata("a_desc", "c_desc"))
def _matmul_gluon_kernel(a_desc, b_desc, c_desc, M, N, K, A_T: gl.constexpr,
                         B_T: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                         BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                         CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2] + c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        # One arrival per consumer partition: Triton 3.6 synchronizes the partition's warps
        # and arrives from its first thread.
        mbarrier.init(empty.index(s), count=2)
    gl.warp_specialize([
        (_consumer, (a_bufs, b_bufs, c_bufs, c_desc, ready, empty, M, N, K, 0, A_T, B_T,
                     BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES)),
        (_consumer, (a_bufs, b_bufs, c_bufs, c_desc, ready, empty, M, N, K, 1, A_T, B_T,
                     BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES)),
        (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, A_T, B_T,
                     BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


@functools.lru_cache(maxsize=None)
def _layout(block: tuple[int, int], dtype: torch.dtype) -> gl.NVMMASharedLayout:
    # Built once per block and dtype: building one took about 5 µs of Python, three per
    # call (x86 host, Triton 3.6).
    gl_dtype = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype)


def _descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A host descriptor of the 2-D ``t`` (unit stride in its last dimension) with
    ``block`` boxes in the MMA's 128-byte swizzled layout (``_host.tma_layout`` has checked
    ``t``)."""
    return descriptor(t, list(t.shape), list(t.stride()), block, _layout(tuple(block), t.dtype))


def matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, num_sms: int,
           plan=None) -> torch.Tensor:
    """Writes ``a @ b`` into ``out`` (M, N), contiguous, in the operands' dtype, and returns
    it, for ``a`` (M, K) and ``b`` (K, N) of one of :data:`DTYPES`, each row- or
    column-major with 16-byte aligned strides and base (``_host.tma_layout``), M, N, K
    positive, on an sm_90 device with ``num_sms`` SMs; fp32 accumulation. With a ``plan``
    (``LaunchPlan``), a call it has seen launches the compiled binary directly."""
    M, K = a.shape
    N = b.shape[1]
    a_t = _host.tma_layout(a) == "col"
    b_t = _host.tma_layout(b) == "col"
    a_desc = _descriptor(a.t(), [BLOCK_K, BLOCK_M]) if a_t else _descriptor(a, [BLOCK_M, BLOCK_K])
    b_desc = _descriptor(b.t(), [BLOCK_N, BLOCK_K]) if b_t else _descriptor(b, [BLOCK_K, BLOCK_N])
    c_desc = _descriptor(out, [BLOCK_M // 2, BLOCK_N])
    grid = (min(num_sms, tiles(M, N)),)
    # Descriptors are built per call (they hold the tensors' addresses); a direct launch
    # keys them by type, as Triton does.
    _host.launcher(plan, _matmul_gluon_kernel)[grid](
        a_desc, b_desc, c_desc, M, N, K, A_T=a_t, B_T=b_t, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K, GROUP_M=GROUP_M, STAGES=STAGES, CONSUMER_REGS=CONSUMER_REGS,
        PRODUCER_REGS=PRODUCER_REGS, num_warps=4)
    return out
