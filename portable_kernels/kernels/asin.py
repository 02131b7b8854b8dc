"""asin: ``out = asin(x)`` elementwise, through libdevice or a portable fp32 polynomial.

One program handles ``BLOCK_SIZE`` consecutive elements (a tail mask covers the last
block). Inputs of every float dtype are widened to fp32, the arcsine is taken in fp32 and
the result is rounded once to the input's dtype, as torch does for fp16/bf16.

Constexpr switches:
    USE_LIBDEVICE: call ``triton.language.extra.libdevice.asin`` (``__nv_asinf`` on NVIDIA,
        the OCML routine on ROCm). The ``generic`` variant sets it and so requires the
        ``libdevice`` capability. Without it (Triton's interpreter has no libdevice) the
        kernel computes the arcsine itself, after fdlibm/musl ``asinf``:

        |x| < 0.5:   asin(x) = x + x * R(x^2)
        |x| >= 0.5:  asin(|x|) = pi/2 - 2 * asin(sqrt(t)),  t = (1 - |x|) / 2,
                     with asin(s) = s + s * R(t) for s = sqrt(t) <= 0.5

        ``R(z) = z (p0 + p1 z + p2 z^2) / (1 + q1 z)`` is musl's minimax rational fit of
        ``(asin(sqrt z) - sqrt z) / sqrt z`` on [0, 0.25]. Near |x| = 0.5 the subtraction
        from pi/2 loses about one bit, so ``sqrt(t)`` is carried as ``df + c``: ``df`` keeps
        the upper 12 mantissa bits (so ``df * df`` is exact) and ``c = (t - df^2) /
        (sqrt(t) + df)`` the rest; pi/2 is carried as a two-float sum likewise. The result
        is within 1 ulp of the correctly rounded arcsine in fp32 (0 or 1 ulp from torch's
        CPU ``asin`` on 2.4 million sampled inputs). |x| > 1 and NaN give NaN, like torch.

Either way |x| < 2^-12 returns x itself, where asin(x) rounds to x: its sign (-0.0
included) and subnormals survive, which libdevice alone (built to flush subnormals) would
turn into 0.

Config: ``BLOCK_SIZE`` and ``num_warps`` (from the backend).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..registry import KernelSpec, Variant
from . import _host

NAME = "asin"

# musl asinf's rational approximation R(z) on [0, 0.25] (fp32 coefficients). Globals read
# inside @triton.jit code must be constexpr.
_P0 = tl.constexpr(1.6666586697e-01)
_P1 = tl.constexpr(-4.2743422091e-02)
_P2 = tl.constexpr(-8.6563630030e-03)
_Q1 = tl.constexpr(-7.0662963390e-01)
# pi/4 rounded to fp32, and the fp32 rounding of pi/2 - 2 * _PIO4_HI: together they carry
# pi/2 to about 2^-50.
_PIO4_HI = tl.constexpr(0.7853981852531433)
_PIO2_LO = tl.constexpr(-4.371138828673793e-08)
# Below this |x| (2^-12), asin(x) rounds to x in fp32.
_TINY = tl.constexpr(0.000244140625)


# --- helpers --------------------------------------------------------------------------------

@triton.jit
def _asin_rational(z):
    """musl's R(z) ~ asin(sqrt z) / sqrt z - 1 for z in [0, 0.25], in fp32."""
    p = z * (_P0 + z * (_P1 + z * _P2))
    q = 1.0 + z * _Q1
    return tl.math.div_rn(p, q)


