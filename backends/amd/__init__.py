"""The AMD ROCm backend: ``torch.cuda`` devices of a ROCm build of torch.

Detection: ``torch.version.hip`` is set (``tryfirst``, ahead of the NVIDIA backend). The
architecture is the ``gcnArchName`` (``gfx942``); CDNA parts (gfx9xx) run 64-lane
wavefronts (``wave64``), RDNA parts 32-lane ones. fp8 comes in two encodings: CDNA3
(gfx940-942) has the fnuz formats (``fp8_fnuz``: torch's ``float8_e4m3fnuz`` and
``float8_e5m2fnuz``), CDNA4 (gfx950) the OCP ones of NVIDIA (``fp8``: ``float8_e4m3fn``,
``float8_e5m2``); Triton's AMD backend compiles only those dots there. RDNA3 has neither.

Emulation profiles: ``mi250x``, ``mi300x``, ``mi355x``, ``rx7900xtx`` (RDNA3).
"""
from __future__ import annotations

import torch

from portable_kernels import DeviceInfo, hookimpl
from portable_kernels_backends import _common

from . import tuning

VENDOR = "amd"


def capabilities(arch: str) -> frozenset[str]:
    """The capability words of a ``gfx`` architecture."""
    caps = {"mma", "bf16", "fp64", "atomics", "libdevice"}
    if is_cdna(arch):
        caps.add("wave64")
    if arch in ("gfx940", "gfx941", "gfx942"):
        caps.add("fp8_fnuz")
    if arch == "gfx950":
        caps.add("fp8")
    return frozenset(caps)


def is_cdna(arch: str) -> bool:
    """CDNA (Instinct) parts are gfx9xx; their wavefronts are 64 lanes wide."""
    return arch.startswith("gfx9")


#: ci/compile_matrix.py's AMD targets. No AMD GPU has run these kernels here: the AMD
#: variants were tested by forcing them on the CPU interpreter and an H200.
COMPILED_FOR = ("gfx90a", "gfx942", "gfx950", "gfx1100")


def evidence(arch: str) -> str:
    """What this backend's kernels have been through on ``arch`` (``DeviceInfo.evidence``)."""
    if arch in COMPILED_FOR:
        return f"compiled for {arch} (ci/compile_matrix.py), not run"
    return "not compiled for or run on by this project: a conformance run is its first test"


def _info(name: str, arch: str, num_cus: int, lds: int) -> DeviceInfo:
    return DeviceInfo(
        vendor=VENDOR,
        arch=arch,
        name=name,
        warp_size=64 if is_cdna(arch) else 32,
        num_sms=num_cus,
        shared_memory=lds,
        triton_version=_common.triton_version(),
        capabilities=capabilities(arch),
        backend=VENDOR,
        evidence=evidence(arch),
    )


@hookimpl(tryfirst=True)
def pk_detect_device(device):
    if device.type != "cuda" or not torch.version.hip:
        return None
    p = _common.props(device)
    arch = p.gcn_arch.split(":")[0] or f"gfx{p.major}{p.minor}"
    return _info(p.name, arch, p.num_sms, p.shared_memory or 65536)


@hookimpl
def pk_emulation_profiles():
    return {
        # LDS: 64 KB per workgroup on CDNA2/3 and RDNA3, 160 KB on CDNA4.
        "mi250x": _info("AMD Instinct MI250X", "gfx90a", 110, 65536),
        "mi300x": _info("AMD Instinct MI300X", "gfx942", 304, 65536),
        "mi355x": _info("AMD Instinct MI355X", "gfx950", 256, 163840),
        # 96 compute units, reported by ROCm as 48 workgroup processors of two each.
        "rx7900xtx": _info("AMD Radeon RX 7900 XTX", "gfx1100", 48, 65536),
    }


@hookimpl
def pk_tuning_configs(kernel, variant, device):
    if device.vendor != VENDOR:
        return None
    return tuning.configs(kernel, variant.name, device)


def _flash_attn_priority(device: DeviceInfo) -> int:
    """First on 64-lane (CDNA) AMD GPUs; elsewhere below generic, so runnable (and
    testable when forced with ``use_variant``) but never chosen."""
    return 100 if device.vendor == VENDOR and device.has("wave64") else -10


@hookimpl
def pk_register_variants(registry):
    # Imported here, not at the top: kernels are decorated only after pk_runtime_setup.
    # The variant is flash_attn.py's generic kernel; what it brings is AMD tuning
    # (tuning.py), which reaches launches only on AMD devices.
    from portable_kernels.kernels import flash_attn, flash_attn_varlen

    for family in (flash_attn, flash_attn_varlen):  # the packed batch runs the same kernels
        registry.add_variant(family.variant(
            "amd.rocm", priority=_flash_attn_priority,
            description="generic kernel with CDNA tuning: 128x64 tiles, num_stages 1-2, "
            "waves_per_eu, matrix_instr_nonkdim, warps clamped to 1024 threads of 64 lanes"))
