"""portable_kernels.ops: every kernel as a torch.library operator.

opcheck (schema, fake tensors, autograd registration, AOT dispatch) for each public and
internal op; outputs and gradients against torch in float64; torch.compile(fullgraph=True)
with Inductor over a small block built from the ops, against eager; selection still runs
inside the op. Shapes are small: the CPU runs every launch under Triton's interpreter.
"""
from __future__ import annotations

import textwrap

import pytest
import torch

import portable_kernels as pk
from portable_kernels import ops
from portable_kernels.testing import Tolerance, assert_close, tolerance

from conftest import DEVICE, ON_CPU

F32 = torch.float32


def _randn(gen, device, *shape, scale=1.0, requires_grad=False):
    t = (scale * torch.randn(shape, generator=gen)).to(device, F32)
    return t.requires_grad_(requires_grad)


def _dropout_reference(x, p, seed):
    from portable_kernels.kernels.dropout import reference

    return reference(x, p, seed)


def _rope_reference(q, k, cos, sin, positions, interleaved):
    from portable_kernels.kernels.rope import reference

    return reference(q, k, cos, sin, positions, interleaved)


def _rope_inputs(g, d, rg):
    """GQA (4 query heads over 2), rotary_dim 12 of D = 16, interleaved, positions."""
    from portable_kernels.kernels.rope import tables

    cos, sin = tables(16, 12, device=d)
    return (_randn(g, d, 2, 5, 4, 16, requires_grad=rg), _randn(g, d, 2, 5, 2, 16, requires_grad=rg),
            cos, sin, torch.randint(0, 16, (2, 5), generator=g).to(d), True)


def _add_rms_norm_reference(x, r, w, eps, offset):
    s = x + r
    return s * torch.rsqrt(s.square().mean(-1, keepdim=True) + eps) * (w + offset), s


def _sdpa(q, k, v, causal=False, sm_scale=None):
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=causal, scale=sm_scale, enable_gqa=q.shape[1] != k.shape[1])


def _cross_entropy_reference(*args):
    from portable_kernels.kernels.cross_entropy import reference

    return reference(*args)


def _flce_reference(*args):
    from portable_kernels.kernels.fused_linear_cross_entropy import reference

    return reference(*args)


