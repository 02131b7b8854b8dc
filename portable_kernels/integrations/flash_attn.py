"""FlashAttention's Python API (``flash_attn`` 2.x) on portable-kernels' attention.

Code written against FlashAttention ports by changing its import::

    # from flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
    from portable_kernels.integrations.flash_attn import (
        flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache)

The functions take FlashAttention's layouts, defaults and argument names, and run
``ops.flash_attn`` (its (B, S, H, D) tensors viewed as (B, H, S, D)),
``ops.flash_attn_varlen`` and ``ops.flash_attn_with_kvcache`` on the variant for the
tensors' device. Semantics are FlashAttention's: causal masks aligned to the bottom right
(FlashAttention >= 2.1), ``window_size=(left, right)`` in keys, ``softcap``, ``alibi_slopes``,
the log-sum-exp in natural log, (B, H, Sq) (packed: (H, total_q)). Outputs are new
contiguous tensors in FlashAttention's layout.

What FlashAttention has and these functions do not is refused with an error naming the
argument, never ignored: attention dropout (``dropout_p > 0``), the attention probabilities
(``return_attn_probs`` gives ``(out, lse, None)``, as FlashAttention does without dropout),
rotary embeddings inside the cache call (``rotary_cos``/``rotary_sin``: rotate q and k with
``ops.rope`` first), ``cache_batch_idx``, ``cache_leftpad``, and a paged ``block_table`` in
the varlen call. ``deterministic`` is accepted: the backward kernels sum each key block's
gradients in one program (no atomics) on every variant but sm_90's Gluon backward, which
adds dq up with the copy engine's reductions from 2048 keys on (``nvidia.hopper_gluon``,
backends/nvidia/README.md): with ``deterministic=True`` such calls run ``nvidia.hopper``.
"""
from __future__ import annotations

import contextlib
from typing import Optional, Union

import torch

from .. import ops
from ..dispatch import explain, use_variant
from ..errors import ArgumentError

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
           "flash_attn_varlen_func", "flash_attn_with_kvcache"]

#: The variant whose backward is not deterministic, and the one its calls run instead.
_NONDETERMINISTIC, _DETERMINISTIC = "nvidia.hopper_gluon", "nvidia.hopper"


def _refuse(name: str, **unsupported) -> None:
    """An error naming the first argument given (``(given, why)`` per argument) that these
    functions cannot honour."""
    for arg, (given, why) in unsupported.items():
        if given:
            raise ArgumentError(f"{name}: {arg} is not supported ({why})")


def _deterministic(deterministic: bool, *args, **kwargs):
    """A context forcing ``flash_attn``'s deterministic backward where ``deterministic``
    asks for it and dispatch would pick the Gluon kernels for ``args`` (flash_attn's)."""
    if not deterministic or args[0].device.type != "cuda":
        return contextlib.nullcontext()
    if explain("flash_attn", *args, **kwargs).variant != _NONDETERMINISTIC:
        return contextlib.nullcontext()
    return use_variant(flash_attn=_DETERMINISTIC)


def _check_dropout(name: str, dropout_p: float) -> None:
    _refuse(name, dropout_p=(dropout_p != 0, f"got {dropout_p}; no attention dropout: pass 0.0"))


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    softmax_scale: Optional[float] = None, causal: bool = False,
                    window_size=(-1, -1), softcap: float = 0.0,
                    alibi_slopes: Optional[torch.Tensor] = None, deterministic: bool = False,
                    return_attn_probs: bool = False):
    """FlashAttention's ``flash_attn_func``: q (B, Sq, H, D), k/v (B, Sk, H_kv, D) with
    H % H_kv == 0, fp16/bf16 (fp32 too); ``causal`` aligned to the bottom right. Returns
    out (B, Sq, H, D), or with ``return_attn_probs`` ``(out, lse (B, H, Sq) fp32, None)``.
    Differentiable in q, k, v."""
    _check_dropout("flash_attn_func", dropout_p)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    options = dict(window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                   align="bottom_right")
    with _deterministic(deterministic, q, k, v, causal, softmax_scale, **options):
        out = ops.flash_attn(q, k, v, causal, softmax_scale, **options,
                             return_lse=return_attn_probs)
    if return_attn_probs:
        return out[0].transpose(1, 2).contiguous(), out[1], None
    return out.transpose(1, 2).contiguous()


