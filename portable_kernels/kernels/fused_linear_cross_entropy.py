"""fused_linear_cross_entropy: ``cross_entropy(hidden @ weight.T + bias, target)`` without
the (T, V) logits.

A language model's last projection and its loss: ``hidden`` (T, H), ``weight`` (V, H) (an
``nn.Linear``'s), ``bias`` (V,) or None, ``target`` (T,). The tokens go in chunks of C
rows (:func:`chunk_rows`); per chunk:

1. ``logits = h_c @ weight.T`` (C, V) by our ``matmul`` family (its plan for these
   operands, so the device's variant and tuning apply), in the inputs' dtype;
2. ``cross_entropy``'s kernel with both passes in one launch: the rows' loss and, in
   place of the logits, their gradient (times ``1 / counted rows`` for ``"mean"``); the
   bias is added inside the kernel, in fp32;
3. ``dh_c = dlogits @ weight`` into the hidden gradient; ``dweight += dlogits.T @ h_c``
   by the matmul's accumulating epilogue (``acc=``: the old value read, the fp32 product
   added, rounded once to the weight's dtype), as Liger's and cuBLAS's ``addmm`` do; the
   column sums of ``dlogits`` to an fp32 bias accumulator.

So the forward of ``"mean"`` and ``"sum"`` computes every gradient, and the backward only
multiplies them by the upstream (scalar) gradient, in place, as Liger's fused linear
cross-entropy does. ``"none"`` cannot: its upstream gradient weighs each row, and the
weight gradient sums over rows, so its forward computes the losses only and its backward
runs the chunks again with the per-row weights as the kernel's scale.

Memory beyond the inputs, in bytes (s: the inputs' element size):

    C*V*s (a logits chunk, reused as its gradient) + C*H*s (a hidden-gradient product)
    + V*H*s + V*4 (the weight gradient, the fp32 bias accumulator) + T*H*s (the hidden
    gradient) + 8*T

of which T*H*s + V*H*s + V*s (the gradients) live until the backward. The weight gradient
is rounded to its dtype once per chunk (T/C times): an fp32 accumulator would hold twice a
bf16 gradient's memory and move twice its bytes per chunk, which made the weight
gradient's chunked sum the slowest part of the call (bench/losses.py).
With ``C = min(T, max(CHUNK_SCALE * next_power_of_2(ceil(T / ceil(V / H))), MIN_CHUNK_ROWS))``
the chunk is at most about ``2 * CHUNK_SCALE`` times the hidden states' size (or 64 rows):
for T=8192, H=4096, V=128256, C=512 and a 131 MB bf16 chunk, where the full logits would
take 2.1 GB (4.2 GB in fp32); the bf16 weight gradient takes 1.05 GB. Liger's chunk is
half this one (``CHUNK_SCALE = 1``; one buffer reused by every chunk): its peak is 66 MB
lower and, on the H100, its call 1.2x slower than ours (see ``CHUNK_SCALE``). Each chunk
is released before the next one's product allocates, so one chunk is live at a time.
Configs are ``cross_entropy``'s (``MAX_BLOCK_V``, ``TILE``).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..registry import KernelSpec, Variant
from . import _host, cross_entropy

NAME = "fused_linear_cross_entropy"

#: Chunk rows are multiplied by this (a power of two). Each chunk reads and writes the whole
#: weight gradient once (its ``acc=`` product has K = C), so doubling C halves that traffic
#: for C*V*s more bytes at the peak. Measured at 8192x4096x128256 bf16 on the H100
#: (bench/losses.py --set fused_linear_cross_entropy.CHUNK_SCALE=1): forward+backward 79.2
#: ms at 1, 53.9 ms at 2 (torch's unfused loss 52.2, Liger 64.0), for one more 66 MB chunk.
CHUNK_SCALE = 2
#: At least this many rows per chunk (all of them below it): a small batch's logits are
#: small, and each chunk costs three products and a loss launch (8 tokens over a 32000
#: vocabulary took 880 µs in 8 chunks of one row, against 119 µs for torch's unfused loss).
MIN_CHUNK_ROWS = 64


class Problem(NamedTuple):
    device: torch.device
    dtype: torch.dtype


def problem(hidden, weight, target, bias=None, ignore_index=-100, label_smoothing=0.0,
            z_loss=0.0, softcap=None, reduction="mean") -> Problem:
    """Selection key of a ``fused_linear_cross_entropy(hidden, weight, target, ...)`` call."""
    return Problem(_host.same_device(NAME, hidden=hidden, weight=weight), hidden.dtype)


def chunk_rows(n_rows: int, n_classes: int, hidden: int) -> int:
    """Rows per chunk (module docstring): the (C, V) logits chunk about ``CHUNK_SCALE``
    times the size of the (T, H) hidden states, a power of two, at least
    ``MIN_CHUNK_ROWS`` (at most ``n_rows``, at least 1)."""
    per_chunk = _host.next_power_of_2(_host.cdiv(max(n_rows, 1), _host.cdiv(n_classes, max(hidden, 1))))
    per_chunk = max(per_chunk * CHUNK_SCALE, MIN_CHUNK_ROWS)
    return max(1, min(n_rows, per_chunk))


def _check(hidden, weight, target, bias, ignore_index, label_smoothing, z_loss, softcap,
           reduction) -> None:
    _host.check_dtype(NAME, "hidden", hidden)
    _host.check_ndim(NAME, "hidden", hidden, 2, "(T, H)")
    _host.check_ndim(NAME, "weight", weight, 2, "(V, H)")
    tensors = {"hidden": hidden, "weight": weight, "target": target}
    if bias is not None:
        tensors["bias"] = bias
    _host.same_device(NAME, **tensors)
    _host.check_same_dtype(NAME, **{k: v for k, v in tensors.items() if k != "target"})
    n_classes, width = weight.shape
    if width != hidden.shape[1]:
        raise _host.InputError(
            f"{NAME}: weight must be (V, H) with H = hidden's {hidden.shape[1]} columns (an "
            f"nn.Linear's weight, not its transpose), got {tuple(weight.shape)}")
    if n_classes == 0:
        raise _host.InputError(f"{NAME}: weight needs at least one class (row), got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (n_classes,):
        raise _host.InputError(f"{NAME}: bias must have shape ({n_classes},) (weight's rows, the "
                               f"classes), got {tuple(bias.shape)}")
    cross_entropy.check_options(NAME, ignore_index, label_smoothing, z_loss, softcap, reduction)
    cross_entropy.check_target(NAME, target, hidden.shape[0], n_classes, ignore_index, "hidden")


_MATMUL: list = []  # the matmul handle, made on first use (it rebinds to a new plugin host)


def _product(a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` (or ``acc += a @ b``) by the matmul family's variant for these operands:
    its plan (selection, tuning) from the handle, launched here through the variant's own
    launcher (a backend's variant may have one), where the caller holds the device's launch
    guard (a handle call would take it again)."""
    if not _MATMUL:
        from ..dispatch import get_kernel  # not at import: dispatch loads the kernel modules

        _MATMUL.append(get_kernel("matmul"))
    if acc is None:
        plan = _MATMUL[0].plan(a, b)
        return plan.launch(plan, a, b)
    plan = _MATMUL[0].plan(a, b, acc=acc)
    return plan.launch(plan, a, b, acc=acc)


