"""matmul: ``out = a @ b`` for 2-D ``a`` (M, K) and ``b`` (K, N), any sizes, fp32 accumulation.

Operands: fp16, bf16 or fp32, and the output has their dtype; or fp8, both operands the
same, in the device's encoding (``float8_e4m3fn`` or ``float8_e5m2`` with the ``fp8``
capability; ``float8_e4m3fnuz`` or ``float8_e5m2fnuz`` with ``fp8_fnuz``, AMD CDNA3; the
other encoding is refused with the conversion to make), and then the output is bf16: an fp8 output could hold neither the range nor the precision of a
K-long sum. No scales are applied; for per-tensor scaled fp8 (``torch._scaled_mm``'s
``scale_a * scale_b``), multiply the output by the product of the scales.

Each program computes ``BLOCK_SIZE_M x BLOCK_SIZE_N`` tiles of the output: it walks K in
steps of ``BLOCK_SIZE_K``, accumulating ``tl.dot`` of an A tile and a B tile in fp32, and
rounds to the output dtype once at the end. Tiles are visited in grouped order
(``GROUP_SIZE_M`` rows of tiles column by column) so that the operand panels a group
shares stay in L2. The tile steps live in ``_tiles.py``, shared with ``grouped_matmul``.

Constexpr switches (a variant sets them; see ``_tiles.py`` for the ones the helpers take):
    TMA: operands and output go through tensor descriptors, built on the device once per
        program (``_tiles.gemm_descriptors``), instead of masked pointer loads. Needs
        16-byte aligned bases and strides; a column-major operand is described through
        its transpose (``A_T``/``B_T``, chosen per call).
    PERSISTENT: launch ``min(SMs, work units)`` programs that each walk work units with a
        stride of the grid size, instead of one program per work unit.
    WARP_SPECIALIZE: warp-specialized K loop (TMA path only; not with ``SPLIT_K > 1``).
    UPCAST: fp32 dots (the interpreter's bf16 arithmetic is wrong).

Configs: ``BLOCK_SIZE_M``, ``BLOCK_SIZE_N``, ``BLOCK_SIZE_K``, ``GROUP_SIZE_M``, optionally
``EPILOGUE_SUBTILE`` (TMA path: store the tile in two halves), ``SPLIT_K`` and
``FP8_PROMOTE`` (fp8 MMAs: products per addition into the fp32 accumulator, default 128,
see ``_tiles.dot_acc``), ``num_warps``, ``num_stages``; autotuned per (M, N, K). A table
may mark configs ``OPERAND_BYTES: 1`` to keep them for fp8 operands (``operand_configs``).
A config of a descriptor variant may also set ``TMA`` and ``PERSISTENT``
(:data:`CONFIG_SWITCHES`), overriding the variant's switches for the problems it is picked
for: on sm_90 the pointer-load kernel, one program per tile, runs
small problems faster than the persistent descriptor one (which builds its descriptors in
every program), so the Hopper table offers both and the autotuner chooses per problem.

Split-K (``SPLIT_K > 1``, a config): when the output has too few tiles to occupy every SM
(decode-sized M, small squares), each tile's K range is cut into ``SPLIT_K`` slices of
whole ``BLOCK_SIZE_K`` blocks and a work unit is one (slice, tile) pair, so ``SPLIT_K``
times as many programs stream the operands. Every slice stores its fp32 partial tile in a
``[SPLIT_K, M, N]`` workspace and counts itself in on the tile's counter (an atomic
increment with release/acquire semantics); the slice that arrives last sums the
``SPLIT_K`` partials in slice order (so the result does not depend on arrival order),
stores the tile and resets the counter to zero. One launch, no second pass; the launcher
passes a workspace only for problems where the pruning keeps a split config, kept per
stream (``_counters``) instead of allocated per call, and since each launch leaves the
counters at zero, it keeps them the same way instead of zero-filling new ones per call.

Variants: ``generic`` (pointer loads, one program per tile) here; the NVIDIA backend
registers ``nvidia.persistent_tma`` (TMA + PERSISTENT + WARP_SPECIALIZE) over the same
kernel.
"""
from __future__ import annotations

