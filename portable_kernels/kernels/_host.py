"""Host-side checks shared by the launchers: errors that name the kernel, argument and problem.

Every check runs before any allocation or launch, so bad input never reaches Triton.
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Callable, Sequence

import torch
from triton.runtime import _allocation

from ..device import DeviceInfo
from ..errors import ArgumentError, DTypeError, InputError
from .. import _replay
from ..launch import launch_guard

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: The 8-bit float formats of ``tl.dot``: the OCP ones (NVIDIA from sm_89, AMD gfx950:
#: capability ``fp8``) and the fnuz ones of AMD CDNA3 (gfx942: ``fp8_fnuz``; no negative
#: zero, one NaN, exponent bias one larger, so e4m3fnuz tops out at 240 where e4m3fn
#: reaches 448).
FP8_OCP = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_FNUZ = (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
FP8_DTYPES = FP8_OCP + FP8_FNUZ


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def tensor_device(kernel: str, arg: str, value: Any) -> torch.device:
    """``value.device``, or ``TypeError`` when ``value`` is not a tensor."""
    try:
        return value.device
    except AttributeError:
        raise DTypeError(
            f"{kernel}: {arg} must be a torch.Tensor, got {type(value).__name__}"
        ) from None


def same_device(kernel: str, **tensors: Any) -> torch.device:
    """The one device all ``tensors`` live on; ``ValueError`` naming them otherwise.

    Runs on every call (problem tuples use it), so the common case is a tight loop and the
    message is only built on failure.
    """
    try:
        first = None
        for t in tensors.values():
            d = t.device
            if first is None:
                first = d
            elif d != first:
                break
        else:
            return first
    except AttributeError:
        pass
    devices = {name: tensor_device(kernel, name, t) for name, t in tensors.items()}
    where = ", ".join(f"{n} on {d}" for n, d in devices.items())
    raise InputError(f"{kernel}: tensors must be on one device, got {where}")


def check_int(kernel: str, arg: str, value: Any) -> None:
    """``ArgumentError`` unless ``value`` is an integer (a Python int, or anything with
    ``__index__`` such as a numpy integer; not a bool). Cheap enough for problem
    functions: a plain int takes one type check."""
    if type(value) is int:
        return
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise ArgumentError(f"{kernel}: {arg} must be an int, got {type(value).__name__} {value!r}")


def check_bool(kernel: str, arg: str, value: Any) -> None:
    """``ArgumentError`` unless ``value`` is a bool (as torch's own ``is_causal``: a string
    such as ``"no"`` would otherwise read as true)."""
    if value is not True and value is not False:
        raise ArgumentError(f"{kernel}: {arg} must be a bool, got {type(value).__name__} {value!r}")


# ``os.environ.get`` of an unset name raises and catches a KeyError inside (about 2 µs on
# the CPU machine, as much as a view op): per-call reads look in the mapping's own dict,
# which every write through ``os.environ`` (``monkeypatch.setenv`` too) keeps current.
_ENVIRON = getattr(os.environ, "_data", None)
_CHECK_VALUES_KEY = (os.environ.encodekey("PK_CHECK_VALUES")
                     if _ENVIRON is not None and hasattr(os.environ, "encodekey") else None)


def check_values() -> bool:
    """Whether checks that need tensor values on the host (a device sync: monotonic
    ``cu_seqlens``, target indices in range, block tables inside the cache) should run:
    ``PK_CHECK_VALUES=1``, which the conformance suite sets. Never on by default: such a check
    would stall the stream on every call and break CUDA-graph capture. A call being recorded
    for replay notes that it asked (its replays decline while the checks are on)."""
    if _replay.RECORDING:
        _replay.note_value_checks()
    if _CHECK_VALUES_KEY is not None:
        raw = _ENVIRON.get(_CHECK_VALUES_KEY)
        if raw is None:
            return False
        value = os.environ.decodevalue(raw)
    else:
        value = os.environ.get("PK_CHECK_VALUES", "")
    return value.strip().lower() in ("1", "true", "yes", "on")


class CheckedCalls:
    """The results of ``problem`` functions for call signatures already checked, so that a
    loop repeating one call (a decode step, a serving batch) is checked once: a family's
    checks can cost more host time than its launches. A signature is a tuple of
    :func:`described` tensors and :func:`typed` scalars holding everything the checks
    read; calls that fail are never stored. Cleared when full."""

    __slots__ = ("seen", "limit")

    def __init__(self, limit: int = 256) -> None:
        self.seen: dict = {}
        self.limit = limit

    def lookup(self, key: Any, build: Callable[..., Any], *args: Any) -> Any:
        """The problem kept for signature ``key``; else ``build(*args)`` (the checks, which
        raise for a bad call), kept unless ``key`` is None (a call not to memoise)."""
        if key is None:
            return build(*args)
        value = self.seen.get(key)
        if value is None:
            value = build(*args)
            if len(self.seen) >= self.limit:
                self.seen.clear()
            self.seen[key] = value
        return value


def described(t: Any, aligned: bool = True) -> tuple | None:
    """A tensor argument as a signature holds it: shape, strides, dtype, device and, with
    ``aligned`` (for checks that read it), whether its address is 16-byte aligned; None
    for None. ``AttributeError`` for a non-tensor."""
    if t is None:
        return None
    if aligned:
        return t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0
    return t.shape, t.stride(), t.dtype, t.device


def typed(*values: Any) -> tuple:
    """Scalars as a signature holds them: with their types, since ``1 == 1.0 == True``
    would otherwise let a value the checks reject reuse an accepted call's entry."""
    return tuple((type(x), x) for x in values)


