"""Tuning configs for NVIDIA GPUs, as data looked up by kernel and variant.

Each entry is a function of the ``DeviceInfo`` returning ``list[triton.Config]``; more than
one config means Triton autotunes among them on first use.
"""
from __future__ import annotations

from typing import Callable

import triton

from portable_kernels import DeviceInfo
from portable_kernels_backends import _common

Configs = Callable[[DeviceInfo], "list[triton.Config]"]


def _gemm(bm: int, bn: int, bk: int, stages: int, warps: int, group: int = 8, **extra) -> triton.Config:
    return triton.Config({"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": bk,
                          "GROUP_SIZE_M": group, **extra}, num_stages=stages, num_warps=warps)


def _matmul(device: DeviceInfo) -> list[triton.Config]:
    # Pointer loads (cp.async pipelines on sm_80+): the spread of Triton's matmul tutorial,
    # big tiles for big problems, narrow ones so that small M or N still fill the SMs.
    # Configs whose stages do not fit shared memory (fp32 operands) fail to compile and
    # the autotuner skips them.
    return [
        _gemm(128, 256, 64, 3, 8),
        _gemm(128, 128, 64, 4, 8),
        _gemm(64, 256, 32, 4, 4),
        _gemm(128, 128, 32, 4, 4),
        _gemm(128, 64, 32, 4, 4),
        _gemm(64, 128, 32, 4, 4),
        _gemm(128, 32, 32, 4, 4),
        _gemm(64, 32, 32, 5, 2),
        _gemm(32, 64, 32, 5, 2),
        # Split-K, for outputs with too few tiles (the launcher's pruning decides where).
        # 8 warps: with 4, the split epilogue spills registers (fp32 operands) or nearly.
        _gemm(64, 128, 64, 4, 8, SPLIT_K=4),
        _gemm(128, 128, 32, 4, 8, SPLIT_K=4),
    ]


# A descriptor variant's config that runs the pointer-load kernel instead (see matmul.py).
_POINTERS = {"TMA": False, "PERSISTENT": False}


def matmul_persistent_tma(device: DeviceInfo) -> list[triton.Config]:
    if device.has("tcgen05"):
        return _matmul_blackwell(device)
    # sm_90: wgmma works on 64 rows per warpgroup (4 warps). Shared memory (227 KB) holds
    # stages x (A + B tiles) plus the epilogue buffer, which the two-halves epilogue
    # halves: that is what lets 128x256x64 keep three or four stages. 64-row tiles serve
    # small M (decode-sized GEMMs).
    # Warp specialization (triton 3.6, sm_90, checked by compiling for sm_90): with 4 warps
    # and 64x128 tiles it splits producer and consumer warps; with 8 warps it leaves the
    # loop software-pipelined; with 4 warps and larger tiles the compiler fails, so no
    # config here has that combination.
    return [
        _gemm(128, 256, 64, 3, 8, EPILOGUE_SUBTILE=True),
        _gemm(128, 256, 64, 4, 8, EPILOGUE_SUBTILE=True),
        _gemm(128, 128, 64, 4, 8, EPILOGUE_SUBTILE=False),
        _gemm(128, 128, 128, 3, 8, EPILOGUE_SUBTILE=True),
        _gemm(128, 64, 64, 4, 8, EPILOGUE_SUBTILE=False),
        _gemm(64, 256, 64, 4, 8, EPILOGUE_SUBTILE=True),
        _gemm(64, 128, 128, 4, 4, EPILOGUE_SUBTILE=False),
        _gemm(64, 128, 64, 4, 4, EPILOGUE_SUBTILE=False),
        # M = 128, N = 4096: 2 x 64 tiles. Five stages, not four: with cold weights (read
        # from HBM, as a model's are) the deeper pipeline took 128x4096x4096 from 0.77 to
        # 0.85x cuBLAS, and from 0.80-0.85 to 0.87x with them in L2 (H200, triton 3.6).
        _gemm(64, 64, 128, 5, 8, EPILOGUE_SUBTILE=False),
        # Split-K: for outputs with too few tiles to occupy the SMs (M of 16 or 128 with
        # N = 4096; 1024-squares), which the launcher's pruning offers them only to. The
        # kernel does not warp-specialize split loops (4-warp ones computed garbage).
        _gemm(64, 128, 128, 3, 8, SPLIT_K=4),   # M <= 64:  N/128 tiles x 4
        _gemm(64, 128, 64, 4, 8, SPLIT_K=4),    #           (the generic table's pick there)
        _gemm(64, 64, 128, 4, 8, SPLIT_K=2),    #           N/64 tiles x 2
        _gemm(64, 128, 64, 4, 8, SPLIT_K=2),    # M <= 128: 2 x N/128 tiles x 2
        _gemm(128, 128, 64, 4, 8, SPLIT_K=4),   # M <= 128: N/128 tiles x 4
        _gemm(128, 128, 64, 4, 8, SPLIT_K=2),   # 1024-squares: 64 tiles x 2
        # Pointer loads, one program per tile (TMA and PERSISTENT off for these): the
        # generic table's picks for small problems on the H200 (triton 3.6), where that
        # kernel ran faster than the descriptor one (1024^3: 7.6 against 9.1 us; 16 x 4096
        # x 4096: 9.6 against 15.4 us, from a profiler trace of both),
        # and the winners of bench/matmul_sweep.py (bf16: 1024^3 6.7 us against
        # 7.7 for the generic pick; 128 x 14336 x 4096 33.5 us against 36.7 for the
        # descriptor pick; fp16 and bf16: 2048^3 25.3 and 24.7 us against 27.7 and
        # 27.1 for the descriptor pick). The autotuner weighs them against the rest per
        # problem.
        _gemm(128, 256, 32, 3, 8, **_POINTERS),                # 2048-squares
        _gemm(64, 128, 64, 3, 8, **_POINTERS),                 # 1024-squares
        _gemm(64, 256, 64, 4, 8, **_POINTERS),                 # M = 128, N = 14336
        _gemm(64, 128, 64, 4, 8, SPLIT_K=4, **_POINTERS),      # M = 16, K >= 4096
        _gemm(128, 128, 32, 4, 8, SPLIT_K=4, **_POINTERS),     # M = 128, N = 4096
        _gemm(32, 64, 32, 5, 2, **_POINTERS),                  # M = 16, N = 14336
    ] + _matmul_fp8(device)


