"""layer_norm against torch in float64: forward, gradients (dx, dweight, dbias), errors."""
from __future__ import annotations

import pytest
import torch

import portable_kernels as pk
from portable_kernels.kernels.layer_norm import reference
from portable_kernels.testing import Tolerance, assert_close, tolerance

from allocations import Outputs

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (1, 1): a one-element row (variance 0); (7, 13, 37): tails in every dimension;
# (5, 2500): rows longer than the interpreter's 1024-wide chunk; (3, 1700, 37): more row
# tiles than the partial rows (2 on the interpreter, 64 on GPUs), so programs share a lock.
SHAPES = [(1, 1), (7, 13, 37), (5, 2500), (3, 1700, 37)]
SHAPE_IDS = ["1x1", "odd-3d", "multi-chunk", "shared-lock"]


def layer_norm(*args, **kwargs):
    return pk.get_kernel("layer_norm")(*args, **kwargs)


def _inputs(shape, gen, device, dtype, requires_grad=False):
    n = shape[-1]
    x = (2 * torch.randn(shape, generator=gen) + 0.5).to(device, dtype)
    w = (1 + 0.5 * torch.randn(n, generator=gen)).to(device, dtype)
    b = torch.randn(n, generator=gen).to(device, dtype)
    return [t.requires_grad_(requires_grad) for t in (x, w, b)]


def _reference_grads(x, w, b, dy, eps=1e-5):
    leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
    out = reference(*leaves, eps=eps)
    out.backward(dy.double())
    return out, [t.grad for t in leaves]


def _dx_tolerance(tol: Tolerance, x, w, dy, eps=1e-5) -> Tolerance:
    """``tol`` for dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * w: a
    difference of terms of size rstd * |g|, so its rounding error scales with those (and
    GPUs, fusing multiply-adds, round them differently), not with dx, which cancels to 0
    exactly in a one-element row."""
    x64 = x.detach().double().reshape(-1, x.shape[-1])
    rstd = (x64.var(-1, unbiased=False) + eps).rsqrt()
    g = (dy.detach().double() * w.detach().double()).reshape(x64.shape)
    bound = (rstd[:, None] * g.abs()).max()
    return Tolerance(tol.atol + tol.rtol * float(bound), tol.rtol)


