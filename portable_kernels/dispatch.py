"""Selection and dispatch: from a call's tensors to the variant that runs it.

Per call, a :class:`KernelHandle` builds the family's problem tuple (device, dtype, ...),
reads the selection context (emulation, forced variants) and looks both up in a dict. Only
on a miss does it detect the device, check every variant's requirements and predicate,
rank the runnable ones by priority and build a launch plan. So the steady state costs one
cheap tuple, one ContextVar read and one dict lookup on top of the family's launcher.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any, Callable, Iterator, NamedTuple

import torch

from . import _context, _replay, plugins
from .device import DeviceInfo
from .errors import ArgumentError, DeviceError, NoVariantError, VariantUnavailableError
from .launch import LaunchPlan, launch_guard
from .registry import KernelSpec, Variant

__all__ = [
    "KernelHandle",
    "Selection",
    "Verdict",
    "device_info",
    "emulate",
    "explain",
    "get_kernel",
    "list_kernels",
    "list_variants",
    "use_variant",
]


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One variant as selection saw it."""

    name: str
    plugin: str
    priority: int
    runnable: bool
    reason: str  # why it was rejected, or why it won / lost on priority

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Selection:
    """The outcome of selection for one kernel, device and problem; ``explain`` returns it.

    Attributes:
        kernel: the kernel's name.
        variant: the chosen variant's name.
        device: the DeviceInfo selection saw (an emulated profile while emulating).
        executor: the DeviceInfo of the device that executes the kernel.
        forced: True when ``use_variant``/``PK_VARIANT`` chose the variant.
        verdicts: every registered variant, the chosen one first, then by priority.
        problem: the problem tuple (``None`` when explained without arguments).
    """

    kernel: str
    variant: str
    device: DeviceInfo
    executor: DeviceInfo
    forced: bool
    verdicts: tuple[Verdict, ...]
    problem: Any = None

    @property
    def reason(self) -> str:
        """Why the chosen variant was chosen."""
        return self.verdicts[0].reason

    def to_dict(self) -> dict:
        return {
            "kernel": self.kernel,
            "variant": self.variant,
            "reason": self.reason,
            "forced": self.forced,
            "device": self.device.to_dict(),
            "executor": self.executor.to_dict(),
            "problem": None if self.problem is None else {
                k: str(v) for k, v in self.problem._asdict().items()},
            "variants": [v.to_dict() for v in self.verdicts],
        }

    def __str__(self) -> str:
        dev = self.device
        where = f"{dev.name} ({dev.vendor} {dev.arch})"
        if dev.emulated:
            where += f", emulated as {dev.emulated!r} on {self.executor.name}"
        lines = [f"{self.kernel} on {where}: {self.variant}", f"  why: {self.reason}"]
        if dev.evidence:
            lines.append(f"  on {dev.arch}: {dev.evidence}")
        for v in self.verdicts[1:]:
            mark = "runnable" if v.runnable else "rejected"
            lines.append(f"  {v.name} [{v.plugin}, priority {v.priority}] {mark}: {v.reason}")
        return "\n".join(lines)


def _spec(name: str) -> KernelSpec:
    return plugins.host().registry.spec(name)