import copy
import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..registry import KernelSpec, Variant
from . import _counters, _host, _tiles

NAME = "matmul"

#: Operand dtypes: the float types, and fp8 (which needs the ``fp8`` capability).
OPERAND_DTYPES = _host.FLOAT_DTYPES + _host.FP8_DTYPES

#: dtypes the TMA path takes: 16-bit operands, which the MMA reads from shared memory in
#: either order (so transposed operands need no copy), and fp8. fp32 stays on the pointer
#: path.
TMA_DTYPES = (torch.float16, torch.bfloat16, *_host.FP8_DTYPES)


def out_dtype(dtype: torch.dtype) -> torch.dtype:
    """The output dtype of operands of ``dtype``: the same, but bf16 for fp8 operands."""
    return torch.bfloat16 if dtype in _host.FP8_DTYPES else dtype

#: Switches a config may set, overriding the variant's (see the module docstring). Turning
#: TMA off is always safe: the pointer path takes any layout the descriptor path takes.
CONFIG_SWITCHES = ("TMA", "PERSISTENT")


_matmul_launch_metadata = _host.gemm_launch_metadata("a", "c")


# --- kernel ---------------------------------------------------------------------------------

@triton.jit
def _store_tile(
    c, c_ptr, acc,                                  # output pointer or descriptor, its pointer, fp32 tile
    M, N, stride_cm, stride_cn,                     # output sizes and strides
    off_m, off_n,                                   # the tile's first row and column
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr,
    EPILOGUE_SUBTILE: tl.constexpr, TMA: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    if ACCUMULATE:
        # Through pointers on every path: a descriptor load of the tile would need shared
        # memory beside the main loop's stages, which the tuned configs already fill.
        _tiles.ptr_accumulate(c_ptr, acc, M, N, stride_cm, stride_cn, off_m, off_n,
                              BLOCK_SIZE_M, BLOCK_SIZE_N)
    elif TMA:
        _tiles.desc_store(c, acc, off_m, off_n, BLOCK_SIZE_M, BLOCK_SIZE_N, EPILOGUE_SUBTILE)
    else:
        _tiles.ptr_store(c, acc, M, N, stride_cm, stride_cn, off_m, off_n, BLOCK_SIZE_M, BLOCK_SIZE_N)


@triton.jit
def _split_k_store(
    partials, counters,                             # fp32 [SPLIT_K, M, N] workspace, int32 per tile
    c, c_ptr, acc,                                  # output pointer or descriptor, its pointer, fp32 partial tile
    tile_id, split,                                 # which tile, which K slice
    M, N, stride_cm, stride_cn,                     # output sizes and strides
    off_m, off_n,                                   # the tile's first row and column
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr,
    EPILOGUE_SUBTILE: tl.constexpr, SPLIT_K: tl.constexpr, TMA: tl.constexpr,
    ACCUMULATE: tl.constexpr,
):
    """Split-K epilogue: store this slice's partial tile; the tile's last slice to arrive
    sums all ``SPLIT_K`` partials and stores the result."""
    offs_m = tl.arange(0, BLOCK_SIZE_M)
    offs_n = tl.arange(0, BLOCK_SIZE_N)
    in_tile = (off_m + offs_m[:, None] < M) & (off_n + offs_n[None, :] < N)
    # The tile in plane 0 of the workspace (int64: planes pass 2**31 elements), offsets
    # within it (int32: a tile's rows span less than 2**31 elements), one plane apart.
    tile_0 = partials + (tl.cast(off_m, tl.int64) * N + off_n)
    at = offs_m[:, None] * N + offs_n[None, :]
    plane = tl.cast(M, tl.int64) * N
    tl.store(tile_0 + split * plane + at, acc, mask=in_tile)
    # --- count this slice in ---
    # The barrier orders every thread's partial stores before the atomic, which one
    # thread performs with release semantics (cumulative: it publishes what the barrier
    # ordered before it); its acquire side makes the other slices' partials visible to
    # the last one, whose threads wait at the barrier that broadcasts the atomic's result.
    tl.debug_barrier()
    arrived = tl.atomic_add(counters + tile_id, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT_K - 1:
        # --- the last slice: sum the partials in slice order, not arrival order, so the
        # result is the same from run to run. ".cg" loads read L2, where the other SMs'
        # stores are, never a stale line of this SM's L1. A loop, not unrolled: one
        # partial tile in registers at a time. ---
        total = tl.load(tile_0 + at, mask=in_tile, other=0.0, cache_modifier=".cg")
        for s in range(1, SPLIT_K):
            total += tl.load(tile_0 + s * plane + at, mask=in_tile, other=0.0, cache_modifier=".cg")
        # Leave the counter at zero: the autotuner relaunches with the same arguments.
        tl.atomic_xchg(counters + tile_id, 0)
        _store_tile(c, c_ptr, total, M, N, stride_cm, stride_cn, off_m, off_n,
                    BLOCK_SIZE_M, BLOCK_SIZE_N, EPILOGUE_SUBTILE, TMA, ACCUMULATE)


@triton.jit
def _matmul_tile(
    work_id,                                        # linear work unit: (K slice, tile)
    a, b, c,                                        # pointers, or descriptors when TMA
    c_ptr,                                          # the output's pointer (ACCUMULATE reads it)
    partials, counters,                             # split-K workspace (SPLIT_K > 1 only)
    M, N, K,                                        # sizes
    stride_am, stride_ak, stride_bk, stride_bn,     # operand strides (pointer path)
    stride_cm, stride_cn,                           # output strides (pointer path)
    num_pid_m, num_pid_n,                           # tiles along M and N
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr, EPILOGUE_SUBTILE: tl.constexpr, SPLIT_K: tl.constexpr,
    TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, UPCAST: tl.constexpr,
    A_T: tl.constexpr, B_T: tl.constexpr, FP8_PROMOTE: tl.constexpr,
    ACCUMULATE: tl.constexpr,
):
    # --- work unit -> tile (grouped order) and K blocks [k_lo, k_hi) ---
    k_blocks = tl.cdiv(K, BLOCK_SIZE_K)
    if SPLIT_K == 1:
        tile_id = work_id
        k_lo = 0
        k_hi = k_blocks
    else:
        # Slice-major: units num_tiles apart are the slices of one tile, so consecutive
        # programs take neighbouring tiles of one slice and the grouped order's L2 reuse
        # holds within a slice. Slices are whole blocks; trailing ones may be empty
        # (their partial is zeros), the last non-empty one holds the K tail.
        num_tiles = num_pid_m * num_pid_n
        split = work_id // num_tiles
        tile_id = work_id - split * num_tiles
        k_per_split = tl.cdiv(k_blocks, SPLIT_K)
        k_lo = split * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, k_blocks)
    pid_m, pid_n = _tiles.grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_SIZE_M)
    off_m = pid_m * BLOCK_SIZE_M
    off_n = pid_n * BLOCK_SIZE_N

    # --- main loop ---
    if TMA:
        # Never warp-specialized when K is split: on sm_90 with triton 3.6 the 4-warp
        # split-K configs (the ones Triton specializes) computed garbage, errors up to 7e19
        # (bench/matmul_sweep.py on the H200), as if the split epilogue's partial stores
        # and counter raced the specialized loop. Pipelined, they are correct.
        acc = _tiles.desc_mainloop(a, b, off_m, off_n, k_lo, k_hi, BLOCK_SIZE_M, BLOCK_SIZE_N,
                                   BLOCK_SIZE_K, A_T, B_T, UPCAST, WARP_SPECIALIZE and SPLIT_K == 1,
                                   FP8_PROMOTE)
    else:
        acc = _tiles.ptr_mainloop(a, b, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                                  off_m, off_n, k_lo, k_hi, BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K,
                                  UPCAST)

    # --- write-back ---
    if SPLIT_K == 1:
        _store_tile(c, c_ptr, acc, M, N, stride_cm, stride_cn, off_m, off_n,
                    BLOCK_SIZE_M, BLOCK_SIZE_N, EPILOGUE_SUBTILE, TMA, ACCUMULATE)
    else:
        _split_k_store(partials, counters, c, c_ptr, acc, tile_id, split, M, N, stride_cm, stride_cn,
                       off_m, off_n, BLOCK_SIZE_M, BLOCK_SIZE_N, EPILOGUE_SUBTILE, SPLIT_K, TMA,
                       ACCUMULATE)