def _column_sum_tolerance(tol: Tolerance, x, dy) -> Tolerance:
    """``tol`` for dweight/dbias, sums over all M rows: fp32 summation error grows with the
    sum of the terms' magnitudes, not with the (possibly cancelled) result, so the
    table's rtol also applies to max over columns of sum |dy| * max(|xhat|, 1)."""
    x64, dy64 = x.detach().double(), dy.detach().double()
    xhat = torch.nn.functional.layer_norm(x64, (x.shape[-1],))
    bound = (dy64.abs() * xhat.abs().clamp(min=1)).reshape(-1, x.shape[-1]).sum(0).max()
    return Tolerance(tol.atol + tol.rtol * float(bound), tol.rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_forward_matches_torch(device, gen, dtype, shape):
    x, w, b = _inputs(shape, gen, device, dtype)
    out = layer_norm(x, w, b)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, reference(x, w, b), tolerance(dtype, "reduction"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_gradients_match_torch_autograd(device, gen, dtype, shape):
    x, w, b = _inputs(shape, gen, device, dtype, requires_grad=True)
    dy = torch.randn(shape, generator=gen).to(device, dtype)
    out = layer_norm(x, w, b)
    out.backward(dy)
    ref, (dx, dw, db) = _reference_grads(x, w, b, dy)
    tol = tolerance(dtype, "reduction")
    assert_close(out, ref, tol, "out")
    assert_close(x.grad, dx, _dx_tolerance(tol, x, w, dy), "dx")
    assert_close(w.grad, dw, _column_sum_tolerance(tol, x, dy), "dweight")
    assert_close(b.grad, db, _column_sum_tolerance(tol, x, dy), "dbias")
    assert x.grad.dtype == w.grad.dtype == b.grad.dtype == dtype


def test_non_contiguous_inputs_and_gradient(device, gen):
    base, w, b = _inputs((2, 41, 30), gen, device, torch.float32)
    w.requires_grad_()
    # Last-dim stride 2 (rows fold into a strided view, no copy), and a transpose whose
    # leading dims do not fold (copied).
    for view in (base[:, :, ::2], base.transpose(1, 2)[:, :, ::2]):
        n = view.shape[-1]
        x = view.detach().requires_grad_()
        wn, bn = w.detach()[:n].clone().requires_grad_(), b[:n].clone().requires_grad_()
        dy = torch.randn(tuple(reversed(view.shape)), generator=gen).to(device).permute(
            *reversed(range(view.dim())))  # a non-contiguous upstream gradient
        out = layer_norm(x, wn, bn)
        out.backward(dy)
        ref, (dx, dw, db) = _reference_grads(x, wn, bn, dy)
        tol = tolerance(torch.float32, "reduction")
        assert_close(out, ref, tol, "out")
        assert_close(x.grad, dx, tol, "dx")
        assert_close(wn.grad, dw, tol, "dweight")
        assert_close(bn.grad, db, tol, "dbias")


def test_eps_and_constant_rows(device, gen):
    x, w, b = _inputs((6, 50), gen, device, torch.float32)
    x[2] = 3.0  # variance 0: the output is the bias
    out = layer_norm(x, w, b, eps=0.25)
    assert_close(out, reference(x, w, b, eps=0.25), tolerance(torch.float32, "reduction"))
    assert_close(out[2], b.double(), tolerance(torch.float32, "reduction"))


def test_only_weight_requires_grad(device, gen):
    x, w, b = _inputs((9, 20), gen, device, torch.float32)
    w.requires_grad_()
    dy = torch.randn(9, 20, generator=gen).to(device)
    layer_norm(x, w, b).backward(dy)
    _, (_, dw, _) = _reference_grads(x, w, b, dy)
    assert_close(w.grad, dw, tolerance(torch.float32, "reduction"))
    assert x.grad is None and b.grad is None


def test_no_grad_builds_no_graph(device, gen):
    x, w, b = _inputs((4, 10), gen, device, torch.float32, requires_grad=True)
    with torch.no_grad():
        out = layer_norm(x, w, b)
    assert out.grad_fn is None
    assert_close(out, reference(x, w, b), tolerance(torch.float32, "reduction"))


@pytest.mark.parametrize("kernel", ["layer_norm", "rms_norm", "add_rms_norm"])
def test_inference_allocates_no_statistics(device, gen, kernel):
    """Without a backward to come the norms allocate no per-row mean or 1/std (fp32, one
    per row), which only a backward reads: allocations are a good part of a small call's
    host time. The results are the training path's."""
    rows = 6

    def statistics(seen):  # fp32 (rows,) tensors returned, by any operator
        return sum(t.dtype == torch.float32 and t.shape == (rows,) for t in seen.tensors())

    x, w, b = _inputs((rows, 300), gen, device, torch.float16)
    args = {"layer_norm": (x, w, b), "rms_norm": (x, w), "add_rms_norm": (x, torch.randn_like(x), w)}[kernel]
    handle = pk.get_kernel(kernel)
    handle(*args)  # compiles and tunes outside the count
    with torch.no_grad(), Outputs() as seen:
        got = handle(*args)
    assert statistics(seen) == 0
    with Outputs() as seen:
        training = handle(*(t.detach().requires_grad_() for t in args))
    assert statistics(seen) >= 1  # the check can fail: training keeps them
    for g, want in zip(*((v if isinstance(v, tuple) else (v,)) for v in (got, training))):
        assert torch.equal(g, want.detach())


def test_errors(device, gen):
    x, w, b = _inputs((3, 8), gen, device, torch.float32)
    with pytest.raises(ValueError, match=r"layer_norm: weight must have shape \(8,\).*got \(9,\)"):
        layer_norm(x, torch.ones(9, device=device), b)
    with pytest.raises(ValueError, match=r"layer_norm: bias must have shape \(8,\).*got \(1, 8\)"):
        layer_norm(x, w, b[None])
    with pytest.raises(TypeError, match="layer_norm: dtypes must match, but x is float32, "
                       "weight is float16"):
        layer_norm(x, w.half(), b)
    with pytest.raises(ValueError, match="layer_norm: tensors must be on one device.*bias on meta"):
        layer_norm(x, w, b.to("meta"))
    with pytest.raises(TypeError, match="layer_norm: x has dtype int64"):
        layer_norm(torch.ones(3, 8, dtype=torch.int64, device=device), w, b)
    with pytest.raises(TypeError, match="layer_norm: weight must be a torch.Tensor"):
        layer_norm(x, None, b)
    with pytest.raises(ValueError, match="layer_norm: x must have at least one dimension"):
        layer_norm(torch.tensor(1.0, device=device), w, b)
    with pytest.raises(ValueError, match="layer_norm: eps must be finite and >= 0, got eps=-1"):
        layer_norm(x, w, b, eps=-1.0)
    with pytest.raises(TypeError, match="layer_norm: eps must be a float"):
        layer_norm(x, w, b, eps="1e-5")


@pytest.mark.parametrize("shape", [(4, 0), (2, 3, 0), (0, 7)], ids=["no-cols", "3d-no-cols", "no-rows"])
def test_empty(shape, device):
    """Empty inputs give torch's empty results, forward and backward (an empty last
    dimension used to fail in the launcher's reshape)."""
    n = shape[-1]
    x = torch.empty(shape, device=device).requires_grad_(True)
    w = torch.ones(n, device=device).requires_grad_(True)
    b = torch.zeros(n, device=device).requires_grad_(True)
    out = layer_norm(x, w, b)
    assert out.shape == x.shape and out.dtype == x.dtype
    out.sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == (n,) and b.grad.shape == (n,)
    assert torch.all(w.grad == 0) and torch.all(b.grad == 0)


def test_rows_wider_than_the_tile_take_wide_row_warps(monkeypatch):
    """WIDE_ROW_WARPS (the A/B knob for 8192-column rows): unset, the config's warps; set,
    it applies to a row wider than TILE only, within 1024 threads a program."""
    import triton

    from portable_kernels import plugins
    from portable_kernels.kernels import layer_norm as fam
    from portable_kernels.launch import LaunchPlan

    host = plugins.host()
    variant = next(iter(host.registry.variants["layer_norm"].values()))
    cfg = triton.Config({"MAX_BLOCK_N": 8192, "TILE": 4096, "GROUPS": 64}, num_warps=8)

    def blocks(profile, n_rows, n_cols):
        plan = LaunchPlan(variant, host.emulation_profile(profile), [cfg], variant.switches)
        return fam._blocks(plan, n_rows, n_cols)

    assert blocks("h200", 32768, 8192) == (1, 8192, 8)
    assert blocks("h200", 32768, 4096) == (1, 4096, 8)
    monkeypatch.setattr(fam, "WIDE_ROW_WARPS", 16)
    assert blocks("h200", 32768, 8192) == (1, 8192, 16)
    assert blocks("h200", 32768, 5000) == (1, 8192, 16)
    assert blocks("h200", 32768, 4096) == (1, 4096, 8)  # fits the tile: unchanged
    assert blocks("h200", 3, 2048) == (2, 2048, 8)
    monkeypatch.setattr(fam, "WIDE_ROW_WARPS", 32)
    assert blocks("h200", 8, 8192) == (1, 8192, 32)
    assert blocks("mi300x", 8, 8192) == (1, 8192, 16)  # 64-lane wavefronts: 1024 threads


@pytest.mark.parametrize("warps", [8, 16])
def test_wide_rows_with_either_warp_count(device, gen, warps, monkeypatch):
    """8192-column rows (wider than a GPU config's 4096-element tile) forward and backward
    at the config's warps and at WIDE_ROW_WARPS = 16: the same results."""
    from portable_kernels.kernels import layer_norm as fam

    if device.type == "cpu":
        pytest.skip("the interpreter's config has no row wider than its tile")
    monkeypatch.setattr(fam, "WIDE_ROW_WARPS", None if warps == 8 else warps)
    shape = (300, 8192)
    x, w, b = _inputs(shape, gen, device, torch.bfloat16, requires_grad=True)
    dy = torch.randn(shape, generator=gen).to(device, torch.bfloat16)
    out = pk.get_kernel("layer_norm")(x, w, b)
    out.backward(dy)
    ref, (dx, dw, db) = _reference_grads(x, w, b, dy)
    tol = tolerance(torch.bfloat16, "reduction")
    assert_close(out, ref, tol, "out")
    assert_close(x.grad, dx, _dx_tolerance(tol, x, w, dy), "dx")
    assert_close(w.grad, dw, _column_sum_tolerance(tol, x, dy), "dweight")
    assert_close(b.grad, db, _column_sum_tolerance(tol, x, dy), "dbias")
