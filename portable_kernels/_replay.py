"""Replaying a seen call of a kernel handle: its allocations and launches, without the
family's host code.

Every call of a family whose arguments have one *signature* (each tensor's dtype, shape,
strides, device and address modulo 16; every other argument's type and value, but the
integer width alone of a per-call argument such as a seed (``KernelSpec.runtime``); the
selection context) takes the same path through the family's launcher: the same checks
pass, tensors of the same sizes are allocated, the same binaries launch on the same grids
with the same scalars, and only addresses differ. That host code (checks, problem tuple,
selection lookup, block sizes, the launch's keyword dictionaries, the direct launch's own
lookup) took most of a small call's host time on an H100 host, where the kernels took a few
microseconds (docs/performance.md, "Host time per call").

So a handle records one call per signature and replays the rest. Recording runs the
call as usual under a ``TorchDispatchMode`` that sees every torch operator it runs, while
:class:`portable_kernels._direct.DirectLaunch` reports each launch. A call is recorded only
when all it did was

- allocate (``torch.empty``/``empty_like``/``empty_strided``/``zeros``...),
- make views of its arguments or of those allocations,
- launch compiled binaries through direct launches (or, where replay is forced with
  ``PK_REPLAY=1``, through Triton's JIT launch: Triton's interpreter, other vendors),
- build device tables of addresses and sizes through :func:`table` (grouped_matmul's), and
- return those tensors (in tuples or lists) or constants.

Any other operator (a copy of a non-contiguous input, a value read on the host, a fill), a
launch through another path (an autotuner still timing), a kernel that takes Triton's
profile scratch or a host tensor descriptor, two arguments that are one tensor, or a
gradient in play: the call is not recorded and its signature keeps the full path. The
replay is generated straight-line Python (``Recipe.source``): allocate, read the current
stream, rebuild each table with the new addresses, call each binary's launcher with the
new addresses (plus the recorded byte offset of a view) and the recorded scalars (a
per-call argument's value read from each call, where a launch takes it at a runtime
position), build the result. Memory is held no longer than the full path holds it: an
allocation is made before its first launch and dropped after its last (one a table points
at lives as long as the table), and temporaries carved from one workspace share bytes
where their launches do not interleave (a chunk loop's chunks).

Families opt in per variant (``Variant.replay``): the flag says the launcher's behaviour is
a function of the signature alone (no state kept between calls, no randomness drawn on the
host, no launch outside the plan). ``PK_CHECK_VALUES=1`` is honoured: a recipe whose call
consulted it declines while it is set, so the value checks run.

A handle whose calls stop repeating (a mixture-of-experts layer's group sizes change every
step) rests: after :data:`MISS_WINDOW` calls that computed a signature and replayed none,
its next :data:`REST` calls take the full path without one.

``PK_REPLAY=direct`` replays direct launches only (NVIDIA GPUs, see
``_direct.supported``), the default (:data:`DEFAULT`); ``PK_REPLAY=1`` also records JIT
launches (tests use it on the CPU interpreter, where nothing is gained but the recording is
exercised); ``PK_REPLAY=0``: off.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import threading
from typing import Any, Callable, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from . import _context, _direct, _signature
from . import launch as _launch

__all__ = ["Recipe", "Replays", "mode", "stage"]

#: Recordings in progress in any thread: launches read it first, so that the common case
#: (none) costs one module attribute read.
RECORDING = 0
_recording_lock = threading.Lock()
_tls = threading.local()

#: Signatures tracked per kernel (recipes and those still being tried); past it new
#: signatures take the full path.
MAX_KEYS = 256
#: Recording attempts per signature after its first call (the first calls of a new shape
#: may still compile or tune).
ATTEMPTS = 3
#: Returned by a recipe that cannot run now (a launch hook is set, or ``PK_CHECK_VALUES``
#: asks for the checks it skips): the caller takes the full path.
DECLINED = object()
#: What ``Replays.recipes.get(key, UNSEEN)`` answers for a signature without a recipe yet.
UNSEEN = object()
#: A handle whose last MISS_WINDOW calls with a signature computed replayed none (calls
#: that never repeat, as a mixture-of-experts layer's group sizes, or that never record)
#: rests: its next REST calls take the full path without computing a signature, which for
#: a list of 64 groups costs about a tenth of the call.
MISS_WINDOW = 64
REST = 1024

_SCALARS = _signature.SCALARS

#: What replays allocate with (read when a recipe is built; tests poison it).
ALLOCATE = torch.empty_strided

_aten = torch.ops.aten
_ALLOCATIONS = frozenset({
    _aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
    _aten.new_empty.default, _aten.new_empty_strided.default,
})
_ZERO_ALLOCATIONS = frozenset({
    _aten.zeros.default, _aten.zeros_like.default, _aten.new_zeros.default,
})
_ALIASES = frozenset({_aten.detach.default, _aten.alias.default})


#: The mode where ``PK_REPLAY`` is unset: direct launches (NVIDIA GPUs) are replayed. The
#: suite passed with it on an H100, and bench/host_per_call.py measured 1.3-3x less host
#: time per replayed call there (docs/performance.md).
DEFAULT = "direct"


def mode() -> str:
    """``PK_REPLAY``: "off" (``0``), "all" (``1``: direct and JIT launches) or "direct"
    (direct launches only); :data:`DEFAULT` where unset."""
    value = os.environ.get("PK_REPLAY", "").strip().lower()
    if value in ("0", "false", "no", "off"):
        return "off"
    if value in ("1", "true", "yes", "on", "all"):
        return "all"
    return "direct" if value == "direct" else DEFAULT


def recorder() -> _Recorder | None:
    """The recording running in this thread, if any."""
    return getattr(_tls, "recorder", None)


class _Unrecordable(Exception):
    def __init__(self, reason: str, final: bool = True) -> None:
        super().__init__(reason)
        self.final = final  # False: a later call of the signature may still record


def note_constant(value: Any) -> None:
    """Tell the recording in this thread, if any, that the tensors in ``value`` outlive
    the call (``LaunchPlan.cached`` answers)."""
    rec = recorder()
    if rec is not None:
        rec.constant(value)


def note_kept(t: torch.Tensor, stream: int, capture: int | None) -> None:
    """Tell the recording in this thread, if any, that ``t`` is ``stream``'s kept buffer."""
    rec = recorder()
    if rec is not None:
        rec.kept(t, stream, capture)


