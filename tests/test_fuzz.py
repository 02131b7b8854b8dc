"""Property-based fuzzing of every kernel family x every variant the test device can run.

For each family of ``pk.list_kernels()`` a hypothesis strategy draws small random problems:
shapes with sizes 1, odd and (where torch takes them for that op) 0; memory layouts
(contiguous, transposed, permuted, sliced with a step out of a NaN-filled buffer, at a
misaligned storage offset, expanded with a zero stride); the family's own arguments
(softmax's dim, layer_norm's eps, dropout's p and seed, flash_attn's GQA, causal, sm_scale
and head dim); which API is called (the handle or the ``portable_kernels.ops`` operator)
and the layout of the upstream gradient. The dtype (fp32, fp16, bf16, and fp8 e4m3/e5m2
for the GEMMs where the device has the ``fp8`` capability) is a pytest parameter, so
every dtype gets its share of each budget.

Each example runs every variant of the family that the device can run
(``pk.list_variants(name, DEVICE)``) and whose predicate accepts the problem (the verdicts
of ``pk.explain``): a variant that rejects the problem is passed over for that example,
but ``generic`` must accept every valid problem wherever the device can run it, and at
least one variant must run. On the CPU interpreter, where the variants are the same
source run again with other switches and an example of attention costs seconds a variant,
an example runs ``generic`` and one other variant, which the example's own shapes and
options pick (``PK_FUZZ_ALL_VARIANTS=1``: all of them). Each variant is forced with
``pk.use_variant`` under ``poisoned_allocations`` (memory torch allocates uninitialized is
NaN, so an output element a kernel never writes fails the comparison). Outputs and, for differentiable families,
gradients are compared with float64 torch references within the tolerance table of
``portable_kernels.testing`` (with the conformance suites' adjustments for gradients that
are sums, and a conditioning bound where the computation is ill-conditioned). dropout is
checked by its mask's properties instead of a reference. Inputs must come back unchanged.

Every family is differentiable through its handle and through ``portable_kernels.ops``
(vector_add, softmax, asin, matmul and grouped_matmul handles take their operator for
calls that need a gradient; ``test_handle_differentiability`` pins that down). Backward
examples draw the API among them.

Budget: ``EXAMPLES[family]`` hypothesis examples per dtype, sized so that the whole file
takes about 2-3 minutes on a 2-core CPU under Triton's interpreter with ``pytest -n 2``.
``PK_FUZZ_EXAMPLES=<factor>`` multiplies every budget (``PK_FUZZ_EXAMPLES=20`` for a long
run, ``0.2`` for a smoke run). Examples are derandomized: each test id (family and dtype)
has its own fixed sequence, the same on every run and machine (it changes when the test's
source does). ``PK_FUZZ_RANDOM=1`` draws fresh examples instead (hypothesis then prints a
``@reproduce_failure`` blob for a failure). No example database is kept, so nothing is
written to the working tree.

Defects this fuzzer found keep a minimal reproducer at the end of the file. One still
open would be pinned there by an ``xfail(strict=True)`` test (which fails once the defect
is fixed) and kept out of the fuzz tests with a comment naming it.

On a GPU, autograd runs backward passes on its own threads, which do not see
``use_variant``: there the backward of the ``ops`` operators runs dispatch's own choice
(the handles' backward keeps the forward's plan, so it runs the forced variant).
"""
from __future__ import annotations

import contextlib
import math
import os
import tempfile
import zlib
from pathlib import Path

import hypothesis
import hypothesis.configuration
import pytest
import torch
# The first call of a torch.library operator imports torch._dynamo, which sets
# TORCHINDUCTOR_CACHE_DIR: imported here, at collection, so that conftest's check for leaked
# environment variables does not blame whichever example calls ``ops`` first.
import torch._dynamo  # noqa: F401
from hypothesis import HealthCheck, given
from hypothesis import strategies as st

import portable_kernels as pk
from conftest import DEVICE
from portable_kernels import ops
from portable_kernels.conformance import test_flash_attn as flash_attn_suite
from portable_kernels.conformance import test_layer_norm as layer_norm_suite
from portable_kernels.conformance import _glu_suite
from portable_kernels.conformance import test_rms_norm as rms_norm_suite
from portable_kernels.conformance import test_rope as rope_suite
from portable_kernels.conformance import test_add_rms_norm as add_rms_norm_suite
from portable_kernels.conformance.harness import Inputs, poisoned_allocations
from portable_kernels.conformance.test_asin import EDGES as ASIN_EDGES
from portable_kernels.kernels.cross_entropy import reference as cross_entropy_reference
from portable_kernels.kernels.flash_attn import reference as flash_attn_reference
from portable_kernels.kernels.fused_linear_cross_entropy import reference as flce_reference
from portable_kernels.kernels.matmul import out_dtype as gemm_out_dtype
from portable_kernels.testing import Tolerance, tolerance

# hypothesis caches the constants it finds in the source under its home directory
# (./.hypothesis by default) even without an example database: keep it out of the tree.
hypothesis.configuration.set_hypothesis_home_dir(
    Path(tempfile.gettempdir()) / "portable-kernels-hypothesis")

# --- budget and settings ---------------------------------------------------------------------

SCALE = float(os.environ.get("PK_FUZZ_EXAMPLES", "1"))
RANDOM = os.environ.get("PK_FUZZ_RANDOM", "") not in ("", "0")
ALL_VARIANTS = DEVICE.type != "cpu" or os.environ.get("PK_FUZZ_ALL_VARIANTS", "") not in ("", "0")

#: Examples per dtype (x SCALE). Costs on the interpreter: each example runs two accepted
#: variants (module docstring), forward and backward; flash_attn and the GEMMs pay per
#: program and K step. The whole file is about a quarter of CI's two cores for its 15
#: minutes: flash_attn took 15-24 s a dtype at 8 examples, grouped_matmul 7-9 s at 14,
#: dropout's fp32 9 s at 25; they run the first 6, 10 and 18.
EXAMPLES = {
    "vector_add": 40,
    "softmax": 24,
    "dropout": 18,
    "asin": 40,
    "layer_norm": 30,
    "rms_norm": 20,
    "swiglu": 25,
    "geglu": 25,
    "matmul": 20,
    "grouped_matmul": 10,
    "flash_attn": 6,
    "flash_attn_varlen": 3,
    "kv_cache_write": 10,
    "flash_attn_with_kvcache": 6,
    "rope": 15,
    "add_rms_norm": 12,
    "cross_entropy": 25,
    "fused_linear_cross_entropy": 8,
}


