"""Exceptions raised by portable-kernels.

Every error a user can trigger derives from :class:`PortableKernelsError`, so a caller
can catch the library's failures as one family. Bad arguments raise the builtin
``ValueError``/``TypeError`` (plus this base) so ordinary code keeps working.
"""
from __future__ import annotations


class PortableKernelsError(Exception):
    """Base class of the library's own errors."""


class DeviceError(PortableKernelsError, RuntimeError):
    """The tensors' device cannot run Triton kernels here (or no backend knows it)."""


class NoVariantError(PortableKernelsError, RuntimeError):
    """No registered variant of a kernel can run on this device and problem."""


class VariantUnavailableError(PortableKernelsError, RuntimeError):
    """A variant forced by ``use_variant``/``PK_VARIANT`` cannot run here; says why."""


class PluginError(PortableKernelsError, RuntimeError):
    """A plugin misbehaved (raised while loading or in a hook); it was skipped."""


class ConfigurationError(PortableKernelsError, ValueError):
    """A ``PK_*`` environment variable names something that does not exist."""


class InputError(PortableKernelsError, ValueError):
    """An argument has the wrong shape, device, stride or value."""


class DTypeError(PortableKernelsError, TypeError):
    """An argument has a dtype the kernel does not take (or is not a tensor)."""


class ArgumentError(PortableKernelsError, TypeError):
    """A call does not match the kernel's signature (a missing or unknown argument), or a
    non-tensor argument has the wrong type (``causal="no"``, ``dim="1"``)."""