# name -> (inputs(gen, device, requires_grad) -> args, float64 reference, tolerance kind).
# Shapes have tails (33 columns, 9 and 11 tokens) and GQA (4 query heads over 2).
CASES = {
    "vector_add": (lambda g, d, rg: (_randn(g, d, 5, 33, requires_grad=rg),
                                     _randn(g, d, 5, 33, requires_grad=rg)),
                   lambda x, y: x + y, "elementwise"),
    "softmax": (lambda g, d, rg: (_randn(g, d, 5, 33, requires_grad=rg), 0),
                lambda x, dim: torch.softmax(x, dim), "reduction"),
    "dropout": (lambda g, d, rg: (_randn(g, d, 5, 33, requires_grad=rg), 0.25, 1234),
                _dropout_reference, "elementwise"),
    "asin": (lambda g, d, rg: ((0.9 * torch.rand(5, 33, generator=g) * 2 - 0.9)
                               .to(d).requires_grad_(rg),),
             torch.asin, "elementwise"),
    "layer_norm": (lambda g, d, rg: (_randn(g, d, 3, 5, 33, requires_grad=rg),
                                     (1 + _randn(g, d, 33, scale=0.2)).requires_grad_(rg),
                                     _randn(g, d, 33, requires_grad=rg), 1e-5),
                   lambda x, w, b, eps: torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, eps),
                   "reduction"),
    "rms_norm": (lambda g, d, rg: (_randn(g, d, 3, 5, 33, requires_grad=rg),
                                   _randn(g, d, 33, scale=0.2).requires_grad_(rg), 1e-6, 1.0),
                 lambda x, w, eps, offset: x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * (w + offset),
                 "reduction"),
    "swiglu": (lambda g, d, rg: (_randn(g, d, 3, 5, 33, requires_grad=rg),
                                 _randn(g, d, 3, 5, 33, requires_grad=rg)),
               lambda gate, up: torch.nn.functional.silu(gate) * up, "elementwise"),
    # Fused: one (..., 2I) gate-up tensor.
    "geglu": (lambda g, d, rg: (_randn(g, d, 3, 5, 66, requires_grad=rg),),
              lambda gu: torch.nn.functional.gelu(gu[..., :33], approximate="tanh") * gu[..., 33:],
              "elementwise"),
    "matmul": (lambda g, d, rg: (_randn(g, d, 9, 33, requires_grad=rg),
                                 _randn(g, d, 33, 17, requires_grad=rg)),
               lambda a, b: a @ b, "dot"),
    "grouped_matmul": (lambda g, d, rg: ([_randn(g, d, 9, 33, requires_grad=rg),
                                          _randn(g, d, 3, 16, requires_grad=rg)],
                                         [_randn(g, d, 33, 5, requires_grad=rg),
                                          _randn(g, d, 16, 12, requires_grad=rg)]),
                       lambda la, lb: [a @ b for a, b in zip(la, lb)], "dot"),
    "flash_attn": (lambda g, d, rg: (_randn(g, d, 1, 4, 9, 16, requires_grad=rg),
                                     _randn(g, d, 1, 2, 11, 16, requires_grad=rg),
                                     _randn(g, d, 1, 2, 11, 16, requires_grad=rg), True, None),
                   _sdpa, "attention"),
    # A packed batch: sequences of 3 and 0 queries over 4 and 2 keys (causal: bottom-right).
    "flash_attn_varlen": (lambda g, d, rg: (_randn(g, d, 3, 4, 16, requires_grad=rg),
                                            _randn(g, d, 6, 2, 16, requires_grad=rg),
                                            _randn(g, d, 6, 2, 16, requires_grad=rg),
                                            torch.tensor([0, 3, 3], dtype=torch.int32, device=d),
                                            torch.tensor([0, 4, 6], dtype=torch.int32, device=d),
                                            3, 4, True),
                          lambda *a: _varlen_reference(*a), "attention"),
    "rope": (_rope_inputs, _rope_reference, "elementwise"),
    "add_rms_norm": (lambda g, d, rg: (_randn(g, d, 3, 5, 33, requires_grad=rg),
                                       _randn(g, d, 3, 5, 33, requires_grad=rg),
                                       _randn(g, d, 33, scale=0.2).requires_grad_(rg), 1e-6, 1.0),
                     _add_rms_norm_reference, "reduction"),
    # Every option on, a third of the rows ignored (-100), per-row losses.
    "cross_entropy": (lambda g, d, rg: (_randn(g, d, 6, 37, scale=3.0, requires_grad=rg),
                                        torch.tensor([3, -100, 0, 36, -100, 5], device=d),
                                        -100, 0.1, 1e-2, 8.0, "none"),
                      _cross_entropy_reference, "reduction"),
    # Three chunks of four tokens, a bias, every option; "mean": gradients from the forward.
    "fused_linear_cross_entropy": (
        lambda g, d, rg: (_randn(g, d, 12, 32, requires_grad=rg),
                          _randn(g, d, 100, 32, scale=0.3, requires_grad=rg),
                          torch.tensor([3, -100, 0, 99, 5, 7, -100, 1, 2, 50, 60, 70], device=d),
                          _randn(g, d, 100, scale=0.3, requires_grad=rg),
                          -100, 0.1, 1e-2, 8.0, "mean"),
        _flce_reference, "dot"),
}


def _varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, causal):
    from portable_kernels.kernels import flash_attn_varlen
    return flash_attn_varlen.reference(q, k, v, cu_q, cu_k, causal=causal)


