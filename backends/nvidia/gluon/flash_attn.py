"""``nvidia.hopper_gluon`` of ``flash_attn``: the predicate and the stages that run the Gluon
kernels (``flash_attn_gluon.py``) inside the family's launcher
(``portable_kernels/kernels/flash_attn.py``, ``launcher``: its argument checks, options and
autograd, and ``portable_kernels.ops``' forward and backward operators).

The kernels keep the family's contract: ``out``, and ``lse`` (fp32, natural log, (B, H, Nq))
for the backward, whose ``delta`` = rowsum(dO ∘ O) the family's preprocess kernel
computes, so either side runs with the other's. Forward: the Gluon kernel for every call
with queries and keys (the predicate took it: plain attention, enough keys). Backward, from
:data:`flash_attn_gluon.BWD_MIN_KEYS` keys: the family's preprocess, then the Gluon dk/dv
kernel, which with ``GLUON_DQ`` (the variant's default) also adds dq up, in fp32 and in no
fixed order, so that the family's dq kernel does not run; without it dq is bitwise
reproducible (and the backward 5-8% slower on the H200 at D=64, 16-19% at D=128). Shorter
calls run the family's backward with the variant's switches and table, ``nvidia.hopper``'s.
"""
from __future__ import annotations


import torch

from portable_kernels import DeviceInfo, Variant
from portable_kernels.kernels import _host
from portable_kernels.kernels import flash_attn as family

from .. import tuning
from . import _common
from . import flash_attn_gluon as kernels

NAME = "nvidia.hopper_gluon"

#: The family's switches as ``nvidia.hopper`` sets them (its preprocess, and its whole
#: backward below BWD_MIN_KEYS, run with them), and ``GLUON_DQ``, which only
#: :func:`backward` reads (see the module docstring).
SWITCHES = {**family.SWITCHES, "TMA": True, "WARP_SPECIALIZE": False, "GLUON_DQ": True}


def keys_issue(head_dim: int, keys: int) -> str:
    """Why the variant declines a call of head dim ``head_dim`` whose key count rounds down
    to the power of two ``keys`` (``Problem.keys``), or "". :data:`flash_attn_gluon.MIN_KEYS`
    are powers of two, so the rounding decides them exactly."""
    least = kernels.MIN_KEYS.get(head_dim, 0)
    if keys < least:
        return (f"Nk is below {least} keys (MIN_KEYS at D={head_dim}), where its fixed set-up "
                "per program measured slower than nvidia.hopper")
    return ""


def accepts(problem: family.Problem, device: DeviceInfo) -> str | None:
    """sm_90 (the kernels state its warpgroup MMAs, which later NVIDIA parts do not have),
    CUDA tensors and Triton 3.6 (``_common.runs_here``), plain attention, enough keys
    (:func:`keys_issue`) and the family's descriptor predicate."""
    if device.arch != "sm_90":
        return f"written for sm_90's warpgroup MMA instructions, which {device.arch} lacks"
    reason = _common.runs_here(problem.device.type)
    if reason:
        return reason
    if problem.options:
        return (f"the Gluon kernels compute plain attention; this call sets {problem.options} "
                "(the Triton kernels take every option)")
    return keys_issue(problem.head_dim, problem.keys) or family.tma_accepts(problem, device)


def forward(plan, q, k, v, causal: bool, scale: float, mods=None, keep_lse: bool = True):
    """``family._forward``'s contract, through the Gluon forward where it applies (which
    always keeps its LSE: its calls are not replayed, so scratch would save nothing)."""
    mods = family._mods(causal) if mods is None else mods
    if k.shape[2] and q.numel() and mods.plain:
        # It allocates its own outputs (one torch.empty is 3-6 µs of an eager call's host
        # time on the H200's host).
        plan.cached((family.NAME, "gluon forward tile"), kernels.tile)
        return kernels.forward(q, k, v, causal, scale, plan)
    return family._forward(plan, q, k, v, causal, scale, mods, keep_lse)


def backward(plan, do, q, k, v, out, lse, causal: bool, scale: float, mods=None,
             return_delta: bool = False):
    """``family._backward``'s contract, through the Gluon dk/dv kernel where it applies."""
    mods = family._mods(causal) if mods is None else mods
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    if not (mods.plain and q.numel() and k.numel() and kernels.backward_takes(n_k, d)):
        return family._backward(plan, do, q, k, v, out, lse, causal, scale, mods, return_delta)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    setup = family._backward_setup(plan, family._block_d(d), q.element_size())
    _, _, dq_m, dq_n = setup.blocks
    do = family.describable_grad(do, d, mods)
    delta = torch.empty_like(lse)
    family._launch_preprocess(out, do, delta, dq_m, setup.dq_options, plan, mods)
    if plan.switches["GLUON_DQ"]:
        # dq's shares from every key tile meet in fp32, rounded once at the end.
        dq_acc = torch.zeros((b, h, n_q, d), dtype=torch.float32, device=q.device)
        kernels.backward(q, k, v, do, lse, delta, dk, dv, causal, scale, dq_acc=dq_acc,
                         plan=plan)
        dq = dq_acc.to(q.dtype)
    else:
        dq = torch.empty((b, h, n_q, d), dtype=q.dtype, device=q.device)
        tma = plan.switches["TMA"] and max(n_q, n_k) >= setup.tma_min_seq
        with _host.scratch(q.device, tma):
            kernels.backward(q, k, v, do, lse, delta, dk, dv, causal, scale, plan=plan)
            family._launch_dq(q, k, v, do, lse, delta, dq, causal, scale, dq_m, dq_n,
                              plan.switches["UPCAST"], tma, setup.dq_options, plan, mods)
    return (dq, dk, dv, delta) if return_delta else (dq, dk, dv)


STAGES = family.Stages(forward, backward)


def variant() -> Variant:
    return Variant(
        family.NAME, NAME, family.launcher(STAGES),
        requires={"tensor_descriptor", "warp_specialize", "wgmma"}, priority=110,
        accepts=accepts, switches=SWITCHES,
        # The backward's preprocess is nvidia.hopper's (its tiles: the table shares them).
        configs=tuning.flash_attn_hopper,
        description="forward and backward written in Gluon (flash_attn_gluon.py), "
        "FlashAttention-3's schedules: a TMA producer warp and two consumer warpgroups as "
        "separate partitions with explicit barriers; forward: scores of the next key block "
        "issued before P·V of this one; backward: dk, dv and dq in one kernel, dq added up "
        "in fp32 by the copy engine; copies through 4-D host descriptors; Triton 3.6, CUDA, "
        "fp16/bf16, D 64 or 128, aligned strides, Nk >= 2048 at D=64, >= 1024 at D=128 "
        "(else nvidia.hopper, with the reason in explain); below 2048 keys its backward is "
        "nvidia.hopper's Triton kernels")
