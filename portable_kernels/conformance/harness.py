"""The conformance harness: cases generated from the registry, each run the same way.

A kernel's conformance file (``test_<kernel>.py``) declares a :class:`KernelSuite`: the shapes
to try (odd sizes, tails, strided views, ...), the dtypes, how to build inputs, the tolerance
kind from :data:`portable_kernels.testing.TOLERANCES`, and which arguments have gradients.
:func:`generate` turns it into :class:`Case` objects, one per registered variant x shape x
dtype x check (``forward``, and ``backward`` where the kernel has one), and
:meth:`CaseRun.check` runs each one:

1. build the inputs with a generator seeded from the case, so every variant, worker and
   device sees the same values;
2. ask dispatch whether the variant can run this problem on the device; if not, skip with
   dispatch's reason (the missing capability, or the variant's own predicate);
3. mark the case xfail when a plugin's ``pk_expected_failures`` lists it;
4. run the variant, forced with ``use_variant``, with poisoned allocations (uninitialized
   memory is NaN, so an output element a kernel forgets to write fails the case), timed;
5. compare with the kernel's float64 reference within the tolerance for the dtype, record
   the max error, and fail with the error against the tolerance when it is exceeded;
6. where later calls of a seen problem launch its compiled kernel directly (NVIDIA GPUs,
   ``portable_kernels/_direct.py``), call and compare twice more: the first call of a
   tuned problem tunes, the second keeps the binary, the third launches it directly
   (``--pk-repeat-calls N`` sets the number of calls after the first anywhere).

Results go into a plain dict per case (``Case.record``) that travels with pytest's reports
(also from pytest-xdist workers) to the plugin, which writes the report.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import os
import platform
import re
import time
import warnings
import zlib
from typing import Any, Callable, Iterator, Mapping, Sequence

import pytest
import torch

import portable_kernels as pk
from portable_kernels import __version__, _direct, dispatch, plugins, testing
from portable_kernels.errors import DTypeError, PluginError, VariantUnavailableError

__all__ = [
    "BACKWARD",
    "FORWARD",
    "Case",
    "CaseRun",
    "Inputs",
    "KernelSuite",
    "Session",
    "Shape",
    "environment",
    "generate",
    "place",
    "poisoned_allocations",
    "randn",
    "resolve_device",
    "uniform",
]

FORWARD = "forward"
BACKWARD = "backward"
DEFAULT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LAYOUTS = ("contiguous", "transposed", "gap", "padded")

# Shape ids and variant names end up in case ids ("generic-float16-n4097") and keys
# ("softmax/generic/float16/n4097/forward"), so they must not contain "-" or "/".
_SHAPE_ID = re.compile(r"^[A-Za-z0-9_.]+$")


def dtype_name(dtype: torch.dtype | None) -> str:
    """``torch.float16`` -> ``"float16"``."""
    return "-" if dtype is None else str(dtype).replace("torch.", "")


# --- what a kernel's conformance file declares -----------------------------------------------

class Shape:
    """One input configuration of a suite: an id for reports and parameters for the suite's
    ``make_inputs`` (``shape["size"]``, ``shape.get("layout", "contiguous")``).

    Args:
        id: short and unique in the suite, e.g. ``"n4097"`` or ``"transposed_33x65"``.
        quick: part of the ``--pk-quick`` subset (choose a few cheap shapes that still hit
            tails and strides).
        dtypes: restrict this shape to these dtypes (default: the suite's).
        backward: also check the backward for this shape (when the suite has one).
        **params: anything ``make_inputs`` reads.
    """

    __slots__ = ("id", "params", "quick", "dtypes", "backward")

    def __init__(self, id: str, *, quick: bool = False, dtypes: Sequence[torch.dtype] | None = None,
                 backward: bool = True, **params: Any) -> None:
        if not _SHAPE_ID.match(id):
            raise ValueError(f"shape id {id!r} may only hold letters, digits, '_' and '.'")
        self.id = id
        self.params = dict(params)
        self.quick = quick
        self.dtypes = tuple(dtypes) if dtypes is not None else None
        self.backward = backward

    def __getitem__(self, key: str) -> Any:
        return self.params[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.params.get(key, default)

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"Shape({self.id!r}{', ' if params else ''}{params})"


@dataclasses.dataclass(frozen=True)
class Inputs:
    """A call's arguments, as ``make_inputs`` builds them."""

    args: tuple
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def _plain_call(fn: Callable, inputs: Inputs) -> Any:
    return fn(*inputs.args, **inputs.kwargs)


@dataclasses.dataclass(frozen=True)
class KernelSuite:
    """How to test one kernel; a conformance file's ``SUITE``.

    Attributes:
        kernel: the kernel's registered name.
        shapes: the :class:`Shape` s to try.
        make_inputs: ``make_inputs(shape, dtype, device, generator) -> Inputs`` (or a tuple
            of positional args). Draw every random value from ``generator`` (a CPU generator)
            so that cases reproduce; :func:`randn` does, and builds strided layouts.
        tolerance: the kind in :data:`portable_kernels.testing.TOLERANCES` for outputs.
        dtypes: the input dtypes to try.
        quick_dtypes: the dtypes of the ``--pk-quick`` subset (default: ``dtypes``).
        grad_args: positions of the arguments whose gradients the backward check compares
            (skipped in a case where that argument is None: an optional tensor left out);
            empty when the kernel has no backward.
        grad_tolerance: the tolerance kind for gradients (default: ``tolerance``).
        arg_names: names of the positional arguments, for messages (``"dx"``).
        call: ``call(fn, inputs) -> output`` for kernels not called as ``fn(*args,
            **kwargs)``; used for the kernel and the reference alike.
        reference: overrides the kernel's registered ``KernelSpec.reference``.
        tolerance_for: ``tolerance_for(tol, name, ref, inputs, grad_outs) -> Tolerance``:
            the table's ``tol`` adjusted for one compared tensor (``name`` is ``"out"``,
            ``"out[i]"`` or ``"d<arg>"``; ``grad_outs`` the upstream gradients, or None
            forward), for values whose rounding error scales with something other than the
            value itself, e.g. gradients that are sums over a sequence. The base always
            comes from the one table.
        out_dtype: ``out_dtype(input dtype) -> output dtype`` for kernels whose outputs do
            not have their inputs' dtype (e.g. matmul's bf16 output of fp8 operands);
            default: the same dtype. Gradients are always expected in the input dtype.
    """

    kernel: str
    shapes: Sequence[Shape]
    make_inputs: Callable[..., Inputs | tuple]
    tolerance: str = "elementwise"
    dtypes: Sequence[torch.dtype] = DEFAULT_DTYPES
    quick_dtypes: Sequence[torch.dtype] | None = None
    grad_args: tuple[int, ...] = ()
    grad_tolerance: str | None = None
    arg_names: tuple[str, ...] = ()
    call: Callable[[Callable, Inputs], Any] = _plain_call
    reference: Callable[..., Any] | None = None
    tolerance_for: Callable[..., testing.Tolerance] | None = None
    out_dtype: Callable[[torch.dtype], torch.dtype] | None = None

    def __post_init__(self) -> None:
        ids = [s.id for s in self.shapes]
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise ValueError(f"{self.kernel} suite: duplicate shape ids {duplicates}")
        if not any(s.quick for s in self.shapes):
            raise ValueError(f"{self.kernel} suite: mark at least one shape quick=True")
        for kind in {self.tolerance, self.grad_tolerance or self.tolerance}:
            for dtype in self.dtypes:
                testing.tolerance(dtype, kind)  # a KeyError naming the gap in the table

    def arg_name(self, index: int) -> str:
        return self.arg_names[index] if index < len(self.arg_names) else f"arg{index}"


# --- cases --------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class Case:
    """One check: a variant of the suite's kernel on one shape and dtype, forward or backward.

    ``broken`` is set instead for a suite whose kernel is not registered at all (a plugin
    failed to load); such a case fails with that message.
    """

    suite: KernelSuite
    variant: str
    plugin: str
    dtype: torch.dtype | None
    shape: Shape | None
    check: str = FORWARD
    index: int = 0
    broken: str = ""

    @property
    def kernel(self) -> str:
        return self.suite.kernel

    @property
    def key(self) -> str:
        """``"<kernel>/<variant>/<dtype>/<shape>/<check>"``: what expected failures match."""
        shape = self.shape.id if self.shape else "-"
        return f"{self.kernel}/{self.variant}/{dtype_name(self.dtype)}/{shape}/{self.check}"

    @property
    def id(self) -> str:
        """The pytest id: ``"<variant>-<dtype>-<shape>"``, ``-bwd`` for backward checks."""
        if self.broken:
            return "unregistered"
        suffix = "-bwd" if self.check == BACKWARD else ""
        return f"{self.variant}-{dtype_name(self.dtype)}-{self.shape.id}{suffix}"

    @property
    def seed(self) -> int:
        # Independent of the variant and the check: every variant gets the same inputs.
        shape = self.shape.id if self.shape else "-"
        return zlib.crc32(f"{self.kernel}/{dtype_name(self.dtype)}/{shape}".encode())

    def record(self) -> dict:
        """The case's result as the report stores it (see docs/conformance-report.md), not
        yet run. It must stay JSON-friendly: pytest-xdist ships it from the workers."""
        return {
            "id": self.key,
            "kernel": self.kernel,
            "variant": self.variant,
            "plugin": self.plugin,
            "dtype": dtype_name(self.dtype),
            "shape": self.shape.id if self.shape else "-",
            "check": self.check,
            "outcome": None,
            "max_error": None,
            "error_ratio": None,
            "tolerance": None,
            "seconds": None,
            "duration": None,
            "reason": "",
            "expected": None,
            "index": self.index,
        }


def _selected(name: str, patterns: Sequence[str] | None) -> bool:
    return not patterns or any(fnmatch.fnmatchcase(name, p) for p in patterns)


def generate(
    suite: KernelSuite,
    *,
    quick: bool = False,
    backend: str | None = None,
    variants: Sequence[str] | None = None,
) -> list[Case]:
    """The cases of ``suite``: every registered variant (those of plugin ``backend`` only,
    and matching one of the ``variants`` globs, when given) x shape x dtype x check.

    Every registered variant yields cases, including those the device cannot run (they
    skip, saying why), so that case ids are the same on every device and every worker.
    """
    registry = plugins.host().registry
    if suite.kernel not in registry.kernels:
        failures = "; ".join(f"{f.plugin} ({f.stage}: {f.error})" for f in plugins.host().failures)
        why = f"kernel {suite.kernel!r} is not registered" + (
            f"; failed plugins: {failures}" if failures else "")
        return [Case(suite, "-", "", None, None, broken=why)]
    cases: list[Case] = []
    for name in sorted(registry.variants[suite.kernel]):
        variant = registry.variants[suite.kernel][name]
        if backend and variant.plugin != backend:
            continue
        if not _selected(name, variants):
            continue
        for shape in suite.shapes:
            if quick and not shape.quick:
                continue
            dtypes = (suite.quick_dtypes or suite.dtypes) if quick else suite.dtypes
            for dtype in dtypes:
                if shape.dtypes is not None and dtype not in shape.dtypes:
                    continue
                cases.append(Case(suite, name, variant.plugin, dtype, shape, FORWARD, len(cases)))
                if suite.grad_args and shape.backward:
                    cases.append(Case(suite, name, variant.plugin, dtype, shape, BACKWARD, len(cases)))
    return cases


# --- inputs -------------------------------------------------------------------------------------

def randn(
    size: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    generator: torch.Generator,
    *,
    layout: str = "contiguous",
    scale: float = 1.0,
    offset: float = 0.0,
) -> torch.Tensor:
    """Normal values (``offset + scale * N(0, 1)``, drawn in fp32 on the CPU from
    ``generator``, then rounded to ``dtype``) laid out in memory as ``layout``:

    - ``"contiguous"``;
    - ``"transposed"``: the last two dimensions swapped in memory (column-major);
    - ``"gap"``: every other element of a NaN-filled buffer along the last dimension
      (stride 2), so a kernel that reads between the elements gets NaN;
    - ``"padded"``: rows of a NaN-filled buffer 5 elements wider (row stride n + 5,
      contiguous within a row), so a kernel that reads past a row's end gets NaN.
    """
    size = tuple(int(s) for s in size)
    values = torch.randn(size, generator=generator, dtype=torch.float32) * scale + offset
    return place(values.to(dtype), device, layout)


def uniform(
    size: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    generator: torch.Generator,
    *,
    low: float = -1.0,
    high: float = 1.0,
    layout: str = "contiguous",
) -> torch.Tensor:
    """Uniform values in [low, high) (drawn in fp32 from ``generator``, rounded to ``dtype``),
    laid out as ``layout`` (see :func:`randn`)."""
    size = tuple(int(s) for s in size)
    values = torch.rand(size, generator=generator, dtype=torch.float32) * (high - low) + low
    return place(values.to(dtype), device, layout)


def place(values: torch.Tensor, device: torch.device, layout: str = "contiguous") -> torch.Tensor:
    """``values`` on ``device`` with the memory layout ``layout`` (see :func:`randn`)."""
    if layout == "contiguous":
        return values.to(device)
    if not values.dim():
        raise ValueError(f"layout {layout!r} needs at least one dimension")
    if layout == "transposed":
        if values.dim() < 2:
            raise ValueError("layout 'transposed' needs at least two dimensions")
        return values.transpose(-1, -2).contiguous().to(device).transpose(-1, -2)
    size = tuple(values.shape)
    if layout == "gap":
        base = torch.full((*size[:-1], 2 * size[-1]), float("nan"), dtype=values.dtype, device=device)
        view = base[..., ::2]
    elif layout == "padded":
        base = torch.full((*size[:-1], size[-1] + 5), float("nan"), dtype=values.dtype, device=device)
        view = base[..., : size[-1]]
    else:
        raise ValueError(f"unknown layout {layout!r}; known: {', '.join(LAYOUTS)}")
    view.copy_(values.to(device))
    return view


@contextlib.contextmanager
def poisoned_allocations() -> Iterator[None]:
    """Inside the block, memory that torch allocates uninitialized (``torch.empty`` and
    friends, including the outputs launchers allocate) is filled with NaN (integers: their
    maximum), so output elements a kernel forgets to write show up as errors.

    It uses torch's deterministic mode (``fill_uninitialized_memory``) in warn-only form:
    nothing refuses to run, and the warnings about nondeterministic ops are silenced.
    """
    det = torch.utils.deterministic
    was = torch.are_deterministic_algorithms_enabled()
    was_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    was_fill = det.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    det.fill_uninitialized_memory = True
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*deterministic.*")
            yield
    finally:
        det.fill_uninitialized_memory = was_fill
        torch.use_deterministic_algorithms(was, warn_only=was_warn)


def synchronize(device: torch.device) -> None:
    """Wait for the device (so that timings cover the kernels, not their launch)."""
    if device.type == "cpu":
        return
    mod = getattr(torch, device.type, None)
    if mod is not None and hasattr(mod, "synchronize"):
        mod.synchronize(device)


# --- the device under test ----------------------------------------------------------------------

def check_device(option: str | None) -> torch.device:
    """``option`` as a ``torch.device`` (default: the GPU when torch sees one, else the
    CPU), or ``DeviceError`` naming it when it is no device name or torch sees no such
    device here (an index past the count included). Changes nothing."""
    name = option or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        raise pk.DeviceError(f"--pk-device {name}: not a device name ({exc})") from None
    if device.type == "cpu" and device.index not in (None, 0):
        raise pk.DeviceError(f"--pk-device {name}: the CPU has no index but 0")
    mod = getattr(torch, device.type, None)
    if device.type == "cpu" or mod is None or not hasattr(mod, "device_count"):
        return device
    count = mod.device_count()
    if count == 0:
        raise pk.DeviceError(f"--pk-device {name}: torch sees no {device.type} device here")
    if device.index is not None and device.index >= count:
        raise pk.DeviceError(f"--pk-device {name}: torch sees {count} {device.type} device(s) here")
    return device


def resolve_device(option: str | None) -> torch.device:
    """The device to test: ``option`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``), by default the
    GPU when torch sees one, else the CPU.

    Without an index, a pytest-xdist worker takes the GPU of its worker number modulo the
    GPU count (``gw0`` -> ``cuda:0``, ``gw1`` -> ``cuda:1``, ...): ``-n <number of GPUs>``
    runs one worker per GPU. The device is made current for the worker.
    """
    device = check_device(option)
    mod = getattr(torch, device.type, None)
    if device.type == "cpu" or mod is None or not hasattr(mod, "device_count"):
        return device
    count = mod.device_count()
    if device.index is None:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "")
        index = int(worker[2:]) % count if worker[2:].isdigit() else mod.current_device()
        device = torch.device(device.type, index)
    if hasattr(mod, "set_device"):
        mod.set_device(device)
    return device