def note_plan(plan: Any, guard: Any) -> None:
    """Tell the recording in this thread, if any, the plan its call launches through and
    the guard it launches in: a variant that does not opt in (``Variant.replay``), JIT
    launches where only direct ones are recorded, or a launch that must switch devices
    first (the interpreter's guard is its lock, which replays take too) end it."""
    rec = recorder()
    if rec is None or rec.failure is not None:
        return
    if not plan.variant.replay:
        rec.failure = _Unrecordable(f"variant {plan.variant.name} does not replay")
    elif not (rec.mode == "all" or plan._direct_launches()):
        rec.failure = _Unrecordable("launches through Triton's JIT (PK_REPLAY=1 records those)")
    elif not (guard is None or "interpreter" in plan.device.capabilities):
        rec.failure = _Unrecordable("the launch switches devices", final=False)


def unrecordable(reason: str, final: bool = True) -> None:
    """Tell the recording in this thread, if any, that its call cannot be replayed (a
    launch path it does not see, e.g. an autotuner timing configs)."""
    rec = recorder()
    if rec is not None and rec.failure is None:
        rec.failure = _Unrecordable(reason, final)


def note_value_checks() -> None:
    """Tell the recording in this thread, if any, that its call consulted
    ``PK_CHECK_VALUES`` (``kernels._host.check_values``)."""
    rec = recorder()
    if rec is not None:
        rec.checks_values = True


def table(build: Callable[[list, torch.device], torch.Tensor], values: list[int],
          device: torch.device, pointers: Callable[[int], bool]) -> torch.Tensor:
    """``build(values, device)``: a device tensor made from host integers, some of them
    addresses (grouped_matmul's table of its groups' operands and outputs). Where this
    thread records, the recording keeps the step: a replay builds the table again from the
    recorded ``values`` with each address (``pointers(i)`` true for position ``i``)
    replaced by the new call's, so an address must be one the call took or allocated.
    Families call it only ``if _replay.RECORDING`` (else ``build`` directly)."""
    rec = recorder()
    if rec is None:
        return build(values, device)
    return rec.table(build, values, device, pointers)


class Recipe:
    """One recorded call: ``recipe.run(args, kwargs, pointers)`` (or ``recipe(...)``)
    replays it, or answers :data:`DECLINED`. ``source`` is the generated function's text;
    ``calls`` counts replays (for tests; the generated function counts itself, so that a
    replay is one Python call)."""

    __slots__ = ("run", "source", "calls")

    def __init__(self, run: Callable, source: str) -> None:
        self.run = run
        self.source = source
        self.calls = 0

    def __call__(self, args: tuple, kwargs: dict, pointers: list) -> Any:
        return self.run(args, kwargs, pointers)


# A tensor's place in a recording: (kind, index, byte offset, size, stride, dtype), kind
# "in" (the index-th tensor argument), "alloc" (the index-th allocation) or "const" (the
# index-th tensor kept beyond the call: a plan's memo, a stream's kept buffer).
_Ref = tuple


class _PerCall(NamedTuple):
    """A launch's scalar that is the call's own per-call integer (``KernelSpec.runtime``):
    the recipe passes each call's value, read by ``expr`` from its ``args`` or ``kwargs``."""
    expr: str


