"""ACME's backend for portable-kernels: an example third-party plugin.

It contributes two variants of ``vector_add``: ``acme.vector_add_wide``, the family's own
launcher (the kernel is written once, in portable-kernels) with ACME's tuning, wider
blocks; and ``acme.grid_stride``, a kernel of ACME's own (``kernels.py``: a persistent
grid-stride loop), shipped in this package with its launcher. A real
backend adds what this one only sketches: ``pk_detect_device`` for its hardware, and
variants whose switches select the code paths its compiler handles best.

Hooks implemented (the contract is ``portable_kernels/hookspecs.py``):

- ``pk_register_variants``: the variant, data only (no kernel body here);
- ``pk_tuning_configs``: ACME's configs for that variant, on every device, ahead of the
  built-in backends' per-kernel defaults;
- ``pk_emulation_profiles``: an ``acme1`` profile, so ``PK_EMULATE=acme1`` shows how
  selection ranks the variant on ACME hardware without owning any;
- ``pk_expected_failures``: known defects as data (none today).
"""
from __future__ import annotations

import triton

from portable_kernels import DeviceInfo, Variant, hookimpl

from . import tuning

VENDOR = "acme"
VARIANT = "acme.vector_add_wide"
OWN_KERNEL = "acme.grid_stride"


def _priority(device: DeviceInfo) -> int:
    # Requires nothing, so it runs (and is tested) everywhere; preferred only on ACME parts,
    # below the built-in variants elsewhere.
    return 50 if device.vendor == VENDOR else -10


@hookimpl
def pk_register_variants(registry):
    # Import kernel modules here, never at the top of the file: portable-kernels loads this
    # module while it builds its plugin host, and the kernels must be decorated after
    # every plugin's pk_runtime_setup (and after the interpreter choice).
    from portable_kernels.kernels import _host, vector_add

    registry.add_variant(Variant(
        "vector_add", VARIANT, vector_add.launch,
        priority=_priority,
        accepts=_host.dtype_supported,  # bf16 problems need the bf16 capability
        configs=tuning.vector_add_wide,
        description="the generic kernel with ACME's wide blocks",
    ))
    # A kernel of ACME's own: its module is imported here too (it decorates the kernel).
    from . import kernels

    registry.add_variant(Variant(
        "vector_add", OWN_KERNEL, kernels.vector_add,
        priority=lambda device: 40 if device.vendor == VENDOR else -20,
        accepts=_host.dtype_supported,
        configs=tuning.grid_stride,
        description="ACME's own kernel: a persistent grid-stride loop, one program per "
        "compute unit",
    ))


@hookimpl(tryfirst=True)
def pk_tuning_configs(kernel, variant, device):
    # tryfirst: the built-in backends answer for every variant of a kernel on their
    # devices; ACME's own variant keeps ACME's configs wherever it runs.
    if variant.name == VARIANT:
        return tuning.vector_add_wide(device)
    if variant.name == OWN_KERNEL:
        return tuning.grid_stride(device)
    return None


@hookimpl
def pk_emulation_profiles():
    return {
        "acme1": DeviceInfo(
            vendor=VENDOR, arch="acme1", name="ACME Accelerator 1", warp_size=32, num_sms=64,
            shared_memory=131072, triton_version=triton.__version__,
            capabilities={"bf16", "fp64", "atomics", "mma"}, backend=VENDOR,
        ),
    }


@hookimpl
def pk_expected_failures(device):
    # Known failures as data: e.g. ExpectedFailure("vector_add/acme.vector_add_wide/bfloat16/*",
    # "acme-sdk#42: bf16 stores round toward zero"). Matching cases report xfail, not fail.
    return []
