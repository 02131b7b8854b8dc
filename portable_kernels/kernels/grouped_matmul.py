"""grouped_matmul: ``[a_g @ b_g for g]``, independent GEMMs of different sizes in one launch.

The host writes a table with one int64 row per group (the addresses of a, b and the output,
M, N, K and the six strides) and launches a fixed grid: ``min(SMs, tiles)`` programs.
Numbering every group's tiles one after another, program ``p`` computes tiles ``p, p + P,
p + 2P, ...`` (``P`` programs): it walks the table once, and for each group steps through
the tiles of that group that fall to it, in grouped (L2-friendly) order within the group.
Small groups cost no idle programs, large ones spread over the whole device, and one
launch replaces G.

A call's host work (checks, a pass over the groups, G allocations, the table's pinned copy)
grows with G. Once a signature (every group's shapes, strides, dtype and alignment) has
been seen, a replay (``portable_kernels._replay``) allocates the outputs, rebuilds the
table from the recorded one with the new call's addresses (``_replay.table``) and
launches: 8 groups of 16x1024x1024 took 76-95 µs a call against 129-141 on the full path
(two H100 hosts, ``bench/host_per_call.py``).

The tile steps (grouped order, main loops, epilogues) are ``_tiles.py``'s, shared with
``matmul``. Operand dtypes and outputs are ``matmul``'s: fp16, bf16, fp32, and fp8 with
bf16 outputs (``OUT_DTYPE``), where the fp8 MMA needs every ``b`` column-major.

Constexpr switches:
    TMA: each group's operands and output through tensor descriptors built on the device
        (``tl.make_tensor_descriptor``; their 128-byte descriptors live in scratch memory from
        the allocator the launcher installs around the launch). Only for problems whose
        every group is aligned (below).
    ALIGNED (set per call, pointer path): every group's ``a`` and output are row-major and
        its ``b`` is row-major (or with ``B_T`` column-major) in every group, all with
        16-byte aligned bases and rows. The compiler cannot see through the table, so
        without this it must assume any stride and load element by element; with it, the
        kernel fixes the unit strides and states the alignment of the rest
        (``tl.multiple_of``), which lets loads be vectorized.
    B_T (set per call): every ``b`` is column-major, as ``w.t()`` of an (N, K) weight (how
        ``nn.Linear`` and most mixture-of-experts layers store theirs); descriptors then
        describe each ``b`` through its transpose.
    UPCAST: fp32 dots (the interpreter's bf16 arithmetic is wrong).

Configs: ``BLOCK_SIZE_M``, ``BLOCK_SIZE_N``, ``BLOCK_SIZE_K``, ``GROUP_SIZE_M``, optionally
``EPILOGUE_SUBTILE`` (TMA path), ``num_warps``, ``num_stages``; autotuned per number of
groups and the largest group's sizes rounded up to powers of two.
"""
from __future__ import annotations

import array
from typing import NamedTuple, Sequence

import torch
import triton
import triton.language as tl

from .. import _replay
from ..registry import KernelSpec, Variant
from . import _host, _tiles
from .matmul import OPERAND_DTYPES, TMA_DTYPES, fit_tiles, operand_configs, out_dtype, random_weight

NAME = "grouped_matmul"

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32,
              torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5,
              torch.float8_e4m3fnuz: tl.float8e4b8, torch.float8_e5m2fnuz: tl.float8e5b16}

# int64 values per group in the table: the addresses of a, b and c, then M, N, K, then
# stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn.
_ROW = tl.constexpr(12)


# --- kernel ---------------------------------------------------------------------------------

