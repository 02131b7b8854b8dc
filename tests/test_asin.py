"""asin against torch: the polynomial variant within 2 ulp in fp32, libdevice on GPUs, errors."""
from __future__ import annotations

import pytest
import torch

import portable_kernels as pk
from portable_kernels.errors import VariantUnavailableError
from portable_kernels.testing import assert_close, tolerance

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# Values where the algorithm switches branch or the result is exact, plus tiny ones.
EDGES = [1.0, -1.0, 0.0, -0.0, 0.5, -0.5, 0.4999999701976776, 0.5000000596046448,
         1 - 2**-24, -(1 - 2**-24), 1 - 2**-23, 0.975, 2**-12, -(2**-12), 2**-12 - 2**-36,
         1e-4, -3e-8, 1e-30, -1e-38, 1e-40, -1e-45, 0.70710678, 0.86602540]


def _ordered(x: torch.Tensor) -> torch.Tensor:
    """fp32 bit patterns mapped to integers that count ulps (with -0.0 == +0.0)."""
    i = x.contiguous().view(torch.int32).to(torch.int64)
    return torch.where(i < 0, -(i & 0x7FFFFFFF), i)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (_ordered(a.cpu()) - _ordered(b.cpu())).abs()


def _fp32_inputs(gen, n: int, device) -> torch.Tensor:
    uniform = torch.rand(n, generator=gen) * 2 - 1
    # Log-uniform magnitudes from 1e-40 to 1 reach the tiny and subnormal range too.
    logs = torch.rand(n // 8, generator=gen) * 40 - 40
    signs = torch.where(torch.rand(n // 8, generator=gen) < 0.5, -1.0, 1.0)
    near_one = 1 - torch.randint(0, 4096, (n // 16,), generator=gen).float() * 2**-24
    return torch.cat([uniform, signs * 10**logs, near_one, -near_one,
                      torch.tensor(EDGES)]).to(device)


def test_cpu_selects_the_polynomial_variant(device):
    if device.type != "cpu":
        pytest.skip("checks selection on the interpreter, which has no libdevice")
    sel = pk.explain("asin", torch.ones(3))
    assert sel.variant == "cpu.polynomial"
    generic = next(v for v in sel.verdicts if v.name == "generic")
    assert not generic.runnable and "libdevice" in generic.reason
    with pytest.raises(VariantUnavailableError, match="libdevice"):
        with pk.use_variant(asin="generic"):
            pk.get_kernel("asin")(torch.ones(3))


def test_polynomial_within_2_ulp_of_torch_fp32(device, gen):
    x = _fp32_inputs(gen, 1 << 17, device)
    with pk.use_variant(asin="cpu.polynomial"):
        out = pk.get_kernel("asin")(x)
    # torch's CPU asin is within 1 ulp of the exact arcsine, so the CPU's is the yardstick.
    expect = torch.asin(x.cpu())
    ulps = _ulps(out, expect)
    worst = int(ulps.argmax())
    assert ulps.max() <= 2, f"asin({x[worst].item()!r}) = {out[worst].item()!r}, torch {expect[worst].item()!r}"
    # Against the correctly rounded arcsine too, so torch's own error cannot hide ours.
    assert _ulps(out, torch.asin(x.double().cpu()).float()).max() <= 1
    # The sign of zero and of tiny values survives.
    assert torch.equal(torch.signbit(out.cpu()), torch.signbit(x.cpu()))


def test_polynomial_nan_outside_domain(device):
    x = torch.tensor([1.0000001, -1.0000001, 1.5, -2.0, 1e30, float("inf"), float("-inf"),
                      float("nan"), 0.25], device=device)
    with pk.use_variant(asin="cpu.polynomial"):
        out = pk.get_kernel("asin")(x)
    assert torch.isnan(out[:-1]).all()
    assert out[-1].item() == pytest.approx(0.25268025514207865, rel=1e-7)


def test_libdevice_within_2_ulp_of_torch(device, gen):
    if device.type == "cpu":
        pytest.skip("the generic variant needs libdevice, which Triton's CPU interpreter lacks")
    x = _fp32_inputs(gen, 1 << 17, device)
    with pk.use_variant(asin="generic"):
        out = pk.get_kernel("asin")(x)
    # libdevice's asinf is within 2 ulp of the exact arcsine; torch's GPU asin is a
    # different routine with its own error, so the exact value is the yardstick here.
    exact = torch.asin(x.double()).float()
    ulps = _ulps(out, exact)
    worst = int(ulps.argmax())
    assert ulps.max() <= 2, f"asin({x[worst].item()!r}) = {out[worst].item()!r}, exact {exact[worst].item()!r}"
    assert torch.equal(torch.signbit(out.cpu()), torch.signbit(x.cpu()))


def _variants(device):
    return pk.list_variants("asin", device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (3, 5, 7), (9000,)], ids=["one", "odd-3d", "tail"])
def test_matches_reference(device, gen, dtype, shape):
    # Inputs slightly past +-1 check NaN for every dtype and variant.
    x = (torch.rand(shape, generator=gen) * 2.02 - 1.01).to(device, dtype)
    for variant in _variants(device):
        with pk.use_variant(asin=variant):
            out = pk.get_kernel("asin")(x)
        assert out.dtype == dtype and out.shape == x.shape
        assert_close(out, torch.asin(x.double()), tolerance(dtype), f"asin/{variant}")
        assert torch.equal(torch.isnan(out), x.abs() > 1)


def test_non_contiguous(device, gen):
    base = (torch.rand(40, 70, generator=gen) * 2 - 1).to(device)
    for view in (base.t(), base[::3, 5:61], base[:, ::2]):
        out = pk.get_kernel("asin")(view)
        assert out.shape == view.shape
        assert_close(out, torch.asin(view.double()), tolerance(torch.float32))


def test_empty(device):
    out = pk.get_kernel("asin")(torch.empty(0, 5, device=device))
    assert out.shape == (0, 5)


def test_errors(device):
    asin = pk.get_kernel("asin")
    with pytest.raises(TypeError, match="asin: x has dtype int64"):
        asin(torch.arange(6, device=device))
    with pytest.raises(TypeError, match="asin: x has dtype float64"):
        asin(torch.zeros(3, dtype=torch.float64, device=device))
    with pytest.raises(TypeError, match="asin: x must be a torch.Tensor"):
        asin([0.5])