def _double(value):
    if isinstance(value, torch.Tensor):
        return value.detach().double().requires_grad_(value.requires_grad)
    if isinstance(value, list):
        return [_double(v) for v in value]
    return value


def _leaves(args):
    out = []
    for a in args:
        out.extend(a if isinstance(a, list) else [a])
    return [t for t in out if isinstance(t, torch.Tensor) and t.requires_grad]


def _flat(out):
    return list(out) if isinstance(out, (list, tuple)) else [out]


#: Operators with no backward (inference calls that write caches in place): opcheck,
#: values and torch.compile in their own test file, not through CASES.
INFERENCE_OPS = {"kv_cache_write": "tests/test_flash_attn_kvcache.py",
                 "flash_attn_with_kvcache": "tests/test_flash_attn_kvcache.py"}


def test_every_kernel_is_an_op():
    assert set(ops.OPS) == set(CASES) | set(INFERENCE_OPS) == set(pk.list_kernels())
    for name in ops.OPS:
        assert callable(getattr(ops, name))
        assert hasattr(torch.ops.portable_kernels, name)


@pytest.mark.parametrize("name", list(CASES))
def test_opcheck(name, gen, device):
    inputs, _, _ = CASES[name]
    torch.library.opcheck(getattr(torch.ops.portable_kernels, name).default,
                          inputs(gen, device, True))


def test_opcheck_stage_ops(gen, device):
    """The forward/backward halves behind layer_norm, rms_norm, add_rms_norm, flash_attn,
    rope, cross_entropy and fused_linear_cross_entropy."""
    ln = torch.ops.portable_kernels
    x, w, b, eps = CASES["layer_norm"][0](gen, device, True)
    torch.library.opcheck(ln.layer_norm_forward.default, (x, w, b, eps))
    with torch.no_grad():
        _, mean, rstd = ln.layer_norm_forward(x, w, b, eps)
    dy = torch.randn_like(x)
    torch.library.opcheck(ln.layer_norm_backward.default, (dy, x.detach(), w.detach(), mean, rstd))

    x, w, eps, offset = CASES["rms_norm"][0](gen, device, True)
    torch.library.opcheck(ln.rms_norm_forward.default, (x, w, eps, offset))
    with torch.no_grad():
        _, rstd = ln.rms_norm_forward(x, w, eps, offset)
    dy = torch.randn_like(x)
    torch.library.opcheck(ln.rms_norm_backward.default, (dy, x.detach(), w.detach(), rstd, offset))

    x, r, w, eps, offset = CASES["add_rms_norm"][0](gen, device, True)
    torch.library.opcheck(ln.add_rms_norm_forward.default, (x, r, w, eps, offset))
    with torch.no_grad():
        _, summed, rstd = ln.add_rms_norm_forward(x, r, w, eps, offset)
    dy, dres = torch.randn_like(x), torch.randn_like(x)
    torch.library.opcheck(ln.add_rms_norm_backward.default, (dy, dres, summed, w.detach(), rstd, offset))

    q, k, cos, sin, positions, interleaved = CASES["rope"][0](gen, device, False)
    torch.library.opcheck(ln.rope_backward.default, (q, k, cos, sin, positions, interleaved))

    q, k, v, causal, scale = CASES["flash_attn"][0](gen, device, True)
    # opcheck compares eager and compiled gradients: on GPUs fp32 attention runs tf32 dots,
    # whose rounding differs between the two beyond opcheck's default fp32 bound.
    attn = tolerance(F32, "attention")
    torch.library.opcheck(ln.flash_attn_forward.default, (q, k, v, causal, scale),
                          atol=attn.atol, rtol=attn.rtol)
    with torch.no_grad():
        out, lse = ln.flash_attn_forward(q, k, v, causal, scale)
    do = torch.randn_like(out)
    torch.library.opcheck(ln.flash_attn_backward.default,
                          (do, q.detach(), k.detach(), v.detach(), out, lse, causal, scale),
                          atol=attn.atol, rtol=attn.rtol)

    logits, target, *options = CASES["cross_entropy"][0](gen, device, True)
    for reduction in ("mean", "none"):
        options[-1] = reduction
        torch.library.opcheck(ln.cross_entropy_forward.default, (logits, target, *options))
        with torch.no_grad():
            loss, lse = ln.cross_entropy_forward(logits, target, *options)
        torch.library.opcheck(ln.cross_entropy_backward.default,
                              (torch.randn_like(loss), logits.detach(), target, lse, *options))

    hidden, weight, target, bias, *options = CASES["fused_linear_cross_entropy"][0](gen, device, True)
    for reduction, b in (("sum", bias), ("mean", None)):
        options[-1] = reduction
        torch.library.opcheck(ln.fused_linear_cross_entropy_forward.default,
                              (hidden, weight, target, b, *options))
    for reduction, b in (("none", bias), ("mean", None)):
        options[-1] = reduction
        torch.library.opcheck(ln.fused_linear_cross_entropy_loss.default,
                              (hidden, weight, target, b, *options))
        grad = torch.randn(12 if reduction == "none" else (), device=device)
        torch.library.opcheck(ln.fused_linear_cross_entropy_backward.default,
                              (grad, hidden.detach(), weight.detach(), target,
                               None if b is None else b.detach(), *options))


