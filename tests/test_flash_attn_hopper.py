"""flash_attn's ``nvidia.hopper`` variant: the descriptor (TMA) path and its warp-specialized
loop, forced, forward and backward against torch SDPA in float64; what it rejects and why.

On the CPU the interpreter runs the same kernel (it executes device-side tensor descriptors,
zero-pads ragged tiles like the copy engine, and ignores the loop's warp-specialization
option), one config of 64-wide tiles. On an sm_90 GPU every tuned config is checked on its
own, then the autotuned path once. Shapes stay small: the interpreter pays about 4 ms per
key-block step.
"""
from __future__ import annotations

import math

import pytest
import torch
import triton

import portable_kernels as pk
from conftest import DEVICE
from portable_kernels.errors import VariantUnavailableError
from portable_kernels.kernels import flash_attn as fa
from portable_kernels.launch import LaunchPlan
from portable_kernels.testing import Tolerance, assert_close, tolerance

NAME = "flash_attn"
HOPPER = "nvidia.hopper"


def _skip_unless_hopper_runs(device) -> None:
    if HOPPER not in pk.list_variants(NAME, device):
        verdict = next(v for v in pk.explain(NAME, device=device).verdicts if v.name == HOPPER)
        pytest.skip(f"{HOPPER}: {verdict.reason}")


def _inputs(b, h, h_kv, n_q, n_k, d, dtype, device, gen, layout="bhnd"):
    """Leaf tensors and their (B, H, N, D) views (``bnhd``: (B, N, H, D) storage)."""
    leaves, views = [], []
    for heads, n in ((h, n_q), (h_kv, n_k), (h_kv, n_k)):
        if layout == "bnhd":
            leaf = torch.randn(b, n, heads, d, generator=gen).to(dtype).to(device).requires_grad_()
            view = leaf.transpose(1, 2)
        else:
            leaf = torch.randn(b, heads, n, d, generator=gen).to(dtype).to(device).requires_grad_()
            view = leaf
        leaves.append(leaf)
        views.append(view)
    return leaves, views


def _grad_tolerance(tol: Tolerance, ref: torch.Tensor) -> Tolerance:
    # Gradients are sums over a sequence, so the table's absolute part scales with them.
    return Tolerance(tol.atol * max(1.0, float(ref.abs().max())), tol.rtol)


def _check(run, dims, causal, dtype, device, gen, layout="bhnd", what=""):
    """``run(q, k, v, causal)`` against SDPA in float64, forward and backward."""
    leaves, views = _inputs(*dims, dtype, device, gen, layout)
    out = run(*views, causal)
    assert out.shape == views[0].shape and out.dtype == dtype
    leaves64 = [x.detach().cpu().double().requires_grad_() for x in leaves]
    views64 = [x.transpose(1, 2) if layout == "bnhd" else x for x in leaves64]
    ref = fa.reference(*views64, causal=causal)
    tol = tolerance(dtype, "attention")
    what = f"{what} {dims} causal={causal} {dtype}"
    assert_close(out, ref, tol, f"{what} out")
    grad = torch.randn(out.shape, generator=gen).to(dtype)
    out.backward(grad.to(device))
    ref.backward(grad.double())
    for name, x, x64 in zip("qkv", leaves, leaves64):
        assert_close(x.grad, x64.grad, _grad_tolerance(tol, x64.grad), f"{what} d{name}")


def _forced(q, k, v, causal):
    with pk.use_variant(**{NAME: HOPPER}):
        return pk.get_kernel(NAME)(q, k, v, causal=causal)


# --- forced through dispatch: the shapes the variant takes -----------------------------------

# (B, H, H_kv, Nq, Nk, D): ragged Nq and Nk (descriptors zero-pad the last tiles), GQA and
# MQA, Nq < Nk and Nq > Nk under causal.
SHAPES = [
    (1, 2, 2, 100, 130, 64),
    (2, 4, 2, 70, 150, 64),
    (1, 2, 1, 150, 70, 128),
    (1, 2, 1, 65, 200, 128),
]


