"""cross_entropy against torch in float64: every option alone and combined, every
reduction, forward and backward, ignored rows, int32 targets, strided logits; what it
allocates; errors that name the argument; target ids checked under PK_CHECK_VALUES."""
from __future__ import annotations

import pytest
import torch

import portable_kernels as pk
from portable_kernels.kernels.cross_entropy import reference
from portable_kernels.testing import assert_close, tolerance

from allocations import Outputs

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
OPTIONS = {
    "plain": {},
    "smoothing": {"label_smoothing": 0.25},
    "z_loss": {"z_loss": 1e-2},
    "softcap": {"softcap": 4.0},
    "all": {"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 10.0},
}


def cross_entropy(*args, **kwargs):
    return pk.get_kernel("cross_entropy")(*args, **kwargs)


def _inputs(gen, device, dtype, rows, n_classes, ignored=0.3, scale=3.0):
    logits = (scale * torch.randn(rows, n_classes, generator=gen)).to(device, dtype)
    target = torch.randint(n_classes, (rows,), generator=gen)
    target[torch.rand(rows, generator=gen) < ignored] = -100
    target[0] = 1 % n_classes  # at least one counted row
    return logits, target.to(device)


def _check(logits, target, gen, **kwargs):
    """Loss and dlogits against the float64 reference, within the table's tolerance."""
    x = logits.detach().requires_grad_()
    out = cross_entropy(x, target, **kwargs)
    x64 = logits.detach().double().requires_grad_()
    ref = reference(x64, target, **kwargs)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    tol = tolerance(logits.dtype, "reduction")
    assert_close(out, ref, tol, "loss")
    dy = torch.randn(out.shape, generator=gen).to(out.device)
    (dx,) = torch.autograd.grad(out, x, dy)
    (dx64,) = torch.autograd.grad(ref, x64, dy.double())
    assert dx.dtype == logits.dtype and dx.shape == logits.shape
    assert_close(dx, dx64, tol, "dlogits")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_torch(option, reduction, dtype, gen, device):
    # 2500 classes: three of the interpreter's 1024-wide chunks, the last one ragged.
    logits, target = _inputs(gen, device, dtype, 6, 2500)
    _check(logits, target, gen, reduction=reduction, **OPTIONS[option])


def test_matches_torch_cross_entropy_itself(gen, device):
    """No softcap or z-loss: the loss is torch's own F.cross_entropy, smoothing included."""
    logits, target = _inputs(gen, device, torch.float32, 9, 77)
    for reduction in ("mean", "sum", "none"):
        expected = torch.nn.functional.cross_entropy(logits.double(), target, label_smoothing=0.3,
                                                     reduction=reduction)
        out = cross_entropy(logits, target, label_smoothing=0.3, reduction=reduction)
        assert_close(out, expected, tolerance(torch.float32, "reduction"), reduction)


def test_softcap_is_stable_for_huge_logits(gen, device):
    logits, target = _inputs(gen, device, torch.float32, 4, 50, scale=1e4)
    logits[1, 3] = 3e38
    _check(logits, target, gen, softcap=30.0)


def test_ignored_rows(gen, device):
    logits, target = _inputs(gen, device, torch.float32, 8, 40, ignored=0.0)
    target[2:5] = 7  # a custom ignore_index that is also a class id
    x = logits.clone().requires_grad_()
    loss = cross_entropy(x, target, ignore_index=7, reduction="none")
    assert torch.equal(loss[2:5], torch.zeros(3, device=device))
    loss.sum().backward()
    assert torch.equal(x.grad[2:5], torch.zeros(3, 40, device=device))
    _check(logits, target, gen, ignore_index=7, z_loss=1e-2)


def test_all_ignored_mean_is_nan_with_zero_gradient_as_torch(gen, device):
    logits, _ = _inputs(gen, device, torch.float32, 4, 30)
    target = torch.full((4,), -100, device=device)
    x = logits.clone().requires_grad_()
    x_t = logits.clone().requires_grad_()
    loss = cross_entropy(x, target, z_loss=1e-3)
    expected = torch.nn.functional.cross_entropy(x_t, target)
    assert loss.isnan() and expected.isnan()
    loss.backward()
    expected.backward()
    assert torch.equal(x.grad, x_t.grad) and not x.grad.any()
    assert cross_entropy(logits, target, reduction="sum") == 0


def test_int32_target_and_strided_logits(gen, device):
    logits, target = _inputs(gen, device, torch.float32, 40, 24)
    _check(logits.t().contiguous().t(), target.int(), gen, label_smoothing=0.1)  # column-major
    _check(logits[:, ::2], target.int() % 12, gen)  # column stride 2


def test_every_element_written_and_logits_untouched(gen, device, nan_empty):
    logits, target = _inputs(gen, device, torch.float16, 5, 1100)
    before = logits.clone()
    x = logits.requires_grad_()
    loss = cross_entropy(x, target, reduction="none")
    loss.sum().backward()
    assert not loss.isnan().any() and not x.grad.isnan().any()
    assert torch.equal(logits.detach(), before)


def test_no_rows(device):
    logits, target = torch.empty(0, 10, device=device), torch.empty(0, dtype=torch.long, device=device)
    assert cross_entropy(logits, target).isnan()
    assert cross_entropy(logits, target, reduction="sum") == 0
    assert cross_entropy(logits, target, reduction="none").shape == (0,)


def test_no_fp32_copy_of_the_logits(gen, device):
    """bf16 logits: forward and backward allocate no fp32 tensor beyond per-row vectors
    (the interpreter's own copies of the arguments keep their dtypes, so they do not
    count)."""
    logits, target = _inputs(gen, device, torch.bfloat16, 8, 3000)
    x = logits.requires_grad_()
    with Outputs() as seen:
        loss = cross_entropy(x, target, label_smoothing=0.1, z_loss=1e-3, softcap=20.0)
        loss.backward()
    assert max(t.numel() for t in seen.tensors() if t.dtype == torch.float32) <= 8
    assert x.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_inference_keeps_no_lse(gen, device, reduction):
    """Without a backward to come only the row losses are allocated per row, not the
    log-sum-exp a backward reads; the loss is the training path's."""
    logits, target = _inputs(gen, device, torch.bfloat16, 8, 3000)
    cross_entropy(logits, target)  # compiles outside the count
    with torch.no_grad(), Outputs() as seen:
        got = cross_entropy(logits, target, reduction=reduction)
    assert seen.new(torch.float32, (8,)) == 1
    with Outputs() as seen:
        want = cross_entropy(logits.detach().requires_grad_(), target, reduction=reduction)
    assert seen.new(torch.float32, (8,)) == 2  # the check can fail: training keeps the LSE
    assert torch.equal(got, want.detach())


@pytest.mark.parametrize("kwargs, match", [
    ({"target": "shape"}, r"cross_entropy: target must have shape \(6,\)"),
    ({"target": "float"}, r"cross_entropy: target has dtype float32; supported: int64, int32"),
    ({"label_smoothing": 1.5}, r"cross_entropy: label_smoothing must be in \[0, 1\]"),
    ({"label_smoothing": -0.1}, r"cross_entropy: label_smoothing must be in \[0, 1\]"),
    ({"z_loss": -1e-4}, r"cross_entropy: z_loss must be finite and >= 0"),
    ({"softcap": 0.0}, r"cross_entropy: softcap must be finite and > 0"),
    ({"softcap": -1.0}, r"cross_entropy: softcap must be finite and > 0"),
    ({"softcap": "30"}, r"cross_entropy: softcap must be a float or None, got str"),
    ({"reduction": "avg"}, r"cross_entropy: reduction must be one of 'mean', 'sum', 'none', got 'avg'"),
    ({"ignore_index": 1.5}, r"cross_entropy: ignore_index must be an int"),
    ({"logits": "1d"}, r"cross_entropy: logits must be 2-D \(T, V\)"),
    ({"logits": "int"}, r"cross_entropy: logits has dtype int32"),
])
def test_errors_name_the_argument(kwargs, match, device):
    logits = torch.randn(6, 10, device=device)
    target = torch.randint(10, (6,), device=device)
    kwargs = dict(kwargs)
    which = kwargs.pop("target", None)
    if which == "shape":
        target = target[:5]
    elif which == "float":
        target = target.float()
    which = kwargs.pop("logits", None)
    if which == "1d":
        logits = logits[0]
    elif which == "int":
        logits = logits.int()
    with pytest.raises(pk.PortableKernelsError, match=match):
        cross_entropy(logits, target, **kwargs)


def test_out_of_range_targets(monkeypatch, device):
    """Without PK_CHECK_VALUES a bad id makes its row NaN (no host sync); with it, an
    error names the row and the id."""
    logits = torch.randn(4, 10, device=device, requires_grad=True)
    target = torch.tensor([1, 10, -100, -3], device=device)
    loss = cross_entropy(logits, target, reduction="none")
    assert loss[[1, 3]].isnan().all() and not loss[[0, 2]].isnan().any()
    loss[0].backward()
    assert logits.grad[[1, 3]].isnan().all() and not logits.grad[[0, 2]].isnan().any()
    monkeypatch.setenv("PK_CHECK_VALUES", "1")
    with pytest.raises(pk.InputError, match=r"cross_entropy: target\[1\] = 10 is neither "
                                            r"ignore_index \(-100\) nor a class in \[0, 10\)"):
        cross_entropy(logits, target)
    cross_entropy(logits, torch.tensor([1, 9, -100, 0], device=device))
