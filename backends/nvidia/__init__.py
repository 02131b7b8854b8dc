"""The NVIDIA backend: CUDA devices by compute capability.

Detection: any ``torch.cuda`` device that neither the AMD (``torch.version.hip``) nor the
Iluvatar backend claimed (both detect ``tryfirst``; this one runs ``trylast``).
Capabilities follow the architecture, not a threshold: ``mma`` from sm_70, ``bf16`` from
sm_80, ``fp8`` from sm_89, ``tensor_descriptor`` (TMA) from sm_90; ``wgmma`` on Hopper (9.x)
only, ``tcgen05`` (tensor memory) on datacenter Blackwell (10.x); ``warp_specialize`` where
Triton's warp specialization has a schedule (9.x and 10.x). Consumer Blackwell (12.x, RTX
50xx) has TMA and fp8 but neither wgmma nor tcgen05: ``tl.dot`` lowers to ``mma.sync`` there,
as on Ampere and Ada.

Direct launches (the core's ``_direct``) go through ``launcher.c`` (``launcher.py`` says
what it leaves out of Triton's launcher and why), offered by ``pk_binary_launcher``.

Emulation profiles: ``a100``, ``l40s``, ``h100``, ``h200``, ``b200``, ``rtx5090``.

``nvidia.hopper_gluon`` ranks above ``nvidia.hopper`` (flash_attn) and
``nvidia.persistent_tma`` (matmul) and takes only sm_90 and the problems its Gluon kernels
cover; the rest go to those. Its kernels are this backend's own, in ``gluon/`` with their
launchers (the other variants are switch settings of the families' kernels).
``nvidia.blackwell`` runs ``nvidia.hopper``'s attention kernels on sm_100 with a table of
its own (warp-specialized tiles on); ``nvidia.persistent_tma`` and grouped_matmul's
``nvidia.tma`` serve sm_90 and sm_100 alike, each with its table. The sm_100 tables are
compiled by ``ci/compile_matrix.py`` but have not run on a B200.
``flash_attn_with_kvcache``'s ``nvidia.hopper`` (K/V tiles of contiguous caches through
descriptors) is not yet timed: it ranks below generic and runs only when forced.
"""
from __future__ import annotations

import torch

from portable_kernels import DeviceInfo, Variant, hookimpl
from portable_kernels_backends import _common

from . import tuning

VENDOR = "nvidia"


def capabilities(major: int, minor: int) -> frozenset[str]:
    """The capability words of compute capability ``major.minor``."""
    caps = {"fp64", "atomics", "libdevice"}
    cc = (major, minor)
    if cc >= (7, 0):
        caps.add("mma")
    if cc >= (8, 0):
        caps.add("bf16")
    if cc >= (8, 9):
        caps.add("fp8")
    if cc >= (9, 0):
        caps.add("tensor_descriptor")
    if major == 9:
        caps |= {"wgmma", "warp_specialize"}
    if major == 10:
        caps |= {"tcgen05", "warp_specialize"}
    return frozenset(caps)


#: Architectures this backend's kernels have executed on, and how (the rest of
#: ci/compile_matrix.py's targets are compiled for, not run).
RUN_ON = {"sm_90": "run: the test suite, the conformance suite and the benchmarks on an H200 and an H100"}
COMPILED_FOR = ("sm_80", "sm_89", "sm_90", "sm_100", "sm_120")


def evidence(arch: str) -> str:
    """What this backend's kernels have been through on ``arch`` (``DeviceInfo.evidence``)."""
    if arch in RUN_ON:
        return RUN_ON[arch]
    if arch in COMPILED_FOR:
        return f"compiled for {arch} (ci/compile_matrix.py), not run"
    return "not compiled for or run on by this project: a conformance run is its first test"