def expected_failures(info: pk.DeviceInfo) -> list[testing.ExpectedFailure]:
    """What the plugins' ``pk_expected_failures`` hooks declare for ``info``."""
    entries: list[testing.ExpectedFailure] = []
    for answer in plugins.host().call("pk_expected_failures", device=info):
        for entry in answer:
            if isinstance(entry, testing.ExpectedFailure):
                entries.append(entry)
            elif isinstance(entry, (tuple, list)) and len(entry) == 2 and all(isinstance(e, str) for e in entry):
                entries.append(testing.ExpectedFailure(*entry))
            else:
                raise PluginError(
                    f"pk_expected_failures returned {entry!r}; expected ExpectedFailure(pattern, "
                    "reason) or a (pattern, reason) pair of strings"
                )
    return entries


def environment(torch_device: torch.device | None) -> dict:
    """What a report says about where it ran: device, versions, plugins."""
    import triton

    host = plugins.host()
    env: dict = {
        "torch_device": None if torch_device is None else str(torch_device),
        "device": None,
        "device_error": None,
        "versions": {
            "portable_kernels": __version__,
            "triton": triton.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "plugins": [{"name": n, "source": getattr(host, "sources", {}).get(n, "")}
                    for n in host.plugin_names()],
        "failed_plugins": [f.to_dict() for f in host.failures],
    }
    if torch_device is not None:
        try:
            env["device"] = pk.device_info(torch_device).to_dict()
        except pk.PortableKernelsError as exc:
            env["device_error"] = str(exc)
    return env


class Session:
    """The device under test and what the plugins say about it, shared by a worker's cases.

    A device that cannot be used (no GPU, compiled Triton with CPU tensors) does not raise
    here: ``error`` says why, and every case fails with it.
    """

    def __init__(self, device_option: str | None, repeat_calls: int | None = None) -> None:
        self.torch_device: torch.device | None = None
        self.info: pk.DeviceInfo | None = None
        self.expected: list[testing.ExpectedFailure] = []
        self.error = ""
        # Checked calls after the first (step 6 of the module docstring); None: automatic.
        self.repeat_calls = repeat_calls or 0
        try:
            self.torch_device = resolve_device(device_option)
            self.info = pk.device_info(self.torch_device)
            self.expected = expected_failures(self.info)
            if repeat_calls is None and _direct.supported(
                    self.info.vendor, "interpreter" in self.info.capabilities):
                self.repeat_calls = 2
        except (pk.PortableKernelsError, RuntimeError, ValueError) as exc:
            self.error = f"device {device_option or 'default'} cannot run the suite: {_one_line(exc)}"

    def expected_failure(self, key: str) -> testing.ExpectedFailure | None:
        return next((e for e in self.expected if e.matches(key)), None)


# --- running one case -----------------------------------------------------------------------------

def _one_line(exc: BaseException, limit: int = 400) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    if not isinstance(exc, AssertionError):
        text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _flatten(value: Any) -> list:
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flatten(v)]
    return [value]


