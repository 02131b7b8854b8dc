"""flash_attn: every variant, forward and backward, against torch SDPA in float64.

Shapes are small and odd (tails in Nq, Nk and D; GQA; causal with Nq < Nk and Nq > Nk;
(B, N, H, D) views) so that the file stays within a few minutes on the CPU interpreter; the
same tests run compiled on a GPU.
"""
from __future__ import annotations

import itertools

import pytest
import torch
import triton

import portable_kernels as pk
from portable_kernels.kernels import flash_attn as fa
from portable_kernels.launch import LaunchPlan
from portable_kernels.testing import Tolerance, assert_close, tolerance

NAME = "flash_attn"


def _variants() -> list[str]:
    return pk.list_variants(NAME)


def _skip_unless_runnable(variant: str, device, *args, **kwargs) -> None:
    """A registered variant the device cannot run, or (given the call's arguments) whose
    predicate rejects the problem, is a skip that says why."""
    if variant not in pk.list_variants(NAME, device):
        verdict = next(v for v in pk.explain(NAME, device=device).verdicts if v.name == variant)
        pytest.skip(f"{variant}: {verdict.reason}")
    if args:
        verdict = next(v for v in pk.explain(NAME, *args, **kwargs).verdicts if v.name == variant)
        if not verdict.runnable:
            pytest.skip(f"{variant}: {verdict.reason}")


class Case:
    """One attention problem: sizes, causal flag and the memory layout of the inputs."""

    def __init__(self, b, h, h_kv, n_q, n_k, d, causal=False, layout="bhnd", sm_scale=None):
        self.b, self.h, self.h_kv, self.n_q, self.n_k, self.d = b, h, h_kv, n_q, n_k, d
        self.causal, self.layout, self.sm_scale = causal, layout, sm_scale

    def __repr__(self) -> str:
        return (f"B{self.b}-H{self.h}/{self.h_kv}-{self.n_q}x{self.n_k}-D{self.d}"
                f"{'-causal' if self.causal else ''}{'-' + self.layout if self.layout != 'bhnd' else ''}")


# Each case exercises something the others do not; every variant runs every case.
CASES = [
    Case(1, 2, 2, 113, 203, 80),                          # tails everywhere, D padded 80 -> 128
    Case(2, 4, 2, 70, 150, 96, causal=True),              # GQA, causal with Nq < Nk
    Case(1, 4, 1, 150, 70, 64, causal=True, layout="bnhd"),  # MQA, Nq > Nk, strided views
    Case(1, 2, 1, 65, 40, 256, causal=True),              # the largest D, one key block
    Case(1, 1, 1, 33, 77, 24, sm_scale=0.3),              # D split into 16-wide halves; scale
    Case(1, 2, 1, 70, 90, 64, causal=True, sm_scale=-0.2),  # negative scale: the largest
                                                          # scaled score is the raw minimum
    Case(1, 1, 1, 40, 50, 64, causal=True, sm_scale=0.0),  # zero: uniform over visible keys
]


def _leaf(shape_bhnd, layout, dtype, device, gen):
    """A leaf tensor and its (B, H, N, D) view: (B, N, H, D) storage for ``bnhd``."""
    b, h, n, d = shape_bhnd
    if layout == "bnhd":
        leaf = torch.randn(b, n, h, d, generator=gen).to(dtype).to(device).requires_grad_()
        return leaf, leaf.transpose(1, 2)
    leaf = torch.randn(b, h, n, d, generator=gen).to(dtype).to(device).requires_grad_()
    return leaf, leaf


def _grad_tolerance(tol: Tolerance, ref: torch.Tensor) -> Tolerance:
    # Gradients are sums over a sequence (dk, dv over queries; dq over keys), so their scale
    # is not 1 like attention outputs: the table's absolute part is taken relative to it.
    return Tolerance(tol.atol * max(1.0, float(ref.abs().max())), tol.rtol)