@pytest.mark.parametrize("path", ["ops", "torch.ops"])
@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_gradients_match_torch(name, path, gen, device):
    """Through ``ops.<name>`` (eager: the kernel's handle) and through the operator
    itself (the dispatcher, its registered autograd)."""
    inputs, reference, kind = CASES[name]
    args = inputs(gen, device, True)
    ref_args = [_double(a) for a in args]
    fn = getattr(ops if path == "ops" else torch.ops.portable_kernels, name)
    out = _flat(fn(*args))
    ref = _flat(reference(*ref_args))
    tol = tolerance(F32, kind)
    for o, r in zip(out, ref):
        assert o.shape == r.shape and o.dtype == F32
        assert_close(o, r, tol, f"{name} output")

    grads_out = [torch.randn(o.shape, generator=gen).to(device) for o in out]
    torch.autograd.backward(out, grads_out)
    torch.autograd.backward(ref, [g.double() for g in grads_out])
    # Gradients chain a second computation (sums over rows for layer_norm's weight and
    # bias): a wider fp32 tolerance; the families' own tests pin their accuracy down.
    grad_tol = Tolerance(max(tol.atol, 1e-4), max(tol.rtol, 1e-4))
    for i, (leaf, ref_leaf) in enumerate(zip(_leaves(args), _leaves(ref_args))):
        assert leaf.grad is not None, f"{name}: no gradient for input {i}"
        assert_close(leaf.grad, ref_leaf.grad, grad_tol, f"{name} gradient of input {i}")


