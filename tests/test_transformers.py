"""attn_implementation="portable_kernels" in a tiny, randomly initialised Llama (no download):
the same logits and gradients as "sdpa", prefill and KV-cache decoding on flash_attn, padded
batches on flash_attn_varlen, greedy generation with the same tokens, GQA passed as is,
what the kernels cannot take falling back to SDPA with a logged reason, and a fullgraph
trace."""
from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("transformers")

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

import portable_kernels.integrations.transformers as pk_hf  # noqa: E402
from conftest import DEVICE  # noqa: E402
from portable_kernels import ops  # noqa: E402
from portable_kernels.testing import Tolerance, assert_close  # noqa: E402

# fp32 end to end: on the interpreter attention differs from SDPA only by summation order;
# GPUs run fp32 dots as tf32.
TOL = Tolerance(1e-4, 1e-4) if DEVICE.type == "cpu" else Tolerance(2e-2, 2e-2)
GRAD_TOL = Tolerance(1e-4, 1e-3) if DEVICE.type == "cpu" else Tolerance(2e-2, 2e-2)
VOCAB, SEQ = 128, 16


@pytest.fixture(scope="module")
def model():
    pk_hf.register()
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(DEVICE).eval()


@pytest.fixture
def kernel_calls(monkeypatch):
    """(q shape, k shape, causal) of every call that reached ops.flash_attn,
    ("varlen", total q, total k, causal) of every ops.flash_attn_varlen call and
    ("kvcache", q shape, cache shape, causal) of every ops.flash_attn_with_kvcache call."""
    calls = []
    real, real_varlen = ops.flash_attn, ops.flash_attn_varlen

    def recording(q, k, v, causal=False, sm_scale=None, **options):
        calls.append((tuple(q.shape), tuple(k.shape), causal))
        return real(q, k, v, causal, sm_scale, **options)

    def recording_varlen(q, k, v, *args, **options):
        calls.append(("varlen", q.shape[0], k.shape[0], args[4] if len(args) > 4 else None))
        return real_varlen(q, k, v, *args, **options)

    real_decode = ops.flash_attn_with_kvcache

    def recording_decode(q, k_cache, v_cache, *args, **options):
        calls.append(("kvcache", tuple(q.shape), tuple(k_cache.shape), options.get("causal")))
        return real_decode(q, k_cache, v_cache, *args, **options)

    monkeypatch.setattr(ops, "flash_attn", recording)
    monkeypatch.setattr(ops, "flash_attn_varlen", recording_varlen)
    monkeypatch.setattr(ops, "flash_attn_with_kvcache", recording_decode)
    return calls


def _logits(model, impl, *args, **kwargs):
    model.set_attn_implementation(impl)
    return model(*args, **kwargs).logits


def _ids(gen, device, batch=2, seq=SEQ):
    return torch.randint(0, VOCAB, (batch, seq), generator=gen).to(device)


def test_prefill_matches_sdpa(model, gen, device, kernel_calls):
    ids = _ids(gen, device)
    with torch.no_grad():
        ref = _logits(model, "sdpa", ids, use_cache=False)
        out = _logits(model, pk_hf.NAME, ids, use_cache=False)
    assert_close(out, ref, TOL, "logits")
    # Both layers ran on the kernel, causal, with 2 K/V heads for 4 query heads (no repeat).
    assert kernel_calls == [((2, 4, SEQ, 16), (2, 2, SEQ, 16), True)] * 2


# past_key_values: the name both transformers 5.17 (the GPU machine) and 5.24 take.
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_decoding_with_kv_cache_matches_sdpa(model, gen, device, kernel_calls):
    ids = _ids(gen, device)
    logits = {}
    with torch.no_grad():
        for impl in ("sdpa", pk_hf.NAME):
            cache = DynamicCache(config=model.config)
            prefill = _logits(model, impl, ids[:, :-2], past_key_values=cache, use_cache=True)
            step1 = _logits(model, impl, ids[:, -2:-1], past_key_values=cache, use_cache=True)
            step2 = _logits(model, impl, ids[:, -1:], past_key_values=cache, use_cache=True)
            logits[impl] = (prefill, step1, step2)
    for out, ref in zip(logits[pk_hf.NAME], logits["sdpa"]):
        assert_close(out, ref, TOL, "logits")
    # Decoding: one query over every cached key, on the serving kernel, which reads
    # transformers' (B, H_kv, N, D) cache as (B, N, H_kv, D) through its strides.
    assert ("kvcache", (2, 1, 4, 16), (2, SEQ - 1, 2, 16), True) in kernel_calls
    assert ("kvcache", (2, 1, 4, 16), (2, SEQ, 2, 16), True) in kernel_calls


