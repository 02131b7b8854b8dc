"""What a family's host launcher receives: the chosen variant's switches and configs.

A :class:`LaunchPlan` is built once per (kernel, variant, executing device) and cached, so
autotuning results and compiled kernels are shared by every call that selects the same
variant on the same device.
"""
from __future__ import annotations

import copy
import threading
from typing import Any, Callable, Mapping, Sequence

import torch
import triton
import triton.testing

from . import _direct, _interpreter, _replay, tuning_cache
from . import _autotuner
from .device import DeviceInfo
from .registry import Variant

__all__ = ["LaunchPlan", "device_guard", "launch_guard"]


_MISSING = object()
# Device type -> the function reading its current index, or None where no launch needs a
# guard: types without a current device (the CPU, meta), and machines with one device of the
# type, where a tensor's device is always the current one.
_current_index: dict[str, Callable[[], int] | None] = {}


def _index_reader(device_type: str) -> Callable[[], int] | None:
    mod = getattr(torch, device_type, None)
    if mod is None or not all(hasattr(mod, f) for f in ("current_device", "device", "device_count")):
        return None
    if mod.device_count() < 2:
        return None
    if device_type == "cuda" and hasattr(torch._C, "_cuda_getDevice"):
        return torch._C._cuda_getDevice  # a C call; torch.cuda.current_device wraps it
    return mod.current_device


def device_guard(device: torch.device) -> Any:
    """A context manager that makes ``device`` current for a launch, or None when it already
    is (or its type has no current device, as the CPU).

    Triton compiles for and launches on the *current* device and stream, not on its
    arguments' device: a call whose tensors live on ``cuda:1`` while ``cuda:0`` is current
    would launch on device 0. Seen on two H200s with triton 3.6: without peer access between
    them Triton refuses the pointers ("cpu tensor?"); with it (torch enables it at the first
    copy between them) the kernel runs on device 0 over NVLink, unordered with device 1's
    stream. Torch's own operators switch devices the same way. With one device of the type
    the check is a dict lookup; with several, one C call more (the handle call measured
    0.3-0.4 µs slower, within noise) and, where the device is not current, a switch there
    and back (2-9 µs).
    """
    current = _current_index.get(device.type, _MISSING)
    if current is _MISSING:
        current = _current_index[device.type] = _index_reader(device.type)
    if current is None or device.index is None or current() == device.index:
        return None
    return getattr(torch, device.type).device(device.index)


def launch_guard(device: torch.device) -> Any:
    """What a launch on ``device`` must run inside, or None: :func:`device_guard` on GPUs,
    and on the CPU (Triton's interpreter) the interpreter's lock and quiet numpy
    (``_interpreter.Serialized``). Every launch path (kernel handles, the ops' stages)
    takes it, so calls from several threads work on every backend."""
    if device.type == "cpu":
        return _interpreter.Serialized()
    return device_guard(device)