def _check(case: Case, dtype: torch.dtype, device, gen, variant: str | None = None) -> None:
    """Forward and backward of ``case`` against SDPA in float64, forcing ``variant`` (a skip
    when it cannot take the problem)."""
    leaves, views = zip(*(
        _leaf((case.b, heads, n, case.d), case.layout, dtype, device, gen)
        for heads, n in ((case.h, case.n_q), (case.h_kv, case.n_k), (case.h_kv, case.n_k))))
    if variant is not None:
        _skip_unless_runnable(variant, device, *views, causal=case.causal, sm_scale=case.sm_scale)
        with pk.use_variant(**{NAME: variant}):
            out = pk.get_kernel(NAME)(*views, causal=case.causal, sm_scale=case.sm_scale)
    else:
        out = pk.get_kernel(NAME)(*views, causal=case.causal, sm_scale=case.sm_scale)
    assert out.shape == (case.b, case.h, case.n_q, case.d) and out.dtype == dtype
    # Laid out as q (flash_attn.output_like): transformers' transpose back is then no copy.
    assert out.stride() == views[0].stride(), (out.stride(), views[0].stride())

    # The reference sees the same (rounded) inputs, in float64, through the same views.
    leaves64 = [x.detach().cpu().double().requires_grad_() for x in leaves]
    views64 = [x.transpose(1, 2) if case.layout == "bnhd" else x for x in leaves64]
    ref = fa.reference(*views64, causal=case.causal, sm_scale=case.sm_scale)
    tol = tolerance(dtype, "attention")
    assert_close(out, ref, tol, f"{case} {dtype} out")
    # A non-contiguous upstream gradient for strided cases: the backward reads it by strides.
    grad = torch.randn(out.shape, generator=gen).to(dtype)
    if case.layout == "bnhd":
        grad = torch.randn(case.b, case.n_q, case.h, case.d, generator=gen).to(dtype).transpose(1, 2)
    out.backward(grad.to(device))
    ref.backward(grad.double())
    for name, x, x64 in zip("qkv", leaves, leaves64):
        assert_close(x.grad, x64.grad, _grad_tolerance(tol, x64.grad), f"{case} {dtype} d{name}")


# --- every variant: forward and backward ----------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=repr)
@pytest.mark.parametrize("variant", _variants())
def test_variant_matches_sdpa_fp32(variant, case, device, gen):
    _skip_unless_runnable(variant, device)
    _check(case, torch.float32, device, gen, variant)


LOW_PRECISION_CASES = [
    Case(1, 4, 2, 100, 130, 96, causal=True),
    Case(2, 2, 2, 113, 203, 80, layout="bnhd"),
]


@pytest.mark.parametrize("case", LOW_PRECISION_CASES, ids=repr)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("variant", _variants())
def test_variant_matches_sdpa_low_precision(variant, dtype, case, device, gen):
    _skip_unless_runnable(variant, device)
    if dtype == torch.bfloat16 and not pk.device_info(device).has("bf16"):
        pytest.skip(f"{pk.device_info(device).name} has no bf16")
    _check(case, dtype, device, gen, variant)


@pytest.mark.parametrize(
    "deferred, head_split, transposed", list(itertools.product([False, True], [1, 2], [False, True])))
def test_every_switch_combination(deferred, head_split, transposed, device, gen):
    """The switches are independent: combinations no variant uses are correct too."""
    q = torch.randn(1, 2, 77, 48, generator=gen).to(device)
    k = torch.randn(1, 1, 90, 48, generator=gen).to(device)
    v = torch.randn(1, 1, 90, 48, generator=gen).to(device)
    plan = _plan(q, k, v)
    plan = LaunchPlan(plan.variant, plan.device, plan.configs, {
        **plan.switches, "DEFERRED": deferred, "HEAD_SPLIT": head_split, "TRANSPOSED": transposed})
    out = fa.launch(plan, q, k, v, causal=True)
    assert_close(out, fa.reference(q.cpu(), k.cpu(), v.cpu(), causal=True),
                 tolerance(torch.float32, "attention"))


