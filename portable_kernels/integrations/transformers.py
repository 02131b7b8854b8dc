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
  aligns it: prefill and chunked prefill over a cache; decoding steps (up to
  ``DECODE_MAX_QUERIES`` queries over more keys, no gradient) on ``flash_attn_with_kvcache``
  over transformers' own cache (read through its strides); grouped-query attention with
  H_kv < H passed as is (no ``repeat_kv``);
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

:func:`apply` (the end of this module) goes further for Llama, Mistral, Qwen2, Qwen3 and
Gemma 1-3 models: their RMSNorm modules, gated MLPs and rotary embeddings run on
``ops.rms_norm``, ``ops.swiglu``/``ops.geglu`` and ``ops.rope``; :func:`undo` reverses it.

``transformers`` is an optional dependency: ``pip install 'portable-kernels[transformers]'``.
This module imports it only inside :func:`register` and the fallback.
"""
from __future__ import annotations

import logging
import types
from typing import Any

import torch

from .. import ops

__all__ = ["NAME", "attention_forward", "fallback_reason", "register", "apply", "undo"]

NAME = "portable_kernels"

logger = logging.getLogger(__name__)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: Calls of at most this many queries over more keys (decoding, speculative decoding)
#: without a gradient go to ``flash_attn_with_kvcache``, whose split over the keys keeps
#: the GPU busy when Nq is small.
DECODE_MAX_QUERIES = 16
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
    if n_q <= DECODE_MAX_QUERIES and n_k > n_q and not torch.is_grad_enabled():
        # Decoding (or speculative decoding) over the cache transformers keeps: the serving
        # kernel reads the (B, H_kv, N, D) cache through its strides as FlashAttention's
        # (B, N, H_kv, D), splitting the keys across programs.
        out = ops.flash_attn_with_kvcache(query.transpose(1, 2), key.transpose(1, 2),
                                          value.transpose(1, 2), causal=causal,
                                          sm_scale=scaling, **options)
        return out.contiguous(), None
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


# --- the model patcher: norms, rotary embeddings and gated MLPs on our kernels ------------------
#
# apply(model) swaps, per module instance (an instance ``forward``; the class is untouched),
# the RMSNorm modules and gated MLPs of the architectures below for ``ops.rms_norm`` and
# ``ops.swiglu``/``ops.geglu``, and the rotary embedding of their attention for ``ops.rope``.
# Rotary embeddings are a function of the modeling module (``apply_rotary_pos_emb``, which
# the attention's forward calls), not of a module instance: it is replaced in that modeling
# module while at least one applied model of the architecture remains, so other models of
# the same architecture run it on the kernel meanwhile (the same math). undo(model) puts
# everything back. Nothing here is read from the weights' values: no device sync.

#: RMSNorm classes and the offset their weight takes (Gemma's ``1 + w``).
RMS_NORMS = {
    "LlamaRMSNorm": 0.0, "MistralRMSNorm": 0.0, "Qwen2RMSNorm": 0.0, "Qwen3RMSNorm": 0.0,
    "GemmaRMSNorm": 1.0, "Gemma2RMSNorm": 1.0, "Gemma3RMSNorm": 1.0,
}
#: Gated MLP classes: ``down_proj(act(gate_proj(x)) * up_proj(x))``.
GATED_MLPS = {"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "GemmaMLP", "Gemma2MLP", "Gemma3MLP"}
#: Attention classes whose modeling module's ``apply_rotary_pos_emb`` is the half rotation
#: by (B, S, D) cos and sin tables with both halves equal (their rotary embeddings').
ROTARY_ATTENTIONS = {"LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention",
                     "GemmaAttention", "Gemma2Attention", "Gemma3Attention"}

#: Causal-LM heads whose training loss apply() computes with fused_linear_cross_entropy.
CAUSAL_LMS = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
              "GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"}

_PATCH = "_pk_patch"            # on an applied model: what apply() did, for undo()
_ORIGINAL = "_pk_original_rope"  # on a modeling module: its own apply_rotary_pos_emb
_rotary_users: dict[str, int] = {}  # modeling module -> applied models using its rotary


def _causal_lm_forward(original):
    """A causal-LM head's forward that, when a loss with a gradient is asked for, hands the
    decoder's hidden states to ``ops.fused_linear_cross_entropy`` instead of materialising
    the (tokens, vocabulary) logits: the loss of transformers' ``ForCausalLMLoss`` (labels
    shifted by one, ``ignore_index`` -100, mean over counted tokens, or the sum over
    ``num_items_in_batch``), Gemma 2/3's final-logit softcap included. It returns no
    logits then (as Liger's fused loss does); every other call runs ``original``."""
    def forward(self, input_ids=None, labels=None, logits_to_keep=0, **kwargs):
        if labels is None or not torch.is_grad_enabled():
            return original(input_ids=input_ids, labels=labels, logits_to_keep=logits_to_keep,
                            **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        num_items = kwargs.pop("num_items_in_batch", None)
        shift_labels = kwargs.pop("shift_labels", None)
        outputs = self.model(input_ids=input_ids, **kwargs)
        hidden = outputs.last_hidden_state
        if shift_labels is None:
            shift_labels = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
        loss = ops.fused_linear_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]), self.lm_head.weight,
            shift_labels.reshape(-1).to(hidden.device), self.lm_head.bias,
            softcap=getattr(self.config, "final_logit_softcapping", None),
            reduction="mean" if num_items is None else "sum")
        if num_items is not None:
            loss = loss / num_items
        return CausalLMOutputWithPast(loss=loss, logits=None,
                                      hidden_states=outputs.hidden_states,
                                      attentions=outputs.attentions)

    return forward


