"""The launchers' host helpers: the integer helpers agree with Triton's own (which cost
microseconds per call from host code, so the launch paths do not use them); the scratch
allocator lends memory for a launch only."""
from __future__ import annotations

import pytest
import torch
import triton

from portable_kernels.kernels import _host


def test_cdiv_and_next_power_of_2_match_triton():
    for n in [0, 1, 2, 3, 4, 5, 63, 64, 65, 127, 128, 129, 1000, 1024, 1025, 2**31 - 1, 2**31, 2**40 + 1]:
        assert _host.next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 16, 64, 100, 128):
            assert _host.cdiv(n, d) == triton.cdiv(n, d), (n, d)


def test_scratch_allocator_lends_torch_memory_for_the_launch_only(device):
    """Inside the block Triton's allocator hands out torch memory on the device; after it
    (also after an error) the caller's own allocator is back."""
    from triton.runtime import _allocation

    def callers(size, alignment, stream):
        raise AssertionError("the caller's allocator must not serve a launcher's scratch")

    token = _allocation._allocator.set(callers)
    try:
        with _host.scratch_allocator(device):
            scratch = _allocation._allocator.get()(384, 128, None)
            assert scratch.numel() == 384 and scratch.dtype == torch.int8 and scratch.device.type == device.type
            with _host.scratch_allocator(device):  # nested: each restores what it found
                pass
            assert _allocation._allocator.get()(16, 16, None).numel() == 16
        assert _allocation._allocator.get() is callers
        with pytest.raises(RuntimeError), _host.scratch_allocator(device):
            raise RuntimeError("a launch failed")
        assert _allocation._allocator.get() is callers
    finally:
        _allocation._allocator.reset(token)


@pytest.mark.parametrize("value, on", [(None, False), ("1", True), (" Yes ", True), ("on", True),
                                       ("0", False), ("off", False), ("", False)])
def test_check_values_follows_the_environment(monkeypatch, value, on):
    """Read on every call (from os.environ's own mapping, kept current by every write)."""
    if value is None:
        monkeypatch.delenv("PK_CHECK_VALUES", raising=False)
    else:
        monkeypatch.setenv("PK_CHECK_VALUES", value)
    assert _host.check_values() is on


class _Double(_host.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def test_function_call_is_apply_outside_functorch_transforms():
    """``call`` builds the same graph as ``apply``; inside a transform it is ``apply``,
    whose check for ``setup_context`` (which the families do not define) then speaks."""
    x = torch.randn(3, requires_grad=True)
    y = _Double.call(x)
    assert type(y.grad_fn) is type(_Double.apply(x).grad_fn)
    assert torch.equal(y, x * 2)
    assert torch.equal(torch.autograd.grad(y.sum(), x)[0], torch.full((3,), 2.0))
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda t: _Double.call(t).sum())(x.detach())