@pytest.mark.parametrize("lengths", [(75, 90), (130, 61)], ids=["nq<nk", "nq>nk"])
@pytest.mark.parametrize("blocks", [(32, 64, 64, 16, 64, 16), (64, 16, 16, 32, 16, 64),
                                    (16, 32, 32, 64, 64, 32)], ids=str)
def test_tile_shapes_other_than_square(blocks, lengths, device, gen):
    """Forward, dk/dv and dq tiles with BLOCK_M != BLOCK_N (each kernel's causal loop
    bounds and tails) and of different shapes per kernel, as GPU tuning tables use them,
    for more keys than queries and fewer."""
    bm, bn, bwd_bm, bwd_bn, dq_bm, dq_bn = blocks
    n_q, n_k = lengths
    leaves = [torch.randn(1, h, n, 40, generator=gen).to(device).requires_grad_()
              for h, n in ((4, n_q), (2, n_k), (2, n_k))]
    plan = _plan(*leaves)
    cfg = triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BWD_BLOCK_M": bwd_bm, "BWD_BLOCK_N": bwd_bn,
                         "DQ_BLOCK_M": dq_bm, "DQ_BLOCK_N": dq_bn},
                        num_warps=plan.config.num_warps)
    plan = LaunchPlan(plan.variant, plan.device, [cfg], plan.switches)
    out = fa.launch(plan, *leaves, causal=True)
    grad = torch.randn(out.shape, generator=gen)
    out.backward(grad.to(device))
    leaves64 = [x.detach().cpu().double().requires_grad_() for x in leaves]
    ref = fa.reference(*leaves64, causal=True)
    ref.backward(grad.double())
    tol = tolerance(torch.float32, "attention")
    assert_close(out, ref, tol, "out")
    for name, x, x64 in zip("qkv", leaves, leaves64):
        assert_close(x.grad, x64.grad, _grad_tolerance(tol, x64.grad), f"d{name}")


def test_config_is_chosen_by_row_bytes(device):
    x = _t(1, 1, 4, 16, device=device)
    plan = _plan(x, x, x)
    small, medium, large = (triton.Config({"BLOCK_M": m, "BLOCK_N": 16, "ROW_BYTES_MAX": r})
                            for m, r in ((128, 128), (64, 256), (32, 512)))
    plan = LaunchPlan(plan.variant, plan.device, [small, medium, large], plan.switches)
    assert fa._config(plan, 64, 2) is small      # fp16 D<=64
    assert fa._config(plan, 128, 2) is medium    # fp16 D<=128
    assert fa._config(plan, 64, 4) is medium     # fp32 D<=64
    assert fa._config(plan, 256, 2) is large
    assert fa._config(plan, 256, 4) is large     # nothing fits: the last


def _plan(*args, **kwargs) -> LaunchPlan:
    return pk.get_kernel(NAME).plan(*args, **kwargs)


# --- what the forward stores for the backward, and empty sequences ---------------------------

def test_lse_is_the_log_sum_exp_of_the_scaled_scores(device, gen):
    q = torch.randn(1, 2, 70, 40, generator=gen).to(device)
    k = torch.randn(1, 2, 90, 40, generator=gen).to(device)
    v = torch.randn(1, 2, 90, 40, generator=gen).to(device)
    _, lse = fa._forward(_plan(q, k, v), q, k, v, True, 0.25)
    scores = 0.25 * q.cpu().double() @ k.cpu().double().transpose(-1, -2)
    hidden = torch.ones(70, 90, dtype=torch.bool).triu(1)  # SDPA's is_causal: keys j > i
    expect = torch.logsumexp(scores.masked_fill(hidden, float("-inf")), dim=-1)
    assert_close(lse, expect, tolerance(torch.float32, "attention"))


