"""grouped_matmul against a float64 reference: groups of different sizes with tails, strided
operands, empty groups, every dtype, the descriptor variant forced, selection and errors;
on a CUDA GPU, calls that do not wait for the GPU and that a CUDA graph captures."""
from __future__ import annotations

import time

import pytest
import torch

import portable_kernels as pk
from conftest import ON_CPU
from portable_kernels import dispatch
from portable_kernels.errors import VariantUnavailableError
from portable_kernels.kernels import grouped_matmul as grouped_module
from portable_kernels.kernels.matmul import out_dtype
from portable_kernels.testing import assert_close, tolerance

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
TMA = "nvidia.tma"

# (M, N, K) per group: tails in every dimension, a one-row group, several K steps, more
# rows of tiles than GROUP_SIZE_M (4 on the interpreter), and sizes that differ per group.
SHAPES = [(67, 45, 33), (1, 64, 8), (130, 70, 200), (300, 20, 16), (16, 16, 16)]
# The same kind of mix with 16-byte aligned rows for 16-bit types (what descriptors take).
ALIGNED_SHAPES = [(67, 48, 40), (1, 64, 8), (130, 72, 200), (300, 24, 16), (16, 16, 16)]
# ... and for 1-byte (fp8) types: N and K multiples of 16.
FP8_SHAPES = [(67, 48, 48), (1, 64, 16), (130, 80, 208), (300, 32, 16), (16, 16, 16)]


def _operands(gen, shapes, dtype, device):
    list_a = [torch.randn(m, k, generator=gen).to(device, dtype) for m, _, k in shapes]
    list_b = [torch.randn(k, n, generator=gen).to(device, dtype) for _, n, k in shapes]
    return list_a, list_b


def _skip_without_fp8(device):
    if not pk.device_info(device).has("fp8"):
        pytest.skip(f"{device} has no fp8 capability")