def _activation(act: torch.nn.Module) -> str | None:
    """``"swiglu"`` or ``"geglu"`` for the activations our kernels compute, else None."""
    name = type(act).__name__
    if name in ("SiLU", "SiLUActivation"):
        return "swiglu"
    if name in ("GELUTanh", "PytorchGELUTanh", "NewGELUActivation") or (
            name == "GELU" and getattr(act, "approximate", "none") == "tanh"):
        return "geglu"
    return None


def _fallback(what: str, reason: str, original, *args):
    _log_patch_fallback(f"{what}: {reason}")
    return original(*args)


def _log_patch_fallback(reason: str) -> None:
    if torch.compiler.is_compiling():
        return
    if reason in _warned:
        logger.debug("falls back to transformers' own code: %s", reason)
    else:
        _warned.add(reason)
        logger.warning("portable_kernels falls back to transformers' own code for %s", reason)


def _rms_norm_forward(offset: float):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if x.dtype != weight.dtype or x.dtype not in _DTYPES:
            return _fallback(type(self).__name__, f"input {x.dtype} with weight {weight.dtype}",
                             type(self).forward, self, x)
        eps = getattr(self, "variance_epsilon", getattr(self, "eps", 1e-6))
        return ops.rms_norm(x, weight, eps, offset)
    return forward