def _matmul_blackwell(device: DeviceInfo) -> list[triton.Config]:
    # sm_100 (tcgen05): the accumulator lives in tensor memory, not in registers, so 4
    # warps carry a 128x256 tile that needs 8 on sm_90, and warp specialization (a TMA
    # producer, an MMA issuer, the epilogue) is Triton's own schedule there. The space of
    # Triton's persistent-matmul tutorial: 128 x {128, 256} x {64, 128}, 2-4 stages.
    # Compiled for sm_100 (ci/compile_matrix.py: shared memory, registers, spills); never
    # timed on a B200, so the autotuner's first-call timing is what picks among them.
    fp8 = {"OPERAND_BYTES": 1}
    return [
        _gemm(128, 256, 64, 3, 4, EPILOGUE_SUBTILE=True),
        _gemm(128, 256, 64, 4, 4, EPILOGUE_SUBTILE=True),
        _gemm(128, 128, 64, 4, 4, EPILOGUE_SUBTILE=False),
        _gemm(128, 128, 128, 3, 4, EPILOGUE_SUBTILE=True),
        _gemm(64, 128, 64, 4, 4, EPILOGUE_SUBTILE=False),     # small M
        # Split loops keep their accumulator in registers (they do not warp-specialize):
        # 128x128 with 4 warps spilled 152 bytes a thread, with 8 none.
        _gemm(64, 128, 128, 3, 4, SPLIT_K=4),                  # outputs of few tiles
        _gemm(128, 128, 64, 4, 8, SPLIT_K=2),
        _gemm(64, 128, 64, 3, 4, **_POINTERS),
        # Two stages: with three, b row-major (tiles converted for the MMA) needs 240 KB;
        # 8 warps: with 4 that conversion spilled 304 bytes a thread.
        _gemm(128, 256, 128, 2, 8, EPILOGUE_SUBTILE=True, **fp8),
        _gemm(128, 128, 128, 4, 4, **fp8),
        _gemm(64, 128, 256, 3, 4, SPLIT_K=4, **fp8),
    ]


