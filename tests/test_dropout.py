"""dropout: its mask against a numpy Philox, determinism per seed, edges, gradients, errors."""
from __future__ import annotations

import math

import pytest
import torch

import portable_kernels as pk
from portable_kernels.kernels.dropout import philox_uniform, reference
from portable_kernels.testing import assert_close, tolerance

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def dropout(*args, **kwargs):
    return pk.get_kernel("dropout")(*args, **kwargs)


def _keep(seed: int, shape) -> torch.Tensor:
    """The mask the kernel should draw, from the numpy re-implementation of tl.rand."""
    return torch.from_numpy(philox_uniform(seed, math.prod(shape)) >= 0.3).reshape(shape)


def _randn(shape, gen, device, dtype=torch.float32):
    # Shifted away from 0 so a zero in the output can only mean "dropped".
    x = torch.randn(shape, generator=gen)
    return (x + torch.where(x < 0, -0.1, 0.1)).to(device, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (3, 5, 7), (9000,)], ids=["one", "odd-3d", "tail"])
def test_matches_reference(device, gen, dtype, shape):
    x = _randn(shape, gen, device, dtype)
    seed = 1234
    out = dropout(x, 0.3, seed)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal((out != 0).cpu(), _keep(seed, shape))
    assert_close(out, reference(x, 0.3, seed), tolerance(dtype), "dropout")


@pytest.mark.parametrize("seed", [0, 1, 2**31 + 5, 2**40 + 7, 2**63 - 1])
def test_every_seed_width_matches_reference(device, gen, seed):
    # Seeds of 1, past int32 and past 2**32 reach the kernel as different scalar types.
    x = _randn((2, 2500), gen, device)
    assert_close(dropout(x, 0.3, seed), reference(x, 0.3, seed), tolerance(torch.float32))


def test_same_seed_same_mask_other_seed_other_mask(device, gen):
    x = _randn((64, 33), gen, device)
    first = dropout(x, 0.5, 7)
    assert torch.equal(dropout(x, 0.5, 7), first)
    # The mask does not depend on the values: a different x gets the same zeros.
    assert torch.equal(dropout(2 * x, 0.5, 7) != 0, first != 0)
    assert not torch.equal(dropout(x, 0.5, 8) != 0, first != 0)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_and_scale(device, gen, p):
    x = _randn((20000,), gen, device)
    out = dropout(x, p, 99)
    kept = out != 0
    rate = kept.float().mean().item()
    sigma = math.sqrt(p * (1 - p) / x.numel())
    assert abs(rate - (1 - p)) < 5 * sigma
    torch.testing.assert_close(out[kept], x[kept] / (1 - p))


def test_p_zero_is_a_copy(device, gen):
    x = _randn((5, 7), gen, device).t()
    out = dropout(x, 0.0, 3)
    assert torch.equal(out, x) and out.is_contiguous()
    out.add_(1.0)
    assert not torch.equal(out, x)


def test_p_one_is_zeros_even_for_inf_and_nan(device, gen):
    x = _randn((3, 77), gen, device)
    x[0, 0], x[1, 1] = float("inf"), float("nan")
    out = dropout(x, 1.0, 3)
    assert torch.equal(out, torch.zeros_like(x))


def test_non_contiguous_is_dropped_like_its_copy(device, gen):
    base = _randn((40, 70), gen, device)
    for view in (base.t(), base[::3, 5:61], base[:, ::2]):
        assert torch.equal(dropout(view, 0.3, 11), dropout(view.contiguous(), 0.3, 11))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradient_matches_torch_autograd(device, gen, dtype):
    x = _randn((13, 57), gen, device, dtype).requires_grad_()
    grad_out = _randn((57, 13), gen, device, dtype)
    out = dropout(x, 0.4, 5)
    # Through a transpose, so the incoming gradient is non-contiguous.
    (out.t() * grad_out).sum().backward()
    x64 = x.detach().double().requires_grad_()
    (reference(x64, 0.4, 5).t() * grad_out.double()).sum().backward()
    assert_close(x.grad, x64.grad, tolerance(dtype), "dx")
    assert torch.equal(x.grad != 0, out != 0)


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_gradient_at_the_edges(device, gen, p):
    x = _randn((4, 9), gen, device).requires_grad_()
    grad_out = _randn((4, 9), gen, device)
    dropout(x, p, 1).backward(grad_out)
    assert torch.equal(x.grad, grad_out if p == 0.0 else torch.zeros_like(grad_out))


def test_empty(device):
    out = dropout(torch.empty(0, 5, device=device), 0.5, 1)
    assert out.shape == (0, 5)


def test_errors(device):
    x = torch.ones(4, device=device)
    for p in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"dropout: p must be in \[0, 1\], got p="):
            dropout(x, p, 1)
    with pytest.raises(TypeError, match="dropout: p must be a float"):
        dropout(x, "0.5", 1)
    with pytest.raises(TypeError, match="dropout: x has dtype int64"):
        dropout(torch.arange(4, device=device), 0.5, 1)
    with pytest.raises(TypeError, match="dropout: x must be a torch.Tensor"):
        dropout([1.0], 0.5, 1)
    with pytest.raises(TypeError, match="dropout: seed must be an int, got float"):
        dropout(x, 0.5, 1.0)
    with pytest.raises(ValueError, match="dropout: seed must be in"):
        dropout(x, 0.5, -1)
    with pytest.raises(ValueError, match="dropout: seed must be in"):
        dropout(x, 0.5, 2**63)