@triton.jit(launch_metadata=_matmul_launch_metadata)
def _matmul_kernel(
    # --- pointers ---
    a, b, c,
    partials, counters,     # split-K workspace: fp32 [SPLIT_K, M, N], int32 per tile, zeroed
    # --- sizes ---
    M, N, K,
    # --- strides, in elements ---
    stride_am, stride_ak,
    stride_bk, stride_bn,
    stride_cm, stride_cn,
    # --- meta: config ---
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    EPILOGUE_SUBTILE: tl.constexpr = False,
    SPLIT_K: tl.constexpr = 1,
    FP8_PROMOTE: tl.constexpr = 128,
    # --- meta: variant switches, then per-call layout ---
    TMA: tl.constexpr = False,
    PERSISTENT: tl.constexpr = False,
    WARP_SPECIALIZE: tl.constexpr = False,
    UPCAST: tl.constexpr = False,
    A_T: tl.constexpr = False,
    B_T: tl.constexpr = False,
    ACCUMULATE: tl.constexpr = False,
):
    c_ptr = c
    if TMA:
        # --- tensor descriptors, once per program (a persistent one reuses them) ---
        a, b, c = _tiles.gemm_descriptors(a, b, c, M, N, K, stride_am, stride_ak, stride_bk,
                                          stride_bn, stride_cm, BLOCK_SIZE_M, BLOCK_SIZE_N,
                                          BLOCK_SIZE_K, A_T, B_T, EPILOGUE_SUBTILE, not ACCUMULATE)
    num_pid_m = tl.cdiv(M, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    if PERSISTENT:
        # --- persistent: min(SMs, work units) programs, each striding over the units ---
        # Consecutive programs take consecutive tiles of the grouped order, so the grid as
        # a whole still sweeps one L2-sized group at a time.
        for work_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n * SPLIT_K, tl.num_programs(0)):
            _matmul_tile(work_id, a, b, c, c_ptr, partials, counters, M, N, K,
                         stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                         num_pid_m, num_pid_n, BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K,
                         GROUP_SIZE_M, EPILOGUE_SUBTILE, SPLIT_K, TMA, WARP_SPECIALIZE, UPCAST,
                         A_T, B_T, FP8_PROMOTE, ACCUMULATE)
    else:
        # --- one program per work unit ---
        _matmul_tile(tl.program_id(0), a, b, c, c_ptr, partials, counters, M, N, K,
                     stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                     num_pid_m, num_pid_n, BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K,
                     GROUP_SIZE_M, EPILOGUE_SUBTILE, SPLIT_K, TMA, WARP_SPECIALIZE, UPCAST,
                     A_T, B_T, FP8_PROMOTE, ACCUMULATE)