def _matmul_fp8(device: DeviceInfo) -> list[triton.Config]:
    # fp8 operands (OPERAND_BYTES=1, see matmul.operand_configs): the K depth doubles for
    # the same bytes per stage. The fp8 MMA needs K-major tiles (a row-major, b
    # column-major, as an (N, K) weight's transpose); other layouts run fp16 MMAs on
    # converted tiles, through descriptors (0.31-0.33x scaled_mm at 4096^3) or pointer
    # loads (0.23x at best), so the pointer configs here are for operands descriptors
    # cannot take. Measured on the H200 (bench/matmul_sweep.py --dtype fp8e4m3).
    fp8 = {"OPERAND_BYTES": 1}
    return [
        _gemm(128, 256, 128, 3, 8, EPILOGUE_SUBTILE=True, **fp8),
        _gemm(128, 128, 128, 4, 8, **fp8),
        _gemm(128, 128, 256, 3, 8, **fp8),
        _gemm(64, 128, 128, 4, 8, **fp8),
        _gemm(64, 64, 128, 5, 8, **fp8),
        _gemm(64, 64, 256, 4, 8, **fp8),
        _gemm(64, 128, 128, 3, 8, SPLIT_K=4, **fp8),
        _gemm(64, 128, 256, 3, 8, SPLIT_K=4, **fp8),
        _gemm(64, 64, 128, 4, 8, SPLIT_K=2, **fp8),
        _gemm(128, 128, 128, 3, 8, SPLIT_K=2, **fp8),
        _gemm(128, 128, 64, 3, 8, **_POINTERS, **fp8),
        _gemm(64, 128, 64, 4, 8, SPLIT_K=4, **_POINTERS, **fp8),
        _gemm(64, 64, 64, 3, 4, SPLIT_K=2, **_POINTERS, **fp8),
    ]


def _grouped_matmul(device: DeviceInfo) -> list[triton.Config]:
    # One program per SM walks every group's tiles; mid-sized tiles balance small groups
    # (few tiles each) against large ones.
    return [
        _gemm(128, 128, 64, 3, 8),
        _gemm(128, 128, 32, 4, 4),
        _gemm(64, 128, 64, 4, 4),
        _gemm(128, 64, 64, 4, 4),
        _gemm(64, 64, 64, 4, 4),
    ]


def grouped_matmul_tma(device: DeviceInfo) -> list[triton.Config]:
    if device.has("tcgen05"):
        # sm_100: the unsplit descriptor tiles of the Blackwell matmul table (compiled,
        # not timed on a B200).
        return [c for c in _matmul_blackwell(device)
                if "SPLIT_K" not in c.kwargs and c.kwargs.get("TMA", True)]
    # The winners of bench/grouped_matmul_sweep.py on the H200 (bf16, 18 tiles,
    # mixture-of-experts layers of 8 and 64 experts, b row- and column-major; results in
    # docs/performance.md): 128x256 with 8 warps where experts hold many tokens, 64x256
    # with 4 warps where they hold few (64 experts of 32 tokens: 1.01x PyTorch's grouped
    # GEMM against 0.89-0.92x for the earlier table's pick) and for the down projections.
    # 128x128 stays for outputs narrower than 256 columns.
    return [
        _gemm(128, 256, 64, 3, 8, EPILOGUE_SUBTILE=True),
        _gemm(128, 256, 64, 4, 8, EPILOGUE_SUBTILE=True),
        _gemm(64, 256, 64, 4, 4, EPILOGUE_SUBTILE=True),
        _gemm(64, 256, 64, 3, 4, EPILOGUE_SUBTILE=True),
        _gemm(128, 128, 64, 4, 4, EPILOGUE_SUBTILE=False),
    ] + _grouped_matmul_fp8(device)


def _grouped_matmul_fp8(device: DeviceInfo) -> list[triton.Config]:
    # fp8 operands (OPERAND_BYTES=1): the unsplit descriptor tiles of the fp8 matmul table
    # (twice the K depth of the 16-bit tiles), not swept for grouped GEMMs.
    return [c for c in _matmul_fp8(device)
            if "SPLIT_K" not in c.kwargs and c.kwargs.get("TMA", True)]

def _attn(bm, bn, warps, stages, dkdv, dq, row_bytes=None) -> triton.Config:
    """A flash_attn config: the forward's tile, warps and stages, then the dk/dv and the dq
    kernels' (BLOCK_M, BLOCK_N, warps, stages)."""
    kwargs = {"BLOCK_M": bm, "BLOCK_N": bn,
              "BWD_BLOCK_M": dkdv[0], "BWD_BLOCK_N": dkdv[1],
              "BWD_NUM_WARPS": dkdv[2], "BWD_NUM_STAGES": dkdv[3],
              "DQ_BLOCK_M": dq[0], "DQ_BLOCK_N": dq[1], "DQ_NUM_WARPS": dq[2], "DQ_NUM_STAGES": dq[3]}
    if row_bytes is not None:
        kwargs["ROW_BYTES_MAX"] = row_bytes
    return triton.Config(kwargs, num_warps=warps, num_stages=stages)


