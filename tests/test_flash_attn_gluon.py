"""flash_attn's ``nvidia.hopper_gluon`` variant, the NVIDIA backend's own kernels
(``backends/nvidia/gluon/``): its Gluon forward and backward, with the family's
preprocess and argument checks, against float64; what it takes, what it leaves to
``nvidia.hopper`` and why; its stages inside the family's launcher and operators.

Gluon kernels do not run under Triton's interpreter, so the numerical tests need an sm_90
GPU and skip elsewhere with the variant's own reason; selection and the predicate are
tested everywhere (``ci/sm90_compile.py`` compiles the kernel for sm_90 on the CPU machine).
"""
from __future__ import annotations

import types

import pytest
import torch

import portable_kernels as pk
from portable_kernels import plugins, tune
from conftest import DEVICE, assert_checked_descriptor
from portable_kernels.errors import VariantUnavailableError
from portable_kernels import dispatch
from portable_kernels.kernels import _counters
from portable_kernels.kernels import flash_attn as fa
from portable_kernels.launch import LaunchPlan
from portable_kernels_backends.nvidia.gluon import _common
from portable_kernels_backends.nvidia.gluon import flash_attn as gfa
from portable_kernels_backends.nvidia.gluon import flash_attn_gluon as fg
from portable_kernels.testing import assert_close, tolerance
from test_flash_attn_hopper import _check, _grad_tolerance, _inputs

NAME = "flash_attn"
GLUON = "nvidia.hopper_gluon"


@pytest.fixture(autouse=True)
def small_problems(monkeypatch):
    """The tests' sequences are far below MIN_KEYS and BWD_MIN_KEYS (the thresholds of the
    automatic choice and of the Gluon backward); forced runs of them still check the
    kernels."""
    monkeypatch.setattr(fg, "MIN_KEYS", {})
    monkeypatch.setattr(fg, "BWD_MIN_KEYS", {})


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