class _Recorder(TorchDispatchMode):
    """Watches one call: its torch operators (``__torch_dispatch__``) and launches
    (:meth:`launch`). ``per_call``: the call's per-call integers, by value, and the
    expression a recipe reads each with (None where two share a value)."""

    def __init__(self, tensors: list, replay_mode: str, per_call: dict | None = None) -> None:
        super().__init__()
        self.per_call = per_call or {}
        self.mode = replay_mode
        self.refs: dict[int, _Ref] = {}
        self.roots = {"in": list(tensors), "alloc": [], "const": []}
        self.keep: list[torch.Tensor] = []  # every tensor with a ref, so ids stay unique
        # [size, stride, dtype, device, zero, table]: table (a table step's build, values,
        # device and address slots) or None (an allocation).
        self.allocs: list[list] = []
        self.steps: list[tuple] = []
        self.failure: _Unrecordable | None = None
        self.quiet = 0
        self.checks_values = False
        self.stream = None  # the stream a kept buffer belongs to
        for i, t in enumerate(tensors):
            # One tensor passed twice: the signature records which arguments share an
            # address, so either argument's index serves.
            self.refs.setdefault(id(t), ("in", i, 0, tuple(t.shape), t.stride(), t.dtype))

    # --- torch operators ---
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.quiet or self.failure is not None:
            return out
        if func in _ALLOCATIONS or func in _ZERO_ALLOCATIONS:
            self._allocation(out, zero=func in _ZERO_ALLOCATIONS)
        elif func is _aten.zero_.default and (fresh := self._fresh_allocation(args[0])) is not None:
            self.allocs[fresh][4] = True
        elif (func.is_view or func in _ALIASES) and _aliases(out, args[0]) \
                and id(args[0]) in self.refs:
            # (An operator whose schema says it may alias, as contiguous and reshape do,
            # returns a copy at times: only a result in its input's storage is a view.)
            self._view(out, args[0])
        else:
            self.failure = _Unrecordable(f"the call ran {func}")
        return out

    def _allocation(self, out: Any, zero: bool) -> None:
        if not isinstance(out, torch.Tensor):
            self.failure = _Unrecordable("an allocation returned no tensor")
            return
        self.allocs.append([tuple(out.shape), out.stride(), out.dtype, out.device, zero, None])
        self._root("alloc", out)

    def _root(self, kind: str, t: torch.Tensor) -> None:
        self.refs[id(t)] = (kind, len(self.roots[kind]), 0, tuple(t.shape), t.stride(), t.dtype)
        self.roots[kind].append(t)
        self.keep.append(t)

    def constant(self, value: Any) -> None:
        """Tensors in ``value`` (a tensor, or a tuple or list of them) outlive the call
        and may be launched on by its replays (a plan's memo)."""
        for t in (value if isinstance(value, (tuple, list)) else (value,)):
            if isinstance(t, torch.Tensor) and id(t) not in self.refs:
                self._root("const", t)

    def kept(self, t: torch.Tensor, stream: int, capture: int | None) -> None:
        """``t`` is ``stream``'s kept buffer (``kernels._counters``): replays on that
        stream alone, never in a graph capture, may use it."""
        if capture is not None:
            self.failure = _Unrecordable("a kept buffer of a graph capture", final=False)
        elif self.stream is not None and self.stream != stream:
            self.failure = _Unrecordable("kept buffers of two streams", final=False)
        self.stream = stream
        if id(t) not in self.refs:
            self._root("const", t)

    def _fresh_allocation(self, t: Any) -> int | None:
        """The allocation ``t`` is, whole, if no launch has run since it was made."""
        ref = self.refs.get(id(t))
        if ref is None or ref[0] != "alloc" or ref[2] != 0 or self.steps:
            return None
        return ref[1]

    def _view(self, out: torch.Tensor, base: torch.Tensor) -> None:
        kind, index, offset = self.refs[id(base)][:3]
        offset += out.data_ptr() - base.data_ptr()
        self.keep.append(out)
        self.refs[id(out)] = (kind, index, offset, tuple(out.shape), out.stride(), out.dtype)

    def table(self, build: Callable, values: list[int], device: torch.device,
              pointers: Callable[[int], bool]) -> torch.Tensor:
        """:func:`table`'s step: the table is an allocation whose replay rebuilds it."""
        self.quiet += 1  # its copies and host buffers are the step's own
        try:
            out = build(values, device)
        finally:
            self.quiet -= 1
        if self.failure is not None:
            return out
        if not isinstance(out, torch.Tensor):
            self.failure = _Unrecordable("a table step returned no tensor")
            return out
        addresses = {}
        for ref in self.refs.values():  # inputs first: refs keep insertion order
            addresses.setdefault(self._address_of(ref), ref)
        slots = []
        for i, value in enumerate(values):
            if pointers(i):
                ref = addresses.get(value)
                if ref is None:
                    self.failure = _Unrecordable(
                        "a table holds an address the call neither took nor allocated")
                    return out
                slots.append((i, ref))
        self.allocs.append([tuple(out.shape), out.stride(), out.dtype, out.device, False,
                            (build, list(values), device, slots)])
        self._root("alloc", out)
        return out

    def _address_of(self, ref: _Ref) -> int:
        kind, index, offset = ref[:3]
        return self.roots[kind][index].data_ptr() + offset

    # --- launches ---
    def launch(self, launcher: Any, grid: Any, args: tuple, kwargs: dict) -> None:
        """Run ``launcher``'s launch (a :class:`~portable_kernels._direct.DirectLaunch`
        called as it was) and record it."""
        before = launcher.launches
        self.quiet += 1  # Triton's interpreter copies arguments with torch operators
        _tls.recorder = None  # the launcher then launches as when nothing records
        try:
            launcher(grid, args, kwargs)
        finally:
            _tls.recorder = self
            self.quiet -= 1
        if self.failure is not None:
            return
        try:
            if launcher.direct:
                if launcher.launches == before:
                    raise _Unrecordable("a launch compiled or ran through Triton's JIT",
                                        final=False)
                self._direct_step(launcher, grid, args, kwargs)
            elif self.mode == "all":
                self._jit_step(launcher, grid, args, kwargs)
            else:
                raise _Unrecordable("a launch ran through Triton's JIT (PK_REPLAY=1 records those)")
        except _Unrecordable as exc:
            self.failure = exc
        except Exception as exc:  # the recording's own failure must never fail the call
            self.failure = _Unrecordable(f"recording a launch failed ({type(exc).__name__}: {exc})")

    def _ref(self, t: Any) -> _Ref:
        ref = self.refs.get(id(t)) if isinstance(t, torch.Tensor) else None
        if ref is None:
            raise _Unrecordable(f"a launch took a {type(t).__name__} the call did not make "
                                "from its arguments or allocate")
        return ref

    @staticmethod
    def _constant(value: Any) -> Any:
        if type(value) in _SCALARS or isinstance(value, torch.dtype):
            return value
        raise _Unrecordable(f"a launch took a {type(value).__name__} scalar")

    def _scalar(self, launcher: Any, i: int, value: Any) -> Any:
        """Launch argument ``i``'s recorded form: a constant, or at the launcher's runtime
        positions the call's per-call integer of that value."""
        if i not in launcher.runtime:
            return self._constant(value)
        expr = self.per_call.get(value) if type(value) is int else None
        if expr is None:
            raise _Unrecordable("a launch takes a scalar new on every call (a seed) that is "
                                "not one of the call's per-call arguments")
        return _PerCall(expr)

    def _direct_step(self, launcher: Any, grid: Any, args: tuple, kwargs: dict) -> None:
        key = launcher._key(args, kwargs)
        entry = None if key is None else launcher.entries.get(key)
        if entry is None:
            raise _Unrecordable("a launch found no compiled binary", final=False)
        meta = getattr(entry.kernel, "metadata", None)
        if getattr(meta, "profile_scratch_size", 0):
            raise _Unrecordable("a kernel takes Triton's profile scratch")
        # Global scratch (device-side tensor descriptors): a backend's launcher finds its
        # own; Triton's allocates it per launch through the allocator the family lends it,
        # as the replay then does (below).
        scratch = bool(getattr(meta, "global_scratch_size", 0))
        n = launcher.n_tensors
        refs = [self._ref(t) for t in args[:n]]
        scalars = [self._scalar(launcher, n + i, v) for i, v in enumerate(args[n:])]
        g = grid(entry.meta) if callable(grid) else grid
        g = (int(g[0]), int(g[1]) if len(g) > 1 else 1, int(g[2]) if len(g) > 2 else 1)
        binary = None
        if launcher.binary is not None:
            # Without guards: the signature already fixes every dtype and alignment.
            binary = launcher._binary_launch(entry.kernel, ())
        self.steps.append(("direct", binary, entry.kernel, g, refs, scalars, entry.tail,
                           torch._C._cuda_getDevice(), launcher, scratch))

    def _jit_step(self, launcher: Any, grid: Any, args: tuple, kwargs: dict) -> None:
        items = [self._ref(a) if isinstance(a, torch.Tensor)
                 else ("const", self._scalar(launcher, i, a)) for i, a in enumerate(args)]
        if any(isinstance(v, torch.Tensor) for v in kwargs.values()):
            raise _Unrecordable("a launch took a tensor keyword")
        self.steps.append(("jit", launcher.fn, grid, items, {**kwargs, **launcher.config}))

    # --- the result ---
    def template(self, value: Any) -> tuple:
        if isinstance(value, torch.Tensor):
            return ("tensor", self._ref(value))
        if type(value) in _SCALARS:
            return ("const", value)
        if isinstance(value, (tuple, list)):
            return (type(value), [self.template(v) for v in value])
        raise _Unrecordable(f"the call returned a {type(value).__name__}")