# Backward settings measured by bench/flash_attn_sweep.py on the H200 (triton 3.6, fp16,
# B=4, H=32, N=4096, the fastest over causal and not; docs/performance.md has the table):
# (BLOCK_M, BLOCK_N, warps, stages), with pointer loads and with descriptors.
_DKDV_D64, _DQ_D64 = (32, 64, 4, 3), (64, 64, 4, 3)
_DKDV_D128, _DQ_D128 = (64, 64, 4, 2), (128, 64, 8, 3)
_DKDV_D64_TMA, _DQ_D64_TMA = (32, 64, 4, 3), (64, 64, 4, 2)


def _flash_attn(device: DeviceInfo) -> list[triton.Config]:
    # By the bytes of one padded K/V row (BLOCK_D x element size): the launcher takes the
    # first entry that fits. Shared memory and registers were checked by compiling for
    # sm_90 (ptxas -v) for the widest row of each class; fp32 rows of D/2 move the same
    # bytes as fp16 rows of D. Each backward kernel holds one block and streams the other:
    # dk/dv holds keys, dq holds queries (at least 64, so that its dots are warpgroup MMAs).
    if device.shared_memory >= 200 * 1024:  # Hopper and later
        return [
            _attn(128, 64, 8, 4, _DKDV_D64, _DQ_D64, row_bytes=128),       # fp16 D<=64
            _attn(128, 64, 8, 3, _DKDV_D128, _DQ_D128, row_bytes=256),     # fp16 D<=128, fp32 D<=64
            _attn(128, 64, 8, 2, (32, 32, 8, 2), (32, 32, 8, 2), row_bytes=512),  # fp16 D=256, fp32 D<=128
            _attn(32, 32, 4, 1, (16, 32, 4, 1), (16, 32, 4, 1)),           # fp32 D=256
        ]
    # Ampere-class shared memory (~164 KB on sm_80): the same shapes, one stage fewer.
    # The 99 KB of sm_89 and sm_120 (L40S, RTX 4090/5090) leave the fp32 D=256 dk/dv
    # kernel 16-key blocks: with 32 it needs 112 KB there (ci/compile_matrix.py).
    widest = (16, 32, 4, 1) if device.shared_memory >= 128 * 1024 else (16, 16, 4, 1)
    return [
        _attn(128, 64, 4, 2, (64, 64, 4, 2), (64, 64, 4, 2), row_bytes=128),
        _attn(64, 64, 4, 2, (32, 64, 4, 2), (32, 64, 4, 2), row_bytes=256),
        _attn(64, 32, 4, 2, (32, 32, 4, 1), (32, 32, 4, 1), row_bytes=512),
        _attn(32, 32, 4, 1, widest, (16, 32, 4, 1)),
    ]


def flash_attn_hopper(device: DeviceInfo) -> list[triton.Config]:
    # nvidia.hopper, fp16/bf16 at D=64 (128-byte rows) and D=128 (256-byte rows). The
    # forward autotunes among the configs of the tightest ROW_BYTES_MAX that fits: the
    # fastest tiles of bench/flash_attn_sweep.py on the H200, through descriptors and, where
    # a pointer-load tile (cp.async pipelining) timed faster (two sweeps: 128x64 with 8
    # warps at D=64, 2-6%; 128x128 with 8 warps at D=128, full), with
    # pointer loads (TMA: False). The backward takes the first config that fits, so each
    # class leads with the sweep's fastest descriptor-path backward settings.
    # No warp-specialized config: triton 3.6's warp-specialized loop for sm_90 (a TMA
    # producer and two consumer warpgroups) computed wrong outputs on the H200 for every
    # causal tile and for 3 stages (inf, errors of 0.2-0.5), and where it was right (full,
    # 2 stages) it ran 7-17% slower than the best pipelined tile (bench/flash_attn_sweep.py).
    # Triton's fused-attention tutorial runs warp_specialize on Blackwell only. The switch
    # and the loop remain (tested under the interpreter) for later Triton releases.
    # The backward takes descriptors from 2048 positions on: as kernels (graph replays,
    # fp16, B=4, H=32, H200) its pointer-load kernels were 5-18% faster at N=1024
    # (per-program descriptor set-up over a short loop) and 3-5% slower at N=4096.
    def cfg(bm, bn, warps, stages, dkdv, dq, row_bytes, tma=True):
        c = _attn(bm, bn, warps, stages, dkdv, dq, row_bytes=row_bytes)
        return triton.Config({**c.kwargs, "TMA": tma, "WARP_SPECIALIZE": False,
                              "BWD_TMA_MIN_SEQ": 2048}, num_warps=warps, num_stages=stages)

    d64, d128 = (_DKDV_D64_TMA, _DQ_D64_TMA), (_DKDV_D128, _DQ_D128)
    return [
        cfg(64, 128, 4, 2, *d64, 128),                # D=64
        cfg(128, 64, 4, 3, *d64, 128),
        cfg(128, 64, 8, 3, *d64, 128, tma=False),
        cfg(128, 64, 8, 4, *d64, 128, tma=False),
        cfg(128, 64, 4, 2, *d128, 256),               # D=128
        cfg(128, 128, 8, 3, *d128, 256, tma=False),
        cfg(128, 128, 8, 3, *d128, 256),
        cfg(64, 64, 4, 3, *d128, 256),
    ]


