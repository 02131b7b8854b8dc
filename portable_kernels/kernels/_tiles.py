"""Tile-level ``@triton.jit`` helpers shared by the GEMM families (``matmul``, ``grouped_matmul``).

A GEMM program computes one ``BLOCK_SIZE_M x BLOCK_SIZE_N`` tile of ``C = A @ B`` at a time,
in three steps that both families share and that each come in two load paths:

- :func:`grouped_tile` maps a linear tile index to ``(pid_m, pid_n)`` in grouped order:
  ``GROUP_SIZE_M`` consecutive rows of tiles are walked column by column, so the
  ``GROUP_SIZE_M`` row panels of A and the current column panel of B stay in L2 while a
  group is computed, instead of streaming all of B again for every row of tiles.
- The main loop accumulates over K in fp32: :func:`ptr_mainloop` through masked pointer
  loads (any strides), :func:`desc_mainloop` through tensor descriptors (TMA on Hopper).
  Both take a range ``[k_lo, k_hi)`` of ``BLOCK_SIZE_K`` blocks, so that split-K programs
  each reduce one slice of K; ``0, cdiv(K, BLOCK_SIZE_K)`` is the whole reduction.
- The epilogue rounds the fp32 tile to the output dtype once: :func:`ptr_store` with a
  mask, :func:`desc_store` through a descriptor, optionally in two halves.
- :func:`gemm_descriptors` builds the three descriptors of the descriptor path on the
  device (``tl.make_tensor_descriptor``), from the same pointers and strides the pointer
  path takes: host ``TensorDescriptor`` objects would cost tens of microseconds of Python
  per launch, which is the whole kernel time of a small GEMM. The launcher lends Triton
  an allocator for their global scratch (``_host.scratch_allocator``).

Constexpr switches taken by the helpers:
    UPCAST: convert loaded tiles to fp32 before ``tl.dot``. Triton's interpreter keeps bf16
        as raw bits, so its bf16 dots are garbage; on GPUs 16-bit tiles go to the tensor
        cores as they are, and fp8 tiles too where both are K-major in shared memory
        (descriptor path, row-major A, column-major B), else as fp16 (see :func:`dot_acc`).
    FP8_PROMOTE (descriptor path, fp8 MMAs): products per addition into the fp32
        accumulator (:func:`dot_acc`).
    A_T / B_T (descriptor path): the operand is stored transposed (column-major), so its
        descriptor describes the transpose and each loaded tile is transposed back in
        shared memory, which the MMA reads in either order for 16-bit types.
    WARP_SPECIALIZE (descriptor path): ``tl.range(..., warp_specialize=True)`` on the K loop,
        letting the compiler split producer (TMA) and consumer (MMA) warps.
    SUBTILE (descriptor path): store the tile as two ``BLOCK_SIZE_N / 2`` halves; the second
        half's conversion overlaps the first half's store and the epilogue's shared-memory
        buffer halves, which leaves room for another pipeline stage.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_SIZE_M: tl.constexpr):
    """``(pid_m, pid_n)`` of linear tile ``tile_id`` in grouped (L2-friendly) order."""
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_SIZE_M
    # The last group may have fewer rows of tiles than GROUP_SIZE_M.
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_SIZE_M)
    in_group = tile_id % num_pid_in_group
    pid_m = first_pid_m + in_group % group_size_m
    pid_n = in_group // group_size_m
    return pid_m, pid_n


@triton.jit
def dot_acc(a, b, acc, UPCAST: tl.constexpr, FP8_MMA: tl.constexpr = False,
            FP8_PROMOTE: tl.constexpr = 128):
    """``acc + a @ b`` with an fp32 accumulator. With UPCAST the tiles are converted to fp32
    first: Triton's interpreter keeps bf16 values as raw bits, so its bf16 dot is garbage.

    fp8 tiles go to an fp8 MMA only with ``FP8_MMA``, which the caller sets where both
    tiles sit K-major in shared memory (row-major A, column-major B, through descriptors):
    sm_90's fp8 MMAs read no other order, and for the other orders Triton 3.6 either fails
    to compile ("WGMMA type or shape is not supported", pointer loads) or transposes every
    tile (descriptor loads, 0.1x the speed; H200, triton 3.6). Elsewhere they become fp16,
    which holds every e4m3 and e5m2 value exactly. The fp8 MMA adds its products into
    fewer bits than fp32: by default Triton lets it run a whole K loop that way, which
    left a 256 x 256 x 14336 product 4.5x further from the exact one than cuBLAS's. With
    ``max_num_imprecise_acc`` it adds into the fp32 accumulator every ``FP8_PROMOTE``
    products (at most the tile's K depth; 0: never, Triton's default): with 128, as cuBLAS
    does unless asked for fast accumulation, the errors matched cuBLAS's (max and mean,
    K = 14336 and 57344)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    elif a.dtype.is_fp8():
        if FP8_MMA:
            if FP8_PROMOTE == 0:
                return tl.dot(a, b, acc)
            if a.shape[1] > FP8_PROMOTE:
                return tl.dot(a, b, acc, max_num_imprecise_acc=FP8_PROMOTE)
            return tl.dot(a, b, acc, max_num_imprecise_acc=a.shape[1])
        a = a.to(tl.float16)
        b = b.to(tl.float16)
    return tl.dot(a, b, acc)


