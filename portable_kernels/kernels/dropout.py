"""dropout: ``out = x * keep / (1 - p)`` with a mask drawn from a counter-based RNG.

Element ``i`` (its index in ``x``'s row-major order) is kept when ``tl.rand(seed, i) >= p``.
``tl.rand`` is Philox 4x32-10 keyed by the seed and counted by the offset, so the mask is a
pure function of ``(seed, i)``: no mask tensor is stored, the same seed gives the same mask
on every call and every device (the interpreter's Philox is bit-identical to the compiled
one), and the backward pass regenerates the mask by running the same kernel on the
incoming gradient. A row-major index (not a memory offset) keys the mask, so a
non-contiguous ``x`` is dropped exactly like its contiguous copy.

``tl.rand`` maps a 31-bit draw to ``[0, 1)``, so ``r >= p`` keeps everything at p = 0 and
nothing at p = 1: both edges fall out of the one comparison. Values are scaled in fp32
and rounded once on store.

Constexpr switches: none. Config: ``BLOCK_SIZE`` and ``num_warps`` (from the backend).
"""
from __future__ import annotations

import numbers
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from ..registry import KernelSpec, Variant
from .. import _replay
from . import _host

NAME = "dropout"

# Philox takes a 64-bit key; a seed outside [0, 2**63) would not pass as an int64 scalar.
_SEED_LIMIT = 2**63


# --- kernel ---------------------------------------------------------------------------------

# Not specialized on the seed (new on every call): one binary serves every seed, so a
# seen call launches directly (plan.direct's runtime arguments).
@triton.jit(do_not_specialize=["seed"])
def _dropout_kernel(
    x_ptr, out_ptr,          # pointers to contiguous tensors
    n_elements,              # size
    p,                       # drop probability, fp32 in [0, 1]
    scale,                   # 1 / (1 - p); 1 when p == 1 (nothing is kept to scale)
    seed,                    # Philox key
    BLOCK_SIZE: tl.constexpr,
):
    pid = tl.program_id(0)
    # int64 so tensors past 2**31 elements index correctly; tl.rand splits a 64-bit offset
    # into two 32-bit Philox counters, and for offsets below 2**32 the high word is 0, so
    # the stream is the same as with int32 offsets.
    offsets = pid.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    # The random number depends only on (seed, element index): this *is* the mask.
    r = tl.rand(seed, offsets)
    keep = r >= p
    # where, not x * keep * scale: a dropped inf or NaN must still give 0.
    y = tl.where(keep, x * scale, 0.0)
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


# --- host launcher --------------------------------------------------------------------------

class Problem(NamedTuple):
    device: torch.device
    dtype: torch.dtype


def problem(x, p, seed) -> Problem:
    """Selection key of a ``dropout(x, p, seed)`` call (its signature is the kernel's, so
    that a call missing ``p`` or ``seed`` is told so; ``launch`` checks their values)."""
    return Problem(_host.tensor_device(NAME, "x", x), x.dtype)


def _check_args(x, p, seed) -> float:
    _host.check_dtype(NAME, "x", x)
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise _host.ArgumentError(f"{NAME}: p must be a float in [0, 1], got {type(p).__name__}")
    p = float(p)
    if not 0.0 <= p <= 1.0:  # also rejects NaN
        raise _host.InputError(f"{NAME}: p must be in [0, 1], got p={p}")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise _host.ArgumentError(f"{NAME}: seed must be an int, got {type(seed).__name__}")
    if not 0 <= seed < _SEED_LIMIT:
        raise _host.InputError(f"{NAME}: seed must be in [0, 2**63), got seed={seed}")
    return p