def flash_attn_blackwell(device: DeviceInfo) -> list[triton.Config]:
    # nvidia.blackwell (sm_100), D=64 and D=128: per row class a warp-specialized tile (a
    # TMA producer and softmax/correction consumers, as Triton's fused-attention tutorial
    # runs on Blackwell) and a software-pipelined one, through descriptors; the backward
    # takes the first config of its class, as on Hopper. Compiled for sm_100
    # (ci/compile_matrix.py); never timed on a B200: the forward's autotuning decides.
    def cfg(bm, bn, warps, stages, dkdv, dq, row_bytes, ws):
        c = _attn(bm, bn, warps, stages, dkdv, dq, row_bytes=row_bytes)
        return triton.Config({**c.kwargs, "TMA": True, "WARP_SPECIALIZE": ws,
                              "BWD_TMA_MIN_SEQ": 2048}, num_warps=warps, num_stages=stages)

    d64, d128 = (_DKDV_D64_TMA, _DQ_D64_TMA), (_DKDV_D128, _DQ_D128)
    return [
        cfg(128, 128, 4, 3, *d64, 128, ws=True),      # D=64
        cfg(128, 64, 4, 3, *d64, 128, ws=False),
        # D=128: a 128x128 warp-specialized tile with 4 warps spilled 336 bytes a thread.
        cfg(128, 128, 8, 2, *d128, 256, ws=True),
        cfg(128, 64, 8, 3, *d128, 256, ws=False),
    ]


def _flash_attn_with_kvcache(device: DeviceInfo) -> list[triton.Config]:
    # Decode is a stream of K/V rows. BLOCK_M is an upper bound (a decode tile packs Nq x
    # GQA-group rows, 16 for one query of an 8-head group), so prefill chunks of several
    # queries get 64-row tiles. 32 keys a step: on an H100 (bf16, D=128, H=32/8) a sweep of
    # BLOCK_N 32/64/128 x 4/8 warps x 3/4 stages x 2/4 waves put 32/4/3 at 2 waves first on
    # every shape timed: B=8 at 32k keys 357 us (64 keys: 378), paged B=8 at 8k 99.8 (106.7),
    # B=1 at 131k 196.8 (198.6), against SDPA's best 349, 93.6 and 179.
    return [triton.Config({"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_R": 16, "WRITE_BLOCK_T": 16},
                          num_warps=4, num_stages=3)]


_TABLE: dict[tuple[str, str | None], Configs] = {
    **_common.MEMORY_BOUND,
    ("flash_attn", None): _flash_attn,
    ("flash_attn", "nvidia.hopper"): flash_attn_hopper,
    # Its forward has one fixed tile (flash_attn_gluon.py); the backward takes these.
    ("flash_attn", "nvidia.hopper_gluon"): flash_attn_hopper,
    ("flash_attn", "nvidia.blackwell"): flash_attn_blackwell,
    ("matmul", None): _matmul,
    ("matmul", "nvidia.persistent_tma"): matmul_persistent_tma,
    ("grouped_matmul", None): _grouped_matmul,
    ("grouped_matmul", "nvidia.tma"): grouped_matmul_tma,
    ("flash_attn_with_kvcache", None): _flash_attn_with_kvcache,
}


def configs(kernel: str, variant: str, device: DeviceInfo) -> list[triton.Config] | None:
    """Configs for ``variant`` of ``kernel`` on ``device``, or None to use the variant's."""
    return _common.table_configs(_TABLE, kernel, variant, device)