def _resolve_device(device: Any) -> torch.device:
    """``device`` (a ``torch.device`` or a string such as ``"cuda:1"``; ``None``: the current
    CUDA device if there is one, else the CPU) as a ``torch.device`` with an index.

    Checked against what torch sees here before any backend's detection hook reads it: a
    hook asked about a device that does not exist raises, and the plugin host would record
    that backend as failed and skip it for the rest of the process. Only calls that take a
    device argument come here; a kernel call takes its device from its tensors.

    Raises:
        DeviceError: ``device`` is not a torch device, torch has no module or no device of
            its type here, or its index is past the count; the message lists what exists.
    """
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    parsed: torch.device | None = None

    def error(problem: str) -> DeviceError:
        here = ["cpu"]
        # Triton's GPU targets, and the type asked about (an out-of-tree backend's, say).
        for kind in dict.fromkeys(["cuda", "xpu"] + ([parsed.type] if parsed is not None else [])):
            mod = getattr(torch, kind, None)
            try:
                count = mod.device_count() if mod.is_available() else 0
            except (AttributeError, RuntimeError):
                count = 0  # no module, or one that cannot count its devices: none offered
            here += [f"{kind}:{i}" for i in range(count)]
        shown = f"'{device}'" if isinstance(device, (str, torch.device)) else repr(device)
        return DeviceError(f"device {shown}: {problem}; devices here: {', '.join(here)}")

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise error("not a torch device (a type and an optional index: cpu, cuda, cuda:1)") from None
    kind = parsed.type
    if kind == "cpu":
        return parsed
    if kind == "meta":
        # No hardware behind it, nothing to check. Cache keys and detection see meta:0.
        return parsed if parsed.index is not None else torch.device("meta", 0)
    mod = getattr(torch, kind, None)
    if mod is None or not hasattr(mod, "device_count"):
        raise error(f"torch has no torch.{kind} module, so it reaches no {kind} device")
    available = mod.is_available() if hasattr(mod, "is_available") else True
    count = mod.device_count() if available else 0
    if count == 0:
        why = f"torch.{kind}.is_available() is False" if not available else f"torch.{kind}.device_count() is 0"
        raise error(f"torch sees no {kind.upper()} device on this machine ({why})")
    if parsed.index is None:
        # Tensors always carry an index; so must cache keys and detection.
        return torch.device(kind, mod.current_device() if hasattr(mod, "current_device") else 0)
    if parsed.index >= count:
        devices = f"{count} {kind.upper()} device" + ("s" if count > 1 else "")
        raise error(f"index {parsed.index} is out of range: torch sees {devices}")
    return parsed


def _devices(torch_device: torch.device, ctx: _context.SelectionContext) -> tuple[DeviceInfo, DeviceInfo]:
    """(the device selection sees, the device that executes)."""
    host = plugins.host()
    real = host.detect(torch_device)
    emulation = ctx.emulation if ctx.emulation is not None else host.env_emulation
    if emulation:
        return host.emulation_profile(emulation), real
    return real, real


def _forced(name: str, ctx: _context.SelectionContext) -> str | None:
    forced = dict(plugins.host().env_forced)
    forced.update(ctx.forced)
    return forced.get(name)


def select(
    name: str,
    problem: NamedTuple | None,
    torch_device: torch.device,
    ctx: _context.SelectionContext | None = None,
) -> Selection:
    """Choose the variant of ``name`` for ``problem`` on ``torch_device``.

    Raises:
        VariantUnavailableError: a forced variant cannot run here (the message says why).
        NoVariantError: no variant can run; the message lists each and why it was rejected.
    """
    host = plugins.host()
    spec = host.registry.spec(name)
    ctx = _context.current.get() if ctx is None else ctx
    info, real = _devices(torch_device, ctx)
    # A copy: a variant whose callback fails leaves the registry while being judged.
    verdicts = [_judge(host, v, problem, info) for v in list(host.registry.variants[spec.name].values())]

    forced = _forced(name, ctx)
    runnable = sorted((v for v in verdicts if v.runnable), key=lambda v: (-v.priority, v.name))
    if forced is not None:
        chosen = next((v for v in verdicts if v.name == forced), None)
        if chosen is None:
            raise VariantUnavailableError(
                f"{name}: forced variant {forced!r} is not registered; registered: "
                f"{', '.join(v.name for v in verdicts)}"
            )
        if not chosen.runnable:
            raise VariantUnavailableError(
                f"{name}: forced variant {forced!r} cannot run on {info.name}: {chosen.reason}"
            )
        why = "forced by use_variant/PK_VARIANT"
    else:
        if not runnable:
            detail = "; ".join(f"{v.name}: {v.reason}" for v in verdicts) or "no variants registered"
            raise NoVariantError(f"{name}: no variant can run on {info.name} ({info.arch}): {detail}")
        chosen = runnable[0]
        why = f"highest priority ({chosen.priority}) among runnable variants"
        if len(runnable) == 1:
            why = f"the only runnable variant (priority {chosen.priority})"
        # The registering plugin's own account of the technique (and of its ranking).
        description = host.registry.variants[spec.name][chosen.name].description
        if description:
            why += f": {description}"
    ordered = [dataclasses.replace(chosen, reason=why)]
    for v in sorted(verdicts, key=lambda v: (not v.runnable, -v.priority, v.name)):
        if v.name == chosen.name:
            continue
        if v.runnable:
            if forced is not None:
                detail = ""
            elif v.priority < chosen.priority:
                detail = f" (priority {v.priority} < {chosen.priority})"
            else:
                detail = " (tie broken by name)"
            v = dataclasses.replace(v, reason=f"runnable, passed over for {chosen.name}{detail}")
        ordered.append(v)
    return Selection(spec.name, chosen.name, info, real, forced is not None, tuple(ordered), problem)