def _aliases(out: Any, base: Any) -> bool:
    """Whether tensor ``out`` lives in tensor ``base``'s storage."""
    return (isinstance(out, torch.Tensor) and isinstance(base, torch.Tensor)
            and out.untyped_storage().data_ptr() == base.untyped_storage().data_ptr())


class _Source:
    """The generated replay function's text and the names it reads."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.names: dict[str, Any] = {
            "_empty_strided": ALLOCATE, "_as_strided": torch.as_strided,
            "_stream": getattr(torch._C, "_cuda_getCurrentRawStream", None),
            "_hooked": _direct._hooked, "_check_values": _check_values,
            "_DECLINED": DECLINED, "_tensors": _tensors, "_guard": _guard,
            "_capturing": torch.cuda.is_current_stream_capturing,
        }
        self._count = itertools.count()
        self.templates: dict[tuple, str] = {}  # (dtype, device) -> an allocator's name

    def name(self, value: Any, prefix: str = "_c") -> str:
        name = f"{prefix}{next(self._count)}"
        self.names[name] = value
        return name

    def add(self, line: str, depth: int = 1) -> None:
        self.lines.append("    " * depth + line)


def _check_values() -> bool:
    from .kernels import _host  # the catalog's helpers: imported once a recipe needs them

    return _host.check_values()


def _scratch_allocator(src: _Source, device_index: int) -> str:
    """An expression for the context that lends Triton's launcher an allocator for global
    scratch on device ``device_index`` (``kernels._host.scratch_allocator``, as the family
    launchers lend it)."""
    from .kernels import _host  # the catalog's helpers: imported once a recipe needs them

    device = src.name(torch.device("cuda", device_index))
    return f"{src.name(_host.scratch_allocator, '_S')}({device})"


def _tensors(args: tuple, kwargs: dict) -> list:
    """The call's tensors in its signature's order: a list's (or tuple's) in place."""
    found = []
    for a in itertools.chain(args, kwargs.values()):
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif type(a) in _signature.SEQUENCES:
            found.extend(t for t in a if isinstance(t, torch.Tensor))
    return found


_NO_GUARD = contextlib.nullcontext()


def _guard(device: torch.device) -> Any:
    guard = _launch.launch_guard(device)
    return _NO_GUARD if guard is None else guard


def _build(rec: _Recorder, result: Any) -> Recipe:
    """The replay function of a finished recording that returned ``result``."""
    template = rec.template(result)
    src = _Source()
    jit = any(step[0] == "jit" for step in rec.steps)
    direct = any(step[0] == "direct" for step in rec.steps)
    if direct:
        src.add("if _hooked():")
        src.add("return _DECLINED", 2)
    if rec.checks_values:
        src.add("if _check_values():")
        src.add("return _DECLINED", 2)
    devices = sorted({step[7] for step in rec.steps if step[0] == "direct"})
    if rec.stream is not None:
        if len(devices) != 1:
            raise _Unrecordable("a kept buffer without one device's launches")
        src.add(f"if _stream({devices[0]}) != {rec.stream} or _capturing():")
        src.add("return _DECLINED", 2)
    uses_inputs = jit or _reads_inputs(template)
    if uses_inputs:
        src.add("t = _tensors(args, kwargs)")
    live = _live(rec)
    returned: set[int] = set()
    _allocations_in(template, returned)
    carved = _workspace(src, rec, live, returned) if direct and not jit else set()

    def allocate(k: int, depth: int) -> None:
        size, stride, dtype, device, zero, table = rec.allocs[k]
        if table is not None:
            _table(src, rec, k, table, depth, direct)
        else:
            src.add(f"a{k} = {_allocation(src, size, stride, dtype, device)}", depth)
        if zero:
            src.add(f"a{k}.zero_()", depth)
        if direct:
            src.add(f"q{k} = a{k}.data_ptr()", depth)

    # The others are allocated before their first launch and, unless returned, dropped
    # after their last (as the full path's chunk loops free their temporaries); those no
    # launch uses, first.
    starts: dict[int, list[int]] = {}
    ends: dict[int, list[int]] = {}
    for k in range(len(rec.allocs)):
        if k in carved:
            continue
        if k not in live:
            allocate(k, 1)
            continue
        starts.setdefault(live[k][0], []).append(k)
        if k not in returned:
            ends.setdefault(live[k][1], []).append(k)
    depth = 1
    if jit:
        device = rec.roots["in"][0].device if rec.roots["in"] else torch.device("cpu")
        src.add(f"with _guard({src.name(device)}):")
        depth = 2
    for index in devices:
        src.add(f"s{index} = _stream({index})")
    for i, step in enumerate(rec.steps):
        for k in starts.get(i, ()):
            allocate(k, depth)
        if step[0] == "direct":
            _, binary, kernel, g, refs, scalars, tail, device_index, launcher, scratch = step
            values = [_pointer(src, rec, ref) for ref in refs]
            values += [_scalar_expr(src, v) for v in (*scalars, *tail)]
            head = f"{g[0]}, {g[1]}, {g[2]}, s{device_index}"
            if binary is not None:
                src.add(f"{src.name(binary, '_L')}({head}, {', '.join(values)})", depth)
            else:
                k = src.name(kernel, "_K")
                run = (f"{k}.run({head}, {k}.function, {k}.packed_metadata, None, None, None, "
                       f"{', '.join(values)})")
                if scratch:
                    src.add(f"with {_scratch_allocator(src, device_index)}:", depth)
                    src.add(run, depth + 1)
                else:
                    src.add(run, depth)
            # Still a direct launch of that launcher's binary (tests and tools count them).
            src.add(f"{src.name(launcher, '_D')}.launches += 1", depth)
        else:
            _, fn, grid, items, keywords = step
            values = [_scalar_expr(src, item[1]) if item[0] == "const" else _tensor(src, rec, item)
                      for item in items]
            src.add(f"{src.name(fn, '_J')}[{src.name(grid, '_G')}]({', '.join(values)}, "
                    f"**{src.name(keywords, '_W')})", depth)
        for k in ends.get(i, ()):
            src.add(f"del a{k}", depth)
    src.add("_recipe.calls += 1")
    src.add(f"return {_result(src, rec, template)}")
    source = "def replay(args, kwargs, p):\n" + "\n".join(src.lines) + "\n"
    namespace = dict(src.names)
    namespace["_kept"] = rec.roots["const"]  # alive while the recipe is
    exec(compile(source, "<portable_kernels replay>", "exec"), namespace)
    recipe = namespace["_recipe"] = Recipe(namespace["replay"], source)
    return recipe


#: Bytes between the allocations carved from one workspace: what torch's caching allocator
#: aligns blocks to, so that every address keeps the alignment it was recorded with.
_CARVE_ALIGN = 512


def _live(rec: _Recorder) -> dict[int, list[int]]:
    """Each allocation a launch uses: ``[first, last]``, the indices of the first and last
    step that launches on it (or on a view of it)."""
    live: dict[int, list[int]] = {}
    for i, step in enumerate(rec.steps):
        refs = step[4] if step[0] == "direct" else [item for item in step[3] if item[0] != "const"]
        for ref in refs:
            if ref[0] == "alloc":
                live.setdefault(ref[1], [i, i])[1] = i
    # An allocation a table holds the address of is live while the table is, and made
    # before it (the launches write it through the table).
    for k, alloc in enumerate(rec.allocs):
        if alloc[5] is None:
            continue
        if k not in live:
            raise _Unrecordable("a table no launch reads")
        first, last = live[k]
        for _, ref in alloc[5][3]:
            if ref[0] == "alloc":
                span = live.setdefault(ref[1], [first, last])
                span[0], span[1] = min(span[0], first), max(span[1], last)
    return live


def _workspace(src: _Source, rec: _Recorder, live: dict[int, list[int]],
               returned: set[int]) -> set[int]:
    """Carve the allocations that only launches use (not returned, not zero-filled) from
    one allocation: each ``torch.empty`` costs about as much host time as a launch (the
    norms' statistics rows, split-K partials, the decode split's partial outputs). Emits
    the workspace and the carved allocations' addresses; returns their indices.

    Two allocations whose launches do not interleave share bytes (:func:`_places`): the
    full path frees a chunk loop's temporaries as it goes (the fused loss's logits chunks),
    and the replay, which allocates up front, must not hold them all at once."""
    carve = [k for k, alloc in enumerate(rec.allocs)
             if k not in returned and not alloc[4] and alloc[5] is None]
    if len(carve) < 2 or len({rec.allocs[k][3] for k in carve}) != 1:
        return set()
    spans = []
    for k in carve:
        size, stride, dtype = rec.allocs[k][:3]
        span = 0 if 0 in size else 1 + sum((n - 1) * st for n, st in zip(size, stride))
        spans.append((k, -(-span * dtype.itemsize // _CARVE_ALIGN) * _CARVE_ALIGN,
                      *live.get(k, (-1, -1))))
    places, total = _places(spans)
    device = rec.allocs[carve[0]][3]
    src.add(f"w = {_allocation(src, (max(total, 1),), (1,), torch.uint8, device)}")
    src.add("qw = w.data_ptr()")
    for k, off in places:
        src.add(f"q{k} = qw + {off}" if off else f"q{k} = qw")
    return set(carve)


def _places(spans: list[tuple[int, int, int, int]]) -> tuple[list[tuple[int, int]], int]:
    """Byte offsets in one workspace for ``(allocation, bytes, first step, last step)``:
    each at the lowest offset where it overlaps no allocation whose steps overlap its own
    (the launches run in order on one stream, so memory whose last launch came before
    another's first can be that one's); ``([(allocation, offset)], workspace bytes)``."""
    placed: list[tuple[int, int, int, int]] = []  # (offset, end, first, last)
    out, total = [], 0
    for k, nbytes, first, last in spans:
        busy = sorted((o, e) for o, e, f, l in placed if f <= last and first <= l)
        offset = 0
        for o, e in busy:
            if offset + nbytes <= o:
                break
            offset = max(offset, e)
        placed.append((offset, offset + nbytes, first, last))
        out.append((k, offset))
        total = max(total, offset + nbytes)
    return out, total


def _allocations_in(template: tuple, found: set) -> None:
    kind, body = template
    if kind == "tensor":
        if body[0] == "alloc":
            found.add(body[1])
    elif kind != "const":
        for t in body:
            _allocations_in(t, found)


def _reads_inputs(template: tuple) -> bool:
    kind, body = template
    if kind == "tensor":
        return body[0] == "in"
    if kind == "const":
        return False
    return any(_reads_inputs(t) for t in body)


def _allocation(src: _Source, size: tuple, stride: tuple, dtype: torch.dtype,
                device: torch.device) -> str:
    """An expression allocating a new ``size``/``stride`` tensor of ``dtype`` on
    ``device``: through a bound ``new_empty_strided`` of an empty tensor of that dtype and
    device (no keywords to parse: 10-15% under ``torch.empty_strided``'s time on the CPU
    machine), or through :data:`ALLOCATE` where tests replace it."""
    if ALLOCATE is not torch.empty_strided:
        return (f"_empty_strided({src.name(size)}, {src.name(stride)}, dtype={src.name(dtype)}, "
                f"device={src.name(device)})")
    new = src.templates.get((dtype, device))
    if new is None:
        new = src.templates[dtype, device] = src.name(_allocator(dtype, device), "_N")
    return f"{new}({src.name(size)}, {src.name(stride)})"


#: (dtype, device) -> a bound ``new_empty_strided`` of an empty tensor of them.
_allocators: dict[tuple, Callable] = {}


def _allocator(dtype: torch.dtype, device: torch.device) -> Callable:
    """The bound ``new_empty_strided`` replays allocate ``dtype`` on ``device`` through,
    made once per process. Its empty tensor is the library's own: made where no dispatch
    mode sees it (a user's mode counting a call's allocations would count it once, when
    the call that records builds its recipe)."""
    new = _allocators.get((dtype, device))
    if new is None:
        with _disable_current_modes():
            new = _allocators[dtype, device] = torch.empty(0, dtype=dtype,
                                                           device=device).new_empty_strided
    return new


def _table(src: _Source, rec: _Recorder, k: int, table: tuple, depth: int,
           direct: bool) -> None:
    """Emit table step ``k``: the recorded values with the new call's addresses, built."""
    build, values, device, slots = table
    src.add(f"v{k} = {src.name(values, '_V')}.copy()", depth)
    for i, ref in slots:
        if direct or ref[0] != "alloc":
            address = _pointer(src, rec, ref)
        else:  # JIT recipes keep no addresses of their allocations
            address = f"a{ref[1]}.data_ptr()" + (f" + {ref[2]}" if ref[2] else "")
        src.add(f"v{k}[{i}] = {address}", depth)
    src.add(f"a{k} = {src.name(build, '_B')}(v{k}, {src.name(device)})", depth)


