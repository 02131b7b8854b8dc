"""Every kernel as a PyTorch operator: ``torch.ops.portable_kernels.<name>``.

``import portable_kernels.ops`` registers one ``torch.library`` operator per kernel family,
so that ``torch.compile(fullgraph=True)`` (Dynamo, AOTAutograd, Inductor) and
``torch.export`` see a model's calls as single opaque nodes with known output shapes,
instead of graph-breaking on a Triton launch:

=================  ====================================================  ==================
op                 signature                                             backward
=================  ====================================================  ==================
``vector_add``     ``(x, y) -> out``                                     identity (torch)
``softmax``        ``(x, dim=-1) -> out``                                aten softmax bwd
``dropout``        ``(x, p, seed) -> out``                               our dropout, same
                                                                         seed (same mask)
``asin``           ``(x) -> out``                                        ``g / sqrt(1-x^2)``
``layer_norm``     ``(x, weight, bias, eps=1e-5) -> out``                our bwd kernels
``rms_norm``       ``(x, weight, eps=1e-6, offset=0.0) -> out``          our bwd kernels
``swiglu``         ``(gate, up=None) -> out``                            our bwd kernel
``geglu``          ``(gate, up=None) -> out``                            our bwd kernel
``matmul``         ``(a, b) -> out``                                     our matmul
``grouped_matmul`` ``(list_a, list_b) -> list_out``                      our grouped_matmul
``flash_attn``     ``(q, k, v, causal=False, sm_scale=None, *options)``  our bwd kernels
``flash_attn_var   ``(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,  our bwd kernels
len``              max_seqlen_k, causal=False, sm_scale=None, *options)``
``rope``           ``(q, k, cos, sin, positions=None, interleaved=False)  our rope kernel,
                   -> (q_out, k_out)``                                   inverse rotation
``add_rms_norm``   ``(x, residual, weight, eps=1e-6, offset=0.0)         our bwd kernels
                   -> (out, new_residual)``
``kv_cache_write`` ``(k, v, k_cache, v_cache, slot_mapping) -> None``     none (in place)
``flash_attn_with  ``(q, k_cache, v_cache, k=None, v=None, cache_seqlens,  none (inference;
_kvcache``         block_table, causal=True, sm_scale, *options,          caches mutated)
                   num_splits=0)``
``cross_entropy``  ``(logits, target, ignore_index=-100,                 our bwd pass
                   label_smoothing=0.0, z_loss=0.0, softcap=None,
                   reduction="mean") -> loss``
``fused_linear_    ``(hidden, weight, target, bias=None, ...) -> loss``  computed in the
cross_entropy``    (cross_entropy's options)                             forward, scaled
=================  ====================================================  ==================

Each is a ``torch.library.custom_op`` with a fake (meta) implementation and, through
``register_autograd``, a backward. Selection still happens per call, inside the op: the
body calls the kernel's :class:`~portable_kernels.dispatch.KernelHandle` (or, for the two
families whose backward needs forward intermediates, the family's own forward and backward
stages with the handle's :class:`~portable_kernels.launch.LaunchPlan`), so the variant for
the tensors' device runs, ``use_variant`` applies, and a compiled graph stays portable.
The module's public functions (``ops.<name>``) call the kernel's handle directly in eager
code, where nothing traces or intercepts the call (:func:`_eager_first`): an operator's
dispatcher crossings cost more host time than a small kernel takes.

``layer_norm``, ``rms_norm`` and ``flash_attn`` need what their forward computed besides the
output (the per-row statistics; the log-sum-exp). A custom op's backward sees only its
inputs and outputs, so each is split in two custom ops that return those intermediates
(``layer_norm_forward`` -> ``(out, mean, rstd)``, ``layer_norm_backward``;
``rms_norm_forward`` -> ``(out, rstd)``, ``rms_norm_backward``;
``add_rms_norm_forward`` -> ``(out, new_residual, rstd)``, ``add_rms_norm_backward``;
``flash_attn_forward`` -> ``(out, lse)``, ``flash_attn_backward``), and the public op is a
``CompositeImplicitAutograd`` operator returning only the output: eager autograd and
tracing decompose it into the forward op, whose registered autograd runs the backward op.

The backward of an op selects its own variant when it runs (selection is per call). On a
GPU, autograd runs backward passes on its own threads, which do not see a ``use_variant``
block around the forward; the backward kernels are shared by every variant of a family, so
only tuning can differ.

This module imports no kernel module at import time (families load with the plugins, on
the first call), so importing it is cheap and decorates no Triton function.
"""
# custom_op infers each op's schema from its annotations; with postponed annotations they
# are strings, which torch evaluates in this module's globals, so every name used in an
# annotation (Tensor, Optional) must be imported at runtime, never under TYPE_CHECKING.
from __future__ import annotations

import contextlib
import importlib
import inspect
import math
from typing import Optional

import torch
from torch import Tensor

from . import dispatch
from .errors import ArgumentError, InputError
from .launch import launch_guard

__all__ = [
    "asin",
    "dropout",
    "flash_attn",
    "flash_attn_varlen",
    "grouped_matmul",
    "layer_norm",
    "matmul",
    "rms_norm",
    "softmax",
    "swiglu",
    "geglu",
    "vector_add",
    "rope",
    "add_rms_norm",
    "kv_cache_write",
    "flash_attn_with_kvcache",
    "cross_entropy",
    "fused_linear_cross_entropy",
    "OPS",
]

NAMESPACE = "portable_kernels"

#: The public operators, as ``torch.ops.portable_kernels.<name>``.
OPS = ("vector_add", "softmax", "dropout", "asin", "layer_norm", "rms_norm", "swiglu",
       "geglu", "matmul", "grouped_matmul", "flash_attn", "flash_attn_varlen",
       "rope", "add_rms_norm", "kv_cache_write", "flash_attn_with_kvcache", "cross_entropy",
       "fused_linear_cross_entropy")

# Holds the composite operators' registrations (a Library is unregistered when collected).
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")

_HANDLES: dict = {}


def _handle(name: str) -> dispatch.KernelHandle:
    handle = _HANDLES.get(name)
    if handle is None:
        handle = _HANDLES[name] = dispatch.get_kernel(name)
    return handle


def _family(name: str):
    """The family's module; imported only after a plan exists, i.e. once the plugins (and
    with them the interpreter choice) are loaded, as ``catalog.py`` requires."""
    return importlib.import_module(f"portable_kernels.kernels.{name}")


def _on(device: torch.device):
    """The launch guard for ops that run a family's stages themselves (``handle(...)``
    calls are guarded by the handle): Triton launches on the current device, and the
    interpreter one launch at a time (``launch.launch_guard``)."""
    return launch_guard(device) or contextlib.nullcontext()


def _rows(x: Tensor) -> int:
    return math.prod(x.shape[:-1])


# --- vector_add -----------------------------------------------------------------------------

@torch.library.custom_op(f"{NAMESPACE}::vector_add", mutates_args=())
def vector_add(x: Tensor, y: Tensor) -> Tensor:
    """``x + y`` (same shape; fp16, bf16, fp32); a new contiguous tensor."""
    return _handle("vector_add")(x, y)