def test_no_keys_gives_zeros_like_sdpa(device):
    q = torch.randn(1, 2, 5, 16, device=device, requires_grad=True)
    k = torch.randn(1, 2, 0, 16, device=device, requires_grad=True)
    v = torch.randn(1, 2, 0, 16, device=device, requires_grad=True)
    out = pk.get_kernel(NAME)(q, k, v)
    assert torch.equal(out.cpu(), fa.reference(q.cpu(), k.cpu(), v.cpu()).float())
    out.sum().backward()
    assert torch.equal(q.grad.cpu(), torch.zeros(1, 2, 5, 16))


def test_no_queries(device):
    q = torch.randn(1, 2, 0, 16, device=device, requires_grad=True)
    k = torch.randn(1, 2, 7, 16, device=device, requires_grad=True)
    v = torch.randn(1, 2, 7, 16, device=device, requires_grad=True)
    out = pk.get_kernel(NAME)(q, k, v, causal=True)
    assert out.shape == (1, 2, 0, 16)
    out.sum().backward()
    assert torch.equal(k.grad.cpu(), torch.zeros(1, 2, 7, 16))


# --- bad inputs: errors naming the problem, before any launch --------------------------------

def _t(*shape, dtype=torch.float32, device="cpu"):
    return torch.zeros(*shape, dtype=dtype, device=device)


