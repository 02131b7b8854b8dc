"""vector_add against torch, and its errors."""
from __future__ import annotations

import pytest
import torch

import portable_kernels as pk
from portable_kernels.testing import assert_close, tolerance

from conftest import ON_CPU

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (4097,), (3, 5, 7), (0,)])
def test_matches_torch(device, gen, dtype, shape):
    x = torch.randn(shape, generator=gen).to(device, dtype)
    y = torch.randn(shape, generator=gen).to(device, dtype)
    out = pk.get_kernel("vector_add")(x, y)
    assert out.shape == x.shape and out.dtype == dtype and out.device == x.device
    assert_close(out, x.double() + y.double(), tolerance(dtype, "elementwise"))


def test_non_contiguous(device, gen):
    x = torch.randn(64, 48, generator=gen).to(device)
    y = torch.randn(48, 64, generator=gen).to(device).t()
    out = pk.get_kernel("vector_add")(x[:, ::1], y)
    assert_close(out, x.double() + y.double(), tolerance(torch.float32))


def test_shape_mismatch(device):
    with pytest.raises(ValueError, match=r"vector_add: shapes must match, got x \(3,\), y \(4,\)"):
        pk.get_kernel("vector_add")(torch.ones(3, device=device), torch.ones(4, device=device))


def test_integer_dtype(device):
    x = torch.ones(3, dtype=torch.int32, device=device)
    with pytest.raises(TypeError, match="vector_add: x has dtype int32; supported: float16, bfloat16, float32"):
        pk.get_kernel("vector_add")(x, x)


def test_mixed_dtypes(device):
    with pytest.raises(TypeError, match="dtypes must match"):
        pk.get_kernel("vector_add")(torch.ones(3, device=device), torch.ones(3, device=device, dtype=torch.float16))


def test_different_devices(device):
    with pytest.raises(ValueError, match="tensors must be on one device, got x on .*, y on meta"):
        pk.get_kernel("vector_add")(torch.ones(3, device=device), torch.ones(3, device="meta"))


def test_not_a_tensor(device):
    with pytest.raises(TypeError, match="y must be a torch.Tensor, got list"):
        pk.get_kernel("vector_add")(torch.ones(3, device=device), [1.0, 2.0, 3.0])


@pytest.mark.skipif(ON_CPU, reason="needs a GPU machine: checks CPU tensors when kernels are compiled")
def test_cpu_tensor_on_a_gpu_machine_is_a_clear_error():
    with pytest.raises(pk.DeviceError, match="PK_INTERPRET=1"):
        pk.get_kernel("vector_add")(torch.ones(3), torch.ones(3))
