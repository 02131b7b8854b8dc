"""flash_attn's FlashAttention options (bottom-right alignment, window, softcap, ALiBi,
sinks, the LSE) and the packed-batch family flash_attn_varlen, against the float64
reference of ``_attn_mods``, forward and backward, on every variant this device runs."""
from __future__ import annotations

import math
import re

import pytest
import torch

import portable_kernels as pk
from portable_kernels.errors import PortableKernelsError, VariantUnavailableError
from portable_kernels.kernels import flash_attn as fa_family
from portable_kernels.kernels import flash_attn_varlen as varlen_family
from portable_kernels.testing import Tolerance, assert_close, tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

#: One case per option, then all of them at once (bottom-right causal with a window).
OPTIONS = {
    "bottom_right": dict(causal=True, align="bottom_right"),
    "window": dict(window_size=(6, 3)),
    "window_causal": dict(causal=True, window_size=(10, -1)),
    "softcap": dict(softcap=2.0),
    "alibi": dict(alibi_slopes="H"),
    "sinks": dict(sinks=True),
    "all": dict(causal=True, align="bottom_right", window_size=(5, 0), softcap=3.0,
                alibi_slopes="BH", sinks=True),
}


def _options(spec: dict, b: int, h: int, gen: torch.Generator) -> dict:
    """``OPTIONS[...]`` with its tensors made: ALiBi slopes (H,) or (B, H), sinks (H,)."""
    kw = dict(spec)
    if kw.get("alibi_slopes") == "H":
        kw["alibi_slopes"] = torch.rand(h, generator=gen).to(DEVICE)
    elif kw.get("alibi_slopes") == "BH":
        kw["alibi_slopes"] = torch.rand(b, h, generator=gen).to(DEVICE)
    if kw.get("sinks"):
        kw["sinks"] = torch.randn(h, generator=gen).to(DEVICE).requires_grad_()
    return kw


def _randn(*shape, gen, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype).requires_grad_()


def _check(out, lse, grads, ref_out, ref_lse, ref_grads, dtype, what):
    """Outputs, LSE (-inf exactly where the reference's is) and gradients within the
    attention tolerance; gradients as tests/test_flash_attn.py scales it (their size
    grows with the largest gradient, and the error with the keys summed)."""
    tol = tolerance(dtype, "attention")
    assert_close(out, ref_out, tol, f"{what} out")
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), f"{what}: empty rows"
    finite = torch.isfinite(ref_lse)
    assert_close(lse[finite], ref_lse[finite], tol, f"{what} lse")
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
        scale = max(1.0, r.abs().max().item())
        assert_close(g, r, Tolerance(tol.atol * scale, tol.rtol), f"{what} {name}")


def _variants(kernel):
    return pk.list_variants(kernel, DEVICE)


@pytest.mark.parametrize("case", list(OPTIONS))
@pytest.mark.parametrize("variant", _variants("flash_attn"))
def test_flash_attn_options_forward_backward(variant, case):
    """Every option alone and all together, GQA, Nq != Nk, outputs, LSE and gradients
    (q, k, v and sinks) against the float64 reference."""
    gen = torch.Generator().manual_seed(hash(case) % 1000)
    dtype = torch.float16 if variant in ("nvidia.hopper",) else torch.float32
    b, h, h_kv, n_q, n_k, d = 2, 4, 2, 37, 45, 64 if dtype == torch.float16 else 32
    q, k, v = (_randn(b, hh, n, d, gen=gen, dtype=dtype)
               for hh, n in ((h, n_q), (h_kv, n_k), (h_kv, n_k)))
    kw = _options(OPTIONS[case], b, h, gen)
    verdict = next(v for v in pk.explain("flash_attn", q, k, v, return_lse=True, **kw).verdicts
                   if v.name == variant)
    with pk.use_variant(flash_attn=variant):
        if not verdict.runnable:
            # A variant that declines the call (nvidia.hopper_gluon computes plain attention
            # only): forcing it is an error that gives its predicate's reason, not a result.
            with pytest.raises(VariantUnavailableError, match=re.escape(verdict.reason)):
                pk.get_kernel("flash_attn")(q, k, v, return_lse=True, **kw)
            return
        out, lse = pk.get_kernel("flash_attn")(q, k, v, return_lse=True, **kw)
    grad = torch.randn(out.shape, generator=gen).to(DEVICE, dtype)
    out.backward(grad)
    inputs = [q, k, v] + ([kw["sinks"]] if "sinks" in kw else [])
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    ref_kw = {**kw, **({"sinks": ref_inputs[3]} if "sinks" in kw else {})}
    ref_out, ref_lse = fa_family.reference(*ref_inputs[:3], return_lse=True, **ref_kw)
    ref_out.backward(grad.double())
    _check(out, lse, [t.grad for t in inputs], ref_out, ref_lse, [r.grad for r in ref_inputs],
           dtype, f"{variant} {case}")