BAD = {
    "head dims differ": ((_t(1, 2, 8, 16), _t(1, 2, 8, 32), _t(1, 2, 8, 32)), ValueError, "head dim"),
    "v head dim differs": ((_t(1, 2, 8, 16), _t(1, 2, 8, 16), _t(1, 2, 8, 32)), ValueError, "head dim"),
    "H not a multiple of H_kv": ((_t(1, 3, 8, 16), _t(1, 2, 8, 16), _t(1, 2, 8, 16)), ValueError,
                                 "multiple"),
    "batch mismatch": ((_t(2, 2, 8, 16), _t(1, 2, 8, 16), _t(1, 2, 8, 16)), ValueError, "batch"),
    "k/v lengths differ": ((_t(1, 2, 8, 16), _t(1, 2, 8, 16), _t(1, 2, 9, 16)), ValueError,
                           "sequence length"),
    "k/v heads differ": ((_t(1, 2, 8, 16), _t(1, 2, 8, 16), _t(1, 1, 8, 16)), ValueError,
                         "number of heads"),
    "3-D q": ((_t(2, 8, 16), _t(1, 2, 8, 16), _t(1, 2, 8, 16)), ValueError, "4-D"),
    "3-D k and v": ((_t(1, 2, 8, 16), _t(2, 8, 16), _t(2, 8, 16)), ValueError, "4-D"),
    "D > 256": ((_t(1, 1, 4, 320), _t(1, 1, 4, 320), _t(1, 1, 4, 320)), ValueError, "head dim"),
    "integer dtype": ((_t(1, 1, 4, 16, dtype=torch.int32),) * 3, TypeError, "int32"),
    "mixed dtypes": ((_t(1, 1, 4, 16, dtype=torch.float16), _t(1, 1, 4, 16), _t(1, 1, 4, 16)),
                     TypeError, "dtypes must match"),
    "different devices": ((_t(1, 1, 4, 16), _t(1, 1, 4, 16, device="meta"), _t(1, 1, 4, 16)),
                          ValueError, "one device"),
    "not a tensor": (([[0.0]], _t(1, 1, 4, 16), _t(1, 1, 4, 16)), TypeError, "torch.Tensor"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_inputs_raise_before_launch(name):
    args, error, match = BAD[name]
    with pytest.raises(error, match=match):
        pk.get_kernel(NAME)(*args)


def test_sm_scale_must_be_a_number():
    x = _t(1, 1, 4, 16)
    with pytest.raises(TypeError, match="sm_scale"):
        pk.get_kernel(NAME)(x, x, x, sm_scale="0.5")


# --- selection -----------------------------------------------------------------------------

@pytest.mark.parametrize("profile, expected", [
    ("bi150", "iluvatar.v2"), ("bi100", "iluvatar.v2"), ("mi300x", "amd.rocm"), ("mi250x", "amd.rocm")])
def test_emulated_devices_pick_their_backends_variant(profile, expected):
    with pk.emulate(profile):
        sel = pk.explain(NAME)
    assert sel.variant == expected
    assert expected in sel.reason or "priority (100)" in sel.reason
    runnable = {v.name for v in sel.verdicts if v.runnable}
    assert {"generic", "iluvatar.v1", "iluvatar.v2", "amd.rocm"} <= runnable
    if expected == "iluvatar.v2":
        # Why V2 over V1 is part of the explanation, not only the priorities.
        assert "iluvatar.v1" in sel.reason and "seed" in sel.reason
        v1 = next(v for v in sel.verdicts if v.name == "iluvatar.v1")
        assert v1.priority == 90 and "passed over for iluvatar.v2" in v1.reason


def test_backend_variants_do_not_win_elsewhere(device):
    sel = pk.explain(NAME, device=device)
    assert sel.variant not in ("iluvatar.v1", "iluvatar.v2", "amd.rocm")
    with pk.emulate("h200"):
        assert pk.explain(NAME).variant not in ("iluvatar.v1", "iluvatar.v2", "amd.rocm")



@pytest.mark.parametrize("name", ["flash_attn", "flash_attn_varlen"])
def test_an_lse_no_one_asked_for_goes_to_scratch(name, device, gen, monkeypatch):
    """A forward without a gradient and without ``return_lse`` writes its LSE to the
    stream's kept scratch (an inference call allocates its output alone); asked for, or
    saved for a backward, the LSE is a tensor of its own. The outputs are the same bits."""
    from portable_kernels.kernels import _counters

    scratch = []

    def kept_scratch(dev, n):
        scratch.append(n)
        return torch.full((n + 5,), float("nan"), device=dev)

    monkeypatch.setattr(_counters, "kept_scratch", kept_scratch)
    handle = pk.get_kernel(name)
    if name == "flash_attn":
        q, k, v = (torch.randn(2, 3, 9, 16, generator=gen).to(device) for _ in range(3))
        args, rows = (q, k, v), 2 * 3 * 9
    else:
        q, k, v = (torch.randn(11, 3, 16, generator=gen).to(device) for _ in range(3))
        cu = torch.tensor([0, 4, 11], dtype=torch.int32, device=device)
        args, rows = (q, k, v, cu, cu, 7, 7), 3 * 11
    with _generic(name):
        plain = handle(*args, causal=True)
        assert scratch == [rows]
        out, lse = handle(*args, causal=True, return_lse=True)
        assert scratch == [rows] and not lse.isnan().any()
        assert torch.equal(plain, out)
        leaves = [t.detach().requires_grad_() for t in args[:3]]
        handle(*leaves, *args[3:], causal=True).sum().backward()
        assert scratch == [rows] and all(t.grad is not None for t in leaves)


def _generic(name: str):
    """The family's Triton kernels (``_forward``): a backend's own forward stages keep
    their LSE."""
    return pk.use_variant(**{name: "generic"})


def test_a_backends_forward_stage_passes_keep_lse_on(device, gen, monkeypatch):
    """The Stages contract carries ``keep_lse``: the Gluon stages hand a call their kernels
    do not take (here a window) to the family's forward with it."""
    from portable_kernels.kernels import _counters
    from portable_kernels_backends.nvidia.gluon import flash_attn as gluon_stages

    asked = []
    monkeypatch.setattr(_counters, "kept_scratch",
                        lambda dev, n: asked.append(n) or torch.empty(n, device=dev))
    q, k, v = (torch.randn(1, 2, 9, 16, generator=gen).to(device) for _ in range(3))
    mods = fa.dense_mods(q, True, window_size=(3, 0))
    plan = _plan(q, k, v)
    want, _ = fa._forward(plan, q, k, v, True, 0.25, mods)
    got, _ = gluon_stages.STAGES.forward(plan, q, k, v, True, 0.25, mods, False)
    assert asked == [2 * 9] and torch.equal(got, want)