def test_eager_calls_take_the_handle_and_traced_ones_the_operator(gen, device):
    """``ops.<name>`` runs the kernel's handle in eager code (its autograd Function, its
    replays) and the operator under a dispatch mode (fake tensors here; tracing and
    opcheck alike) or torch.jit.trace, where a handle could not run or be seen."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    x = _randn(gen, device, 4, 32, requires_grad=True)
    w = _randn(gen, device, 32, requires_grad=True)
    assert type(ops.rms_norm(x, w).grad_fn).__name__ == "_RMSNormFunctionBackward"
    assert "rms_norm_forward" in type(torch.ops.portable_kernels.rms_norm(x, w).grad_fn).__name__
    with FakeTensorMode():
        out = ops.rms_norm(torch.empty(4, 32, device=device), torch.empty(32, device=device))
    assert isinstance(out, FakeTensor) and out.shape == (4, 32)
    traced = torch.jit.trace(lambda a, b: ops.rms_norm(a, b), (x.detach(), w.detach()))
    assert "portable_kernels::rms_norm" in str(traced.graph)  # not the handle's launches
    from portable_kernels import dispatch

    # Handles trace as the operators themselves, never as these eager-first functions.
    assert all(dispatch.TRACED_OPS[name] is getattr(ops, name).op for name in ops.OPS)


def test_dropout_backward_reuses_the_mask(gen, device):
    x = _randn(gen, device, 4, 100, requires_grad=True)
    out = ops.dropout(x, 0.5, 99)
    out.backward(torch.ones_like(out))
    # d(out)/dx is 2 where kept and 0 where dropped: the same mask as the forward.
    assert torch.equal(x.grad, (out != 0).to(F32) * 2)


@pytest.mark.skipif(not ON_CPU, reason="forces a variant the interpreter cannot run")
def test_selection_runs_inside_the_op(gen, device):
    """use_variant reaches the op: a forced variant the device cannot run is refused."""
    x = _randn(gen, device, 8)
    with pk.use_variant(asin="generic"), pytest.raises(pk.VariantUnavailableError, match="libdevice"):
        ops.asin(x)


def test_kernel_errors_pass_through(device):
    x = torch.ones(8, dtype=torch.int32, device=device)
    with pytest.raises(pk.DTypeError, match="vector_add"):
        ops.vector_add(x, x)
    with pytest.raises(pk.InputError, match="matmul"):
        ops.matmul(torch.ones(2, 3, device=device), torch.ones(4, 5, device=device))


class _Handles:
    """The kernels as ``pk.get_kernel`` handles, under the ops' names: what users call."""

    def __init__(self):
        for name in ops.OPS:
            setattr(self, name, pk.get_kernel(name))