# --- host launcher --------------------------------------------------------------------------

class Problem(NamedTuple):
    device: torch.device
    dtype: torch.dtype
    a_layout: str     # _host.tma_layout(a): "row", "col" or "" (no descriptor can take it)
    b_layout: str
    n_aligned: bool   # output rows (N elements) are a multiple of 16 bytes: a TMA store fits
    # M, N and K (0 where an operand is not 2-D: the launcher's checks name it), for
    # predicates about size. A new size costs one selection, where the autotuner (keyed
    # on them too) costs far more.
    m: int
    n: int
    k: int
    accumulate: bool = False  # acc= given: the product is added to an existing output


def problem(a, b, acc=None) -> Problem:
    """Selection key of a ``matmul(a, b, acc)`` call."""
    device = _host.same_device(NAME, a=a, b=b)
    # Output rows of N elements: 2 bytes each for fp8 operands (bf16 output).
    n_aligned = b.dim() == 2 and (b.shape[1] * max(2, b.element_size())) % 16 == 0
    m, k = a.shape if a.dim() == 2 else (0, 0)
    return Problem(device, a.dtype, _host.tma_layout(a), _host.tma_layout(b), n_aligned,
                   m, b.shape[1] if b.dim() == 2 else 0, k, acc is not None)


def tma_accepts(problem: Problem, device) -> str | None:
    """Predicate of TMA variants: what a tensor descriptor cannot describe goes elsewhere."""
    if problem.dtype not in TMA_DTYPES:
        return (f"{_host._dtype_name(problem.dtype)} operands stay on pointer loads (the TMA "
                "path takes float16, bfloat16 and the fp8 types)")
    for name, layout in (("a", problem.a_layout), ("b", problem.b_layout)):
        if not layout:
            return (f"{name} cannot be described by a tensor descriptor: it needs a unit "
                    "stride in one dimension and a 16-byte aligned base and other stride")
    if not problem.n_aligned:
        return "output rows (N elements) are not a multiple of 16 bytes, which a TMA store needs"
    return _host.dtype_supported(problem, device)


