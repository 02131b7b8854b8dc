"""Loading plugins, calling their hooks in isolation, and holding what they registered.

One :class:`PluginHost` per process (``host()``) owns the pluggy ``PluginManager``, the
registry, detected devices, emulation profiles, and the selection caches. It is built on
first use, never at import, so importing the library probes no hardware.

Hooks are called one implementation at a time (in pluggy's order) rather than through
pluggy's own hook caller, so that one plugin raising is recorded and skipped instead of
aborting the call for everyone.
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import threading
import traceback
from importlib import metadata
from typing import Any, Iterable

import pluggy
import torch

from . import hookspecs
from .device import DeviceInfo
from .errors import DeviceError, PluginError, PortableKernelsError
from .registry import Registry, UndeclaredKernelError

__all__ = ["PluginHost", "PluginFailure", "host", "install_host", "reset"]

ENTRY_POINT_GROUP = "portable_kernels"
_log = logging.getLogger("portable_kernels")

#: True once some host has run ``pk_runtime_setup`` in this process (see kernels/__init__).
RUNTIME_READY = False
#: Hosts being built right now (a plugin importing kernel modules at load time runs inside).
BUILDING = 0
_CATALOG = "portable_kernels.catalog"


@dataclasses.dataclass(frozen=True)
class PluginFailure:
    """A plugin that raised: where (``"load"`` or a hook name), what, and the traceback."""

    plugin: str
    stage: str
    error: str
    traceback: str = ""

    def to_dict(self) -> dict:
        return {"plugin": self.plugin, "stage": self.stage, "error": self.error}


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def parse_variant_env(value: str) -> dict[str, str]:
    """Parse ``PK_VARIANT="flash_attn=iluvatar.v1,matmul=generic"`` into a dict."""
    forced: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        kernel, sep, variant = item.partition("=")
        if not sep or not kernel.strip() or not variant.strip():
            raise ValueError(
                f"PK_VARIANT entry {item!r} is not 'kernel=variant' "
                "(e.g. PK_VARIANT='softmax=generic,matmul=nvidia.hopper')"
            )
        forced[kernel.strip()] = variant.strip()
    return forced


class PluginHost:
    """The loaded plugins and everything derived from them.

    Args:
        plugins: extra plugin objects (modules, classes or instances with hook
            functions) to register, e.g. inline fakes in tests.
        autoload: load the ``portable_kernels`` entry points; defaults to
            ``PK_DISABLE_PLUGIN_AUTOLOAD`` not being set.
        catalog: register the core's catalog (the kernel families and their ``generic``
            variants). Tests of the dispatch layer turn it off and declare their own.
    """

    def __init__(
        self,
        plugins: Iterable[Any] = (),
        *,
        autoload: bool | None = None,
        catalog: bool = True,
    ) -> None:
        global BUILDING
        BUILDING += 1
        try:
            self._build(plugins, autoload, catalog)
        finally:
            BUILDING -= 1

    def _build(self, plugins: Iterable[Any], autoload: bool | None, catalog: bool) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.failures: list[PluginFailure] = []
        self._failed: set[str] = set()
        #: plugin name -> where it came from ("builtin", "entry point acme-pk 1.0", ...)
        self.sources: dict[str, str] = {}
        self._lock = threading.RLock()
        self.autoload = (not _truthy("PK_DISABLE_PLUGIN_AUTOLOAD")) if autoload is None else autoload
        self.env_emulation = os.environ.get("PK_EMULATE", "").strip().lower()
        self.env_forced = parse_variant_env(os.environ.get("PK_VARIANT", ""))
        # Selection caches; see dispatch.py. Cleared whenever the set of plugins changes.
        self.plans: dict[str, dict] = {}
        self.launch_plans: dict[tuple, Any] = {}
        self._devices: dict[torch.device, DeviceInfo] = {}

        if catalog:
            self._register(importlib.import_module(_CATALOG), _CATALOG, "builtin")
        if self.autoload:
            self._load_entry_points()
        for name in filter(None, (m.strip() for m in os.environ.get("PK_PLUGINS", "").split(","))):
            self._load_module(name)
        for plugin in plugins:
            name = getattr(plugin, "__name__", None) or type(plugin).__name__
            self._register(plugin, name, "passed to PluginHost")

        global RUNTIME_READY
        self.call("pk_runtime_setup")
        RUNTIME_READY = True
        self.registry = self._build_registry()
        self.profiles = self._collect_profiles()
        if self.env_emulation and self.env_emulation not in self.profiles:
            self._record("PK_EMULATE", "environment", ValueError(
                f"PK_EMULATE={self.env_emulation!r} is not a known profile; "
                f"known: {', '.join(sorted(self.profiles)) or 'none'}"), keep=True)

    # Loading ---------------------------------------------------------------------------

    def _register(self, plugin: Any, name: str, source: str) -> None:
        self.sources[name] = source
        # A misspelt hook would otherwise be silently ignored by pluggy.
        unknown = sorted(
            attr for attr in dir(plugin)
            if attr.startswith("pk_") and callable(getattr(plugin, attr, None))
            and not hasattr(self.pm.hook, attr)
        )
        if unknown:
            self._record(name, "load", PluginError(
                f"{name} defines unknown hooks {unknown}; known hooks: "
                f"{sorted(n for n in dir(hookspecs) if n.startswith('pk_'))}"))
            return
        try:
            self.pm.register(plugin, name=name)
        except Exception as exc:  # pluggy validates hook signatures here
            self._record(name, "load", exc)

    def _load_module(self, name: str) -> None:
        try:
            module = importlib.import_module(name)
        except Exception as exc:
            self.sources[name] = "PK_PLUGINS"
            self._record(name, "load", exc)
            return
        self._register(module, name, "PK_PLUGINS")

    def _load_entry_points(self) -> None:
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            if self.pm.get_plugin(ep.name) is not None or ep.name in self._failed:
                continue
            dist = getattr(ep, "dist", None)
            source = f"entry point {ep.value}" + (f" ({dist.name} {dist.version})" if dist else "")
            try:
                plugin = ep.load()
            except Exception as exc:
                self.sources[ep.name] = source
                self._record(ep.name, "load", exc)
                continue
            self._register(plugin, ep.name, source)

    def _record(self, plugin: str, stage: str, exc: BaseException, keep: bool = False) -> None:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self.failures.append(PluginFailure(plugin, stage, f"{type(exc).__name__}: {exc}", tb))
        # Also logged: a plugin that silently vanished would otherwise only show in `info`.
        _log.warning("portable-kernels plugin %s failed in %s and is %s: %s: %s", plugin, stage,
                     "kept" if keep else "skipped", type(exc).__name__, exc)
        if keep:
            return
        self._failed.add(plugin)
        if self.pm.get_plugin(plugin) is not None:
            self.pm.unregister(name=plugin)
        # What the failed plugin registered or detected may be behind cached selections.
        registry = getattr(self, "registry", None)
        if registry is not None:
            for variants in registry.variants.values():
                for vname in [n for n, v in variants.items() if v.plugin == plugin]:
                    del variants[vname]
        self.clear_caches()

    # Calling hooks -----------------------------------------------------------------------

    def _impls(self, hook: str):
        # pluggy calls implementations last-registered-first, tryfirst before trylast.
        return reversed(getattr(self.pm.hook, hook).get_hookimpls())

    def call(self, hook: str, firstresult: bool = False, **kwargs: Any) -> Any:
        """Call ``hook`` on each plugin in turn, isolating failures.

        With ``firstresult`` the first non-``None`` answer is returned (else ``None``);
        otherwise the list of non-``None`` answers. A :class:`PortableKernelsError` raised
        by a plugin is about the user's input and propagates; anything else marks the
        plugin failed and the call goes on without it.
        """
        results = []
        for impl in list(self._impls(hook)):
            if impl.plugin_name in self._failed:
                continue
            try:
                result = impl.function(*(kwargs[name] for name in impl.argnames))
            except PortableKernelsError:
                raise
            except Exception as exc:
                self._record(impl.plugin_name, hook, exc)
                continue
            if result is None:
                continue
            if firstresult:
                return result
            results.append(result)
        return None if firstresult else results

    def _build_registry(self) -> Registry:
        registry = Registry()
        # Registration order (catalog first, then entry points), so kernels are declared
        # before other plugins add variants to them; a plugin adding to a kernel that a
        # later plugin declares is retried once the others are in.
        impls = getattr(self.pm.hook, "pk_register_variants").get_hookimpls()
        pending = [i for i in impls if i.tryfirst] + [i for i in impls if not (i.tryfirst or i.trylast)] \
            + [i for i in impls if i.trylast]
        while pending:
            retry, last_error = [], {}
            for impl in pending:
                staging = Registry(parent=registry)
                try:
                    impl.function(*({"registry": staging}[n] for n in impl.argnames))
                    registry.merge(staging, impl.plugin_name)
                except UndeclaredKernelError as exc:
                    retry.append(impl)
                    last_error[impl.plugin_name] = exc
                except Exception as exc:
                    self._record(impl.plugin_name, "pk_register_variants", exc)
            if len(retry) == len(pending):
                for impl in retry:
                    self._record(impl.plugin_name, "pk_register_variants", last_error[impl.plugin_name])
                break
            pending = retry
        return registry

    def _collect_profiles(self) -> dict[str, DeviceInfo]:
        profiles: dict[str, DeviceInfo] = {}
        for impl in list(self._impls("pk_emulation_profiles")):
            if impl.plugin_name in self._failed:
                continue
            try:
                answer = impl.function() or {}
                for name, info in answer.items():
                    if not isinstance(info, DeviceInfo):
                        raise TypeError(f"profile {name!r} is a {type(info).__name__}, not DeviceInfo")
            except Exception as exc:
                self._record(impl.plugin_name, "pk_emulation_profiles", exc)
                continue
            for name, info in answer.items():
                key = name.lower()
                if key in profiles:
                    self._record(impl.plugin_name, "pk_emulation_profiles", ValueError(
                        f"profile {key!r} is already defined by {profiles[key].backend}"), keep=True)
                    continue
                profiles[key] = dataclasses.replace(
                    info, emulated=key, backend=info.backend or impl.plugin_name)
        return profiles

    # Devices -----------------------------------------------------------------------------

    def plugin_names(self) -> list[str]:
        """Names of the plugins loaded and not failed, in registration order."""
        return [name for name, _ in self.pm.list_name_plugin()]

    def detect(self, device: torch.device) -> DeviceInfo:
        """The real device's info (cached); ``DeviceError`` when no backend knows it."""
        info = self._devices.get(device)
        if info is not None:
            return info
        with self._lock:
            info = self.call("pk_detect_device", firstresult=True, device=device)
            if info is None:
                failed = "; ".join(f"{f.plugin} ({f.stage}: {f.error})" for f in self.failures)
                raise DeviceError(
                    f"no loaded backend recognizes device {device}; loaded plugins: "
                    f"{', '.join(self.plugin_names()) or 'none'}"
                    + (f"; failed plugins: {failed}" if failed else "")
                    + ("" if self.autoload else " (PK_DISABLE_PLUGIN_AUTOLOAD is set)")
                )
            if not isinstance(info, DeviceInfo):
                raise PluginError(f"pk_detect_device returned {type(info).__name__}, not DeviceInfo")
            self._devices[device] = info
            return info

    def emulation_profile(self, name: str) -> DeviceInfo:
        """The profile called ``name``; ``ValueError`` listing the known ones otherwise."""
        try:
            return self.profiles[name.lower()]
        except KeyError:
            raise ValueError(
                f"unknown emulation profile {name!r}; known: {', '.join(sorted(self.profiles))}"
            ) from None

    def clear_caches(self) -> None:
        """Forget every cached selection and launch plan (after plugins changed)."""
        for cache in self.plans.values():
            cache.clear()
        self.launch_plans.clear()
        self._devices.clear()


_HOST: PluginHost | None = None
_HOST_LOCK = threading.Lock()


def host() -> PluginHost:
    """The process's plugin host, built on first use."""
    global _HOST
    if _HOST is None:
        with _HOST_LOCK:
            if _HOST is None:
                _HOST = PluginHost()
    return _HOST


def install_host(new: PluginHost | None) -> PluginHost | None:
    """Make ``new`` the process's host (``None``: rebuild on next use); returns the old one."""
    global _HOST
    with _HOST_LOCK:
        old, _HOST = _HOST, new
    return old


def reset() -> None:
    """Drop the host so the next call reloads plugins and re-reads ``PK_*`` variables."""
    install_host(None)
