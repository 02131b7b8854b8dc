"""matmul: ``out = a @ b`` for 2-D ``a`` (M, K) and ``b`` (K, N), any sizes, fp32 accumulation.

Each program computes ``BLOCK_SIZE_M x BLOCK_SIZE_N`` tiles of the output: it walks K in
steps of ``BLOCK_SIZE_K``, accumulating ``tl.dot`` of an A tile and a B tile in fp32, and
rounds to the output dtype once at the end. Tiles are visited in grouped order
(``GROUP_SIZE_M`` rows of tiles column by column) so that the operand panels a group
shares stay in L2. The tile steps live in ``_tiles.py``, shared with ``grouped_matmul``.

Constexpr switches (a variant sets them; see ``_tiles.py`` for the ones the helpers take):
    TMA: operands and output go through tensor descriptors (host ``TensorDescriptor``s
        whose block shapes a config pre-hook sets) instead of masked pointer loads.
        Needs 16-byte aligned strides; a column-major operand is described through its
        transpose (``A_T``/``B_T``, chosen per call).
    PERSISTENT: launch ``min(SMs, tiles)`` programs that each walk tiles with a stride of
        the grid size, instead of one program per tile.
    WARP_SPECIALIZE: warp-specialized K loop (TMA path only).
    UPCAST: fp32 dots (the interpreter's bf16 arithmetic is wrong).

Configs: ``BLOCK_SIZE_M``, ``BLOCK_SIZE_N``, ``BLOCK_SIZE_K``, ``GROUP_SIZE_M``, optionally
``EPILOGUE_SUBTILE`` (TMA path: store the tile in two halves), ``num_warps``,
``num_stages``; autotuned per (M, N, K).

Variants: ``generic`` (pointer loads, one program per tile) here; the NVIDIA backend
registers ``nvidia.persistent_tma`` (TMA + PERSISTENT + WARP_SPECIALIZE) over the same
kernel.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..registry import KernelSpec, Variant
from . import _host, _tiles

NAME = "matmul"

#: dtypes the TMA path takes: 16-bit operands, which the MMA reads from shared memory in
#: either order (so transposed operands need no copy). fp32 stays on the pointer path.
TMA_DTYPES = (torch.float16, torch.bfloat16)


def _matmul_launch_metadata(grid, kernel, args) -> dict:
    """What profilers (proton, launch hooks) record per launch: a name with the problem
    size, the flops and the bytes moved at least once."""
    M, N, K = args["M"], args["N"], args["K"]
    out = args["c"]
    out = getattr(out, "base", out)  # a TensorDescriptor on the TMA path
    size = out.element_size()
    return {
        "name": f"{kernel.name} [M={M}, N={N}, K={K}]",
        f"flops{8 * size}": 2.0 * M * N * K,
        "bytes": size * (M * K + K * N + M * N),
    }


# --- kernel ---------------------------------------------------------------------------------

@triton.jit
def _matmul_tile(
    tile_id,                                        # linear tile index (grouped order)
    a, b, c,                                        # pointers, or descriptors when TMA
    M, N, K,                                        # sizes
    stride_am, stride_ak, stride_bk, stride_bn,     # operand strides (pointer path)
    stride_cm, stride_cn,                           # output strides (pointer path)
    num_pid_m, num_pid_n,                           # tiles along M and N
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr, EPILOGUE_SUBTILE: tl.constexpr,
    TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, UPCAST: tl.constexpr,
    A_T: tl.constexpr, B_T: tl.constexpr,
):
    pid_m, pid_n = _tiles.grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_SIZE_M)
    off_m = pid_m * BLOCK_SIZE_M
    off_n = pid_n * BLOCK_SIZE_N
    if TMA:
        acc = _tiles.desc_mainloop(a, b, K, off_m, off_n, BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K,
                                   A_T, B_T, UPCAST, WARP_SPECIALIZE)
        _tiles.desc_store(c, acc, off_m, off_n, BLOCK_SIZE_M, BLOCK_SIZE_N, EPILOGUE_SUBTILE)
    else:
        acc = _tiles.ptr_mainloop(a, b, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                                  off_m, off_n, BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, UPCAST)
        _tiles.ptr_store(c, acc, M, N, stride_cm, stride_cn, off_m, off_n, BLOCK_SIZE_M, BLOCK_SIZE_N)


@triton.jit(launch_metadata=_matmul_launch_metadata)
def _matmul_kernel(
    # --- pointers (tensor descriptors when TMA) ---
    a, b, c,
    # --- sizes ---
    M, N, K,
    # --- strides, in elements (unused when TMA: the descriptors carry them) ---
    stride_am, stride_ak,
    stride_bk, stride_bn,
    stride_cm, stride_cn,
    # --- meta: config ---
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    EPILOGUE_SUBTILE: tl.constexpr = False,
    # --- meta: variant switches, then per-call layout ---
    TMA: tl.constexpr = False,
    PERSISTENT: tl.constexpr = False,
    WARP_SPECIALIZE: tl.constexpr = False,
    UPCAST: tl.constexpr = False,
    A_T: tl.constexpr = False,
    B_T: tl.constexpr = False,
):
    num_pid_m = tl.cdiv(M, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    if PERSISTENT:
        # --- persistent: min(SMs, tiles) programs, each striding over the tiles ---
        # Consecutive programs take consecutive tiles of the grouped order, so the grid as
        # a whole still sweeps one L2-sized group at a time.
        for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0)):
            _matmul_tile(tile_id, a, b, c, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                         stride_cm, stride_cn, num_pid_m, num_pid_n,
                         BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, EPILOGUE_SUBTILE,
                         TMA, WARP_SPECIALIZE, UPCAST, A_T, B_T)
    else:
        # --- one program per tile ---
        _matmul_tile(tl.program_id(0), a, b, c, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                     stride_cm, stride_cn, num_pid_m, num_pid_n,
                     BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, EPILOGUE_SUBTILE,
                     TMA, WARP_SPECIALIZE, UPCAST, A_T, B_T)


# --- host launcher --------------------------------------------------------------------------

class Problem(NamedTuple):
    device: torch.device
    dtype: torch.dtype
    a_layout: str     # _host.tma_layout(a): "row", "col" or "" (no descriptor can take it)
    b_layout: str
    n_aligned: bool   # output rows (N elements) are a multiple of 16 bytes: a TMA store fits


def problem(a, b) -> Problem:
    """Selection key of a ``matmul(a, b)`` call."""
    device = _host.same_device(NAME, a=a, b=b)
    n_aligned = b.dim() == 2 and (b.shape[1] * b.element_size()) % 16 == 0
    return Problem(device, a.dtype, _host.tma_layout(a), _host.tma_layout(b), n_aligned)


def tma_accepts(problem: Problem, device) -> str | None:
    """Predicate of TMA variants: what a tensor descriptor cannot describe goes elsewhere."""
    if problem.dtype not in TMA_DTYPES:
        return (f"{_host._dtype_name(problem.dtype)} operands stay on pointer loads (the TMA "
                "path takes float16 and bfloat16)")
    for name, layout in (("a", problem.a_layout), ("b", problem.b_layout)):
        if not layout:
            return (f"{name} cannot be described by a tensor descriptor: it needs a unit "
                    "stride in one dimension and a 16-byte aligned base and other stride")
    if not problem.n_aligned:
        return "output rows (N elements) are not a multiple of 16 bytes, which a TMA store needs"
    return _host.dtype_supported(problem, device)


def _check(a: torch.Tensor, b: torch.Tensor) -> None:
    _host.check_dtype(NAME, "a", a)
    _host.check_dtype(NAME, "b", b)
    _host.check_same_dtype(NAME, a=a, b=b)
    _host.check_ndim(NAME, "a", a, 2, "(M, K)")
    _host.check_ndim(NAME, "b", b, 2, "(K, N)")
    if a.shape[1] != b.shape[0]:
        raise _host.InputError(
            f"{NAME}: inner dimensions differ: a {tuple(a.shape)} @ b {tuple(b.shape)} "
            f"needs a.shape[1] == b.shape[0]")


def _set_block_shapes(nargs: dict) -> None:
    """Config pre-hook of the TMA path: size the host descriptors to the config's blocks."""
    bm, bn, bk = nargs["BLOCK_SIZE_M"], nargs["BLOCK_SIZE_N"], nargs["BLOCK_SIZE_K"]
    nargs["a"].block_shape = [bk, bm] if nargs["A_T"] else [bm, bk]
    nargs["b"].block_shape = [bn, bk] if nargs["B_T"] else [bk, bn]
    nargs["c"].block_shape = [bm, bn // 2] if nargs.get("EPILOGUE_SUBTILE") else [bm, bn]


def fit_tiles(configs: list, m: int, n: int) -> list:
    """Autotune pruning: drop configs whose tiles overhang an M x N output by more than a
    64-wide tile (they only add masked-off work and tuning time); keep at least the one
    with the smallest tile."""
    cap_m, cap_n = max(64, triton.next_power_of_2(m)), max(64, triton.next_power_of_2(n))
    kept = [c for c in configs if c.kwargs["BLOCK_SIZE_M"] <= cap_m and c.kwargs["BLOCK_SIZE_N"] <= cap_n]
    return kept or [min(configs, key=lambda c: c.kwargs["BLOCK_SIZE_M"] * c.kwargs["BLOCK_SIZE_N"])]


def _prune(configs: list, nargs: dict, **kwargs) -> list:
    return fit_tiles(configs, nargs["M"], nargs["N"])


def _descriptor(t: torch.Tensor, transposed: bool) -> TensorDescriptor:
    # The block shape is a placeholder until the config's pre-hook sets it.
    return TensorDescriptor.from_tensor(t.t() if transposed else t, [1, 1])


def launch(plan, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for ``a`` (M, K) and ``b`` (K, N) of one float dtype (fp16, bf16, fp32),
    any strides; accumulates in fp32 (tf32 dots for fp32 on NVIDIA GPUs). Returns a new
    contiguous (M, N) tensor of that dtype."""
    _check(a, b)
    M, K = a.shape
    N = b.shape[1]
    out = torch.empty((M, N), dtype=a.dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    switches = plan.switches
    persistent = switches.get("PERSISTENT", False)
    num_sms = plan.device.num_sms

    def grid(meta):
        tiles = triton.cdiv(M, meta["BLOCK_SIZE_M"]) * triton.cdiv(N, meta["BLOCK_SIZE_N"])
        return (min(tiles, num_sms) if persistent else tiles,)

    if switches.get("TMA", False):
        a_t, b_t = _host.tma_layout(a) == "col", _host.tma_layout(b) == "col"
        kernel = plan.autotuned(_matmul_kernel, key=["M", "N", "K", "A_T", "B_T"],
                                config_pre_hook=_set_block_shapes,
                                prune_configs_by={"early_config_prune": _prune})
        operands = (_descriptor(a, a_t), _descriptor(b, b_t), _descriptor(out, False))
    else:
        a_t = b_t = False
        kernel = plan.autotuned(_matmul_kernel, key=["M", "N", "K", "A_T", "B_T"],
                                prune_configs_by={"early_config_prune": _prune})
        operands = (a, b, out)
    kernel[grid](
        *operands, M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        A_T=a_t, B_T=b_t, **switches,
    )
    return out


# --- reference ------------------------------------------------------------------------------

def reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in float64."""
    return a.double() @ b.double()


def inputs(shape: str, dtype: torch.dtype, device) -> tuple:
    """Random ``(a, b)`` for shape string ``"MxNxK"``: a (M, K), b (K, N)."""
    m, n, k = _host.parse_shape(NAME, shape, "MxNxK")
    return (torch.randn(m, k, device=device).to(dtype), torch.randn(k, n, device=device).to(dtype)), {}


def default_configs(device) -> list:
    return [triton.Config({"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 8},
                          num_warps=4, num_stages=3)]


#: Switches of the portable baseline; other variants override some of them.
GENERIC_SWITCHES = {"TMA": False, "PERSISTENT": False, "WARP_SPECIALIZE": False, "UPCAST": False}


def register(registry) -> None:
    registry.add_kernel(KernelSpec(
        NAME, "(a, b) -> out", problem, "2-D matrix product, any M, N, K, fp32 accumulation",
        reference, inputs=inputs, input_shape="MxNxK"))
    registry.add_variant(Variant(
        NAME, "generic", launch, accepts=_host.dtype_supported, switches=GENERIC_SWITCHES,
        configs=default_configs,
        description="masked pointer loads, one program per tile in grouped order, autotuned"))