def _graph_replays(fn: Callable[[], None], quantiles: Any = None, rep_ms: float = 20.0) -> Any:
    """``fn``'s time in ms (or its ``quantiles``), from replays of a CUDA graph of repeated
    calls captured on a new stream of the current device. As
    ``triton.testing.do_bench_cudagraph``, except that the capture names its stream: without
    one, ``torch.cuda.graph`` captures on a stream torch creates once per process, on the
    device current at the first capture, and switches to that device. A process that tuned
    on ``cuda:0`` then captured a ``cuda:1`` launch on device 0's stream (seen on two
    H200s: Triton then refused the ``cuda:1`` pointers)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            fn()
        end.record()
        torch.cuda.synchronize()
        estimate = start.elapsed_time(end) / 5
        repeat = max(1, int(rep_ms / estimate)) if estimate > 0 else 1000
        graph = torch.cuda.CUDAGraph()
        # thread_local: in the default (global) mode, a capture makes every other thread's
        # launch or allocation fail ("operation not permitted when stream is capturing"), so
        # a call tuning in one thread broke calls running in others.
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            for _ in range(repeat):
                fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(10):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / repeat)
    if quantiles is None:
        return sum(times) / len(times)
    ret = torch.quantile(torch.tensor(times), torch.tensor(quantiles, dtype=torch.float)).tolist()
    return ret[0] if len(ret) == 1 else ret


def _bench_replayed(kernel_call: Callable[[], None], quantiles: Any = None) -> Any:
    """The autotuner's timer: replays of a captured graph, so that a config's time is its
    kernel's, not the host's launch path. Triton's default, ``do_bench``, times launches
    one after another; a decode-sized GEMM takes less GPU time than its launch takes on the
    host, so configs were ranked by launch-path noise (seen on the H200: a 16x4096x4096
    bf16 product tuned to a 25 µs config over a 16 µs one). Falls back to
    ``do_bench`` where graph capture fails. Compile errors surface from the first call, as
    the autotuner expects."""
    kernel_call()
    try:
        # The replays' first calls run on a new stream, not ordered after this launch: they
        # would overlap it on the arguments both use (split-K counters, which an
        # overlapping launch can leave non-zero for every later call).
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return _graph_replays(kernel_call, quantiles=quantiles)
    except RuntimeError:
        return triton.testing.do_bench(kernel_call, quantiles=quantiles)


class LaunchPlan:
    """The variant chosen for a device, ready to launch.

    Attributes:
        variant: the :class:`Variant`.
        device: the ``DeviceInfo`` of the device that executes (never an emulated one).
        configs: the ``triton.Config`` list for this variant on this device.
        switches: the constexpr switches to pass to the family's kernels.
        launch: ``variant.launch``, bound here so that the hot path is one attribute read.
        binary_launcher: the backend's ``pk_binary_launcher`` answer for the device (``make``
            of a compiled kernel), used by direct launches; ``None`` keeps Triton's launcher.
    """

    __slots__ = ("variant", "device", "configs", "switches", "launch", "binary_launcher",
                 "_tuned", "_chosen", "_lock")

    def __init__(
        self,
        variant: Variant,
        device: DeviceInfo,
        configs: Sequence[triton.Config],
        switches: Mapping[str, Any],
        binary_launcher: Callable[[Any], Any] | None = None,
    ) -> None:
        self.variant = variant
        self.binary_launcher = binary_launcher
        self.device = device
        self.configs = list(configs)
        self.switches = dict(switches)
        self.launch = variant.launch
        self._tuned: dict[Any, Any] = {}
        self._chosen: dict[Any, Any] = {}
        self._lock = threading.Lock()

    @property
    def config(self) -> triton.Config:
        """The first config, for launchers that size blocks themselves instead of tuning."""
        if not self.configs:
            raise LookupError(
                f"{self.variant.kernel}/{self.variant.name}: no tuning configs for "
                f"{self.device.name}; a backend's pk_tuning_configs or the variant's "
                "configs must supply at least one"
            )
        return self.configs[0]

    def autotuned(self, fn: Any, key: Sequence[str], config_pre_hook: Callable[[dict], None] | None = None,
                  configs: Sequence[triton.Config] | None = None, name: str = "",
                  **autotune_kwargs: Any) -> Any:
        """``fn`` (a ``@triton.jit`` kernel) wrapped in ``triton.autotune`` over this plan's
        configs, keyed on the argument names ``key``. Built once per plan and kernel.
        Results persist per device fingerprint across processes (see ``tuning_cache``).

        ``autotune_kwargs`` go to ``triton.autotune`` (``prune_configs_by``,
        ``reset_to_zero``, ...). With a single config no benchmarking happens, which is
        what the interpreter needs. ``config_pre_hook(nargs)`` is set as every config's
        ``pre_hook``: it runs before each launch with the chosen config (e.g. to size host
        tensor descriptors' block shapes to the config's blocks). ``configs`` replaces the
        plan's own list, for launchers that derive the kernel's configs from the plan's (e.g.
        without the keys the launcher reads itself); like the rest, fixed at the first call.
        ``name`` tells apart several autotuners of one kernel (e.g. over the configs for
        another operand size); each persists its results under its own entry.
        """
        memo = (fn, name) if name else fn
        tuned = self._tuned.get(memo)
        if tuned is None:
            with self._lock:
                tuned = self._tuned.get(memo)
                if tuned is None:
                    _ = self.config  # clear error when there are none
                    configs = self.configs if configs is None else list(configs)
                    if config_pre_hook is not None:
                        configs = [copy.copy(c) for c in configs]
                        for c in configs:
                            c.pre_hook = config_pre_hook
                    if "interpreter" not in self.device.capabilities:
                        autotune_kwargs.setdefault("do_bench", _bench_replayed)
                    tuned = _autotuner.adopt(
                        triton.autotune(configs=configs, key=list(key), **autotune_kwargs)(fn))
                    # Near-ties timed again before a pick is kept (compiled kernels only).
                    tuned.confirm_ties = len(configs) > 1 and "interpreter" not in self.device.capabilities
                    fn_name = getattr(fn, "__name__", None) or fn.fn.__name__
                    entry = f"{self.variant.kernel}/{self.variant.name}/{fn_name}"
                    if name:
                        entry += f":{name}"
                    tuned = tuning_cache.attach(tuned, self.device.fingerprint, entry)
                    self._tuned[memo] = tuned
        return tuned

    def run_tuned(self, tuned: Any, problem_key: Any, grid: Any, *args: Any, **kwargs: Any) -> None:
        """Launch ``tuned`` (from :meth:`autotuned`) on ``grid``; once it has chosen a config
        for ``problem_key``, launch the JIT kernel with that config directly, and on NVIDIA
        GPUs its compiled binary (``_direct``: Triton's per-call dispatch costs more host
        time than a decode-sized kernel takes).

        Triton's ``Autotuner.run`` rebuilds its key from every argument on each call (about
        7 µs of host time, as much as a decode-sized GEMM takes on the GPU). ``problem_key``
        must determine the autotuner's key: every ``key`` argument and the dtype of every
        tensor argument. Positional arguments are tensors first, then scalars. Configs with
        a ``pre_hook`` always go through the autotuner.
        """
        chosen = self._chosen.get((tuned, problem_key))
        if chosen is not None:
            chosen(grid, args, kwargs)
            return
        if _replay.RECORDING:
            _replay.unrecordable("an autotuner launch", final=False)
        tuned[grid](*args, **kwargs)
        config = getattr(tuned, "best_config", None)
        if config is not None and config.pre_hook is None:
            self._chosen[(tuned, problem_key)] = _direct.DirectLaunch(
                tuned.fn, config.all_kwargs(), self._direct_launches(), self.binary_launcher)

    def direct(self, fn: Any, runtime: tuple[int, ...] = ()) -> _direct.DirectLaunch:
        """``fn`` (a ``@triton.jit`` kernel) for launchers that pass its config themselves:
        ``plan.direct(fn)[grid](*args, **kwargs)`` launches as ``fn[grid](...)`` does, and
        on NVIDIA GPUs reuses each binary Triton compiled for a call (see ``_direct``).
        ``runtime``: positions of integer arguments new on every call, which ``fn`` must
        not specialize on (``DirectLaunch``)."""
        launcher = self._tuned.get(("direct", fn))
        if launcher is None:
            launcher = self._tuned[("direct", fn)] = _direct.DirectLaunch(
                fn, {}, self._direct_launches(), self.binary_launcher, runtime)
        return launcher

    def _direct_launches(self) -> bool:
        return _direct.supported(self.device.vendor, "interpreter" in self.device.capabilities)

    def chosen(self, tuned: Any, problem_key: Any) -> dict[str, Any] | None:
        """The config keywords :meth:`run_tuned` launches ``problem_key`` with once it is
        tuned (``None`` before, or for configs with a ``pre_hook``), so that a launcher can
        size per-call buffers for the config that runs rather than for every candidate."""
        chosen = self._chosen.get((tuned, problem_key))
        return None if chosen is None else chosen.config

    def stage_replays(self, fn: Any, per_call: dict[int, str] | None = None) -> Any:
        """The :class:`~portable_kernels._replay.Replays` of stage ``fn`` on this plan
        (``_replay.stage``; ``per_call`` its per-call integers), or None where the variant
        does not replay."""
        if not self.variant.replay:
            return None
        replays = self._tuned.get(("stage", fn))
        if replays is None:
            name = f"{self.variant.kernel}:{getattr(fn, '__name__', 'stage')}"
            replays = self._tuned[("stage", fn)] = _replay.Replays(name, per_call)
        return replays

    def cached(self, key: Any, build: Callable[[], Any]) -> Any:
        """A per-plan memo for launchers (e.g. block sizes derived from the config)."""
        value = self._tuned.get(key)
        if value is None:
            value = self._tuned[key] = build()
        if _replay.RECORDING:
            _replay.note_constant(value)
        return value

    def __repr__(self) -> str:
        return (
            f"LaunchPlan({self.variant.kernel}/{self.variant.name} on {self.device.name}, "
            f"{len(self.configs)} config(s), switches={self.switches})"
        )