def _chunks(plan, hidden, weight, target, bias, options, *, scale=None, needs=(False, False, False)):
    """The chunk loop (module docstring). Returns the (T,) fp32 row losses and the
    gradients asked for by ``needs`` (hidden, weight, bias), each scaled by ``scale`` (the
    per-row or 0-d fp32 factor of ``cross_entropy``'s second pass), in the inputs' dtype;
    None for those not asked for."""
    ignore_index, label_smoothing, z_loss, softcap, _ = options
    n_rows, width = hidden.shape
    n_classes = weight.shape[0]
    device = hidden.device
    rows = torch.empty(n_rows, dtype=torch.float32, device=device)
    grads = any(needs)
    dh = torch.empty_like(hidden, memory_format=torch.contiguous_format) if needs[0] else None
    step = chunk_rows(n_rows, n_classes, width)
    # The weight gradient sums over every chunk: each chunk's product is added to it by
    # the matmul's epilogue (fp32 sum, one rounding per chunk), as Liger and cuBLAS's
    # addmm do; an fp32 accumulator would double the gradient's memory and the bytes each
    # chunk moves (module docstring).
    dw = torch.zeros(weight.shape, dtype=weight.dtype, device=device) if needs[1] else None
    db = torch.zeros(n_classes, dtype=torch.float32, device=device) if needs[2] else None
    weight_t = weight.t()  # (H, V): the matmul reads the strides, no copy
    for start in range(0, n_rows, step):
        end = min(start + step, n_rows)
        h = hidden[start:end]
        logits = _product(h, weight_t)
        chunk_scale = scale if scale is None or scale.dim() == 0 else scale[start:end]
        # Pass 2 reads the LSE pass 1 left in registers: none is stored.
        cross_entropy.run(plan, logits, target[start:end], loss=rows[start:end],
                          grad=logits if grads else None, scale=chunk_scale, bias=bias,
                          ignore_index=ignore_index, label_smoothing=label_smoothing,
                          z_loss=z_loss, softcap=softcap)
        if needs[0]:
            dh[start:end] = _product(logits, weight)
        if needs[1]:
            _product(logits.t(), h, acc=dw)
        if needs[2]:
            db += logits.sum(0, dtype=torch.float32)
        # Released before the next chunk's product allocates its logits: the name would
        # otherwise hold this chunk until then, two chunks at the call's peak (a memory
        # trace of a model's training step showed 125 MiB of logits live, not 63).
        del logits
    return rows, dh, dw, None if db is None else db.to(hidden.dtype)


