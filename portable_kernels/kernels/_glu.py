"""Gated linear units, shared by the ``swiglu`` and ``geglu`` families: ``act(gate) * up``.

One kernel source, the activation a constexpr (``GELU``: tanh-approximated GELU; else
SiLU). ``gate`` and ``up`` are (..., I), folded to (M, I) rows with any row stride and a
unit column stride, so the two halves of one fused (..., 2I) gate-up projection are read
in place. Arithmetic in fp32; outputs in the inputs' dtype.

Backward, with ``a = act(gate)``: ``dgate = dy * up * act'(gate)``, ``dup = dy * a``; one
kernel computes both, writing the halves of one (..., 2I) buffer when the input was fused.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import _replay
from ..registry import KernelSpec, Variant
from . import _host

@triton.jit
def _activation(g, GELU: tl.constexpr):
    """(act(g), act'(g)) in fp32."""
    if GELU:
        # gelu_tanh(g) = 0.5 g (1 + tanh(z)) = g * sigmoid(2z), z = sqrt(2/pi) (g + c g^3):
        # the sigmoid form does not cancel where tanh(z) is near -1 (negative g), and
        # needs no libdevice tanh, which the interpreter lacks. 1.5957... = 2 sqrt(2/pi),
        # 0.134145 = 3c.
        s = tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))
        act = g * s
        grad = s + act * (1.0 - s) * 1.5957691216057308 * (1.0 + 0.134145 * g * g)
    else:
        s = tl.sigmoid(g)
        act = g * s
        grad = s * (1.0 + g * (1.0 - s))
    return act, grad