def test_gradients_match_sdpa(model, gen, device):
    ids = _ids(gen, device)
    grads = {}
    model.train()  # attention_dropout is 0.0, so training still runs on the kernel
    try:
        for impl in ("sdpa", pk_hf.NAME):
            model.set_attn_implementation(impl)
            model.zero_grad()
            model(ids, labels=ids, use_cache=False).loss.backward()
            grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters()}
    finally:
        model.eval()
        model.zero_grad()
    for name, ref in grads["sdpa"].items():
        assert_close(grads[pk_hf.NAME][name], ref, GRAD_TOL, name)


def _padded_ids(gen, device):
    ids = _ids(gen, device)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding in the first sequence
    mask[1, -3:] = 0  # right padding in the second
    return ids, mask


def test_padded_batch_runs_packed_and_matches_sdpa(model, gen, device, kernel_calls):
    ids, mask = _padded_ids(gen, device)
    with torch.no_grad():
        ref = _logits(model, "sdpa", ids, attention_mask=mask, use_cache=False)
        out = _logits(model, pk_hf.NAME, ids, attention_mask=mask, use_cache=False)
    valid = mask.bool()
    assert_close(out[valid], ref[valid], TOL, "logits of the valid tokens")
    # Both layers: the 24 valid tokens of the 32, packed, causal.
    assert kernel_calls == [("varlen", 24, 24, True)] * 2


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def _assert_same_greedy_tokens(tokens, logits, ref_tokens, ref_logits):
    """Greedy tokens (B, steps) and their logits (B, steps, V) as SDPA's: each step's logits
    within TOL while the prefixes agree, and the same token, except where SDPA's own
    choice was a tie within that tolerance (the tiny random model's top two logits can lie
    1e-4 apart, and tf32 attention on a GPU may break such a tie the other way); a row's
    prefixes differ after that, so its comparison ends there."""
    for b in range(tokens.shape[0]):
        for s in range(min(tokens.shape[1], ref_tokens.shape[1])):
            assert_close(logits[b, s], ref_logits[b, s], TOL, f"row {b} step {s} logits")
            mine, ref = int(tokens[b, s]), int(ref_tokens[b, s])
            if mine != ref:
                top, other = float(ref_logits[b, s, ref]), float(ref_logits[b, s, mine])
                allowed = 2 * (TOL.atol + TOL.rtol * abs(top))
                assert top - other <= allowed, (
                    f"row {b} step {s}: token {mine} for SDPA's {ref}, whose logit leads by "
                    f"{top - other:.3g} (a tie allows {allowed:.3g})")
                break


def test_greedy_generation_matches_sdpa(model, gen, device, kernel_calls):
    """generate() with a KV cache: the same tokens as SDPA, with left padding (packed
    prefill and decode steps) and without (flash_attn throughout)."""
    ids = _ids(gen, device, seq=7)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    for attention_mask in (None, mask):
        runs = {}
        for impl in ("sdpa", pk_hf.NAME):
            model.set_attn_implementation(impl)
            with torch.no_grad():
                out = model.generate(ids, attention_mask=attention_mask, max_new_tokens=6,
                                     do_sample=False, pad_token_id=0,
                                     return_dict_in_generate=True, output_logits=True)
            runs[impl] = (out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1))
        _assert_same_greedy_tokens(*runs[pk_hf.NAME], *runs["sdpa"])
    assert any(c[0] == "varlen" for c in kernel_calls)  # padded prefill and decode steps
    assert ("kvcache", (2, 1, 4, 16), (2, 8, 2, 16), True) in kernel_calls  # unpadded decode


