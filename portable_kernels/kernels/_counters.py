"""Counters that kernels leave at zero, kept between launches instead of zero-filled per call;
and, kept the same way, scratch memory a kernel writes before it reads (:func:`kept_scratch`).

The split-K matmul counts the slices of each output tile in on an int32 counter, and the
slice that arrives last resets it to zero. Zero-filling fresh counters for every call costs
a launch of its own: on the H200 about 0.8 us of a 10 us decode-sized (16 x 4096 x 4096)
product replayed in a CUDA graph, and a few microseconds of host time eagerly. Since every
launch leaves them at zero, one zeroed buffer can serve the next launch, as long as no two
launches that may overlap share it. :func:`kept_zeros` keeps one per stream:

- Not capturing a CUDA graph: one buffer per (device, stream), zero-filled once, when it is
  created or grown. Launches on one stream run in order, so they never overlap; launches on
  two streams get two buffers.
- Capturing: the buffer must be zero-filled inside the graph (a graph replays without the
  host, and a buffer zeroed by another graph's replay may not have been zeroed yet). So a
  capture gets its own buffer, created (and zero-filled, in the graph) by its first launch
  on that stream and shared by its later ones; known by the capture's id, which the CUDA
  driver reports. Where the id cannot be read (no ``libcuda``, another runtime), every
  launch in the capture gets fresh zeros, as before.

Devices other than CUDA-type GPUs (and the CPU interpreter's) get fresh zeros every call.
A buffer is shared only by the launches of one capture, or by the eager launches of one
stream: never by two graphs, nor by a graph and eager launches.
"""
from __future__ import annotations

import ctypes
import functools
import threading

import torch

from .. import _replay

try:
    # The current stream's raw handle, as Triton's own launcher reads it: a C call, where
    # ``torch.cuda.current_stream`` builds a Stream object (about 11 µs per eager call
    # under the profiler on the H200 host, as much as a decode-sized GEMM's kernel).
    from torch._C import _cuda_getCurrentRawStream as _raw_stream
except ImportError:  # a CPU-only torch, or a future one without it
    def _raw_stream(index: int) -> int:
        return torch.cuda.current_stream(index).cuda_stream

# (device, stream handle) -> (capture id or None, int32 tensor)
_kept: dict[tuple, tuple[int | None, torch.Tensor]] = {}
# the same for kept_scratch's fp32 buffers
_kept_scratch: dict[tuple, tuple[int | None, torch.Tensor]] = {}
_lock = threading.Lock()
_MIN = 256  # counters; grown by doubling, so a few sizes cover every problem


@functools.lru_cache(maxsize=1)
def _capture_info():
    """``cuStreamGetCaptureInfo`` of the CUDA driver (status and capture id), or None."""
    if torch.version.cuda is None:
        return None
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuStreamGetCaptureInfo
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_uint64)]
    return fn


def capture_id(stream_handle: int) -> int | None:
    """The id of the CUDA graph capture under way on the stream, or None when it is not
    capturing or the driver cannot say."""
    fn = _capture_info()
    if fn is None:
        return None
    status, ident = ctypes.c_int(0), ctypes.c_uint64(0)
    # Status 1 is CU_STREAM_CAPTURE_STATUS_ACTIVE.
    if fn(stream_handle, ctypes.byref(status), ctypes.byref(ident)) != 0 or status.value != 1:
        return None
    return ident.value


def _stream_key(device: torch.device) -> tuple[tuple, int | None] | None:
    """``(key, capture id)`` of the current stream, or None for fresh zeros every call."""
    if device.type != "cuda":
        return None
    handle = _raw_stream(device.index)
    if not torch.cuda.is_current_stream_capturing():
        return (device, handle), None
    ident = capture_id(handle)
    return (None if ident is None else ((device, handle), ident))


def kept_zeros(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` int32 zeros on ``device``, for a kernel that leaves each counter it
    uses at zero when it ends; the same buffer again for the next call on this stream
    (see the module's notes for graphs and devices without streams)."""
    return _kept_buffer(_kept, device, n, lambda size: torch.zeros(size, dtype=torch.int32, device=device))


def kept_scratch(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` fp32 elements of uninitialized memory on ``device`` for a kernel
    that writes every element it reads earlier in the same launch (the split-K partial
    tiles): kept per stream, and per graph capture, as :func:`kept_zeros` keeps its
    buffers, so that an eager call does not allocate it (measured in alternation on an
    H200 host: 1.5-1.9 µs less host time per split-K call, of 36-68). A
    stream's buffer lives as long as the process and holds at most twice the largest
    request made on it."""
    return _kept_buffer(_kept_scratch, device, n, lambda size: torch.empty(size, dtype=torch.float32, device=device))


def _kept_buffer(store: dict, device: torch.device, n: int, make) -> torch.Tensor:
    where = _stream_key(device)
    if where is None:
        return make(n)
    key, ident = where
    kept = store.get(key)
    if kept is not None and kept[0] == ident and kept[1].numel() >= n:
        buf = kept[1]
    else:
        with _lock:
            size = max(_MIN, n if kept is None or kept[0] != ident else max(n, 2 * kept[1].numel()))
            # Replacing the buffer of a finished capture drops it as the graph's
            # intermediates are dropped: the graph keeps the memory (and counters'
            # replays zero it first).
            buf = make(size)
            store[key] = (ident, buf)
    if _replay.RECORDING:
        _replay.note_kept(buf, key[1], ident)  # a replay may launch on it, on this stream
    return buf
