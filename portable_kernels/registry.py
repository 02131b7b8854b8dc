"""Kernels and variants as data.

A :class:`KernelSpec` names a kernel family (its call signature and how to describe a call
as a hashable *problem*); a :class:`Variant` is a named choice of one family's constexpr
switches, the configs that suit it, the capabilities it requires and a priority. Plugins
add both to a :class:`Registry` from their ``pk_register_variants`` hook.
"""
from __future__ import annotations

import dataclasses
import inspect
import numbers
import re
from types import MappingProxyType
from typing import Any, Callable, Mapping, NamedTuple

from .device import DeviceInfo, check_capabilities

__all__ = ["KernelSpec", "Variant", "Registry", "UndeclaredKernelError"]


class UndeclaredKernelError(KeyError):
    """A variant names a kernel no plugin has declared (yet)."""

_NAME = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)?$")


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One kernel family, as users call it.

    Attributes:
        name: the public name, e.g. ``"softmax"``.
        signature: the call as users write it, e.g. ``"(x, dim=-1) -> out"``.
        problem: ``problem(*args, **kwargs) -> NamedTuple`` describing a call. It runs on
            every call, so it must be cheap; its first field is ``device`` (the
            ``torch.device`` of the tensors) and every other field is something a variant's
            ``accepts`` may look at. It is the selection cache key, so it should not hold
            sizes that vary call to call unless a predicate needs them. It raises
            ``ValueError``/``TypeError`` for calls no variant could take (tensors on
            different devices, missing arguments).
        summary: one line for ``portable-kernels list``.
        reference: a plain-torch implementation with the same signature (for tests).
        inputs: ``inputs(shape, dtype, device) -> (args, kwargs)``: random example inputs
            from a shape string such as ``"4096x4096x4096"`` (its meaning is the family's,
            stated in ``input_shape``); used by ``portable-kernels tune`` and benchmarks.
        input_shape: what ``inputs``' shape string means, e.g. ``"MxNxK"``.
        runtime: names of ``problem``'s integer arguments that change from call to call (a
            random seed). Replays (``Variant.replay``) key them by integer width, not value,
            and pass each call's own value to the launches that take it at a runtime
            position (``LaunchPlan.direct(..., runtime=...)``); values outside [0, 2**63)
            keep the full path, whose checks run.
    """

    name: str
    signature: str
    problem: Callable[..., NamedTuple]
    summary: str = ""
    reference: Callable[..., Any] | None = None
    inputs: Callable[..., tuple] | None = None
    input_shape: str = ""
    runtime: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not _NAME.match(self.name) or "." in self.name:
            raise ValueError(f"kernel name {self.name!r} must be a lower-case identifier")
        if self.runtime:
            params = inspect.signature(self.problem).parameters
            unknown = [n for n in self.runtime if n not in params]
            if unknown:
                raise ValueError(f"kernel {self.name!r}: runtime names {unknown}, which are not "
                                 f"arguments of its problem function ({', '.join(params)})")


Priority = "int | Callable[[DeviceInfo], int]"


@dataclasses.dataclass(frozen=True)
class Variant:
    """A named way of running a kernel family.

    Attributes:
        kernel: the family's name.
        name: ``"generic"`` for the portable baseline, else ``"<backend>.<variant>"``.
        launch: ``launch(plan, *args, **kwargs)``: the family's host launcher. ``plan`` is a
            :class:`portable_kernels.launch.LaunchPlan` carrying this variant's switches and
            the configs chosen for the device.
        requires: capabilities the device must have; without them the variant cannot run.
        priority: preference among runnable variants, an int or a function of the
            ``DeviceInfo`` (so a variant can rank first on its own hardware yet run anywhere).
        accepts: ``accepts(problem, device) -> str | None``: ``None`` when the variant
            can take the problem, else the reason it cannot (shown by ``explain``). It may
            raise a ``PortableKernelsError`` about the user's input, which reaches the caller.
            A ``priority`` or ``accepts`` that raises anything else, or answers the wrong
            type, sets the variant aside (recorded as its plugin's failure) and selection
            goes on with the others.
        switches: the constexpr switches this variant sets on the family's kernels.
        configs: ``configs(device) -> list[triton.Config]``: default configs; a backend's
            ``pk_tuning_configs`` answer for the device overrides them.
        description: one line saying what technique the variant uses.
        replay: whether a call's host work is a function of its signature alone (see
            ``portable_kernels._replay``): ``launch`` checks, allocates, makes views and
            launches through the plan's direct launches, and nothing else (no other torch
            operator, no value read on the host, no random draw, no state kept between
            calls). A handle then replays a seen signature's allocations and launches
            without running ``launch``; calls it cannot replay keep the full path.
        plugin: the plugin that registered it (filled in by the registry).
    """

    kernel: str
    name: str
    launch: Callable[..., Any]
    requires: frozenset[str] = frozenset()
    priority: Any = 0
    accepts: Callable[[NamedTuple, DeviceInfo], str | None] | None = None
    switches: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    configs: Callable[[DeviceInfo], list] | None = None
    description: str = ""
    replay: bool = False
    plugin: str = ""

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(
                f"variant name {self.name!r} must be 'generic' or '<backend>.<variant>' "
                "in lower case"
            )
        object.__setattr__(self, "requires", frozenset(self.requires))
        object.__setattr__(self, "switches", MappingProxyType(dict(self.switches)))
        check_capabilities(self.requires, f"variant {self.kernel}/{self.name}")
        if not callable(self.launch):
            raise TypeError(f"variant {self.kernel}/{self.name}: launch must be callable")
        if not (isinstance(self.priority, int) or callable(self.priority)):
            raise TypeError(f"variant {self.kernel}/{self.name}: priority must be int or callable")

    def priority_on(self, device: DeviceInfo) -> int:
        """This variant's priority on ``device``. Selection calls it through
        ``PluginHost.variant_callback``, which sets the variant aside if it raises."""
        if not callable(self.priority):
            return self.priority
        value = self.priority(device)
        if not isinstance(value, numbers.Real):
            raise TypeError(f"priority of variant {self.kernel}/{self.name} returned "
                            f"{type(value).__name__} ({value!r}); it should return an int")
        return int(value)

    def missing(self, device: DeviceInfo) -> frozenset[str]:
        """The required capabilities ``device`` lacks."""
        return self.requires - device.capabilities


class Registry:
    """Kernels and their variants, as the plugins registered them."""

    def __init__(self, parent: "Registry | None" = None) -> None:
        self.kernels: dict[str, KernelSpec] = {}
        self.variants: dict[str, dict[str, Variant]] = {}
        # A plugin registers into a staging registry whose parent is the real one, so that
        # a plugin failing half-way leaves nothing behind (see Registry.merge).
        self._parent = parent

    def _known(self, kernel: str) -> bool:
        return kernel in self.kernels or (self._parent is not None and self._parent._known(kernel))

    def _existing(self, kernel: str, name: str) -> Variant | None:
        found = self.variants.get(kernel, {}).get(name)
        if found is None and self._parent is not None:
            return self._parent._existing(kernel, name)
        return found

    # What plugins call -------------------------------------------------------------

    def add_kernel(self, spec: KernelSpec) -> None:
        """Declare a kernel family. Declaring the same spec twice is harmless."""
        old = self.kernels.get(spec.name)
        if old is not None and old != spec:
            raise ValueError(f"kernel {spec.name!r} is already declared differently")
        self.kernels[spec.name] = spec
        self.variants.setdefault(spec.name, {})

    def add_variant(self, variant: Variant) -> None:
        """Register a variant of a declared kernel. Names are unique per kernel."""
        if not self._known(variant.kernel):
            raise UndeclaredKernelError(
                f"variant {variant.name!r} is for undeclared kernel {variant.kernel!r} "
                "(declare it with add_kernel first)"
            )
        existing = self._existing(variant.kernel, variant.name)
        if existing is not None:
            raise ValueError(
                f"variant {variant.kernel}/{variant.name} is already registered "
                f"by {existing.plugin or 'another plugin'}"
            )
        self.variants.setdefault(variant.kernel, {})[variant.name] = variant

    # What the core reads -------------------------------------------------------------

    def merge(self, other: "Registry", plugin: str) -> None:
        """Take ``other``'s entries, stamping its variants with ``plugin``; all or nothing."""
        for spec in other.kernels.values():
            old = self.kernels.get(spec.name)
            if old is not None and old != spec:
                raise ValueError(f"kernel {spec.name!r} is already declared differently")
        for kernel, variants in other.variants.items():
            for name in variants:
                if name in self.variants.get(kernel, {}):
                    raise ValueError(f"variant {kernel}/{name} is already registered")
        for spec in other.kernels.values():
            self.add_kernel(spec)
        for kernel, variants in other.variants.items():
            self.variants.setdefault(kernel, {})
            for v in variants.values():
                self.variants[kernel][v.name] = dataclasses.replace(v, plugin=plugin)

    def spec(self, name: str) -> KernelSpec:
        """The kernel called ``name``; ``KeyError`` listing the known ones otherwise."""
        try:
            return self.kernels[name]
        except KeyError:
            raise KeyError(
                f"unknown kernel {name!r}; known kernels: {', '.join(sorted(self.kernels))}"
            ) from None
