"""Loading plugins, calling their hooks in isolation, and holding what they registered.

One :class:`PluginHost` per process (``host()``) owns the pluggy ``PluginManager``, the
registry, detected devices, emulation profiles, and the selection caches. It is built on
first use, never at import, so importing the library probes no hardware.

Hooks are called one implementation at a time (in pluggy's order) rather than through
pluggy's own hook caller, so that one plugin raising, or answering something of the wrong
type, is recorded and skipped instead of aborting the call for everyone. A variant's own
callbacks (``priority``, ``accepts``) get the same isolation through
:meth:`PluginHost.variant_callback`: the variant is set aside, its plugin kept.
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import reprlib
import threading
import traceback
from collections.abc import Mapping
from importlib import metadata
from typing import Any, Callable, Iterable, Iterator

import pluggy
import torch

from . import hookspecs
from .device import DeviceInfo
from .errors import ConfigurationError, DeviceError, PluginError, PortableKernelsError
from .registry import Registry, UndeclaredKernelError, Variant

__all__ = ["PluginHost", "PluginFailure", "VariantSetAside", "host", "install_host", "reset"]

ENTRY_POINT_GROUP = "portable_kernels"
_log = logging.getLogger("portable_kernels")

#: True once some host has run ``pk_runtime_setup`` in this process (see kernels/__init__).
RUNTIME_READY = False
#: Hosts being built right now (a plugin importing kernel modules at load time runs inside).
BUILDING = 0
_CATALOG = "portable_kernels.catalog"


@dataclasses.dataclass(frozen=True)
class PluginFailure:
    """A plugin that failed: where (``"load"``, a hook name, or ``"<kernel>/<variant>
    <callback>"`` for a variant's own callback), what, and the traceback."""

    plugin: str
    stage: str
    error: str
    traceback: str = ""

    def to_dict(self) -> dict:
        return {"plugin": self.plugin, "stage": self.stage, "error": self.error}


class VariantSetAside(Exception):
    """A variant's callback failed, so selection must go on without it; the message says
    why, in the words a rejected variant's reason uses."""


def _kind(value: Any) -> str:
    return f"{type(value).__name__} ({reprlib.repr(value)})"


def _device_info(answer: Any) -> str | None:
    if not isinstance(answer, DeviceInfo):
        return f"returned {_kind(answer)}; it should return a DeviceInfo or None"
    return None


def _configs(answer: Any) -> str | None:
    import triton  # here: importing the core must not import triton before _interpreter

    should = "it should return a list of triton.Config or None"
    if not isinstance(answer, (list, tuple)):
        return f"returned {_kind(answer)}; {should}"
    bad = next((c for c in answer if not isinstance(c, triton.Config)), None)
    return None if bad is None else f"returned a list holding {_kind(bad)}; {should}"


def _switches(answer: Any) -> str | None:
    if not isinstance(answer, Mapping):
        return f"returned {_kind(answer)}; it should return a dict of constexpr names to values, or None"
    bad = next((k for k in answer if not isinstance(k, str)), None)
    if bad is not None:
        return f"returned a dict with the key {_kind(bad)}; its keys must be constexpr names (str)"
    return None


def _expected_failures(answer: Any) -> str | None:
    # The entries themselves are checked by the conformance suite, which reports them.
    if not isinstance(answer, (list, tuple)):
        return f"returned {_kind(answer)}; it should return a list of ExpectedFailure or None"
    return None


def _profiles(answer: Any) -> str | None:
    if not isinstance(answer, Mapping):
        return f"returned {_kind(answer)}; it should return a dict of profile names to DeviceInfo, or None"
    for name, info in answer.items():
        if not isinstance(name, str) or not isinstance(info, DeviceInfo):
            return f"returned profile {name!r} as {_kind(info)}; profiles must be str names of DeviceInfo"
    return None


def _binary_launcher(answer: Any) -> str | None:
    return None if callable(answer) else f"returned {_kind(answer)}; it should return a function of a compiled kernel, or None"


#: hook name -> check of a non-None answer (a message saying what is wrong, or None). A bad
#: answer would otherwise fail later, far from the plugin, in every kernel that meets it.
VALIDATORS: dict[str, Callable[[Any], str | None]] = {
    "pk_detect_device": _device_info,
    "pk_tuning_configs": _configs,
    "pk_variant_switches": _switches,
    "pk_expected_failures": _expected_failures,
    "pk_emulation_profiles": _profiles,
    "pk_binary_launcher": _binary_launcher,
}


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def parse_variant_env(value: str) -> dict[str, str]:
    """Parse ``PK_VARIANT="flash_attn=iluvatar.v1,matmul=generic"`` into a dict."""
    forced: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        kernel, sep, variant = item.partition("=")
        if not sep or not kernel.strip() or not variant.strip():
            raise ConfigurationError(
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
        #: kernel name -> its recorded calls (``_replay.Replays``), shared by its handles.
        self.replays: dict[str, Any] = {}
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
        self._check_environment()

    def _check_environment(self) -> None:
        # Here rather than at the first call, so that every entry point (a call, explain,
        # `portable-kernels info`) reports the mistake, and reports it the same way.
        failed = "; ".join(f"{f.plugin} ({f.stage}: {f.error})" for f in self.failures)
        failed = f"; failed plugins: {failed}" if failed else ""
        if self.env_emulation and self.env_emulation not in self.profiles:
            raise ConfigurationError(
                f"PK_EMULATE={self.env_emulation!r} is not a known emulation profile; "
                f"known profiles: {', '.join(sorted(self.profiles)) or 'none'}{failed}")
        for kernel, variant in self.env_forced.items():
            if kernel not in self.registry.kernels:
                raise ConfigurationError(
                    f"PK_VARIANT entry '{kernel}={variant}' names unknown kernel {kernel!r}; "
                    f"known kernels: {', '.join(sorted(self.registry.kernels)) or 'none'}{failed}")
            registered = self.registry.variants[kernel]
            if variant not in registered:
                raise ConfigurationError(
                    f"PK_VARIANT entry '{kernel}={variant}': kernel {kernel!r} has no variant "
                    f"{variant!r}; registered: {', '.join(sorted(registered)) or 'none'}{failed}")

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

    def _note(self, plugin: str, stage: str, exc: BaseException, outcome: str) -> None:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self.failures.append(PluginFailure(plugin, stage, f"{type(exc).__name__}: {exc}", tb))
        # Also logged: a plugin that silently vanished would otherwise only show in `info`.
        _log.warning("portable-kernels plugin %s failed in %s and %s: %s: %s", plugin, stage,
                     outcome, type(exc).__name__, exc)

    def _record(self, plugin: str, stage: str, exc: BaseException, keep: bool = False) -> None:
        self._note(plugin, stage, exc, "is kept" if keep else "is skipped")
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

    def _answers(self, hook: str, **kwargs: Any) -> Iterator[tuple[str, Any]]:
        """(plugin name, answer) for each plugin's non-``None`` answer to ``hook``, asked
        lazily in pluggy's order; see :meth:`call`."""
        check = VALIDATORS.get(hook)
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
            wrong = check(result) if check is not None else None
            if wrong is not None:
                self._record(impl.plugin_name, hook, PluginError(f"{hook} {wrong}"))
                continue
            yield impl.plugin_name, result

    def call(self, hook: str, firstresult: bool = False, **kwargs: Any) -> Any:
        """Call ``hook`` on each plugin in turn, isolating failures.

        With ``firstresult`` the first non-``None`` answer is returned (else ``None``);
        otherwise the list of non-``None`` answers. A :class:`PortableKernelsError` raised
        by a plugin is about the user's input and propagates; anything else, or an answer
        of the wrong type (see :data:`VALIDATORS`), marks the plugin failed and the call
        goes on without it.
        """
        answers = (result for _, result in self._answers(hook, **kwargs))
        if firstresult:
            return next(answers, None)
        return list(answers)

    def variant_callback(self, variant: Variant, callback: str, *args: Any) -> Any:
        """``variant``'s ``priority`` or ``configs`` (on ``args = (device,)``) or ``accepts``
        (on ``args = (problem, device)``), isolated as hooks are.

        A :class:`PortableKernelsError` from ``accepts`` is about the user's input and
        propagates. Anything else ``accepts`` raises, anything ``priority`` raises (it sees
        only the device, so no error of its is the user's), or an answer of the wrong type
        sets the variant aside: it leaves the registry (and the caches), the failure is
        recorded against its plugin, which keeps its other variants, and
        :class:`VariantSetAside` tells the caller to go on without it.
        """
        if callback not in ("priority", "accepts", "configs"):
            raise ValueError(f"unknown variant callback {callback!r}")
        call = {"priority": variant.priority_on, "accepts": variant.accepts,
                "configs": variant.configs}[callback]
        try:
            result = call(*args)
        except Exception as exc:
            if callback == "accepts" and isinstance(exc, PortableKernelsError):
                raise
            raise self._set_aside(variant, callback, exc, f"its {callback} raised "
                                  f"{type(exc).__name__}: {exc}") from exc
        if callback == "accepts" and not (result is None or isinstance(result, str)):
            wrong = (f"accepts returned {_kind(result)}; it should return None or a str "
                     "saying why the variant cannot take the problem")
            raise self._set_aside(variant, callback, PluginError(wrong), f"its {wrong}")
        if callback == "configs" and result is not None:
            wrong = _configs(result)
            if wrong:
                wrong = f"configs {wrong}"
                raise self._set_aside(variant, callback, PluginError(wrong), f"its {wrong}")
        return result

    def _set_aside(self, variant: Variant, callback: str, exc: Exception, why: str) -> VariantSetAside:
        with self._lock:
            variants = self.registry.variants.get(variant.kernel, {})
            # Another thread may have set it aside already: record and log it once.
            if variants.get(variant.name) is variant:
                del variants[variant.name]
                self._note(variant.plugin, f"{variant.kernel}/{variant.name} {callback}", exc,
                           "the variant is set aside")
                self.clear_caches()
        return VariantSetAside(f"set aside: {why}")

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
        for plugin, answer in self._answers("pk_emulation_profiles"):
            for name, info in answer.items():
                key = name.lower()
                if key in profiles:
                    self._record(plugin, "pk_emulation_profiles", ValueError(
                        f"profile {key!r} is already defined by {profiles[key].backend}"), keep=True)
                    continue
                profiles[key] = dataclasses.replace(info, emulated=key, backend=info.backend or plugin)
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
        for replays in self.replays.values():
            replays.clear()  # also re-reads PK_REPLAY
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