_UNAVAILABLE = re.compile(r"cannot run on .+?: (.+)$", re.S)


class CaseRun:
    """One case bound to its pytest item; the ``pk_case`` fixture hands it to the test."""

    def __init__(self, case: Case, session: Session, record: dict, node: pytest.Item) -> None:
        self.case = case
        self.session = session
        self.record = record
        self.node = node

    # The pieces ---------------------------------------------------------------------------

    def _fail(self, message: str) -> None:
        self.record["reason"] = message
        pytest.fail(message, pytrace=False)

    def _skip(self, message: str) -> None:
        self.record["reason"] = message
        pytest.skip(message)

    def _unavailable(self, inputs: Inputs) -> str | None:
        """Why the variant cannot run these inputs on this device, per dispatch, or None."""
        case = self.case
        spec = plugins.host().registry.spec(case.kernel)
        problem = spec.problem(*inputs.args, **inputs.kwargs)
        try:
            with pk.use_variant(**{case.kernel: case.variant}):
                selection = dispatch.select(case.kernel, problem, problem.device)
        except VariantUnavailableError as exc:
            found = _UNAVAILABLE.search(str(exc))
            return found.group(1) if found else str(exc)
        except DTypeError as exc:  # a dtype of the other fp8 encoding than this device's
            return str(exc)
        variant = plugins.host().registry.variants[case.kernel][case.variant]
        missing = variant.missing(selection.executor)
        if missing:  # while emulating: selection saw the profile, this device executes
            return (f"requires {', '.join(sorted(missing))}, which the executing device "
                    f"{selection.executor.name} lacks")
        return None

    def _reference(self) -> Callable:
        ref = self.case.suite.reference or plugins.host().registry.spec(self.case.kernel).reference
        if ref is None:
            self._fail(f"kernel {self.case.kernel!r} registers no reference and its suite gives none")
        return ref

    def _timed(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        device = self.session.torch_device
        with pk.use_variant(**{self.case.kernel: self.case.variant}), poisoned_allocations():
            synchronize(device)
            start = time.perf_counter()
            out = fn()
            synchronize(device)
        return out, time.perf_counter() - start

    def _forward(self, inputs: Inputs) -> tuple:
        suite = self.case.suite
        kernel = pk.get_kernel(self.case.kernel)
        out, seconds = self._timed(lambda: suite.call(kernel, inputs))
        ref = suite.call(self._reference(), inputs)
        outs, refs = _flatten(out), _flatten(ref)
        names = ["out"] if len(outs) == 1 else [f"out[{i}]" for i in range(len(outs))]
        if len(outs) != len(refs):
            self._fail(f"returned {len(outs)} tensors, the reference {len(refs)}")
        return names, outs, refs, seconds, None

    def _backward(self, inputs: Inputs, gen: torch.Generator) -> tuple:
        suite = self.case.suite
        kernel = pk.get_kernel(self.case.kernel)
        args = list(inputs.args)
        # An optional tensor argument left out (None, e.g. a bias) has no gradient to check.
        grad_args = [i for i in suite.grad_args if inputs.args[i] is not None]
        for i in grad_args:
            # detach() keeps the strides, so strided layouts stay strided.
            args[i] = args[i].detach().requires_grad_(True)
        leaves = [args[i] for i in grad_args]
        grad_inputs = Inputs(tuple(args), inputs.kwargs)
        outs, forward_s = self._timed(lambda: _flatten(suite.call(kernel, grad_inputs)))
        grad_outs = [randn(o.shape, o.dtype, o.device, gen) for o in outs]
        grads, backward_s = self._timed(
            lambda: list(torch.autograd.grad(outs, leaves, grad_outs, allow_unused=True)))
        seconds = forward_s + backward_s
        args64 = list(inputs.args)
        for i in grad_args:
            args64[i] = inputs.args[i].detach().to(torch.float64).requires_grad_(True)
        leaves64 = [args64[i] for i in grad_args]
        refs_out = _flatten(suite.call(self._reference(), Inputs(tuple(args64), inputs.kwargs)))
        refs = torch.autograd.grad(refs_out, leaves64, [g.to(torch.float64) for g in grad_outs],
                                   allow_unused=True)
        names = [f"d{suite.arg_name(i)}" for i in grad_args]
        for name, g, r in zip(names, grads, refs):
            if g is None and r is not None:
                self._fail(f"{name}: the kernel's backward returned no gradient")
        pairs = [(n, g, r) for n, g, r in zip(names, grads, refs) if r is not None]
        names, outs, refs = ([p[i] for p in pairs] for i in range(3))
        return names, outs, refs, seconds, grad_outs

    def _compare(self, names: list, outs: list, refs: list, table: testing.Tolerance, kind: str,
                 inputs: Inputs, grad_outs: list | None, call: int = 1) -> None:
        """Fail on the first output outside its tolerance; record the worst error of the
        first ``call`` (later calls only fail, their messages naming the call)."""
        case, adjust = self.case, self.case.suite.tolerance_for
        rec = self.record if call == 1 else {}
        where = "" if call == 1 else f"call {call}: "
        # Gradients have their inputs' dtype whatever the outputs' (cross_entropy: an fp32
        # loss of fp16 logits).
        expected_dtype = (case.dtype if case.suite.out_dtype is None or case.check == BACKWARD
                          else case.suite.out_dtype(case.dtype))
        worst = (0.0, 0.0, "", table)
        for name, out, ref in zip(names, outs, refs):
            if not isinstance(out, torch.Tensor):
                self._fail(f"{where}{name} is a {type(out).__name__}, not a tensor")
            if tuple(out.shape) != tuple(ref.shape):
                self._fail(f"{where}{name} has shape {tuple(out.shape)}, the reference {tuple(ref.shape)}")
            if out.dtype != expected_dtype:
                self._fail(f"{where}{name} has dtype {dtype_name(out.dtype)}, expected {dtype_name(expected_dtype)}")
            if out.device != self.session.torch_device:
                self._fail(f"{where}{name} is on {out.device}, the inputs on {self.session.torch_device}")
            tol = table if adjust is None else adjust(table, name, ref, inputs, grad_outs)
            err, ratio = testing.max_error(out, ref, tol)
            if ratio > worst[1] or not ratio <= 1.0:
                worst = (err, ratio, name, tol)
            if not ratio <= 1.0:
                break
        err, ratio, name, tol = worst
        rec["max_error"] = _finite(err)
        rec["error_ratio"] = _finite(ratio)
        rec["tolerance"] = {"kind": kind, "atol": tol.atol, "rtol": tol.rtol}
        if tol != table:  # adjusted by the suite: keep the table's values too
            rec["tolerance"]["table"] = {"atol": table.atol, "rtol": table.rtol}
        if not ratio <= 1.0:
            out = dict(zip(names, outs))[name].detach().to(torch.float64)
            ref = dict(zip(names, refs))[name].detach().to(torch.float64)
            bad = int((~torch.isfinite(out) & torch.isfinite(ref)).sum())
            if bad:
                self._fail(f"{where}{name}: {bad} of {out.numel()} element(s) NaN or inf where the "
                           "reference is finite (an output element never written, or a read outside "
                           "the input)")
            self._fail(f"{where}{name}: max abs error {err:.3g} exceeds the {kind} tolerance for "
                       f"{dtype_name(case.dtype)} ({tol}): {ratio:.3g}x the allowed error")

    # The test body -------------------------------------------------------------------------

    def check(self) -> None:
        """Run the case; skip, fail or pass as the module docstring describes."""
        case, rec, session = self.case, self.record, self.session
        if case.broken:
            self._fail(case.broken)
        if session.error:
            self._fail(session.error)
        suite = case.suite
        gen = torch.Generator().manual_seed(case.seed)
        inputs = suite.make_inputs(case.shape, case.dtype, session.torch_device, gen)
        if not isinstance(inputs, Inputs):
            inputs = Inputs(tuple(inputs))
        reason = self._unavailable(inputs)
        if reason:
            self._skip(reason)
        expected = session.expected_failure(case.key)
        if expected is not None:
            rec["expected"] = expected.reason
            self.node.add_marker(pytest.mark.xfail(reason=expected.reason, strict=False))
        kind = suite.tolerance if case.check == FORWARD else (suite.grad_tolerance or suite.tolerance)
        table = testing.tolerance(case.dtype, kind)
        rec["tolerance"] = {"kind": kind, "atol": table.atol, "rtol": table.rtol}
        for call in range(1, 2 + session.repeat_calls):
            try:
                if case.check == FORWARD:
                    names, outs, refs, seconds, grad_outs = self._forward(inputs)
                else:
                    names, outs, refs, seconds, grad_outs = self._backward(inputs, gen)
            except VariantUnavailableError as exc:  # raised at launch, e.g. while emulating
                self._skip(str(exc))
            except (pytest.fail.Exception, pytest.skip.Exception):
                raise
            except Exception as exc:
                rec["reason"] = (f"call {call}: " if call > 1 else "") + _one_line(exc)
                raise
            rec["calls"] = call
            if call == 1:
                rec["seconds"] = round(seconds, 6)
            self._compare(names, outs, refs, table, kind, inputs, grad_outs, call)


def _finite(x: float) -> float | None:
    # JSON has no inf/NaN; None in the report means "not a number" (see the format doc).
    return x if x == x and abs(x) != float("inf") else None

