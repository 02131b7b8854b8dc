"""``nvidia.hopper_gluon`` of ``matmul``: the predicate and launcher of the Gluon kernel
(``matmul_gluon.py``) in the family's contract (``portable_kernels/kernels/matmul.py``:
its argument checks, output dtype and empty cases)."""
from __future__ import annotations

import torch

from portable_kernels import DeviceInfo, Variant
from portable_kernels.kernels import _host
from portable_kernels.kernels import matmul as family

from .. import tuning
from . import _common
from . import matmul_gluon as kernels

NAME = "nvidia.hopper_gluon"


def size_issue(m: int, n: int, k: int) -> str:
    """Why the Gluon kernel leaves an (M, K) @ (K, N) product to the family's by its size,
    or ""."""
    if k == 0:
        return "K is 0: the output is all zeros"
    if kernels.tiles(m, n) < kernels.MIN_TILES:
        return (f"fewer than MIN_TILES={kernels.MIN_TILES} output tiles of "
                f"{kernels.BLOCK_M}x{kernels.BLOCK_N}: some SMs would idle, where "
                "the Triton kernel splits K")
    return ""


def accepts(problem: family.Problem, device: DeviceInfo) -> str | None:
    """sm_90 (the kernel states its warpgroup MMAs, which later NVIDIA parts do not have),
    CUDA tensors and Triton 3.6 (``_common.runs_here``), 16-bit operands, enough output
    tiles (:func:`size_issue`) and the family's descriptor predicate; not ``acc=`` (its
    epilogue only stores)."""
    if device.arch != "sm_90":
        return f"written for sm_90's warpgroup MMA instructions, which {device.arch} lacks"
    reason = _common.runs_here(problem.device.type)
    if reason:
        return reason
    if problem.accumulate:
        return "acc= (adding to an existing output) takes the Triton kernel's epilogue"
    if problem.dtype not in kernels.DTYPES:
        return (f"{_host._dtype_name(problem.dtype)} operands take the Triton kernel (the "
                "Gluon one takes float16 and bfloat16)")
    return size_issue(problem.m, problem.n, problem.k) or family.tma_accepts(problem, device)


def launch(plan, a: torch.Tensor, b: torch.Tensor, acc: None = None) -> torch.Tensor:
    """``a @ b`` as ``matmul.launch`` computes it (the same checks, a new contiguous (M, N)
    output of the operands' dtype), through the Gluon kernel for the calls
    :func:`accepts` took."""
    family._check(a, b)
    M, K = a.shape
    N = b.shape[1]
    out = torch.empty((M, N), dtype=family.out_dtype(a.dtype), device=a.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    plan.cached((family.NAME, "gluon tile"), kernels.tile)
    return kernels.matmul(a, b, out, plan.device.num_sms, plan)


def variant() -> Variant:
    return Variant(
        family.NAME, NAME, launch,
        requires={"tensor_descriptor", "warp_specialize", "wgmma"}, priority=110,
        accepts=accepts,
        # The kernel has one fixed tile; the table is nvidia.persistent_tma's, as reports
        # of the plan's configs show it.
        configs=tuning.matmul_persistent_tma,
        description="written in Gluon (matmul_gluon.py), CUTLASS's cooperative schedule: a "
        "persistent grid in grouped order, a TMA producer warp and two consumer warpgroups "
        "sharing 128x256 tiles, explicit barriers, the output stored by the copy engine "
        "while the next tile runs; Triton 3.6, CUDA, fp16/bf16, aligned strides, at least "
        "MIN_TILES output tiles (else nvidia.persistent_tma, with the reason in explain)")