def _fuzz(family: str):
    """hypothesis settings for ``family``'s test: its budget, derandomized (a fixed seed
    per test id, so each dtype gets its own fixed examples), no database, no deadline (the
    interpreter's first call of a shape is slow)."""
    return hypothesis.settings(
        max_examples=max(1, round(EXAMPLES[family] * SCALE)), deadline=None, database=None,
        derandomize=not RANDOM, print_blob=RANDOM,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


INFO = pk.device_info(DEVICE)
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _dtype_params(dtypes) -> list:
    """``dtypes`` as pytest params, skipped where the device lacks the capability."""
    params = []
    for dtype in dtypes:
        need = "fp8" if dtype in FP8 else "bf16" if dtype == torch.bfloat16 else None
        marks = [pytest.mark.skipif(need is not None and not INFO.has(need),
                                    reason=f"{INFO.name} has no {need} capability")]
        params.append(pytest.param(dtype, id=str(dtype).replace("torch.", ""), marks=marks))
    return params


FLOATS = _dtype_params([torch.float32, torch.float16, torch.bfloat16])
GEMM_DTYPES = _dtype_params([torch.float32, torch.float16, torch.bfloat16, *FP8])


# --- strategies shared by the families ------------------------------------------------------

def sizes(hi: int, special=(1, 0, 2, 3, 7, 64, 65)) -> st.SearchStrategy[int]:
    """A dimension: a special size (1 first, so that shrinking goes there) or any in [0, hi]."""
    return st.one_of(st.sampled_from([s for s in special if s <= hi]), st.integers(0, hi))


@st.composite
def shapes(draw, ndim: int, hi: int, total: int, min_size: int = 0) -> tuple[int, ...]:
    """``ndim`` sizes in [min_size, hi] whose product stays within ``total``."""
    dims = []
    for _ in range(ndim):
        room = total // max(1, math.prod(d for d in dims if d))
        dims.append(max(min_size, min(draw(sizes(hi)), max(min_size, room))))
    return tuple(dims)


@st.composite
def layouts(draw, ndim: int, expand: bool = True):
    """How a tensor of ``ndim`` dimensions lies in memory: ``(kind, argument)``."""
    kinds = ["contiguous", "step", "offset"] if ndim else ["contiguous", "offset"]
    if ndim >= 2:
        kinds += ["transposed", "permuted"]
    if expand and ndim:
        kinds.append("expanded")
    kind = draw(st.sampled_from(kinds))
    if kind == "permuted":
        return kind, tuple(draw(st.permutations(range(ndim))))
    if kind in ("step", "expanded"):
        return kind, draw(st.integers(0, ndim - 1))
    return kind, None


seeds = st.integers(0, 2**31 - 1)


def _normal(scale: float = 1.0, offset: float = 0.0):
    def sample(shape, gen):
        return torch.randn(shape, generator=gen) * scale + offset
    return sample


def _uniform(low: float, high: float):
    def sample(shape, gen):
        return torch.rand(shape, generator=gen) * (high - low) + low
    return sample


def make(shape, dtype, layout, gen, sample=_normal()) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` on DEVICE with values ``sample(shape, gen)``
    (fp32, rounded to ``dtype``), laid out as ``layout`` (see :func:`layouts`):

    - ``contiguous``; ``transposed``: the last two dims swapped in memory; ``permuted``:
      memory order given by the permutation;
    - ``step``: every other element along one dim of a NaN-filled buffer;
    - ``offset``: contiguous at storage offset 1 (a base no 16-byte rule accepts);
    - ``expanded``: one dim of size 1 expanded (stride 0), so values repeat along it.
    """
    shape = tuple(shape)
    kind, arg = layout
    if kind == "expanded":
        small = list(shape)
        small[arg] = min(1, shape[arg])
        return sample(small, gen).to(dtype).to(DEVICE).expand(shape)
    values = sample(shape, gen).to(dtype)
    if kind == "contiguous":
        return values.to(DEVICE)
    if kind == "transposed":
        return values.transpose(-1, -2).contiguous().to(DEVICE).transpose(-1, -2)
    if kind == "permuted":
        inverse = [arg.index(i) for i in range(len(arg))]
        return values.permute(arg).contiguous().to(DEVICE).permute(inverse)
    if kind == "step":
        big = list(shape)
        big[arg] *= 2
        base = torch.full(big, float("nan"), dtype=dtype, device=DEVICE)
        view = base[(slice(None),) * arg + (slice(None, None, 2),)]
    elif kind == "offset":
        base = torch.full((values.numel() + 1,), float("nan"), dtype=dtype, device=DEVICE)
        view = base[1:].view(shape)
    else:
        raise ValueError(kind)
    view.copy_(values.to(DEVICE))
    return view


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- checks ----------------------------------------------------------------------------------

def assert_close(out, ref, tol: Tolerance, what: str, magnitude=None) -> None:
    """``|out - ref| <= atol + rtol * m`` elementwise, ``m = |ref|`` or ``magnitude`` (what the
    rounding error scales with, where that is not the result). Equal values (infinities of
    one sign included) and NaN where the reference is NaN match; NaN elsewhere fails."""
    out64 = out.detach().cpu().double()
    ref64 = ref.detach().cpu().double()
    assert out64.shape == ref64.shape, f"{what}: shape {tuple(out64.shape)} != reference {tuple(ref64.shape)}"
    if not out64.numel():
        return
    same = (out64 == ref64) | (out64.isnan() & ref64.isnan())
    err = (out64 - ref64).abs().nan_to_num(nan=math.inf).masked_fill(same, 0.0)
    mag = ref64.abs() if magnitude is None else magnitude.detach().cpu().double()
    allowed = tol.atol + tol.rtol * torch.where(mag.isfinite(), mag, torch.zeros_like(mag))
    ratio = err / allowed
    if not bool((ratio <= 1.0).all()):
        worst = int(torch.where(ratio.isnan(), math.inf, ratio).flatten().argmax())
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), out64.shape))
        bad = int((~(ratio <= 1.0)).sum())
        unwritten = int((out64.isnan() & ~ref64.isnan()).sum())
        raise AssertionError(
            f"{what}: {bad} of {out64.numel()} elements outside tolerance ({tol}"
            f"{', scaled' if magnitude is not None else ''}); {unwritten} NaN where the "
            f"reference is not; worst at {idx}: got {out64[idx].item()!r}, expected "
            f"{ref64[idx].item()!r}")


def check_output(out, ref, dtype, tol, what, contiguous=True, magnitude=None) -> None:
    assert isinstance(out, torch.Tensor), f"{what}: returned {type(out).__name__}"
    assert out.dtype == dtype, f"{what}: dtype {out.dtype}, expected {dtype}"
    assert out.device.type == DEVICE.type, f"{what}: on {out.device}, inputs on {DEVICE}"
    assert tuple(out.shape) == tuple(ref.shape), f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    if contiguous:
        assert out.is_contiguous(), f"{what}: not contiguous (strides {out.stride()})"
    assert_close(out, ref, tol, what, magnitude)


def snapshot(*tensors):
    return [t.detach().cpu().double().clone() for t in tensors]


def assert_unchanged(before, tensors, what) -> None:
    for i, (b, t) in enumerate(zip(before, tensors)):
        now = t.detach().cpu().double()
        assert torch.equal(now.isnan(), b.isnan()) and torch.equal(
            now.nan_to_num(0.0), b.nan_to_num(0.0)), f"{what}: input {i} was modified"


def runnable_variants(name: str, *args, **kwargs) -> list[str]:
    """The variants of ``name`` this device can run that accept the call's problem (per
    ``pk.explain``'s verdicts), best first. ``generic`` must accept every valid problem
    where the device can run it, and some variant must."""
    verdicts = {v.name: v for v in pk.explain(name, *args, **kwargs).verdicts}
    on_device = pk.list_variants(name, DEVICE)
    runnable = [v for v in on_device if verdicts[v].runnable]
    why = "; ".join(f"{v}: {verdicts[v].reason}" for v in on_device)
    if "generic" in on_device:
        assert "generic" in runnable, f"{name}: generic rejects a valid problem ({why})"
    assert runnable, f"{name}: no variant of {on_device} accepts a valid problem ({why})"
    if ALL_VARIANTS or len(runnable) <= 2:
        return runnable
    # The other variant from the example itself (shapes, strides, dtypes, options): the
    # same on every run, whichever worker and order the examples get.
    drawn = repr([(a.shape, a.stride(), a.dtype) if isinstance(a, torch.Tensor) else a
                  for a in (*args, *kwargs.values())])
    first = "generic" if "generic" in runnable else runnable[0]
    others = [v for v in runnable if v != first]
    return [first, others[zlib.crc32(drawn.encode()) % len(others)]]


def accepts(name: str, variant: str, *args, **kwargs) -> bool:
    return next(v for v in pk.explain(name, *args, **kwargs).verdicts if v.name == variant).runnable


@contextlib.contextmanager
def forced(name: str, variant: str | None):
    """``variant`` forced (None: dispatch's own choice), with poisoned allocations."""
    with (pk.use_variant(**{name: variant}) if variant else contextlib.nullcontext()), \
            poisoned_allocations():
        yield


def call(name: str, api: str, *args, **kwargs):
    fn = pk.get_kernel(name) if api == "handle" else getattr(ops, name)
    return fn(*args, **kwargs)


def leaves(*tensors):
    """Leaves requiring grad with the inputs' strides (``detach`` keeps them), and their
    float64 copies for the reference."""
    mine = [t.detach().requires_grad_() for t in tensors]
    ref = [t.detach().cpu().double().requires_grad_() for t in tensors]
    return mine, ref


# --- every family has a fuzzer ---------------------------------------------------------------

FUZZED = ("vector_add", "softmax", "dropout", "asin", "layer_norm", "rms_norm", "swiglu",
          "geglu", "matmul", "grouped_matmul", "flash_attn", "flash_attn_varlen",
          "kv_cache_write", "flash_attn_with_kvcache", "rope", "add_rms_norm", "cross_entropy", "fused_linear_cross_entropy")


@pytest.mark.parametrize("family", pk.list_kernels())
def test_every_family_has_a_fuzzer(family):
    assert family in FUZZED and family in EXAMPLES and f"test_{family}" in globals(), (
        f"kernel family {family!r} has no strategy in tests/test_fuzz.py: add one")


def test_every_fuzzer_has_a_family():
    assert sorted(FUZZED) == sorted(EXAMPLES) and set(FUZZED) <= set(pk.list_kernels())


def test_handle_differentiability():
    """Which API carries gradients (the premise of the backward checks below): every
    handle and every ``ops`` operator."""
    x = torch.rand(2, 16, device=DEVICE, requires_grad=True)
    w = torch.ones(16, device=DEVICE, requires_grad=True)
    q = torch.rand(1, 1, 4, 16, device=DEVICE, requires_grad=True)
    calls = {
        "vector_add": (x, x), "softmax": (x,), "dropout": (x, 0.5, 1), "asin": (x,),
        "layer_norm": (x, w, w), "rms_norm": (x, w), "swiglu": (x, x), "geglu": (x,),
        "matmul": (x, x.t()),
        "grouped_matmul": ([x], [x.t()]),
        "flash_attn": (q, q, q),
        "rope": (q, q, *_rope_tables(4, 8)),
        "add_rms_norm": (x, x, w),
        "cross_entropy": (x, torch.tensor([1, -100], device=DEVICE)),
        "fused_linear_cross_entropy": (x, x, torch.tensor([1, -100], device=DEVICE)),
    }
    handle_grad = {name for name, args in calls.items()
                   if _requires_grad(pk.get_kernel(name)(*args))}
    assert handle_grad == set(calls)
    assert all(_requires_grad(getattr(ops, name)(*args)) for name, args in calls.items())


def _requires_grad(out) -> bool:
    return (out[0] if isinstance(out, (list, tuple)) else out).requires_grad


# --- vector_add -----------------------------------------------------------------------------

@st.composite
def vector_add_cases(draw):
    ndim = draw(st.integers(0, 3))
    return dict(shape=draw(shapes(ndim, 5000, 12000)), x=draw(layouts(ndim)),
                y=draw(layouts(ndim)), grad=draw(layouts(ndim)),
                api=draw(st.sampled_from(["handle", "ops"])), seed=draw(seeds))


@pytest.mark.parametrize("dtype", FLOATS)
@_fuzz("vector_add")
@given(case=vector_add_cases())
def test_vector_add(dtype, case):
    gen = _gen(case["seed"])
    x = make(case["shape"], dtype, case["x"], gen)
    y = make(case["shape"], dtype, case["y"], gen)
    ref = x.cpu().double() + y.cpu().double()
    before = snapshot(x, y)
    tol = tolerance(dtype, "elementwise")
    for variant in runnable_variants("vector_add", x, y):
        with forced("vector_add", variant):
            out = call("vector_add", case["api"], x, y)
        check_output(out, ref, dtype, tol, f"vector_add[{variant}]")
        assert_unchanged(before, (x, y), f"vector_add[{variant}]")
        # Backward (ops only): the identity for both operands.
        (xl, yl), _ = leaves(x, y)
        g = make(case["shape"], dtype, case["grad"], gen)
        with forced("vector_add", variant):
            dx, dy = torch.autograd.grad(ops.vector_add(xl, yl), (xl, yl), g)
        assert torch.equal(dx.cpu(), g.cpu()) and torch.equal(dy.cpu(), g.cpu()), "vector_add grads"


# --- softmax --------------------------------------------------------------------------------

@st.composite
def softmax_cases(draw):
    ndim = draw(st.integers(1, 3))
    dim = draw(st.integers(-ndim, ndim - 1))
    # Rows up to past the interpreter's 1024-wide block (two passes); few of them, as the
    # interpreter pays per program (one per row).
    n = draw(st.one_of(st.sampled_from([1, 1025, 0]), st.integers(0, 3000)))
    rows = list(draw(shapes(ndim - 1, 200, 200)))
    shape = tuple(rows[:dim % ndim] + [n] + rows[dim % ndim:])
    return dict(shape=shape, dim=dim, x=draw(layouts(ndim)), grad=draw(layouts(ndim)),
                scale=draw(st.sampled_from([1.0, 4.0, 30.0])),
                masked=draw(st.sampled_from(["none", "some", "row"])),
                api=draw(st.sampled_from(["handle", "ops"])), seed=draw(seeds))


def _softmax_inputs(case, dtype, gen):
    x = make(case["shape"], dtype, case["x"], gen, _normal(case["scale"]))
    if case["masked"] != "none" and x.numel():
        x = x.clone() if case["x"][0] == "expanded" else x  # writable
        hide = torch.rand(x.shape, generator=gen) < 0.4
        if case["masked"] == "row":
            # One row -inf but its first element; a whole row -inf (NaN, as torch) too.
            row = x.movedim(case["dim"], -1).reshape(-1, x.shape[case["dim"]])
            hide = hide.movedim(case["dim"], -1).reshape(row.shape)
            hide[0] = True
            hide[0, 0] = False
            if hide.shape[0] > 1:
                hide[-1] = True
            hide = hide.reshape(x.movedim(case["dim"], -1).shape).movedim(-1, case["dim"])
        x.masked_fill_(hide.to(DEVICE), float("-inf"))
    return x


@pytest.mark.parametrize("dtype", FLOATS)
@_fuzz("softmax")
@given(case=softmax_cases())
def test_softmax(dtype, case):
    gen = _gen(case["seed"])
    x = _softmax_inputs(case, dtype, gen)
    dim = case["dim"]
    ref = torch.softmax(x.cpu().double(), dim)
    before = snapshot(x)
    tol = tolerance(dtype, "reduction")
    for variant in runnable_variants("softmax", x, dim):
        with forced("softmax", variant):
            out = call("softmax", case["api"], x, dim)
        check_output(out, ref, dtype, tol, f"softmax[{variant}]", contiguous=False)
        assert_unchanged(before, (x,), f"softmax[{variant}]")
        # Backward (ops only): dx = y * (g - sum(g * y)). Its rounding error scales with
        # y * (|g| + sum |g| y), not with dx, which cancels where g is near the row mean.
        (xl,), (x64,) = leaves(x)
        g = make(x.shape, dtype, case["grad"], gen)
        with forced("softmax", variant):
            (dx,) = torch.autograd.grad(ops.softmax(xl, dim), (xl,), g)
        y64 = torch.softmax(x64, dim)
        (dx64,) = torch.autograd.grad(y64, (x64,), g.cpu().double())
        g64 = g.cpu().double().abs()
        magnitude = y64 * (g64 + (g64 * y64).nan_to_num(0.0).sum(dim, keepdim=True))
        check_output(dx, dx64, dtype, tol, f"softmax[{variant}] dx", contiguous=False,
                     magnitude=magnitude.detach() + dx64.abs())


# --- dropout --------------------------------------------------------------------------------

@st.composite
def dropout_cases(draw):
    ndim = draw(st.integers(0, 3))
    # 16-bit outputs overflow for x / (1 - p) past their range: p up to 0.999 there (and 1).
    p = draw(st.one_of(st.sampled_from([0.5, 0.0, 1.0]), st.floats(0.0, 0.999)))
    return dict(shape=draw(shapes(ndim, 6000, 12000)), x=draw(layouts(ndim)),
                grad=draw(layouts(ndim)), p=p, seed=draw(st.integers(0, 2**63 - 1)),
                specials=draw(st.booleans()), api=draw(st.sampled_from(["handle", "ops"])),
                data=draw(seeds))


def _away_from_zero(shape, gen):
    x = torch.randn(shape, generator=gen)
    return x + torch.where(x < 0, -0.1, 0.1)  # a zero output can only mean "dropped"


@pytest.mark.parametrize("dtype", FLOATS)
@_fuzz("dropout")
@given(case=dropout_cases())
def test_dropout(dtype, case):
    gen = _gen(case["data"])
    p, seed = case["p"], case["seed"]
    x = make(case["shape"], dtype, case["x"], gen, _away_from_zero)
    n = x.numel()
    before = snapshot(x)
    tol = tolerance(dtype, "elementwise")
    scaled = x.cpu().double() / (1.0 - p) if p < 1 else torch.zeros(x.shape, dtype=torch.float64)
    for variant in runnable_variants("dropout", x, p, seed):
        what = f"dropout[{variant}] p={p!r} seed={seed}"
        with forced("dropout", variant):
            out = call("dropout", case["api"], x, p, seed)
            again = call("dropout", case["api"], x, p, seed)
            # The mask depends on (seed, row-major index) only: not on values or strides.
            other_values = call("dropout", case["api"], -2 * x.contiguous(), p, seed)
            other_seed = call("dropout", case["api"], x, p, (seed + 1) % 2**63)
        assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous(), what
        assert n == 0 or out.data_ptr() != x.data_ptr(), f"{what}: returned its input"
        assert_unchanged(before, (x,), what)
        kept = (out != 0).cpu()
        assert torch.equal(again.cpu(), out.cpu()), f"{what}: same seed, other output"
        assert torch.equal((other_values != 0).cpu(), kept), f"{what}: mask depends on values/strides"
        if p == 0:
            assert torch.equal(out.cpu(), x.cpu()), f"{what}: p=0 is not the identity"
        elif p == 1:
            assert not kept.any(), f"{what}: p=1 kept elements"
        else:
            assert_close(out.cpu()[kept], scaled[kept], tol, f"{what}: kept values")
            if n >= 2000:
                sigma = math.sqrt(p * (1 - p) / n)
                rate = kept.double().mean().item()
                assert abs(rate - (1 - p)) <= 6 * sigma + 1 / n, f"{what}: keep rate {rate}"
            if n >= 64 and 0.1 <= p <= 0.9:
                assert not torch.equal((other_seed != 0).cpu(), kept), f"{what}: seed ignored"
        if case["specials"] and n:
            # Dropped inf and NaN give 0; kept ones stay inf (same sign) and NaN.
            xs = x.contiguous().clone()
            where = torch.randint(0, n, (max(1, n // 8),), generator=gen)
            special = torch.tensor([math.inf, -math.inf, math.nan])[torch.arange(where.numel()) % 3]
            xs.view(-1)[where.to(DEVICE)] = special.to(dtype).to(DEVICE)
            with forced("dropout", variant):
                outs = call("dropout", case["api"], xs, p, seed).cpu()
            keep = kept.reshape(-1)
            flat, xs_flat = outs.reshape(-1), xs.cpu().reshape(-1)
            assert (flat[~keep] == 0).all(), f"{what}: dropped inf/NaN did not give 0"
            inf = keep & xs_flat.isinf()
            assert torch.equal(flat[inf], xs_flat[inf]), f"{what}: kept inf"
            assert flat[keep & xs_flat.isnan()].isnan().all(), f"{what}: kept NaN"
        # Backward (handle or ops): the same mask and scale applied to the upstream gradient.
        (xl,), _ = leaves(x)
        g = make(x.shape, dtype, case["grad"], gen, _normal())
        with forced("dropout", variant):
            (dx,) = torch.autograd.grad(call("dropout", case["api"], xl, p, seed), (xl,), g)
        g64 = g.cpu().double()
        expect = torch.where(kept, g64 / (1.0 - p), torch.zeros_like(g64)) if p < 1 else 0 * g64
        check_output(dx, expect, dtype, tol, f"{what} dx", contiguous=False)
        assert (dx.cpu()[~kept] == 0).all(), f"{what}: gradient flows through dropped elements"


# --- asin -----------------------------------------------------------------------------------

ASIN_RANGES = [(-1.0, 1.0), (-1.25, 1.25), (0.45, 0.55), (0.99, 1.0), (-1e-3, 1e-3)]


@st.composite
def asin_cases(draw):
    ndim = draw(st.integers(0, 3))
    return dict(shape=draw(shapes(ndim, 6000, 12000)), x=draw(layouts(ndim)),
                grad=draw(layouts(ndim)), range=draw(st.sampled_from(ASIN_RANGES)),
                edges=draw(st.booleans()), api=draw(st.sampled_from(["handle", "ops"])),
                seed=draw(seeds))


@pytest.mark.parametrize("dtype", FLOATS)
@_fuzz("asin")
@given(case=asin_cases())
def test_asin(dtype, case):
    gen = _gen(case["seed"])
    x = make(case["shape"], dtype, case["x"], gen, _uniform(*case["range"]))
    if case["edges"] and x.numel():
        # The conformance suite's edge values (branch switch, ends of the domain, tiny,
        # subnormal, signed zero, inf, NaN) at random places.
        x = x.clone()
        where = torch.randint(0, x.numel(), (len(ASIN_EDGES),), generator=gen)
        x.view(-1)[where.to(DEVICE)] = torch.tensor(ASIN_EDGES).to(dtype).to(DEVICE)
    x64 = x.cpu().double()
    ref = torch.asin(x64)
    before = snapshot(x)
    tol = tolerance(dtype, "elementwise")
    for variant in runnable_variants("asin", x):
        with forced("asin", variant):
            out = call("asin", case["api"], x)
        check_output(out, ref, dtype, tol, f"asin[{variant}]")
        assert_unchanged(before, (x,), f"asin[{variant}]")
        # asin is odd and keeps the sign of zero and of tiny values.
        o = out.cpu()
        fine = ~o.isnan()
        assert torch.equal(o[fine].signbit(), x.cpu()[fine].signbit()), f"asin[{variant}] sign"
        # Backward (ops only): g / sqrt(1 - x^2), taken in fp32 as torch's own asin backward;
        # 1 - x*x loses about x^2 / (1 - x^2) ulp of 1 - x^2, so the relative tolerance grows by
        # 1 / (1 - x^2) (infinite at |x| = 1, where the gradient is inf: equal values match).
        (xl,), (xr,) = leaves(x)
        g = make(x.shape, dtype, case["grad"], gen)
        with forced("asin", variant):
            (dx,) = torch.autograd.grad(ops.asin(xl), (xl,), g)
        (dx64,) = torch.autograd.grad(torch.asin(xr), (xr,), g.cpu().double())
        check_output(dx, dx64, dtype, tol, f"asin[{variant}] dx", contiguous=False,
                     magnitude=dx64.abs() / (1 - x64 * x64).abs())


# --- layer_norm -----------------------------------------------------------------------------

@st.composite
def layer_norm_cases(draw):
    ndim = draw(st.integers(1, 3))
    # The last dim: up to past the interpreter's 1024-wide chunk, 1 and 0 included.
    n = draw(st.one_of(st.sampled_from([1, 37, 1025, 0]), st.integers(0, 2100)))
    lead = draw(shapes(ndim - 1, 400, 24000 // max(1, n)))
    # Which of (x, weight, bias) require grad: all of them first, then any nonempty subset.
    requires = draw(st.sampled_from([(True, True, True), (True, False, False), (False, True, False),
                                     (False, False, True), (True, True, False), (False, True, True),
                                     (True, False, True)]))
    return dict(shape=(*lead, n), x=draw(layouts(ndim)), w=draw(layouts(1)), b=draw(layouts(1)),
                grad=draw(layouts(ndim)), eps=draw(st.sampled_from([1e-5, 1e-3, 0.25])),
                offset=draw(st.sampled_from([0.0, 0.5, 30.0])), requires=requires,
                api=draw(st.sampled_from(["handle", "ops"])), seed=draw(seeds))


@pytest.mark.parametrize("dtype", FLOATS)
@_fuzz("layer_norm")
@given(case=layer_norm_cases())
def test_layer_norm(dtype, case):
    gen = _gen(case["seed"])
    n, eps = case["shape"][-1], case["eps"]
    x = make(case["shape"], dtype, case["x"], gen, _normal(2.0, case["offset"]))
    w = make((n,), dtype, case["w"], gen, _normal(0.5, 1.0))
    b = make((n,), dtype, case["b"], gen)
    x64, w64, b64 = x.cpu().double(), w.cpu().double(), b.cpu().double()
    ref = torch.nn.functional.layer_norm(x64, (n,), w64, b64, eps)
    # The output's rounding error scales with its terms, not with the (possibly cancelled)
    # result: x - mean is rounded at the size of x, so for rows with a large mean the error
    # is about eps_fp32 * |x| * rstd * |w| (torch's own fp32 layer_norm errs as much).
    magnitude = None
    if x.numel():
        rstd = (x64.var(-1, unbiased=False, keepdim=True) + eps).rsqrt()
        magnitude = (ref.abs() + (x64.abs() + x64.mean(-1, keepdim=True).abs()) * rstd * w64.abs()
                     + b64.abs())
    before = snapshot(x, w, b)
    tol = tolerance(dtype, "reduction")
    for variant in runnable_variants("layer_norm", x, w, b, eps):
        with forced("layer_norm", variant):
            out = call("layer_norm", case["api"], x, w, b, eps)
        check_output(out, ref, dtype, tol, f"layer_norm[{variant}]", magnitude=magnitude)
        assert_unchanged(before, (x, w, b), f"layer_norm[{variant}]")
        if not x.numel():
            continue
        # Backward (handle or ops) for the drawn subset of (x, weight, bias); tolerances as
        # the conformance suite's (dx: a difference of terms of size rstd * |dy * w|;
        # dweight, dbias: sums over every row).
        mine, ref64 = leaves(x, w, b)
        wanted = [i for i, r in enumerate(case["requires"]) if r]
        for i, r in enumerate(case["requires"]):
            mine[i].requires_grad_(r)
            ref64[i].requires_grad_(r)
        g = make(x.shape, dtype, case["grad"], gen)
        with forced("layer_norm", variant):
            y = call("layer_norm", case["api"], *mine, eps)
            grads = torch.autograd.grad(y, [mine[i] for i in wanted], g)
        refs = torch.autograd.grad(
            torch.nn.functional.layer_norm(ref64[0], (n,), ref64[1], ref64[2], eps),
            [ref64[i] for i in wanted], g.cpu().double())
        for i, got, expect in zip(wanted, grads, refs):
            name = ("dx", "dweight", "dbias")[i]
            t = _layer_norm_grad_tolerance(tol, name, expect, x, w, eps, g)
            check_output(got, expect, dtype, t, f"layer_norm[{variant}] {name}", contiguous=False)


def _layer_norm_grad_tolerance(tol, name, expect, x, w, eps, g) -> Tolerance:
    """The conformance suite's gradient tolerances (``tolerance_for``), and for dweight =
    sum over rows of dy * xhat, the rounding error of xhat itself: xhat = (x - mean) *
    rstd is computed from values of size |x|, so each term errs by about eps_fp32 * |dy| *
    (|x| + |mean|) * rstd, which for rows of (near) constant values (rstd up to
    1/sqrt(eps)) or with a large mean exceeds the suite's bound (torch's fp32 layer_norm
    errs as much there)."""
    table = layer_norm_suite.tolerance_for(tol, name, expect, Inputs((x, w, None), {"eps": eps}), [g])
    if name != "dweight":
        return table
    x64 = x.detach().cpu().double().reshape(-1, x.shape[-1])
    rstd = (x64.var(-1, unbiased=False, keepdim=True) + eps).rsqrt()
    terms = (x64.abs() + x64.mean(-1, keepdim=True).abs()) * rstd
    bound = (g.detach().cpu().double().reshape(x64.shape).abs() * terms).sum(0).max()
    return Tolerance(table.atol + tol.rtol * float(bound), tol.rtol)


# --- rms_norm -------------------------------------------------------------------------------

@st.composite
def rms_norm_cases(draw):
    ndim = draw(st.integers(1, 3))
    n = draw(st.one_of(st.sampled_from([1, 37, 1025, 0]), st.integers(0, 2100)))
    lead = draw(shapes(ndim - 1, 400, 24000 // max(1, n)))
    requires = draw(st.sampled_from([(True, True), (True, False), (False, True)]))
    return dict(shape=(*lead, n), x=draw(layouts(ndim)), w=draw(layouts(1)),
                grad=draw(layouts(ndim)), eps=draw(st.sampled_from([1e-6, 1e-3, 0.25])),
                offset=draw(st.sampled_from([0.0, 1.0])), requires=requires,
                api=draw(st.sampled_from(["handle", "ops"])), seed=draw(seeds))


def _rms_norm64(x, w, eps, offset):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * (w + offset)


@pytest.mark.parametrize("dtype", FLOATS)
@_fuzz("rms_norm")
@given(case=rms_norm_cases())
def test_rms_norm(dtype, case):
    gen = _gen(case["seed"])
    n, eps, offset = case["shape"][-1], case["eps"], case["offset"]
    x = make(case["shape"], dtype, case["x"], gen, _normal(2.0, 0.5))
    w = make((n,), dtype, case["w"], gen, _normal(0.5, 1.0 - offset))
    x64, w64 = x.cpu().double(), w.cpu().double()
    ref = _rms_norm64(x64, w64, eps, offset)
    before = snapshot(x, w)
    tol = tolerance(dtype, "reduction")
    for variant in runnable_variants("rms_norm", x, w, eps, offset):
        with forced("rms_norm", variant):
            out = call("rms_norm", case["api"], x, w, eps, offset)
        check_output(out, ref, dtype, tol, f"rms_norm[{variant}]")
        assert_unchanged(before, (x, w), f"rms_norm[{variant}]")
        if not x.numel():
            continue
        mine, ref64 = leaves(x, w)
        wanted = [i for i, r in enumerate(case["requires"]) if r]
        for i, r in enumerate(case["requires"]):
            mine[i].requires_grad_(r)
            ref64[i].requires_grad_(r)
        g = make(x.shape, dtype, case["grad"], gen)
        with forced("rms_norm", variant):
            y = call("rms_norm", case["api"], *mine, eps, offset)
            grads = torch.autograd.grad(y, [mine[i] for i in wanted], g)
        refs = torch.autograd.grad(_rms_norm64(ref64[0], ref64[1], eps, offset),
                                   [ref64[i] for i in wanted], g.cpu().double())
        inputs = Inputs((x, w), {"eps": eps, "offset": offset})
        for i, got, expect in zip(wanted, grads, refs):
            name = ("dx", "dweight")[i]
            t = rms_norm_suite.tolerance_for(tol, name, expect, inputs, [g])
            check_output(got, expect, dtype, t, f"rms_norm[{variant}] {name}", contiguous=False)


# --- swiglu, geglu -----------------------------------------------------------------------------

@st.composite
def glu_cases(draw):
    ndim = draw(st.integers(1, 3))
    i = draw(st.one_of(st.sampled_from([1, 37, 4097, 0]), st.integers(0, 5000)))
    lead = draw(shapes(ndim - 1, 300, 30000 // max(1, i)))
    return dict(shape=(*lead, i), fused=draw(st.booleans()), gate=draw(layouts(ndim)),
                up=draw(layouts(ndim)), grad=draw(layouts(ndim)),
                scale=draw(st.sampled_from([1.0, 4.0, 30.0])),
                api=draw(st.sampled_from(["handle", "ops"])), seed=draw(seeds))


def _glu64(name, gate, up):
    act = (torch.nn.functional.gelu(gate, approximate="tanh") if name == "geglu"
           else torch.nn.functional.silu(gate))
    return act * up


def _check_glu(name, dtype, case):
    gen = _gen(case["seed"])
    shape = case["shape"]
    if case["fused"]:
        gu = make((*shape[:-1], 2 * shape[-1]), dtype, case["gate"], gen, _normal(case["scale"]))
        args = (gu,)
        gate, up = gu[..., :shape[-1]], gu[..., shape[-1]:]
    else:
        gate = make(shape, dtype, case["gate"], gen, _normal(case["scale"]))
        up = make(shape, dtype, case["up"], gen)
        args = (gate, up)
    ref = _glu64(name, gate.cpu().double(), up.cpu().double())
    before = snapshot(*args)
    tol = tolerance(dtype, "elementwise")
    for variant in runnable_variants(name, *args):
        with forced(name, variant):
            out = call(name, case["api"], *args)
        check_output(out, ref, dtype, tol, f"{name}[{variant}]")
        assert_unchanged(before, args, f"{name}[{variant}]")
        if not out.numel():
            continue
        mine, ref64 = leaves(*args)
        g = make(out.shape, dtype, case["grad"], gen)
        with forced(name, variant):
            grads = torch.autograd.grad(call(name, case["api"], *mine), mine, g)
        r_gate, r_up = (ref64[0][..., :shape[-1]], ref64[0][..., shape[-1]:]) if case["fused"] else ref64
        refs = torch.autograd.grad(_glu64(name, r_gate, r_up), ref64, g.cpu().double())
        inputs = Inputs((gate, up))
        if case["fused"]:  # one (..., 2I) gradient: dgate's bound covers both halves
            t = _glu_suite.tolerance_for(tol, "dgate", refs[0], inputs, [g])
            check_output(grads[0], refs[0], dtype, t, f"{name}[{variant}] dgate_up", contiguous=False)
            continue
        for arg, got, expect in zip(("dgate", "dup"), grads, refs):
            t = _glu_suite.tolerance_for(tol, arg, expect, inputs, [g])
            check_output(got, expect, dtype, t, f"{name}[{variant}] {arg}", contiguous=False)


@pytest.mark.parametrize("dtype", FLOATS)
@_fuzz("swiglu")
@given(case=glu_cases())
def test_swiglu(dtype, case):
    _check_glu("swiglu", dtype, case)


@pytest.mark.parametrize("dtype", FLOATS)
@_fuzz("geglu")
@given(case=glu_cases())
def test_geglu(dtype, case):
    _check_glu("geglu", dtype, case)


# --- rope -----------------------------------------------------------------------------------

def _rope_tables(max_pos: int, rotary_dim: int):
    from portable_kernels.kernels.rope import tables

    return tables(max_pos, rotary_dim, device=DEVICE)


@st.composite
def rope_cases(draw):
    packed = draw(st.booleans())
    d = draw(st.one_of(st.sampled_from([2, 7, 16, 64, 130]), st.integers(2, 160)))
    h = draw(st.integers(1, 5))
    lead = draw(shapes(1 if packed else 2, 40, max(1, 3000 // (h * d))))
    ndim = len(lead) + 2
    return dict(lead=lead, h=h, hk=draw(st.integers(1, h)), d=d,
                half=draw(st.one_of(st.just(d // 2), st.integers(1, d // 2))),
                extra=draw(st.integers(0, 20)), interleaved=draw(st.booleans()),
                positions=draw(st.sampled_from([None, torch.int32, torch.int64])),
                q=draw(layouts(ndim)), k=draw(layouts(ndim)), tables=draw(layouts(2, expand=False)),
                grad_q=draw(layouts(ndim)), grad_k=draw(layouts(ndim)),
                api=draw(st.sampled_from(["handle", "ops"])), seed=draw(seeds))


@pytest.mark.parametrize("dtype", FLOATS)
@_fuzz("rope")
@given(case=rope_cases())
def test_rope(dtype, case):
    """Any tables (the kernel rotates by what it is given), partial rotary_dim, GQA, packed
    or batched, default or given positions, any layouts."""
    from portable_kernels.kernels.rope import reference

    gen = _gen(case["seed"])
    lead, d, half, interleaved = case["lead"], case["d"], case["half"], case["interleaved"]
    q = make((*lead, case["h"], d), dtype, case["q"], gen)
    k = make((*lead, case["hk"], d), dtype, case["k"], gen)
    max_pos = max(1, lead[-1] + case["extra"])
    cos = make((max_pos, half), torch.float32, case["tables"], gen)
    sin = make((max_pos, half), torch.float32, case["tables"], gen)
    positions = None
    if case["positions"] is not None:
        positions = torch.randint(0, max_pos, lead, generator=gen, dtype=case["positions"]).to(DEVICE)
    refs = reference(q.cpu(), k.cpu(), cos.cpu(), sin.cpu(),
                     None if positions is None else positions.cpu(), interleaved)
    before = snapshot(q, k, cos, sin)
    tol = tolerance(dtype, "elementwise")
    inputs = Inputs((q, k, cos, sin))
    for variant in runnable_variants("rope", q, k, cos, sin, positions, interleaved):
        with forced("rope", variant):
            outs = call("rope", case["api"], q, k, cos, sin, positions, interleaved)
        for i, (out, ref) in enumerate(zip(outs, refs)):
            t = rope_suite.tolerance_for(tol, f"out[{i}]", ref, inputs, None)
            check_output(out, ref, dtype, t, f"rope[{variant}] out[{i}]")
        assert_unchanged(before, (q, k, cos, sin), f"rope[{variant}]")
        if not q.numel():
            continue
        mine, ref64 = leaves(q, k)
        grads = [make(o.shape, dtype, case[g], gen) for o, g in zip(outs, ("grad_q", "grad_k"))]
        with forced("rope", variant):
            got = torch.autograd.grad(call("rope", case["api"], *mine, cos, sin, positions,
                                           interleaved), mine, grads)
        want = torch.autograd.grad(
            reference(*ref64, cos.cpu(), sin.cpu(), None if positions is None else positions.cpu(),
                      interleaved), ref64, [g.cpu().double() for g in grads])
        for name, g, r in zip(("dq", "dk"), got, want):
            t = rope_suite.tolerance_for(tol, name, r, inputs, grads)
            check_output(g, r, dtype, t, f"rope[{variant}] {name}", contiguous=False)


# --- add_rms_norm ---------------------------------------------------------------------------

@st.composite
def add_rms_norm_cases(draw):
    ndim = draw(st.integers(1, 3))
    n = draw(st.one_of(st.sampled_from([1, 37, 1025, 0]), st.integers(0, 2100)))
    lead = draw(shapes(ndim - 1, 400, 24000 // max(1, n)))
    requires = draw(st.sampled_from([(True, True, True), (True, False, False),
                                     (False, True, True), (False, False, True)]))
    return dict(shape=(*lead, n), x=draw(layouts(ndim)), r=draw(layouts(ndim)), w=draw(layouts(1)),
                grad=draw(layouts(ndim)), grad_res=draw(layouts(ndim)),
                eps=draw(st.sampled_from([1e-6, 1e-3, 0.25])),
                offset=draw(st.sampled_from([0.0, 1.0])), requires=requires,
                api=draw(st.sampled_from(["handle", "ops"])), seed=draw(seeds))


@pytest.mark.parametrize("dtype", FLOATS)
@_fuzz("add_rms_norm")
@given(case=add_rms_norm_cases())
def test_add_rms_norm(dtype, case):
    gen = _gen(case["seed"])
    n, eps, offset = case["shape"][-1], case["eps"], case["offset"]
    x = make(case["shape"], dtype, case["x"], gen, _normal(2.0, 0.5))
    r = make(case["shape"], dtype, case["r"], gen, _normal(2.0))
    w = make((n,), dtype, case["w"], gen, _normal(0.5, 1.0 - offset))
    summed64 = (x.cpu().double() + r.cpu().double()).to(dtype).double()
    refs = (_rms_norm64(summed64, w.cpu().double(), eps, offset), summed64)
    before = snapshot(x, r, w)
    tol = tolerance(dtype, "reduction")
    for variant in runnable_variants("add_rms_norm", x, r, w, eps, offset):
        with forced("add_rms_norm", variant):
            outs = call("add_rms_norm", case["api"], x, r, w, eps, offset)
        check_output(outs[0], refs[0], dtype, tol, f"add_rms_norm[{variant}] out")
        check_output(outs[1], refs[1], dtype, tolerance(dtype, "elementwise"),
                     f"add_rms_norm[{variant}] new_residual")
        assert_unchanged(before, (x, r, w), f"add_rms_norm[{variant}]")
        if not x.numel():
            continue
        mine, ref64 = leaves(x, r, w)
        wanted = [i for i, req in enumerate(case["requires"]) if req]
        for i, req in enumerate(case["requires"]):
            mine[i].requires_grad_(req)
            ref64[i].requires_grad_(req)
        grads = [make(x.shape, dtype, case[g], gen) for g in ("grad", "grad_res")]
        with forced("add_rms_norm", variant):
            got = torch.autograd.grad(call("add_rms_norm", case["api"], *mine, eps, offset),
                                      [mine[i] for i in wanted], grads)
        s64 = ref64[0] + ref64[1]
        # With only the weight differentiable, the new residual has no gradient to pass on.
        outs64 = (_rms_norm64(s64, ref64[2], eps, offset), s64)
        pairs = [(o, g.cpu().double()) for o, g in zip(outs64, grads) if o.requires_grad]
        want = torch.autograd.grad([o for o, _ in pairs], [ref64[i] for i in wanted],
                                   [g for _, g in pairs])
        inputs = Inputs((x, r, w), {"eps": eps, "offset": offset})
        for i, g, expect in zip(wanted, got, want):
            name = ("dx", "dresidual", "dweight")[i]
            t = add_rms_norm_suite.tolerance_for(tol, name, expect, inputs, grads)
            check_output(g, expect, dtype, t, f"add_rms_norm[{variant}] {name}", contiguous=False)


# --- matmul ---------------------------------------------------------------------------------

#: GEMM sizes: tails of the 64-wide interpreter tiles, and multiples of 16 that descriptor
#: (TMA) variants take.
GEMM_SIZES = (1, 0, 16, 48, 64, 65, 72, 33, 128, 130)


def gemm_size(hi: int) -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from([s for s in GEMM_SIZES if s <= hi]), st.integers(0, hi))


#: Layouts a tensor descriptor can describe (a unit stride in one dim, 16-byte aligned
#: base and other stride, for sizes that are multiples of 16).
DESCRIBABLE_2D = st.sampled_from([("contiguous", None), ("transposed", None), ("step", 0)])
ALIGNED_SIZES = st.sampled_from([16, 32, 48, 64, 80, 128])


@st.composite
def matmul_cases(draw):
    # Aligned examples let the descriptor (TMA) variant take the call; the others exercise
    # its predicate and the pointer path.
    aligned = draw(st.booleans())
    size = ALIGNED_SIZES if aligned else gemm_size(200)
    layout = DESCRIBABLE_2D if aligned else layouts(2)
    return dict(m=draw(gemm_size(200)), n=draw(size), k=draw(size),
                a=draw(layout), b=draw(layout), grad=draw(layout),
                requires=draw(st.sampled_from([(True, True), (True, False), (False, True)])),
                api=draw(st.sampled_from(["handle", "ops"])), seed=draw(seeds))


def _gemm_backward(name, variant, fn, operands, wrt, grads, needs):
    """Gradients of ``fn(*operands)`` with respect to ``wrt`` under ``variant``. The
    backward's products are calls of the family itself (on transposed views, ``needs``); a
    forced variant whose predicate rejects one of them raises, as forcing promises, so such
    backwards run on dispatch's own choice."""
    take = variant if all(accepts(name, variant, *p) for p in needs) else None
    with forced(name, take):
        return torch.autograd.grad(fn(*operands), wrt, grads)


@pytest.mark.parametrize("dtype", GEMM_DTYPES)
@_fuzz("matmul")
@given(case=matmul_cases())
def test_matmul(dtype, case):
    gen = _gen(case["seed"])
    m, n, k = case["m"], case["n"], case["k"]
    a = make((m, k), dtype, case["a"], gen)
    b = make((k, n), dtype, case["b"], gen)
    out_dtype = gemm_out_dtype(dtype)
    ref = a.cpu().double() @ b.cpu().double()
    before = snapshot(a, b)
    tol = tolerance(dtype, "dot")
    for variant in runnable_variants("matmul", a, b):
        with forced("matmul", variant):
            out = call("matmul", case["api"], a, b)
        check_output(out, ref, out_dtype, tol, f"matmul[{variant}] {m}x{n}x{k}")
        assert_unchanged(before, (a, b), f"matmul[{variant}]")
        if dtype in FP8:
            continue  # no gradient for fp8 operands (tests/test_matmul.py checks the error)
        # Backward (ops only): da = g @ b.T, db = a.T @ g, by our matmul.
        (al, bl), (a64, b64) = leaves(a, b)
        al.requires_grad_(case["requires"][0])
        bl.requires_grad_(case["requires"][1])
        g = make((m, n), dtype, case["grad"], gen)
        needs = ([(g, b.t())] if case["requires"][0] else []) + (
            [(a.t(), g)] if case["requires"][1] else [])
        wrt = [t for t in (al, bl) if t.requires_grad]
        grads = _gemm_backward("matmul", variant, ops.matmul, (al, bl), wrt, g, needs)
        refs = torch.autograd.grad(a64 @ b64, (a64, b64), g.cpu().double())
        for got, expect, name in zip(grads, [r for r, q in zip(refs, case["requires"]) if q],
                                     [nm for nm, q in zip("ab", case["requires"]) if q]):
            check_output(got, expect, dtype, tol, f"matmul[{variant}] d{name}", contiguous=False)


# --- grouped_matmul -------------------------------------------------------------------------

@st.composite
def grouped_matmul_cases(draw):
    groups = draw(st.integers(1, 4))
    # Aligned examples (N, K multiples of 16, one b layout for all groups, as w.t() weights
    # are) let the descriptor variant take the call; the others exercise its predicate.
    aligned = draw(st.booleans())
    size = ALIGNED_SIZES if aligned else gemm_size(130)
    dims = [(draw(gemm_size(130)), draw(size), draw(size)) for _ in range(groups)]
    shared_b = draw(DESCRIBABLE_2D) if aligned else None
    row_major = st.sampled_from([("contiguous", None), ("step", 0)])
    a_layout = row_major if aligned else layouts(2)
    return dict(dims=dims, a=[draw(a_layout) for _ in dims],
                b=[shared_b or draw(layouts(2)) for _ in dims],
                grad=[draw(row_major if aligned else layouts(2)) for _ in dims],
                requires=draw(st.sampled_from([(True, True), (True, False), (False, True)])),
                api=draw(st.sampled_from(["handle", "ops"])), seed=draw(seeds))


@pytest.mark.parametrize("dtype", GEMM_DTYPES)
@_fuzz("grouped_matmul")
@given(case=grouped_matmul_cases())
def test_grouped_matmul(dtype, case):
    gen = _gen(case["seed"])
    list_a = [make((m, k), dtype, lay, gen) for (m, n, k), lay in zip(case["dims"], case["a"])]
    list_b = [make((k, n), dtype, lay, gen) for (m, n, k), lay in zip(case["dims"], case["b"])]
    out_dtype = gemm_out_dtype(dtype)
    refs = [a.cpu().double() @ b.cpu().double() for a, b in zip(list_a, list_b)]
    before = snapshot(*list_a, *list_b)
    tol = tolerance(dtype, "dot")
    for variant in runnable_variants("grouped_matmul", list_a, list_b):
        with forced("grouped_matmul", variant):
            outs = call("grouped_matmul", case["api"], list_a, list_b)
        assert isinstance(outs, list) and len(outs) == len(list_a), f"grouped_matmul[{variant}]"
        for gi, (out, ref) in enumerate(zip(outs, refs)):
            check_output(out, ref, out_dtype, tol, f"grouped_matmul[{variant}] group {gi} "
                         f"{'x'.join(map(str, case['dims'][gi]))}")
        assert_unchanged(before, (*list_a, *list_b), f"grouped_matmul[{variant}]")
        if dtype in FP8:
            continue
        # Backward (ops only): two grouped GEMMs on transposed views (da = g @ b.T and
        # db = a.T @ g), for the lists the example differentiates.
        need_a, need_b = case["requires"]
        la, la64 = leaves(*list_a)
        lb, lb64 = leaves(*list_b)
        for t in la:
            t.requires_grad_(need_a)
        for t in lb:
            t.requires_grad_(need_b)
        grads = [make(ref.shape, dtype, lay, gen) for ref, lay in zip(refs, case["grad"])]
        needs = ([(grads, [b.t() for b in list_b])] if need_a else []) + (
            [([a.t() for a in list_a], grads)] if need_b else [])
        wrt = (la if need_a else []) + (lb if need_b else [])
        got = _gemm_backward("grouped_matmul", variant, ops.grouped_matmul, (la, lb), wrt, grads,
                             needs)
        expect = torch.autograd.grad([a @ b for a, b in zip(la64, lb64)],
                                     (la64 if need_a else []) + (lb64 if need_b else []),
                                     [g.cpu().double() for g in grads])
        names = ([f"da[{i}]" for i in range(len(la))] if need_a else []) + (
            [f"db[{i}]" for i in range(len(lb))] if need_b else [])
        for name, dg, de in zip(names, got, expect):
            check_output(dg, de, dtype, tol, f"grouped_matmul[{variant}] {name}", contiguous=False)


# --- flash_attn -----------------------------------------------------------------------------

#: Head dims: the descriptor variants' (64, 128), padded ones, the largest, and any other.
HEAD_DIMS = (64, 128, 16, 24, 80, 96, 256, 1)


@st.composite
def flash_attn_cases(draw):
    b = draw(st.integers(1, 2))
    h_kv = draw(st.integers(1, 2))
    group = draw(st.integers(1, max(1, 4 // (b * h_kv))))  # H = H_kv * group, B * H <= 4
    seq = st.one_of(st.sampled_from([1, 64, 65, 0, 100]), st.integers(0, 130))
    # Describable examples (head dims and layouts a tensor descriptor takes: D innermost,
    # 16-byte aligned) let the descriptor (TMA) variants take the call; the others exercise
    # their predicate and the pointer path.
    describable = draw(st.booleans())
    if describable:
        d = draw(st.sampled_from([64, 128]))
        layout = st.sampled_from([("contiguous", None), ("permuted", (0, 2, 1, 3)), ("step", 0),
                                  ("step", 1), ("step", 2), ("expanded", 0), ("expanded", 1)])
    else:
        d = draw(st.one_of(st.sampled_from(HEAD_DIMS), st.integers(1, 256)))
        layout = layouts(4)
    return dict(b=b, h=h_kv * group, h_kv=h_kv, n_q=draw(seq), n_k=draw(seq), d=d,
                causal=draw(st.booleans()),
                sm_scale=draw(st.one_of(st.none(), st.sampled_from([0.0, -0.3]),
                                        st.floats(-1.0, 1.0))),
                q=draw(layout), k=draw(layout), v=draw(layout), grad=draw(layouts(4)),
                api=draw(st.sampled_from(["handle", "ops"])), seed=draw(seeds))


@pytest.mark.parametrize("dtype", FLOATS)
@_fuzz("flash_attn")
@given(case=flash_attn_cases())
def test_flash_attn(dtype, case):
    gen = _gen(case["seed"])
    b, h, h_kv, n_q, n_k, d = (case[k] for k in ("b", "h", "h_kv", "n_q", "n_k", "d"))
    q = make((b, h, n_q, d), dtype, case["q"], gen)
    k = make((b, h_kv, n_k, d), dtype, case["k"], gen)
    v = make((b, h_kv, n_k, d), dtype, case["v"], gen)
    kwargs = dict(causal=case["causal"], sm_scale=case["sm_scale"])
    (ql, kl, vl), (q64, k64, v64) = leaves(q, k, v)
    ref = flash_attn_reference(q64, k64, v64, **kwargs)
    g = make(ref.shape, dtype, case["grad"], gen)
    refs = torch.autograd.grad(ref, (q64, k64, v64), g.cpu().double())
    before = snapshot(q, k, v)
    tol = tolerance(dtype, "attention")
    inputs = Inputs((q, k, v), kwargs)
    for variant in runnable_variants("flash_attn", q, k, v, **kwargs):
        what = f"flash_attn[{variant}]"
        with forced("flash_attn", variant):
            out = call("flash_attn", case["api"], q, k, v, **kwargs)
        check_output(out, ref, dtype, tol, what, contiguous=False)
        # Laid out as q where q is dense with a unit D stride, else contiguous (output_like).
        layout = torch.empty_like(q) if q.stride(-1) == 1 else torch.empty(q.shape)
        assert out.stride() == layout.stride(), f"{what}: strides {out.stride()}, q's {q.stride()}"
        assert_unchanged(before, (q, k, v), what)
        # Backward (handle or ops); gradients are sums over a sequence: the conformance
        # suite's tolerance, the table's atol relative to their scale.
        with forced("flash_attn", variant):
            grads = torch.autograd.grad(call("flash_attn", case["api"], ql, kl, vl, **kwargs),
                                        (ql, kl, vl), g)
        for name, got, expect in zip("qkv", grads, refs):
            t = flash_attn_suite.tolerance_for(tol, f"d{name}", expect, inputs, [g]) \
                if expect.numel() else tol
            check_output(got, expect, dtype, t, f"{what} d{name}", contiguous=False)


# --- flash_attn_varlen ----------------------------------------------------------------------

@st.composite
def flash_attn_varlen_cases(draw):
    """A packed batch of 1-3 sequences (empty and one-token ones among them), GQA, and
    FlashAttention's options drawn independently."""
    n = st.one_of(st.sampled_from([0, 1, 64, 65]), st.integers(0, 90))
    batch = draw(st.integers(1, 3))
    h_kv = draw(st.integers(1, 2))
    return dict(lengths_q=[draw(n) for _ in range(batch)], lengths_k=[draw(n) for _ in range(batch)],
                h=h_kv * draw(st.integers(1, 2)), h_kv=h_kv,
                d=draw(st.one_of(st.sampled_from([64, 16]), st.integers(1, 128))),
                causal=draw(st.booleans()),
                window_size=draw(st.sampled_from([(-1, -1), (8, 0), (0, 5), (33, -1)])),
                softcap=draw(st.sampled_from([0.0, 0.0, 2.5])), alibi=draw(st.booleans()),
                sinks=draw(st.booleans()), api=draw(st.sampled_from(["handle", "ops"])),
                seed=draw(seeds))


@pytest.mark.parametrize("dtype", FLOATS)
@_fuzz("flash_attn_varlen")
@given(case=flash_attn_varlen_cases())
def test_flash_attn_varlen(dtype, case):
    from portable_kernels.kernels import flash_attn_varlen
    gen = _gen(case["seed"])
    lq, lk, h, h_kv, d = (case[k] for k in ("lengths_q", "lengths_k", "h", "h_kv", "d"))
    q = make((sum(lq), h, d), dtype, ("contiguous", None), gen)
    k = make((sum(lk), h_kv, d), dtype, ("contiguous", None), gen)
    v = make((sum(lk), h_kv, d), dtype, ("contiguous", None), gen)
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32,
                               device=DEVICE) for n in (lq, lk))
    kwargs = dict(causal=case["causal"], window_size=case["window_size"],
                  softcap=case["softcap"],
                  alibi_slopes=torch.rand(h, generator=gen).to(DEVICE) if case["alibi"] else None,
                  sinks=torch.randn(h, generator=gen).to(DEVICE) if case["sinks"] else None)
    args = (cu_q, cu_k, max(lq), max(lk))
    (ql, kl, vl), (q64, k64, v64) = leaves(q, k, v)
    ref = flash_attn_varlen.reference(q64, k64, v64, *args, **kwargs)
    g = make(ref.shape, dtype, ("contiguous", None), gen)
    refs = torch.autograd.grad(ref, (q64, k64, v64), g.cpu().double())
    tol = tolerance(dtype, "attention")
    for variant in runnable_variants("flash_attn_varlen", q, k, v, *args, **kwargs):
        what = f"flash_attn_varlen[{variant}]"
        with forced("flash_attn_varlen", variant):
            out = call("flash_attn_varlen", case["api"], ql, kl, vl, *args, **kwargs)
            check_output(out, ref, dtype, tol, what)
            grads = torch.autograd.grad(out, (ql, kl, vl), g)
        for name, got, expect in zip("qkv", grads, refs):
            scale = max(1.0, float(expect.abs().max())) if expect.numel() else 1.0
            check_output(got, expect, dtype, Tolerance(tol.atol * scale, tol.rtol),
                         f"{what} d{name}", contiguous=False)


# --- cross_entropy, fused_linear_cross_entropy ----------------------------------------------

@st.composite
def loss_options(draw):
    """cross_entropy's options: each off or at a few values, and a reduction."""
    return dict(ignore_index=draw(st.sampled_from([-100, 0])),
                label_smoothing=draw(st.sampled_from([0.0, 0.1, 1.0])),
                z_loss=draw(st.sampled_from([0.0, 1e-3])),
                softcap=draw(st.sampled_from([None, 5.0, 30.0])),
                reduction=draw(st.sampled_from(["mean", "sum", "none"])))


def make_target(rows: int, n_classes: int, ignored: float, ignore_index: int, dtype, gen):
    target = torch.randint(n_classes, (rows,), generator=gen)
    target[torch.rand(rows, generator=gen) < ignored] = ignore_index
    return target.to(DEVICE, dtype)


@st.composite
def cross_entropy_cases(draw):
    n_classes = draw(st.one_of(st.sampled_from([1, 33, 1025, 2500]), st.integers(1, 3000)))
    rows = draw(shapes(1, 40, 40000 // n_classes))[0]
    options = draw(loss_options())
    # Logits beyond +-50 only under a cap: the fp32 exp(z - lse) of the gradient loses
    # |lse| * 2**-24 of relative precision, more than the table allows past that.
    scale = draw(st.sampled_from([1.0, 4.0, 12.0] + ([100.0] if options["softcap"] else [])))
    return dict(rows=rows, n_classes=n_classes, x=draw(layouts(2)), options=options,
                scale=scale, ignored=draw(st.sampled_from([0.0, 0.3, 1.0])),
                target=draw(st.sampled_from([torch.int64, torch.int32])),
                api=draw(st.sampled_from(["handle", "ops"])), seed=draw(seeds))


@pytest.mark.parametrize("dtype", FLOATS)
@_fuzz("cross_entropy")
@given(case=cross_entropy_cases())
def test_cross_entropy(dtype, case):
    gen = _gen(case["seed"])
    options = case["options"]
    x = make((case["rows"], case["n_classes"]), dtype, case["x"], gen, _normal(case["scale"]))
    target = make_target(case["rows"], case["n_classes"], case["ignored"], options["ignore_index"],
                         case["target"], gen)
    x64 = x.detach().cpu().double().requires_grad_()
    ref = cross_entropy_reference(x64, target.cpu(), **options)
    before = snapshot(x, target)
    tol = tolerance(dtype, "reduction")
    for variant in runnable_variants("cross_entropy", x, target, **options):
        with forced("cross_entropy", variant):
            out = call("cross_entropy", case["api"], x, target, **options)
        check_output(out, ref, torch.float32, tol, f"cross_entropy[{variant}]")
        assert_unchanged(before, (x, target), f"cross_entropy[{variant}]")
        if not x.numel():
            continue
        (mine,), _ = leaves(x)
        g = make(ref.shape, torch.float32, ("contiguous", None), gen)
        with forced("cross_entropy", variant):
            y = call("cross_entropy", case["api"], mine, target, **options)
            (got,) = torch.autograd.grad(y, mine, g)
        (expect,) = torch.autograd.grad(ref, x64, g.cpu().double(), retain_graph=True)
        check_output(got, expect, dtype, tol, f"cross_entropy[{variant}] dlogits")


@st.composite
def flce_cases(draw):
    return dict(rows=draw(sizes(24)), width=draw(st.sampled_from([1, 8, 33, 64])),
                n_classes=draw(st.sampled_from([1, 7, 100, 300])), bias=draw(st.booleans()),
                hidden=draw(layouts(2)), weight=draw(layouts(2)), options=draw(loss_options()),
                ignored=draw(st.sampled_from([0.0, 0.3, 1.0])),
                requires=draw(st.sampled_from([(True, True, True), (True, False, False),
                                               (False, True, True)])),
                api=draw(st.sampled_from(["handle", "ops"])), seed=draw(seeds))


@pytest.mark.parametrize("dtype", FLOATS)
@_fuzz("fused_linear_cross_entropy")
@given(case=flce_cases())
def test_fused_linear_cross_entropy(dtype, case):
    gen = _gen(case["seed"])
    rows, width, n_classes, options = case["rows"], case["width"], case["n_classes"], case["options"]
    hidden = make((rows, width), dtype, case["hidden"], gen)
    weight = make((n_classes, width), dtype, case["weight"], gen, _normal(2.0 / width ** 0.5))
    bias = make((n_classes,), dtype, ("contiguous", None), gen, _normal(0.5)) if case["bias"] else None
    target = make_target(rows, n_classes, case["ignored"], options["ignore_index"], torch.int64, gen)
    tensors = [t for t in (hidden, weight, bias) if t is not None]
    args64 = [t.detach().cpu().double() for t in tensors]
    ref = flce_reference(args64[0], args64[1], target.cpu(), args64[2] if bias is not None else None,
                         **options)
    before = snapshot(*tensors)
    tol = tolerance(dtype, "dot")
    name = "fused_linear_cross_entropy"
    for variant in runnable_variants(name, hidden, weight, target, bias, **options):
        with forced(name, variant):
            out = call(name, case["api"], hidden, weight, target, bias, **options)
        check_output(out, ref, torch.float32, tol, f"{name}[{variant}]")
        assert_unchanged(before, tensors, f"{name}[{variant}]")
        if not rows:
            continue
        mine, ref64 = leaves(*tensors)
        wanted = [i for i, r in enumerate(case["requires"][:len(tensors)]) if r]
        for i in range(len(tensors)):
            mine[i].requires_grad_(i in wanted)
            ref64[i].requires_grad_(i in wanted)
        g = make(ref.shape, torch.float32, ("contiguous", None), gen)
        with forced(name, variant):
            y = call(name, case["api"], mine[0], mine[1], target, mine[2] if bias is not None else None,
                     **options)
            grads = torch.autograd.grad(y, [mine[i] for i in wanted], g)
        y64 = flce_reference(ref64[0], ref64[1], target.cpu(), ref64[2] if bias is not None else None,
                             **options)
        refs = torch.autograd.grad(y64, [ref64[i] for i in wanted], g.cpu().double())
        for i, got, expect in zip(wanted, grads, refs):
            what = f"{name}[{variant}] d{('hidden', 'weight', 'bias')[i]}"
            check_output(got, expect, dtype, tol, what, contiguous=False)


# --- kv_cache_write, flash_attn_with_kvcache ------------------------------------------------

@st.composite
def kv_cache_write_cases(draw):
    paged = draw(st.booleans())
    size = 16 * draw(st.integers(1, 2)) if paged else draw(st.integers(1, 40))
    slots = (draw(st.integers(1, 4)) if paged else draw(st.integers(1, 3))) * size
    t = draw(st.integers(0, min(slots, 20)))
    return dict(paged=paged, size=size, slots=slots, t=t, h_kv=draw(st.integers(1, 3)),
                d=draw(st.one_of(st.sampled_from([64, 16]), st.integers(1, 96))),
                skip=draw(st.booleans()), api=draw(st.sampled_from(["handle", "ops"])),
                seed=draw(seeds))


@pytest.mark.parametrize("dtype", FLOATS)
@_fuzz("kv_cache_write")
@given(case=kv_cache_write_cases())
def test_kv_cache_write(dtype, case):
    """Tokens to distinct random slots (some -1: skipped) of a contiguous (B, N, H_kv, D)
    or paged (blocks, block_size, H_kv, D) cache; every other slot left as it was."""
    from portable_kernels.kernels import kv_cache_write
    gen = _gen(case["seed"])
    t, h_kv, d, size, slots = (case[k] for k in ("t", "h_kv", "d", "size", "slots"))
    k, v = (make((t, h_kv, d), dtype, ("contiguous", None), gen) for _ in range(2))
    caches = [make((slots // size, size, h_kv, d), dtype, ("contiguous", None), gen)
              for _ in range(2)]
    mapping = torch.randperm(slots, generator=gen)[:t]
    if case["skip"] and t:
        mapping[torch.rand(t, generator=gen) < 0.3] = -1
    mapping = mapping.to(DEVICE)
    expect = [c.clone() for c in caches]
    kv_cache_write.reference(k, v, *expect, mapping)
    call("kv_cache_write", case["api"], k, v, *caches, mapping)
    for name, got, want in zip(("k_cache", "v_cache"), caches, expect):
        assert torch.equal(got, want), f"kv_cache_write {name}"


@st.composite
def flash_attn_with_kvcache_cases(draw):
    paged = draw(st.booleans())
    page = 16 * draw(st.integers(1, 2))
    blocks = draw(st.integers(1, 4))
    capacity = blocks * page if paged else draw(st.integers(1, 70))
    n_q = draw(st.integers(1, 4))
    new = draw(st.booleans()) and capacity >= n_q
    b = draw(st.integers(1, 3))
    room = capacity - (n_q if new else 0)
    h_kv = draw(st.integers(1, 2))
    return dict(paged=paged, page=page, blocks=blocks, capacity=capacity, n_q=n_q, new=new, b=b,
                lengths=[draw(st.integers(0, room)) for _ in range(b)], h_kv=h_kv,
                h=h_kv * draw(st.sampled_from([1, 2, 4])),
                d=draw(st.one_of(st.sampled_from([64, 128]), st.integers(8, 96))),
                causal=draw(st.booleans()),
                window_size=draw(st.sampled_from([(-1, -1), (6, 0), (20, -1)])),
                softcap=draw(st.sampled_from([0.0, 0.0, 4.0])), alibi=draw(st.booleans()),
                sinks=draw(st.booleans()), num_splits=draw(st.sampled_from([0, 1, 3])),
                api=draw(st.sampled_from(["handle", "ops"])), seed=draw(seeds))


@pytest.mark.parametrize("dtype", FLOATS)
@_fuzz("flash_attn_with_kvcache")
@given(case=flash_attn_with_kvcache_cases())
def test_flash_attn_with_kvcache(dtype, case):
    """Decode over a contiguous or paged cache (NaN in every slot past a sequence's
    length, pages in random order), new tokens appended or not, options drawn
    independently; every variant against the float64 reference."""
    from portable_kernels.kernels import flash_attn_with_kvcache as family
    gen = _gen(case["seed"])
    b, n_q, h, h_kv, d = (case[k] for k in ("b", "n_q", "h", "h_kv", "d"))
    q = make((b, n_q, h, d), dtype, ("contiguous", None), gen)
    if case["paged"]:
        shape = (b * case["blocks"], case["page"], h_kv, d)
        table = torch.randperm(b * case["blocks"], generator=gen).to(torch.int32)
        table = table.view(b, case["blocks"]).to(DEVICE)
    else:
        shape, table = (b, case["capacity"], h_kv, d), None
    caches = [torch.full(shape, float("nan"), dtype=dtype, device=DEVICE) for _ in range(2)]
    lengths = torch.tensor(case["lengths"], dtype=torch.int32, device=DEVICE)
    for cache in caches:  # fill each sequence's first `length` slots
        for i, n in enumerate(case["lengths"]):
            values = torch.randn(n, h_kv, d, generator=gen).to(DEVICE, dtype)
            if table is None:
                cache[i, :n] = values
            else:
                pos = torch.arange(n, device=DEVICE)
                cache[table[i, pos // case["page"]].long(), pos % case["page"]] = values
    new = [make((b, n_q, h_kv, d), dtype, ("contiguous", None), gen) for _ in range(2)] \
        if case["new"] else [None, None]
    kwargs = dict(causal=case["causal"], window_size=case["window_size"],
                  softcap=case["softcap"], num_splits=case["num_splits"],
                  alibi_slopes=torch.rand(h, generator=gen).to(DEVICE) if case["alibi"] else None,
                  sinks=torch.randn(h, generator=gen).to(DEVICE) if case["sinks"] else None)
    ref_caches = [c.clone() for c in caches]
    ref = family.reference(q, *ref_caches, *new, lengths, table, **kwargs)
    tol = tolerance(dtype, "attention")
    args = (q, *caches, *new, lengths, table)
    for variant in runnable_variants("flash_attn_with_kvcache", *args, **kwargs):
        mine = [c.clone() for c in caches]
        with forced("flash_attn_with_kvcache", variant):
            out = call("flash_attn_with_kvcache", case["api"], q, *mine, *new, lengths, table,
                       **kwargs)
        check_output(out, ref, dtype, tol, f"flash_attn_with_kvcache[{variant}]")
        if case["new"]:
            for got, want in zip(mine, ref_caches):
                assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)), "appended tokens"


# --- defects the fuzzing found: their minimal reproducers ------------------------------------

@pytest.mark.parametrize("requires", [(True, False), (False, True)], ids=["list_a", "list_b"])
def test_grouped_matmul_backward_one_list(requires):
    """One list needing no gradient (frozen experts): ops' backward used to return None for
    it where torch.library wants a list, and raised."""
    a = torch.randn(4, 8, device=DEVICE, requires_grad=requires[0])
    b = torch.randn(8, 3, device=DEVICE, requires_grad=requires[1])
    (out,) = ops.grouped_matmul([a], [b])
    g = torch.randn(4, 3, device=DEVICE)
    (grad,) = torch.autograd.grad(out, a if requires[0] else b, g)
    expect = g @ b.t() if requires[0] else a.t() @ g
    assert_close(grad, expect, tolerance(torch.float32, "dot"), "grad")
