"""softmax against torch, and its errors."""
from __future__ import annotations

import pytest
import torch

import portable_kernels as pk
from portable_kernels.testing import assert_close, tolerance

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (5, 37), (3, 1000), (2, 3, 2500)],
                         ids=["1x1", "tail", "one-block", "multi-block"])
def test_matches_torch(device, gen, dtype, shape):
    # 2500 columns exceed the interpreter's 1024-wide block: the streaming two-pass path.
    x = (3 * torch.randn(shape, generator=gen)).to(device, dtype)
    out = pk.get_kernel("softmax")(x)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, torch.softmax(x.double(), -1), tolerance(dtype, "reduction"))


@pytest.mark.parametrize("dim", [0, 1, -2])
def test_other_dims(device, gen, dim):
    x = torch.randn(6, 7, 9, generator=gen).to(device)
    assert_close(pk.get_kernel("softmax")(x, dim=dim), torch.softmax(x.double(), dim), tolerance(torch.float32, "reduction"))


def test_non_contiguous_views(device, gen):
    base = torch.randn(40, 3000, generator=gen).to(device)
    for view in (base.t(), base[::3, 5:2900], base[:, ::2]):
        assert_close(pk.get_kernel("softmax")(view), torch.softmax(view.double(), -1),
                     tolerance(torch.float32, "reduction"))


def test_large_magnitudes_and_infinities(device):
    x = torch.tensor([[1000.0, -1000.0, 0.0, float("-inf")], [float("-inf")] * 3 + [5.0]], device=device)
    out = pk.get_kernel("softmax")(x)
    assert_close(out, torch.softmax(x.double(), -1), tolerance(torch.float32, "reduction"))


def test_long_row_with_leading_neg_inf_block(device, gen):
    # The whole first block is -inf: lanes must not produce NaN from (-inf) - (-inf).
    x = torch.randn(2, 3000, generator=gen).to(device)
    x[:, :1500] = float("-inf")
    assert_close(pk.get_kernel("softmax")(x), torch.softmax(x.double(), -1), tolerance(torch.float32, "reduction"))


@pytest.mark.parametrize("shape, dim", [((0, 5), -1), ((4, 0), -1), ((4, 0), 0), ((0, 3, 5), 1),
                                        ((3, 0, 2), 2)])
def test_empty(shape, dim, device):
    """Empty along the softmax's dimension or another one: torch's empty result, shape
    and dtype alike (an empty last dimension used to fail in the launcher's reshape)."""
    x = torch.empty(shape, device=device, dtype=torch.float16)
    out = pk.get_kernel("softmax")(x, dim)
    expected = torch.softmax(x.float(), dim).half()
    assert out.shape == expected.shape and out.dtype == x.dtype and out.device == x.device


def test_errors(device):
    softmax = pk.get_kernel("softmax")
    with pytest.raises(TypeError, match="softmax: x has dtype int64"):
        softmax(torch.arange(6, device=device).reshape(2, 3))
    with pytest.raises(ValueError, match="dim 2 is out of range for a 2-D tensor"):
        softmax(torch.ones(2, 3, device=device), dim=2)
    with pytest.raises(ValueError, match="at least one dimension"):
        softmax(torch.tensor(1.0, device=device))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        softmax([1.0, 2.0])