@vector_add.register_fake
def _(x, y):
    if x.shape != y.shape:
        raise InputError(f"vector_add: shapes must match, got x {tuple(x.shape)}, y {tuple(y.shape)}")
    return x.new_empty(x.shape)


def _vector_add_backward(ctx, grad):
    return grad, grad


vector_add.register_autograd(_vector_add_backward, setup_context=lambda ctx, inputs, output: None)


# --- softmax --------------------------------------------------------------------------------

@torch.library.custom_op(f"{NAMESPACE}::softmax", mutates_args=())
def softmax(x: Tensor, dim: int = -1) -> Tensor:
    """Softmax of ``x`` along ``dim`` (fp16, bf16, fp32; computed in fp32), ``x``'s shape
    and dtype."""
    return _handle("softmax")(x, dim)


@softmax.register_fake
def _(x, dim=-1):
    # The launcher writes rows of the moved layout, then moves the dim back: same strides.
    return x.new_empty(x.movedim(dim, -1).shape).movedim(-1, dim)


def _softmax_setup(ctx, inputs, output):
    x, dim = inputs
    ctx.dim, ctx.dtype = dim, x.dtype
    ctx.save_for_backward(output)


def _softmax_backward(ctx, grad):
    (out,) = ctx.saved_tensors
    # aten's own softmax backward: dx = y * (g - sum(g * y)); the forward's output suffices.
    return torch.ops.aten._softmax_backward_data(grad, out, ctx.dim, ctx.dtype), None


softmax.register_autograd(_softmax_backward, setup_context=_softmax_setup)


# --- dropout --------------------------------------------------------------------------------

@torch.library.custom_op(f"{NAMESPACE}::dropout", mutates_args=())
def dropout(x: Tensor, p: float, seed: int) -> Tensor:
    """Dropout with a counter-based mask: element ``i`` is kept when Philox(seed, i) >= p,
    kept values scaled by 1 / (1 - p). ``p`` in [0, 1], ``seed`` in [0, 2**63). Returns a
    new contiguous tensor of ``x``'s shape and dtype."""
    return _handle("dropout")(x, p, seed)


@dropout.register_fake
def _(x, p, seed):
    return x.new_empty(x.shape)


def _dropout_setup(ctx, inputs, output):
    _, ctx.p, ctx.seed = inputs


def _dropout_backward(ctx, grad):
    # d(out)/dx is the same mask and scale: run the kernel on the gradient with the same
    # seed. No mask tensor is saved.
    return dropout(grad, ctx.p, ctx.seed), None, None


dropout.register_autograd(_dropout_backward, setup_context=_dropout_setup)


# --- asin -----------------------------------------------------------------------------------

@torch.library.custom_op(f"{NAMESPACE}::asin", mutates_args=())
def asin(x: Tensor) -> Tensor:
    """Elementwise arcsine (fp16, bf16, fp32; computed in fp32); NaN where |x| > 1."""
    return _handle("asin")(x)


@asin.register_fake
def _(x):
    return x.new_empty(x.shape)


def _asin_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _asin_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    # d asin(x)/dx = 1 / sqrt(1 - x^2), in fp32 as the forward (inf at |x| = 1, NaN beyond,
    # as torch's own asin backward).
    x32 = x.float()
    return (grad.float() * torch.rsqrt(1.0 - x32 * x32)).to(grad.dtype)


asin.register_autograd(_asin_backward, setup_context=_asin_setup)


# --- layer_norm -----------------------------------------------------------------------------

@torch.library.custom_op(f"{NAMESPACE}::layer_norm_forward", mutates_args=())
def layer_norm_forward(x: Tensor, weight: Tensor, bias: Tensor,
                       eps: float = 1e-5) -> tuple[Tensor, Tensor, Tensor]:
    """``(out, mean, rstd)``: layer norm of ``x`` (..., N) over its last dim, and the fp32
    per-row statistics (shape (M,), M = rows of ``x``) that ``layer_norm_backward`` needs."""
    plan = _handle("layer_norm").plan(x, weight, bias, eps)
    family = _family("layer_norm")
    family._check(x, weight, bias, eps)
    with _on(x.device):
        out, _, mean, rstd = family._forward(plan, x, weight.contiguous(), bias.contiguous(), eps)
    return out, mean, rstd


@layer_norm_forward.register_fake
def _(x, weight, bias, eps=1e-5):
    stats = (_rows(x),)
    return (x.new_empty(x.shape), x.new_empty(stats, dtype=torch.float32),
            x.new_empty(stats, dtype=torch.float32))


@torch.library.custom_op(f"{NAMESPACE}::layer_norm_backward", mutates_args=())
def layer_norm_backward(grad: Tensor, x: Tensor, weight: Tensor, mean: Tensor,
                        rstd: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, dweight, dbias)`` for the upstream gradient ``grad`` (``x``'s shape)."""
    # The plan depends on x alone (its device and dtype): no bias reaches the backward.
    plan = _handle("layer_norm").plan(x, weight, None)
    n = x.shape[-1]
    with _on(x.device):
        dx, dw, db = _family("layer_norm")._backward(
            plan, grad.reshape(-1, n), x.reshape(-1, n), weight.contiguous(), mean, rstd)
    return dx.reshape(x.shape), dw, db


@layer_norm_backward.register_fake
def _(grad, x, weight, mean, rstd):
    return x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape)


def _layer_norm_setup(ctx, inputs, output):
    x, weight, _, _ = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, weight, mean, rstd)


def _layer_norm_backward(ctx, grad, _grad_mean, _grad_rstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = layer_norm_backward(grad, x, weight, mean, rstd)
    return dx, dw, db, None


layer_norm_forward.register_autograd(_layer_norm_backward, setup_context=_layer_norm_setup)

_LIB.define("layer_norm(Tensor x, Tensor weight, Tensor bias, float eps=1e-05) -> Tensor")


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5) -> Tensor:
    """Layer norm of ``x`` (..., N) over its last dim, ``* weight + bias`` ((N,), ``x``'s
    dtype: fp16, bf16, fp32); statistics in fp32. Differentiable in all three tensors."""
    return torch.ops.portable_kernels.layer_norm_forward(x, weight, bias, eps)[0]


_LIB.impl("layer_norm", layer_norm, "CompositeImplicitAutograd")


# --- rms_norm -------------------------------------------------------------------------------

@torch.library.custom_op(f"{NAMESPACE}::rms_norm_forward", mutates_args=())
def rms_norm_forward(x: Tensor, weight: Tensor, eps: float = 1e-6,
                     offset: float = 0.0) -> tuple[Tensor, Tensor]:
    """``(out, rstd)``: RMS norm of ``x`` (..., N) over its last dim, and the fp32 per-row
    1/rms (shape (M,), M = rows of ``x``) that ``rms_norm_backward`` needs."""
    plan = _handle("rms_norm").plan(x, weight, eps, offset)
    family = _family("rms_norm")
    family._check(x, weight, eps, offset)
    with _on(x.device):
        out, _, rstd = family._forward(plan, x, weight.contiguous(), eps, offset)
    return out, rstd