def test_bottom_right_decode_row_sees_every_key():
    """The issue's case: one query over N keys, causal. Top-left lets it see key 0 only;
    bottom-right, every key (what decode needs)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 16, generator=gen).to(DEVICE) for n in (1, 9, 9))
    fa = pk.get_kernel("flash_attn")
    top = fa(q, k, v, causal=True)
    bottom = fa(q, k, v, causal=True, align="bottom_right")
    # fp32 products may run as tf32 on a GPU (P·V rounds V's mantissas): the table's bound.
    tol = tolerance(torch.float32, "attention")
    assert_close(top, v[:, :, :1], tol, "top-left")
    assert_close(bottom, fa(q, k, v), tol, "bottom-right against no mask")


def test_rows_without_keys_are_zero_with_lse_minus_inf():
    """Bottom-right causal with Nq > Nk: the first Nq - Nk rows see nothing."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 1, 20, 16, generator=gen).to(DEVICE)
    k, v = (torch.randn(1, 1, 7, 16, generator=gen).to(DEVICE) for _ in range(2))
    out, lse = pk.get_kernel("flash_attn")(q, k, v, causal=True, align="bottom_right",
                                           return_lse=True)
    assert not torch.isnan(out).any()
    assert torch.equal(out[0, 0, :13], torch.zeros_like(out[0, 0, :13]))
    assert bool(torch.isneginf(lse[0, 0, :13]).all()) and bool(torch.isfinite(lse[0, 0, 13:]).all())


@pytest.mark.parametrize("bad, message", [
    (dict(window_size=(-2, 0)), "window_size's left must be >= -1"),
    (dict(window_size=(3,)), "window_size must be a pair"),
    (dict(softcap=-1.0), "softcap must be finite and >= 0"),
    (dict(softcap=True), "softcap must be a float"),
    (dict(alibi_slopes=torch.ones(3)), "alibi_slopes must have shape (4,) or (2, 4)"),
    (dict(alibi_slopes=torch.ones(4, dtype=torch.float64)), "alibi_slopes must be float32"),
    (dict(sinks=torch.ones(2)), "sinks must have shape (4,)"),
    (dict(align="bottom"), "align must be one of"),
])
def test_flash_attn_option_errors(bad, message):
    q = torch.randn(2, 4, 8, 16, device=DEVICE)
    k = torch.randn(2, 2, 8, 16, device=DEVICE)
    bad = {key: (t.to(DEVICE) if torch.is_tensor(t) else t) for key, t in bad.items()}
    with pytest.raises(PortableKernelsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        pk.get_kernel("flash_attn")(q, k, k, **bad)


# --- flash_attn_varlen ---------------------------------------------------------------------

#: Query and key lengths per sequence: odd lengths, an empty query sequence, a sequence
#: without keys, one-token sequences, a sequence longer than one block.
LENGTHS_Q = [5, 0, 1, 70, 33, 1]
LENGTHS_K = [9, 4, 0, 70, 20, 1]


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                        device=DEVICE)