def _needs(hidden, weight, bias) -> tuple[bool, bool, bool]:
    return (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)


def forward(plan, hidden, weight, target, bias, options, needs=(True, True, True)):
    """(loss, dhidden, dweight, dbias) for "mean" and "sum": the reduced fp32 loss and its
    gradients for an upstream gradient of 1 (None where ``needs`` says no)."""
    ignore_index, *_, reduction = options
    scale = cross_entropy.upstream_scale(plan, None, target, ignore_index, reduction)
    rows, *grads = _chunks(plan, hidden, weight, target, bias, options, scale=scale, needs=needs)
    return (cross_entropy.reduce(plan, rows, target, ignore_index, reduction), *grads)


def loss_only(plan, hidden, weight, target, bias, options) -> torch.Tensor:
    """The reduced fp32 loss, no gradient computed."""
    ignore_index, *_, reduction = options
    rows = _chunks(plan, hidden, weight, target, bias, options)[0]
    return cross_entropy.reduce(plan, rows, target, ignore_index, reduction)


def backward(plan, grad, hidden, weight, target, bias, options, needs=(True, True, True)):
    """(dhidden, dweight, dbias) for the upstream gradient ``grad`` of the reduced loss,
    by running the chunks again (what "none" needs)."""
    ignore_index, *_, reduction = options
    scale = cross_entropy.upstream_scale(plan, grad, target, ignore_index, reduction)
    return _chunks(plan, hidden, weight, target, bias, options, scale=scale, needs=needs)[1:]


def scale_saved(grads, grad: torch.Tensor) -> list:
    """The gradients the forward computed for an upstream gradient of 1, times ``grad``
    (0-d). Eager: in place, since a second copy of the weight gradient would be the call's
    largest allocation; a second backward through the same graph (``retain_graph=True``)
    then finds them changed and autograd raises, rather than scaling them twice. Traced
    (torch.compile, AOT autograd: tensor subclasses stand for the values): out of place,
    since a graph's saved activations must not be mutated by its backward."""
    if type(grad) is torch.Tensor and not torch.compiler.is_compiling():
        return [None if g is None else g.mul_(grad) for g in grads]
    return [None if g is None else g * grad for g in grads]


def _options(ignore_index, label_smoothing, z_loss, softcap, reduction) -> tuple:
    return (ignore_index, float(label_smoothing), float(z_loss),
            None if softcap is None else float(softcap), reduction)