class _Block(torch.nn.Module):
    """A pre-norm attention block made of nothing but our kernels (and a tanh for asin),
    called through ``calls``: the ``ops`` module or handles."""

    def __init__(self, gen, calls=ops, dim=32, heads=2, kv_heads=1):
        super().__init__()
        self.calls = calls
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        width = dim + 2 * kv_heads * self.head_dim
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(dim, generator=gen))
        self.bias = torch.nn.Parameter(0.1 * torch.randn(dim, generator=gen))
        self.qkv = torch.nn.Parameter(torch.randn(dim, width, generator=gen) / dim ** 0.5)
        self.proj = torch.nn.Parameter(torch.randn(dim, dim, generator=gen) / dim ** 0.5)
        from portable_kernels.kernels.rope import tables

        # Partial rotary (12 of 16 dims), as buffers: no gradient.
        self.register_buffer("cos", tables(8, 12)[0])
        self.register_buffer("sin", tables(8, 12)[1])

    def forward(self, x):
        ops = self.calls
        b, n, dim = x.shape
        h = ops.layer_norm(x, self.weight, self.bias)
        qkv = ops.matmul(h.reshape(b * n, dim), self.qkv)
        kv_width = self.kv_heads * self.head_dim
        q, k, v = qkv.split([dim, kv_width, kv_width], dim=-1)
        q = q.reshape(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = k.reshape(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.reshape(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = ops.rope(q.transpose(1, 2), k.transpose(1, 2), self.cos, self.sin)
        a = ops.flash_attn(q.transpose(1, 2), k.transpose(1, 2), v, causal=True)
        a = a.transpose(1, 2).reshape(b * n, dim)
        o = ops.dropout(ops.matmul(a, self.proj).reshape(b, n, dim), 0.1, 1234)
        o, res = ops.add_rms_norm(o, x, self.weight, 1e-6, 0.0)
        o = ops.rms_norm(o, self.weight, 1e-6, 1.0)
        o = ops.swiglu(o, ops.geglu(torch.cat([o, x], dim=-1)))
        # asin's slope grows without bound towards +-1, where an ulp of difference between
        # Inductor's tanh and eager's would outgrow the tolerance: keep within +-0.5.
        return ops.softmax(ops.asin(0.5 * torch.tanh(ops.vector_add(res, o))), dim=-1)


# torch 2.13's own compile stack calls torch.jit.script_method, which it deprecates.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("calls", ["ops", "handles"])
def test_torch_compile_fullgraph_matches_eager(calls, gen, device):
    """Through the ops and through handles: a handle traces as its op (no graph break),
    forward and backward."""
    torch._dynamo.reset()
    block = _Block(gen).to(device)
    x = _randn(gen, device, 2, 8, 32, requires_grad=True)
    params = [*block.parameters(), x]

    # The eager side through the ops (a traced handle is its op, and an eager handle
    # call that needs a gradient takes it too).
    eager = block(x)
    eager.square().sum().backward()
    eager_grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None

    # fullgraph: any graph break (an untraceable launch) is an error, not a silent split.
    if calls == "handles":
        block.calls = _Handles()
    compiled = torch.compile(block, fullgraph=True, backend="inductor")(x)
    compiled.square().sum().backward()
    tol = Tolerance(1e-5, 1e-5)
    assert_close(compiled, eager, tol, "compiled output")
    for i, (p, g) in enumerate(zip(params, eager_grads)):
        assert_close(p.grad, g, tol, f"compiled gradient {i}")


def test_handles_made_inside_a_compiled_function_in_a_fresh_process():
    """``pk.get_kernel(...)`` called inside the compiled function, as the library's first
    use in the process (no plugin host yet, whose building cannot be traced): fullgraph,
    forward and backward, against torch."""
    import subprocess
    import sys

    code = textwrap.dedent(f"""
        import torch, portable_kernels as pk
        from portable_kernels import plugins
        from portable_kernels.testing import Tolerance, max_error, tolerance
        assert plugins._HOST is None
        device = {str(DEVICE)!r}

        def f(q, x):
            out = pk.get_kernel("flash_attn")(q, q, q, causal=True)
            return out, pk.get_kernel("softmax")(x)

        torch.manual_seed(0)
        q = torch.randn(1, 2, 40, 16, device=device, requires_grad=True)
        x = torch.randn(4, 33, device=device)
        out, sm = torch.compile(f, fullgraph=True)(q, x)
        out.square().sum().backward()
        q64 = q.detach().double().requires_grad_()
        ref = torch.nn.functional.scaled_dot_product_attention(q64, q64, q64, is_causal=True)
        ref.square().sum().backward()
        # Error over allowed error: the table's bounds (fp32 products may run as tf32 on a
        # GPU), the gradient's scaled by its largest element as tests/test_flash_attn.py does.
        attn = tolerance(torch.float32, "attention")
        grad = Tolerance(attn.atol * max(1.0, q64.grad.abs().max().item()), attn.rtol)
        print(max_error(out, ref, attn)[1], max_error(q.grad, q64.grad, grad)[1],
              max_error(sm, torch.softmax(x.double(), -1), tolerance(torch.float32, "reduction"))[1])
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ratios = [float(e) for e in done.stdout.split()]
    assert len(ratios) == 3 and all(r <= 1.0 for r in ratios), ratios


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_handle_of_a_kernel_without_an_op_runs_eagerly_under_compile(fresh_host, device):
    """A plugin's own family has no torch operator: under torch.compile its handle's call
    is a graph break around the eager call, which still selects and launches."""
    from typing import NamedTuple

    from portable_kernels import KernelSpec, Variant, hookimpl

    class Problem(NamedTuple):
        device: torch.device

    class Plugin:
        @hookimpl
        def pk_register_variants(self, registry):
            registry.add_kernel(KernelSpec("twice", "(x) -> out", lambda x: Problem(x.device),
                                           "x * 2"))
            registry.add_variant(Variant("twice", "generic", lambda plan, x: x * 2))

    fresh_host(Plugin())
    twice = pk.get_kernel("twice")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    x = torch.randn(8, device=device)
    out = torch.compile(lambda t: twice(t + 1) - 1, backend="eager")(x)
    assert torch.equal(out, (x + 1) * 2 - 1)
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) >= 1