def _apply(plan, x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """Run the kernel on contiguous ``x`` (forward on inputs, backward on gradients)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    n = out.numel()
    if n == 0:
        return out
    # At p = 1 nothing is kept, so the scale is never applied; 1 avoids 1/0 here and
    # inf * 0 in the kernel's unselected lanes.
    scale = 1.0 if p == 1.0 else 1.0 / (1.0 - p)
    grid, meta = _host.elementwise_launch(plan, n)
    # The seed (argument 5) is new on every call: a runtime argument, not in the key.
    plan.direct(_dropout_kernel, runtime=(5,))[grid](x, out, n, p, scale, int(seed), **meta)
    return out


def launch(plan, x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """Dropout of ``x`` (any shape; fp16, bf16 or fp32) with drop probability ``p`` in
    [0, 1] and an int ``seed`` in [0, 2**63). Returns a new contiguous tensor of ``x``'s
    shape and dtype; at p = 0 it is a copy of ``x`` (never ``x`` itself, so writing to it
    cannot change ``x``), at p = 1 all zeros. Non-contiguous inputs are copied first.

    Differentiable in ``x``: the backward pass regenerates the mask from ``seed``.
    """
    p = _check_args(x, p, seed)
    if p == 0.0:
        # Nothing is dropped; clone keeps autograd (the gradient is the identity).
        return x.clone(memory_format=torch.contiguous_format)
    if x.requires_grad and torch.is_grad_enabled():
        return _DropoutFunction.call(x, p, seed, plan)
    return _apply(plan, x, p, seed)


# --- autograd -------------------------------------------------------------------------------

#: ``_apply``'s per-call argument (the seed, after x and p): its stages replay with each
#: call's seed, as the handle's replays do (``KernelSpec.runtime``).
_SEED = {2: "seed"}


class _DropoutFunction(_host.Function):
    """Saves only ``(p, seed)``: d(out)/dx is the same mask and scale as the forward."""

    @staticmethod
    def forward(ctx, x, p, seed, plan):
        ctx.p, ctx.seed, ctx.plan = p, seed, plan
        return _replay.stage(plan, _apply, (), x, p, seed, per_call=_SEED)

    @staticmethod
    def backward(ctx, grad_out):
        with _host.launching(grad_out.device):
            dx = _replay.stage(ctx.plan, _apply, (), grad_out, ctx.p, ctx.seed, per_call=_SEED)
        return dx, None, None, None


# --- reference ------------------------------------------------------------------------------

# Philox 4x32 constants, as in triton/language/random.py.
_PHILOX_KEY_A, _PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
_PHILOX_ROUND_A, _PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57
_PHILOX_ROUNDS = 10
_U32 = np.uint64(0xFFFFFFFF)


def philox_uniform(seed: int, n: int) -> np.ndarray:
    """``tl.rand(seed, arange(n))`` recomputed in numpy: fp32 uniforms in [0, 1)."""
    offsets = np.arange(n, dtype=np.uint64)
    # Counters (offset low word, offset high word, 0, 0); key (seed low word, high word).
    c0, c1 = offsets & _U32, offsets >> np.uint64(32)
    c2 = np.zeros_like(c0)
    c3 = np.zeros_like(c0)
    k0 = np.uint64(seed & 0xFFFFFFFF)
    k1 = np.uint64((seed >> 32) & 0xFFFFFFFF)
    a, b = np.uint64(_PHILOX_ROUND_A), np.uint64(_PHILOX_ROUND_B)
    for _ in range(_PHILOX_ROUNDS):
        # A product of two 32-bit words fits a uint64: its high word is umulhi.
        prod_b, prod_a = b * c2, a * c0
        c0, c2, c1, c3 = (
            (prod_b >> np.uint64(32)) ^ c1 ^ k0,
            (prod_a >> np.uint64(32)) ^ c3 ^ k1,
            prod_b & _U32,
            prod_a & _U32,
        )
        k0 = (k0 + np.uint64(_PHILOX_KEY_A)) & _U32
        k1 = (k1 + np.uint64(_PHILOX_KEY_B)) & _U32
    # uint_to_uniform_float: fold the signed 32-bit draw onto [0, 2**31) and scale in fp32.
    draw = c0.astype(np.uint32).view(np.int32).astype(np.int64)
    draw = np.where(draw < 0, -draw - 1, draw)
    return draw.astype(np.float32) * np.float32(4.6566127342e-10)


def reference(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """Dropout in float64 with the kernel's mask, recomputed from ``seed`` in numpy."""
    x64 = x.double()
    if p == 0.0:
        return x64.clone()
    u = philox_uniform(seed, x.numel()).reshape(tuple(x.shape))
    keep = torch.from_numpy(u >= np.float32(p)).to(x64.device)
    scale = 0.0 if p == 1.0 else 1.0 / (1.0 - p)
    return torch.where(keep, x64 * scale, torch.zeros_like(x64))


def inputs(shape: str, dtype: torch.dtype, device) -> tuple:
    """A random input of ``N`` elements (shape string ``"N"``), p = 0.1, seed 1234."""
    (n,) = _host.parse_shape(NAME, shape, "N")
    return (torch.randn(n, device=device).to(dtype), 0.1, 1234), {}


def register(registry) -> None:
    registry.add_kernel(KernelSpec(
        NAME, "(x, p, seed) -> out", problem,
        "dropout with a counter-based (Philox) mask: same seed, same mask, none stored",
        reference, inputs, "N", runtime=("seed",)))
    registry.add_variant(Variant(
        NAME, "generic", launch, accepts=_host.dtype_supported, configs=_host.elementwise_configs,
        replay=True, description="pointer loads with a tail mask; tl.rand mask regenerated in backward"))