@rms_norm_forward.register_fake
def _(x, weight, eps=1e-6, offset=0.0):
    return x.new_empty(x.shape), x.new_empty((_rows(x),), dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::rms_norm_backward", mutates_args=())
def rms_norm_backward(grad: Tensor, x: Tensor, weight: Tensor, rstd: Tensor,
                      offset: float = 0.0) -> tuple[Tensor, Tensor]:
    """``(dx, dweight)`` for the upstream gradient ``grad`` (``x``'s shape)."""
    plan = _handle("rms_norm").plan(x, weight)
    n = x.shape[-1]
    with _on(x.device):
        dx, dw = _family("rms_norm")._backward(
            plan, grad.reshape(-1, n), x.reshape(-1, n), weight.contiguous(), rstd, offset)
    return dx.reshape(x.shape), dw


@rms_norm_backward.register_fake
def _(grad, x, weight, rstd, offset=0.0):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _rms_norm_setup(ctx, inputs, output):
    x, weight, _, offset = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x, weight, output[1])
    ctx.offset = offset


def _rms_norm_backward(ctx, grad, _grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_backward(grad, x, weight, rstd, ctx.offset)
    return dx, dw, None, None


rms_norm_forward.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)

_LIB.define("rms_norm(Tensor x, Tensor weight, float eps=1e-06, float offset=0.0) -> Tensor")


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, offset: float = 0.0) -> Tensor:
    """RMS norm of ``x`` (..., N) over its last dim, ``* (weight + offset)`` ((N,), ``x``'s
    dtype: fp16, bf16, fp32; ``offset=1.0`` for Gemma); statistics in fp32. Differentiable
    in ``x`` and ``weight``."""
    return torch.ops.portable_kernels.rms_norm_forward(x, weight, eps, offset)[0]


_LIB.impl("rms_norm", rms_norm, "CompositeImplicitAutograd")


# --- swiglu, geglu ---------------------------------------------------------------------------
# One operator each; their backward is one op for separate gate and up and one for a fused
# (..., 2I) input, so that a fused input's gradient is written in place, not concatenated.

def _glu_plan(name: str, gate: Tensor):
    return _handle(name).plan(gate)


@torch.library.custom_op(f"{NAMESPACE}::glu_backward", mutates_args=())
def glu_backward(grad: Tensor, gate: Tensor, up: Tensor, gelu: bool) -> tuple[Tensor, Tensor]:
    """``(dgate, dup)`` of ``act(gate) * up`` (``gelu``: geglu's, else swiglu's)."""
    plan = _glu_plan("geglu" if gelu else "swiglu", gate)
    with _on(gate.device):
        return _family("_glu").backward(plan, grad, gate, up, gelu, fused=False)


@glu_backward.register_fake
def _(grad, gate, up, gelu):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


@torch.library.custom_op(f"{NAMESPACE}::glu_backward_fused", mutates_args=())
def glu_backward_fused(grad: Tensor, gate_up: Tensor, gelu: bool) -> Tensor:
    """The (..., 2I) gradient of ``act(gate) * up`` for one fused ``gate_up`` input."""
    plan = _glu_plan("geglu" if gelu else "swiglu", gate_up)
    half = gate_up.shape[-1] // 2
    with _on(gate_up.device):
        return _family("_glu").backward(plan, grad, gate_up[..., :half], gate_up[..., half:],
                                        gelu, fused=True)[0]


@glu_backward_fused.register_fake
def _(grad, gate_up, gelu):
    return gate_up.new_empty(gate_up.shape)


