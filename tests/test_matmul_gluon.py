"""matmul's ``nvidia.hopper_gluon`` variant, the NVIDIA backend's own kernel
(``backends/nvidia/gluon/``): its Gluon kernel against float64 in every operand layout, with
tails in every dimension and programs walking many tiles; what it takes, what it leaves to
``nvidia.persistent_tma`` and why.

Gluon kernels do not run under Triton's interpreter, so the numerical tests need an sm_90
GPU and skip elsewhere with the variant's own reason; selection, the predicate and the
launcher's host logic are tested everywhere (``ci/sm90_compile.py`` compiles the kernel
for sm_90 on the CPU machine).
"""
from __future__ import annotations

import types

import pytest
import torch
import triton

import portable_kernels as pk
from conftest import DEVICE, assert_checked_descriptor
from portable_kernels import dispatch, plugins, tune
from portable_kernels.errors import VariantUnavailableError
from portable_kernels.kernels import matmul as mm
from portable_kernels.launch import LaunchPlan
from portable_kernels_backends.nvidia.gluon import _common
from portable_kernels_backends.nvidia.gluon import matmul as gmm
from portable_kernels_backends.nvidia.gluon import matmul_gluon as mg
from portable_kernels.testing import assert_close, tolerance

NAME = "matmul"
GLUON = "nvidia.hopper_gluon"
TMA = "nvidia.persistent_tma"


def _operand(gen, rows, cols, dtype, device, col_major=False):
    if col_major:
        return torch.randn(cols, rows, generator=gen).to(device, dtype).t()
    return torch.randn(rows, cols, generator=gen).to(device, dtype)


def _check(out, a, b):
    assert out.shape == (a.shape[0], b.shape[1]) and out.dtype == a.dtype
    assert not torch.isnan(out).any(), "the kernel left output elements unwritten"
    assert_close(out, mm.reference(a, b), tolerance(a.dtype, "dot"), f"{tuple(out.shape)} {a.dtype}")


def _skip_unless_gluon_runs(device) -> None:
    x = torch.zeros(8192, 8192, dtype=torch.float16, device=device)[:, :8]
    verdict = next(v for v in pk.explain(NAME, x, x.t()).verdicts if v.name == GLUON)
    if not verdict.runnable:
        pytest.skip(f"{GLUON}: {verdict.reason}")


# --- on an sm_90 GPU ----------------------------------------------------------------------

