"""This backend's launcher for compiled kernels: ``launcher.c``, used by the core's direct
launches (``portable_kernels/_direct.py``) through the ``pk_binary_launcher`` hook.

Triton 3.6's launcher for a compiled binary costs about 5 µs of host time per call on an
H100 host (``CompiledKernel.run`` 5.3 µs for a four-argument kernel, 4.4 of them in its C
part), most of torch's whole eager add there (8.5). Much of it is work that a call whose
arguments were checked once does not need: a Python frame that sizes scratch buffers the
kernel does not use, ``PyArg_ParseTuple`` over a format string, and one
``cuPointerGetAttribute`` driver call per pointer to learn whether it is device memory.
``launcher.c`` keeps the argument packing and ``cuLaunchKernel``.

What it leaves out, and why that is safe where it runs:

- the device-memory check of each pointer: the families check that every tensor is on the
  launching device before they launch (``_host.same_device`` and the checks beside it);
- kernels that need profile scratch, clusters (``num_ctas > 1``), cooperative or
  programmatic-dependent launches, host tensor descriptors or tuple arguments: :func:`make`
  returns None for them and they keep Triton's launcher;
- a fresh global scratch buffer per launch (device-side tensor descriptors are written
  there): Triton's launcher allocates one through its allocator on every call; launcher.c
  keeps one per stream, grown as launches need (launches on a stream run in order, so one
  buffer serves them all), and takes a fresh one only while the stream is captured into a
  CUDA graph. A stream's buffer lives as long as the process, at most twice the largest
  request made on it. Off unless ``PK_C_LAUNCHER_SCRATCH=1`` until it has run on a GPU
  (:func:`scratch_enabled`);
- launch hooks (profilers): the core never launches directly while one is set.

The module is built at its first use with Triton's own C build helper (the compiler Triton
builds its launchers with; the result lands in Triton's cache). Where the build fails the
failure is logged once and Triton's launcher stays. ``PK_C_LAUNCHER=0`` keeps it too.
"""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any, Callable

import torch
import triton

__all__ = ["available", "kinds", "make", "module"]

log = logging.getLogger(__name__)

#: Triton versions whose launch protocol (parameters, then two scratch pointers) launcher.c
#: reproduces (checked on the H100 against Triton's launcher).
VERIFIED = ("3.6.",)

#: Triton's scalar parameter types -> launcher.c's kind characters.
_KINDS = {"i1": "b", "i8": "b", "i16": "h", "i32": "i", "i64": "l", "u1": "B", "u8": "B",
          "u16": "H", "u32": "I", "u64": "L", "fp16": "e", "bf16": "E", "fp32": "f",
          "f32": "f", "fp64": "d", "constexpr": "C"}

#: torch's caching allocator aligns every block to 512 bytes; a kernel asking more of its
#: global scratch keeps Triton's launcher.
SCRATCH_ALIGN = 512

_lock = threading.Lock()
_module: Any = None
_failed = False


def available() -> bool:
    """Whether :func:`make` may be used: a verified Triton, not turned off."""
    return triton.__version__.startswith(VERIFIED) and os.environ.get("PK_C_LAUNCHER", "1") != "0"


def scratch_enabled() -> bool:
    """Whether kernels taking global scratch launch through launcher.c (``PK_C_LAUNCHER_SCRATCH=1``;
    read when a binary's launcher is made). Off by default: its kept per-stream buffers
    have passed the CPU tests (``tests/test_nvidia_launcher.py``) but not yet run on a GPU."""
    return os.environ.get("PK_C_LAUNCHER_SCRATCH", "0") == "1"


def kinds(signature: dict) -> str | None:
    """launcher.c's kind string for a compiled kernel's ``src.signature`` (parameter name ->
    Triton type), or None when a parameter is of a type it does not launch."""
    out = []
    for ty in signature.values():
        if not isinstance(ty, str):
            return None  # a tuple argument
        if ty.startswith("*"):
            out.append("P")
        elif ty in _KINDS:
            out.append(_KINDS[ty])
        else:
            return None  # tensor descriptors, and anything newer
    return "".join(out)


def module() -> Any:
    """The compiled ``launcher.c`` (built once per process), or None where it cannot be
    built."""
    global _module, _failed
    if _module is None and not _failed:
        with _lock:
            if _module is None and not _failed:
                try:
                    from triton.runtime.build import compile_module_from_src

                    src = Path(__file__).with_name("launcher.c").read_text()
                    _module = compile_module_from_src(src, "portable_kernels_launcher")
                except Exception as exc:  # no compiler, no headers: Triton's launcher stays
                    _failed = True
                    log.warning("portable_kernels: the C launcher did not build (%s); "
                                "launches keep Triton's launcher", exc)
    return _module


def make(kernel: Any, guards: tuple = ()) -> Callable[..., bool] | None:
    """A launcher for ``kernel`` (a Triton ``CompiledKernel`` on the current device), called
    as ``launch(grid_x, grid_y, grid_z, stream, *args)`` with the arguments Triton's
    launcher takes after its metadata; None where the kernel needs what it leaves out.
    ``guards``: a ``(dtype, aligned)`` pair per leading tensor argument, checked at each
    call (launch returns False, launching nothing, where one does not hold)."""
    meta = kernel.metadata
    scratch = getattr(meta, "global_scratch_size", 0)
    if (getattr(meta, "num_ctas", 1) != 1 or getattr(meta, "profile_scratch_size", 0)
            or getattr(meta, "tensordesc_meta", None) or getattr(meta, "launch_cooperative_grid", False)
            or getattr(meta, "launch_pdl", False)
            or (scratch and (not scratch_enabled()
                             or getattr(meta, "global_scratch_align", 1) > SCRATCH_ALIGN))):
        return None
    signature = getattr(getattr(kernel, "src", None), "signature", None)
    spec = kinds(signature) if isinstance(signature, dict) else None
    mod = None if spec is None else module()
    if mod is None:
        return None
    kernel.run  # loads the binary on the current device if it is not yet
    device = torch.cuda.current_device()
    extra = {"scratch": (scratch, _allocator(device))} if scratch else {}
    return mod.Launcher(kernel.function, device, 32 * meta.num_warps, meta.shared, spec,
                        tuple(guards), **extra)


def _allocator(device: int) -> Callable[[int], torch.Tensor]:
    """launcher.c's global scratch: bytes on ``device`` from torch's caching allocator, on
    the current stream (the launch's)."""
    where = torch.device("cuda", device)
    return lambda nbytes: torch.empty(nbytes, dtype=torch.uint8, device=where)