def check_aux(kernel: str, arg: str, t: Any, device: torch.device,
              dtype: torch.dtype | None = None) -> None:
    """An auxiliary tensor (lengths, tables, slopes, sinks): a tensor on the inputs'
    ``device`` and, when given, of ``dtype`` exactly (float ones: any of FLOAT_DTYPES)."""
    tensor_device(kernel, arg, t)
    if t.device != device:
        raise InputError(f"{kernel}: {arg} must be on {device} (the inputs' device), got "
                         f"{t.device}")
    if dtype is None:
        check_dtype(kernel, arg, t)
    elif t.dtype != dtype:
        raise DTypeError(f"{kernel}: {arg} must be {_dtype_name(dtype)}, got {_dtype_name(t.dtype)}")


def check_dtype(kernel: str, arg: str, t: torch.Tensor, allowed: Sequence[torch.dtype] = FLOAT_DTYPES) -> None:
    """``TypeError`` when ``t``'s dtype is not in ``allowed``."""
    if t.dtype in allowed:
        return
    names = ", ".join(_dtype_name(d) for d in allowed)
    raise DTypeError(f"{kernel}: {arg} has dtype {_dtype_name(t.dtype)}; supported: {names}")


def _agreed(kernel: str, tensors: dict, value, describe, error: type, problem: str):
    """``value(t)``, the same for every tensor of ``tensors``; else ``error`` with
    ``problem`` followed by each tensor's ``describe(name, t)``."""
    # Every call runs this: a plain loop, the message built only on failure.
    first = None
    for i, t in enumerate(tensors.values()):
        v = value(t)
        if i == 0:
            first = v
        elif v != first:
            what = ", ".join(describe(n, t) for n, t in tensors.items())
            raise error(f"{kernel}: {problem} {what}")
    return first


def check_same_dtype(kernel: str, **tensors: torch.Tensor) -> torch.dtype:
    """The one dtype of ``tensors``; ``TypeError`` naming them otherwise."""
    return _agreed(kernel, tensors, lambda t: t.dtype,
                   lambda n, t: f"{n} is {_dtype_name(t.dtype)}", DTypeError, "dtypes must match, but")


def check_ndim(kernel: str, arg: str, t: torch.Tensor, ndim: int, layout: str = "") -> None:
    """``ValueError`` when ``t`` does not have ``ndim`` dimensions (``layout`` names them)."""
    if t.dim() != ndim:
        want = f"{ndim}-D {layout}".rstrip()
        raise InputError(f"{kernel}: {arg} must be {want}, got shape {tuple(t.shape)}")


def check_same_shape(kernel: str, **tensors: torch.Tensor) -> None:
    """``ValueError`` naming the shapes when ``tensors`` differ in shape."""
    _agreed(kernel, tensors, lambda t: t.shape, lambda n, t: f"{n} {tuple(t.shape)}",
            InputError, "shapes must match, got")