# (M, N, K): one partial tile with K under one step; tails in M, N and K over a few tiles
# (the grouped order's partial last group); more tiles than SMs, so programs walk several.
SHAPES = [(72, 48, 40), (296, 520, 200), (1000, 1032, 520), (4104, 2056, 136)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("layout", ["nn", "nt", "tn", "tt"])
def test_forced_matches_reference(shape, layout, dtype, device, gen, nan_empty, monkeypatch):
    """Every operand layout (``t``: column-major, described through its transpose and read
    transposed by the MMA), forced on problems below MIN_TILES too."""
    _skip_unless_gluon_runs(device)
    monkeypatch.setattr(mg, "MIN_TILES", 1)
    m, n, k = shape
    a = _operand(gen, m, k, dtype, device, layout[0] == "t")
    b = _operand(gen, k, n, dtype, device, layout[1] == "t")
    with pk.use_variant(**{NAME: GLUON}):
        _check(pk.get_kernel(NAME)(a, b), a, b)


@pytest.mark.parametrize("num_sms", [1, 3, 7])
def test_few_programs_walk_every_tile(num_sms, device, gen, nan_empty):
    """A grid far smaller than the tile count: each program's barriers go through many
    phases and its output buffer is reused tile after tile."""
    _skip_unless_gluon_runs(device)
    a = _operand(gen, 1000, 264, torch.float16, device)
    b = _operand(gen, 264, 1800, torch.float16, device, col_major=True)
    out = torch.empty(1000, 1800, dtype=torch.float16, device=device)
    _check(mg.matmul(a, b, out, num_sms), a, b)


def test_chosen_on_sm90_for_enough_tiles(device, gen, nan_empty):
    """Chosen by itself from MIN_TILES output tiles on; a smaller product goes to
    nvidia.persistent_tma, and explain says why."""
    _skip_unless_gluon_runs(device)
    a = _operand(gen, 2048, 256, torch.bfloat16, device)
    b = _operand(gen, 256, 4096, torch.bfloat16, device)
    assert mg.tiles(2048, 4096) >= mg.MIN_TILES
    assert pk.explain(NAME, a, b).variant == GLUON
    _check(pk.get_kernel(NAME)(a, b), a, b)
    small = pk.explain(NAME, a[:128], b)
    assert small.variant == TMA
    assert "MIN_TILES" in next(v for v in small.verdicts if v.name == GLUON).reason


def test_seen_calls_launch_the_compiled_kernel(device, gen, nan_empty):
    """After its first call a problem's launches skip Triton's JIT dispatch (``_direct``),
    and each launch describes the tensors it is given: new operands and outputs of the same
    sizes and layouts get their own products, not the first call's."""
    _skip_unless_gluon_runs(device)
    if torch.version.cuda is None:
        pytest.skip("direct launches are used on NVIDIA GPUs only")
    handle = pk.get_kernel(NAME)
    pairs = [(_operand(gen, 2048, 264, torch.float16, device),
              _operand(gen, 264, 4104, torch.float16, device, col_major=True)) for _ in range(3)]
    _check(handle(*pairs[0]), *pairs[0])
    plan = next(p for p in set(handle._cache.values()) if p.variant.name == GLUON)
    launcher = plan.direct(mg._matmul_gluon_kernel)
    before = launcher.launches
    for a, b in pairs[1:]:
        _check(handle(a, b), a, b)
    assert launcher.launches == before + 2, "calls after the first did not launch the binary"


def test_launch_metadata_reaches_profiler_hooks(device, gen):
    """Launch hooks see the product's launches (which then take Triton's JIT path: direct
    launches skip the hooks' metadata)."""
    _skip_unless_gluon_runs(device)
    seen = []

    def hook(metadata):
        seen.append(metadata.get())

    a = _operand(gen, 2048, 256, torch.float16, device)
    b = _operand(gen, 256, 4096, torch.float16, device)
    pk.get_kernel(NAME)(a, b)  # compile first
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        pk.get_kernel(NAME)(a, b)
        torch.cuda.synchronize()
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    ours = [m for m in seen if m.get("name", "").startswith("_matmul_gluon_kernel [M=2048")]
    assert ours and ours[-1]["flops16"] == 2.0 * 2048 * 4096 * 256


def test_forcing_a_small_problem_raises(device):
    _skip_unless_gluon_runs(device)
    x = torch.zeros(64, 64, dtype=torch.float16, device=device)
    with pk.use_variant(**{NAME: GLUON}):
        with pytest.raises(VariantUnavailableError, match="MIN_TILES"):
            pk.get_kernel(NAME)(x, x)


# --- what it takes: everywhere ----------------------------------------------------------------

def test_size_issue_names_the_threshold():
    """Below MIN_TILES output tiles, or with K = 0, the kernel declines by size, from the
    family problem's M, N and K; one message for every small problem."""
    def issue(*shape):
        a = torch.empty(*shape[:2], dtype=torch.float16, device="meta")
        b = torch.empty(*shape[1:], dtype=torch.float16, device="meta")
        p = mm.problem(a, b)
        return gmm.size_issue(p.m, p.n, p.k)

    assert "MIN_TILES=132" in issue(128, 64, 4096)
    assert issue(100, 64, 100) == issue(128, 64, 4096) == issue(128 * 131, 64, 256)
    assert issue(2048, 0, 4096) == "K is 0: the output is all zeros"
    assert issue(2048, 64, 4096) == issue(128 * 12, 64, 256 * 11) == ""
    # Not 2-D: no sizes, declined (the family's checks name the operand at launch).
    p = mm.problem(torch.empty(2048, device="meta"), torch.empty(64, 4096, device="meta"))
    assert (p.m, p.n, p.k) == (0, 4096, 0) and gmm.size_issue(p.m, p.n, p.k)


def _cuda_problem(dtype=torch.float16, m=2048, k=64, b_layout="row", accumulate=False):
    return mm.Problem(torch.device("cuda"), dtype, "row", b_layout, True, m, 4096, k, accumulate)


def test_predicate_names_the_problem(monkeypatch):
    """On a CUDA device with the Triton it was checked on: 16-bit operands, enough tiles
    and what a descriptor takes; each refusal says which."""
    h200 = plugins.host().emulation_profile("h200")
    monkeypatch.setattr(_common, "TRITON_OK", True)
    assert gmm.accepts(_cuda_problem(), h200) is None
    assert "float32 operands take the Triton kernel" in gmm.accepts(
        _cuda_problem(torch.float32), h200)
    assert "float8_e4m3fn operands" in gmm.accepts(_cuda_problem(torch.float8_e4m3fn), h200)
    assert "MIN_TILES" in gmm.accepts(_cuda_problem(m=128), h200)
    assert gmm.accepts(_cuda_problem(k=0), h200) == "K is 0: the output is all zeros"
    assert "b cannot be described" in gmm.accepts(_cuda_problem(b_layout=""), h200)
    assert "acc= (adding to an existing output)" in gmm.accepts(_cuda_problem(accumulate=True), h200)
    b200 = plugins.host().emulation_profile("b200")
    assert "sm_90's warpgroup MMA" in gmm.accepts(_cuda_problem(), b200)
    monkeypatch.setattr(_common, "TRITON_OK", False)
    assert "TRITON_OK" in gmm.accepts(_cuda_problem(), h200)


@pytest.mark.parametrize("profile", ["h200", "h100"])
def test_chosen_under_emulation_for_a_large_bf16_product_on_cuda_tensors(profile, monkeypatch):
    """Selection as an sm_90 GPU with Triton 3.6 makes it, from any machine: the problem of
    CUDA tensors (only its device differs from a CPU call's) goes to the variant from
    MIN_TILES output tiles on, to nvidia.persistent_tma with the reason below. The
    executing device is the suite's (a GPU machine has no CPU device to run kernels on)."""
    monkeypatch.setattr(_common, "TRITON_OK", True)

    def select(m, n, k=64):
        a = torch.empty(m, k, dtype=torch.bfloat16, device="meta")
        b = torch.empty(k, n, dtype=torch.bfloat16, device="meta")
        with pk.emulate(profile):
            cuda = mm.problem(a, b)._replace(device=torch.device("cuda", 0))
            return dispatch.select(NAME, cuda, dispatch._resolve_device(DEVICE))

    sel = select(4096, 4096)
    assert sel.variant == GLUON and "written in Gluon" in sel.verdicts[0].reason
    small = select(128 * 131, 256)
    assert small.variant == TMA
    assert "MIN_TILES" in next(v for v in small.verdicts if v.name == GLUON).reason


@pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU tensors run under Triton's interpreter, "
                    "which a process that compiles for its GPU does not use")