@pytest.mark.parametrize("case", ["causal", "plain", "all"])
@pytest.mark.parametrize("variant", _variants("flash_attn_varlen"))
def test_varlen_forward_backward(variant, case):
    gen = torch.Generator().manual_seed(7)
    dtype = torch.float16 if variant in ("nvidia.hopper",) else torch.float32
    h, h_kv, d = 4, 2, 64 if dtype == torch.float16 else 32
    b = len(LENGTHS_Q)
    q = _randn(sum(LENGTHS_Q), h, d, gen=gen, dtype=dtype)
    k, v = (_randn(sum(LENGTHS_K), h_kv, d, gen=gen, dtype=dtype) for _ in range(2))
    kw = {"causal": dict(causal=True), "plain": {}, "all": dict(OPTIONS["all"])}[case]
    kw.pop("align", None)  # packed batches are always bottom-right
    kw = _options(kw, b, h, gen)
    cu_q, cu_k = _cu(LENGTHS_Q), _cu(LENGTHS_K)
    with pk.use_variant(flash_attn_varlen=variant):
        out, lse = pk.get_kernel("flash_attn_varlen")(
            q, k, v, cu_q, cu_k, max(LENGTHS_Q), max(LENGTHS_K), return_lse=True, **kw)
    assert out.shape == q.shape and lse.shape == (h, q.shape[0])
    grad = torch.randn(out.shape, generator=gen).to(DEVICE, dtype)
    out.backward(grad)
    inputs = [q, k, v] + ([kw["sinks"]] if "sinks" in kw else [])
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    ref_kw = {**kw, **({"sinks": ref_inputs[3]} if "sinks" in kw else {})}
    ref_out, ref_lse = varlen_family.reference(*ref_inputs[:3], cu_q, cu_k, return_lse=True,
                                               **ref_kw)
    ref_out.backward(grad.double())
    _check(out, lse, [t.grad for t in inputs], ref_out, ref_lse, [r.grad for r in ref_inputs],
           dtype, f"{variant} {case}")


def test_varlen_writes_every_row_and_no_padding_leaks():
    """Rows of one sequence never read another's keys: NaN keys in a sequence that is not
    attended (no queries) must not reach any output."""
    gen = torch.Generator().manual_seed(3)
    lq, lk = [3, 0, 4], [5, 6, 2]
    q = torch.randn(sum(lq), 2, 16, generator=gen).to(DEVICE)
    k, v = (torch.randn(sum(lk), 2, 16, generator=gen).to(DEVICE) for _ in range(2))
    k[5:11], v[5:11] = float("nan"), float("nan")  # sequence 1's keys: it has no queries
    out = pk.get_kernel("flash_attn_varlen")(q, k, v, _cu(lq), _cu(lk), 4, 6, causal=True)
    assert not torch.isnan(out).any()
    ref = varlen_family.reference(q, k.nan_to_num(0), v.nan_to_num(0), _cu(lq), _cu(lk),
                                  causal=True)
    assert_close(out, ref, tolerance(torch.float32, "attention"))