@triton.jit
def _grouped_matmul_kernel(
    # --- pointers ---
    table_ptr,                      # int64 [G, _ROW]: one row per group, see _ROW
    # --- sizes ---
    G,                              # number of groups in the table
    M_KEY, N_KEY, K_KEY,            # autotune key only: largest M, N, K rounded up to 2**n
    # --- meta: config ---
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    EPILOGUE_SUBTILE: tl.constexpr = False,
    # --- meta: switches and per-call facts ---
    DTYPE: tl.constexpr = tl.float16,   # element type of every operand
    OUT_DTYPE: tl.constexpr = tl.float16,   # of every output: DTYPE's, bf16 for fp8 operands
    VEC: tl.constexpr = 8,              # elements per 16 bytes (ALIGNED hints)
    TMA: tl.constexpr = False,
    ALIGNED: tl.constexpr = False,
    B_T: tl.constexpr = False,
    UPCAST: tl.constexpr = False,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    # Global index of the current group's first tile (a tensor: it is carried by the loop).
    first_tile = tl.full([], 0, tl.int32)
    for g in range(G):
        # --- the group's row of the table ---
        row = table_ptr + g * _ROW
        a_ptr = tl.load(row + 0).to(tl.pointer_type(DTYPE))
        b_ptr = tl.load(row + 1).to(tl.pointer_type(DTYPE))
        c_ptr = tl.load(row + 2).to(tl.pointer_type(OUT_DTYPE))
        M = tl.load(row + 3).to(tl.int32)
        N = tl.load(row + 4).to(tl.int32)
        K = tl.load(row + 5).to(tl.int32)
        stride_am = tl.load(row + 6)
        stride_ak = tl.load(row + 7)
        stride_bk = tl.load(row + 8)
        stride_bn = tl.load(row + 9)
        stride_cm = tl.load(row + 10)
        stride_cn = tl.load(row + 11)
        num_pid_m = tl.cdiv(M, BLOCK_SIZE_M)
        num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
        end_tile = first_tile + num_pid_m * num_pid_n
        # This program's first tile here: the least t >= first_tile with t = pid (mod P).
        start = first_tile + (pid - first_tile % num_programs + num_programs) % num_programs

        if TMA:
            # --- descriptors, built only by programs with tiles in this group ---
            if start < end_tile:
                a_desc, b_desc, c_desc = _tiles.gemm_descriptors(
                    a_ptr, b_ptr, c_ptr, M, N, K, stride_am, 1, stride_bk, stride_bn, stride_cm,
                    BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, False, B_T, EPILOGUE_SUBTILE)
                for tile_id in tl.range(start, end_tile, num_programs):
                    pid_m, pid_n = _tiles.grouped_tile(tile_id - first_tile, num_pid_m, num_pid_n,
                                                       GROUP_SIZE_M)
                    off_m = pid_m * BLOCK_SIZE_M
                    off_n = pid_n * BLOCK_SIZE_N
                    acc = _tiles.desc_mainloop(a_desc, b_desc, off_m, off_n,
                                               0, tl.cdiv(K, BLOCK_SIZE_K),
                                               BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K,
                                               False, B_T, UPCAST, False)
                    _tiles.desc_store(c_desc, acc, off_m, off_n, BLOCK_SIZE_M, BLOCK_SIZE_N,
                                      EPILOGUE_SUBTILE)
        else:
            if ALIGNED:
                # 16-byte aligned bases and rows (the host checked every group), so N, the
                # output's row length, is a whole number of 16-byte vectors too.
                N = tl.multiple_of(N, VEC)
                a_ptr = tl.multiple_of(a_ptr, 16)
                b_ptr = tl.multiple_of(b_ptr, 16)
                c_ptr = tl.multiple_of(c_ptr, 16)
                stride_am = tl.multiple_of(stride_am, VEC)
                stride_cm = tl.multiple_of(stride_cm, VEC)
                stride_ak = 1
                stride_cn = 1
                if B_T:
                    stride_bn = tl.multiple_of(stride_bn, VEC)
                    stride_bk = 1
                else:
                    stride_bk = tl.multiple_of(stride_bk, VEC)
                    stride_bn = 1
            for tile_id in tl.range(start, end_tile, num_programs):
                pid_m, pid_n = _tiles.grouped_tile(tile_id - first_tile, num_pid_m, num_pid_n,
                                                   GROUP_SIZE_M)
                off_m = pid_m * BLOCK_SIZE_M
                off_n = pid_n * BLOCK_SIZE_N
                acc = _tiles.ptr_mainloop(a_ptr, b_ptr, M, N, K, stride_am, stride_ak, stride_bk,
                                          stride_bn, off_m, off_n, 0, tl.cdiv(K, BLOCK_SIZE_K),
                                          BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, UPCAST)
                _tiles.ptr_store(c_ptr, acc, M, N, stride_cm, stride_cn, off_m, off_n,
                                 BLOCK_SIZE_M, BLOCK_SIZE_N)
        first_tile = end_tile


# --- host launcher --------------------------------------------------------------------------

class Problem(NamedTuple):
    device: torch.device
    dtype: torch.dtype
    b_layout: str   # "row" or "col" when every group is aligned with b so (see _layout), else ""


def _check_lists(list_a, list_b) -> None:
    for name, value in (("list_a", list_a), ("list_b", list_b)):
        if not isinstance(value, (list, tuple)):
            raise _host.DTypeError(
                f"{NAME}: {name} must be a list or tuple of tensors, got {type(value).__name__}")
    if not list_a or not list_b:
        raise _host.InputError(f"{NAME}: list_a and list_b must be non-empty")
    if len(list_a) != len(list_b):
        raise _host.InputError(
            f"{NAME}: list_a has {len(list_a)} matrices but list_b has {len(list_b)}")


def _layout(pa: int, sam: int, sak: int, pb: int, sbk: int, sbn: int,
            m: int, n: int, k: int, size: int) -> str:
    """``b``'s layout, ``"row"`` or ``"col"``, when ``a`` (at address ``pa``, strides
    ``sam, sak``) is row-major, both have 16-byte aligned bases and rows (the rule of
    :func:`_host.tma_layout`), and so has the output (``n`` elements a row); else ``""``."""
    if (n * size) % 16 or _host.layout_of(pa, m, k, sam, sak, size) != "row":
        return ""
    return _host.layout_of(pb, k, n, sbk, sbn, size)


def _check(list_a, list_b) -> tuple[torch.dtype, torch.device]:
    """The groups' one dtype and device, after checking every group in detail: one dtype
    and device, 2-D operands with matching inner sizes; the error names the first wrong
    group. :func:`problem` tests the valid case in one tight pass and calls this only
    when that pass fails."""
    _check_lists(list_a, list_b)
    tensors = {}
    for g, (a, b) in enumerate(zip(list_a, list_b)):
        tensors[f"list_a[{g}]"] = a
        tensors[f"list_b[{g}]"] = b
    device = _host.same_device(NAME, **tensors)
    dtype = list_a[0].dtype
    for g, (a, b) in enumerate(zip(list_a, list_b)):
        where = f"{NAME} group {g}"
        _host.check_dtype(where, "a", a, OPERAND_DTYPES)
        _host.check_dtype(where, "b", b, OPERAND_DTYPES)
        _host.check_same_dtype(where, a=a, b=b)
        if a.dtype != dtype:
            raise _host.DTypeError(
                f"{where}: dtype {_host._dtype_name(a.dtype)} differs from group 0's "
                f"{_host._dtype_name(dtype)}; every group must have one dtype")
        _host.check_ndim(where, "a", a, 2, "(M, K)")
        _host.check_ndim(where, "b", b, 2, "(K, N)")
        if a.shape[1] != b.shape[0]:
            raise _host.InputError(
                f"{where}: inner dimensions differ: a {tuple(a.shape)} @ b {tuple(b.shape)} "
                "needs a.shape[1] == b.shape[0]")
    return dtype, device


def _common_layout(layouts: set[str]) -> str:
    """The groups' one layout, or ``""`` when they differ or one is unaligned."""
    return next(iter(layouts)) if len(layouts) == 1 else ""


def problem(list_a, list_b) -> Problem:
    """Selection key of a ``grouped_matmul(list_a, list_b)`` call, after checking every
    group (the launcher trusts it): one pass over the groups where they are valid."""
    _check_lists(list_a, list_b)
    layouts = set()
    try:
        dtype, device = list_a[0].dtype, list_a[0].device
        size = list_a[0].element_size()
        valid = dtype in _TL_DTYPES
        for a, b in zip(list_a, list_b) if valid else ():
            (m, k), (k_b, n) = a.shape, b.shape
            if not (a.dtype is dtype and b.dtype is dtype and a.device == device
                    and b.device == device and k == k_b):
                valid = False
                break
            layouts.add(_layout(a.data_ptr(), *a.stride(), b.data_ptr(), *b.stride(), m, n, k,
                                size))
    except (AttributeError, ValueError):  # not a tensor, or not 2-D: named below
        valid = False
    if not valid:
        # Raises where a group is wrong; what it passes (tensor-likes the tight pass does
        # not take) gets its layouts here.
        dtype, device = _check(list_a, list_b)
        size = list_a[0].element_size()
        layouts = {_layout(a.data_ptr(), *a.stride(), b.data_ptr(), *b.stride(), a.shape[0],
                           b.shape[1], a.shape[1], size) for a, b in zip(list_a, list_b)}
    return Problem(device, dtype, _common_layout(layouts))


def tma_accepts(problem: Problem, device) -> str | None:
    """Predicate of the descriptor variant: 16-bit, aligned groups (row-major ``a``,
    ``b`` row-major in every group or column-major in every group)."""
    if problem.dtype not in TMA_DTYPES:
        return (f"{_host._dtype_name(problem.dtype)} operands stay on pointer loads (the TMA "
                "path takes float16, bfloat16 and the fp8 types)")
    if not problem.b_layout:
        return ("some group's a is not row-major, or its b is neither row- nor column-major "
                "as in the other groups, with 16-byte aligned base and rows (a, b and the "
                "output), which device-side tensor descriptors need")
    return _host.dtype_supported(problem, device)


#: Pinned sources and device tables of the table copies captured into CUDA graphs: a graph
#: replays the copy from the same host memory into the same device memory, so both must
#: outlive it; a graph does not say when it is dropped, so they are kept for the process
#: (one int64 row of 12 per group each).
_captured: list[tuple[torch.Tensor, torch.Tensor]] = []


def _device_table(values: list[int], device: torch.device) -> torch.Tensor:
    """The int64 table of ``values`` (G rows of ``_ROW``, flattened) on ``device``,
    copied without waiting.

    A plain ``.to(device)`` copies from pageable host memory, for which PyTorch waits for
    the whole stream to finish: every call would stall the host until the GPU ran dry (no
    overlap of the next layer's launches with this one's kernels), and a CUDA graph cannot
    capture a stream synchronization. From pinned memory the copy is asynchronous and
    ordered on the stream before the kernel; PyTorch's pinned-memory cache does not reuse
    the buffer until the copy has run. Devices without pinned memory (the CPU
    interpreter's, other accelerators) take the plain copy."""
    # Through an int64 array: a third of torch.tensor's time on a list of Python ints.
    packed = torch.frombuffer(array.array("q", values), dtype=torch.int64)
    if device.type != "cuda":
        return packed.to(device)
    host = torch.empty(packed.shape, dtype=torch.int64, pin_memory=True).copy_(packed)
    table = torch.empty(host.shape, dtype=torch.int64, device=device)
    table.copy_(host, non_blocking=True)
    if torch.cuda.is_current_stream_capturing():
        _captured.append((host, table))
    return table


def _is_address(i: int) -> bool:
    """Whether position ``i`` of a table holds an address (a, b or the output)."""
    return i % _ROW.value < 3


def _prune(configs: list, nargs: dict, **kwargs) -> list:
    return fit_tiles(configs, nargs["M_KEY"], nargs["N_KEY"])


def launch(plan, list_a: Sequence[torch.Tensor], list_b: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``[a @ b for a, b in zip(list_a, list_b)]`` in one launch. Each ``a`` is (M_g, K_g),
    each ``b`` (K_g, N_g), any strides, all of one dtype (fp16, bf16, fp32, or fp8
    e4m3/e5m2 in the device's encoding: OCP with ``fp8``, fnuz with ``fp8_fnuz``) and device; fp32 accumulation.
    Returns new contiguous (M_g, N_g) tensors of that dtype, bf16 for fp8 operands (as
    ``matmul``; no scales are applied). fp8 products take sm_90's fp8 MMAs on the
    descriptor path with every ``b`` column-major (``w.t()`` of (N, K) weights); elsewhere
    their tiles become fp16 first."""
    # The full path's host time grows with the number of groups (about 10 us a group on
    # the H200's host), most of it Python per group: one pass, no checks. The handle calls
    # this after :func:`problem`, whose pass over the groups checked them (a second pass
    # here took a sixth of the call's Python on the CPU machine). Seen signatures replay.
    dtype, device = list_a[0].dtype, list_a[0].device
    size = list_a[0].element_size()
    result = out_dtype(dtype)
    outs, rows, layouts = [], [], set()
    tiles_of, m_max, n_max, k_max = [], 0, 0, 0  # (M, N) per launched group; the largest
    for a, b in zip(list_a, list_b):
        (M, K), N = a.shape, b.shape[1]
        c = torch.empty((M, N), dtype=result, device=device)
        outs.append(c)
        if M == 0 or N == 0:
            continue
        if K == 0:
            c.zero_()
            continue
        pa, pb = a.data_ptr(), b.data_ptr()
        sam, sak = a.stride()
        sbk, sbn = b.stride()
        rows += (pa, pb, c.data_ptr(), M, N, K, sam, sak, sbk, sbn, N, 1)
        tiles_of.append((M, N))
        if M > m_max:
            m_max = M
        if N > n_max:
            n_max = N
        if K > k_max:
            k_max = K
        layouts.add(_layout(pa, sam, sak, pb, sbk, sbn, M, N, K, size))
    if not rows:
        return outs
    table = _replay.table(_device_table, rows, device, _is_address) if _replay.RECORDING \
        else _device_table(rows, device)
    num_sms = plan.device.num_sms

    def grid(meta):
        bm, bn = meta["BLOCK_SIZE_M"], meta["BLOCK_SIZE_N"]
        tiles = sum(_host.cdiv(m, bm) * _host.cdiv(n, bn) for m, n in tiles_of)
        return (min(tiles, num_sms),)

    keys = [_host.next_power_of_2(x) for x in (m_max, n_max, k_max)]
    layout = _common_layout(layouts)
    # One autotuner per operand size, over the table's configs for that size (a table may
    # mark fp8 ones, see matmul.operand_configs): the key has no dtype (the table holds
    # every tensor), and a tile tuned for 2-byte operands may not fit shared memory with
    # 4-byte ones.
    kernel = plan.cached((NAME, "tuned kernel", size), lambda: plan.autotuned(
        _grouped_matmul_kernel, key=["G", "M_KEY", "N_KEY", "K_KEY", "B_T"],
        configs=operand_configs(plan.configs, size),
        prune_configs_by={"early_config_prune": _prune},
        name="" if size == 2 else f"{size}-byte operands"))
    b_t = layout == "col"
    with _host.scratch(device, plan.switches.get("TMA", False)):
        # Once tuned, a direct launch: the autotuner's own call rebuilt its key and went
        # through Triton's JIT dispatch on every call.
        plan.run_tuned(
            kernel, (len(tiles_of), *keys, b_t, bool(layout), dtype), grid,
            table, len(tiles_of), *keys,
            DTYPE=_TL_DTYPES[dtype], OUT_DTYPE=_TL_DTYPES[result], VEC=16 // size,
            ALIGNED=bool(layout), B_T=b_t, **plan.switches,
        )
    return outs


# --- reference ------------------------------------------------------------------------------

def reference(list_a: Sequence[torch.Tensor], list_b: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each ``a @ b`` in float64."""
    return [a.double() @ b.double() for a, b in zip(list_a, list_b)]


def inputs(shape: str, dtype: torch.dtype, device) -> tuple:
    """Random ``(list_a, list_b)`` of ``G`` groups for shape string ``"GxMxNxK"``; group
    ``g`` has ``M * (g + 1) // G`` rows (at least 1), so sizes differ as in MoE layers;
    each ``b`` as ``matmul.random_weight`` draws it (column-major for fp8)."""
    groups, m, n, k = _host.parse_shape(NAME, shape, "GxMxNxK")
    rows = [max(1, m * (g + 1) // groups) for g in range(groups)]
    list_a = [torch.randn(r, k, device=device).to(dtype) for r in rows]
    list_b = [random_weight(k, n, dtype, device) for _ in rows]
    return (list_a, list_b), {}


def default_configs(device) -> list:
    return [triton.Config({"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 8},
                          num_warps=4, num_stages=3)]


#: Switches of the portable baseline; other variants override some of them.
GENERIC_SWITCHES = {"TMA": False, "UPCAST": False}


def register(registry) -> None:
    registry.add_kernel(KernelSpec(
        NAME, "(list_a, list_b) -> list_out", problem,
        "independent 2-D matrix products of different sizes in one launch",
        reference, inputs=inputs, input_shape="GxMxNxK"))
    registry.add_variant(Variant(
        NAME, "generic", launch, accepts=_host.dtype_supported, switches=GENERIC_SWITCHES,
        configs=default_configs, replay=True,
        description="persistent grid walking every group's tiles; masked pointer loads "
        "from a device-side table of addresses, sizes and strides"))
