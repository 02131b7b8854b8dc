"""The Iluvatar CoreX backend (天数智芯): BI-V100/BI-V150 and later, through ``torch.cuda``.

Detection (``tryfirst``, ahead of the NVIDIA backend): the device name starts with
"Iluvatar" or the torch build has ``torch.corex``. CoreX reports compute capability 7.x and
64-lane warps; its Triton lowers tensor descriptors to pointer loads and has no warp
specialization, so neither capability is claimed.

Emulation profiles: ``bi150``, ``bi100``.
"""
from __future__ import annotations

import torch

from portable_kernels import DeviceInfo, hookimpl
from portable_kernels_backends import _common

from . import tuning

VENDOR = "iluvatar"
CAPABILITIES = frozenset({"mma", "bf16", "fp64", "atomics", "libdevice", "wave64"})


def is_corex(device: torch.device) -> bool:
    """Whether ``device`` (a cuda device) is an Iluvatar CoreX GPU."""
    if getattr(torch, "corex", None):
        return True
    return torch.cuda.get_device_name(device).startswith("Iluvatar")


def _info(name: str, major: int, minor: int, num_sms: int, shared_memory: int) -> DeviceInfo:
    return DeviceInfo(
        vendor=VENDOR,
        arch=f"ivcore{major}{minor}",
        name=name,
        warp_size=64,
        num_sms=num_sms,
        shared_memory=shared_memory,
        triton_version=_common.triton_version(),
        capabilities=CAPABILITIES,
        backend=VENDOR,
        # Triton has no CoreX target to compile for without the vendor's toolchain.
        evidence="not compiled or run: V1/V2 were tested forced on the interpreter and an H200",
    )


@hookimpl(tryfirst=True)
def pk_detect_device(device):
    if device.type != "cuda" or torch.version.hip or not is_corex(device):
        return None
    p = _common.props(device)
    return _info(p.name, p.major, p.minor, p.num_sms, p.shared_memory)


@hookimpl
def pk_emulation_profiles():
    # SM counts and shared memory are the public figures as far as known; selection does
    # not depend on them.
    return {
        "bi150": _info("Iluvatar BI-V150", 7, 1, 64, 131072),
        "bi100": _info("Iluvatar BI-V100", 7, 0, 64, 131072),
    }


@hookimpl
def pk_tuning_configs(kernel, variant, device):
    if device.vendor != VENDOR:
        return None
    return tuning.configs(kernel, variant.name, device)


def _flash_attn_priority(on_iluvatar: int):
    """First on Iluvatar devices; elsewhere below generic, so runnable (and testable when
    forced with ``use_variant``) but never chosen."""

    def priority(device: DeviceInfo) -> int:
        return on_iluvatar if device.vendor == VENDOR else -10

    return priority


@hookimpl
def pk_register_variants(registry):
    # Imported here, not at the top: kernels are decorated only after pk_runtime_setup.
    # Both variants are switch settings of flash_attn.py's one kernel (the seed's V1 and
    # V2); V2 ranks first because the seed measured it fastest on CoreX: changing the
    # reduction direction removes the conversion of the MMA result between operand
    # layouts (fewer instructions), and it keeps V1's deferred row sums.
    from portable_kernels.kernels import flash_attn, flash_attn_varlen

    for family in (flash_attn, flash_attn_varlen):  # the packed batch runs the same kernels
        registry.add_variant(family.variant(
            "iluvatar.v2", switches={"TRANSPOSED": True, "DEFERRED": True},
            priority=_flash_attn_priority(100), configs=tuning.flash_attn_configs,
            description="seed V2, transposed view: S^T = K.Q^T, reductions along axis 0, "
            "acc^T += V^T.P^T so P never changes operand layout; deferred row sums. First on "
            "Iluvatar (100 > iluvatar.v1's 90): the seed measured V2 fastest, as it drops "
            "V1's MMA-result layout conversion"))
        registry.add_variant(family.variant(
            "iluvatar.v1", switches={"DEFERRED": True, "HEAD_SPLIT": 2},
            priority=_flash_attn_priority(90), configs=tuning.flash_attn_configs,
            description="seed V1: head_dim split in two halves (narrower MMA strips) and "
            "deferred reduction (elementwise row-sum partials, reduced once after the K/V "
            "loop). Second on Iluvatar (90): iluvatar.v2 adds the transposed view on top"))