def _mlp_forward(kernel: str):
    glu = getattr(ops, kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if gate.dtype not in _DTYPES or gate.dtype != up.dtype:
            return self.down_proj(self.act_fn(gate) * up)
        return self.down_proj(glu(gate, up))
    return forward


def _rope_fallback_reason(q, k, cos, sin, unsqueeze_dim) -> str | None:
    if unsqueeze_dim not in (1, 2) or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3:
        return (f"q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)} with "
                f"unsqueeze_dim={unsqueeze_dim}: rope takes (B, H, S, D) and (B, S, D) tables")
    seq_dim = 2 if unsqueeze_dim == 1 else 1
    if (cos.shape != sin.shape or cos.shape[-1] != q.shape[-1] or q.shape[-1] % 2
            or cos.shape[1] != q.shape[seq_dim] or cos.shape[0] not in (1, q.shape[0])):
        return f"tables cos {tuple(cos.shape)}, sin {tuple(sin.shape)} for q {tuple(q.shape)}"
    if q.dtype not in _DTYPES or q.dtype != k.dtype or cos.dtype not in _DTYPES:
        return f"dtypes q {q.dtype}, k {k.dtype}, cos {cos.dtype}"
    if cos.requires_grad or sin.requires_grad:
        return "cos and sin require a gradient, which rope does not give them"
    return None


def _rope_function(original):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        """transformers' rotary embedding on ``ops.rope``: each token's (B, S, D) cos and sin
        row (halves equal, as these models' rotary embeddings make them) is a row of a
        (B * S, D / 2) table, and token (b, s) takes row b * S + s."""
        reason = _rope_fallback_reason(q, k, cos, sin, unsqueeze_dim)
        if reason is not None:
            return _fallback("apply_rotary_pos_emb", reason, original, q, k, cos, sin, unsqueeze_dim)
        b, s, d = cos.shape
        half = d // 2
        cos_t, sin_t = cos.reshape(b * s, d)[:, :half], sin.reshape(b * s, d)[:, :half]
        positions = torch.arange(b * s, device=q.device).view(b, s).expand(q.shape[0], s)
        if unsqueeze_dim == 1:  # (B, H, S, D): the kernel takes (B, S, H, D) views
            q_out, k_out = ops.rope(q.transpose(1, 2), k.transpose(1, 2), cos_t, sin_t, positions)
            return q_out.transpose(1, 2), k_out.transpose(1, 2)
        return ops.rope(q, k, cos_t, sin_t, positions)
    apply_rotary_pos_emb.__wrapped__ = original
    return apply_rotary_pos_emb


def _patch_rotary(module_name: str) -> None:
    import sys

    mod = sys.modules[module_name]
    if _rotary_users.get(module_name, 0) == 0:
        original = mod.apply_rotary_pos_emb
        setattr(mod, _ORIGINAL, original)
        mod.apply_rotary_pos_emb = _rope_function(original)
    _rotary_users[module_name] = _rotary_users.get(module_name, 0) + 1


def _unpatch_rotary(module_name: str) -> None:
    import sys

    mod = sys.modules[module_name]
    _rotary_users[module_name] -= 1
    if _rotary_users[module_name] == 0:
        mod.apply_rotary_pos_emb = getattr(mod, _ORIGINAL)
        delattr(mod, _ORIGINAL)
        del _rotary_users[module_name]


def apply(model: torch.nn.Module) -> dict[str, int]:
    """Run ``model``'s RMSNorm modules, gated MLPs, rotary embeddings and attention on our
    kernels (``ops.rms_norm``, ``ops.swiglu``/``ops.geglu``, ``ops.rope``, and
    ``attn_implementation`` set to :data:`NAME`, see :func:`attention_forward`; :func:`undo`
    sets the previous one back), for the Llama, Mistral,
    Qwen2, Qwen3 and Gemma 1-3 classes named in :data:`RMS_NORMS`, :data:`GATED_MLPS` and
    :data:`ROTARY_ATTENTIONS`, and the training loss of the heads in :data:`CAUSAL_LMS`
    through ``ops.fused_linear_cross_entropy`` (:func:`_causal_lm_forward`); other modules
    are left alone. Returns how many of each were patched (``{"rms_norm": n, "mlp": m,
    "rotary": modules, "loss": heads}``) and logs it at INFO.

    Idempotent (a second call changes nothing and returns the first call's counts);
    :func:`undo` reverses it. Calls the kernels cannot take (mixed dtypes, tables of
    another shape) run transformers' own code, with the reason logged once at WARNING.
    """
    done = getattr(model, _PATCH, None)
    if done is not None:
        logger.debug("portable_kernels: %s is already patched", type(model).__name__)
        return done["counts"]
    patched, rotary = [], []
    for module in model.modules():
        name = type(module).__name__
        if name in RMS_NORMS:
            module.forward = types.MethodType(_rms_norm_forward(RMS_NORMS[name]), module)
            patched.append(module)
        elif name in GATED_MLPS:
            kernel = _activation(module.act_fn)
            if kernel is None:
                logger.info("portable_kernels: %s keeps its activation %s (no kernel for it)",
                            name, type(module.act_fn).__name__)
                continue
            module.forward = types.MethodType(_mlp_forward(kernel), module)
            patched.append(module)
        elif name in ROTARY_ATTENTIONS and type(module).__module__ not in rotary:
            rotary.append(type(module).__module__)
        elif name in CAUSAL_LMS and hasattr(module, "lm_head") and hasattr(module, "model"):
            module.forward = types.MethodType(_causal_lm_forward(module.forward), module)
            patched.append(module)
    for module_name in rotary:
        _patch_rotary(module_name)
    # Attention through this module's implementation (what attn_implementation=NAME does).
    previous = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if hasattr(model, "set_attn_implementation"):
        register()
        model.set_attn_implementation(NAME)
    counts = {"rms_norm": sum(type(m).__name__ in RMS_NORMS for m in patched),
              "mlp": sum(type(m).__name__ in GATED_MLPS for m in patched), "rotary": len(rotary),
              "loss": sum(type(m).__name__ in CAUSAL_LMS for m in patched)}
    setattr(model, _PATCH, {"modules": patched, "rotary": rotary, "counts": counts,
                            "attention": previous})
    logger.info("portable_kernels: %s runs %d RMSNorm and %d MLP modules and the rotary "
                "embeddings of %s on its kernels, attention as %r (was %r)",
                type(model).__name__, counts["rms_norm"], counts["mlp"],
                ", ".join(rotary) or "no module",
                getattr(getattr(model, "config", None), "_attn_implementation", None), previous)
    return counts


def undo(model: torch.nn.Module) -> None:
    """Reverse :func:`apply` on ``model`` (nothing to do if it was not applied)."""
    done = getattr(model, _PATCH, None)
    if done is None:
        return
    for module in done["modules"]:
        del module.forward  # the instance attribute; the class's forward shows again
    for module_name in done["rotary"]:
        _unpatch_rotary(module_name)
    if done["attention"] is not None and hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(done["attention"])
    delattr(model, _PATCH)
    logger.info("portable_kernels: %s back on transformers' own code", type(model).__name__)