def _judge(host: plugins.PluginHost, variant: Variant, problem: Any, info: DeviceInfo) -> Verdict:
    """How selection sees ``variant`` on ``info`` (``problem`` ``None``: requirements only).
    The one place a variant's own callbacks run, so that one that fails is always set
    aside (see ``PluginHost.variant_callback``), shown here as rejected."""
    try:
        priority = host.variant_callback(variant, "priority", info)
        reason = _rejection(host, variant, problem, info)
    except plugins.VariantSetAside as aside:
        return Verdict(variant.name, variant.plugin, 0, False, str(aside))
    return Verdict(variant.name, variant.plugin, priority, reason is None, reason or "")


def _rejection(host: plugins.PluginHost, variant: Variant, problem: Any, info: DeviceInfo) -> str | None:
    missing = variant.missing(info)
    if missing:
        return f"requires {', '.join(sorted(missing))}, which {info.name} lacks"
    if problem is not None and variant.accepts is not None:
        return host.variant_callback(variant, "accepts", problem, info)
    return None


def _launch_plan(selection: Selection) -> LaunchPlan:
    host = plugins.host()
    key = (selection.kernel, selection.variant, selection.executor)
    plan = host.launch_plans.get(key)
    if plan is None:
        variant = host.registry.variants[selection.kernel][selection.variant]
        device = selection.executor
        missing = variant.missing(device)
        if missing:
            # Only while emulating: selection saw the profile, but this device executes.
            raise VariantUnavailableError(
                f"{selection.kernel}: {variant.name} was selected for the emulated "
                f"{selection.device.name}, but the executing device {device.name} lacks "
                f"{', '.join(sorted(missing))}; call it outside emulation or force another "
                "variant with use_variant"
            )
        configs = host.call("pk_tuning_configs", firstresult=True,
                            kernel=variant.kernel, variant=variant, device=device)
        if configs is None and variant.configs is not None:
            # Raises VariantSetAside when the variant's own configs fail (see _resolve).
            configs = host.variant_callback(variant, "configs", device)
        switches = dict(variant.switches)
        switches.update(host.call("pk_variant_switches", firstresult=True,
                                  kernel=variant.kernel, variant=variant, device=device) or {})
        binary = host.call("pk_binary_launcher", firstresult=True, device=device)
        plan = host.launch_plans[key] = LaunchPlan(variant, device, configs or [], switches,
                                                   binary_launcher=binary)
    return plan


