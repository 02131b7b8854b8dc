"""flash_attn_varlen: attention over a packed batch of sequences of different lengths, in
FlashAttention's ``flash_attn_varlen_func`` layout, forward and backward.

``q`` (total_q, H, D) and ``k``, ``v`` (total_k, H_kv, D) hold the sequences one after the
other; ``cu_seqlens_q``/``cu_seqlens_k`` (int32, batch + 1) say where each starts, so that
sequence ``b`` is rows ``cu[b]:cu[b+1]``. No padding is computed: a program whose query
block lies past its sequence's end returns at once. ``causal`` is aligned bottom-right per
sequence, as FlashAttention >= 2.1 does: query ``i`` of a sequence sees keys up to
``i + Nk - Nq`` (what chunked prefill needs); the window, softcap, ALiBi and sinks follow
``_attn_mods``. A sequence with no keys gives zero outputs and an LSE of -inf.

It runs ``flash_attn``'s kernels with their ``VARLEN`` switch (one kernel source, as
rms_norm runs layer_norm's): each program reads its sequence's start and lengths from
``cu_seqlens`` and offsets its bases by them; the tensors are seen as (1, H, total, D) views
with no batch stride. Every ``flash_attn`` variant's switches apply (backends register each
for this family too) and its configs are ``flash_attn``'s. The grid covers
``max_seqlen_q`` (``max_seqlen_k`` sizes the autotuning bucket), so those must bound the
lengths; ``PK_CHECK_VALUES=1`` checks that and that ``cu_seqlens`` rise from 0 to the totals,
which needs the values on the host (a sync), so it is off by default.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from ..registry import KernelSpec, Variant
from . import _attn_mods, _host, flash_attn

NAME = "flash_attn_varlen"


def _check_cu(name: str, cu: Any, device: torch.device, batch: int | None) -> int:
    _host.check_aux(NAME, name, cu, device, torch.int32)
    if cu.dim() != 1 or cu.shape[0] < 1:
        raise _host.InputError(f"{NAME}: {name} must have shape (batch + 1,), got "
                               f"{tuple(cu.shape)}")
    if batch is not None and cu.shape[0] - 1 != batch:
        raise _host.InputError(f"{NAME}: cu_seqlens_q and cu_seqlens_k must have the same "
                               f"length (batch + 1), got {batch + 1} and {cu.shape[0]}")
    return cu.shape[0] - 1


def _check_values(cu: torch.Tensor, name: str, total: int, max_len: int, max_name: str) -> None:
    """``PK_CHECK_VALUES=1``: ``cu`` rises from 0 to ``total`` in steps of at most
    ``max_len``."""
    values = cu.tolist()
    if values[0] != 0 or values[-1] != total:
        raise _host.InputError(f"{NAME}: {name} must start at 0 and end at the total number of "
                               f"rows ({total}), got {values[0]} ... {values[-1]}")
    steps = [b - a for a, b in zip(values, values[1:])]
    if any(s < 0 for s in steps):
        raise _host.InputError(f"{NAME}: {name} must not decrease, got {values}")
    if steps and max(steps) > max_len:
        raise _host.InputError(f"{NAME}: {max_name}={max_len} is below the longest sequence "
                               f"({max(steps)}) of {name}")


def problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
            sm_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None,
            return_lse=False) -> flash_attn.Problem:
    """Check a ``flash_attn_varlen`` call and return its selection key (``flash_attn``'s,
    for the (1, H, total, D) views the kernels see). A call seen before (its signature:
    shapes, strides, dtypes, devices, alignment, scalars) is not checked again; value
    checks under ``PK_CHECK_VALUES=1`` run on every call."""
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, sm_scale,
            window_size, softcap, alibi_slopes, sinks, return_lse)
    return _CHECKED.lookup(None if _host.check_values() else _signature(*args), _problem, *args)


def _signature(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
               sm_scale, window_size, softcap, alibi_slopes, sinks, return_lse) -> tuple | None:
    """Everything :func:`_problem` reads of a call (with the tensors' alignment: the
    selection key reads it), or None for a call not to memoise (ALiBi slopes or sinks,
    whose options hold the tensors; arguments the checks must reject)."""
    if alibi_slopes is not None or sinks is not None or type(window_size) is not tuple:
        return None
    try:
        described = _host.described
        return (described(q), described(k), described(v), described(cu_seqlens_q),
                described(cu_seqlens_k),
                _host.typed(max_seqlen_q, max_seqlen_k, causal, sm_scale, softcap, return_lse),
                _host.typed(*window_size))
    except (AttributeError, TypeError):  # _problem names the bad argument
        return None


#: Problems of calls already checked (``problem``): a serving loop repeats batch shapes.
_CHECKED = _host.CheckedCalls()


def _problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
             sm_scale, window_size, softcap, alibi_slopes, sinks, return_lse) -> flash_attn.Problem:
    device = _host.same_device(NAME, q=q, k=k, v=v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _host.check_ndim(NAME, name, t, 3, "(total, H, D)")
        _host.check_dtype(NAME, name, t)
    dtype = _host.check_same_dtype(NAME, q=q, k=k, v=v)
    (_, h, d), (total_k, h_kv, dk), (total_v, h_v, dv) = q.shape, k.shape, v.shape
    if not d == dk == dv:
        raise _host.InputError(
            f"{NAME}: q, k and v must have the same head dim D, got q {d}, k {dk}, v {dv}")
    if h_kv != h_v or total_k != total_v:
        raise _host.InputError(f"{NAME}: k and v must have the same shape, got k "
                               f"{tuple(k.shape)}, v {tuple(v.shape)}")
    _attn_mods.check_heads(NAME, h, h_kv, d)
    batch = _check_cu("cu_seqlens_q", cu_seqlens_q, device, None)
    _check_cu("cu_seqlens_k", cu_seqlens_k, device, batch)
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        _host.check_int(NAME, name, value)
        if value < 0:
            raise _host.InputError(f"{NAME}: {name} must be >= 0, got {value}")
    _attn_mods.check_scale(NAME, sm_scale)
    options = _attn_mods.check_options(
        NAME, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, sinks=sinks, batch=batch, heads=h, device=device)
    _host.check_bool(NAME, "return_lse", return_lse)
    if _host.check_values():
        _check_values(cu_seqlens_q, "cu_seqlens_q", q.shape[0], max_seqlen_q, "max_seqlen_q")
        _check_values(cu_seqlens_k, "cu_seqlens_k", total_k, max_seqlen_k, "max_seqlen_k")
    q4, k4, v4 = views(q, k, v)
    return flash_attn.Problem(device, dtype, d, bool(causal), h != h_kv,
                              flash_attn._descriptor_issue(d, q4, k4, v4),
                              flash_attn.key_class(max_seqlen_k),
                              flash_attn.options_key(options, True))


def launch(plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
           max_seqlen_k: int, causal: bool = False, sm_scale: float | None = None,
           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
           alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
           return_lse: bool = False):
    """Attention of each sequence of a packed batch (module docstring).

    q (total_q, H, D), k/v (total_k, H_kv, D) fp16/bf16/fp32 with H % H_kv == 0,
    ``cu_seqlens_q``/``cu_seqlens_k`` int32 (batch + 1,), ``max_seqlen_*`` at least the
    longest sequence; options as ``flash_attn``'s (``alibi_slopes`` (H,) or (batch, H)).
    Returns a new contiguous (total_q, H, D) tensor of q's dtype, differentiable in q, k, v
    and sinks; with ``return_lse`` also the fp32 LSE, (H, total_q) as FlashAttention's.
    """
    causal = bool(causal)
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
    mods = packed_mods(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                       window_size, softcap, alibi_slopes, sinks)
    q4, k4, v4 = views(q, k, v)
    result = flash_attn.run(plan, q4, k4, v4, causal, scale, mods, return_lse)
    if return_lse:
        return result[0][0].transpose(0, 1), result[1]
    return result[0].transpose(0, 1)


def packed_mods(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                sinks=None) -> flash_attn.Mods:
    """``flash_attn``'s :class:`~flash_attn.Mods` of a packed call (options checked)."""
    batch = cu_seqlens_q.shape[0] - 1
    options = _attn_mods.check_options(
        NAME, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, sinks=sinks, batch=batch, heads=q.shape[1], device=q.device)
    return flash_attn.Mods(options, True, cu_seqlens_q, cu_seqlens_k, batch, int(max_seqlen_q),
                           int(max_seqlen_k), q.shape[0])