@pytest.mark.parametrize("profile", ["h200", "h100"])
def test_declined_under_emulation_for_cpu_tensors(profile, monkeypatch):
    """A bf16 product of CPU tensors: the variant declines with the interpreter's reason."""
    monkeypatch.setattr(_common, "TRITON_OK", True)
    x = torch.zeros(64, 64, dtype=torch.bfloat16)
    with pk.emulate(profile):
        on_cpu = pk.explain(NAME, x, x)
    verdict = next(v for v in on_cpu.verdicts if v.name == GLUON)
    assert on_cpu.variant == TMA and "Triton's interpreter does not run them" in verdict.reason


def test_sm90_only_and_never_on_the_interpreter():
    x = torch.zeros(64, 64, dtype=torch.float16, device=DEVICE)
    with pk.emulate("a100"):
        verdict = next(v for v in pk.explain(NAME, x, x).verdicts if v.name == GLUON)
    assert not verdict.runnable and "requires tensor_descriptor" in verdict.reason
    with pk.emulate("h100"):
        sel = pk.explain(NAME, x, x)
    verdict = next(v for v in sel.verdicts if v.name == GLUON)
    assert verdict.priority == 110 and not verdict.runnable
    assert sel.variant == TMA
    reason = ("Triton's interpreter does not run them" if DEVICE.type == "cpu" else "MIN_TILES")
    assert reason in verdict.reason, verdict.reason


def test_a_launcher_of_its_own():
    """The variant launches through its own launcher, registered by the NVIDIA backend;
    the family's launcher and switches know nothing of it."""
    gluon = plugins.host().registry.variants[NAME][GLUON]
    assert gluon.launch is gmm.launch and gluon.plugin == "nvidia"
    assert not gluon.switches
    assert not {"GLUON", "HOST_SWITCHES", "gluon_accepts"} & set(vars(mm))


