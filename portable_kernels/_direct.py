"""Launching a tuned kernel's compiled binary without Triton's per-call JIT dispatch.

Once a plan has tuned a problem, every call launches the same kernel with the same config.
Triton's ``JITFunction.run`` still works out on each call what its arguments specialize to
(types, 16-byte alignment of pointers, integers equal to 1 or divisible by 16), looks the
binary up, reads its knobs and builds launch metadata for hooks. On the H200 host that cost
14 µs per call (``kernel[grid](...)`` 24.3 µs against 10.2 µs for the binary's own
launcher, 16x4096x4096 bf16, triton 3.6), more than the kernel itself (10 µs).

:class:`DirectLaunch` keeps, per tuned problem, the binaries the JIT path returned, keyed by
everything that could select another binary: the current device, each tensor argument's
dtype and 16-byte alignment, each host tensor descriptor's type (its base's dtype, block
shape, shared-memory layout and padding: Triton specializes a descriptor on nothing else),
every other argument's value and every keyword's. That is
stricter than Triton's own key (which keeps only classes of integers), so a call it has not
seen goes through the JIT path once more and adds an entry; a seen one launches the binary.

Direct launches are used only where the launch protocol was checked: NVIDIA's driver under
the Triton versions in :data:`VERIFIED` (other versions and drivers keep the JIT path), and
never while launch hooks are set (profilers such as proton read the launch metadata they
get through them). ``PK_DIRECT_LAUNCH=0`` turns them off.

The binary is launched by its own Triton launcher, or by the launcher the device's backend
offers through the ``pk_binary_launcher`` hook (the NVIDIA backend's ``launcher.c``: 5.6
against 8.3 µs for vector_add on an H100 host; ``PK_C_LAUNCHER=0`` turns it off). Such a
launcher checks the leading tensors' dtypes and alignment itself, so a seen call is first
looked up by device, scalars and keywords alone (``guarded``); where its checks fail, the
full key above finds the call's binary.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import torch
import triton

from . import _replay

__all__ = ["DirectLaunch", "describe", "supported"]

log = logging.getLogger(__name__)

#: Triton versions whose JIT launch this module reproduces (checked on the H200).
VERIFIED = ("3.6.",)
#: Binaries kept per launcher; past it, calls with new argument values take the JIT path.
MAX_ENTRIES = 64


def supported(vendor: str, interpreted: bool) -> bool:
    """Whether launches on a device of ``vendor`` (``DeviceInfo.vendor``) may skip the JIT
    dispatch here."""
    if interpreted or vendor != "nvidia" or torch.version.cuda is None:
        return False
    if os.environ.get("PK_DIRECT_LAUNCH", "1") == "0":
        return False
    return triton.__version__.startswith(VERIFIED) and hasattr(torch._C, "_cuda_getCurrentRawStream")


def describe(vendor: str, interpreted: bool, binary: Any) -> str:
    """How calls are launched on a device of ``vendor``, with ``binary`` its backend's
    ``pk_binary_launcher`` answer (``portable-kernels info``)."""
    if interpreted:
        return "Triton's interpreter"
    if not supported(vendor, interpreted):
        why = ("PK_DIRECT_LAUNCH=0" if os.environ.get("PK_DIRECT_LAUNCH", "1") == "0"
               else f"direct launches need NVIDIA GPUs under triton {' or '.join(v + 'x' for v in VERIFIED)}")
        return f"Triton's JIT dispatch on every call ({why})"
    how = "its Triton launcher" if binary is None else getattr(binary, "__module__", None) or "the backend's"
    from . import _replay  # not at the top: _replay imports this module

    replays = ("replays off (PK_REPLAY=0)" if _replay.mode() == "off" else
               "from a signature's third call, the allocations and launches recorded at its "
               "second (replays; PK_REPLAY=0 turns them off)")
    return f"a seen call's compiled kernel directly, by {how}; {replays}"


def _hooked() -> bool:
    """Whether a launch hook is set (Triton 3.6 keeps chains of them, empty by default)."""
    runtime = triton.knobs.runtime
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


def _leading(arg: Any) -> bool:
    """Whether ``arg`` is a tensor or a host tensor descriptor (keyed by type, not value)."""
    return isinstance(arg, torch.Tensor) or isinstance(getattr(arg, "base", None), torch.Tensor)


class _Entry:
    __slots__ = ("kernel", "tail", "meta", "launch")

    def __init__(self, kernel: Any, tail: tuple, meta: dict, launch: Any) -> None:
        self.kernel = kernel  # triton's CompiledKernel
        self.tail = tail      # the values of the parameters after the positional arguments
        self.meta = meta      # the constexprs and config, for the grid function
        self.launch = launch  # the backend's launcher of this binary, or None for Triton's


class DirectLaunch:
    """The launches of ``fn`` (a ``@triton.jit`` function) with the ``config`` keywords
    (a tuned problem's ``triton.Config.all_kwargs()``, or none where the launcher passes
    its own).

    Calls are ``launch(grid, args, kwargs)`` or ``launch[grid](*args, **kwargs)``:
    positional tensors and host tensor descriptors first (``triton.tools``' or Gluon's
    ``TensorDescriptor``; the binary's launcher encodes a descriptor's addresses, sizes and
    strides at every launch), then scalars, as the family launchers pass them. Scalars are
    part of the key by value, so a scalar that changes on every call (a random seed) gains
    nothing here. Values compare across types (``1 == 1.0 == True``, which Triton types
    apart), so a call site must pass each scalar with one type, as the family launchers do
    (``float(eps)``, sizes and strides as ints). ``launches`` counts the direct ones (for
    tests). ``binary``: the backend's ``pk_binary_launcher`` answer, or None.

    ``runtime``: positions of integer arguments that change from call to call (a random
    seed) and that ``fn`` does not specialize on (``do_not_specialize``): the key holds only
    whether each fits int32, as Triton's own key does, so every value reuses one binary."""

    __slots__ = ("fn", "config", "direct", "binary", "n_tensors", "entries", "guarded", "launches",
                 "runtime")

    def __init__(self, fn: Any, config: dict, direct: bool, binary: Any = None,
                 runtime: tuple[int, ...] = ()) -> None:
        self.fn = fn
        self.config = config
        self.direct = direct
        self.runtime = runtime
        self.binary = binary if direct else None
        self.n_tensors = -1  # leading tensor arguments, known at the first call
        self.entries: dict[tuple, _Entry] = {}
        # (device, scalars, keywords) -> an entry whose backend launcher checks the tensors'
        # dtypes and alignment itself, so that the lookup need not read them (about 2 µs of
        # a call's host time on an H100 host): the first entry of each such key.
        self.guarded: dict[tuple, _Entry] = {}
        self.launches = 0

    def __getitem__(self, grid: Any) -> Any:
        """``launch[grid](*args, **kwargs)``, as a JIT function is launched."""
        return lambda *args, **kwargs: self(grid, args, kwargs)

    def __call__(self, grid: Any, args: tuple, kwargs: dict) -> None:
        if _replay.RECORDING:
            recorder = _replay.recorder()
            if recorder is not None:
                recorder.launch(self, grid, args, kwargs)  # calls this again, unrecorded
                return
        if self.guarded:
            device = torch._C._cuda_getDevice()
            try:
                scalars = self._scalars(args) if self.runtime else args[self.n_tensors:]
                entry = self.guarded.get((device, scalars, tuple(kwargs.items())))
            except TypeError:  # an unhashable scalar
                entry = None
            if entry is not None and not _hooked():
                g = grid(entry.meta) if callable(grid) else grid
                if entry.launch(g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1,
                                torch._C._cuda_getCurrentRawStream(device), *args, *entry.tail):
                    self.launches += 1
                    return
                # Another dtype or alignment than this entry's: the full key finds its binary.
        key = self._key(args, kwargs) if self.direct else None
        entry = None if key is None else self.entries.get(key)
        if entry is None or _hooked():
            kernel = self.fn[grid](*args, **kwargs, **self.config)
            if key is not None and entry is None and len(self.entries) < MAX_ENTRIES:
                entry = self._entry(kernel, grid, args, kwargs)
                if entry is not None:
                    self.entries[key] = entry
                    if entry.launch is not None:
                        self.guarded.setdefault((key[0], key[2], key[3]), entry)
            return
        g = grid(entry.meta) if callable(grid) else grid
        stream = torch._C._cuda_getCurrentRawStream(key[0])
        gx, gy, gz = g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1
        if entry.launch is None or not entry.launch(gx, gy, gz, stream, *args, *entry.tail):
            kernel = entry.kernel
            kernel.run(gx, gy, gz, stream, kernel.function, kernel.packed_metadata, None, None, None,
                       *args, *entry.tail)
        self.launches += 1

    def _key(self, args: tuple, kwargs: dict) -> tuple | None:
        n = self.n_tensors
        if n < 0:
            n = self.n_tensors = next((i for i, a in enumerate(args) if not _leading(a)), len(args))
        try:
            return (torch._C._cuda_getDevice(),
                    tuple([(t.dtype, t.data_ptr() % 16 == 0) if isinstance(t, torch.Tensor)
                           else (t.base.dtype, tuple(t.block_shape), getattr(t, "layout", None),
                                 getattr(t, "padding", None))
                           for t in args[:n]]),
                    self._scalars(args) if self.runtime else args[n:], tuple(kwargs.items()))
        except (AttributeError, TypeError):  # not the first call's layout, or unhashable
            return None

    def _scalars(self, args: tuple) -> tuple:
        """The scalar arguments as keys hold them: runtime ones by their integer width."""
        scalars = args[self.n_tensors:]
        if not self.runtime:
            return scalars
        return tuple((type(v), -2**31 <= v < 2**31) if i in self.runtime else v
                     for i, v in enumerate(scalars, self.n_tensors))

    def _entry(self, kernel: Any, grid: Any, args: tuple, kwargs: dict) -> _Entry | None:
        """What a later call with the same key needs to launch ``kernel`` itself, or None
        when it must keep the JIT path."""
        if kernel is None:
            return None
        if hasattr(kernel, "result"):  # asynchronous compilation
            kernel = kernel.result()
        n = self.n_tensors
        if any(_leading(a) for a in (*args[n:], *kwargs.values())):
            return None  # a tensor passed where scalars go: its alignment is not in the key
        params = self.fn.params
        named = {**kwargs, **self.config}
        tail = []
        for p in params[len(args):]:
            if p.name in named:
                tail.append(named[p.name])
            elif p.has_default:
                tail.append(p.default)
            else:
                return None
        meta = {p.name: v for p, v in zip(params[len(args):], tail) if p.is_constexpr}
        meta.update(self.config)
        if callable(grid):
            # The grid must follow from the constexprs alone (the launchers close over the
            # sizes they need): a grid that reads a runtime argument keeps the JIT path.
            full = {**{p.name: a for p, a in zip(params, args)}, **meta}
            try:
                if tuple(grid(meta)) != tuple(grid(full)):
                    return None
            except KeyError:
                return None
        return _Entry(kernel, tuple(tail), meta, self._binary_launch(kernel, args[:n]))

    def _binary_launch(self, kernel: Any, leading: tuple) -> Any:
        if self.binary is None or not all(isinstance(t, torch.Tensor) for t in leading):
            return None  # host descriptors: Triton's launcher encodes them
        try:
            return self.binary(kernel, tuple((t.dtype, t.data_ptr() % 16 == 0) for t in leading))
        except Exception as exc:  # a backend's launcher must never cost a launch
            log.warning("portable_kernels: the backend's launcher failed on %s (%s); Triton's "
                        "launcher launches it", getattr(kernel, "name", "a kernel"), exc)
            return None