@triton.jit
def _asin_fp32(x):
    """asin of an fp32 block without libdevice (see the module docstring)."""
    abs_x = tl.abs(x)
    # Inputs outside [-1, 1] become NaN at the end; clamped, they compute without raising
    # inf/inf or 0 * inf on the way.
    a = tl.minimum(abs_x, 1.0)
    # --- |x| < 0.5: the series form directly ---
    small = a + a * _asin_rational(a * a)
    # --- 0.5 <= |x| <= 1: reflect through asin(x) = pi/2 - 2 asin(sqrt((1 - x) / 2)) ---
    # 1 - a is exact for a >= 0.5 (Sterbenz) and halving is exact, so t carries no error.
    t = (1.0 - a) * 0.5
    s = tl.math.sqrt_rn(t)
    r = _asin_rational(t)
    # df: s with its low 12 mantissa bits cleared, so df * df is exact in fp32; c restores
    # the part of sqrt(t) that df dropped: sqrt(t) - df = (t - df^2) / (sqrt(t) + df).
    df = (s.to(tl.int32, bitcast=True) & -4096).to(tl.float32, bitcast=True)
    # At |x| = 1 (t = 0) that is 0 / 0; dividing by 1 there gives the right correction, 0.
    c = tl.math.div_rn(t - df * df, tl.where(t > 0.0, s + df, 1.0))
    # pi/2 - 2 (df + c + s r), ordered so that the large terms cancel first.
    p = 2.0 * s * r - (_PIO2_LO - 2.0 * c)
    q = _PIO4_HI - 2.0 * df
    big = _PIO4_HI - (p - q)
    y = tl.where(a < 0.5, small, big)
    y = tl.where(x < 0.0, -y, y)
    # Outside the domain, and NaN (which fails every comparison and which tl.minimum need
    # not propagate): NaN.
    return tl.where(abs_x <= 1.0, y, float("nan"))


# --- kernel ---------------------------------------------------------------------------------

@triton.jit
def _asin_kernel(
    x_ptr, out_ptr,          # pointers to contiguous tensors
    n_elements,              # size
    BLOCK_SIZE: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
):
    pid = tl.program_id(0)
    # int64 so tensors past 2**31 elements index correctly.
    offsets = pid.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    # fp32 whatever the input: one rounding on store, and no bf16 arithmetic (the
    # interpreter keeps bf16 as raw bits).
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    if USE_LIBDEVICE:
        y = libdevice.asin(x)
    else:
        y = _asin_fp32(x)
    # Tiny |x|: asin(x) rounds to x itself. Returning x keeps -0.0 and subnormals, which
    # Triton's libdevice (built to flush subnormals) and GPU arithmetic would turn to 0.
    y = tl.where(tl.abs(x) < _TINY, x, y)
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


# --- host launcher --------------------------------------------------------------------------

class Problem(NamedTuple):
    device: torch.device
    dtype: torch.dtype


def problem(x) -> Problem:
    """Selection key of an ``asin(x)`` call."""
    return Problem(_host.tensor_device(NAME, "x", x), x.dtype)


def launch(plan, x: torch.Tensor) -> torch.Tensor:
    """``asin(x)`` elementwise for any shape; fp16, bf16 or fp32 in and out, computed in fp32.

    Non-contiguous inputs are copied to contiguous ones first (a documented copy: an
    elementwise kernel gains nothing from strided loads). Returns a new contiguous tensor
    of ``x``'s shape and dtype; NaN where |x| > 1.
    """
    _host.check_dtype(NAME, "x", x)
    x = x.contiguous()
    out = torch.empty_like(x)
    n = out.numel()
    if n == 0:
        return out
    grid, meta = _host.elementwise_launch(plan, n)
    plan.direct(_asin_kernel)[grid](x, out, n, **meta)
    return out


# --- reference ------------------------------------------------------------------------------

def reference(x: torch.Tensor) -> torch.Tensor:
    """``asin(x)`` in float64 (NaN outside [-1, 1])."""
    return torch.asin(x.double())


def inputs(shape: str, dtype: torch.dtype, device) -> tuple:
    """A random input of ``N`` elements in [-1, 1] (shape string ``"N"``)."""
    (n,) = _host.parse_shape(NAME, shape, "N")
    return ((torch.rand(n, device=device) * 2 - 1).to(dtype),), {}


def register(registry) -> None:
    registry.add_kernel(KernelSpec(
        NAME, "(x) -> out", problem, "elementwise arcsine, any shape", reference,
        inputs, "N"))
    registry.add_variant(Variant(
        NAME, "generic", launch, requires=frozenset({"libdevice"}),
        accepts=_host.dtype_supported, switches={"USE_LIBDEVICE": True},
        configs=_host.elementwise_configs, replay=True, description="libdevice asin in fp32"))