class KernelHandle:
    """A callable kernel: each call runs the best variant for its tensors' device.

    Get one with :func:`get_kernel`. The handle itself holds no device state, so one
    handle serves CPU and GPU tensors alike. Inside ``torch.compile`` a call is traced as
    the kernel's operator in :mod:`portable_kernels.ops` (one opaque node with a fake
    implementation and a backward, the variant still chosen per call when the graph runs),
    so compiled code may call handles as eager code does.
    """

    __slots__ = ("name", "_host", "_problem", "_cache", "_replays", "summary", "_traced",
                 "_grad_op")

    def __init__(self, name: str) -> None:
        self.name = name
        self._host: plugins.PluginHost | None = None
        self._grad_op = GRAD_OPS.get(name)
        if _compiling():
            # A handle made inside a compiled function: the plugin host may not exist yet,
            # and building it (entry points, locks) cannot be traced. Tracing needs only
            # the operator; the first eager call binds the rest.
            self._traced = _traced_call(name, self.__call__)
        else:
            self._bind()

    def _bind(self) -> None:
        host = plugins.host()
        spec = host.registry.spec(self.name)
        self._problem = spec.problem
        self._cache = host.plans.setdefault(spec.name, {})
        # Replays of seen calls (_replay), where a variant of the family opts in.
        replays = None
        if any(v.replay for v in host.registry.variants.get(spec.name, {}).values()):
            replays = host.replays.get(spec.name)
            if replays is None:
                replays = host.replays[spec.name] = _replay.Replays(spec.name, _per_call(spec))
        self._replays = replays
        self.summary = f"{spec.name}{spec.signature}: {spec.summary}"
        # For a kernel without an operator, the call itself behind a graph break: under
        # torch.compiler.disable it runs eagerly, where _compiling() is False.
        self._traced = _traced_call(spec.name, self.__call__)
        self._host = host

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Tracing must not enter the eager path: its checks read data pointers, which fake
        # tensors do not have, and its launches cannot be traced.
        if _compiling():
            return self._traced(*args, **kwargs)
        if plugins._HOST is not self._host:
            self._bind()
        replays = self._replays
        if replays is not None and replays.active:
            if replays.resting:  # its calls stopped repeating: no signature for a while
                replays.resting -= 1
            else:
                # A signature seen before replays its recorded allocations and launches. (A
                # call with a signature needs no gradient: none is taken where a tensor
                # argument, or one in a list, requires one under grad mode.)
                # The key straight from its C builder where nothing records and no argument
                # is new on every call (a Python frame less on the path every replay takes).
                if _replay.RECORDING or replays.per_call:
                    signature = replays.signature(args, kwargs)
                else:
                    signature = replays.key(args, kwargs, replays.current)
                if signature is None:  # a gradient in play, an argument it cannot key
                    replays.missed()
                else:
                    recipe = replays.recipes.get(signature[0], _replay.UNSEEN)
                    if recipe is _replay.UNSEEN:
                        replays.missed()
                        return replays.call(signature[0], self._launch, args, kwargs)
                    if recipe is not None:
                        out = recipe.run(args, kwargs, signature[1])
                        if out is not _replay.DECLINED:
                            return out
                    replays.missed()
                    return self._launch(args, kwargs)
        if self._grad_op is not None and torch.is_grad_enabled() and _wants_grad(args, kwargs):
            # A family whose launcher returns no grad_fn: its operator carries the gradient
            # (inside it grad mode is off, so this does not recurse).
            return self._grad_op(*args, **kwargs)
        return self._launch(args, kwargs)

    def _launch(self, args: tuple, kwargs: dict) -> Any:
        """The full path of a call: its problem, its plan, the family's launcher."""
        try:
            key = (self._problem(*args, **kwargs), _context.current.get())
        except TypeError as exc:
            raise _signature_error(self.name, self._problem, args, kwargs) or exc
        plan = self._cache.get(key)
        if plan is None:
            plan = self._resolve(key)
        guard = launch_guard(key[0].device)
        if _replay.RECORDING:
            _replay.note_plan(plan, guard)
        if guard is None:
            return plan.launch(plan, *args, **kwargs)
        with guard:
            return plan.launch(plan, *args, **kwargs)

    def _resolve(self, key: tuple) -> LaunchPlan:
        problem, ctx = key
        selection = select(self.name, problem, problem.device, ctx)
        try:
            plan = _launch_plan(selection)
        except plugins.VariantSetAside:
            # The chosen variant's configs failed and it left the registry: choose again
            # among the others (a forced one now says why it cannot run).
            selection = select(self.name, problem, problem.device, ctx)
            plan = _launch_plan(selection)
        self._cache[key] = plan
        return plan

    def select(self, *args: Any, **kwargs: Any) -> Selection:
        """The selection this call would make, without launching."""
        problem = _problem(self.name, self._problem, args, kwargs)
        return select(self.name, problem, problem.device)

    def plan(self, *args: Any, **kwargs: Any) -> LaunchPlan:
        """The :class:`LaunchPlan` this call would launch, without launching: for code that
        runs a family's internal stages itself (``portable_kernels.ops`` runs forward and
        backward as separate ops). Same cache and errors as a call. Such code launches
        inside ``launch.launch_guard`` of the tensors' device, as a call does."""
        if plugins._HOST is not self._host:
            self._bind()
        key = (_problem(self.name, self._problem, args, kwargs), _context.current.get())
        plan = self._cache.get(key)
        if plan is None:
            plan = self._resolve(key)
        if _replay.RECORDING:
            # A family that launches another's plan (the fused loss's products): a recording
            # of its call must meet that variant's terms too. The caller holds the guard.
            _replay.note_plan(plan, None)
        return plan

    def __repr__(self) -> str:
        return f"<portable_kernels kernel {self.name!r}>"