@pytest.mark.parametrize("dims", [(2, 4, 2, 200, 330, 64), (1, 2, 1, 390, 250, 64),
                                  (1, 2, 2, 384, 384, 64)], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_three_consumers_at_d64(dims, causal, device, gen, nan_empty, monkeypatch):
    """Long key loops at D=64 take three consumer warpgroups (192 query rows, ping-pong
    among three); forced here on short ones: ragged, GQA, causal Nq > Nk and Nq = Nk."""
    _skip_unless_gluon_runs(device, dims)
    monkeypatch.setattr(fg, "D64_CONSUMERS_MIN_KEYS", 0)
    assert fg.D64_CONSUMERS == 3
    _check(_forced, dims, causal, torch.float16, device, gen)


@pytest.mark.parametrize("order", [0, 1], ids=["key order", "masked last block first"])
@pytest.mark.parametrize("dims, causal, three", [
    ((2, 4, 2, 200, 330, 64), True, False), ((1, 2, 2, 384, 384, 64), True, True),
    ((1, 2, 1, 390, 250, 128), False, False), ((1, 2, 2, 256, 512, 128), False, False)],
    ids=str)
def test_every_key_order(dims, causal, three, order, device, gen, nan_empty, monkeypatch):
    """KEY_ORDER, either way: key blocks in key order, or the last one first when it needs
    the mask (so a 192-row causal tile's first rows see no key in its first block); the
    first block masked or not (MASK_FIRST)."""
    _skip_unless_gluon_runs(device, dims)
    monkeypatch.setattr(fg, "KEY_ORDER", order)
    if three:
        monkeypatch.setattr(fg, "D64_CONSUMERS_MIN_KEYS", 0)
    _check(_forced, dims, causal, torch.float16, device, gen)


@pytest.mark.parametrize("pack", [0, 1], ids=["p.to", "cvt x2 asm"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dims, causal", [((1, 2, 2, 200, 330, 64), True),
                                          ((1, 2, 1, 390, 250, 128), False)], ids=str)
def test_either_packing_of_p(dims, causal, dtype, pack, device, gen, nan_empty, monkeypatch):
    """PACK_P, either way: P converted element by element, or two elements per register
    in inline PTX, whose halves must come out in the order the MMA reads them."""
    _skip_unless_gluon_runs(device, dims)
    monkeypatch.setattr(fg, "PACK_P", pack)
    _check(_forced, dims, causal, dtype, device, gen)


# (B, H, H_kv, Nq, Nk, D): more tiles than an H200 has SMs (192 and 240), so a persistent
# grid's programs take tiles from the launch's queue: ragged Nq and Nk, GQA, causal Nq < Nk.
WALK_SHAPES = [(2, 40, 20, 300, 520, 64), (3, 32, 8, 250, 250, 128)]


@pytest.mark.parametrize("dims", WALK_SHAPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("programs", [None, 3], ids=["one per SM", "3 programs"])
def test_persistent_grid_takes_every_tile_once(dims, causal, programs, device, gen, nan_empty,
                                               monkeypatch):
    """PERSISTENT: each program takes tiles until the queue has none left. Every row is
    written (outputs start as NaN) and right, forward and backward; a second call gets a
    queue whose counter the first left at zero, and it is zero after it too."""
    _skip_unless_gluon_runs(device, dims)
    assert fg.PERSISTENT
    if programs:
        monkeypatch.setattr(fg, "_num_sms", lambda plan, device: programs)
    b, h, _, n_q, _, d = dims
    assert -(-n_q // 128) * b * h > torch.cuda.get_device_properties(
        device).multi_processor_count, "the shape must have more tiles than SMs"
    for _ in range(2):
        _check(_forced, dims, causal, torch.float16, device, gen)
    queue = _counters.kept_zeros(torch.device("cuda", torch.cuda.current_device()), 1)
    torch.cuda.synchronize()
    assert not queue.any(), "a launch left the tile queue's counter set"


def test_persistent_forward_in_cuda_graphs(device, gen):
    """Captured in CUDA graphs, the persistent forward draws its tiles from a counter of
    the capture's own, zeroed inside the graph, and left at zero by every replay: two
    captures of one call, replayed in the other order and twice each, give the eager
    result bit for bit."""
    _skip_unless_gluon_runs(device)
    if torch.version.cuda is None:
        pytest.skip("CUDA graphs")
    q, k, v = (torch.randn(2, 40, 300, 64, generator=gen).half().to(device) for _ in range(3))
    assert 3 * 2 * 40 > torch.cuda.get_device_properties(device).multi_processor_count
    with pk.use_variant(**{NAME: GLUON}):
        plan = pk.get_kernel(NAME).plan(q, k, v, causal=True)
    forward = fa.stages(plan).forward
    eager = forward(plan, q, k, v, True, 0.125)[0]  # compiles outside the captures
    torch.cuda.synchronize()
    graphs, outs = [], []
    capture = torch.cuda.Stream(device)
    for _ in range(2):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=capture):
            outs.append(forward(plan, q, k, v, True, 0.125)[0])
        graphs.append(graph)
    for i in (1, 0):
        for replay in range(2):
            outs[i].fill_(float("nan"))
            graphs[i].replay()
            torch.cuda.synchronize()
            assert torch.equal(outs[i], eager), f"graph {i}, replay {replay}: not the eager result"


@pytest.mark.parametrize("sm_scale", [0.3, -0.2, 0.0], ids=["positive", "negative", "zero"])
def test_scales_and_lse(sm_scale, device, gen, nan_empty):
    """A non-positive scale takes the scale-first softmax (the raw-score max is only right
    for a positive one); the LSE is the natural log-sum-exp of the scaled scores."""
    _skip_unless_gluon_runs(device)
    q, k, v = (torch.randn(1, 2, 256, 64, generator=gen).half().to(device) for _ in range(3))
    with pk.use_variant(**{NAME: GLUON}):
        plan = pk.get_kernel(NAME).plan(q, k, v)
    assert plan.variant.name == GLUON
    out, lse = fa.stages(plan).forward(plan, q, k, v, True, sm_scale)
    q64, k64, v64 = (x.cpu().double() for x in (q, k, v))
    tol = tolerance(torch.float16, "attention")
    assert_close(out, fa.reference(q64, k64, v64, causal=True, sm_scale=sm_scale), tol, "out")
    scores = sm_scale * q64 @ k64.transpose(-1, -2)
    hidden = torch.ones(256, 256, dtype=torch.bool).triu(1)
    assert_close(lse, torch.logsumexp(scores.masked_fill(hidden, float("-inf")), dim=-1), tol,
                 "lse")


def test_seen_calls_launch_the_compiled_kernels(device, gen, nan_empty):
    """After a problem's first call, the Gluon forward and backward launch their compiled
    kernels directly (``_direct``), each launch describing the tensors it is given: fresh
    inputs of the same sizes get their own results, forward and backward."""
    _skip_unless_gluon_runs(device)
    if torch.version.cuda is None:
        pytest.skip("direct launches are used on NVIDIA GPUs only")
    dims = (1, 4, 2, 300, 260, 64)
    q = torch.empty(1, 4, 300, 64, device=device, dtype=torch.float16)
    kv = torch.empty(1, 2, 260, 64, device=device, dtype=torch.float16)
    with pk.use_variant(**{NAME: GLUON}):
        plan = pk.get_kernel(NAME).plan(q, kv, kv, causal=True)
    kernels = (fg._flash_attn_fwd_gluon_kernel, fg._flash_attn_bwd_gluon_kernel)
    _check(_forced, dims, True, torch.float16, device, gen)
    before = [plan.direct(kernel).launches for kernel in kernels]
    for _ in range(2):
        _check(_forced, dims, True, torch.float16, device, gen)
    after = [plan.direct(kernel).launches for kernel in kernels]
    assert [a - b for a, b in zip(after, before)] == [2, 2], "seen calls took the JIT path"


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


@pytest.mark.parametrize("fused_dq", [False, True], ids=["dq_kernel", "dq_fused"])
@pytest.mark.parametrize("dims, causal", [((2, 4, 2, 200, 330, 128), True),
                                          ((1, 4, 1, 390, 250, 64), False)], ids=str)
def test_backward_with_and_without_the_fused_dq(dims, causal, fused_dq, device, gen, nan_empty):
    """The Gluon dk/dv kernel with dq added up in it (GLUON_DQ, the variant's default) and
    with the family's dq kernel after it, at both head dims: both against float64. Nq = 200
    and 390 leave a partial block whose rows past Nq land in the next head's part of dq's
    buffer: they must add zeros there."""
    _skip_unless_gluon_runs(device, dims)
    x = torch.empty(1, 1, 1, dims[5], device=device, dtype=torch.float16)
    with pk.use_variant(**{NAME: GLUON}):
        chosen = pk.get_kernel(NAME).plan(x, x, x)
    assert chosen.switches["GLUON_DQ"] is True
    plan = LaunchPlan(chosen.variant, chosen.device, chosen.configs,
                      {**chosen.switches, "GLUON_DQ": fused_dq})
    _check(lambda q, k, v, causal: fa.launch(plan, q, k, v, causal), dims, causal,
           torch.float16, device, gen)


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


class _Launches:
    """Stands in for a Gluon kernel: records each launch's grid and keyword arguments."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


@pytest.mark.parametrize("d, causal, n_k, consumers", [
    (64, False, 4096, 3), (64, True, 8192, 3), (64, True, 4096, 2), (64, False, 4095, 2),
    (128, False, 16384, 2)], ids=str)
def test_forward_consumers_follow_the_mean_key_loop(d, causal, n_k, consumers, monkeypatch):
    """Three consumer warpgroups (192 query rows a program) only at D=64 and only when a
    program's mean key loop, Nk or Nk/2 causal, reaches D64_CONSUMERS_MIN_KEYS; each count
    with its register split. Host logic only: the launch is recorded, not run."""
    launches = _Launches()
    monkeypatch.setattr(fg, "_flash_attn_fwd_gluon_kernel", launches)
    q = torch.empty(2, 4, 1000, d, dtype=torch.float16)
    k = torch.empty(2, 4, n_k, d, dtype=torch.float16)
    fg.forward(q, k, k, causal, 0.125)
    (grid, _, kwargs), = launches.calls
    assert kwargs["CONSUMERS"] == consumers
    assert kwargs["CONSUMER_REGS"] == fg.CONSUMER_REGS[consumers]
    assert grid == (-(-1000 // (64 * consumers)) * 2 * 4,) and kwargs["WALK"] is False


@pytest.mark.parametrize("order, causal, n_k, mask_first", [
    (1, False, 1024, False), (1, False, 1000, True), (1, True, 1024, True),
    (1, False, 100, True), (0, False, 1000, False),
    (0, False, 100, True), (0, True, 1024, True)], ids=str)
def test_first_block_masked_only_when_it_needs_it(order, causal, n_k, mask_first,
                                                   monkeypatch):
    """A tile's first block is masked when causal (the diagonal, or in key order block 0,
    the first tile's diagonal) or when it is the key tail: the last block (KEY_ORDER 1) or
    block 0 under one block of keys (key order). Host logic only: the launch is recorded,
    not run."""
    launches = _Launches()
    monkeypatch.setattr(fg, "_flash_attn_fwd_gluon_kernel", launches)
    monkeypatch.setattr(fg, "KEY_ORDER", order)
    q = torch.empty(1, 2, 1000, 128, dtype=torch.float16)
    k = torch.empty(1, 2, n_k, 128, dtype=torch.float16)
    fg.forward(q, k, k, causal, 0.125)
    (_, _, kwargs), = launches.calls
    assert kwargs["MASK_FIRST"] is mask_first and kwargs["KEY_ORDER"] == order


@pytest.mark.parametrize("persistent", [1, 0])
def test_forward_walks_tiles_only_past_one_per_sm(persistent, monkeypatch):
    """With PERSISTENT, more tiles than SMs, two consumers and a mean key loop under
    PERSISTENT_MAX_KEYS: one program per SM (the plan's count), walking tiles drawn from a
    kept counter that starts at zero; otherwise one program per tile, the counter not
    passed. Host logic only: the launch is recorded, not run."""
    launches = _Launches()
    monkeypatch.setattr(fg, "_flash_attn_fwd_gluon_kernel", launches)
    monkeypatch.setattr(fg, "PERSISTENT", persistent)
    h200 = plugins.host().emulation_profile("h200")
    plan = types.SimpleNamespace(device=h200)
    monkeypatch.setattr(fg._host, "launcher", lambda plan, kernel: kernel)
    few = torch.empty(1, 4, 1000, 128, dtype=torch.float16)    # 32 tiles
    many = torch.empty(4, 32, 1000, 128, dtype=torch.float16)  # 1024 tiles
    fg.forward(few, few, few, False, 0.1, plan)
    fg.forward(many, many, many, True, 0.1, plan)
    three = torch.empty(4, 32, 16384, 64, dtype=torch.float16)  # three consumers
    fg.forward(three, three, three, True, 0.1, plan)
    long = torch.empty(1, 32, 2 * fg.PERSISTENT_MAX_KEYS, 128, dtype=torch.float16)
    fg.forward(long, long, long, True, 0.1, plan)  # mean key loop Nk / 2 = the limit
    (grid_few, args_few, kw_few), (grid_many, args_many, kw_many), (_, _, kw_three), \
        (_, _, kw_long) = launches.calls
    assert kw_three["CONSUMERS"] == 3 and kw_three["WALK"] is False
    assert kw_long["CONSUMERS"] == 2 and kw_long["WALK"] is False
    assert grid_few == (32,) and kw_few["WALK"] is False
    for desc in args_many[:3]:
        assert_checked_descriptor(desc)
    if persistent:
        assert grid_many == (h200.num_sms,) and kw_many["WALK"] is True
        queue = args_many[5]
        assert queue.dtype == torch.int32 and not queue.any()
    else:
        assert grid_many == (1024,) and kw_many["WALK"] is False


def test_backward_launch_fuses_dq_only_with_its_buffer(monkeypatch):
    """dk/dv alone, or with dq's fp32 buffer described as (B·H·Nq, D) in 32-column boxes."""
    launches = _Launches()
    monkeypatch.setattr(fg, "_flash_attn_bwd_gluon_kernel", launches)
    q = torch.empty(2, 4, 300, 128, dtype=torch.float16)
    k = torch.empty(2, 2, 500, 128, dtype=torch.float16)
    lse = torch.empty(2, 4, 300)
    fg.backward(q, k, k, q, lse, lse, k, k, True, 0.1)
    acc = torch.zeros(2, 4, 300, 128)
    fg.backward(q, k, k, q, lse, lse, k, k, True, 0.1, dq_acc=acc)
    (grid, plain, plain_kw), (_, fused, fused_kw) = launches.calls
    assert grid == (-(-500 // 128), 2 * 2)
    assert plain_kw["FUSED_DQ"] is False and fused_kw["FUSED_DQ"] is True
    dq_desc = fused[4]
    assert list(dq_desc.shape) == [2 * 4 * 300, 128] and list(dq_desc.block_shape) == [64, 32]
    assert dq_desc.base.data_ptr() == acc.data_ptr()
    for desc in (*plain[:4], *fused[:5]):
        assert_checked_descriptor(desc)


@pytest.mark.parametrize("d, least", [(64, 2048), (128, 1024)])
def test_short_key_sequences_stay_on_nvidia_hopper(d, least, monkeypatch):
    """Below its head dim's MIN_KEYS (shorter key loops measured slower than nvidia.hopper)
    the variant declines, naming the threshold; from it on it takes the call. It sees Nk
    rounded down to a power of two (the family's ``Problem.keys``), exact for thresholds
    that are powers of two, as the shipped ones are."""
    monkeypatch.setattr(fg, "MIN_KEYS", {64: 2048, 128: 1024})

    def issue(n):
        return gfa.keys_issue(d, fa.key_class(n))

    assert f"Nk is below {least} keys (MIN_KEYS at D={d})" in issue(least - 1)
    # One message for every short length.
    assert issue(100) == issue(least - 1) == issue(0)
    assert issue(least) == issue(2 * least - 1) == issue(10 ** 6) == ""
    assert gfa.keys_issue(96, 1) == ""  # no threshold at D=96


def test_shipped_key_thresholds_are_powers_of_two():
    """keys_issue decides MIN_KEYS exactly only for powers of two (see above)."""
    for least in fg.MIN_KEYS.values():
        assert least > 0 and least & (least - 1) == 0, fg.MIN_KEYS


@pytest.mark.parametrize("profile", ["h200", "h100"])
def test_chosen_under_emulation_for_a_large_bf16_call_on_cuda_tensors(profile, monkeypatch):
    """Selection as an sm_90 GPU with Triton 3.6 makes it, from any machine: the problem of
    CUDA tensors (only its device differs from a CPU call's) goes to the variant when long
    enough, to nvidia.hopper with the threshold named when not. The executing device is
    the suite's (a GPU machine has no CPU device to run kernels on)."""
    monkeypatch.setattr(_common, "TRITON_OK", True)
    monkeypatch.setattr(fg, "MIN_KEYS", {64: 2048, 128: 1024})

    def select(n_k, d=128):
        q = torch.empty(1, 2, 256, d, dtype=torch.bfloat16)
        kv = torch.empty(1, 2, n_k, d, dtype=torch.bfloat16)
        with pk.emulate(profile):
            cuda = fa.problem(q, kv, kv, True)._replace(device=torch.device("cuda", 0))
            return dispatch.select(NAME, cuda, dispatch._resolve_device(DEVICE))

    sel = select(4096)
    assert sel.variant == GLUON and "written in Gluon" in sel.verdicts[0].reason
    short = select(1000)
    assert short.variant == "nvidia.hopper"
    assert "Nk is below 1024 keys" in next(v for v in short.verdicts if v.name == GLUON).reason


@pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU tensors run under Triton's interpreter, "
                    "which a process that compiles for its GPU does not use")
@pytest.mark.parametrize("profile", ["h200", "h100"])
def test_declined_under_emulation_for_cpu_tensors(profile, monkeypatch):
    """The same long call of CPU tensors: the variant declines with the interpreter's reason."""
    monkeypatch.setattr(_common, "TRITON_OK", True)
    q = torch.empty(1, 2, 256, 128, dtype=torch.bfloat16)
    kv = torch.empty(1, 2, 4096, 128, dtype=torch.bfloat16)
    with pk.emulate(profile):
        on_cpu = pk.explain(NAME, q, kv, kv)
    verdict = next(v for v in on_cpu.verdicts if v.name == GLUON)
    assert on_cpu.variant != GLUON and "Triton's interpreter does not run them" in verdict.reason


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


def test_the_family_knows_no_gluon():
    """The variant runs its own stages inside the family's launcher; the family has no
    switch for them (GLUON_DQ is the variant's, read by its backward only), and its other
    variants run the family's stages."""
    with pytest.raises(ValueError, match="unknown switches"):
        fa.variant("x.y", switches={"GLUON_DQ": True})
    variants = plugins.host().registry.variants[NAME]
    gluon = variants[GLUON]
    assert gluon.launch.stages is gfa.STAGES and gluon.switches["GLUON_DQ"] is True
    assert gluon.switches["TMA"] is True and gluon.plugin == "nvidia"
    h200 = plugins.host().emulation_profile("h200")
    assert fa.stages(LaunchPlan(gluon, h200, [], dict(gluon.switches))) is gfa.STAGES
    hopper = variants["nvidia.hopper"]
    assert fa.stages(LaunchPlan(hopper, h200, [], dict(hopper.switches))) == (
        fa._forward, fa._backward)


def _gluon_plan_on_pointers(q, k, v, **switches):
    """(the generic variant's plan for q, k, v, a plan of the Gluon variant with the
    generic one's configs and switches and ``switches``): the variant's stages around
    family kernels that run on every device (the Gluon ones stood in for)."""
    with pk.use_variant(**{NAME: "generic"}):
        generic = pk.get_kernel(NAME).plan(q, k, v)
    gluon = plugins.host().registry.variants[NAME][GLUON]
    return generic, LaunchPlan(gluon, generic.device, generic.configs,
                               {**generic.switches, "GLUON_DQ": True, **switches})


@pytest.mark.parametrize("fused_dq", [False, True], ids=["dq_kernel", "dq_fused"])
def test_gluon_backward_wiring(fused_dq, monkeypatch):
    """The backward's dk/dv come from flash_attn_gluon.backward (the GPU tests above check
    its numbers) after the family's preprocess; with GLUON_DQ, dq is what that kernel added
    into its fp32 buffer, else the family's dq kernel's."""
    calls = []

    def fake(q, k, v, do, lse, delta, dk, dv, causal, scale, dq_acc=None, plan=None):
        calls.append((q.shape, k.shape, causal, scale, dq_acc is not None, plan))
        assert torch.allclose(delta, (out.float() * do.float()).sum(-1), atol=1e-5)
        dk.fill_(1.0)
        dv.fill_(2.0)
        if dq_acc is not None:
            assert dq_acc.dtype == torch.float32 and not dq_acc.any()
            dq_acc.fill_(3.0)

    monkeypatch.setattr(fg, "backward", fake)
    q, k, v = (torch.randn(1, 2, 40, 64, device=DEVICE) for _ in range(3))
    generic, plan = _gluon_plan_on_pointers(q, k, v, GLUON_DQ=fused_dq)
    out, lse = fa._forward(generic, q, k, v, True, 0.125)
    do = torch.randn_like(out)
    dq, dk, dv, delta = gfa.backward(plan, do, q, k, v, out, lse, True, 0.125,
                                     return_delta=True)
    assert torch.allclose(delta, (out * do).sum(-1), atol=1e-5)
    assert calls == [(q.shape, k.shape, True, 0.125, fused_dq, plan)]  # plan: direct launches
    assert (dk == 1.0).all() and (dv == 2.0).all()
    if fused_dq:
        assert (dq == 3.0).all()
    else:  # the family's dq kernel, as the generic plan runs it
        assert torch.equal(dq, fa._backward(generic, do, q, k, v, out, lse, True, 0.125)[0])


def test_backward_below_its_threshold_runs_the_family_kernels(monkeypatch):
    """A call the variant took with fewer than BWD_MIN_KEYS keys (its head dim's) gets the
    family's Triton backward, nvidia.hopper's: the Gluon kernel is not called and the
    gradients are the family kernels' (host logic and the family's kernels; the Gluon
    kernel's numbers are checked on the GPU above)."""
    monkeypatch.setattr(fg, "backward", lambda *args, **kwargs: pytest.fail("Gluon backward ran"))
    q, k, v = (torch.randn(1, 2, 40, 64, device=DEVICE) for _ in range(3))
    monkeypatch.setattr(fg, "BWD_MIN_KEYS", {64: 41, 128: 1})
    assert not fg.backward_takes(40, 64) and fg.backward_takes(41, 64)
    assert fg.backward_takes(40, 128) and fg.backward_takes(40, 96)  # no threshold at D=96
    generic, plan = _gluon_plan_on_pointers(q, k, v)
    out, lse = fa._forward(generic, q, k, v, True, 0.125)
    do = torch.randn_like(out)
    grads = gfa.backward(plan, do, q, k, v, out, lse, True, 0.125)
    for got, want in zip(grads, fa._backward(generic, do, q, k, v, out, lse, True, 0.125)):
        assert torch.equal(got, want)


def test_gluon_forward_wiring_and_its_reported_tile(monkeypatch):
    """The forward is flash_attn_gluon.forward's (the GPU tests above check its numbers),
    and ``portable-kernels tune`` names its fixed tile, not the first config of the table
    the plan shares with nvidia.hopper."""
    calls = []

    def fake(q, k, v, causal, scale, plan):
        calls.append((q.shape, causal, scale, plan))
        return torch.full_like(q, 4.0), torch.zeros(q.shape[:3])

    monkeypatch.setattr(fg, "forward", fake)
    q = torch.randn(1, 2, 40, 64, device=DEVICE)
    _, plan = _gluon_plan_on_pointers(q, q, q)
    out, _ = gfa.forward(plan, q, q, q, False, 0.125)
    assert calls == [(q.shape, False, 0.125, plan)] and (out == 4.0).all()
    assert tune._chosen_configs(plan) == fg.tile().best_config


@pytest.mark.parametrize("through", ["launcher", "ops"])
def test_stages_run_through_autograd_and_the_operators(through, monkeypatch):
    """The family's launcher (its autograd) and ``portable_kernels.ops``' forward and
    backward operators run the variant's stages: the Gluon kernels (stood in for) give
    out, lse, dk, dv and dq; the family's preprocess gives delta."""
    from portable_kernels import ops

    q, k, v = (torch.randn(1, 2, 40, 64, device=DEVICE) for _ in range(3))
    generic, plan = _gluon_plan_on_pointers(q, k, v)
    want, want_lse = fa._forward(generic, q, k, v, True, 0.125)
    # Not the family kernels' output, so that the test sees whose forward ran.
    monkeypatch.setattr(fg, "forward", lambda q, k, v, causal, scale, plan: (
        want + 1.0, want_lse.clone()))

    def backward(q, k, v, do, lse, delta, dk, dv, causal, scale, dq_acc=None, plan=None):
        dk.fill_(1.0)
        dv.fill_(2.0)
        dq_acc.fill_(3.0)

    monkeypatch.setattr(fg, "backward", backward)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    if through == "ops":
        handle = pk.get_kernel(NAME)
        monkeypatch.setattr(type(handle), "plan", lambda self, *args, **kwargs: plan)
        monkeypatch.setattr(ops, "_handle", lambda name: handle)
        out = torch.ops.portable_kernels.flash_attn(*leaves, True, 0.125)  # the operators
    else:
        out = plan.variant.launch(plan, *leaves, True, 0.125)
    assert torch.equal(out.detach(), want + 1.0)
    out.sum().backward()
    for x, fill in zip(leaves, (3.0, 1.0, 2.0)):
        assert (x.grad == fill).all()


def test_the_core_imports_no_gluon_and_no_backend():
    """The vendor-neutral core (portable_kernels/) imports neither Gluon nor a backend: the
    Gluon kernels reach it only as variants the NVIDIA backend registers."""
    import pathlib

    import portable_kernels

    root = pathlib.Path(portable_kernels.__file__).parent
    found = [f"{path.relative_to(root)}:{n}" for path in sorted(root.rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if line.lstrip().startswith(("import ", "from "))
             and ("gluon" in line or "portable_kernels_backends" in line)]
    assert not found, found
