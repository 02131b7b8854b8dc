"""The CPU backend: runs every kernel under Triton's interpreter.

It is a real backend, not a test double: on a machine with no GPU it makes the whole
library work with no environment set up by the user, and it carries the interpreter's
portability adjustments as its own settings:

- The interpreter is turned on (``TRITON_INTERPRET=1``) when no GPU is usable or
  ``PK_INTERPRET=1`` is set. That must happen before ``import triton``, earlier than any
  plugin loads, so the core does it as ``portable_kernels`` is imported
  (``portable_kernels/_interpreter.py``); this backend reports the outcome.
- One config per kernel (``tuning.py``): the interpreter cannot autotune.
- ``UPCAST=True`` on every variant that has that switch: the interpreter keeps bf16 values
  as raw bits, so bf16 arithmetic and dots must run in fp32.
- Variants that avoid what the interpreter lacks: ``asin``'s ``cpu.polynomial`` (no
  libdevice), registered here with its switches; the kernel body stays in the family's
  module.

On a GPU machine where kernels were compiled, a CPU tensor gets a ``DeviceError`` that says
how to use the interpreter instead of a Triton driver traceback.
"""
from __future__ import annotations

import os
import platform

import triton

from portable_kernels import DeviceError, DeviceInfo, Variant, _interpreter, hookimpl

from . import tuning

# What the interpreter can execute. It runs tensor-descriptor loads and warp-specialized
# loops correctly (the loop options are ignored), so variants using them are testable here;
# it converts fp8 values exactly and its fp8 dots accumulate in fp32 (tests/test_matmul.py);
# it has no libdevice and no tensor cores.
CAPABILITIES = frozenset({
    "interpreter", "bf16", "fp8", "fp64", "atomics", "tensor_descriptor", "warp_specialize",
})


@hookimpl
def pk_detect_device(device):
    if device.type != "cpu":
        return None
    late = _interpreter.late_reason()
    if late:
        raise DeviceError(f"cannot run kernels on the CPU: {late}")
    if not _interpreter.active() and _interpreter.TRITON_FIRST and not _interpreter._gpu_usable():
        # Setting PK_INTERPRET now would not help (the choice was made at `import triton`),
        # so say what does, first.
        raise DeviceError(
            "cannot run kernels on the CPU: triton was imported before portable_kernels on "
            "this machine without a GPU, so Triton's own library was compiled and its CPU "
            "interpreter cannot run; import portable_kernels before anything imports triton "
            "(or set TRITON_INTERPRET=1 before importing triton)"
        )
    if not _interpreter.active():
        raise DeviceError(
            "this tensor is on the CPU, but Triton compiles kernels for the GPU in this "
            "process; move the tensors to the GPU, or set PK_INTERPRET=1 (or "
            "TRITON_INTERPRET=1) before importing portable_kernels to run every kernel "
            "under Triton's CPU interpreter"
        )
    return DeviceInfo(
        vendor="cpu",
        arch="interpreter",
        name=platform.processor() or platform.machine() or "cpu",
        warp_size=1,
        num_sms=os.cpu_count() or 1,
        shared_memory=0,
        triton_version=triton.__version__,
        capabilities=CAPABILITIES,
        backend="cpu",
        evidence="run: every test, on every commit (CI)",
    )


@hookimpl
def pk_tuning_configs(kernel, variant, device):
    if device.vendor != "cpu":
        return None
    own = tuning.config(kernel, variant.name)
    if own is not None:
        return [own]
    # A variant we have no tuning for (a plugin's, or one forced here): its first config.
    # One whose configs fail is not this plugin's failure: answering None leaves the call
    # to the core, which sets that variant aside.
    if variant.configs is not None:
        try:
            configs = variant.configs(device)
        except Exception:
            return None
        return list(configs[:1]) or None if isinstance(configs, (list, tuple)) else None
    return None


@hookimpl
def pk_variant_switches(kernel, variant, device):
    if device.vendor == "cpu" and "UPCAST" in variant.switches:
        return {"UPCAST": True}
    return None


@hookimpl
def pk_register_variants(registry):
    # Imported here, not at the top: kernels are decorated only after pk_runtime_setup has
    # turned the interpreter on. The kernel body stays in the family's module; this
    # variant is only its libdevice-free switch setting.
    from portable_kernels.kernels import _host, asin

    registry.add_variant(Variant(
        "asin", "cpu.polynomial", asin.launch, accepts=_host.dtype_supported,
        switches={"USE_LIBDEVICE": False}, configs=_host.elementwise_configs, replay=True,
        # A fallback: below generic wherever libdevice exists, the only runnable variant
        # where it does not (the interpreter). It requires nothing, so it runs anywhere.
        priority=-10,
        description="fp32 minimax polynomial with range reduction, no libdevice"))