def test_unsupported_calls_fall_back_to_sdpa_with_a_logged_reason(gen, device, caplog):
    """Attention dropout: SDPA's implementation runs, with the padding mask rebuilt as
    SDPA's 4-D one, once-per-reason logging."""
    q = torch.randn(2, 4, 6, 16, generator=gen).to(device)
    kv = torch.randn(2, 2, 6, 16, generator=gen).to(device)
    mask = torch.ones(2, 6, dtype=torch.bool, device=device)
    mask[0, :2] = False
    pk_hf.register()
    pk_hf._warned.clear()
    module = torch.nn.Module()
    module.is_causal = True
    module.num_key_value_groups = 2
    module.training = False
    with caplog.at_level(logging.WARNING, logger=pk_hf.__name__):
        for _ in range(2):
            # A constant bias (SDPA's softmax drops it), on the device: SDPA adds it to the mask.
            out, _ = pk_hf.attention_forward(module, q, kv, kv, mask,
                                             position_bias=torch.ones(1, device=device))
    warnings = [r for r in caplog.records if r.name == pk_hf.__name__]
    assert len(warnings) == 1, "one warning per reason, not one per layer"
    assert "falls back" in warnings[0].getMessage() and "position bias" in warnings[0].getMessage()
    ours, _ = pk_hf.attention_forward(module, q, kv, kv, mask)
    valid = mask[:, :, None, None].expand(2, 6, 4, 16)
    assert_close(out[valid], ours[valid], TOL, "SDPA fallback vs packed kernel")


def test_the_attention_output_is_saved_once(gen, device):
    """The (B, Nq, H, D) output transformers gets back is the very tensor the attention's
    backward keeps (q's layout, so no copy): the next projection, which saves its input,
    holds no second copy of it, as with SDPA's output."""
    module = torch.nn.Module()
    module.is_causal, module.training = True, True
    q = torch.randn(1, 12, 4, 16, generator=gen).to(device).requires_grad_().transpose(1, 2)
    kv = torch.randn(1, 12, 2, 16, generator=gen).to(device).requires_grad_().transpose(1, 2)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out, _ = pk_hf.attention_forward(module, q, kv, kv, None)
    assert out.shape == (1, 12, 4, 16) and out.is_contiguous()
    kept = {t.untyped_storage().data_ptr() for t in saved}
    assert out.untyped_storage().data_ptr() in kept


def test_fallback_reasons():
    q = torch.empty(1, 4, 3, 16)
    kv = torch.empty(1, 2, 5, 16)
    assert pk_hf.fallback_reason(None, q, kv, kv, None) is None
    assert pk_hf.fallback_reason(None, q, kv, kv, None, softcap=30.0) is None
    assert pk_hf.fallback_reason(None, q, kv, kv, torch.ones(1, 5, dtype=torch.bool)) is None
    assert "4-D" in pk_hf.fallback_reason(None, q, kv, kv, torch.ones(1, 1, 3, 5, dtype=torch.bool))
    assert "dropout" in pk_hf.fallback_reason(None, q, kv, kv, None, dropout=0.1)
    assert "position bias" in pk_hf.fallback_reason(None, q, kv, kv, None, position_bias=q)
    assert "head dims" in pk_hf.fallback_reason(None, q, kv, torch.empty(1, 2, 5, 8), None)
    assert "dtypes" in pk_hf.fallback_reason(None, q.double(), kv.double(), kv.double(), None)
    assert "multiple" in pk_hf.fallback_reason(None, torch.empty(1, 3, 3, 16), kv, kv, None)


def test_sliding_window_softcap_and_sinks_match_the_reference(gen, device):
    """Options transformers passes (Mistral's sliding_window, Gemma 2's softcap, gpt-oss's
    s_aux) reach the kernel with FlashAttention-2's meaning."""
    from portable_kernels.kernels import _attn_mods
    q = torch.randn(1, 4, 9, 16, generator=gen).to(device)
    kv = torch.randn(1, 2, 9, 16, generator=gen).to(device)
    sinks = torch.randn(4, generator=gen).to(device)
    module = torch.nn.Module()
    module.is_causal = True
    out, _ = pk_hf.attention_forward(module, q, kv, kv, None, sliding_window=4, softcap=5.0,
                                     s_aux=sinks)
    ref, _ = _attn_mods.reference(q, kv, kv, causal=True, window_size=(3, 3), softcap=5.0,
                                  sinks=sinks)
    assert_close(out, ref.transpose(1, 2), TOL, "options")


def test_torch_compile_fullgraph_traces_the_model(model, gen, device):
    torch._dynamo.reset()
    ids = _ids(gen, device)
    with torch.no_grad():
        ref = _logits(model, pk_hf.NAME, ids, use_cache=False)
        # aot_eager: the whole model in one graph with our op in it, without paying for
        # Inductor's C++ compile (tests/test_ops.py covers Inductor over the ops).
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        out = compiled(ids, use_cache=False).logits
    assert_close(out, ref, TOL, "compiled logits")
