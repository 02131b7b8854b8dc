"""matmul against a float64 reference: tails in every dimension, strided operands, every
dtype, the Hopper variant forced, selection, errors and launch metadata."""
from __future__ import annotations

import types

import pytest
import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

import portable_kernels as pk
from conftest import DEVICE
from portable_kernels import dispatch
from portable_kernels.errors import NoVariantError, VariantUnavailableError
from portable_kernels.kernels import matmul as matmul_module
from portable_kernels.testing import assert_close, tolerance

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
TMA = "nvidia.persistent_tma"

# (M, N, K). On the interpreter (64-wide blocks, GROUP_SIZE_M 4): 67x45x33 has a tail in
# every dimension; 130x72x200 runs four K steps with a tail (and its 16-byte aligned rows
# select the TMA variant for 16-bit types on Hopper); 300x136x130 has five rows of tiles,
# so the second group of the grouped order is a partial one.
SHAPES = [(1, 1, 1), (67, 45, 33), (130, 72, 200), (300, 136, 130)]


def _rand(gen, *shape, dtype, device):
    return torch.randn(*shape, generator=gen).to(device, dtype)


def _check(out, a, b):
    assert out.shape == (a.shape[0], b.shape[1])
    assert out.dtype == matmul_module.out_dtype(a.dtype) and out.device == a.device and out.is_contiguous()
    assert not torch.isnan(out).any(), "the kernel left output elements unwritten"
    assert_close(out, matmul_module.reference(a, b), tolerance(a.dtype, "dot"), f"{tuple(out.shape)} {a.dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_reference(device, gen, nan_empty, dtype, shape):
    M, N, K = shape
    a, b = _rand(gen, M, K, dtype=dtype, device=device), _rand(gen, K, N, dtype=dtype, device=device)
    _check(pk.get_kernel("matmul")(a, b), a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_operands(device, gen, nan_empty, dtype):
    M, N, K = 67, 45, 33
    a, b = _rand(gen, M, K, dtype=dtype, device=device), _rand(gen, K, N, dtype=dtype, device=device)
    a_t = _rand(gen, K, M, dtype=dtype, device=device).t()             # column-major
    b_t = _rand(gen, N, K, dtype=dtype, device=device).t()
    a_step = _rand(gen, M, 2 * K, dtype=dtype, device=device)[:, ::2]  # no unit stride at all
    b_step = _rand(gen, 2 * K, N + 3, dtype=dtype, device=device)[::2, 3:]
    mm = pk.get_kernel("matmul")
    for x, y in ((a_t, b), (a, b_t), (a_t, b_t), (a_step, b_step), (a_step, b_t)):
        _check(mm(x, y), x, y)


# --- fp8 operands (bf16 output) -----------------------------------------------------------

def _skip_without_fp8(device):
    if not pk.device_info(device).has("fp8"):
        pytest.skip(f"{pk.device_info(device).name} has no fp8 capability")


@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
def test_fp8_operands(device, gen, nan_empty, dtype):
    """Any variant dispatch picks: tails everywhere, row- and column-major operands (a
    weight ``w`` of shape (N, K) is passed as ``w.t()``), and strides no descriptor takes."""
    _skip_without_fp8(device)
    mm = pk.get_kernel("matmul")
    for M, N, K in ((67, 45, 33), (130, 80, 208)):
        a, b = _rand(gen, M, K, dtype=dtype, device=device), _rand(gen, K, N, dtype=dtype, device=device)
        w = _rand(gen, N, K, dtype=dtype, device=device)
        a_step = _rand(gen, M, 2 * K, dtype=dtype, device=device)[:, ::2]
        for x, y in ((a, b), (a, w.t()), (a_step, w.t())):
            out = mm(x, y)
            assert out.dtype == torch.bfloat16
            _check(out, x, y)


@pytest.mark.parametrize("variant", ["generic", TMA])
def test_fp8_tiles_as_compiled(device, gen, nan_empty, variant):
    """UPCAST off, as on GPUs: the interpreter then runs the fp8 paths compiled kernels
    take (fp16 conversion; with K-major descriptor tiles, the fp8 dot with its periodic
    fp32 accumulation)."""
    _skip_without_fp8(device)
    dtype = torch.float8_e4m3fn
    M, N, K = 80, 48, 96
    a, b = _rand(gen, M, K, dtype=dtype, device=device), _rand(gen, K, N, dtype=dtype, device=device)
    w = _rand(gen, N, K, dtype=dtype, device=device)
    with pk.use_variant(matmul=variant):
        base = dispatch._launch_plan(pk.explain("matmul", a, b))
    plan = pk.LaunchPlan(base.variant, base.device, base.configs, dict(base.switches, UPCAST=False))
    for y in (b, w.t()):
        _check(matmul_module.launch(plan, a, y), a, y)


def test_fp8_needs_the_capability(fresh_host):
    """An A100 (sm_80) has no fp8 dots: selection says so instead of compiling."""
    fresh_host()
    a = torch.ones(16, 16, dtype=torch.float8_e4m3fn, device=DEVICE)
    with pk.emulate("a100"):
        with pytest.raises(NoVariantError, match="generic: float8_e4m3fn inputs need the fp8 capability"):
            pk.explain("matmul", a, a)


def test_fp8_has_no_gradient(device, gen):
    _skip_without_fp8(device)
    a = _rand(gen, 16, 16, dtype=torch.float8_e4m3fn, device=device).requires_grad_()
    from portable_kernels import ops

    out = ops.matmul(a, a.detach())
    with pytest.raises(ValueError, match="no gradient for float8_e4m3fn operands"):
        out.sum().backward()


def test_operand_configs():
    """A table may keep configs per operand size; the mark never reaches the kernel."""
    def cfg(bk, **marks):
        return triton.Config({"BLOCK_SIZE_K": bk, **marks}, num_warps=4)

    both = [cfg(64), cfg(128, OPERAND_BYTES=1)]
    assert [c.kwargs for c in matmul_module.operand_configs(both, 1)] == [{"BLOCK_SIZE_K": 128}]
    assert [c.kwargs for c in matmul_module.operand_configs(both, 2)] == [{"BLOCK_SIZE_K": 64}]
    assert both[1].kwargs == {"BLOCK_SIZE_K": 128, "OPERAND_BYTES": 1}  # the table is untouched
    unmarked = [cfg(64), cfg(32)]
    assert matmul_module.operand_configs(unmarked, 1) == unmarked
    only_fp8 = [cfg(128, OPERAND_BYTES=1)]
    assert [c.kwargs for c in matmul_module.operand_configs(only_fp8, 2)] == [{"BLOCK_SIZE_K": 128}]


def test_operand_sizes_with_configs_of_their_own_get_their_own_autotuner():
    """fp8 (marked configs) tunes apart; fp16 and fp32 share the unmarked configs' tuner."""
    h200 = pk.plugins.host().emulation_profile("h200")
    variant = pk.plugins.host().registry.variants["matmul"]["generic"]
    tile = {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 32, "GROUP_SIZE_M": 4}
    configs = [triton.Config({**tile, "BLOCK_SIZE_K": 32}, num_warps=4),
               triton.Config({**tile, "BLOCK_SIZE_K": 64, "OPERAND_BYTES": 1}, num_warps=4)]
    plan = pk.LaunchPlan(variant, h200, configs, dict(variant.switches))
    fp16, fp32, fp8 = (matmul_module._tuned_kernel(plan, size).kernel for size in (2, 4, 1))
    assert fp16 is fp32 and fp8 is not fp16
    assert [c.kwargs["BLOCK_SIZE_K"] for c in fp8.configs] == [64]
    assert all("OPERAND_BYTES" not in c.kwargs for c in fp8.configs + fp16.configs)


def test_empty_dimensions(device):
    mm = pk.get_kernel("matmul")
    assert mm(torch.ones(0, 4, device=device), torch.ones(4, 5, device=device)).shape == (0, 5)
    assert mm(torch.ones(3, 4, device=device), torch.ones(4, 0, device=device)).shape == (3, 0)
    out = mm(torch.ones(3, 0, device=device, dtype=torch.float16), torch.ones(0, 5, device=device, dtype=torch.float16))
    assert out.shape == (3, 5) and out.dtype == torch.float16 and not out.any()


def test_errors(device):
    mm = pk.get_kernel("matmul")
    x = torch.ones(3, 4, device=device)
    with pytest.raises(ValueError, match=r"inner dimensions differ: a \(3, 4\) @ b \(5, 6\)"):
        mm(x, torch.ones(5, 6, device=device))
    with pytest.raises(TypeError, match="dtypes must match, but a is float32, b is float16"):
        mm(x, torch.ones(4, 2, device=device, dtype=torch.float16))
    with pytest.raises(ValueError, match="tensors must be on one device"):
        mm(x, torch.ones(4, 2, device="meta"))
    with pytest.raises(ValueError, match=r"a must be 2-D \(M, K\), got shape \(4,\)"):
        mm(torch.ones(4, device=device), torch.ones(4, 2, device=device))
    with pytest.raises(ValueError, match=r"b must be 2-D \(K, N\), got shape \(2, 4, 2\)"):
        mm(x, torch.ones(2, 4, 2, device=device))
    with pytest.raises(TypeError, match="a has dtype int32"):
        mm(torch.ones(3, 4, device=device, dtype=torch.int32), torch.ones(4, 2, device=device, dtype=torch.int32))
    with pytest.raises(TypeError, match="b must be a torch.Tensor, got list"):
        mm(x, [[1.0]])


def test_comparison_catches_a_wrong_result(device, gen):
    # The check these tests rely on is not vacuous: one wrong element fails it.
    a, b = _rand(gen, 67, 33, dtype=torch.float16, device=device), _rand(gen, 33, 45, dtype=torch.float16, device=device)
    out = pk.get_kernel("matmul")(a, b)
    out[66, 44] += 1
    with pytest.raises(AssertionError, match="exceeds tolerance"):
        _check(out, a, b)


def test_launch_metadata():
    meta = matmul_module._matmul_launch_metadata
    kernel = matmul_module._matmul_kernel
    # The hook is attached to the kernel (compiled: JITFunction; interpreter: its kwargs).
    attached = getattr(kernel, "launch_metadata", None) or kernel.kwargs.get("launch_metadata")
    assert attached is meta
    out = torch.empty(3, 16, dtype=torch.float16)
    a = torch.empty(3, 7, dtype=torch.float16)
    for c in (out, TensorDescriptor.from_tensor(out, [1, 16])):
        got = meta((1, 1, 1), types.SimpleNamespace(name="_matmul_kernel"),
                   {"M": 3, "N": 16, "K": 7, "a": a, "c": c})
        assert got == {"name": "_matmul_kernel [M=3, N=16, K=7]", "flops16": 2.0 * 3 * 16 * 7,
                       "bytes": 2 * (3 * 7 + 7 * 16 + 3 * 16)}
    # fp8 operands, bf16 output: the flops are counted at the operands' width.
    got = meta((1, 1, 1), types.SimpleNamespace(name="_matmul_kernel"),
               {"M": 3, "N": 16, "K": 7, "a": a.to(torch.float8_e4m3fn), "c": out.to(torch.bfloat16)})
    assert got["flops8"] == 2.0 * 3 * 16 * 7 and got["bytes"] == (3 * 7 + 7 * 16) + 2 * 3 * 16


def test_launch_metadata_reaches_profiler_hooks(device, gen):
    if device.type == "cpu":
        pytest.skip("the interpreter calls no launch hooks")
    seen = []

    def hook(metadata):
        seen.append(metadata.get())

    a = _rand(gen, 256, 128, dtype=torch.float16, device=device)
    b = _rand(gen, 128, 64, dtype=torch.float16, device=device)
    pk.get_kernel("matmul")(a, b)  # autotune first, so the hook sees one launch
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        pk.get_kernel("matmul")(a, b)
        torch.cuda.synchronize()
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    ours = [m for m in seen if "[M=256, N=64, K=128]" in m.get("name", "")]
    assert ours and ours[-1]["flops16"] == 2.0 * 256 * 64 * 128


def _check_accumulated(acc, before, products, dtype):
    """``acc`` after ``acc += a @ b`` for each (a, b) of ``products``, starting from
    ``before``: each step rounds once to ``dtype``, so the bound grows with the steps."""
    ref = before.double() + sum(matmul_module.reference(a, b) for a, b in products)
    tol = tolerance(dtype, "dot")
    steps = len(products)
    assert_close(acc, ref, type(tol)(tol.atol * steps, tol.rtol * steps), f"acc {dtype}")


@pytest.mark.parametrize("variant", ["generic", TMA])
@pytest.mark.parametrize("dtype", DTYPES)
def test_accumulates_in_place(device, gen, dtype, variant):
    """``acc=``: the product added to an existing output, the result written there (tails
    in every dimension, a row-major acc and a column-major view of a bigger one), three
    times over as a sum over chunks is; the first call tunes without touching acc."""
    if variant == TMA and dtype == torch.float32:
        pytest.skip("the descriptor variant takes 16-bit and fp8 operands")
    M, N, K = 72, 48, 40
    mm = pk.get_kernel("matmul")
    row = _rand(gen, M, N, dtype=dtype, device=device)
    col = _rand(gen, N + 5, M, dtype=dtype, device=device)[:N].t()
    with pk.use_variant(matmul=variant):
        for acc in (row, col):
            before = acc.clone()
            products = [(_rand(gen, M, K, dtype=dtype, device=device),
                         _rand(gen, K, N, dtype=dtype, device=device)) for _ in range(3)]
            for a, b in products:
                assert mm(a, b, acc=acc) is acc
            _check_accumulated(acc, before, products, dtype)


def test_accumulate_errors_and_empty_k(device):
    mm = pk.get_kernel("matmul")
    a, b = torch.ones(3, 4, device=device), torch.ones(4, 5, device=device)
    with pytest.raises(ValueError, match=r"acc must be the \(M, N\) = \(3, 5\) output .* got \(5, 3\)"):
        mm(a, b, acc=torch.zeros(5, 3, device=device))
    with pytest.raises(ValueError, match="acc must have the output dtype float32 of float32 operands, got float16"):
        mm(a, b, acc=torch.zeros(3, 5, device=device, dtype=torch.float16))
    with pytest.raises(ValueError, match="must not be a broadcast view"):
        mm(a, b, acc=torch.zeros(5, device=device).expand(3, 5))
    acc = torch.full((3, 5), 2.0, device=device)
    assert mm(torch.ones(3, 0, device=device), torch.ones(0, 5, device=device), acc=acc) is acc
    assert (acc == 2).all()


# --- the Hopper variant, forced (it runs on the interpreter too) ---------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, *FP8])
def test_tma_variant_layouts(device, gen, nan_empty, dtype):
    # 72x48x40: tails in every dimension with 16-byte aligned rows in both layouts; fp8
    # rows need multiples of 16 elements: 80x48x96 has tails in M and K of 64-wide blocks
    # (and takes the fp8 MMA with b column-major, fp16 MMAs otherwise).
    if dtype in FP8:
        _skip_without_fp8(device)
    M, N, K = (80, 48, 96) if dtype in FP8 else (72, 48, 40)
    a, b = _rand(gen, M, K, dtype=dtype, device=device), _rand(gen, K, N, dtype=dtype, device=device)
    a_t = _rand(gen, K, M, dtype=dtype, device=device).t()
    b_t = _rand(gen, N, K, dtype=dtype, device=device).t()
    mm = pk.get_kernel("matmul")
    with pk.use_variant(matmul=TMA):
        for x, y in ((a, b), (a_t, b), (a, b_t), (a_t, b_t)):
            _check(mm(x, y), x, y)


@pytest.mark.parametrize("subtile", [False, True])
def test_tma_variant_many_tiles_per_program(device, gen, nan_empty, subtile):
    # More tiles than programs (the CPU has few "SMs"; on a GPU, 40000 rows make 300 or
    # more tiles for any config), walked persistently, stored whole or in halves.
    M, N, K = 40000 if device.type != "cpu" else 300, 136, 200
    a = _rand(gen, M, K, dtype=torch.float16, device=device)
    b = _rand(gen, K, N, dtype=torch.float16, device=device)
    with pk.use_variant(matmul=TMA):
        base = dispatch._launch_plan(pk.explain("matmul", a, b))  # the device's configs, switches
    config = base.configs[0]
    config = triton.Config({**config.kwargs, "EPILOGUE_SUBTILE": subtile},
                           num_warps=config.num_warps, num_stages=config.num_stages)
    plan = pk.LaunchPlan(base.variant, base.device, [config], base.switches)
    _check(matmul_module.launch(plan, a, b), a, b)


def _pointer_configs():
    """The Hopper table's configs that run the pointer-load kernel, shrunk to the
    interpreter's cost (their TMA, PERSISTENT and SPLIT_K settings kept)."""
    from portable_kernels_backends.nvidia import tuning

    h200 = pk.plugins.host().emulation_profile("h200")
    configs = [c for c in tuning.matmul_persistent_tma(h200) if c.kwargs.get("TMA") is False]
    assert configs and all(c.kwargs["PERSISTENT"] is False for c in configs)
    params = []
    for c in configs:
        kw = c.kwargs
        label = (f"{kw['BLOCK_SIZE_M']}x{kw['BLOCK_SIZE_N']}x{kw['BLOCK_SIZE_K']}"
                 f"-split{kw.get('SPLIT_K', 1)}-w{c.num_warps}-s{c.num_stages}")
        if DEVICE.type == "cpu":
            c = triton.Config({**kw, "BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 32},
                              num_warps=c.num_warps, num_stages=c.num_stages)
        params.append(pytest.param(c, id=label))
    return params


@pytest.mark.parametrize("config", _pointer_configs())
def test_tma_variant_pointer_configs(config, device, gen, nan_empty):
    """A config of the descriptor variant may run the pointer-load kernel (TMA and
    PERSISTENT off): one program per work unit, every layout the variant takes (the
    descriptor path's transposed views are the pointer path's strides), split-K too."""
    M, N, K = 72, 48, 264
    a, b = _rand(gen, M, K, dtype=torch.float16, device=device), _rand(gen, K, N, dtype=torch.float16, device=device)
    a_t = _rand(gen, K, M, dtype=torch.float16, device=device).t()
    b_t = _rand(gen, N, K, dtype=torch.float16, device=device).t()
    with pk.use_variant(matmul=TMA):
        base = dispatch._launch_plan(pk.explain("matmul", a, b))
    plan = pk.LaunchPlan(base.variant, base.device, [config], base.switches)
    kernel, switches, _ = matmul_module._tuned_kernel(plan, 2)
    assert [c.kwargs["TMA"] for c in kernel.configs] == [False]
    assert not set(matmul_module.CONFIG_SWITCHES) & set(switches)  # the configs carry them
    for x, y in ((a, b), (a_t, b), (a, b_t), (a_t, b_t)):
        _check(matmul_module.launch(plan, x, y), x, y)


def test_configs_without_switches_keep_the_variants():
    """A table whose configs set no switch passes the variant's at launch, unchanged."""
    h200 = pk.plugins.host().emulation_profile("h200")
    variant = pk.plugins.host().registry.variants["matmul"]["generic"]
    config = triton.Config({"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 32,
                            "GROUP_SIZE_M": 4}, num_warps=4)
    plan = pk.LaunchPlan(variant, h200, [config], dict(variant.switches))
    kernel, switches, _ = matmul_module._tuned_kernel(plan, 2)
    assert kernel.configs[0].kwargs == config.kwargs and switches == variant.switches


def test_tma_variant_rejects_what_descriptors_cannot_take(device, gen):
    mm = pk.get_kernel("matmul")
    with pk.use_variant(matmul=TMA):
        with pytest.raises(VariantUnavailableError, match="float32 operands stay on pointer loads"):
            mm(torch.ones(16, 16, device=device), torch.ones(16, 16, device=device))
        # K = 33 halves: rows of a are 66 bytes apart.
        with pytest.raises(VariantUnavailableError, match="a cannot be described by a tensor descriptor"):
            mm(torch.ones(16, 33, device=device, dtype=torch.float16), torch.ones(33, 16, device=device, dtype=torch.float16))
        with pytest.raises(VariantUnavailableError, match="output rows"):
            mm(torch.ones(16, 16, device=device, dtype=torch.float16), torch.ones(16, 8, device=device, dtype=torch.float16)[:, :7])


def test_selection(device):
    half = torch.ones(64, 64, device=device, dtype=torch.float16)
    if device.type == "cpu":
        # The interpreter can run the TMA variant but does not prefer it.
        assert pk.explain("matmul", half, half).variant == "generic"
    with pk.emulate("h100"):
        assert pk.explain("matmul", half, half).variant == TMA
        sel = pk.explain("matmul", half.float(), half.float())
        assert sel.variant == "generic"
        assert "float32 operands stay on pointer loads" in next(v for v in sel.verdicts if v.name == TMA).reason
        # Unaligned rows fall back to generic, and explain says why.
        odd = torch.ones(64, 33, device=device, dtype=torch.float16)
        sel = pk.explain("matmul", odd, odd.t())
        assert sel.variant == "generic"
        assert "tensor descriptor" in next(v for v in sel.verdicts if v.name == TMA).reason
    with pk.emulate("a100"):
        sel = pk.explain("matmul", half, half)
        assert sel.variant == "generic"
        assert "tensor_descriptor" in next(v for v in sel.verdicts if v.name == TMA).reason


# --- split-K (a config of either load path, forced here) -----------------------------------

def _plan_with(variant, a, b, **config_kwargs):
    """The device's launch plan for ``variant``, reduced to one config with ``config_kwargs``
    set (one config: no autotuning, no pruning): the device's own split-K config if it has
    one, the one with the least shared memory (it fits fp32 operands too)."""
    with pk.use_variant(matmul=variant):
        base = dispatch._launch_plan(pk.explain("matmul", a, b))
    split = [c for c in base.configs if c.kwargs.get("SPLIT_K", 1) > 1]
    c = min(split or base.configs, key=lambda c: c.num_stages * c.kwargs["BLOCK_SIZE_K"]
            * (c.kwargs["BLOCK_SIZE_M"] + c.kwargs["BLOCK_SIZE_N"]))
    config = triton.Config({**c.kwargs, **config_kwargs}, num_warps=c.num_warps, num_stages=c.num_stages)
    return pk.LaunchPlan(base.variant, base.device, [config], base.switches)


# On the interpreter (64-wide blocks): K = 200 is four K blocks, the last a tail of 8; three
# slices of two blocks leave the last one empty, two slices put the tail in the second.
# K = 40 is one partial block: every slice but the first is empty.
SPLIT_CASES = [(2, 200), (3, 200), (3, 40)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k,K", SPLIT_CASES, ids=lambda v: str(v))
def test_split_k_generic(device, gen, nan_empty, dtype, split_k, K):
    # 67 x 45: tails in M and N. Strided operands too, a column-major one of 130 rows.
    M, N = 67, 45
    a, b = _rand(gen, M, K, dtype=dtype, device=device), _rand(gen, K, N, dtype=dtype, device=device)
    plan = _plan_with("generic", a, b, SPLIT_K=split_k)
    a_t = _rand(gen, K, 130, dtype=dtype, device=device).t()
    b_step = _rand(gen, K, 2 * N, dtype=dtype, device=device)[:, ::2]
    for x, y in ((a, b), (a_t, b), (a, b_step)):
        _check(matmul_module.launch(plan, x, y), x, y)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("split_k,K", SPLIT_CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("subtile", [False, True])
def test_split_k_tma_variant(device, gen, nan_empty, dtype, split_k, K, subtile):
    # Persistent: more work units (tiles x slices) than programs, so programs take slices
    # of several tiles. 16-byte aligned rows in both layouts, tails in M and N.
    M, N = 72 if device.type == "cpu" else 4000, 48
    a, b = _rand(gen, M, K, dtype=dtype, device=device), _rand(gen, K, N, dtype=dtype, device=device)
    plan = _plan_with(TMA, a, b, SPLIT_K=split_k, EPILOGUE_SUBTILE=subtile)
    a_t = _rand(gen, K, M, dtype=dtype, device=device).t()
    b_t = _rand(gen, N, K, dtype=dtype, device=device).t()
    for x, y in ((a, b), (a_t, b), (a, b_t)):
        _check(matmul_module.launch(plan, x, y), x, y)


@pytest.mark.parametrize("split_k", [2, 4])
def test_split_k_tma_variant_four_warps(device, gen, nan_empty, split_k):
    """4-warp split-K descriptor configs, the ones Triton 3.6 warp-specializes on sm_90:
    specialized, their K loop and the split epilogue computed garbage on the H200 (errors
    up to 7e19 at 128x4096x4096, bench/matmul_sweep.py), so split-K loops are not
    specialized. Several launches, since a race need not show every time. (The interpreter
    does not specialize: there this checks the configuration's arithmetic.)"""
    M, N, K = (128, 4096, 4096) if device.type != "cpu" else (72, 48, 264)
    a, b = _rand(gen, M, K, dtype=torch.float16, device=device), _rand(gen, K, N, dtype=torch.float16, device=device)
    with pk.use_variant(matmul=TMA):
        base = dispatch._launch_plan(pk.explain("matmul", a, b))
    assert base.switches["WARP_SPECIALIZE"] and base.switches["TMA"]
    config = triton.Config({"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64,
                            "GROUP_SIZE_M": 8, "SPLIT_K": split_k}, num_warps=4, num_stages=3)
    plan = pk.LaunchPlan(base.variant, base.device, [config], base.switches)
    for _ in range(3 if device.type != "cpu" else 1):
        _check(matmul_module.launch(plan, a, b), a, b)


def test_split_k_is_deterministic_and_leaves_counters_at_zero(device, gen, monkeypatch):
    # The last slice sums the partials in slice order, so reruns agree bit for bit, and it
    # resets its tile's counter, so the next launch (the autotuner's relaunch with the same
    # arguments, or the next call on the stream's kept counters) starts from zero again.
    a = _rand(gen, 130, 200, dtype=torch.float16, device=device)
    b = _rand(gen, 200, 72, dtype=torch.float16, device=device)
    kept, counters = matmul_module._counters.kept_zeros, []

    def spy(device, n):
        counters.append(kept(device, n))
        return counters[-1]

    monkeypatch.setattr(matmul_module._counters, "kept_zeros", spy)
    for variant in ("generic", TMA):
        plan = _plan_with(variant, a, b, SPLIT_K=3)
        first = matmul_module.launch(plan, a, b)
        assert torch.equal(matmul_module.launch(plan, a, b), first), variant
        _check(first, a, b)
    assert len(counters) == 4 and not any(c.any() for c in counters)


def test_tuned_unsplit_problems_allocate_no_workspace(device, gen, monkeypatch, tmp_path):
    """Before tuning, a problem some candidate splits gets a split-K workspace; once the
    autotuner has chosen an unsplit config, its launches allocate and zero nothing."""
    monkeypatch.setenv("PK_CACHE_DIR", str(tmp_path))  # no tuning results from elsewhere
    a = _rand(gen, 64, 256, dtype=torch.float16, device=device)
    b = _rand(gen, 256, 64, dtype=torch.float16, device=device)
    with pk.use_variant(matmul="generic"):
        base = dispatch._launch_plan(pk.explain("matmul", a, b))
    c = base.configs[0]
    split, unsplit = (triton.Config({**c.kwargs, "BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64,
                                     "BLOCK_SIZE_K": 32, "SPLIT_K": s},
                                    num_warps=c.num_warps, num_stages=c.num_stages) for s in (2, 1))
    plan = pk.LaunchPlan(base.variant, base.device, [split, unsplit], base.switches)
    timed = []

    def do_bench(kernel_call, quantiles=None):  # the config timed last wins: unsplit
        timed.append(1)
        kernel_call()
        return [1.0 / len(timed)] * 3

    # The launcher's autotuner is built once per plan: build it first, with this timer.
    plan.autotuned(matmul_module._matmul_kernel, key=["M", "N", "K", "A_T", "B_T"],
                   do_bench=do_bench, prune_configs_by={"early_config_prune": lambda configs, nargs, **kw:
                                                          matmul_module.candidates(configs, 64, 64, 256, 2)})
    zeros, empty, partials, counters, stand_ins = torch.zeros, torch.empty, [], [], []

    def counters_spy(device, n):
        counters.append(n)
        return zeros(n, dtype=torch.int32, device=device)

    def zeros_spy(*args, **kwargs):
        t = zeros(*args, **kwargs)
        if t.dtype == torch.int32:
            stand_ins.append(t.numel())
        return t

    def partials_spy(device, n):
        partials.append(n)
        return empty(n, dtype=torch.float32, device=device)

    monkeypatch.setattr(matmul_module._counters, "kept_scratch", partials_spy)
    monkeypatch.setattr(matmul_module._counters, "kept_zeros", counters_spy)
    monkeypatch.setattr(torch, "zeros", zeros_spy)
    allocated = []
    for _ in range(4):
        _check(matmul_module.launch(plan, a, b), a, b)
        allocated.append((len(partials), len(counters), len(stand_ins)))
    assert len(timed) == 2  # both candidates were timed, once
    assert plan.chosen(plan.autotuned(matmul_module._matmul_kernel, key=[]),
                       (64, 64, 256, False, False, torch.float16))["SPLIT_K"] == 1
    # The untuned first launch asks for the workspace (partials and counters); the second
    # makes the plan's one-element stand-ins for unsplit kernels (kept); later launches
    # nothing.
    assert allocated == [(1, 1, 0), (1, 1, 1), (1, 1, 1), (1, 1, 1)]


def test_split_k_pruning():
    # What the autotuner may pick on an H100/H200 (132 SMs): split configs only where the
    # output's tiles are too few, and the workspace the launcher allocates for them.
    from portable_kernels_backends import nvidia

    h100 = nvidia.pk_emulation_profiles()["h100"]
    tables = ((nvidia.tuning.matmul_persistent_tma(h100), 64),  # its 64 x 64 tiles, x 2
              (nvidia.tuning.configs("matmul", "generic", h100), 32))
    for configs, most_tiles in tables:
        def splits(m, n, k):
            return sorted({c.kwargs.get("SPLIT_K", 1) for c in matmul_module.candidates(configs, m, n, k, 132)})

        # N = 4096 with M = 16 or 128: 32 tiles of 128 columns, cut into 4 slices.
        assert splits(16, 4096, 14336)[-1] == 4 and splits(128, 4096, 4096)[-1] == 4
        # Enough tiles already (14336 columns, big squares), or K too short to cut in four.
        for shape in ((4096, 4096, 4096), (2048, 2048, 2048), (16, 14336, 4096), (128, 14336, 14336)):
            assert splits(*shape) == [1], shape
        assert 4 not in splits(16, 4096, 512)
        slices, tiles = matmul_module._split_workspace(configs, 16, 4096, 14336, 132)
        assert slices == 4 and tiles == most_tiles
        assert matmul_module._split_workspace(configs, 4096, 4096, 4096, 132) == (0, 0)
    # A single config is used as it is, split or not (Triton prunes only lists).
    one = [triton.Config({"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 4, "SPLIT_K": 2})]
    assert matmul_module.candidates(one, 4096, 4096, 4096, 132) == one
    assert matmul_module._split_workspace(one, 100, 70, 64, 2) == (2, 4)
