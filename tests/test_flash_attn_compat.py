"""portable_kernels.integrations.flash_attn: FlashAttention's Python API (layouts, defaults,
bottom-right causal masks, LSE layouts) on our kernels, checked against the float64 oracle;
what it cannot do is refused naming the argument."""
from __future__ import annotations

import pytest
import torch

from portable_kernels import errors
from portable_kernels.integrations import flash_attn as fa2
from portable_kernels.kernels import _attn_mods
from portable_kernels.kernels import flash_attn_varlen as varlen
from portable_kernels.testing import assert_close, tolerance


def _rand(gen, device, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(device, dtype)


def _oracle(q, k, v, causal, **options):
    """(B, S, H, D) tensors through the float64 oracle, bottom-right aligned."""
    out, lse = _attn_mods.reference(*(t.transpose(1, 2).double() for t in (q, k, v)),
                                    causal=causal, diag=k.shape[1] - q.shape[1], **options)
    return out.transpose(1, 2), lse


@pytest.mark.parametrize("causal", [False, True])
def test_func_takes_flash_attentions_layout_and_aligns_causal_bottom_right(gen, device, causal):
    """Fewer queries than keys (a chunk of prefill): a causal row sees the keys up to its
    own position counted from the end, as FlashAttention >= 2.1 does."""
    q = _rand(gen, device, 2, 5, 4, 16)
    k, v = _rand(gen, device, 2, 9, 2, 16), _rand(gen, device, 2, 9, 2, 16)
    out, lse, probs = fa2.flash_attn_func(q, k, v, causal=causal, window_size=(3, -1),
                                          softcap=5.0, return_attn_probs=True)
    want, want_lse = _oracle(q, k, v, causal, window_size=(3, -1), softcap=5.0)
    assert out.shape == q.shape and out.is_contiguous() and probs is None
    assert_close(out, want, tolerance(torch.float32, "attention"))
    assert lse.shape == (2, 4, 5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-4, atol=1e-4)


def test_packed_calls_and_gradients(gen, device):
    """qkv- and kv-packed calls equal the unpacked one; gradients flow to the packed tensor."""
    qkv = _rand(gen, device, 1, 7, 3, 2, 16).requires_grad_()
    out = fa2.flash_attn_qkvpacked_func(qkv, causal=True)
    q, k, v = (qkv.detach()[:, :, i] for i in range(3))
    assert_close(out, _oracle(q, k, v, True)[0], tolerance(torch.float32, "attention"))
    kv = qkv.detach()[:, :, 1:]
    assert torch.equal(fa2.flash_attn_kvpacked_func(q, kv, causal=True), out.detach())
    out.sum().backward()
    qkv64 = qkv.detach().double().requires_grad_()
    _oracle(*(qkv64[:, :, i] for i in range(3)), True)[0].sum().backward()
    torch.testing.assert_close(qkv.grad.double(), qkv64.grad, rtol=1e-3, atol=1e-3)
    with pytest.raises(errors.ArgumentError, match=r"kv must be \(B, Sk, 2, H_kv, D\)"):
        fa2.flash_attn_kvpacked_func(q, qkv)


def test_varlen_func_and_its_lse_layout(gen, device):
    args, _ = varlen.inputs("3+11x4x16", torch.float32, device)
    out, lse, probs = fa2.flash_attn_varlen_func(*args, causal=True, return_attn_probs=True)
    want, want_lse = varlen.reference(*args, causal=True, return_lse=True)
    assert probs is None and lse.shape == (4, 14)
    assert_close(out, want, tolerance(torch.float32, "attention"))
    torch.testing.assert_close(lse.double(), want_lse.to(lse.device), rtol=1e-4, atol=1e-4)


def test_with_kvcache_defaults_to_full_attention_as_flash_attention(gen, device):
    """FlashAttention's cache call is not causal unless asked (ours defaults to causal):
    two queries over a cache of 6 keys plus the 2 appended see all 8 keys."""
    q = _rand(gen, device, 1, 2, 4, 16)
    kc, vc = (torch.zeros(1, 16, 2, 16, device=device) for _ in range(2))
    old_k, old_v = _rand(gen, device, 1, 6, 2, 16), _rand(gen, device, 1, 6, 2, 16)
    kc[:, :6], vc[:, :6] = old_k, old_v
    k, v = _rand(gen, device, 1, 2, 2, 16), _rand(gen, device, 1, 2, 2, 16)
    lens = torch.tensor([6], dtype=torch.int32, device=device)
    out, lse = fa2.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens,
                                           return_softmax_lse=True)
    keys, values = torch.cat([old_k, k], 1), torch.cat([old_v, v], 1)
    want, want_lse = _oracle(q, keys, values, False)
    assert_close(out, want, tolerance(torch.float32, "attention"))
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-4, atol=1e-4)
    assert torch.equal(kc[:, 6:8], k)  # appended in place


@pytest.mark.parametrize("call, kwargs, arg", [
    ("flash_attn_func", {"dropout_p": 0.1}, "dropout_p"),
    ("flash_attn_varlen_func", {"dropout_p": 0.1}, "dropout_p"),
    ("flash_attn_varlen_func", {"block_table": torch.zeros(1, 1, dtype=torch.int32)}, "block_table"),
    ("flash_attn_with_kvcache", {"rotary_cos": torch.ones(4, 8)}, "rotary_cos"),
    ("flash_attn_with_kvcache", {"cache_batch_idx": torch.zeros(1, dtype=torch.int32)},
     "cache_batch_idx"),
    ("flash_attn_with_kvcache", {"cache_leftpad": torch.zeros(1, dtype=torch.int32)},
     "cache_leftpad"),
])
def test_what_it_cannot_do_is_refused_by_name(gen, device, call, kwargs, arg):
    q, k = _rand(gen, device, 1, 2, 2, 16), _rand(gen, device, 1, 16, 2, 16)
    if call == "flash_attn_varlen_func":
        args = (q[0], k[0], k[0], *(torch.tensor([0, 2], dtype=torch.int32, device=device),) * 2, 2, 2)
    else:
        args = (q, k, k)
    with pytest.raises(errors.ArgumentError, match=f"{arg} is not supported"):
        getattr(fa2, call)(*args, **kwargs)


def test_deterministic_runs_a_backward_without_atomics(gen, device):
    """``deterministic=True`` where dispatch picks sm_90's Gluon kernels (whose backward sums
    dq with the copy engine's reductions): the call runs ``nvidia.hopper`` instead, and two
    backward passes give the same bits."""
    import portable_kernels as pk

    q = _rand(gen, device, 1, 2048, 4, 128, dtype=torch.bfloat16)
    views = [q.transpose(1, 2)] * 3
    if pk.explain("flash_attn", *views, True, align="bottom_right").variant != "nvidia.hopper_gluon":
        pytest.skip("dispatch picks no Gluon attention here (sm_90 GPUs under Triton 3.6)")
    with fa2._deterministic(True, *views, True, align="bottom_right"):
        assert pk.explain("flash_attn", *views, True, align="bottom_right").variant == "nvidia.hopper"
    grads = []
    for _ in range(2):
        x = q.detach().requires_grad_()
        fa2.flash_attn_func(x, x, x, causal=True, deterministic=True).float().square().sum().backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])
