"""flash_attn's ``nvidia.hopper_gluon`` variant: its Gluon forward (``flash_attn_gluon.py``)
with the family's backward, forward and backward against float64; what it takes, what it
leaves to ``nvidia.hopper`` and why.

Gluon kernels do not run under Triton's interpreter, so the numerical tests need an sm_90
GPU and skip elsewhere with the variant's own reason; selection and the predicate are
tested everywhere (``ci/sm90_compile.py`` compiles the kernel for sm_90 on the CPU machine).
"""
from __future__ import annotations

import pytest
import torch

import portable_kernels as pk
from conftest import DEVICE
from portable_kernels.errors import VariantUnavailableError
from portable_kernels.kernels import flash_attn as fa
from portable_kernels.kernels import flash_attn_gluon as fg
from portable_kernels.testing import assert_close, tolerance
from test_flash_attn_hopper import _check, _grad_tolerance, _inputs

NAME = "flash_attn"
GLUON = "nvidia.hopper_gluon"


@pytest.fixture(autouse=True)
def small_problems(monkeypatch):
    """The tests' sequences are far below MIN_KEYS (the automatic choice's threshold);
    forced runs of them still check the kernel."""
    monkeypatch.setattr(fg, "MIN_KEYS", 0)


def _skip_unless_gluon_runs(device, dims=(1, 2, 2, 128, 128, 64)) -> None:
    x = torch.zeros(*dims[:2], dims[3], dims[5], dtype=torch.float16, device=device)
    verdict = next(v for v in pk.explain(NAME, x, x, x).verdicts if v.name == GLUON)
    if not verdict.runnable:
        pytest.skip(f"{GLUON}: {verdict.reason}")


def _forced(q, k, v, causal, sm_scale=None):
    with pk.use_variant(**{NAME: GLUON}):
        return pk.get_kernel(NAME)(q, k, v, causal=causal, sm_scale=sm_scale)


# --- forced on an sm_90 GPU: forward and backward -------------------------------------------

# (B, H, H_kv, Nq, Nk, D): one and several tiles and key blocks, ragged Nq and Nk (the
# copy engine's zero rows: keys masked, rows not stored), Nk under one block, GQA and MQA,
# Nq < Nk and Nq > Nk under causal (top-left aligned), both head dims.
SHAPES = [
    (1, 2, 2, 128, 128, 64),
    (2, 4, 2, 200, 330, 64),
    (1, 2, 1, 70, 50, 64),
    (1, 4, 1, 390, 250, 128),
    (2, 2, 2, 512, 512, 128),
]


