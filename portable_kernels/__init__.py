"""portable-kernels: Triton kernels written once, run on the best variant for every device.

    import portable_kernels as pk
    softmax = pk.get_kernel("softmax")
    y = softmax(x)                      # picks the variant for x's device
    print(pk.explain("softmax", x))     # which variant, and why the others were passed over

Importing this package loads no plugin and touches no device; plugins load on first use.
(It does ask torch whether a GPU is usable, once, to turn Triton's interpreter on before
Triton is imported on machines without one.)
"""
from __future__ import annotations

from . import _interpreter

_interpreter.choose()  # must precede every import of triton; see _interpreter.py

from .device import CAPABILITIES, DeviceInfo, register_capability
from .dispatch import (
    KernelHandle,
    Selection,
    device_info,
    emulate,
    explain,
    get_kernel,
    list_kernels,
    list_variants,
    use_variant,
)
from .errors import (
    ArgumentError,
    ConfigurationError,
    DeviceError,
    DTypeError,
    InputError,
    NoVariantError,
    PluginError,
    PortableKernelsError,
    VariantUnavailableError,
)
from .hookspecs import hookimpl, hookspec
from .launch import LaunchPlan
from .registry import KernelSpec, Registry, Variant
from .testing import ExpectedFailure
from . import ops  # noqa: E402,F401  (defines the torch operators that handles trace as)

__version__ = "0.1.0"

__all__ = [
    "ArgumentError",
    "CAPABILITIES",
    "ConfigurationError",
    "DTypeError",
    "DeviceError",
    "DeviceInfo",
    "ExpectedFailure",
    "InputError",
    "KernelHandle",
    "KernelSpec",
    "LaunchPlan",
    "NoVariantError",
    "PluginError",
    "PortableKernelsError",
    "Registry",
    "Selection",
    "Variant",
    "VariantUnavailableError",
    "device_info",
    "emulate",
    "explain",
    "get_kernel",
    "hookimpl",
    "hookspec",
    "list_kernels",
    "list_variants",
    "register_capability",
    "use_variant",
]