def _info(name: str, major: int, minor: int, num_sms: int, shared_memory: int) -> DeviceInfo:
    arch = f"sm_{major}{minor}"
    return DeviceInfo(
        vendor=VENDOR,
        arch=arch,
        name=name,
        warp_size=32,
        num_sms=num_sms,
        shared_memory=shared_memory,
        triton_version=_common.triton_version(),
        capabilities=capabilities(major, minor),
        backend=VENDOR,
        evidence=evidence(arch),
    )


@hookimpl(trylast=True)
def pk_detect_device(device):
    if device.type != "cuda" or torch.version.hip:
        return None
    p = _common.props(device)
    return _info(p.name, p.major, p.minor, p.num_sms, p.shared_memory)


@hookimpl
def pk_emulation_profiles():
    return {
        # Shared memory: the opt-in maximum per block (cudaDevAttrMaxSharedMemoryPerBlockOptin).
        "a100": _info("NVIDIA A100-SXM4-80GB", 8, 0, 108, 166912),
        "l40s": _info("NVIDIA L40S", 8, 9, 142, 101376),
        "h100": _info("NVIDIA H100 80GB HBM3", 9, 0, 132, 232448),
        "h200": _info("NVIDIA H200", 9, 0, 132, 232448),
        "b200": _info("NVIDIA B200", 10, 0, 148, 232448),
        "rtx5090": _info("NVIDIA GeForce RTX 5090", 12, 0, 170, 101376),
    }


@hookimpl
def pk_tuning_configs(kernel, variant, device):
    if device.vendor != VENDOR:
        return None
    return tuning.configs(kernel, variant.name, device)


@hookimpl
def pk_binary_launcher(device):
    # Only for devices this backend detected: emulated profiles never execute here, and a
    # device another backend claimed keeps that backend's answer.
    if device.vendor != VENDOR or "interpreter" in device.capabilities:
        return None
    from . import launcher

    return launcher.make if launcher.available() else None


def _tma_priority(device: DeviceInfo) -> int:
    """First where the MMAs read their operands from shared memory that TMA fills
    (Hopper's wgmma, datacenter Blackwell's tcgen05). Elsewhere below generic: on sm_120
    (TMA, but ``mma.sync`` from registers) and under the interpreter (which also runs
    descriptors and warp-specialized loops) the variant stays runnable, and testable when
    forced with ``use_variant``, but is never chosen."""
    return 100 if device.has("wgmma") or device.has("tcgen05") else -10


def _blackwell_accepts(problem, device: DeviceInfo) -> str | None:
    """``tma_accepts`` of the attention families, less softcapped calls: with a softcap the
    sm_100 forward's warp-specialized 128 x 128 tile at D = 128 needs 232,728 bytes of shared
    memory, over sm_100's 232,448 (ci/compile_matrix.py); the generic kernels take them."""
    if "softcap" in problem.options.split(","):
        return ("softcapped scores stay on the generic kernels on sm_100: the descriptor "
                "forward's D = 128 tile would need more shared memory than the SM has")
    from portable_kernels.kernels import flash_attn

    return flash_attn.tma_accepts(problem, device)


def _hopper_priority(device: DeviceInfo) -> int:
    """First on Hopper; on Blackwell ``nvidia.blackwell`` takes its place."""
    return 100 if device.has("wgmma") else -10