def flash_attn_kvpacked_func(q: torch.Tensor, kv: torch.Tensor, dropout_p: float = 0.0,
                             softmax_scale: Optional[float] = None, causal: bool = False,
                             window_size=(-1, -1), softcap: float = 0.0,
                             alibi_slopes: Optional[torch.Tensor] = None,
                             deterministic: bool = False, return_attn_probs: bool = False):
    """:func:`flash_attn_func` with k and v stacked: kv (B, Sk, 2, H_kv, D)."""
    if kv.dim() != 5 or kv.shape[2] != 2:
        raise ArgumentError(f"flash_attn_kvpacked_func: kv must be (B, Sk, 2, H_kv, D), got "
                            f"{tuple(kv.shape)}")
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal,
                           window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_qkvpacked_func(qkv: torch.Tensor, dropout_p: float = 0.0,
                              softmax_scale: Optional[float] = None, causal: bool = False,
                              window_size=(-1, -1), softcap: float = 0.0,
                              alibi_slopes: Optional[torch.Tensor] = None,
                              deterministic: bool = False, return_attn_probs: bool = False):
    """:func:`flash_attn_func` with q, k and v stacked: qkv (B, S, 3, H, D)."""
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ArgumentError(f"flash_attn_qkvpacked_func: qkv must be (B, S, 3, H, D), got "
                            f"{tuple(qkv.shape)}")
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale,
                           causal, window_size, softcap, alibi_slopes, deterministic,
                           return_attn_probs)


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size=(-1, -1), softcap: float = 0.0,
                           alibi_slopes: Optional[torch.Tensor] = None,
                           deterministic: bool = False, return_attn_probs: bool = False,
                           block_table: Optional[torch.Tensor] = None):
    """FlashAttention's ``flash_attn_varlen_func``: packed q (total_q, H, D), k/v
    (total_k, H_kv, D), ``cu_seqlens_*`` int32 (batch + 1,). Returns out (total_q, H, D),
    or with ``return_attn_probs`` ``(out, lse (H, total_q) fp32, None)``. Differentiable in
    q, k, v."""
    name = "flash_attn_varlen_func"
    _check_dropout(name, dropout_p)
    _refuse(name, block_table=(block_table is not None,
                               "paged keys: use flash_attn_with_kvcache's block_table"))
    # (deterministic: every varlen variant's backward is; the Gluon kernels take no varlen.)
    out = ops.flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, causal, softmax_scale, window_size, softcap,
                                alibi_slopes, None, return_attn_probs)
    return (*out, None) if return_attn_probs else out


def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None,
                            rotary_cos: Optional[torch.Tensor] = None,
                            rotary_sin: Optional[torch.Tensor] = None,
                            cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
                            cache_batch_idx: Optional[torch.Tensor] = None,
                            cache_leftpad: Optional[torch.Tensor] = None,
                            block_table: Optional[torch.Tensor] = None,
                            softmax_scale: Optional[float] = None, causal: bool = False,
                            window_size=(-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True,
                            alibi_slopes: Optional[torch.Tensor] = None, num_splits: int = 0,
                            return_softmax_lse: bool = False):
    """FlashAttention's ``flash_attn_with_kvcache`` (``causal=False`` by default, as there):
    q (B, Sq, H, D); caches (B, N_max, H_kv, D), or paged (num_blocks, block_size, H_kv, D)
    with ``block_table`` (B, max_blocks) int32; ``k``/``v`` (B, S_new, H_kv, D) appended
    in place at ``cache_seqlens`` first. Returns out (B, Sq, H, D), with
    ``return_softmax_lse`` also the lse (B, H, Sq) fp32. No gradient (inference)."""
    name = "flash_attn_with_kvcache"
    _refuse(name,
            rotary_cos=(rotary_cos is not None, "rotate q and k with ops.rope first"),
            rotary_sin=(rotary_sin is not None, "rotate q and k with ops.rope first"),
            cache_batch_idx=(cache_batch_idx is not None, "index the caches first"),
            cache_leftpad=(cache_leftpad is not None, "caches start at position 0"))
    return ops.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                                       causal, softmax_scale, window_size, softcap,
                                       alibi_slopes, None, num_splits, return_softmax_lse)