def _glu_op(name: str, gelu: bool):
    @torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=())
    def op(gate: Tensor, up: Optional[Tensor] = None) -> Tensor:
        plan = _glu_plan(name, gate)
        glu = _family("_glu")
        g, u, _ = glu._halves(name, gate, up)
        with _on(gate.device):
            return glu.forward(plan, g, u, gelu)

    @op.register_fake
    def _(gate, up=None):
        shape = gate.shape if up is not None else (*gate.shape[:-1], gate.shape[-1] // 2)
        return gate.new_empty(shape)

    def setup(ctx, inputs, output):
        ctx.save_for_backward(*[t for t in inputs if t is not None])
        ctx.fused = inputs[1] is None

    def backward(ctx, grad):
        if ctx.fused:
            (gate_up,) = ctx.saved_tensors
            return glu_backward_fused(grad, gate_up, gelu), None
        gate, up = ctx.saved_tensors
        return glu_backward(grad, gate, up, gelu)

    op.register_autograd(backward, setup_context=setup)
    return op


swiglu = _glu_op("swiglu", gelu=False)
swiglu.__doc__ = ("``silu(gate) * up`` for ``gate``, ``up`` (..., I) of one float dtype, or "
                  "one fused (..., 2I) ``gate`` with ``up`` None; differentiable.")
geglu = _glu_op("geglu", gelu=True)
geglu.__doc__ = ("``gelu_tanh(gate) * up`` for ``gate``, ``up`` (..., I) of one float dtype, "
                 "or one fused (..., 2I) ``gate`` with ``up`` None; differentiable.")


# --- matmul ---------------------------------------------------------------------------------

@torch.library.custom_op(f"{NAMESPACE}::matmul", mutates_args=())
def matmul(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` for ``a`` (M, K), ``b`` (K, N) of one dtype (fp16, bf16, fp32, or fp8
    e4m3/e5m2), any strides, fp32 accumulation; a new contiguous (M, N) tensor of that
    dtype (bf16 for fp8 operands)."""
    return _handle("matmul")(a, b)


@matmul.register_fake
def _(a, b):
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise InputError(
            f"matmul: needs a (M, K) and b (K, N), got a {tuple(a.shape)}, b {tuple(b.shape)}")
    from .kernels.matmul import out_dtype

    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype(a.dtype))


def _matmul_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _no_fp8_gradient(kernel: str, a: Tensor) -> None:
    """``InputError`` for fp8 operands: their gradients would mix a bf16 grad with fp8
    operands, which the GEMMs do not take; fp8 weights are quantized copies, trained (if at
    all) through their bf16 masters."""
    from .kernels._host import FP8_DTYPES

    if a.dtype in FP8_DTYPES:
        raise InputError(f"{kernel}: no gradient for {str(a.dtype).replace('torch.', '')} "
                         f"operands; differentiate a {kernel} of their bf16 or fp32 values")


def _matmul_backward(ctx, grad):
    a, b = ctx.saved_tensors
    need_a, need_b = ctx.needs_input_grad
    _no_fp8_gradient("matmul", a)
    # Our own kernel on transposed views: the launcher reads any strides, so no copies.
    da = matmul(grad, b.t()) if need_a else None
    db = matmul(a.t(), grad) if need_b else None
    return da, db


matmul.register_autograd(_matmul_backward, setup_context=_matmul_setup)


# --- grouped_matmul -------------------------------------------------------------------------

@torch.library.custom_op(f"{NAMESPACE}::grouped_matmul", mutates_args=())
def grouped_matmul(list_a: list[Tensor], list_b: list[Tensor]) -> list[Tensor]:
    """``[a @ b for a, b in zip(list_a, list_b)]`` in one launch; each ``a`` (M_g, K_g),
    ``b`` (K_g, N_g), one dtype for all (fp16, bf16, fp32, or fp8); new contiguous
    (M_g, N_g) tensors of that dtype (bf16 for fp8 operands)."""
    return _handle("grouped_matmul")(list_a, list_b)


@grouped_matmul.register_fake
def _(list_a, list_b):
    if not list_a or len(list_a) != len(list_b):
        raise InputError(
            f"grouped_matmul: needs two non-empty lists of one length, got {len(list_a)} "
            f"and {len(list_b)}")
    from .kernels.matmul import out_dtype

    return [a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype(a.dtype))
            for a, b in zip(list_a, list_b)]


def _grouped_matmul_setup(ctx, inputs, output):
    list_a, list_b = inputs
    ctx.groups = len(list_a)
    ctx.save_for_backward(*list_a, *list_b)


def _grouped_matmul_backward(ctx, grads):
    saved = ctx.saved_tensors
    list_a, list_b = saved[:ctx.groups], saved[ctx.groups:]
    need_a, need_b = ctx.needs_input_grad  # one list of flags per list argument
    _no_fp8_gradient("grouped_matmul", list_a[0])
    # Both gradients are grouped GEMMs themselves: one launch each, on transposed views.
    # A list that needs no gradient still gets a list, of Nones: torch.library wants the
    # gradients in the structure of the inputs.
    none = [None] * ctx.groups
    da = grouped_matmul(list(grads), [b.t() for b in list_b]) if any(need_a) else none
    db = grouped_matmul([a.t() for a in list_a], list(grads)) if any(need_b) else none
    return da, db


grouped_matmul.register_autograd(_grouped_matmul_backward, setup_context=_grouped_matmul_setup)


# --- flash_attn, flash_attn_varlen ----------------------------------------------------------
# The options travel as schema types: the window as two ints, ALiBi slopes and sinks as
# optional tensors. The backward ops also return the sinks' gradient (an empty tensor when
# there are no sinks: an op's outputs cannot be optional).

def _scale(q: Tensor, sm_scale: Optional[float]) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)


def _no_sinks_grad(q: Tensor) -> Tensor:
    return q.new_empty((0,), dtype=torch.float32)


# Its output follows q's memory order (flash_attn.output_like): compiled code must pass q in
# the order it was traced with, where Inductor would otherwise pick an input layout freely
# (custom_op takes tags from torch 2.5).
_Q_ORDER = ({"tags": (torch.Tag.needs_fixed_stride_order,)}
            if "tags" in inspect.signature(torch.library.custom_op).parameters else {})


@torch.library.custom_op(f"{NAMESPACE}::flash_attn_forward", mutates_args=(), **_Q_ORDER)
def flash_attn_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool = False,
                       sm_scale: Optional[float] = None, window_left: int = -1,
                       window_right: int = -1, softcap: float = 0.0,
                       alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
                       align: str = "top_left") -> tuple[Tensor, Tensor]:
    """``(out, lse)``: attention output (B, H, Nq, D) in q's dtype and the fp32 natural
    log-sum-exp of the scaled scores (B, H, Nq) that ``flash_attn_backward`` needs."""
    window = (window_left, window_right)
    plan = _handle("flash_attn").plan(q, k, v, causal, sm_scale, window_size=window,
                                      softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                                      align=align)  # validates the inputs
    family = _family("flash_attn")
    mods = family.dense_mods(q, causal, window, softcap, alibi_slopes, sinks, align)
    with _on(q.device):
        # The variant's own stages where it has them (flash_attn.launcher), else the family's.
        return family.stages(plan).forward(plan, q, k, v, bool(causal), _scale(q, sm_scale), mods)


@flash_attn_forward.register_fake
def _(q, k, v, causal=False, sm_scale=None, window_left=-1, window_right=-1, softcap=0.0,
      alibi_slopes=None, sinks=None, align="top_left"):
    b, h, n_q, d = q.shape
    # In q's memory order, as the kernels' output (flash_attn.output_like).
    out = torch.empty_like(q) if q.stride(-1) == 1 else q.new_empty((b, h, n_q, d))
    return out, q.new_empty((b, h, n_q), dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::flash_attn_backward", mutates_args=())
def flash_attn_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                        lse: Tensor, causal: bool = False, sm_scale: Optional[float] = None,
                        window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                        alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
                        align: str = "top_left") -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dsinks)`` in the inputs' dtypes; dk and dv summed over each GQA
    group; ``dsinks`` (H,), or empty without sinks."""
    window = (window_left, window_right)
    plan = _handle("flash_attn").plan(q, k, v, causal, sm_scale, window_size=window,
                                      softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                                      align=align)
    family = _family("flash_attn")
    mods = family.dense_mods(q, causal, window, softcap, alibi_slopes, sinks, align)
    with _on(q.device):
        dq, dk, dv, delta = family.stages(plan).backward(
            plan, grad, q, k, v, out, lse, bool(causal), _scale(q, sm_scale), mods,
            return_delta=True)
    dsinks = _no_sinks_grad(q) if sinks is None else family.sinks_grad(sinks, lse, delta)
    return dq, dk, dv, dsinks


@flash_attn_backward.register_fake
def _(grad, q, k, v, out, lse, causal=False, sm_scale=None, window_left=-1, window_right=-1,
      softcap=0.0, alibi_slopes=None, sinks=None, align="top_left"):
    dsinks = _no_sinks_grad(q) if sinks is None else sinks.new_empty(sinks.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _flash_attn_setup(ctx, inputs, output):
    q, k, v, *options = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.options = options
    ctx.save_for_backward(q, k, v, out, lse)


def _flash_attn_backward(ctx, grad, _grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    causal, sm_scale, left, right, softcap, alibi, sinks, align = ctx.options
    dq, dk, dv, dsinks = flash_attn_backward(grad, q, k, v, out, lse, causal, sm_scale, left,
                                             right, softcap, alibi, sinks, align)
    return dq, dk, dv, None, None, None, None, None, None, (None if sinks is None else dsinks), None


flash_attn_forward.register_autograd(_flash_attn_backward, setup_context=_flash_attn_setup)

_LIB.define("flash_attn(Tensor q, Tensor k, Tensor v, bool causal=False, float? sm_scale=None, "
            "int[2] window_size=[-1, -1], float softcap=0.0, Tensor? alibi_slopes=None, "
            "Tensor? sinks=None, str align='top_left') -> Tensor")


def flash_attn(q: Tensor, k: Tensor, v: Tensor, causal: bool = False,
               sm_scale: Optional[float] = None, window_size=(-1, -1), softcap: float = 0.0,
               alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
               align: str = "top_left", return_lse: bool = False):
    """Attention of ``q`` (B, H, Nq, D) over ``k``, ``v`` (B, H_kv, Nk, D), H % H_kv == 0
    (GQA), D <= 256, fp16/bf16/fp32. ``causal`` is SDPA's ``is_causal`` (top-left aligned;
    ``align="bottom_right"`` aligns it to the end of the keys); ``sm_scale`` defaults to
    1/sqrt(D); ``window_size``, ``softcap``, ``alibi_slopes`` (fp32 (H,) or (B, H)) and
    ``sinks`` (H,) as FlashAttention's. Returns a new contiguous (B, H, Nq, D) tensor,
    differentiable in q, k, v and sinks, and with ``return_lse`` also the fp32 (B, H, Nq)
    log-sum-exp (not differentiable)."""
    left, right = window_size
    out, lse = torch.ops.portable_kernels.flash_attn_forward(
        q, k, v, causal, sm_scale, left, right, softcap, alibi_slopes, sinks, align)
    return (out, lse) if return_lse else out


_LIB.impl("flash_attn", flash_attn, "CompositeImplicitAutograd")


def _varlen_setup(varlen, q, k, v, cu_q, cu_k, max_q, max_k, causal, sm_scale, window,
                  softcap, alibi_slopes, sinks):
    """(plan, mods, views of q, k, v) of a packed call (validated)."""
    plan = _handle("flash_attn_varlen").plan(q, k, v, cu_q, cu_k, max_q, max_k, causal,
                                             sm_scale, window, softcap, alibi_slopes, sinks)
    mods = varlen.packed_mods(q, cu_q, cu_k, max_q, max_k, causal, window, softcap,
                              alibi_slopes, sinks)
    return plan, mods, varlen.views(q, k, v)


@torch.library.custom_op(f"{NAMESPACE}::flash_attn_varlen_forward", mutates_args=())
def flash_attn_varlen_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                              cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                              causal: bool = False, sm_scale: Optional[float] = None,
                              window_left: int = -1, window_right: int = -1,
                              softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
                              sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of a packed batch: out (total_q, H, D), lse fp32 (H, total_q)."""
    varlen = _family("flash_attn_varlen")
    plan, mods, (q4, k4, v4) = _varlen_setup(
        varlen, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
        sm_scale, (window_left, window_right), softcap, alibi_slopes, sinks)
    with _on(q.device):
        out, lse = _family("flash_attn")._forward(plan, q4, k4, v4, bool(causal),
                                                  _scale(q, sm_scale), mods)
    return out[0].transpose(0, 1), lse


@flash_attn_varlen_forward.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
      sm_scale=None, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
      sinks=None):
    total, h, d = q.shape
    return q.new_empty((total, h, d)), q.new_empty((h, total), dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::flash_attn_varlen_backward", mutates_args=())
def flash_attn_varlen_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                               lse: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                               max_seqlen_q: int, max_seqlen_k: int, causal: bool = False,
                               sm_scale: Optional[float] = None, window_left: int = -1,
                               window_right: int = -1, softcap: float = 0.0,
                               alibi_slopes: Optional[Tensor] = None,
                               sinks: Optional[Tensor] = None
                               ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dsinks)`` of a packed batch, in the layouts of q, k, v (packed)."""
    varlen = _family("flash_attn_varlen")
    family = _family("flash_attn")
    plan, mods, (q4, k4, v4) = _varlen_setup(
        varlen, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
        sm_scale, (window_left, window_right), softcap, alibi_slopes, sinks)
    out4, grad4 = varlen.views(out, grad)
    with _on(q.device):
        dq, dk, dv, delta = family._backward(plan, grad4, q4, k4, v4, out4, lse, bool(causal),
                                             _scale(q, sm_scale), mods, return_delta=True)
    dsinks = (_no_sinks_grad(q) if sinks is None
              else family.sinks_grad(sinks, lse, delta, varlen=True))
    return (*(t[0].transpose(0, 1) for t in (dq, dk, dv)), dsinks)


@flash_attn_varlen_backward.register_fake
def _(grad, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      causal=False, sm_scale=None, window_left=-1, window_right=-1, softcap=0.0,
      alibi_slopes=None, sinks=None):
    dsinks = _no_sinks_grad(q) if sinks is None else sinks.new_empty(sinks.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _flash_attn_varlen_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, *options = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.options = options
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)


def _flash_attn_varlen_backward(ctx, grad, _grad_lse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    max_q, max_k, causal, sm_scale, left, right, softcap, alibi, sinks = ctx.options
    dq, dk, dv, dsinks = flash_attn_varlen_backward(
        grad, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, sm_scale, left, right,
        softcap, alibi, sinks)
    return (dq, dk, dv, *[None] * 10, None if sinks is None else dsinks)


flash_attn_varlen_forward.register_autograd(_flash_attn_varlen_backward,
                                            setup_context=_flash_attn_varlen_setup)

_LIB.define("flash_attn_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, "
            "Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, bool causal=False, "
            "float? sm_scale=None, int[2] window_size=[-1, -1], float softcap=0.0, "
            "Tensor? alibi_slopes=None, Tensor? sinks=None) -> Tensor")


def flash_attn_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                      cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                      causal: bool = False, sm_scale: Optional[float] = None,
                      window_size=(-1, -1), softcap: float = 0.0,
                      alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
                      return_lse: bool = False):
    """FlashAttention's ``flash_attn_varlen_func``: q (total_q, H, D), k/v (total_k, H_kv, D),
    ``cu_seqlens_*`` int32 (batch + 1,), causal aligned bottom-right per sequence; options
    as :func:`flash_attn`'s. Returns (total_q, H, D), differentiable in q, k, v and sinks,
    and with ``return_lse`` also the fp32 (H, total_q) log-sum-exp."""
    left, right = window_size
    out, lse = torch.ops.portable_kernels.flash_attn_varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, sm_scale,
        left, right, softcap, alibi_slopes, sinks)
    return (out, lse) if return_lse else out


_LIB.impl("flash_attn_varlen", flash_attn_varlen, "CompositeImplicitAutograd")
# --- rope -----------------------------------------------------------------------------------
# The backward needs only the tables and positions (inputs): one op each way, the backward
# the same kernel rotating by minus the angles.

@torch.library.custom_op(f"{NAMESPACE}::rope", mutates_args=())
def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, positions: Optional[Tensor] = None,
         interleaved: bool = False) -> tuple[Tensor, Tensor]:
    """``(q_out, k_out)``: rotary embeddings of ``q`` (B, S, H, D) and ``k`` (B, S, H_kv, D)
    (or packed (T, H, D), (T, H_kv, D)) by ``cos``/``sin`` (max_positions, rotary_dim / 2),
    at ``positions`` ((B, S) or (T,), int32/int64; default 0..S-1); half-rotation pairs, or
    (2j, 2j+1) with ``interleaved``. New contiguous tensors; differentiable in q and k."""
    plan = _handle("rope").plan(q, k, cos, sin, positions, interleaved)
    family = _family("rope")
    family._check(q, k, cos, sin, positions, interleaved)
    with _on(q.device):
        return family._apply(plan, q, k, cos, sin, positions, interleaved)


@rope.register_fake
def _(q, k, cos, sin, positions=None, interleaved=False):
    return q.new_empty(q.shape), k.new_empty(k.shape)


@torch.library.custom_op(f"{NAMESPACE}::rope_backward", mutates_args=())
def rope_backward(grad_q: Tensor, grad_k: Tensor, cos: Tensor, sin: Tensor,
                  positions: Optional[Tensor] = None,
                  interleaved: bool = False) -> tuple[Tensor, Tensor]:
    """``(dq, dk)``: the upstream gradients rotated back (by minus the angles)."""
    plan = _handle("rope").plan(grad_q, grad_k, cos, sin, positions, interleaved)
    with _on(grad_q.device):
        return _family("rope")._apply(plan, grad_q, grad_k, cos, sin, positions, interleaved,
                                      inverse=True)


@rope_backward.register_fake
def _(grad_q, grad_k, cos, sin, positions=None, interleaved=False):
    return grad_q.new_empty(grad_q.shape), grad_k.new_empty(grad_k.shape)


def _rope_setup(ctx, inputs, output):
    _, _, cos, sin, positions, interleaved = inputs
    if cos.requires_grad or sin.requires_grad:
        raise InputError("rope: cos and sin take no gradient; pass them detached")
    ctx.save_for_backward(cos, sin, positions)
    ctx.interleaved = interleaved


def _rope_backward(ctx, grad_q, grad_k):
    cos, sin, positions = ctx.saved_tensors
    dq, dk = rope_backward(grad_q, grad_k, cos, sin, positions, ctx.interleaved)
    return dq, dk, None, None, None, None


rope.register_autograd(_rope_backward, setup_context=_rope_setup)


# --- add_rms_norm ---------------------------------------------------------------------------

@torch.library.custom_op(f"{NAMESPACE}::add_rms_norm_forward", mutates_args=())
def add_rms_norm_forward(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6,
                         offset: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """``(out, new_residual, rstd)``: ``new_residual = x + residual`` (x's dtype), its RMS
    norm, and the fp32 per-row 1/rms (shape (M,)) that ``add_rms_norm_backward`` needs."""
    plan = _handle("add_rms_norm").plan(x, residual, weight, eps, offset)
    family = _family("add_rms_norm")
    family._check(x, residual, weight, eps, offset)
    with _on(x.device):
        out, summed, rstd = family._forward(plan, x, residual, weight.contiguous(), eps, offset)
    return out, summed.reshape(x.shape), rstd


@add_rms_norm_forward.register_fake
def _(x, residual, weight, eps=1e-6, offset=0.0):
    return (x.new_empty(x.shape), x.new_empty(x.shape),
            x.new_empty((_rows(x),), dtype=torch.float32))


@torch.library.custom_op(f"{NAMESPACE}::add_rms_norm_backward", mutates_args=())
def add_rms_norm_backward(grad_out: Tensor, grad_residual: Tensor, new_residual: Tensor,
                          weight: Tensor, rstd: Tensor,
                          offset: float = 0.0) -> tuple[Tensor, Tensor]:
    """``(dx, dweight)``; dx is also the residual's gradient (x and residual enter only
    through their sum)."""
    plan = _handle("add_rms_norm").plan(new_residual, new_residual, weight)
    n = new_residual.shape[-1]
    with _on(new_residual.device):
        dx, dw = _family("add_rms_norm")._backward(
            plan, grad_out.reshape(-1, n), grad_residual.reshape(-1, n),
            new_residual.reshape(-1, n), weight.contiguous(), rstd, offset)
    return dx.reshape(new_residual.shape), dw


@add_rms_norm_backward.register_fake
def _(grad_out, grad_residual, new_residual, weight, rstd, offset=0.0):
    return new_residual.new_empty(new_residual.shape), weight.new_empty(weight.shape)


def _add_rms_norm_setup(ctx, inputs, output):
    _, _, weight, _, offset = inputs
    _, summed, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(summed, weight, rstd)
    ctx.offset = offset


def _add_rms_norm_backward(ctx, grad_out, grad_residual, _grad_rstd):
    summed, weight, rstd = ctx.saved_tensors
    dx, dw = add_rms_norm_backward(grad_out, grad_residual, summed, weight, rstd, ctx.offset)
    # One tensor for both, as torch's own add returns its gradient for both operands.
    return dx, dx, dw, None, None


add_rms_norm_forward.register_autograd(_add_rms_norm_backward, setup_context=_add_rms_norm_setup)

_LIB.define("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps=1e-06, "
            "float offset=0.0) -> (Tensor, Tensor)")


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6,
                 offset: float = 0.0) -> tuple[Tensor, Tensor]:
    """``(out, new_residual)``: ``new_residual = x + residual`` in x's dtype and its RMS
    norm over the last dim times ``weight + offset`` (x, residual (..., N) of one shape,
    weight (N,), one dtype: fp16, bf16, fp32). Differentiable in all three tensors."""
    out, summed, _ = torch.ops.portable_kernels.add_rms_norm_forward(x, residual, weight, eps,
                                                                    offset)
    return out, summed


_LIB.impl("add_rms_norm", add_rms_norm, "CompositeImplicitAutograd")


# --- kv_cache_write, flash_attn_with_kvcache -------------------------------------------------
# Inference calls with no backward. Both write into the caches they are given, which their
# schemas declare (mutates_args), so that torch.compile orders them against later reads of
# the cache. cache_seqlens travels as an optional tensor plus an int (-1: none), since a
# schema type cannot be "int or tensor".

@torch.library.custom_op(f"{NAMESPACE}::kv_cache_write", mutates_args=("k_cache", "v_cache"))
def kv_cache_write(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                   slot_mapping: Tensor) -> None:
    """Store ``k``, ``v`` (T, H_kv, D) into the caches (contiguous (B, N_max, H_kv, D) or
    paged (num_blocks, block_size, H_kv, D)) in place at the flat slots ``slot_mapping``
    (T,) int32/int64 (``block * block_size + offset``; -1 skips the token)."""
    _handle("kv_cache_write")(k, v, k_cache, v_cache, slot_mapping)


@kv_cache_write.register_fake
def _(k, v, k_cache, v_cache, slot_mapping):
    return None


@torch.library.custom_op(f"{NAMESPACE}::flash_attn_with_kvcache",
                         mutates_args=("k_cache", "v_cache"))
def _flash_attn_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor,
                             k: Optional[Tensor] = None, v: Optional[Tensor] = None,
                             cache_seqlens: Optional[Tensor] = None, seqlen: int = -1,
                             block_table: Optional[Tensor] = None, causal: bool = True,
                             sm_scale: Optional[float] = None, window_left: int = -1,
                             window_right: int = -1, softcap: float = 0.0,
                             alibi_slopes: Optional[Tensor] = None,
                             sinks: Optional[Tensor] = None,
                             num_splits: int = 0) -> tuple[Tensor, Tensor]:
    """``(out (B, Nq, H, D), lse (B, H, Nq) fp32)``; ``seqlen`` >= 0 stands for an int
    ``cache_seqlens``."""
    lengths = cache_seqlens if cache_seqlens is not None else (seqlen if seqlen >= 0 else None)
    out, lse = _handle("flash_attn_with_kvcache")(
        q, k_cache, v_cache, k, v, lengths, block_table, causal, sm_scale,
        (window_left, window_right), softcap, alibi_slopes, sinks, num_splits, True)
    return out, lse


@_flash_attn_with_kvcache.register_fake
def _(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, seqlen=-1, block_table=None,
      causal=True, sm_scale=None, window_left=-1, window_right=-1, softcap=0.0,
      alibi_slopes=None, sinks=None, num_splits=0):
    b, n_q, h, d = q.shape
    return q.new_empty((b, n_q, h, d)), q.new_empty((b, h, n_q), dtype=torch.float32)


def flash_attn_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor,
                            k: Optional[Tensor] = None, v: Optional[Tensor] = None,
                            cache_seqlens=None, block_table: Optional[Tensor] = None,
                            causal: bool = True, sm_scale: Optional[float] = None,
                            window_size=(-1, -1), softcap: float = 0.0,
                            alibi_slopes: Optional[Tensor] = None,
                            sinks: Optional[Tensor] = None, num_splits: int = 0,
                            return_lse: bool = False):
    """FlashAttention's ``flash_attn_with_kvcache``: q (B, Nq, H, D) over a cache
    (B, N_max, H_kv, D), or paged (num_blocks, block_size, H_kv, D) with ``block_table``
    (B, max_blocks) int32; ``k``/``v`` (B, N_new, H_kv, D) appended in place at
    ``cache_seqlens`` (int32 (B,), an int, or None: full) first; causal bottom-right;
    options as :func:`flash_attn`'s. Returns (B, Nq, H, D), and with ``return_lse`` also
    the fp32 (B, H, Nq) log-sum-exp."""
    tensor = isinstance(cache_seqlens, Tensor)
    seqlen = -1
    if cache_seqlens is not None and not tensor:
        if (isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, int)
                or cache_seqlens < 0):
            raise InputError(f"flash_attn_with_kvcache: cache_seqlens must be an int32 tensor, "
                             f"an int >= 0 or None, got {cache_seqlens!r}")
        seqlen = cache_seqlens
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ArgumentError(f"flash_attn_with_kvcache: window_size must be a pair (left, "
                            f"right), got {window_size!r}") from None
    out, lse = torch.ops.portable_kernels.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens if tensor else None, seqlen, block_table,
        causal, sm_scale, left, right, softcap, alibi_slopes, sinks, num_splits)
    return (out, lse) if return_lse else out
# --- cross_entropy ------------------------------------------------------------------------
# Split as layer_norm's: the backward needs the per-row log-sum-exp of the forward.

def _ce_args(ignore_index, label_smoothing, z_loss, softcap, reduction) -> tuple:
    return (ignore_index, float(label_smoothing), float(z_loss),
            None if softcap is None else float(softcap), reduction)


@torch.library.custom_op(f"{NAMESPACE}::cross_entropy_forward", mutates_args=())
def cross_entropy_forward(logits: Tensor, target: Tensor, ignore_index: int = -100,
                          label_smoothing: float = 0.0, z_loss: float = 0.0,
                          softcap: Optional[float] = None,
                          reduction: str = "mean") -> tuple[Tensor, Tensor]:
    """``(loss, lse)``: the fp32 loss (reduced as ``reduction`` says) and the fp32
    log-sum-exp of each row's (capped) logits, shape (T,), that the backward needs."""
    plan = _handle("cross_entropy").plan(logits, target)
    family = _family("cross_entropy")
    args = _ce_args(ignore_index, label_smoothing, z_loss, softcap, reduction)
    family._check(logits, target, *args)
    with _on(logits.device):
        return family._forward(plan, logits, target, *args)


@cross_entropy_forward.register_fake
def _(logits, target, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None,
      reduction="mean"):
    rows = (logits.shape[0],)
    loss = logits.new_empty(rows if reduction == "none" else (), dtype=torch.float32)
    return loss, logits.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::cross_entropy_backward", mutates_args=())
def cross_entropy_backward(grad: Tensor, logits: Tensor, target: Tensor, lse: Tensor,
                           ignore_index: int = -100, label_smoothing: float = 0.0,
                           z_loss: float = 0.0, softcap: Optional[float] = None,
                           reduction: str = "mean") -> Tensor:
    """The gradient of the logits (their shape and dtype) for the upstream ``grad``."""
    plan = _handle("cross_entropy").plan(logits, target)
    args = _ce_args(ignore_index, label_smoothing, z_loss, softcap, reduction)
    with _on(logits.device):
        return _family("cross_entropy")._backward(plan, grad, logits, target, lse, *args)


@cross_entropy_backward.register_fake
def _(grad, logits, target, lse, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
      softcap=None, reduction="mean"):
    return logits.new_empty(logits.shape)


def _cross_entropy_setup(ctx, inputs, output):
    logits, target, *ctx.args = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(logits, target, output[1])


def _cross_entropy_backward(ctx, grad, _grad_lse):
    logits, target, lse = ctx.saved_tensors
    dlogits = cross_entropy_backward(grad, logits, target, lse, *ctx.args)
    return (dlogits, None) + (None,) * len(ctx.args)


cross_entropy_forward.register_autograd(_cross_entropy_backward, setup_context=_cross_entropy_setup)

_LIB.define("cross_entropy(Tensor logits, Tensor target, int ignore_index=-100, "
            "float label_smoothing=0.0, float z_loss=0.0, float? softcap=None, "
            "str reduction=\"mean\") -> Tensor")


def cross_entropy(logits: Tensor, target: Tensor, ignore_index: int = -100,
                  label_smoothing: float = 0.0, z_loss: float = 0.0,
                  softcap: Optional[float] = None, reduction: str = "mean") -> Tensor:
    """Cross-entropy of ``logits`` (T, V) (fp16, bf16, fp32) against ``target`` (T,) int64
    or int32, torch's ``label_smoothing`` and ``ignore_index``, PaLM's ``z_loss`` and
    Gemma 2's ``softcap``. An fp32 loss: a scalar for "mean" (NaN over no counted rows, as
    torch) and "sum", (T,) for "none". Differentiable in ``logits``."""
    return torch.ops.portable_kernels.cross_entropy_forward(
        logits, target, ignore_index, label_smoothing, z_loss, softcap, reduction)[0]


_LIB.impl("cross_entropy", cross_entropy, "CompositeImplicitAutograd")


# --- fused_linear_cross_entropy --------------------------------------------------------------
# "mean" and "sum" with a gradient: one op whose forward returns the loss and its gradients
# (computed chunk by chunk), whose backward scales them. Otherwise (no gradient wanted, or
# "none", whose per-row upstream gradient the forward cannot know): a loss-only op whose
# backward op runs the chunks again. A bias of None is an empty gradient in the op's outputs.

_FLCE = "fused_linear_cross_entropy"


def _flce_call(hidden, weight, target, bias, options):
    plan = _handle(_FLCE).plan(hidden, weight, target, bias)
    family = _family(_FLCE)
    family._check(hidden, weight, target, bias, *options)
    return plan, family


@torch.library.custom_op(f"{NAMESPACE}::fused_linear_cross_entropy_forward", mutates_args=())
def fused_linear_cross_entropy_forward(
        hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None,
        ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
        softcap: Optional[float] = None,
        reduction: str = "mean") -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(loss, dhidden, dweight, dbias)`` for "mean" or "sum": the fp32 loss and its
    gradients for an upstream gradient of 1 (``dbias`` empty without a bias)."""
    options = _ce_args(ignore_index, label_smoothing, z_loss, softcap, reduction)
    if reduction == "none":
        raise InputError(f"{_FLCE}_forward: computes the gradients of a reduced loss; "
                         "reduction='none' takes fused_linear_cross_entropy_loss")
    plan, family = _flce_call(hidden, weight, target, bias, options)
    with _on(hidden.device):
        loss, dh, dw, db = family.forward(plan, hidden, weight, target, bias, options,
                                          (True, True, bias is not None))
    return loss, dh, dw, hidden.new_empty((0,)) if db is None else db


@fused_linear_cross_entropy_forward.register_fake
def _(hidden, weight, target, bias=None, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
      softcap=None, reduction="mean"):
    db = hidden.new_empty((0,)) if bias is None else bias.new_empty(bias.shape)
    return (hidden.new_empty((), dtype=torch.float32), hidden.new_empty(hidden.shape),
            weight.new_empty(weight.shape), db)


def _flce_forward_setup(ctx, inputs, output):
    ctx.has_bias = inputs[3] is not None
    ctx.mark_non_differentiable(*output[1:])
    # Autograd would otherwise pass the backward a zero tensor for each gradient output,
    # a second (V, H) weight gradient's memory at the peak (2.08 against 1.10 GiB at
    # 8192x4096x128256 bf16 on the H100).
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*output[1:])


def _flce_forward_backward(ctx, grad, *_grad_of_gradients):
    if grad is None:  # not materialized: the loss had no gradient
        return (None,) * 9
    # A second backward through a retained graph finds the saved gradients' versions
    # changed and autograd raises, rather than scaling them twice.
    dh, dw, db = _family(_FLCE).scale_saved(ctx.saved_tensors, grad)
    return (dh, dw, None, db if ctx.has_bias else None) + (None,) * 5


fused_linear_cross_entropy_forward.register_autograd(_flce_forward_backward,
                                                     setup_context=_flce_forward_setup)


@torch.library.custom_op(f"{NAMESPACE}::fused_linear_cross_entropy_loss", mutates_args=())
def fused_linear_cross_entropy_loss(
        hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None,
        ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
        softcap: Optional[float] = None, reduction: str = "mean") -> Tensor:
    """The fp32 loss alone (no gradient computed in the forward)."""
    options = _ce_args(ignore_index, label_smoothing, z_loss, softcap, reduction)
    plan, family = _flce_call(hidden, weight, target, bias, options)
    with _on(hidden.device):
        return family.loss_only(plan, hidden, weight, target, bias, options)


@fused_linear_cross_entropy_loss.register_fake
def _(hidden, weight, target, bias=None, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
      softcap=None, reduction="mean"):
    return hidden.new_empty((hidden.shape[0],) if reduction == "none" else (), dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::fused_linear_cross_entropy_backward", mutates_args=())
def fused_linear_cross_entropy_backward(
        grad: Tensor, hidden: Tensor, weight: Tensor, target: Tensor,
        bias: Optional[Tensor] = None, ignore_index: int = -100, label_smoothing: float = 0.0,
        z_loss: float = 0.0, softcap: Optional[float] = None,
        reduction: str = "mean") -> tuple[Tensor, Tensor, Tensor]:
    """``(dhidden, dweight, dbias)`` for the upstream ``grad``, the chunks run again
    (``dbias`` empty without a bias)."""
    options = _ce_args(ignore_index, label_smoothing, z_loss, softcap, reduction)
    plan = _handle(_FLCE).plan(hidden, weight, target, bias)
    with _on(hidden.device):
        dh, dw, db = _family(_FLCE).backward(plan, grad, hidden, weight, target, bias, options,
                                             (True, True, bias is not None))
    return dh, dw, hidden.new_empty((0,)) if db is None else db


@fused_linear_cross_entropy_backward.register_fake
def _(grad, hidden, weight, target, bias=None, ignore_index=-100, label_smoothing=0.0,
      z_loss=0.0, softcap=None, reduction="mean"):
    db = hidden.new_empty((0,)) if bias is None else bias.new_empty(bias.shape)
    return hidden.new_empty(hidden.shape), weight.new_empty(weight.shape), db


def _flce_loss_setup(ctx, inputs, output):
    hidden, weight, target, bias, *ctx.args = inputs
    ctx.has_bias = bias is not None
    ctx.save_for_backward(hidden, weight, target, *([bias] if ctx.has_bias else []))


def _flce_loss_backward(ctx, grad):
    hidden, weight, target, *bias = ctx.saved_tensors
    dh, dw, db = fused_linear_cross_entropy_backward(grad, hidden, weight, target,
                                                     bias[0] if bias else None, *ctx.args)
    return (dh, dw, None, db if ctx.has_bias else None) + (None,) * len(ctx.args)


fused_linear_cross_entropy_loss.register_autograd(_flce_loss_backward,
                                                  setup_context=_flce_loss_setup)

_LIB.define("fused_linear_cross_entropy(Tensor hidden, Tensor weight, Tensor target, "
            "Tensor? bias=None, int ignore_index=-100, float label_smoothing=0.0, "
            "float z_loss=0.0, float? softcap=None, str reduction=\"mean\") -> Tensor")


def fused_linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor,
                               bias: Optional[Tensor] = None, ignore_index: int = -100,
                               label_smoothing: float = 0.0, z_loss: float = 0.0,
                               softcap: Optional[float] = None,
                               reduction: str = "mean") -> Tensor:
    """``cross_entropy(hidden @ weight.T + bias, target, ...)`` for ``hidden`` (T, H),
    ``weight`` (V, H), ``bias`` (V,) or None (one float dtype), in chunks of tokens,
    never the (T, V) logits; cross_entropy's options and fp32 result. Differentiable in
    ``hidden``, ``weight`` and ``bias``."""
    args = (hidden, weight, target, bias, ignore_index, label_smoothing, z_loss, softcap, reduction)
    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias))
    if wants_grad and reduction != "none":
        return torch.ops.portable_kernels.fused_linear_cross_entropy_forward(*args)[0]
    return torch.ops.portable_kernels.fused_linear_cross_entropy_loss(*args)


_LIB.impl("fused_linear_cross_entropy", fused_linear_cross_entropy, "CompositeImplicitAutograd")


# Handles trace as these operators under torch.compile (dispatch._traced_call), and the
# families whose launchers do not differentiate take them for calls that need a gradient.
dispatch.TRACED_OPS.update({name: globals()[name] for name in OPS})
dispatch.GRAD_OPS.update({name: globals()[name]
                          for name in ("vector_add", "softmax", "asin", "matmul", "grouped_matmul")})


_functorch_level = torch._C._functorch.peek_interpreter_stack
_dispatch_modes = torch._C._len_torch_dispatch_stack
_jit_tracing = torch._C._get_tracing_state


def _eager_first(name: str, op):
    """The public ``ops.<name>``: in eager code, the kernel's handle, whose calls replay
    (``_replay``) and whose gradients run the family's autograd ``Function``; else ``op``.

    An operator's eager call crosses torch's dispatcher two or three times (the composite,
    the custom op's autograd, its implementation) before the handle's work starts: about
    44 µs on the CPU machine for an op whose body only allocates, against 8 µs for the
    allocations themselves. What the operator is for stays with it: tracing
    (``torch.compile``, ``torch.export``), a dispatch mode (fake tensors, ``make_fx``,
    ``opcheck``, FLOP counters), functorch transforms (``vmap``) and ``torch.jit.trace`` all
    see ``op``. The handle takes the operator's arguments (same names and order) and gives
    its results."""
    def call(*args, **kwargs):
        if (_compiling() or _dispatch_modes() or _functorch_level() is not None
                or _jit_tracing() is not None):
            return op(*args, **kwargs)
        return _handle(name)(*args, **kwargs)

    fn = getattr(op, "_init_fn", op)  # a custom op's own function, for its name and docs
    call.__name__ = call.__qualname__ = name
    call.__doc__ = fn.__doc__
    call.__wrapped__ = fn  # inspect.signature shows the operator's
    call.op = op
    return call


_compiling = torch.compiler.is_compiling
for _name in OPS:
    globals()[_name] = _eager_first(_name, globals()[_name])
del _name