def _check(a: torch.Tensor, b: torch.Tensor) -> None:
    # Every call runs this: the usual case in one expression, the messages only on failure.
    if (a.dtype is b.dtype and a.dtype in OPERAND_DTYPES and a.dim() == 2 and b.dim() == 2
            and a.shape[1] == b.shape[0]):
        return
    _host.check_dtype(NAME, "a", a, OPERAND_DTYPES)
    _host.check_dtype(NAME, "b", b, OPERAND_DTYPES)
    _host.check_same_dtype(NAME, a=a, b=b)
    _host.check_ndim(NAME, "a", a, 2, "(M, K)")
    _host.check_ndim(NAME, "b", b, 2, "(K, N)")
    if a.shape[1] != b.shape[0]:
        raise _host.InputError(
            f"{NAME}: inner dimensions differ: a {tuple(a.shape)} @ b {tuple(b.shape)} "
            f"needs a.shape[1] == b.shape[0]")


def fit_tiles(configs: list, m: int, n: int) -> list:
    """Autotune pruning: drop configs whose tiles overhang an M x N output by more than a
    64-wide tile (they only add masked-off work and tuning time); keep at least the one
    with the smallest tile."""
    cap_m, cap_n = max(64, _host.next_power_of_2(m)), max(64, _host.next_power_of_2(n))
    kept = [c for c in configs if c.kwargs["BLOCK_SIZE_M"] <= cap_m and c.kwargs["BLOCK_SIZE_N"] <= cap_n]
    return kept or [min(configs, key=lambda c: c.kwargs["BLOCK_SIZE_M"] * c.kwargs["BLOCK_SIZE_N"])]