def _scalar_expr(src: _Source, value: Any) -> str:
    """An expression for a recorded scalar: a constant's name, or a per-call integer read
    from the call."""
    return value.expr if type(value) is _PerCall else src.name(value)


def _pointer(src: _Source, rec: _Recorder, ref: _Ref) -> str:
    kind, index, offset = ref[:3]
    if kind == "const":
        return src.name(rec.roots["const"][index].data_ptr() + offset)
    base = f"p[{index}]" if kind == "in" else f"q{index}"
    return base if offset == 0 else f"{base} + {offset}"


def _tensor(src: _Source, rec: _Recorder, ref: _Ref) -> str:
    """An expression for the tensor ``ref`` names (the root itself, or a view of it)."""
    kind, index, offset, size, stride, dtype = ref
    root = rec.roots[kind][index]
    base = {"in": f"t[{index}]", "alloc": f"a{index}", "const": src.name(root)}[kind]
    if (offset == 0 and size == tuple(root.shape) and stride == root.stride()
            and dtype == root.dtype):
        return base
    if dtype != root.dtype or offset % root.element_size():
        raise _Unrecordable("a view of another dtype")
    return (f"_as_strided({base}, {src.name(size)}, {src.name(stride)}, "
            f"{base}.storage_offset() + {offset // root.element_size()})")