@triton.jit
def ptr_mainloop(
    a_ptr, b_ptr,                                   # operand base pointers
    M, N, K,                                        # sizes
    stride_am, stride_ak, stride_bk, stride_bn,     # strides (elements)
    off_m, off_n,                                   # the tile's first row and column
    k_lo, k_hi,                                     # the K blocks to reduce: [k_lo, k_hi)
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """The fp32 ``BLOCK_SIZE_M x BLOCK_SIZE_N`` tile of ``A[:, K slice] @ B[K slice, :]`` at
    ``(off_m, off_n)``, the slice being K blocks ``[k_lo, k_hi)`` (``k_hi`` at most
    ``cdiv(K, BLOCK_SIZE_K)``), through masked pointer loads (any strides, any sizes)."""
    # --- offsets ---
    # The offsets are not wrapped (no `% M`): each tile starts at a multiple of its block
    # and runs contiguously, so the hints below are true even for tail tiles, and the
    # compiler may vectorize along whichever operand dimension has unit stride.
    offs_m = tl.max_contiguous(tl.multiple_of(off_m + tl.arange(0, BLOCK_SIZE_M), BLOCK_SIZE_M), BLOCK_SIZE_M)
    offs_n = tl.max_contiguous(tl.multiple_of(off_n + tl.arange(0, BLOCK_SIZE_N), BLOCK_SIZE_N), BLOCK_SIZE_N)
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    # Rows (of A) and columns (of B) past the edge are masked rather than clamped; int64
    # because row * stride passes 2**31 elements in large operands.
    a_ptrs = a_ptr + (offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak)
    b_ptrs = b_ptr + (offs_k[:, None] * stride_bk + offs_n[None, :].to(tl.int64) * stride_bn)
    # The slice's first K (int64: k * stride passes 2**31 in large column-major operands).
    k_start = tl.cast(k_lo, tl.int64) * BLOCK_SIZE_K
    a_ptrs += k_start * stride_ak
    b_ptrs += k_start * stride_bk
    in_m = offs_m[:, None] < M
    in_n = offs_n[None, :] < N

    # --- main loop: fp32 accumulation over the whole K blocks of the slice ---
    # No K mask here: a mask that varies along a unit-stride K (row-major A) would split
    # its loads into single elements unless the compiler can prove K % 16 == 0, and
    # element-sized (2-byte) copies cannot be pipelined through shared memory. The M and
    # N masks are constant along K, so they cost nothing.
    k_whole = K // BLOCK_SIZE_K   # index of the partial last block, if there is one
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k in range(k_lo, tl.minimum(k_hi, k_whole)):
        a = tl.load(a_ptrs, mask=in_m, other=0.0)
        b = tl.load(b_ptrs, mask=in_n, other=0.0)
        acc = dot_acc(a, b, acc, UPCAST)
        a_ptrs += BLOCK_SIZE_K * stride_ak
        b_ptrs += BLOCK_SIZE_K * stride_bk
    # --- the K tail, once, by the slice that holds it: masked loads read zeros past K,
    # which add nothing ---
    k_left = K % BLOCK_SIZE_K
    if (k_left != 0) & (k_lo <= k_whole) & (k_whole < k_hi):
        a = tl.load(a_ptrs, mask=in_m & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & in_n, other=0.0)
        acc = dot_acc(a, b, acc, UPCAST)
    return acc


@triton.jit
def ptr_store(
    c_ptr, acc,                                     # output base pointer, fp32 tile
    M, N,                                           # sizes
    stride_cm, stride_cn,                           # strides (elements)
    off_m, off_n,                                   # the tile's first row and column
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr,
    ADD: tl.constexpr = False,
):
    """Round ``acc`` to the output dtype once and store the in-bounds part; with ``ADD``,
    the old values read and added in fp32 first."""
    offs_m = off_m + tl.arange(0, BLOCK_SIZE_M)
    offs_n = off_n + tl.arange(0, BLOCK_SIZE_N)
    c_ptrs = c_ptr + (offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if ADD:
        acc += tl.load(c_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def ptr_accumulate(
    c_ptr, acc,                                     # output base pointer, fp32 tile
    M, N,                                           # sizes
    stride_cm, stride_cn,                           # strides (elements)
    off_m, off_n,                                   # the tile's first row and column
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr,
):
    """``C += acc`` on the in-bounds part: the old tile read, the sum taken in fp32 and
    rounded to the output dtype once. In two halves of columns, so that the old values
    of only half a tile are live beside the accumulator (whole, a 128x256 tile of 4 warps
    spilled 760 registers on sm_100)."""
    halves = tl.permute(tl.reshape(acc, (BLOCK_SIZE_M, 2, BLOCK_SIZE_N // 2)), (0, 2, 1))
    left, right = tl.split(halves)
    ptr_store(c_ptr, left, M, N, stride_cm, stride_cn, off_m, off_n,
              BLOCK_SIZE_M, BLOCK_SIZE_N // 2, True)
    ptr_store(c_ptr, right, M, N, stride_cm, stride_cn, off_m, off_n + BLOCK_SIZE_N // 2,
              BLOCK_SIZE_M, BLOCK_SIZE_N // 2, True)


@triton.jit
def gemm_descriptors(
    a_ptr, b_ptr, c_ptr,                            # operand and output base pointers
    M, N, K,                                        # sizes
    stride_am, stride_ak, stride_bk, stride_bn,     # operand strides (elements)
    stride_cm,                                      # output row stride (unit column stride)
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    A_T: tl.constexpr, B_T: tl.constexpr, SUBTILE: tl.constexpr, C_DESC: tl.constexpr = True,
):
    """Tensor descriptors of A, B and C with the block shapes :func:`desc_mainloop` and
    :func:`desc_store` expect. Each needs a unit stride in its last dimension, a 16-byte
    aligned base and a 16-byte multiple other stride (the launcher checked): a
    column-major operand (``A_T``/``B_T``) is described through its transpose. Without
    ``C_DESC``, C stays a pointer (an epilogue that reads C through pointers, any strides)."""
    if A_T:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[K, M], strides=[stride_ak, 1],
                                           block_shape=[BLOCK_SIZE_K, BLOCK_SIZE_M])
    else:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1],
                                           block_shape=[BLOCK_SIZE_M, BLOCK_SIZE_K])
    if B_T:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[stride_bn, 1],
                                           block_shape=[BLOCK_SIZE_N, BLOCK_SIZE_K])
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[stride_bk, 1],
                                           block_shape=[BLOCK_SIZE_K, BLOCK_SIZE_N])
    if not C_DESC:
        c_desc = c_ptr
    elif SUBTILE:
        c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[stride_cm, 1],
                                           block_shape=[BLOCK_SIZE_M, BLOCK_SIZE_N // 2])
    else:
        c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[stride_cm, 1],
                                           block_shape=[BLOCK_SIZE_M, BLOCK_SIZE_N])
    return a_desc, b_desc, c_desc


@triton.jit
def desc_mainloop(
    a_desc, b_desc,                                 # tensor descriptors of A and B
    off_m, off_n,                                   # the tile's first row and column
    k_lo, k_hi,                                     # the K blocks to reduce: [k_lo, k_hi)
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    A_T: tl.constexpr, B_T: tl.constexpr,
    UPCAST: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, FP8_PROMOTE: tl.constexpr = 128,
):
    """The fp32 tile of ``A[:, K slice] @ B[K slice, :]`` at ``(off_m, off_n)`` through
    tensor descriptors, the slice being K blocks ``[k_lo, k_hi)`` (fp8 operands: see
    :func:`dot_acc` for ``FP8_PROMOTE``).

    The descriptors' block shapes are ``[BLOCK_SIZE_M, BLOCK_SIZE_K]`` for A and
    ``[BLOCK_SIZE_K, BLOCK_SIZE_N]`` for B, or their transposes when ``A_T``/``B_T``.
    Out-of-bounds parts of a block read as zero (the copy engine pads them), so tails in
    M, N and K need no masks.
    """
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for ki in tl.range(k_lo, k_hi, warp_specialize=WARP_SPECIALIZE):
        off_k = ki * BLOCK_SIZE_K
        if A_T:
            a = a_desc.load([off_k, off_m]).T
        else:
            a = a_desc.load([off_m, off_k])
        if B_T:
            b = b_desc.load([off_n, off_k]).T
        else:
            b = b_desc.load([off_k, off_n])
        acc = dot_acc(a, b, acc, UPCAST, B_T and not A_T, FP8_PROMOTE)
    return acc


@triton.jit
def desc_store(
    c_desc, acc,                                    # output descriptor, fp32 tile
    off_m, off_n,                                   # the tile's first row and column
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr,
    SUBTILE: tl.constexpr,
):
    """Round ``acc`` to the output dtype and store it through ``c_desc``, whose block shape
    is ``[BLOCK_SIZE_M, BLOCK_SIZE_N // 2]`` when ``SUBTILE`` else the whole tile. The copy
    engine drops the out-of-bounds part of a block."""
    dtype = c_desc.dtype
    if SUBTILE:
        # (M, N) -> (M, 2, N/2) -> (M, N/2, 2), then split the last axis: the left and
        # right halves of the tile, each stored as soon as it is converted.
        halves = tl.permute(tl.reshape(acc, (BLOCK_SIZE_M, 2, BLOCK_SIZE_N // 2)), (0, 2, 1))
        left, right = tl.split(halves)
        c_desc.store([off_m, off_n], left.to(dtype))
        c_desc.store([off_m, off_n + BLOCK_SIZE_N // 2], right.to(dtype))
    else:
        c_desc.store([off_m, off_n], acc.to(dtype))