def fit_split(configs: list, m: int, n: int, k: int, num_sms: int) -> list:
    """Autotune pruning of split-K configs: keep one only where its tiles are too few to
    occupy the SMs (tiles x SPLIT_K within 1.25 x SMs, which also bounds the workspace)
    and each slice keeps at least four K blocks."""
    kept = []
    for c in configs:
        split = c.kwargs.get("SPLIT_K", 1)
        if split > 1:
            tiles = _host.cdiv(m, c.kwargs["BLOCK_SIZE_M"]) * _host.cdiv(n, c.kwargs["BLOCK_SIZE_N"])
            if tiles * split * 4 > num_sms * 5 or k < 4 * split * c.kwargs["BLOCK_SIZE_K"]:
                continue
        kept.append(c)
    return kept or configs


def candidates(configs: list, m: int, n: int, k: int, num_sms: int) -> list:
    """The configs the autotuner may pick for an M x N x K problem (all of them when there
    is one: Triton prunes only lists of two or more)."""
    if len(configs) < 2:
        return configs
    return fit_split(fit_tiles(configs, m, n), m, n, k, num_sms)


def _prune(configs: list, nargs: dict, num_sms: int, **kwargs) -> list:
    return candidates(configs, nargs["M"], nargs["N"], nargs["K"], num_sms)


def _split_workspace(configs: list, m: int, n: int, k: int, num_sms: int) -> tuple[int, int]:
    """``(slices, tiles)`` the split-K workspace needs for any config the autotuner may
    pick for this problem; ``(0, 0)`` when none of them splits."""
    slices = tiles = 0
    for c in candidates(configs, m, n, k, num_sms):
        split = c.kwargs.get("SPLIT_K", 1)
        if split > 1:
            slices = max(slices, split)
            tiles = max(tiles, _host.cdiv(m, c.kwargs["BLOCK_SIZE_M"]) * _host.cdiv(n, c.kwargs["BLOCK_SIZE_N"]))
    return slices, tiles


def operand_configs(configs: list, itemsize: int) -> list:
    """The configs for operands of ``itemsize`` bytes: those a table marks with
    ``OPERAND_BYTES: itemsize``, else the unmarked ones (else all), without the mark (the
    kernel does not take it). fp8 tiles want twice the K depth of 16-bit ones for the same
    bytes per stage, so a table may keep separate lists."""
    marked = [c for c in configs if c.kwargs.get("OPERAND_BYTES") == itemsize]
    chosen = marked or [c for c in configs if "OPERAND_BYTES" not in c.kwargs] or configs
    if not any("OPERAND_BYTES" in c.kwargs for c in chosen):
        return chosen
    chosen = [copy.copy(c) for c in chosen]
    for c in chosen:
        c.kwargs = {k: v for k, v in c.kwargs.items() if k != "OPERAND_BYTES"}
    return chosen


class _Tuned(NamedTuple):
    kernel: object     # the autotuned _matmul_kernel
    switches: dict     # passed at launch
    configs: list      # the autotuner's configs (for sizing split-K workspaces)


def _tuned_kernel(plan, itemsize: int) -> _Tuned:
    """The autotuner for operands of ``itemsize`` bytes (over :func:`operand_configs`),
    and the switches to pass at launch: when some config sets a :data:`CONFIG_SWITCHES`
    entry, every config carries those switches (the variant's values where it sets none)
    and the launch passes the rest; otherwise the launch passes every switch."""
    def build():
        switches = dict(plan.switches)
        configs = operand_configs(plan.configs, itemsize)
        if any(name in c.kwargs for c in configs for name in CONFIG_SWITCHES):
            defaults = {name: switches.get(name, False) for name in CONFIG_SWITCHES}
            configs = [copy.copy(c) for c in configs]
            for c in configs:
                c.kwargs = {**defaults, **c.kwargs}
            switches = {k: v for k, v in switches.items() if k not in CONFIG_SWITCHES}
        num_sms = plan.device.num_sms
        # Operand sizes without configs of their own share one autotuner (its key holds the
        # dtype), and its persisted results.
        own = any(c.kwargs.get("OPERAND_BYTES") == itemsize for c in plan.configs)
        kernel = plan.autotuned(_matmul_kernel, key=["M", "N", "K", "A_T", "B_T"], configs=configs,
                                prune_configs_by={"early_config_prune": functools.partial(_prune, num_sms=num_sms)},
                                name=f"{itemsize}-byte operands" if own else "")
        return _Tuned(kernel, switches, configs)

    return plan.cached((NAME, "tuned kernel", itemsize), build)