_compiling = torch.compiler.is_compiling


def _signature_error(name: str, problem: Any, args: tuple, kwargs: dict) -> ArgumentError | None:
    """The error for a call of kernel ``name`` whose arguments do not bind to its problem
    function (whose signature is the kernel's), or None when they do (a ``TypeError`` raised
    inside it is its own message). Only runs once a call has failed."""
    try:
        inspect.signature(problem).bind(*args, **kwargs)
    except TypeError as exc:
        spec = plugins.host().registry.kernels.get(name)
        call = f"{name}{spec.signature}" if spec is not None else name
        return ArgumentError(f"{name}: {exc}; the call is {call}")
    return None


def _problem(name: str, problem: Any, args: tuple, kwargs: dict) -> Any:
    """``problem(*args, **kwargs)``, with a call that does not match the kernel's signature
    reported as such."""
    try:
        return problem(*args, **kwargs)
    except TypeError as exc:
        raise _signature_error(name, problem, args, kwargs) or exc


#: Kernel name -> its operator, for the families whose launchers return tensors without a
#: ``grad_fn``: a handle call that needs a gradient goes through the operator (filled by
#: :mod:`portable_kernels.ops`, as TRACED_OPS).
GRAD_OPS: dict[str, Callable[..., Any]] = {}


def _wants_grad(args: tuple, kwargs: dict) -> bool:
    """Whether any tensor argument (or tensor in a list argument) requires grad."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            if a.requires_grad:
                return True
        elif isinstance(a, (list, tuple)) and any(
                isinstance(t, torch.Tensor) and t.requires_grad for t in a):
            return True
    return False


#: Kernel name -> its torch operator, the public function of :mod:`portable_kernels.ops`,
#: which fills this table when the package is imported (it builds on this module, so
#: this module does not import it).
TRACED_OPS: dict[str, Callable[..., Any]] = {}


def _traced_call(name: str, eager: Any) -> Any:
    """What a call of kernel ``name`` is under ``torch.compile``: its operator in
    :mod:`portable_kernels.ops`, or, for a kernel that has none (a plugin's own family),
    the eager call behind a graph break."""
    op = TRACED_OPS.get(name)
    if op is not None:
        return op
    reason = (f"portable_kernels: kernel {name!r} has no torch operator "
              "(portable_kernels.ops), so torch.compile runs it eagerly")
    try:
        return torch.compiler.disable(eager, reason=reason)
    except TypeError:  # torch < 2.6 takes no reason
        return torch.compiler.disable(eager)


def get_kernel(name: str) -> KernelHandle:
    """The kernel called ``name``; ``KeyError`` listing the known kernels otherwise."""
    return KernelHandle(name)


def list_kernels() -> list[str]:
    """Names of every declared kernel, sorted."""
    return sorted(plugins.host().registry.kernels)


def _per_call(spec: KernelSpec) -> dict[int, str]:
    """``spec.runtime``'s arguments by their position in a call: ``{position: name}``."""
    if not spec.runtime:
        return {}
    names = list(inspect.signature(spec.problem).parameters)
    return {names.index(name): name for name in spec.runtime}


def list_variants(name: str, device: Any = None) -> list[str]:
    """Variants of kernel ``name``: all registered ones, or with ``device`` those whose
    requirements it meets (what it *can run*), best priority first."""
    host = plugins.host()
    spec = host.registry.spec(name)
    variants = list(host.registry.variants[spec.name].values())
    if device is None:
        return sorted(v.name for v in variants)
    ctx = _context.current.get()
    info = _devices(_resolve_device(device), ctx)[0]
    ok = [v for v in (_judge(host, v, None, info) for v in variants) if v.runnable]
    return [v.name for v in sorted(ok, key=lambda v: (-v.priority, v.name))]


def device_info(device: Any = None) -> DeviceInfo:
    """The ``DeviceInfo`` selection uses for ``device`` (a ``torch.device`` or string;
    default: the current CUDA device if there is one, else the CPU). While emulating,
    the emulated profile.

    Raises:
        DeviceError: ``device`` does not exist here (the message names it and lists the
            devices that do), or no loaded backend recognizes it.
    """
    ctx = _context.current.get()
    return _devices(_resolve_device(device), ctx)[0]


def explain(name: str, *args: Any, device: Any = None, **kwargs: Any) -> Selection:
    """Which variant of ``name`` would run, and why each other one would not.

    With arguments (the kernel's own), selection sees their device and problem; without,
    it uses ``device`` (default as :func:`device_info`) and skips the problem predicates.
    """
    spec = _spec(name)
    if args or kwargs:
        problem = _problem(spec.name, spec.problem, args, kwargs)
        return select(spec.name, problem, problem.device)
    return select(spec.name, None, _resolve_device(device))


@contextlib.contextmanager
def emulate(profile: str | None) -> Iterator[None]:
    """Make device detection report the ``profile``'s DeviceInfo inside the block.

    Kernels still run on the real device; only selection sees the profile. ``None`` turns
    emulation off inside the block, even where ``PK_EMULATE`` is set.

    Example::

        with pk.emulate("bi150"):
            print(pk.explain("flash_attn"))
    """
    if profile is not None:
        plugins.host().emulation_profile(profile)  # fail early on an unknown name
    ctx = _context.current.get()
    token = _context.current.set(ctx._replace(emulation=(profile or "").lower()))
    try:
        yield
    finally:
        _context.current.reset(token)


@contextlib.contextmanager
def use_variant(**forced: str) -> Iterator[None]:
    """Force variants inside the block: ``with pk.use_variant(softmax="generic"):``.

    A forced variant that cannot run on a call's device or problem raises
    :class:`VariantUnavailableError` saying why; another variant is never run instead.
    Unknown kernel or variant names raise ``KeyError`` at once.
    """
    registry = plugins.host().registry
    for kernel, variant in forced.items():
        spec = registry.spec(kernel)
        if variant not in registry.variants[spec.name]:
            raise KeyError(
                f"{kernel} has no variant {variant!r}; registered: "
                f"{', '.join(sorted(registry.variants[spec.name]))}"
            )
    ctx = _context.current.get()
    merged = dict(ctx.forced)
    merged.update(forced)
    token = _context.current.set(ctx._replace(forced=tuple(sorted(merged.items()))))
    try:
        yield
    finally:
        _context.current.reset(token)