@pytest.mark.parametrize("mutate, message", [
    (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"].long()), "cu_seqlens_q must be int32"),
    (lambda a: a.update(cu_seqlens_k=a["cu_seqlens_k"][:-1]), "must have the same length"),
    (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"][None]), r"cu_seqlens_q must have shape"),
    (lambda a: a.update(max_seqlen_q=-1), "max_seqlen_q must be >= 0"),
    (lambda a: a.update(max_seqlen_k=2.5), "max_seqlen_k must be an int"),
    (lambda a: a.update(q=a["q"][None]), "q must be"),
    (lambda a: a.update(window_size=(0, -3)), "window_size's right must be >= -1"),
    (lambda a: a.update(alibi_slopes=torch.ones(3, 4, device=DEVICE)), "alibi_slopes must have shape"),
])
def test_varlen_errors(mutate, message):
    q = torch.randn(7, 4, 16, device=DEVICE)
    k = torch.randn(9, 2, 16, device=DEVICE)
    args = dict(q=q, k=k, v=k, cu_seqlens_q=_cu([3, 4]), cu_seqlens_k=_cu([4, 5]),
                max_seqlen_q=4, max_seqlen_k=5)
    mutate(args)
    with pytest.raises(PortableKernelsError, match=message):
        pk.get_kernel("flash_attn_varlen")(**args)


def test_varlen_call_seen_before_is_not_checked_again(monkeypatch):
    """A serving loop repeats batch shapes: a call's checks run once per signature; one
    differing in a scalar's type or value, or in an argument the checks reject, is checked
    (and fails)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (_randn(20, 4, 16, gen=gen) for _ in range(3))
    cu = _cu([7, 13])
    call = pk.get_kernel("flash_attn_varlen")
    call(q, k, v, cu, cu, 13, 13)
    checks = []
    real = varlen_family._problem
    monkeypatch.setattr(varlen_family, "_problem", lambda *a: checks.append(a) or real(*a))
    call(q, k, v, _cu([10, 10]), _cu([10, 10]), 13, 13)  # new lengths, same signature
    assert checks == []
    with pytest.raises(PortableKernelsError, match="causal"):
        call(q, k, v, cu, cu, 13, 13, causal="yes")
    with pytest.raises(PortableKernelsError, match="max_seqlen_q"):
        call(q, k, v, cu, cu, -1, 13)
    assert len(checks) == 2


def test_varlen_value_checks_only_when_asked(monkeypatch):
    """cu_seqlens that decrease, or a max_seqlen below the longest sequence, need the values
    on the host: an error under PK_CHECK_VALUES=1, unchecked (no sync) otherwise."""
    q = torch.randn(7, 2, 16, device=DEVICE)
    bad_cu = torch.tensor([0, 5, 3, 7], dtype=torch.int32, device=DEVICE)
    call = lambda: pk.get_kernel("flash_attn_varlen")(q, q, q, bad_cu, bad_cu, 8, 8)  # noqa: E731
    monkeypatch.setenv("PK_CHECK_VALUES", "1")
    with pytest.raises(PortableKernelsError, match="cu_seqlens_q must not decrease"):
        call()
    short = _cu([3, 4])
    with pytest.raises(PortableKernelsError, match="max_seqlen_q=2 is below the longest"):
        pk.get_kernel("flash_attn_varlen")(q, q, q, short, short, 2, 4)
    monkeypatch.delenv("PK_CHECK_VALUES")
    pk.get_kernel("flash_attn_varlen")(q, q, q, short, short, 4, 4)


def test_varlen_matches_dense_on_equal_lengths():
    """A packed batch of equal lengths is the dense call, bottom-right = top-left there."""
    gen = torch.Generator().manual_seed(5)
    b, n, h, d = 3, 19, 2, 16
    q, k, v = (torch.randn(b, n, h, d, generator=gen).to(DEVICE) for _ in range(3))
    dense = pk.get_kernel("flash_attn")(*(t.transpose(1, 2) for t in (q, k, v)), causal=True)
    cu = _cu([n] * b)
    packed = pk.get_kernel("flash_attn_varlen")(*(t.reshape(b * n, h, d) for t in (q, k, v)),
                                                cu, cu, n, n, causal=True)
    assert torch.allclose(packed.reshape(b, n, h, d), dense.transpose(1, 2), atol=1e-6)
    assert math.isfinite(packed.abs().max().item())


# --- operators ---------------------------------------------------------------------------

def test_ops_opcheck_and_compile_with_options():
    """Both operators with every option pass opcheck (schemas, fakes, autograd) and trace
    under torch.compile(fullgraph=True) to the eager results."""
    from portable_kernels import ops

    gen = torch.Generator().manual_seed(11)
    q = _randn(2, 4, 9, 16, gen=gen)
    k, v = (_randn(2, 2, 11, 16, gen=gen) for _ in range(2))
    sinks = _randn(4, gen=gen)
    slopes = torch.rand(4, generator=gen).to(DEVICE)
    torch.library.opcheck(torch.ops.portable_kernels.flash_attn_forward.default,
                          (q, k, v, True, None, 5, 0, 2.0, slopes, sinks, "bottom_right"))
    kw = dict(window_size=(5, 0), softcap=2.0, alibi_slopes=slopes, sinks=sinks,
              align="bottom_right")
    compiled = torch.compile(lambda *t: ops.flash_attn(*t, True, **kw), fullgraph=True)
    assert torch.equal(compiled(q, k, v), pk.get_kernel("flash_attn")(q, k, v, True, **kw))

    cu_q, cu_k = _cu([3, 0, 5]), _cu([4, 2, 5])
    q = _randn(8, 4, 16, gen=gen)
    k, v = (_randn(11, 2, 16, gen=gen) for _ in range(2))
    torch.library.opcheck(torch.ops.portable_kernels.flash_attn_varlen_forward.default,
                          (q, k, v, cu_q, cu_k, 5, 5, True, None, 2, -1, 0.0, None, sinks))
    packed = torch.compile(lambda *t: ops.flash_attn_varlen(*t, cu_q, cu_k, 5, 5, causal=True),
                           fullgraph=True)
    out = packed(q, k, v)
    assert torch.equal(out, pk.get_kernel("flash_attn_varlen")(q, k, v, cu_q, cu_k, 5, 5,
                                                                causal=True))
    out.sum().backward()
    assert q.grad is not None and bool(torch.isfinite(q.grad).all())
