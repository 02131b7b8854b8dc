"""The plugin contract: every hook a backend can implement.

Backends are pluggy plugins: plain modules (or objects) with functions named after these
hooks and marked with :data:`portable_kernels.hookimpl`. The built-in backends
(``portable_kernels_backends.{nvidia,amd,iluvatar,cpu}``) load through the entry-point group
``portable_kernels`` exactly as a third-party package does::

    [project.entry-points.portable_kernels]
    acme = "acme_pk_backend"

``PK_DISABLE_PLUGIN_AUTOLOAD=1`` turns entry-point loading off; ``PK_PLUGINS=mod1,mod2``
registers modules by import name (with or without autoload).

A hook implementation may take any subset of a hook's parameters, by name. A plugin that
raises while loading or inside a hook (other than a :class:`PortableKernelsError` it raises
on purpose about the user's input), or whose hook answers something other than what the
hook's ``:return:`` says, is recorded, skipped from then on, and shown by
``portable-kernels info``; it never breaks the other plugins.

Hooks are called in this order: once per process ``pk_runtime_setup``, then
``pk_register_variants`` and ``pk_emulation_profiles``; then, on demand,
``pk_detect_device`` (once per device), and ``pk_tuning_configs`` and
``pk_variant_switches`` (once per kernel, variant and device, when a variant is first
launched there) and ``pk_binary_launcher`` (with them). The conformance suite also calls ``pk_expected_failures`` (once per run).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from typing import Any, Callable

    import torch
    import triton

    from .device import DeviceInfo
    from .registry import Registry, Variant
    from .testing import ExpectedFailure

PROJECT = "portable_kernels"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def pk_runtime_setup() -> None:
    """Prepare the process before any Triton kernel is decorated.

    Called once, after every plugin is loaded and before ``pk_register_variants`` (which
    imports the kernel modules and so decorates their ``@triton.jit`` functions): the place
    for environment a vendor's Triton reads when kernels are decorated or compiled.

    (The choice between compiled Triton and the interpreter cannot wait for plugins:
    Triton's own library is decorated at ``import triton``. The core makes it as
    ``portable_kernels`` is imported; see ``portable_kernels/_interpreter.py``.)

    Implemented by: none of the built-in backends today. Must not launch kernels or
    create device contexts.
    """


@hookspec
def pk_register_variants(registry: "Registry") -> None:
    """Declare kernel families and register their variants.

    Called once per process, after ``pk_runtime_setup``, for every plugin. Each plugin
    writes into a staging registry that is merged only if the hook returns normally, so a
    plugin that fails half-way leaves nothing behind.

    :param registry: call ``registry.add_kernel(KernelSpec(...))`` to declare a family and
        ``registry.add_variant(Variant(...))`` to add a way of running one. Variant names are
        ``"generic"`` or ``"<backend>.<variant>"``.

    Implemented by: the core's catalog (the families and their ``generic`` variants) and
    every backend (its own variants, e.g. ``iluvatar.v1``, ``nvidia.hopper``).
    """


@hookspec
def pk_emulation_profiles() -> "dict[str, DeviceInfo] | None":
    """Return device profiles that ``PK_EMULATE``/``portable_kernels.emulate`` can select.

    Called once per process; the answers of all plugins are merged (a name claimed twice
    keeps the first plugin's profile and records the clash).

    :return: a dict from profile name (lower case, e.g. ``"h100"``) to the ``DeviceInfo``
        that detection should report while emulating it.

    Implemented by: each vendor backend, for the devices it knows.
    """


@hookspec(firstresult=True)
def pk_detect_device(device: "torch.device") -> "DeviceInfo | None":
    """Describe ``device`` if this plugin knows it.

    Called the first time tensors on ``device`` reach a kernel (the answer is cached per
    device for the process). The first non-``None`` answer wins, so a backend returns
    ``None`` for devices that are not its own. Order: ``tryfirst`` implementations before
    plain ones before ``trylast`` ones; a backend whose devices look like another's (ROCm
    and CoreX both expose ``torch.cuda``) marks its implementation ``tryfirst``.

    :param device: a ``torch.device`` with its index resolved (``cuda:0``, never ``cuda``).
    :return: a :class:`DeviceInfo` or ``None``. Raising
        :class:`portable_kernels.errors.DeviceError` reports that the device is known but
        cannot run kernels here; the message reaches the user.

    Implemented by: every backend. Must not launch kernels.
    """


@hookspec(firstresult=True)
def pk_tuning_configs(kernel: str, variant: "Variant", device: "DeviceInfo") -> "list[triton.Config] | None":
    """Return the autotune configs for ``variant`` of ``kernel`` on ``device``.

    Called when a variant is first launched on a device (then cached). ``device`` is the
    device that executes the kernel (the real one, also while emulating). The first
    non-``None`` answer wins; with none, the variant's own ``configs(device)`` is used.
    A backend answers for the devices it detects and returns ``None`` for variants it has
    no tuning for.

    :return: a list of ``triton.Config`` (one config means no autotuning; the interpreter
        can only run one).

    Implemented by: every backend, from its tuning tables (e.g. ``nvidia/tuning.py``).
    """


@hookspec(firstresult=True)
def pk_variant_switches(kernel: str, variant: "Variant", device: "DeviceInfo") -> "dict | None":
    """Return constexpr switches to set on top of ``variant.switches`` on ``device``.

    Called with ``pk_tuning_configs`` and answered the same way (first non-``None`` wins;
    ``device`` is the executing device). Use it for adjustments the device needs whatever
    the variant: the CPU backend computes bf16 in fp32 because Triton's interpreter keeps
    bf16 values as raw bits.

    :return: a dict of constexpr names to values, or ``None``.

    Implemented by: the CPU backend.
    """


@hookspec(firstresult=True)
def pk_binary_launcher(device: "DeviceInfo") -> "Callable[[Any], Callable | None] | None":
    """Offer a faster launcher for the compiled kernels the core launches directly.

    Where the core skips Triton's per-call JIT dispatch (``portable_kernels/_direct.py``:
    NVIDIA GPUs under a verified Triton), it keeps each binary Triton compiled and launches
    it itself, by default through the binary's own Triton launcher. A backend that can
    launch with less host work answers here with a function ``make(kernel, guards)``: given
    a Triton ``CompiledKernel`` whose binary is loaded on the current device, it returns
    ``launch(grid_x, grid_y, grid_z, stream, *args)`` (``args``: every kernel parameter in
    order, constexprs included, as Triton's launcher takes them) or ``None`` to keep
    Triton's launcher for that kernel. ``guards`` holds a ``(dtype, aligned)`` pair per
    leading tensor argument (``aligned``: its address is a multiple of 16 bytes), what
    Triton compiled the binary for: ``launch`` checks them on every call and returns
    ``False`` without launching where one does not hold, ``True`` once launched (the core
    then looks the call's binary up itself). ``make`` runs once per binary, never per call.

    Called once per kernel, variant and device, with ``pk_tuning_configs``; first
    non-``None`` wins.

    :return: ``make``, or ``None``.

    Implemented by: the NVIDIA backend (``launcher.c``: argument packing and
    ``cuLaunchKernel``, under Triton 3.6).
    """


@hookspec
def pk_expected_failures(device: "DeviceInfo") -> "list[ExpectedFailure] | None":
    """Declare conformance cases known to fail on ``device``: known failures as data.

    Called by the conformance suite once per run (once per worker under pytest-xdist),
    before any case runs; the answers of all plugins are concatenated. A case matching an
    entry that fails is reported as an expected failure (``xfail``) and does not fail the
    run; one that passes is reported as unexpectedly passing (``xpass``), so the entry can
    be removed. Cases skipped because the device cannot run them stay skips.

    :param device: the device under test, as selection sees it (an emulated profile while
        emulating).
    :return: a list of :class:`portable_kernels.testing.ExpectedFailure` (or
        ``(pattern, reason)`` pairs), e.g.
        ``[ExpectedFailure("flash_attn/acme.fast/bfloat16/*", "acme-sdk#123: bf16 rounding")]``.
        ``pattern`` is an ``fnmatch`` glob over the case key
        ``"<kernel>/<variant>/<dtype>/<shape>/<check>"``; ``reason`` is shown in reports.

    Implemented by: backends with known, tracked defects on their devices; none of the
    built-in backends today. Must not launch kernels.
    """