def launch(plan, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
           bias: torch.Tensor | None = None, ignore_index: int = -100,
           label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float | None = None,
           reduction: str = "mean") -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T + bias, target, ...)`` in chunks of tokens, never
    holding the (T, V) logits.

    ``hidden`` (T, H), ``weight`` (V, H), ``bias`` (V,) or None, one float dtype (fp16,
    bf16, fp32); ``target`` (T,) int64 or int32. The options and the fp32 result are
    ``cross_entropy``'s. Differentiable in ``hidden``, ``weight`` and ``bias``; for "mean"
    and "sum" the gradients are computed in the forward (module docstring).
    """
    _check(hidden, weight, target, bias, ignore_index, label_smoothing, z_loss, softcap, reduction)
    options = _options(ignore_index, label_smoothing, z_loss, softcap, reduction)
    needs = _needs(hidden, weight, bias)
    if torch.is_grad_enabled() and any(needs):
        return _FusedLinearCrossEntropyFunction.call(hidden, weight, target, bias, plan, options, needs)
    return loss_only(plan, hidden, weight, target, bias, options)


class _FusedLinearCrossEntropyFunction(_host.Function):
    """"mean"/"sum": saves the gradients the forward computed; "none": saves the inputs
    and computes the gradients in the backward."""

    @staticmethod
    def forward(ctx, hidden, weight, target, bias, plan, options, needs):
        ctx.plan, ctx.options, ctx.needs = plan, options, needs
        ctx.has_bias = bias is not None
        if options[-1] == "none":
            ctx.save_for_backward(hidden, weight, target, bias)
            return loss_only(plan, hidden, weight, target, bias, options)
        loss, *grads = forward(plan, hidden, weight, target, bias, options, needs)
        ctx.save_for_backward(*grads)
        return loss

    @staticmethod
    def backward(ctx, grad):
        if ctx.options[-1] == "none":
            hidden, weight, target, bias = ctx.saved_tensors
            with _host.launching(grad.device):
                grads = backward(ctx.plan, grad, hidden, weight, target, bias, ctx.options, ctx.needs)
        else:
            grads = scale_saved(ctx.saved_tensors, grad)
        dh, dw, db = grads
        return dh, dw, None, db if ctx.has_bias else None, None, None, None


def reference(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
              bias: torch.Tensor | None = None, ignore_index: int = -100,
              label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float | None = None,
              reduction: str = "mean") -> torch.Tensor:
    """The projection in float64, then ``cross_entropy``'s reference (differentiable)."""
    logits = hidden.double() @ weight.double().t()
    if bias is not None:
        logits = logits + bias.double()
    return cross_entropy.reference(logits, target, ignore_index, label_smoothing, z_loss,
                                   softcap, reduction)


def inputs(shape: str, dtype: torch.dtype, device) -> tuple:
    """Random ``hidden`` (T, H), ``weight`` (V, H) scaled as an initialized projection, and
    ``target`` (T,) (shape string ``"TxHxV"``)."""
    rows, width, n_classes = _host.parse_shape(NAME, shape, "TxHxV")
    hidden = torch.randn(rows, width, device=device).to(dtype)
    weight = (torch.randn(n_classes, width, device=device) / width ** 0.5).to(dtype)
    return (hidden, weight, cross_entropy.random_target(rows, n_classes, device)), {}


def register(registry) -> None:
    registry.add_kernel(KernelSpec(
        NAME, "(hidden, weight, target, bias=None, **options) -> loss", problem,
        "the last projection and cross_entropy (its options) in chunks of tokens, never the "
        "(T, V) logits; differentiable in hidden, weight and bias", reference, inputs, "TxHxV"))
    registry.add_variant(Variant(
        NAME, "generic", launch, accepts=_host.dtype_supported,
        configs=cross_entropy.default_configs,
        replay=True, description="chunks of tokens: matmul's selected variant for the projections, "
        "cross_entropy's kernel for loss and gradient in one launch; gradients computed in "
        "the forward (mean, sum)"))
