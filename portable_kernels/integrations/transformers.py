"""Hugging Face ``transformers`` models with attention through the ``flash_attn`` kernel.

    import portable_kernels.integrations.transformers as pk_hf
    pk_hf.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="portable_kernels")

:func:`register` adds an attention implementation named ``"portable_kernels"`` to
``transformers.AttentionInterface`` and, for the same name, SDPA's mask builder to
``AttentionMaskInterface``. The mask builder matters: for a name with no mask builder,
transformers passes no mask at all, and padding would silently be ignored. With SDPA's, a
model hands the attention function exactly what it hands SDPA: ``None`` when a causal (or
no) mask says everything (prefill without padding, one-token decoding), else a boolean
(B, 1, Nq, Nk) mask.

What runs on the kernel (``portable_kernels.ops.flash_attn``, a custom op, so
``torch.compile(fullgraph=True)`` traces it): no mask, causal or not, any Nq and Nk (decoding
one token over a KV cache is non-causal attention over every cached key, as SDPA does it),
grouped-query attention with H_kv < H passed as is (no ``repeat_kv``).

What falls back to transformers' own SDPA implementation, with the reason logged once per
reason at WARNING on this module's logger (``portable_kernels.integrations.transformers``):
an explicit mask (padding, chunked prefill over a cache, sliding windows past the window),
attention dropout in training, soft-capping, position biases, attention sinks, head dims
that differ between q/k/v or exceed 256, dtypes other than fp16/bf16/fp32.

``transformers`` is an optional dependency: ``pip install 'portable-kernels[transformers]'``.
This module imports it only inside :func:`register` and the fallback.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from .. import ops

__all__ = ["NAME", "attention_forward", "fallback_reason", "register"]

NAME = "portable_kernels"

logger = logging.getLogger(__name__)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256
# kwargs some models pass that change the attention itself; the kernel has none of them.
_UNSUPPORTED_KWARGS = {
    "softcap": "logit soft-capping",
    "position_bias": "an additive position bias",
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
}
# Reasons already logged at WARNING (each is then logged at DEBUG only): a model calls
# attention once per layer per step, and one line per reason says enough.
_warned: set[str] = set()


def fallback_reason(module: torch.nn.Module | None, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, attention_mask: torch.Tensor | None,
                    dropout: float = 0.0, **kwargs: Any) -> str | None:
    """Why this call cannot run on the ``flash_attn`` kernel, or ``None`` when it can.

    ``query`` (B, H, Nq, D), ``key``/``value`` (B, H_kv, Nk, D), as transformers passes them.
    """
    if attention_mask is not None:
        return ("an explicit attention mask (padding, a chunk over a KV cache, or a sliding "
                "window) was given; flash_attn takes only causal or no masking")
    if dropout:
        return f"attention dropout p={dropout} (flash_attn has no dropout)"
    for name, what in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            return f"{what} ({name}=...) is not supported by flash_attn"
    if not query.shape[-1] == key.shape[-1] == value.shape[-1]:
        return (f"head dims differ (q {query.shape[-1]}, k {key.shape[-1]}, "
                f"v {value.shape[-1]}); flash_attn needs one head dim")
    if query.shape[-1] > _MAX_HEAD_DIM:
        return f"head dim {query.shape[-1]} exceeds flash_attn's {_MAX_HEAD_DIM}"
    if query.dtype not in _DTYPES or not query.dtype == key.dtype == value.dtype:
        return (f"dtypes q {query.dtype}, k {key.dtype}, v {value.dtype}; flash_attn takes one "
                "of float16, bfloat16, float32")
    if query.shape[0] != key.shape[0] or key.shape[1] == 0 or query.shape[1] % key.shape[1]:
        return (f"shapes q {tuple(query.shape)}, k {tuple(key.shape)}: flash_attn needs one batch "
                "size and query heads a multiple of key/value heads")
    return None


_SDPA = None


def _sdpa():
    # Looked up by register(), outside any traced region: under torch.compile, dynamo cannot
    # trace the import of transformers' lazy module (seen with transformers 5.17).
    global _SDPA
    if _SDPA is None:
        from transformers import AttentionInterface

        _SDPA = AttentionInterface._global_mapping["sdpa"]
    return _SDPA


def _log_fallback(reason: str) -> None:
    # Dynamo cannot trace a logging call (it would break the graph); under torch.compile the
    # eager run before or after says the same.
    if torch.compiler.is_compiling():
        return
    if reason in _warned:
        logger.debug("attention falls back to SDPA: %s", reason)
    else:
        _warned.add(reason)
        logger.warning("portable_kernels attention falls back to transformers' SDPA "
                       "implementation: %s", reason)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract, on the ``flash_attn`` kernel.

    ``query`` (B, H, Nq, D), ``key``/``value`` (B, H_kv, Nk, D) with H % H_kv == 0;
    ``scaling`` defaults to 1/sqrt(D); ``is_causal`` (else ``module.is_causal``, else True)
    applies when Nq > 1. Returns ``(out, None)`` with ``out`` (B, Nq, H, D) contiguous (the
    layout transformers reshapes to hidden states) and no attention weights. Calls the
    kernel cannot take go to transformers' SDPA implementation (see the module docstring).
    """
    reason = fallback_reason(module, query, key, value, attention_mask, dropout, **kwargs)
    if reason is not None:
        _log_fallback(reason)
        return _sdpa()(module, query, key, value, attention_mask, dropout=dropout,
                       scaling=scaling, is_causal=is_causal, **kwargs)
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    n_q = query.shape[2]
    # As SDPA's integration does: a single query sees every cached key (causal alignment at
    # the bottom right), so decoding is non-causal; and check the shape first, so that under
    # torch.compile with dynamic shapes this stays a plain bool.
    causal = n_q > 1 and bool(is_causal)
    if causal and key.shape[2] > n_q:
        # No mask with more keys than queries only happens when prefilling an empty static
        # cache (masking_utils drops the mask only then): the keys past Nq are empty slots
        # that top-left causal masking would hide anyway, so drop them, as SDPA's path does.
        key, value = key[:, :, :n_q], value[:, :, :n_q]
    out = ops.flash_attn(query, key, value, causal, scaling)
    return out.transpose(1, 2).contiguous(), None


def register(name: str = NAME) -> str:
    """Register :func:`attention_forward` as attention implementation ``name`` (default
    ``"portable_kernels"``) and SDPA's mask builder for it; returns ``name``. Idempotent.

    Raises:
        ImportError: ``transformers`` is not installed (``pip install
            'portable-kernels[transformers]'``).
    """
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
    except ImportError as exc:
        raise ImportError(
            "portable_kernels.integrations.transformers needs Hugging Face transformers 5 "
            "(AttentionInterface and AttentionMaskInterface): "
            "pip install 'portable-kernels[transformers]'") from exc
    AttentionInterface.register(name, attention_forward)
    _sdpa()  # resolve the fallback now, outside any torch.compile trace
    # SDPA's masks mean what this function expects: None whenever causal (or no) masking
    # says everything, so prefill and decoding reach the kernel.
    AttentionMaskInterface.register(name, AttentionMaskInterface._global_mapping["sdpa"])
    return name