@triton.jit
def _tile(n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's (BLOCK_M, BLOCK_N) tile: its rows (int64), columns and mask. Narrow
    rows share a program (BLOCK_M > 1), so a program moves about BLOCK_M x BLOCK_N
    elements whatever the row width."""
    col_blocks = tl.cdiv(n_cols, BLOCK_N)
    pid = tl.program_id(0)
    rows = (pid // col_blocks).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows[:, None], cols[None, :], (rows < n_rows)[:, None] & (cols < n_cols)[None, :]


@triton.jit
def _glu_fwd_kernel(gate_ptr, up_ptr, out_ptr, n_rows, n_cols, gate_stride, up_stride,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GELU: tl.constexpr):
    rows, cols, mask = _tile(n_rows, n_cols, BLOCK_M, BLOCK_N)
    g = tl.load(gate_ptr + rows * gate_stride + cols, mask=mask).to(tl.float32)
    u = tl.load(up_ptr + rows * up_stride + cols, mask=mask).to(tl.float32)
    act, _ = _activation(g, GELU)
    tl.store(out_ptr + rows * n_cols + cols, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _glu_bwd_kernel(dy_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, n_rows, n_cols, gate_stride,
                    up_stride, dy_stride, dgate_stride, dup_stride,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GELU: tl.constexpr):
    rows, cols, mask = _tile(n_rows, n_cols, BLOCK_M, BLOCK_N)
    g = tl.load(gate_ptr + rows * gate_stride + cols, mask=mask).to(tl.float32)
    u = tl.load(up_ptr + rows * up_stride + cols, mask=mask).to(tl.float32)
    dy = tl.load(dy_ptr + rows * dy_stride + cols, mask=mask).to(tl.float32)
    act, grad = _activation(g, GELU)
    tl.store(dgate_ptr + rows * dgate_stride + cols, (dy * u * grad).to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + rows * dup_stride + cols, (dy * act).to(dup_ptr.dtype.element_ty), mask=mask)


# --- host ----------------------------------------------------------------------------------

class Problem(NamedTuple):
    device: torch.device
    dtype: torch.dtype


def problem_of(name: str):
    def problem(gate, up=None) -> Problem:  # the selection key of a call
        return Problem(_host.tensor_device(name, "gate", gate), gate.dtype)
    return problem


def _halves(name: str, gate: torch.Tensor, up: torch.Tensor | None):
    """(gate, up, fused): with ``up`` None, ``gate`` is the fused (..., 2I) tensor."""
    _host.check_dtype(name, "gate", gate)
    if gate.dim() == 0:
        raise _host.InputError(f"{name}: gate must have at least one dimension, got a scalar")
    if up is None:
        width = gate.shape[-1]
        if width % 2:
            raise _host.InputError(
                f"{name}: a fused gate-up tensor needs an even last dimension (gate, then up), "
                f"got {width}")
        return gate[..., : width // 2], gate[..., width // 2:], True
    _host.same_device(name, gate=gate, up=up)
    _host.check_dtype(name, "up", up)
    _host.check_same_dtype(name, gate=gate, up=up)
    _host.check_same_shape(name, gate=gate, up=up)
    return gate, up, False


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as (M, I) with a unit column stride: a view where strides allow, else a copy."""
    n = t.shape[-1]
    rows = t.reshape(-1, n) if n else t.reshape(math.prod(t.shape[:-1]), 0)
    return rows if rows.stride(-1) == 1 or rows.shape[-1] <= 1 else rows.contiguous()


def _grid(plan, n_rows: int, n_cols: int) -> tuple[tuple[int], dict]:
    """Tiles of about the config's ``BLOCK_SIZE`` elements: a block of columns, and as many
    rows as fill it."""
    cfg = plan.config
    block = cfg.kwargs["BLOCK_SIZE"]
    block_n = min(block, _host.next_power_of_2(n_cols))
    block_m = max(1, min(block // block_n, _host.next_power_of_2(n_rows)))
    grid = (_host.cdiv(n_rows, block_m) * _host.cdiv(n_cols, block_n),)
    return grid, {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": cfg.num_warps}


def forward(plan, gate: torch.Tensor, up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """``act(gate) * up`` for same-shape ``gate`` and ``up``: a new contiguous tensor."""
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if out.numel() == 0:
        return out
    g, u = _rows(gate), _rows(up)
    grid, meta = _grid(plan, g.shape[0], g.shape[1])
    plan.direct(_glu_fwd_kernel)[grid](g, u, out, g.shape[0], g.shape[1], g.stride(0),
                                       u.stride(0), GELU=gelu, **meta, **plan.switches)
    return out


def backward(plan, dy, gate, up, gelu: bool, fused: bool):
    """(dgate, dup), or for a fused input one (..., 2I) gradient and None."""
    shape = gate.shape
    if fused:
        dgu = torch.empty((*shape[:-1], 2 * shape[-1]), dtype=gate.dtype, device=gate.device)
        dgate, dup = dgu[..., : shape[-1]], dgu[..., shape[-1]:]
    else:
        dgu = None
        dgate = torch.empty(shape, dtype=gate.dtype, device=gate.device)
        dup = torch.empty(shape, dtype=gate.dtype, device=gate.device)
    if dgate.numel():
        g, u, d = _rows(gate), _rows(up), _rows(dy)
        dg_rows, du_rows = dgate.reshape(-1, shape[-1]), dup.reshape(-1, shape[-1])
        grid, meta = _grid(plan, g.shape[0], g.shape[1])
        plan.direct(_glu_bwd_kernel)[grid](
            d, g, u, dg_rows, du_rows, g.shape[0], g.shape[1], g.stride(0), u.stride(0), d.stride(0),
            dg_rows.stride(0), du_rows.stride(0), GELU=gelu, **meta, **plan.switches)
    return (dgu, None) if fused else (dgate, dup)


class _GLUFunction(_host.Function):
    @staticmethod
    def forward(ctx, gate, up, plan, gelu, name):
        g, u, fused = _halves(name, gate, up)
        ctx.save_for_backward(g, u)
        ctx.plan, ctx.gelu, ctx.fused = plan, gelu, fused
        return _replay.stage(plan, forward, (), g, u, gelu)

    @staticmethod
    def backward(ctx, dy):
        g, u = ctx.saved_tensors
        with _host.launching(dy.device):
            dgate, dup = _replay.stage(ctx.plan, backward, (), dy, g, u, ctx.gelu, ctx.fused)
        return dgate, dup, None, None, None


def launch_of(name: str, gelu: bool):
    def launch(plan, gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
        if torch.is_grad_enabled() and (gate.requires_grad or (up is not None and up.requires_grad)):
            return _GLUFunction.call(gate, up, plan, gelu, name)
        g, u, _ = _halves(name, gate, up)
        return forward(plan, g, u, gelu)
    launch.__doc__ = (
        f"``{'gelu_tanh' if gelu else 'silu'}(gate) * up`` for ``gate`` and ``up`` of one "
        "shape (..., I) and float dtype (fp16, bf16, fp32), or with ``up`` None one fused "
        "(..., 2I) tensor, gate first. Computed in fp32; a new contiguous (..., I) tensor. "
        "Differentiable in both (a fused input gets one (..., 2I) gradient).")
    return launch


def reference_of(gelu: bool):
    def reference(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
        if up is None:
            gate, up = gate.chunk(2, dim=-1)
        g = gate.double()
        act = torch.nn.functional.gelu(g, approximate="tanh") if gelu else torch.nn.functional.silu(g)
        return act * up.double()
    return reference


def inputs_of(name: str):
    def inputs(shape: str, dtype: torch.dtype, device) -> tuple:
        """Random ``gate`` and ``up`` (M, I) (shape string ``"MxI"``)."""
        rows, cols = _host.parse_shape(name, shape, "MxI")
        return (torch.randn(rows, cols, device=device).to(dtype),
                torch.randn(rows, cols, device=device).to(dtype)), {}
    return inputs


def register(registry, name: str, gelu: bool, summary: str) -> None:
    """Declare the family ``name`` and its ``generic`` variant."""
    registry.add_kernel(KernelSpec(
        name, "(gate, up=None) -> out", problem_of(name), summary, reference_of(gelu),
        inputs_of(name), "MxI"))
    registry.add_variant(Variant(
        name, "generic", launch_of(name, gelu), accepts=_host.dtype_supported,
        configs=_host.elementwise_configs,
        replay=True, description="one program per row block of columns, gate and up read in place "
        "(also the halves of a fused gate-up tensor); backward in one kernel"))