def _result(src: _Source, rec: _Recorder, template: tuple) -> str:
    kind, body = template
    if kind == "tensor":
        return _tensor(src, rec, body)
    if kind == "const":
        return src.name(body)
    items = "".join(f"{_result(src, rec, t)}, " for t in body)
    if kind is tuple:
        return f"({items})"
    if kind is list:
        return f"[{items}]"
    return f"{src.name(kind, '_T')}._make(({items}))"  # a NamedTuple


class Replays:
    """One kernel's recipes, keyed by signature (see the module docstring). Lives on the
    plugin host; :meth:`clear` forgets them (``PluginHost.clear_caches``)."""

    __slots__ = ("kernel", "mode", "active", "recipes", "tries", "why", "current", "per_call",
                 "key", "resting", "misses", "hits")

    def __init__(self, kernel: str, per_call: dict[int, str] | None = None) -> None:
        self.kernel = kernel
        # The family's per-call integers (KernelSpec.runtime): position -> name.
        self.per_call = per_call or {}
        self.recipes: dict[tuple, Recipe | None] = {}  # None: the signature never replays
        self.tries: dict[tuple, int] = {}
        self.why: dict[tuple, str] = {}  # why a signature is not replayed
        self.clear()

    def clear(self) -> None:
        self.mode = mode()
        # Handles skip the signature where nothing can record: off, or direct launches only
        # where none can be made (no CUDA build of torch, PK_DIRECT_LAUNCH=0, a Triton whose
        # launchers are not verified), as on a CPU-only machine.
        self.active = self.mode == "all" or (self.mode == "direct"
                                             and _direct.supported("nvidia", False))
        self.recipes.clear()
        self.tries.clear()
        self.why.clear()
        self.resting = 0  # calls left to take the full path without a signature
        self.misses = 0  # calls that did not replay since the window began
        self.hits = 0  # the recipes' replays when it began
        # With several GPUs a launch's device is the current one: part of the signature.
        self.current = None
        if torch.cuda.is_available() and torch.cuda.device_count() > 1:
            self.current = torch._C._cuda_getDevice
        # key(args, kwargs, current): the signature's builder, the C one where it builds
        # (built only where replays are active).
        self.key = _signature.signature() if self.active else _signature.python_signature

    def signature(self, args: tuple, kwargs: dict) -> tuple[tuple, list] | None:
        """``(key, pointers)`` of a call, or None where it cannot replay (a gradient in
        play, an argument of another type than a tensor, a scalar, a tuple of scalars or a
        list of tensors): ``portable_kernels._signature``."""
        if RECORDING and recorder() is not None:
            return None  # a call inside a recorded one: its launches belong to that recipe
        if self.per_call:
            args, kwargs = self._widths(args, kwargs)
        return self.key(args, kwargs, self.current)

    def missed(self) -> None:
        """Count a call that computed its signature and did not replay; after
        :data:`MISS_WINDOW` of them with no replay between, rest (:data:`REST`)."""
        self.misses += 1
        if self.misses >= MISS_WINDOW:
            # Recipes count their own replays: their sum moved unless none ran.
            hits = sum(recipe.calls for recipe in self.recipes.values() if recipe is not None)
            if hits == self.hits:
                self.resting = REST
            self.hits, self.misses = hits, 0

    def _widths(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``args`` and ``kwargs`` with each per-call integer in [0, 2**63) replaced by its
        integer width's stand-in (0: int32, 2**40: int64), as direct launches key them:
        one recipe for every value. Others (negative, a bool, not an int) stay as they are,
        so the full path sees them and its checks speak."""
        args = list(args)
        for i, name in self.per_call.items():
            if i < len(args):
                args[i] = _width(args[i])
            elif name in kwargs:
                kwargs = {**kwargs, name: _width(kwargs[name])}
        return tuple(args), kwargs

    def _per_call_values(self, args: tuple, kwargs: dict) -> dict:
        """The call's per-call integers: value -> the recipe's expression for it (None where
        two share a value: a launch's could be either)."""
        found: dict = {}
        for i, name in self.per_call.items():
            expr, value = (f"args[{i}]", args[i]) if i < len(args) else \
                (f"kwargs[{name!r}]", kwargs.get(name))
            if type(value) is int:
                found[value] = None if value in found else expr
        return found

    def call(self, key: tuple, full: Callable[[tuple, dict], Any], args: tuple,
             kwargs: dict) -> Any:
        """``full(args, kwargs)``, the full path of a call of signature ``key`` that has no
        recipe yet, recorded where the signature was seen before."""
        tries = self.tries.get(key)
        if tries is None:  # the first call: it may compile and tune
            if len(self.tries) + len(self.recipes) >= MAX_KEYS and self.tries:
                # Make room: the signature seen longest ago (calls whose scalars change
                # every time, a decode step's length, would otherwise fill every slot).
                del self.tries[next(iter(self.tries))]
            if len(self.tries) + len(self.recipes) < MAX_KEYS:
                self.tries[key] = 0
            return full(args, kwargs)
        global RECORDING
        rec = _Recorder(_tensors(args, kwargs), self.mode,
                        self._per_call_values(args, kwargs) if self.per_call else None)
        _tls.recorder = rec
        with _recording_lock:  # never 0 while a thread records: its launches would go unseen
            RECORDING += 1
        try:
            with rec:
                out = full(args, kwargs)
        finally:
            with _recording_lock:
                RECORDING -= 1
            _tls.recorder = None
        failure = rec.failure
        if failure is None:
            try:
                self.recipes[key] = _build(rec, out)
                self.tries.pop(key, None)
                return out
            except _Unrecordable as exc:
                failure = exc
            except Exception as exc:  # a recipe that does not build: never the call's error
                failure = _Unrecordable(f"its recipe did not build ({type(exc).__name__}: {exc})")
        self.why[key] = str(failure)
        if failure.final or tries + 1 >= ATTEMPTS:
            self.recipes[key] = None
            self.tries.pop(key, None)
        else:
            self.tries[key] = tries + 1
        return out

    def explain(self, key: tuple) -> str:
        """What this kernel does with calls of signature ``key`` (for tests and debugging)."""
        recipe = self.recipes.get(key, False)
        if recipe is False:
            return f"seen {self.tries.get(key, 0)} time(s), not recorded"
        if recipe is None:
            return f"not replayed: {self.why.get(key, '?')}"
        return recipe.source


def _width(value: Any) -> Any:
    if type(value) is not int or not 0 <= value < 2**63:
        return value
    return 0 if value < 2**31 else 2**40


def stage(plan: Any, fn: Callable, static: tuple, *args: Any,
          per_call: dict[int, str] | None = None) -> Any:
    """``fn(plan, *args, *static)``: a forward or backward stage that a family's autograd
    ``Function`` runs, replayed per signature as handle calls are.

    A call that needs a gradient cannot replay at the handle (autograd must see it), and its
    backward is called by autograd, not through a handle: there the family's host code ran on
    every call (replaying it took a third off a small layer_norm's forward and backward on an
    H100 host, docs/performance.md). Inside the ``Function`` no gradient is recorded, so its stages
    replay like any call: one :class:`Replays` per plan and stage function, the signature
    being ``args``' (tensors, scalars) and ``static``'s (hashable values that decide the path
    with them, e.g. attention options without tensors). The plan's variant must opt in
    (``Variant.replay``), as for handles. ``per_call``: ``{position in args: name}`` of
    integers new on every call (a seed), replayed as ``KernelSpec.runtime`` says."""
    replays = plan.stage_replays(fn, per_call)
    if replays is None or not replays.active:
        return fn(plan, *args, *static)
    signature = replays.signature(args, {})
    if signature is None:
        return fn(plan, *args, *static)
    key = (static, signature[0])
    recipe = replays.recipes.get(key, UNSEEN)
    if recipe is UNSEEN:
        def full(args: tuple, kwargs: dict) -> Any:
            if RECORDING:
                note_plan(plan, None)  # the Function runs inside the call's launch guard
            return fn(plan, *args, *static)

        return replays.call(key, full, args, {})
    if recipe is not None:
        out = recipe.run(args, {}, signature[1])
        if out is not DECLINED:
            return out
    return fn(plan, *args, *static)