@pytest.mark.parametrize("dims", SHAPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forced_matches_sdpa_fp16(dims, causal, device, gen):
    _skip_unless_hopper_runs(device)
    _check(_forced, dims, causal, torch.float16, device, gen)


@pytest.mark.parametrize("dims, causal", [((1, 4, 2, 100, 130, 128), True),
                                          ((2, 2, 1, 113, 77, 64), False)], ids=str)
def test_forced_matches_sdpa_bf16(dims, causal, device, gen):
    _skip_unless_hopper_runs(device)
    if not pk.device_info(device).has("bf16"):
        pytest.skip(f"{pk.device_info(device).name} has no bf16")
    _check(_forced, dims, causal, torch.bfloat16, device, gen)


def test_forced_on_strided_views(device, gen):
    """(B, N, H, D) storage viewed as (B, H, N, D): 16-byte aligned strides, so the
    descriptors take it without a copy."""
    _skip_unless_hopper_runs(device)
    _check(_forced, (1, 4, 2, 90, 120, 64), True, torch.float16, device, gen, layout="bnhd")


@pytest.mark.parametrize("grad_view", ["expanded", "strided"])
def test_backward_takes_any_incoming_gradient(grad_view, device, gen):
    """The backward's descriptors describe dO too, which autograd may hand over as any view:
    a sum's gradient is expanded (zero strides), a slice's is strided."""
    _skip_unless_hopper_runs(device)
    leaves, views = _inputs(1, 2, 1, 70, 90, 64, torch.float16, device, gen)
    leaves64 = [x.detach().cpu().double().requires_grad_() for x in leaves]
    if grad_view == "expanded":
        loss = lambda out: out.sum()  # noqa: E731
    else:
        loss = lambda out: out[..., ::2].sum() + (out[..., 1::2] * 2).sum()  # noqa: E731
    loss(_forced(*views, True)).backward()
    loss(fa.reference(*leaves64, causal=True)).backward()
    tol = tolerance(torch.float16, "attention")
    for name, x, x64 in zip("qkv", leaves, leaves64):
        assert_close(x.grad, x64.grad, _grad_tolerance(tol, x64.grad), f"{grad_view} d{name}")


def test_autotuned_sequence_bucket(device, gen):
    """Long enough (bucket 1024) that a GPU autotunes among the row class's configs."""
    _skip_unless_hopper_runs(device)
    _check(_forced, (1, 2, 1, 600, 530, 64), True, torch.float16, device, gen)


def test_lse_matches(device, gen):
    _skip_unless_hopper_runs(device)
    q = torch.randn(1, 2, 70, 64, generator=gen).half().to(device)
    k = torch.randn(1, 2, 90, 64, generator=gen).half().to(device)
    v = torch.randn(1, 2, 90, 64, generator=gen).half().to(device)
    with pk.use_variant(**{NAME: HOPPER}):
        plan = pk.get_kernel(NAME).plan(q, k, v)
    assert plan.variant.name == HOPPER
    _, lse = fa._forward(plan, q, k, v, True, 0.25)
    scores = 0.25 * q.cpu().double() @ k.cpu().double().transpose(-1, -2)
    hidden = torch.ones(70, 90, dtype=torch.bool).triu(1)
    expect = torch.logsumexp(scores.masked_fill(hidden, float("-inf")), dim=-1)
    assert_close(lse, expect, tolerance(torch.float16, "attention"))


def test_empty_sequences(device):
    _skip_unless_hopper_runs(device)
    q = torch.randn(1, 2, 5, 64, device=device, dtype=torch.float16, requires_grad=True)
    kv = torch.randn(1, 2, 0, 64, device=device, dtype=torch.float16, requires_grad=True)
    out = _forced(q, kv, kv, False)
    assert not out.any()
    out.float().sum().backward()
    assert not q.grad.any()
    q0 = torch.randn(1, 2, 0, 64, device=device, dtype=torch.float16)
    assert _forced(q0, q, q, True).shape == (1, 2, 0, 64)


# --- every config of the device's table, and both loop shapes --------------------------------

def _hopper_plan(device) -> LaunchPlan:
    x = torch.zeros(1, 1, 16, 64, dtype=torch.float16, device=device)
    with pk.use_variant(**{NAME: HOPPER}):
        return pk.get_kernel(NAME).plan(x, x, x)


def _single(plan: LaunchPlan, cfg: triton.Config) -> LaunchPlan:
    return LaunchPlan(plan.variant, plan.device, [cfg], plan.switches)


def _table_cases(device):
    """(config, head dim) for every config the device's plan has; on the interpreter also
    each config with the other loop shape (a config may set WARP_SPECIALIZE)."""
    if HOPPER not in pk.list_variants(NAME, device):
        return []
    plan = _hopper_plan(device)
    cases = []
    for cfg in plan.configs:
        # The largest head dim of the config's row class (fp16: 2 bytes per element).
        d = 128 if cfg.kwargs.get("ROW_BYTES_MAX", math.inf) >= 256 else 64
        ws = cfg.kwargs.get("WARP_SPECIALIZE", plan.switches["WARP_SPECIALIZE"])
        shapes = (ws, not ws) if "interpreter" in plan.device.capabilities else (ws,)
        # BWD_TMA_MIN_SEQ 0: the backward on descriptors at these short test lengths too.
        cases += [(triton.Config({**cfg.kwargs, "WARP_SPECIALIZE": w, "BWD_TMA_MIN_SEQ": 0},
                                 num_warps=cfg.num_warps, num_stages=cfg.num_stages), d)
                  for w in shapes]
    return cases


def _case_id(case) -> str:
    cfg, d = case
    return (f"D{d}-{cfg.kwargs['BLOCK_M']}x{cfg.kwargs['BLOCK_N']}-w{cfg.num_warps}"
            f"-s{cfg.num_stages}-{'ws' if cfg.kwargs['WARP_SPECIALIZE'] else 'pipelined'}"
            f"{'' if cfg.kwargs.get('TMA', True) else '-pointers'}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", _table_cases(DEVICE), ids=_case_id)
def test_every_config_is_correct(case, causal, device, gen):
    """The autotuner picks by speed alone: each config must be right on its own."""
    _skip_unless_hopper_runs(device)
    cfg, d = case
    plan = _single(_hopper_plan(device), cfg)
    run = lambda q, k, v, c: fa.launch(plan, q, k, v, causal=c)  # noqa: E731
    _check(run, (1, 2, 1, 200, 150, d), causal, torch.float16, device, gen, what=_case_id(case))


@pytest.mark.parametrize("min_seq", [0, 200, 201], ids=["zero", "the-length", "one-more"])
def test_backward_path_follows_the_sequence_length(min_seq, device, gen, monkeypatch):
    """``BWD_TMA_MIN_SEQ``: below it the descriptor variant's backward runs on pointer
    loads; either way the gradients are right."""
    _skip_unless_hopper_runs(device)
    plan = _hopper_plan(device)
    cfg = plan.configs[0]
    plan = _single(plan, triton.Config({**cfg.kwargs, "BWD_TMA_MIN_SEQ": min_seq},
                                       num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    paths = []
    launch_dkdv = fa._launch_dkdv
    monkeypatch.setattr(fa, "_launch_dkdv", lambda *a, **kw: paths.append(a[13]) or launch_dkdv(*a, **kw))
    run = lambda q, k, v, c: fa.launch(plan, q, k, v, causal=c)  # noqa: E731
    _check(run, (1, 2, 1, 200, 150, 64), True, torch.float16, device, gen)  # longer: 200
    assert paths == [min_seq <= 200]


COMBOS = [{"DEFERRED": True, "TRANSPOSED": True}, {"HEAD_SPLIT": 2, "DEFERRED": True},
          {"TRANSPOSED": True, "HEAD_SPLIT": 2}]


@pytest.mark.parametrize("ws", [False, True], ids=["pipelined", "ws"])
@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "+".join(sorted(c)))
def test_descriptor_path_composes_with_other_switches(combo, ws, device, gen):
    """TMA with the Iluvatar variants' switches (no variant uses these combinations) and a
    padded head dim (48 -> 64: the copy engine zero-fills the missing columns)."""
    _skip_unless_hopper_runs(device)
    plan = _hopper_plan(device)
    if ws and combo.get("TRANSPOSED") and combo.get("HEAD_SPLIT") == 2 \
            and "interpreter" not in plan.device.capabilities:
        pytest.skip("triton 3.6 fails to compile a warp-specialized loop with the transposed "
                    "view and a head-dim split for sm_90")
    cfg = plan.configs[0]
    cfg = triton.Config({**cfg.kwargs, "WARP_SPECIALIZE": ws}, num_warps=cfg.num_warps,
                        num_stages=cfg.num_stages)
    plan = LaunchPlan(plan.variant, plan.device, [cfg], {**plan.switches, **combo})
    q = torch.randn(1, 2, 77, 48, generator=gen).half().to(device)
    k = torch.randn(1, 1, 90, 48, generator=gen).half().to(device)
    v = torch.randn(1, 1, 90, 48, generator=gen).half().to(device)
    out = fa.launch(plan, q, k, v, causal=True)
    assert_close(out, fa.reference(q.cpu(), k.cpu(), v.cpu(), causal=True),
                 tolerance(torch.float16, "attention"))


# --- what it rejects: explained, never silently run ------------------------------------------

def _rejections():
    # Selection only: the inputs are never computed on (forcing raises before any launch).
    h = lambda *s, dtype=torch.float16: torch.zeros(*s, dtype=dtype, device=DEVICE)  # noqa: E731
    unaligned = h(1, 2, 64, 68)[..., :64]                           # rows 136 bytes apart
    not_unit = h(1, 2, 64, 128)[..., ::2]                           # stride(-1) == 2
    return {
        "fp32": ((h(1, 2, 64, 64, dtype=torch.float32),) * 3, "float32 inputs stay on pointer"),
        "D=80": ((h(1, 2, 64, 80),) * 3, "head dim 80"),
        "D=256": ((h(1, 2, 64, 256),) * 3, "head dim 256"),
        "unaligned rows": ((unaligned, unaligned, unaligned), "not multiples of 16 bytes"),
        "unaligned k": ((h(1, 2, 64, 64), unaligned, unaligned), "k's base address"),
        "head dim not contiguous": ((not_unit,) * 3, "stride(-1) != 1"),
    }


@pytest.mark.parametrize("name", list(_rejections()))
def test_unsupported_problems_fall_back_with_a_reason(name):
    args, reason = _rejections()[name]
    with pk.emulate("h200"):
        sel = pk.explain(NAME, *args)
    assert sel.variant == "generic"
    verdict = next(v for v in sel.verdicts if v.name == HOPPER)
    assert not verdict.runnable and reason in verdict.reason, verdict.reason


@pytest.mark.parametrize("name", list(_rejections()))
def test_forcing_an_unsupported_problem_raises(name):
    args, reason = _rejections()[name]
    with pk.use_variant(**{NAME: HOPPER}):
        with pytest.raises(VariantUnavailableError, match="cannot run"):
            pk.get_kernel(NAME)(*args)


def test_chosen_on_hopper_and_nowhere_else():
    x = torch.zeros(1, 2, 64, 128, dtype=torch.bfloat16, device=DEVICE)
    for profile in ("h100", "h200"):
        with pk.emulate(profile):
            assert pk.explain(NAME, x, x, x).variant == HOPPER
    with pk.emulate("a100"):
        sel = pk.explain(NAME, x, x, x)
    assert sel.variant == "generic"
    assert "requires tensor_descriptor, warp_specialize" in next(
        v.reason for v in sel.verdicts if v.name == HOPPER)
    here = next(v for v in pk.explain(NAME, x, x, x).verdicts if v.name == HOPPER)
    if DEVICE.type == "cpu":
        assert here.priority < 0  # runnable on the interpreter when forced, never chosen there
    else:
        assert here.priority == (100 if pk.device_info(DEVICE).has("wgmma") else -10)


# --- the tuning table and the autotuner's candidates -----------------------------------------

def test_warp_specialization_is_opt_in(device):
    """A config that does not name WARP_SPECIALIZE (a vendor's table, a sweep's one-config
    plan) gets the pipelined two-loop forward: the warp-specialized loop passed small tests
    on the H200 but computed wrong outputs at N = 4096 with triton 3.6."""
    _skip_unless_hopper_runs(device)
    plan = _hopper_plan(device)
    cfg = plan.configs[0]
    bare = triton.Config({k: v for k, v in cfg.kwargs.items() if k != "WARP_SPECIALIZE"},
                         num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    tuned = fa._autotuned_forward(_single(plan, bare))
    assert [c.kwargs["WARP_SPECIALIZE"] for c in tuned.configs] == [False]
    opted = triton.Config({**bare.kwargs, "WARP_SPECIALIZE": True},
                          num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    assert [c.kwargs["WARP_SPECIALIZE"] for c in fa._autotuned_forward(_single(plan, opted)).configs] == [True]


def test_sm90_table_is_consistent():
    """No warp-specialized config (wrong results on sm_90 with triton 3.6); each row class
    leads with complete backward settings, whose dq kernel holds at least 64 queries (a
    warpgroup MMA's rows) in the descriptor table and the generic table's 16-bit rows."""
    from portable_kernels_backends.nvidia import tuning

    h200 = pk.plugins.host().emulation_profile("h200")
    configs = tuning.flash_attn_hopper(h200)
    generic = tuning._flash_attn(h200)
    bwd = ("BWD_BLOCK_M", "BWD_BLOCK_N", "BWD_NUM_WARPS", "BWD_NUM_STAGES",
           "DQ_BLOCK_M", "DQ_BLOCK_N", "DQ_NUM_WARPS", "DQ_NUM_STAGES")
    for cfg in configs:
        assert cfg.kwargs["BLOCK_M"] in (64, 128) and cfg.kwargs["BLOCK_N"] in (64, 128)
        assert 2 <= cfg.num_stages <= 4
        assert cfg.kwargs["WARP_SPECIALIZE"] is False
    for table in (configs, generic):
        for row in (128, 256):
            first = next(c for c in table if c.kwargs["ROW_BYTES_MAX"] >= row)
            assert first.kwargs["ROW_BYTES_MAX"] == row
            assert all(k in first.kwargs for k in bwd)
            assert first.kwargs["DQ_BLOCK_M"] >= 64
            assert fa._backward_blocks(first) == tuple(first.kwargs[k] for k in (
                "BWD_BLOCK_M", "BWD_BLOCK_N", "DQ_BLOCK_M", "DQ_BLOCK_N"))


def test_a_config_may_take_pointer_loads_for_the_forward():
    """The forward autotunes among descriptor and pointer-load tiles (the sm_90 table has
    both); ``TMA`` is the launcher's key, never passed on as a compiler option."""
    from portable_kernels_backends.nvidia import tuning

    h200 = pk.plugins.host().emulation_profile("h200")
    plan = LaunchPlan(_hopper_plan(DEVICE).variant, h200, tuning.flash_attn_hopper(h200),
                      {**fa.SWITCHES, "TMA": True})
    paths = {c.kwargs["TMA"] for c in fa._autotuned_forward(plan).configs}
    assert paths == {True, False}
    for cfg in plan.configs:
        assert "TMA" not in fa._options(cfg) and "TMA" not in fa._options(cfg, "dq")


def test_backward_options_per_kernel():
    cfg = triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BWD_NUM_WARPS": 4, "BWD_NUM_STAGES": 2,
                         "DQ_NUM_WARPS": 8, "waves_per_eu": 2}, num_warps=8, num_stages=3)
    assert fa._options(cfg) == {"waves_per_eu": 2, "num_warps": 8, "num_stages": 3}
    assert fa._options(cfg, "dkdv") == {"waves_per_eu": 2, "num_warps": 4, "num_stages": 2}
    assert fa._options(cfg, "dq") == {"waves_per_eu": 2, "num_warps": 8, "num_stages": 2}
    # Without backward keys every kernel takes the forward's tile and options.
    plain = triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=2)
    assert fa._backward_blocks(plain) == (64, 32, 64, 32)
    assert fa._options(plain, "dq") == fa._options(plain) == {"num_warps": 4, "num_stages": 2}


def test_candidates_are_the_tightest_row_class():
    c = [triton.Config({"BLOCK_M": 128, "BLOCK_N": n}, num_warps=w) for n, w in
         ((128, 4), (64, 4), (64, 8), (128, 8))]
    classes = {c[0]: {128}, c[1]: {128, 256}, c[2]: {256}, c[3]: {512}}
    assert fa._candidates(c, classes, 128, 4096) == [c[0], c[1]]
    assert fa._candidates(c, classes, 256, 4096) == [c[1], c[2]]
    assert fa._candidates(c, classes, 512, 4096) == [c[3]]
    assert fa._candidates(c, classes, 1024, 4096) == [c[3]]        # none fits: the last
    assert fa._candidates(c, classes, 128, 256) == [c[0]]          # short: the first, untuned
    assert fa._candidates(c, {}, 128, 4096) == c                   # no ROW_BYTES_MAX: all fit