def dtype_supported(problem: Any, device: DeviceInfo) -> str | None:
    """A variant predicate: bf16 problems need the device's ``bf16`` capability, OCP fp8
    ones its ``fp8`` and fnuz fp8 ones its ``fp8_fnuz``.

    Raises:
        DTypeError: fp8 of the other encoding than the device computes (e4m3fn on an
            MI300X, e4m3fnuz on an H100): no variant anywhere could take it, and the
            conversion the user needs is named.
    """
    dtype = problem.dtype
    if dtype == torch.bfloat16 and not device.has("bf16"):
        return f"bfloat16 inputs need the bf16 capability, which {device.name} lacks"
    if dtype in FP8_DTYPES:
        word, other, other_dtypes = (("fp8", "fp8_fnuz", FP8_FNUZ) if dtype in FP8_OCP
                                     else ("fp8_fnuz", "fp8", FP8_OCP))
        if device.has(word):
            return None
        if device.has(other):
            names = " and ".join(_dtype_name(d) for d in other_dtypes)
            raise DTypeError(
                f"{_dtype_name(dtype)} is not an fp8 format {device.name} ({device.arch}) "
                f"computes: its fp8 dots take {names} (convert with .to(torch.{_dtype_name(other_dtypes[0])}); "
                "e4m3fn reaches 448 and e4m3fnuz 240, so rescale values above 240 first)")
        return (f"{_dtype_name(dtype)} inputs need the {word} capability (float8 dots), "
                f"which {device.name} lacks")
    return None


def parse_shape(kernel: str, shape: str, fields: str) -> tuple[int, ...]:
    """``"64x1000"`` -> ``(64, 1000)``, checked against ``fields`` (e.g. ``"RxC"``)."""
    names = fields.split("x")
    try:
        dims = tuple(int(d) for d in shape.lower().split("x"))
    except ValueError:
        dims = ()
    if len(dims) != len(names) or any(d <= 0 for d in dims):
        raise InputError(f"{kernel}: shape {shape!r} is not {fields} with positive integers")
    return dims


def tma_layout(t: Any) -> str:
    """How a tensor descriptor (TMA) can describe the 2-D tensor ``t``: ``"row"`` (unit
    stride along dim 1), ``"col"`` (unit stride along dim 0: describe ``t.T``), or ``""``.

    The copy engine needs a 16-byte aligned base and, in the other dimension, a 16-byte
    aligned stride that steps past a whole row (no broadcast or overlapping rows). Cheap
    enough for ``problem`` functions.
    """
    if t.dim() != 2:
        return ""
    return layout_of(t.data_ptr(), *t.shape, *t.stride(), t.element_size())


def layout_of(ptr: int, n0: int, n1: int, s0: int, s1: int, size: int) -> str:
    """:func:`tma_layout` of a 2-D tensor given by its address, sizes, strides and element
    size: for launchers that read these numbers per call anyway (grouped_matmul, per group)."""
    if ptr % 16:
        return ""
    if s1 == 1 and s0 >= n1 and (s0 * size) % 16 == 0:
        return "row"
    if s0 == 1 and s1 >= n0 and (s1 * size) % 16 == 0:
        return "col"
    return ""


def _scratch(device: torch.device, size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device=device)


_SCRATCH: dict[torch.device, Any] = {}  # device -> its allocator, built once


class scratch_allocator:
    """Device-side tensor descriptors (``tl.make_tensor_descriptor``) need global scratch
    memory at launch: ``with scratch_allocator(device):`` lends Triton a torch allocator for
    the launch only, leaving the caller's own ``triton.set_allocator`` setting alone.

    A class with one allocator per device rather than a generator context manager: it runs
    on every descriptor launch, and ``contextlib``'s machinery cost about 1.2 µs per call
    (CPU machine; a few times that on the GPU host)."""

    __slots__ = ("_alloc", "_token")

    def __init__(self, device: torch.device) -> None:
        alloc = _SCRATCH.get(device)
        if alloc is None:
            alloc = _SCRATCH[device] = functools.partial(_scratch, device)
        self._alloc = alloc

    def __enter__(self) -> None:
        self._token = _allocation._allocator.set(self._alloc)

    def __exit__(self, *exc: Any) -> None:
        _allocation._allocator.reset(self._token)


_NO_SCRATCH = contextlib.nullcontext()  # reusable: it holds no state