def _check(outs, list_a, list_b):
    assert isinstance(outs, list) and len(outs) == len(list_a)
    refs = grouped_module.reference(list_a, list_b)
    for g, (out, a, ref) in enumerate(zip(outs, list_a, refs)):
        assert out.shape == ref.shape and out.dtype == out_dtype(a.dtype) and out.is_contiguous(), f"group {g}"
        assert not torch.isnan(out).any(), f"group {g}: the kernel left output elements unwritten"
        assert_close(out, ref, tolerance(a.dtype, "dot"), f"group {g} {tuple(out.shape)} {a.dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(device, gen, nan_empty, dtype):
    list_a, list_b = _operands(gen, SHAPES, dtype, device)
    _check(pk.get_kernel("grouped_matmul")(list_a, list_b), list_a, list_b)


def test_one_group_and_many_groups(device, gen, nan_empty):
    gm = pk.get_kernel("grouped_matmul")
    list_a, list_b = _operands(gen, [(67, 45, 33)], torch.float16, device)
    _check(gm(list_a, list_b), list_a, list_b)
    # Many small groups: every program walks the whole table, taking a tile here and there.
    shapes = [(1 + 7 * g, 8 + 5 * g, 3 + 4 * g) for g in range(12)]
    list_a, list_b = _operands(gen, shapes, torch.float16, device)
    _check(gm(tuple(list_a), tuple(list_b)), list_a, list_b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_operands(device, gen, nan_empty, dtype):
    list_a, list_b = _operands(gen, SHAPES[:3], dtype, device)
    list_a[0] = torch.randn(33, 67, generator=gen).to(device, dtype).t()
    list_b[1] = torch.randn(64, 8, generator=gen).to(device, dtype).t()
    list_a[2] = torch.randn(130, 400, generator=gen).to(device, dtype)[:, ::2]
    _check(pk.get_kernel("grouped_matmul")(list_a, list_b), list_a, list_b)


def test_empty_groups(device, gen):
    shapes = [(0, 5, 4), (3, 0, 4), (3, 5, 0), (7, 9, 11)]
    list_a, list_b = _operands(gen, shapes, torch.float32, device)
    outs = pk.get_kernel("grouped_matmul")(list_a, list_b)
    assert [tuple(o.shape) for o in outs] == [(0, 5), (3, 0), (3, 5), (7, 9)]
    assert not outs[2].any()
    _check(outs, list_a, list_b)
    # Nothing to compute at all: no launch.
    outs = pk.get_kernel("grouped_matmul")(list_a[:3], list_b[:3])
    assert [tuple(o.shape) for o in outs] == [(0, 5), (3, 0), (3, 5)]


def test_errors(device):
    gm = pk.get_kernel("grouped_matmul")
    x = torch.ones(3, 4, device=device)
    y = torch.ones(4, 2, device=device)
    with pytest.raises(ValueError, match="list_a has 2 matrices but list_b has 1"):
        gm([x, x], [y])
    with pytest.raises(ValueError, match="must be non-empty"):
        gm([], [])
    with pytest.raises(TypeError, match="list_a must be a list or tuple of tensors, got Tensor"):
        gm(x, y)
    with pytest.raises(ValueError, match=r"group 1: inner dimensions differ: a \(3, 4\) @ b \(5, 2\)"):
        gm([x, x], [y, torch.ones(5, 2, device=device)])
    with pytest.raises(TypeError, match="group 1: dtype float16 differs from group 0's float32"):
        gm([x, x.half()], [y, y.half()])
    with pytest.raises(TypeError, match="group 0: dtypes must match, but a is float32, b is bfloat16"):
        gm([x], [y.bfloat16()])
    with pytest.raises(TypeError, match="group 1: a has dtype int64"):
        gm([x, torch.ones(3, 4, dtype=torch.int64, device=device)], [y, y])
    with pytest.raises(ValueError, match=r"group 2: b must be 2-D \(K, N\), got shape \(4,\)"):
        gm([x, x, x], [y, y, torch.ones(4, device=device)])
    with pytest.raises(ValueError, match=r"tensors must be on one device.*list_b\[1\] on meta"):
        gm([x, x], [y, torch.ones(4, 2, device="meta")])
    with pytest.raises(TypeError, match=r"list_b\[0\] must be a torch.Tensor, got list"):
        gm([x], [[[1.0]]])


# --- the descriptor variant, forced (it runs on the interpreter too) -----------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tma_variant(device, gen, nan_empty, dtype):
    list_a, list_b = _operands(gen, ALIGNED_SHAPES, dtype, device)
    with pk.use_variant(grouped_matmul=TMA):
        _check(pk.get_kernel("grouped_matmul")(list_a, list_b), list_a, list_b)


def _weights_t(gen, shapes, dtype, device):
    """``w.t()`` of (N, K) weights: column-major (K, N) operands."""
    return [torch.randn(n, k, generator=gen).to(device, dtype).t() for _, n, k in shapes]


@pytest.mark.parametrize("variant", ["generic", TMA])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_column_major_weights(device, gen, nan_empty, variant, dtype):
    """b as ``w.t()`` in every group, how models store weights: aligned (vectorized pointer
    loads, descriptors of the transposes) and the right products."""
    list_a, _ = _operands(gen, ALIGNED_SHAPES, dtype, device)
    list_b = _weights_t(gen, ALIGNED_SHAPES, dtype, device)
    assert grouped_module.problem(list_a, list_b).b_layout == "col"
    with pk.use_variant(grouped_matmul=variant):
        _check(pk.get_kernel("grouped_matmul")(list_a, list_b), list_a, list_b)


@pytest.mark.parametrize("variant", ["generic", TMA])
@pytest.mark.parametrize("weights", ["row", "col"])
def test_mixture_of_experts_layer(device, gen, nan_empty, variant, weights):
    """Tokens split among experts (views of one (T, K) tensor, one expert without tokens)
    and their stacked weights (views of one (G, K, N) tensor, or of a (G, N, K) one
    transposed), as a mixture-of-experts layer passes them."""
    counts, n, k = [5, 0, 17, 64, 3], 48, 40
    tokens = torch.randn(sum(counts), k, generator=gen).to(device, torch.float16)
    if weights == "col":
        stacked = torch.randn(len(counts), n, k, generator=gen).to(device, torch.float16).transpose(1, 2)
    else:
        stacked = torch.randn(len(counts), k, n, generator=gen).to(device, torch.float16)
    list_a, list_b = list(torch.split(tokens, counts)), list(stacked.unbind(0))
    assert grouped_module.problem(list_a, list_b).b_layout == weights
    with pk.use_variant(grouped_matmul=variant):
        outs = pk.get_kernel("grouped_matmul")(list_a, list_b)
    _check(outs, list_a, list_b)


@pytest.mark.parametrize("upcast", [None, False])
@pytest.mark.parametrize("variant", ["generic", TMA])
@pytest.mark.parametrize("weights", ["row", "col"])
@pytest.mark.parametrize("dtype", FP8)
def test_fp8(device, gen, nan_empty, dtype, weights, variant, upcast):
    """fp8 operands, bf16 outputs. ``upcast=False`` on the interpreter runs the paths
    compiled kernels take: fp16 tiles, or with every b column-major on the descriptor
    path, the fp8 dot with its periodic fp32 accumulation."""
    _skip_without_fp8(device)
    if upcast is False and not ON_CPU:
        pytest.skip("UPCAST is already off for compiled kernels (the default case runs them)")
    list_a, list_b = _operands(gen, FP8_SHAPES, dtype, device)
    if weights == "col":
        list_b = _weights_t(gen, FP8_SHAPES, dtype, device)
    assert grouped_module.problem(list_a, list_b).b_layout == weights
    with pk.use_variant(grouped_matmul=variant):
        plan = dispatch._launch_plan(pk.explain("grouped_matmul", list_a, list_b))
    if upcast is not None:
        plan = pk.LaunchPlan(plan.variant, plan.device, plan.configs, dict(plan.switches, UPCAST=upcast))
    _check(grouped_module.launch(plan, list_a, list_b), list_a, list_b)


def test_fp8_has_no_gradient(device, gen):
    _skip_without_fp8(device)
    from portable_kernels import ops

    list_a, list_b = _operands(gen, ALIGNED_SHAPES[:2], torch.float8_e4m3fn, device)
    outs = ops.grouped_matmul([a.requires_grad_() for a in list_a], list_b)
    with pytest.raises(ValueError, match="grouped_matmul: no gradient for float8_e4m3fn operands"):
        sum(o.float().sum() for o in outs).backward()


def test_mixed_weight_layouts(device, gen, nan_empty):
    """Row-major b in some groups and column-major in others: no common layout, so the
    pointer path without alignment hints, and descriptors refuse it, saying why."""
    list_a, list_b = _operands(gen, ALIGNED_SHAPES, torch.float16, device)
    list_b[1:3] = _weights_t(gen, ALIGNED_SHAPES[1:3], torch.float16, device)
    assert grouped_module.problem(list_a, list_b).b_layout == ""
    _check(pk.get_kernel("grouped_matmul")(list_a, list_b), list_a, list_b)
    with pk.emulate("h100"):
        sel = pk.explain("grouped_matmul", list_a, list_b)
    assert sel.variant == "generic"
    assert "neither row- nor column-major as in the other groups" in next(
        v for v in sel.verdicts if v.name == TMA).reason


def test_tma_variant_rejects_unaligned_groups(device, gen):
    gm = pk.get_kernel("grouped_matmul")
    list_a, list_b = _operands(gen, ALIGNED_SHAPES[:2], torch.float16, device)
    with pk.use_variant(grouped_matmul=TMA):
        with pytest.raises(VariantUnavailableError, match="16-byte aligned"):
            gm(list_a + [torch.ones(3, 5, device=device, dtype=torch.float16)],
               list_b + [torch.ones(5, 8, device=device, dtype=torch.float16)])
        with pytest.raises(VariantUnavailableError, match="16-byte aligned"):
            gm([list_a[0].t().contiguous().t()], [list_b[0]])  # column-major a
        with pytest.raises(VariantUnavailableError, match="float32 operands stay on pointer loads"):
            gm([a.float() for a in list_a], [b.float() for b in list_b])


def test_selection(device):
    half = [torch.ones(64, 64, device=device, dtype=torch.float16)]
    if device.type == "cpu":
        assert pk.explain("grouped_matmul", half, half).variant == "generic"
    with pk.emulate("h100"):
        assert pk.explain("grouped_matmul", half, half).variant == TMA
        odd = [torch.ones(64, 33, device=device, dtype=torch.float16)]
        sel = pk.explain("grouped_matmul", odd, [o.t() for o in odd])
        assert sel.variant == "generic"
        assert "16-byte aligned" in next(v for v in sel.verdicts if v.name == TMA).reason
    with pk.emulate("a100"):
        assert pk.explain("grouped_matmul", half, half).variant == "generic"


# --- the table's copy to the GPU: no host wait, capturable ---------------------------------

NEEDS_CUDA = pytest.mark.skipif(ON_CPU or torch.version.cuda is None,
                                reason="stream order and graph capture need a CUDA GPU")


def _needs_variant(variant: str) -> None:
    if variant == TMA and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the descriptor variant needs sm_90 or newer")


@NEEDS_CUDA
@pytest.mark.parametrize("variant", ["generic", TMA])
def test_call_does_not_wait_for_the_gpu(device, gen, variant):
    """The host returns while earlier work still runs: the table goes up from pinned
    memory, where a pageable copy makes PyTorch wait for the whole stream."""
    _needs_variant(variant)
    list_a, list_b = _operands(gen, ALIGNED_SHAPES, torch.float16, device)
    with pk.use_variant(grouped_matmul=variant):
        gm = pk.get_kernel("grouped_matmul")
        gm(list_a, list_b)  # compiles and tunes
        torch.cuda.synchronize()
        busy = time.perf_counter()
        torch.cuda._sleep(1 << 30)  # ~0.5 s of a spinning kernel ahead of ours
        queued = time.perf_counter() - busy
        start = time.perf_counter()
        outs = gm(list_a, list_b)
        took = time.perf_counter() - start
        pending = not torch.cuda.current_stream(device).query()
        torch.cuda.synchronize()
        slept = time.perf_counter() - busy
    assert pending and slept > 0.1 + queued, f"the sleep kernel ran {slept:.3f} s only"
    assert took < slept / 4, f"the call took {took:.3f} s behind a {slept:.3f} s kernel: it waited"
    _check(outs, list_a, list_b)


@NEEDS_CUDA
@pytest.mark.parametrize("variant", ["generic", TMA])
def test_cuda_graph_capture_and_replay(device, gen, variant):
    _needs_variant(variant)
    list_a, list_b = _operands(gen, ALIGNED_SHAPES, torch.float16, device)
    with pk.use_variant(grouped_matmul=variant):
        gm = pk.get_kernel("grouped_matmul")
        gm(list_a, list_b)  # compiles and tunes outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = gm(list_a, list_b)
    # New values in the captured operands: the replay must compute with them.
    fresh_a, fresh_b = _operands(gen, ALIGNED_SHAPES, torch.float16, device)
    for dst, src in zip(list_a + list_b, fresh_a + fresh_b):
        dst.copy_(src)
    for out in outs:
        out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _check(outs, fresh_a, fresh_b)