def _problem_key(tma: bool, a: torch.Tensor, b: torch.Tensor) -> tuple:
    """``(M, N, K, A_T, B_T, dtype)``: the autotuner's whole key for ``a @ b``. A_T and B_T
    are set (descriptor path only) for column-major operands, which are described through
    their transposes."""
    a_t = tma and a.stride(0) == 1 and a.stride(1) != 1
    b_t = tma and b.stride(0) == 1 and b.stride(1) != 1
    return (a.shape[0], b.shape[1], a.shape[1], a_t, b_t, a.dtype)


def chosen_config(plan, a: torch.Tensor, b: torch.Tensor) -> dict | None:
    """The config keywords ``plan`` launches ``a @ b`` with once tuned (None before): for
    benchmarks and ``explain``-style reports."""
    tuned = _tuned_kernel(plan, a.element_size()).kernel
    return plan.chosen(tuned, _problem_key(plan.switches.get("TMA", False), a, b))


def _check_acc(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    shape = (a.shape[0], b.shape[1])
    if not isinstance(acc, torch.Tensor) or tuple(acc.shape) != shape:
        got = tuple(acc.shape) if isinstance(acc, torch.Tensor) else type(acc).__name__
        raise _host.InputError(f"{NAME}: acc must be the (M, N) = {shape} output to add a @ b "
                               f"to, got {got}")
    if acc.dtype != out_dtype(a.dtype):
        raise _host.InputError(f"{NAME}: acc must have the output dtype "
                               f"{_host._dtype_name(out_dtype(a.dtype))} of {_host._dtype_name(a.dtype)} "
                               f"operands, got {_host._dtype_name(acc.dtype)}")
    _host.same_device(NAME, a=a, acc=acc)
    if acc.numel() > 1 and 0 in acc.stride():
        raise _host.InputError(f"{NAME}: acc is written in place and must not be a broadcast "
                               f"view (strides {acc.stride()})")


def launch(plan, a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` for ``a`` (M, K) and ``b`` (K, N) of one dtype (fp16, bf16, fp32, or fp8
    e4m3/e5m2 in the device's encoding, OCP or fnuz), any strides; accumulates in fp32 (tf32
    dots for fp32 on NVIDIA GPUs). Returns a new contiguous (M, N) tensor of that dtype, or
    bf16 for fp8 operands.

    With ``acc`` (M, N) of that output dtype, any strides: ``acc += a @ b`` in place (as
    ``torch.addmm(acc, a, b, out=acc)``), the old value added to the fp32 product and
    rounded once; returns ``acc``. For sums over many products that would not fit at once
    (a weight gradient over chunks of tokens)."""
    _check(a, b)
    M, K = a.shape
    N = b.shape[1]
    if acc is None:
        out = torch.empty((M, N), dtype=out_dtype(a.dtype), device=a.device)
    else:
        _check_acc(acc, a, b)
        out = acc
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out if acc is not None else out.zero_()
    num_sms = plan.device.num_sms

    def grid(meta):
        bm, bn = meta["BLOCK_SIZE_M"], meta["BLOCK_SIZE_N"]
        units = _host.cdiv(M, bm) * _host.cdiv(N, bn) * meta.get("SPLIT_K", 1)
        return (min(units, num_sms) if meta.get("PERSISTENT", False) else units,)

    kernel, switches, configs = _tuned_kernel(plan, a.element_size())
    # The variant's TMA: a config may turn it off, and then ignores A_T, B_T and the
    # descriptors' scratch.
    tma = plan.switches.get("TMA", False)
    problem_key = _problem_key(tma, a, b)
    a_t, b_t = problem_key[3], problem_key[4]
    if acc is not None and plan.chosen(kernel, problem_key) is None:
        # Tune on a plain product first: the autotuner times each config by launching it
        # several times, which would add to acc once per launch.
        launch(plan, a, b)

    # --- split-K workspace: for the config tuned for this problem, or before tuning for
    # any config the autotuner may pick that splits K ---
    chosen = plan.chosen(kernel, problem_key)
    if chosen is None:
        slices, tiles = plan.cached(("matmul.split_k", M, N, K, a.element_size()),
                                    lambda: _split_workspace(configs, M, N, K, num_sms))
    elif chosen.get("SPLIT_K", 1) > 1:
        slices = chosen["SPLIT_K"]
        tiles = _host.cdiv(M, chosen["BLOCK_SIZE_M"]) * _host.cdiv(N, chosen["BLOCK_SIZE_N"])
    else:
        slices = tiles = 0  # tuned to an unsplit config: no per-call allocation, no zeroing
    if slices:
        # Flat: the kernel finds each plane from M and N. Every slice writes its partial
        # tile before the last one reads them all, so memory kept from earlier calls on
        # this stream serves.
        partials = _counters.kept_scratch(a.device, slices * M * N)
        counters = _counters.kept_zeros(a.device, tiles)  # the kernel leaves them at zero
    else:
        # Never read; real tensors of the same dtypes, so that the kernels compiled for
        # these calls are the ones split-capable problems use for their unsplit configs.
        partials, counters = plan.cached(("matmul.split_k", a.device), lambda: (
            torch.empty(1, dtype=torch.float32, device=a.device),
            torch.zeros(1, dtype=torch.int32, device=a.device)))
    # An accumulating launch has its own key: the same tuned config, another binary.
    run_key = problem_key if acc is None else (*problem_key, "acc")
    with _host.scratch(a.device, tma):
        plan.run_tuned(
            kernel, run_key, grid,
            a, b, out, partials, counters, M, N, K,
            a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
            A_T=a_t, B_T=b_t, ACCUMULATE=acc is not None, **switches,
        )
    return out


# --- reference ------------------------------------------------------------------------------

def reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in float64."""
    return a.double() @ b.double()


def random_weight(k: int, n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A random (K, N) right operand: row-major, or for fp8 column-major (an (N, K)
    weight's transpose), the layout fp8 MMAs run fastest on."""
    if dtype in _host.FP8_DTYPES:
        return torch.randn(n, k, device=device).to(dtype).t()
    return torch.randn(k, n, device=device).to(dtype)


def inputs(shape: str, dtype: torch.dtype, device) -> tuple:
    """Random ``(a, b)`` for shape string ``"MxNxK"``: a (M, K), b (K, N) as
    :func:`random_weight` draws it."""
    m, n, k = _host.parse_shape(NAME, shape, "MxNxK")
    return (torch.randn(m, k, device=device).to(dtype), random_weight(k, n, dtype, device)), {}


def default_configs(device) -> list:
    return [triton.Config({"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 8},
                          num_warps=4, num_stages=3)]


#: Switches of the portable baseline; other variants override some of them.
GENERIC_SWITCHES = {"TMA": False, "PERSISTENT": False, "WARP_SPECIALIZE": False, "UPCAST": False}


def register(registry) -> None:
    registry.add_kernel(KernelSpec(
        NAME, "(a, b, acc=None) -> out", problem,
        "2-D matrix product, any M, N, K, fp32 accumulation; acc=: added in place to acc",
        reference, inputs=inputs, input_shape="MxNxK"))
    registry.add_variant(Variant(
        NAME, "generic", launch, accepts=_host.dtype_supported, switches=GENERIC_SWITCHES,
        configs=default_configs,
        replay=True, description="masked pointer loads, one program per tile in grouped order, autotuned"))