@hookimpl
def pk_register_variants(registry):
    # Imported here, not at the top: kernels are decorated only after pk_runtime_setup.
    # Each variant but the Gluon ones is a switch setting of its family's one kernel; the
    # bodies stay in portable_kernels/kernels/.
    from portable_kernels.kernels import (
        flash_attn, flash_attn_varlen, flash_attn_with_kvcache, grouped_matmul, matmul)

    from . import gluon

    registry.add_variant(Variant(
        "matmul", "nvidia.persistent_tma", matmul.launch,
        requires={"tensor_descriptor", "warp_specialize"}, priority=_tma_priority,
        accepts=matmul.tma_accepts,
        switches={"TMA": True, "PERSISTENT": True, "WARP_SPECIALIZE": True, "UPCAST": False},
        configs=tuning.matmul_persistent_tma, replay=True,
        description="persistent grid of min(SMs, tiles) in grouped order; TMA loads and "
        "stores through device-side tensor descriptors; warp-specialized K loop; epilogue "
        "subtiling; split-K where the output has too few tiles; sm_90 and sm_100 (on "
        "sm_100 with a table of its own, compiled but not yet run on one)"))
    registry.add_variant(Variant(
        "grouped_matmul", "nvidia.tma", grouped_matmul.launch,
        requires={"tensor_descriptor"}, priority=_tma_priority,
        accepts=grouped_matmul.tma_accepts, switches={"TMA": True, "UPCAST": False},
        configs=tuning.grouped_matmul_tma, replay=True,
        description="persistent grid over every group's tiles; device-side tensor "
        "descriptors per group (tl.make_tensor_descriptor, scratch from an allocator)"))
    hopper = dict(
        priority=_hopper_priority, accepts=flash_attn.tma_accepts,
        # WARP_SPECIALIZE off unless a config turns it on: with triton 3.6 on sm_90 the
        # warp-specialized loop passes small tests yet computed wrong outputs at N = 4096
        # (causal, or 3 stages). A config that does not name it (a vendor's table, a
        # sweep's one-config plan) must not inherit it.
        switches={"TMA": True, "WARP_SPECIALIZE": False}, configs=tuning.flash_attn_hopper,
        description="Q/K/V/O tiles through device-side tensor descriptors (TMA), "
        "software-pipelined K/V loop (the warp-specialized loop is off on sm_90: wrong "
        "results with triton 3.6), causal split into unmasked and diagonal blocks, "
        "forward autotuned among descriptor and pointer-load (cp.async) tiles; backward "
        "kernels on descriptors, with tiles of their own; "
        "fp16/bf16, D 64 or 128, 16-byte aligned strides (else generic, with the reason "
        "in explain)")
    blackwell = dict(
        priority=100, accepts=_blackwell_accepts,
        # Triton lowers tl.dot to tcgen05 on sm_100 and schedules warp-specialized loops
        # there (its fused-attention tutorial does): the switch that triton 3.6 broke on
        # sm_90 is on in this table's warp-specialized configs.
        switches={"TMA": True, "WARP_SPECIALIZE": False}, configs=tuning.flash_attn_blackwell,
        description="nvidia.hopper's descriptor kernels for datacenter Blackwell (sm_100, "
        "tcgen05 MMAs): warp-specialized and pipelined forward tiles of its own table; "
        "compiled for sm_100 by ci/compile_matrix.py, not yet run on one; fp16/bf16, D 64 "
        "or 128, 16-byte aligned strides (else generic, with the reason in explain)")
    for family in (flash_attn, flash_attn_varlen):  # the packed batch runs the same kernels
        registry.add_variant(family.variant(
            "nvidia.hopper", requires={"tensor_descriptor", "warp_specialize"}, **hopper))
        registry.add_variant(family.variant(
            "nvidia.blackwell", requires={"tensor_descriptor", "warp_specialize", "tcgen05"},
            **blackwell))
    # Decode attention with K/V tiles through descriptors on contiguous caches. Not yet
    # timed against generic's pointer loads: ranked below generic everywhere, so that
    # dispatch never picks it and an A/B forces it (use_variant or PK_VARIANT).
    registry.add_variant(flash_attn_with_kvcache.variant(
        "nvidia.hopper", requires={"tensor_descriptor"}, priority=-10,
        switches={"TMA": True},
        description="generic's split-K decode kernel with K/V tiles of a contiguous cache "
        "through device-side tensor descriptors (TMA), zero-filled past each sequence's "
        "keys; paged caches and layouts no descriptor fits keep pointer loads; unmeasured, "
        "so below generic: chosen only when forced"))
    # Kernels of this backend's own (sm_90, written in Gluon), with their launchers.
    gluon.register(registry)