def scratch(device: torch.device, descriptors: bool) -> Any:
    """``with scratch(device, descriptors):`` around a launch: :class:`scratch_allocator`
    where the kernel builds device-side descriptors, else a shared no-op context (no
    allocation per call on the pointer-load path)."""
    return scratch_allocator(device) if descriptors else _NO_SCRATCH


def launcher(plan: Any, kernel: Any) -> Any:
    """``kernel`` (a ``@triton.jit`` or Gluon kernel) through ``plan``'s direct launches
    (``LaunchPlan.direct``: on NVIDIA GPUs a seen call launches its compiled binary), or as
    it is without a plan (benchmarks timing a kernel alone), through Triton's JIT launch."""
    return kernel if plan is None else plan.direct(kernel)


# --- integer helpers for launch grids and tile sizes ------------------------------------------
# triton.cdiv and triton.next_power_of_2 are constexpr functions in Triton 3.6: from host
# code each call costs about 3 µs (argument unwrapping), several of them per launch.

def gemm_launch_metadata(a: str, out: str) -> Callable[[Any, Any, dict], dict]:
    """The ``launch_metadata`` hook of a product kernel with ``M``, ``N``, ``K`` arguments
    and its first operand and output in the arguments named ``a`` and ``out`` (tensors or
    host tensor descriptors): what profilers (proton, launch hooks) record per launch, a
    name with the problem size, the flops (at the operands' width) and the bytes moved at
    least once."""
    def metadata(grid, kernel, args: dict) -> dict:
        M, N, K = args["M"], args["N"], args["K"]
        a_t, out_t = (getattr(args[n], "base", args[n]) for n in (a, out))
        size = a_t.element_size()
        return {
            "name": f"{kernel.name} [M={M}, N={N}, K={K}]",
            f"flops{8 * size}": 2.0 * M * N * K,
            "bytes": size * (M * K + K * N) + out_t.element_size() * M * N,
        }

    return metadata


def cdiv(x: int, y: int) -> int:
    """``ceil(x / y)`` for ints, ``y > 0``."""
    return -(-x // y)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` for ``n >= 1``, and 0 for 0, as
    ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


# --- autograd functions -------------------------------------------------------------------

class Function(torch.autograd.Function):
    """The families' autograd functions: ``call`` is ``apply`` without the Python layer of
    ``torch.autograd.Function.apply`` where no functorch transform is active.

    That layer binds default arguments (for ``setup_context``, which the families do not
    define) and unwraps functorch wrappers of transforms that have ended, then calls
    ``torch._C._FunctionBase.apply``: 10 of a trivial function's 24 µs on the CPU machine,
    paid by every call that needs a gradient. Inside a transform (vmap, grad), ``call``
    is ``apply``."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._base_apply = super(torch.autograd.Function, cls).apply

    @classmethod
    def call(cls, *args: Any) -> Any:
        if _functorch_active():
            return cls.apply(*args)
        return cls._base_apply(*args)


_functorch_active = torch._C._are_functorch_transforms_active


def as_shape(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``t.reshape(shape)``, or ``t`` itself where it has that shape already (a backward's
    common case: a reshape costs microseconds of host time even then)."""
    return t if t.shape == shape else t.reshape(shape)


def launching(device: torch.device) -> Any:
    """What launches on ``device`` outside a handle's call must run inside (an autograd
    backward, which torch calls later and maybe from another thread): the handle's own
    ``launch_guard``, or nothing where none is needed."""
    guard = launch_guard(device)
    return contextlib.nullcontext() if guard is None else guard


# --- shared by the 1-D elementwise families (vector_add, asin, dropout) ---------------------

def elementwise_launch(plan: Any, n: int) -> tuple[tuple[int], dict]:
    """The grid and launch keywords of a 1-D elementwise kernel over ``n`` elements: one
    program per ``BLOCK_SIZE`` block (from the plan's config), plus the plan's switches."""
    cfg = plan.config
    block = cfg.kwargs["BLOCK_SIZE"]
    return ((n + block - 1) // block,), {"BLOCK_SIZE": block, "num_warps": cfg.num_warps, **plan.switches}


def elementwise_configs(device: Any) -> list:
    """Default configs of the 1-D elementwise families (backends' tables override them)."""
    import triton

    return [triton.Config({"BLOCK_SIZE": 1024}, num_warps=4)]