def views(*packed: torch.Tensor) -> tuple:
    """(total, H, D) tensors as the (1, H, total, D) views ``flash_attn``'s kernels take."""
    return tuple(t.transpose(0, 1)[None] for t in packed)


def reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
              causal=False, sm_scale=None, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None, sinks=None, return_lse=False):
    """Each sequence through ``_attn_mods.reference`` (bottom-right aligned), in float64:
    (total_q, H, D), and with ``return_lse`` the (H, total_q) LSE."""
    cq, ck = ([int(n) for n in cu.tolist()] for cu in (cu_seqlens_q, cu_seqlens_k))
    outs, lses = [], []
    for b in range(len(cq) - 1):
        qs, ks = q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]]
        vs = v[ck[b]:ck[b + 1]]
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]
        o, lse = _attn_mods.reference(
            *(t.transpose(0, 1)[None] for t in (qs, ks, vs)), causal=causal,
            diag=ks.shape[0] - qs.shape[0], window_size=window_size, softcap=softcap,
            alibi_slopes=slopes, sinks=sinks, sm_scale=sm_scale)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    out = torch.cat(outs) if outs else q.double().new_zeros(q.shape)
    lse = torch.cat(lses, dim=1) if lses else q.double().new_zeros((q.shape[1], 0))
    return (out, lse) if return_lse else out


def inputs(shape: str, dtype: torch.dtype, device) -> tuple:
    """A random packed batch (shape string ``"LENGTHSxHxD"``, lengths ``+``-separated, the
    same for queries and keys, e.g. ``"100+4096+7x8x128"``), causal."""
    lengths, h, d = shape.split("x")
    lens = [int(n) for n in lengths.split("+")]
    h, d = int(h), int(d)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                      device=device)
    total = sum(lens)
    q, k, v = (torch.randn(total, h, d, device=device).to(dtype) for _ in range(3))
    return (q, k, v, cu, cu, max(lens), max(lens)), {"causal": True}


def variant(name: str, *, switches: dict[str, Any] | None = None, **kwargs: Any) -> Variant:
    """A ``flash_attn_varlen`` variant: ``flash_attn``'s kernels with ``switches`` (see
    :func:`flash_attn.variant`); backends register one beside each of their ``flash_attn``
    variants."""
    base = flash_attn.variant(name, switches=switches, **kwargs)
    return Variant(NAME, name, launch, switches=base.switches,
                   **{f: getattr(base, f) for f in ("requires", "priority", "accepts", "configs",
                                                     "description", "replay")})


def register(registry) -> None:
    registry.add_kernel(KernelSpec(
        NAME, "(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, **options) -> out",
        problem, "packed batch (FlashAttention's varlen layout), bottom-right causal, "
        "options as flash_attn's; differentiable", reference, inputs, "LENGTHSxHxD"))
    registry.add_variant(variant(
        "generic",
        description="flash_attn's kernels with VARLEN: sequence bounds from cu_seqlens, "
        "no padding computed"))