class _Launches:
    """Stands in for the Gluon kernel: records each launch's grid and arguments."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


@pytest.mark.parametrize("a_col, b_col", [(False, False), (False, True), (True, False),
                                          (True, True)])
def test_launch_describes_each_layout(a_col, b_col, monkeypatch):
    """The launcher's host work: a column-major operand is described through its transpose
    (A_T/B_T), boxes follow the tile, the output is stored in 64-row halves, and the grid is
    min(SMs, tiles). Recorded, not run."""
    launches = _Launches()
    monkeypatch.setattr(mg, "_matmul_gluon_kernel", launches)
    m, n, k = 1000, 2056, 72
    a = torch.empty(k, m, dtype=torch.float16).t() if a_col else torch.empty(m, k, dtype=torch.float16)
    b = torch.empty(n, k, dtype=torch.float16).t() if b_col else torch.empty(k, n, dtype=torch.float16)
    out = torch.empty(m, n, dtype=torch.float16)
    assert mg.matmul(a, b, out, 132) is out
    (grid, args, kwargs), = launches.calls
    a_desc, b_desc, c_desc = args[:3]
    assert grid == (min(132, mg.tiles(m, n)),) and args[3:6] == (m, n, k)
    assert kwargs["A_T"] is a_col and kwargs["B_T"] is b_col
    bm, bn, bk = mg.BLOCK_M, mg.BLOCK_N, mg.BLOCK_K
    assert list(a_desc.shape) == ([k, m] if a_col else [m, k])
    assert list(a_desc.block_shape) == ([bk, bm] if a_col else [bm, bk])
    assert list(b_desc.shape) == ([n, k] if b_col else [k, n])
    assert list(b_desc.block_shape) == ([bn, bk] if b_col else [bk, bn])
    assert c_desc.base is out and list(c_desc.block_shape) == [bm // 2, bn]
    for desc in (a_desc, b_desc, c_desc):
        assert_checked_descriptor(desc)


def test_launch_hands_products_to_the_kernel(monkeypatch):
    """The variant's launcher hands non-empty products to matmul_gluon.matmul with the
    output it allocated, the device's SM count and the plan (for direct launches); empty
    ones never reach it, and bad operands get the family's errors."""
    calls = []

    def fake(a, b, out, num_sms, plan):
        calls.append((a.shape, b.shape, out.shape, num_sms, plan))
        return out.fill_(5.0)

    monkeypatch.setattr(mg, "matmul", fake)
    h200 = plugins.host().emulation_profile("h200")
    gluon = plugins.host().registry.variants[NAME][GLUON]
    plan = LaunchPlan(gluon, h200, gluon.configs(h200), dict(gluon.switches))
    a, b = torch.ones(300, 40, dtype=torch.float16), torch.ones(40, 520, dtype=torch.float16)
    assert (gmm.launch(plan, a, b) == 5.0).all()
    assert calls == [((300, 40), (40, 520), (300, 520), h200.num_sms, plan)]
    assert not gmm.launch(plan, a[:, :0], b[:0]).any()  # K = 0: zeros, no launch
    assert gmm.launch(plan, a[:0], b).shape == (0, 520)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="matmul"):
        gmm.launch(plan, a, a)
    # portable-kernels tune names the Gluon kernel's tile, not the table's first config.
    assert tune._chosen_configs(plan) == mg.tile().best_config


def test_launch_metadata_counts_the_product():
    """Profilers (launch hooks, proton) see the Gluon kernel's launches named with their
    sizes, with flops and bytes, as the Triton kernel's are."""
    attached = mg._matmul_gluon_kernel.launch_metadata
    assert attached is not None
    a = torch.empty(3, 8, dtype=torch.bfloat16)
    out = torch.empty(3, 16, dtype=torch.bfloat16)
    args = {"M": 3, "N": 16, "K": 8, "a_desc": mg._descriptor(a, [64, 64]),
            "c_desc": mg._descriptor(out, [64, 64])}
    got = attached((1,), types.SimpleNamespace(name="_matmul_gluon_kernel"), args)
    assert got == {"name": "_matmul_gluon_kernel [M=3, N=16, K=8]", "flops16": 2.0 * 3 * 16 * 8,
                   "bytes": 2 * (3 * 8 + 8 * 16 + 3 * 16)}



def test_families_that_run_matmul_use_the_variants_launcher(monkeypatch):
    """A family that computes its products with matmul's plan (fused_linear_cross_entropy)
    launches them through the chosen variant's own launcher, so a product the Gluon variant
    took runs its kernel (stood in for here), not the family's launcher with its switches."""
    from portable_kernels.kernels import fused_linear_cross_entropy as flce

    calls = []
    monkeypatch.setattr(mg, "matmul", lambda a, b, out, num_sms, plan: (
        calls.append((a.shape, b.shape)), out.fill_(7.0))[1])
    h200 = plugins.host().emulation_profile("h200")
    gluon = plugins.host().registry.variants[NAME][GLUON]
    plan = LaunchPlan(gluon, h200, gluon.configs(h200), dict(gluon.switches))
    handle = types.SimpleNamespace(plan=lambda a, b: plan)
    monkeypatch.setattr(flce, "_MATMUL", [handle])
    a, b = torch.ones(300, 40, dtype=torch.float16), torch.ones(40, 520, dtype=torch.float16)
    assert (flce._product(a, b) == 7.0).all() and calls == [((300, 40), (40, 520))]
