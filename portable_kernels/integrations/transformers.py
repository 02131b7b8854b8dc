"""Hugging Face ``transformers`` models with attention through our attention kernels.

    import portable_kernels.integrations.transformers as pk_hf
    pk_hf.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="portable_kernels")

:func:`register` adds an attention implementation named ``"portable_kernels"`` to
``transformers.AttentionInterface`` and, for the same name, FlashAttention's mask builder to
``AttentionMaskInterface``: a model then hands the attention function what it hands
FlashAttention-2, ``None`` when no token is padding, else the 2-D (B, Nk) padding mask (the
window of a sliding-window layer comes as ``sliding_window``, softcaps as ``softcap``, sinks
as ``s_aux``).

What runs on our kernels (``portable_kernels.ops``, custom ops, so
``torch.compile(fullgraph=True)`` traces the unpadded path):

- no padding: ``flash_attn`` with causal masking aligned bottom-right, as FlashAttention
  aligns it: prefill, chunked prefill over a cache, and decoding (one query over every
  cached key) alike; grouped-query attention with H_kv < H passed as is (no ``repeat_kv``);
- padding: the batch is unpadded (the valid keys of each sequence, and its valid queries
  among the last Nq positions) and runs through ``flash_attn_varlen``, as FlashAttention-2's
  integration does; padded query positions get zeros. (Finding the valid tokens reads the
  mask on the host: one sync per layer call, as FlashAttention-2's path has.)
- sliding windows, logit softcaps and attention sinks, as options of those kernels.

What falls back to transformers' own SDPA implementation (with the mask rebuilt as SDPA's),
with the reason logged once per reason at WARNING on this module's logger
(``portable_kernels.integrations.transformers``): attention dropout in training, additive
position biases, head dims that differ between q/k/v or exceed 256, dtypes other than
fp16/bf16/fp32.

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
# kwargs some models pass that change the attention itself; the kernels have none of them.
_UNSUPPORTED_KWARGS = {
    "position_bias": "an additive position bias",
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
    if attention_mask is not None and attention_mask.dim() != 2:
        return (f"a {attention_mask.dim()}-D attention mask was given; the kernels take "
                "FlashAttention's 2-D padding mask (register() sets its mask builder)")
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


def _window(sliding_window: int | None, n_k: int) -> tuple[int, int]:
    """transformers' ``sliding_window`` (tokens seen, the current one included) as
    FlashAttention's inclusive ``window_size``, as its FlashAttention-2 path converts it."""
    if sliding_window is None or n_k <= sliding_window:
        return (-1, -1)
    return (sliding_window - 1, sliding_window - 1)


def _sdpa_mask(mask: torch.Tensor | None, n_q: int, n_k: int, causal: bool,
               window: tuple[int, int]) -> torch.Tensor | None:
    """The (B, 1, Nq, Nk) boolean mask SDPA needs for what our kernels would have computed
    from a padding mask (or none): bottom-right causal, the window, the valid keys. Rows
    of padded queries (nothing visible) see every key instead: their outputs are ignored,
    and SDPA returns NaN for a row with no key."""
    if mask is None and n_q == n_k and window == (-1, -1):
        return None  # SDPA's is_causal (top-left) is bottom-right when Nq == Nk
    device = mask.device if mask is not None else None
    rel = (torch.arange(n_k, device=device)[None, :] - torch.arange(n_q, device=device)[:, None]
           - (n_k - n_q))
    allowed = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
    left, right = window
    if causal:
        right = 0
    if left >= 0:
        allowed &= rel >= -left
    if right >= 0:
        allowed &= rel <= right
    allowed = allowed[None, None]
    if mask is not None:
        allowed = allowed & mask.bool()[:, None, None, :]
    return allowed | ~allowed.any(-1, keepdim=True)


def _packed(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` of a (B, H, N, D) tensor's (B·N, H, D) token view."""
    b, h, n, d = t.shape
    return t.transpose(1, 2).reshape(b * n, h, d)[index]


def _cu_seqlens(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(token indices, int32 cu_seqlens, longest length) of a (B, N) validity mask."""
    lengths = valid.sum(1, dtype=torch.int32)
    cu = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    return valid.flatten().nonzero().squeeze(1), cu, int(lengths.max()) if lengths.numel() else 0


def _unpadded(query, key, value, mask, causal, scaling, options) -> torch.Tensor:
    """Attention of a padded batch through ``flash_attn_varlen``: (B, Nq, H, D), zeros at
    padded query positions."""
    b, h, n_q, d = query.shape
    valid_k = mask.bool()
    if valid_k.shape[1] < key.shape[2]:
        # A static cache longer than the tokens seen: its first slots are the filled ones.
        key, value = key[:, :, :valid_k.shape[1]], value[:, :, :valid_k.shape[1]]
    valid_q = valid_k[:, -n_q:]
    index_q, cu_q, max_q = _cu_seqlens(valid_q)
    index_k, cu_k, max_k = _cu_seqlens(valid_k)
    out = ops.flash_attn_varlen(_packed(query, index_q), _packed(key, index_k),
                                _packed(value, index_k), cu_q, cu_k, max_q, max_k, causal,
                                scaling, **options)
    full = out.new_zeros((b * n_q, h, d)).index_copy(0, index_q, out)
    return full.view(b, n_q, h, d)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract, on our attention kernels.

    ``query`` (B, H, Nq, D), ``key``/``value`` (B, H_kv, Nk, D) with H % H_kv == 0;
    ``attention_mask`` None or a 2-D (B, Nk) padding mask (FlashAttention's mask builder);
    ``scaling`` defaults to 1/sqrt(D); ``is_causal`` (else ``module.is_causal``, else True)
    aligned bottom-right; ``sliding_window``, ``softcap`` and ``s_aux`` (sinks) as
    FlashAttention-2's integration takes them. Returns ``(out, None)`` with ``out``
    (B, Nq, H, D) contiguous (the layout transformers reshapes to hidden states) and no
    attention weights. Calls the kernels cannot take go to transformers' SDPA
    implementation (see the module docstring).
    """
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    causal = bool(is_causal)
    n_q, n_k = query.shape[2], key.shape[2]
    window = _window(kwargs.pop("sliding_window", None), n_k)
    reason = fallback_reason(module, query, key, value, attention_mask, dropout, **kwargs)
    if reason is not None:
        _log_fallback(reason)
        mask = _sdpa_mask(attention_mask, n_q, n_k, causal, window)
        return _sdpa()(module, query, key, value, mask, dropout=dropout, scaling=scaling,
                       is_causal=causal and mask is None, **kwargs)
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    options = dict(window_size=window, softcap=kwargs.get("softcap") or 0.0, sinks=sinks)
    if attention_mask is not None and not torch.compiler.is_compiling() \
            and bool(attention_mask.all()) and attention_mask.shape[1] <= n_k:
        # A static cache with no padding: its filled slots come first.
        key, value = key[:, :, :attention_mask.shape[1]], value[:, :, :attention_mask.shape[1]]
        attention_mask = None
    if attention_mask is not None:
        return _unpadded(query, key, value, attention_mask, causal, scaling, options), None
    out = ops.flash_attn(query, key, value, causal, scaling, align="bottom_right", **options)
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
    # FlashAttention's masks: None without padding (prefill and decoding reach the kernel
    # as they are), else the 2-D padding mask that the packed path unpads with.
    AttentionMaskInterface.register(
        name, AttentionMaskInterface._global_mapping["flash_attention_2"])
    return name