@pytest.mark.parametrize("dims", SHAPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forced_matches_reference_fp16(dims, causal, device, gen, nan_empty):
    _skip_unless_gluon_runs(device, dims)
    _check(_forced, dims, causal, torch.float16, device, gen)


@pytest.mark.parametrize("dims, causal", [((1, 4, 2, 256, 390, 128), True),
                                          ((2, 2, 1, 384, 256, 64), False)], ids=str)
def test_forced_matches_reference_bf16(dims, causal, device, gen, nan_empty):
    _skip_unless_gluon_runs(device, dims)
    _check(_forced, dims, causal, torch.bfloat16, device, gen)


@pytest.mark.parametrize("sm_scale", [0.3, -0.2, 0.0], ids=["positive", "negative", "zero"])
def test_scales_and_lse(sm_scale, device, gen, nan_empty):
    """A non-positive scale takes the scale-first softmax (the raw-score max is only right
    for a positive one); the LSE is the natural log-sum-exp of the scaled scores."""
    _skip_unless_gluon_runs(device)
    q, k, v = (torch.randn(1, 2, 256, 64, generator=gen).half().to(device) for _ in range(3))
    with pk.use_variant(**{NAME: GLUON}):
        plan = pk.get_kernel(NAME).plan(q, k, v)
    assert plan.variant.name == GLUON
    out, lse = fa._forward(plan, q, k, v, True, sm_scale)
    q64, k64, v64 = (x.cpu().double() for x in (q, k, v))
    tol = tolerance(torch.float16, "attention")
    assert_close(out, fa.reference(q64, k64, v64, causal=True, sm_scale=sm_scale), tol, "out")
    scores = sm_scale * q64 @ k64.transpose(-1, -2)
    hidden = torch.ones(256, 256, dtype=torch.bool).triu(1)
    assert_close(lse, torch.logsumexp(scores.masked_fill(hidden, float("-inf")), dim=-1), tol,
                 "lse")


def test_strided_views(device, gen, nan_empty):
    """(B, N, H, D) storage viewed as (B, H, N, D): the per-head descriptors take it."""
    _skip_unless_gluon_runs(device)
    _check(_forced, (1, 4, 2, 300, 260, 64), True, torch.float16, device, gen, layout="bnhd")


def test_empty_sequences(device):
    """No keys: zeros, as SDPA's math backend; no queries: an empty output."""
    _skip_unless_gluon_runs(device)
    q = torch.randn(1, 2, 130, 64, device=device, dtype=torch.float16)
    kv = torch.randn(1, 2, 0, 64, device=device, dtype=torch.float16)
    assert not _forced(q, kv, kv, False).any()
    assert _forced(q[:, :, :0], q, q, True).shape == (1, 2, 0, 64)


def test_backward_takes_a_strided_incoming_gradient(device, gen):
    _skip_unless_gluon_runs(device)
    leaves, views = _inputs(1, 2, 1, 256, 128, 64, torch.float16, device, gen)
    leaves64 = [x.detach().cpu().double().requires_grad_() for x in leaves]
    loss = lambda out: out[..., ::2].sum() + (out[..., 1::2] * 2).sum()  # noqa: E731
    loss(_forced(*views, True)).backward()
    loss(fa.reference(*leaves64, causal=True)).backward()
    tol = tolerance(torch.float16, "attention")
    for name, x, x64 in zip("qkv", leaves, leaves64):
        assert_close(x.grad, x64.grad, _grad_tolerance(tol, x64.grad), f"d{name}")


def test_chosen_on_sm90_for_whole_tiles(device):
    """Chosen by itself where it takes the problem; a head dim it lacks goes elsewhere."""
    _skip_unless_gluon_runs(device)
    x = torch.zeros(1, 2, 200, 128, dtype=torch.bfloat16, device=device)
    assert pk.explain(NAME, x, x, x).variant == GLUON
    odd = torch.zeros(1, 2, 200, 96, dtype=torch.bfloat16, device=device)
    sel = pk.explain(NAME, odd, odd, odd)
    assert sel.variant == "nvidia.hopper" or sel.variant == "generic"
    verdict = next(v for v in sel.verdicts if v.name == GLUON)
    assert "head dim 96" in verdict.reason


# --- what it takes: everywhere ----------------------------------------------------------------

def _rejections():
    def t(*shape, dtype=torch.float16):
        return torch.zeros(*shape, dtype=dtype, device=DEVICE)

    q = t(1, 2, 256, 64)
    return {
        "fp32": ((t(1, 2, 256, 64, dtype=torch.float32),) * 3, "float32 inputs stay on pointer loads"),
        "head dim 96": ((t(1, 2, 256, 96),) * 3, "head dim 96"),
        "misaligned rows": ((t(1, 2, 256, 65)[..., :64], q, q), "strides are not multiples of 16 bytes"),
    }


@pytest.mark.parametrize("name", list(_rejections()))
def test_issue_names_the_problem(name):
    args, reason = _rejections()[name]
    with pk.emulate("h200"):
        sel = pk.explain(NAME, *args)
    assert sel.variant != GLUON
    verdict = next(v for v in sel.verdicts if v.name == GLUON)
    assert not verdict.runnable
    if DEVICE.type == "cpu":
        reason = "Gluon kernels run only on CUDA devices"
    assert reason in verdict.reason, verdict.reason


@pytest.mark.parametrize("name", list(_rejections()))
def test_forcing_an_unsupported_problem_raises(name):
    args, _ = _rejections()[name]
    with pk.use_variant(**{NAME: GLUON}):
        with pytest.raises(VariantUnavailableError, match="cannot run"):
            pk.get_kernel(NAME)(*args)


def test_short_key_sequences_stay_on_nvidia_hopper(monkeypatch):
    """Below MIN_KEYS (Nk=1024 measured slower than nvidia.hopper) the variant declines,
    naming the threshold; from it on it takes the call."""
    monkeypatch.setattr(fg, "MIN_KEYS", 4096)
    q = torch.empty(1, 2, 128, 64, device="meta")
    short = torch.empty(1, 2, 1024, 64, device="meta")
    assert "Nk is below MIN_KEYS=4096" in fg.issue(q, short, short)
    # One message for every short length: one selection-cache entry.
    shorter = torch.empty(1, 2, 100, 64, device="meta")
    assert fg.issue(q, shorter, shorter) == fg.issue(q, short, short)
    long = torch.empty(1, 2, 4096, 64, device="meta")
    assert fg.issue(q, long, long) == ""


def test_sm90_only_and_never_on_the_interpreter():
    x = torch.zeros(1, 2, 256, 128, dtype=torch.float16, device=DEVICE)
    with pk.emulate("a100"):
        verdict = next(v for v in pk.explain(NAME, x, x, x).verdicts if v.name == GLUON)
    assert not verdict.runnable and "requires tensor_descriptor" in verdict.reason
    with pk.emulate("h100"):
        sel = pk.explain(NAME, x, x, x)
    verdict = next(v for v in sel.verdicts if v.name == GLUON)
    assert verdict.priority == 110
    if DEVICE.type == "cpu":
        assert sel.variant == "nvidia.hopper"
        assert "Triton's interpreter does not run them" in verdict.reason
    else:
        assert sel.variant == GLUON


def test_gluon_forward_is_a_host_switch():
    """GLUON_FORWARD picks the launcher's forward; it never reaches a kernel's constexprs."""
    v = fa.variant("x.y", switches={"GLUON_FORWARD": True})
    assert v.switches["GLUON_FORWARD"] is True
    assert "GLUON_FORWARD" not in fa.SWITCHES
    with pytest.raises(ValueError, match="unknown switches"):
        fa.variant("x.y", switches={"GLUON": True})
