"""fused_linear_cross_entropy against the projection and torch's cross-entropy in float64:
every reduction, with and without a bias, the options alone and combined, forward and
backward; the chunk size and what forward and backward allocate (never a (T, V) tensor);
the projections run on the matmul family; errors that name the argument."""
from __future__ import annotations

import weakref

import pytest
import torch

import portable_kernels as pk
from portable_kernels.kernels import fused_linear_cross_entropy as flce
from portable_kernels.kernels.fused_linear_cross_entropy import chunk_rows, reference
from portable_kernels.testing import assert_close, tolerance

from allocations import Outputs

OPTIONS = {
    "plain": {},
    "smoothing": {"label_smoothing": 0.2},
    "z_loss": {"z_loss": 1e-2},
    "softcap": {"softcap": 3.0},
    "all": {"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 10.0},
}


def fused(*args, **kwargs):
    return pk.get_kernel("fused_linear_cross_entropy")(*args, **kwargs)


def _inputs(gen, device, dtype, rows=12, width=32, n_classes=100, bias=False, ignored=0.25):
    hidden = torch.randn(rows, width, generator=gen).to(device, dtype)
    weight = (2 * torch.randn(n_classes, width, generator=gen) / width ** 0.5).to(device, dtype)
    b = (0.5 * torch.randn(n_classes, generator=gen)).to(device, dtype) if bias else None
    target = torch.randint(n_classes, (rows,), generator=gen)
    target[torch.rand(rows, generator=gen) < ignored] = -100
    target[0] = 2
    return hidden, weight, target.to(device), b


def _check(gen, hidden, weight, target, bias, **kwargs):
    tensors = [t for t in (hidden, weight, bias) if t is not None]
    mine = [t.detach().requires_grad_() for t in tensors]
    ref64 = [t.detach().double().requires_grad_() for t in tensors]
    out = fused(*mine[:2], target, mine[2] if bias is not None else None, **kwargs)
    ref = reference(*ref64[:2], target, ref64[2] if bias is not None else None, **kwargs)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    tol = tolerance(hidden.dtype, "dot")
    assert_close(out, ref, tol, "loss")
    dy = torch.randn(out.shape, generator=gen).to(out.device)
    grads = torch.autograd.grad(out, mine, dy)
    refs = torch.autograd.grad(ref, ref64, dy.double())
    for name, g, r in zip(("dhidden", "dweight", "dbias"), grads, refs):
        assert g.dtype == hidden.dtype
        assert_close(g, r, tol, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_torch(reduction, bias, dtype, gen, device):
    hidden, weight, target, b = _inputs(gen, device, dtype, bias=bias)
    _check(gen, hidden, weight, target, b, reduction=reduction, **OPTIONS["all"])


@pytest.mark.parametrize("option", list(OPTIONS))
def test_each_option(option, gen, device):
    hidden, weight, target, b = _inputs(gen, device, torch.float32, rows=9, n_classes=70, bias=True)
    _check(gen, hidden, weight, target, b, **OPTIONS[option])


def test_matches_a_linear_layer_and_torch_cross_entropy(gen, device):
    hidden, weight, target, b = _inputs(gen, device, torch.float32, bias=True)
    expected = torch.nn.functional.cross_entropy(
        torch.nn.functional.linear(hidden.double(), weight.double(), b.double()), target,
        label_smoothing=0.1)
    assert_close(fused(hidden, weight, target, b, label_smoothing=0.1), expected,
                 tolerance(torch.float32, "dot"), "loss")


def test_all_ignored_and_no_rows(gen, device):
    hidden, weight, target, _ = _inputs(gen, device, torch.float32, rows=4)
    target[:] = -100
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    loss = fused(h, w, target)
    assert loss.isnan()  # torch's mean over no counted rows
    loss.backward()
    assert not h.grad.any() and not w.grad.any()
    empty = fused(hidden[:0].detach(), weight.detach(), target[:0], reduction="none")
    assert empty.shape == (0,)
    assert fused(hidden[:0].detach(), weight.detach(), target[:0], reduction="sum") == 0


def test_strided_operands(gen, device):
    hidden, weight, target, _ = _inputs(gen, device, torch.float32)
    _check(gen, hidden.t().contiguous().t(), weight.t().contiguous().t(), target, None, z_loss=1e-3)


def test_only_the_gradients_asked_for(gen, device):
    """A frozen weight (fine-tuning the layers below): no weight gradient, no bias one."""
    hidden, weight, target, b = _inputs(gen, device, torch.float32, bias=True)
    h = hidden.requires_grad_()
    loss = fused(h, weight, target, b)
    loss.backward()
    assert weight.grad is None and b.grad is None and h.grad is not None
    assert fused(hidden.detach(), weight, target).grad_fn is None


@pytest.fixture(autouse=True)
def _chunks_of_any_size(monkeypatch):
    """Chunks as small as the formula makes them (not MIN_CHUNK_ROWS), so that these small
    calls run the chunk loop; test_chunk_rows checks the shipped minimum."""
    monkeypatch.setattr(flce, "MIN_CHUNK_ROWS", 1)


def test_chunk_rows(monkeypatch):
    scale = flce.CHUNK_SCALE
    # Module docstring's example: 256 * CHUNK_SCALE rows.
    assert chunk_rows(8192, 128256, 4096) == 256 * scale
    assert chunk_rows(5, 10, 64) == 5 and chunk_rows(0, 10, 4) == 1 and chunk_rows(3, 1000, 1) == scale
    for rows in (1, 7, 100, 4096, 8191):
        for n_classes in (1, 33, 1000, 50257, 262144):
            for width in (1, 64, 2048, 8192):
                c = chunk_rows(rows, n_classes, width)
                assert 1 <= c <= rows and c & (c - 1) == 0 or c == rows
                assert c * n_classes < scale * (2 * rows * width + 2 * n_classes), (rows, n_classes, width, c)
    monkeypatch.setattr(flce, "MIN_CHUNK_ROWS", 64)
    assert chunk_rows(8, 32000, 4096) == 8      # a small batch: one chunk
    assert chunk_rows(1000, 262144, 64) == 64   # never fewer than 64 rows
    assert chunk_rows(8192, 128256, 4096) == 256 * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_gradient_over_many_chunks(dtype, gen, device, monkeypatch):
    """The weight gradient summed over many chunks (chunks of one row, V >> H), each added
    by the matmul's accumulating epilogue and rounded to the weight's dtype: 24 roundings
    of a bf16 sum stay within bf16's bound."""
    monkeypatch.setattr(flce, "CHUNK_SCALE", 1)
    hidden, weight, target, b = _inputs(gen, device, dtype, rows=24, width=8,
                                        n_classes=1000, bias=True, ignored=0.0)
    assert chunk_rows(24, 1000, 8) == 1
    _check(gen, hidden, weight, target, b, label_smoothing=0.1, reduction="sum")


def test_second_backward_raises_instead_of_scaling_twice(gen, device):
    """The forward's gradients are scaled in place by the upstream gradient: a second
    backward through the same graph must fail loudly, not scale them again."""
    hidden, weight, target, _ = _inputs(gen, device, torch.float32)
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    loss = fused(h, w, target)
    (2 * loss).backward(retain_graph=True)
    first = w.grad.clone()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    assert torch.equal(w.grad, first)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_never_allocates_the_logits(reduction, gen, device):
    """Forward and backward allocate nothing of T x V elements: at most a chunk of logits,
    the (V, H) weight gradient or the (T, H) hidden one."""
    rows, width, n_classes = 32, 16, 256
    hidden, weight, target, b = _inputs(gen, device, torch.float32, rows, width, n_classes, bias=True)
    leaves = [t.requires_grad_() for t in (hidden, weight, b)]
    with Outputs() as seen:
        loss = fused(*leaves[:2], target, leaves[2], reduction=reduction, softcap=5.0)
        loss.sum().backward()
    step = chunk_rows(rows, n_classes, width)
    assert step < rows
    # uint8: the interpreter's byte copies of launch arguments are not the library's
    largest = max(t.numel() for t in seen.tensors() if t.dtype != torch.uint8)
    assert largest <= max(step * n_classes, n_classes * width, rows * width) < rows * n_classes


def test_one_logits_chunk_alive_at_a_time(gen, device, monkeypatch):
    """A chunk's logits are released before the next chunk's product allocates: holding
    the previous one until its name is rebound doubled the loss's peak logits (seen in a
    memory trace of a model's training step)."""
    rows, width, n_classes = 24, 8, 96
    hidden, weight, target, _ = _inputs(gen, device, torch.float32, rows, width, n_classes)
    real, chunks, alive_at_new_chunk = flce._product, [], []

    def product(a, b, acc=None):
        if acc is None and b.shape[-1] == n_classes:  # a chunk's logits, h_c @ weight.T
            alive_at_new_chunk.append(sum(ref() is not None for ref in chunks))
            out = real(a, b, acc)
            chunks.append(weakref.ref(out))
            return out
        return real(a, b, acc)

    monkeypatch.setattr(flce, "_product", product)
    fused(hidden.requires_grad_(), weight.requires_grad_(), target).backward()
    assert len(chunks) == rows // chunk_rows(rows, n_classes, width) > 2
    assert alive_at_new_chunk == [0] * len(chunks)


def test_operator_backward_allocates_nothing_of_the_weights_size(gen, device):
    """The operator's backward scales the gradients its forward computed in place: autograd
    must not hand it zero tensors for the forward's gradient outputs (a second weight
    gradient at the peak: 2.08 against Liger's 1.10 GiB at 8192x4096x128256 bf16)."""
    from portable_kernels import ops

    hidden, weight, target, _ = _inputs(gen, device, torch.float32, 32, 16, 256)
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    loss = ops.fused_linear_cross_entropy(h, w, target)
    with Outputs() as seen:
        dh, dw = torch.autograd.grad(loss, [h, w])
    made = [t.numel() for t in seen.tensors()]
    assert all(n < w.numel() for n in made), made  # no zeros of the weight's size
    assert dw.shape == w.shape and dh.shape == h.shape


def test_projections_run_on_the_matmul_family(gen, device, monkeypatch):
    calls = []
    handle = pk.get_kernel("matmul")
    plan = type(handle).plan

    def counted(self, a, b, **kwargs):
        chosen = plan(self, a, b, **kwargs)
        calls.append(chosen.variant.name)
        return chosen

    monkeypatch.setattr(type(handle), "plan", counted)
    monkeypatch.setattr(flce, "_MATMUL", [handle])
    hidden, weight, target, _ = _inputs(gen, device, torch.float32)
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    fused(h, w, target).backward()
    chunks = -(-12 // chunk_rows(12, 100, 32))
    assert len(calls) == 3 * chunks  # logits, dhidden and dweight per chunk
    assert set(calls) <= set(pk.list_variants("matmul", device))


@pytest.mark.parametrize("change, match", [
    ({"target": "shape"}, r"fused_linear_cross_entropy: target must have shape \(6,\) \(one id per row of hidden\)"),
    ({"target": "float"}, r"fused_linear_cross_entropy: target has dtype float32"),
    ({"weight": "transposed"}, r"fused_linear_cross_entropy: weight must be \(V, H\) with H = hidden's 8 columns"),
    ({"bias": "short"}, r"fused_linear_cross_entropy: bias must have shape \(10,\)"),
    ({"bias": "half"}, r"fused_linear_cross_entropy: dtypes must match"),
    ({"hidden": "3d"}, r"fused_linear_cross_entropy: hidden must be 2-D \(T, H\)"),
    ({"label_smoothing": 2.0}, r"fused_linear_cross_entropy: label_smoothing must be in \[0, 1\]"),
    ({"z_loss": -1.0}, r"fused_linear_cross_entropy: z_loss must be finite and >= 0"),
    ({"softcap": 0.0}, r"fused_linear_cross_entropy: softcap must be finite and > 0"),
    ({"reduction": "batchmean"}, r"fused_linear_cross_entropy: reduction must be one of"),
])
def test_errors_name_the_argument(change, match, device):
    hidden, weight = torch.randn(6, 8, device=device), torch.randn(10, 8, device=device)
    target, bias = torch.randint(10, (6,), device=device), torch.randn(10, device=device)
    change = dict(change)
    edits = {
        ("target", "shape"): lambda: target[:5], ("target", "float"): lambda: target.float(),
        ("weight", "transposed"): lambda: weight.t(), ("bias", "short"): lambda: bias[:9],
        ("bias", "half"): lambda: bias.half(), ("hidden", "3d"): lambda: hidden[None],
    }
    args = {"hidden": hidden, "weight": weight, "target": target, "bias": bias}
    for name in list(change):
        if (name, change[name]) in edits:
            args[name] = edits[(name, change.pop(name))]()
    with pytest.raises(pk.PortableKernelsError, match=match):
        fused(args["hidden"], args["weight"], args["target"], args["bias"], **change)


def test_target_values_checked_under_pk_check_values(monkeypatch, device):
    hidden, weight = torch.randn(3, 8, device=device), torch.randn(10, 8, device=device)
    target = torch.tensor([0, 10, -100], device=device)
    assert fused(hidden, weight, target, reduction="none")[1].isnan()
    monkeypatch.setenv("PK_CHECK_VALUES", "1")
    with pytest.raises(pk.InputError, match=r"fused_linear_cross_entropy: target\[1\] = 10 is "
                                            r"neither ignore_index \(-100\) nor a class in \[0, 10\)"):
        fused(hidden, weight, target)


# torch 2.13's own compile stack calls torch.jit.script_method, which it deprecates.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("calls", ["ops", "handles"])
def test_torch_compile_fullgraph(calls, gen, device):
    """Both losses in one compiled function (no graph break), forward and backward, as
    eager: cross_entropy per row ("none") and fused_linear_cross_entropy's mean."""
    from portable_kernels import ops

    torch._dynamo.reset()
    if calls == "ops":
        ce, fl = ops.cross_entropy, ops.fused_linear_cross_entropy
    else:
        ce, fl = pk.get_kernel("cross_entropy"), pk.get_kernel("fused_linear_cross_entropy")
    hidden, weight, target, b = _inputs(gen, device, torch.float32, bias=True)
    leaves = [t.requires_grad_() for t in (hidden, weight, b)]

    def loss(h, w, bias):
        per_row = ce(h @ w.t(), target, softcap=10.0, reduction="none")
        return per_row.sum() + fl(h, w, target, bias, z_loss=1e-3)

    eager = loss(*leaves)
    eager_grads = torch.autograd.grad(eager, leaves)
    compiled = torch.compile(loss, fullgraph=True, backend="inductor")(*leaves)
    grads = torch.autograd.grad(compiled, leaves)
    tol = tolerance(torch.float32, "reduction")
    assert_close(compiled, eager, tol, "compiled loss")
    for name, g, e in zip(("dhidden", "dweight", "dbias"), grads, eager_grads):
        assert_close(g, e, tol, f"compiled {name}")
