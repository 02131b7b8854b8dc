"""rope against float64 references and two independent formulations (transformers'
rotate_half, Meta's complex product), its backward as the adjoint of the forward, packed
against batched calls, positions, poisoned outputs, and errors that name the argument."""
from __future__ import annotations

import pytest
import torch

import portable_kernels as pk
from portable_kernels.conformance.harness import Inputs
from portable_kernels.conformance.test_rope import tolerance_for
from portable_kernels.kernels.rope import reference, tables
from portable_kernels.testing import assert_close, tolerance

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def rope(*args, **kwargs):
    return pk.get_kernel("rope")(*args, **kwargs)


def _randn(gen, device, dtype, *shape):
    return torch.randn(shape, generator=gen).to(device, dtype)


# (q shape, k heads, rotary_dim, interleaved, positions): half and interleaved pairs,
# rotary_dim below D with an odd half, GQA, packed tokens with positions.
CASES = {
    "llama-gqa": ((2, 7, 4, 16), 2, 16, False, False),
    "gptj-partial": ((3, 5, 2, 20), 1, 12, True, False),
    "odd-half": ((1, 9, 3, 24), 3, 10, False, True),
    "packed-positions": ((13, 4, 32), 1, 20, True, True),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_backward(case, dtype, gen, device, nan_empty):
    shape, hk, rot, interleaved, with_pos = CASES[case]
    q = _randn(gen, device, dtype, *shape).requires_grad_()
    k = _randn(gen, device, dtype, *shape[:-2], hk, shape[-1]).requires_grad_()
    cos, sin = tables(40, rot, device=device)
    positions = torch.randint(0, 40, shape[:-2], generator=gen).to(device) if with_pos else None
    q_out, k_out = rope(q, k, cos, sin, positions, interleaved)
    assert q_out.dtype == dtype and q_out.shape == q.shape and q_out.is_contiguous()
    assert k_out.shape == k.shape and k_out.is_contiguous()
    q64, k64 = (t.detach().double().requires_grad_() for t in (q, k))
    refs = reference(q64, k64, cos, sin, positions, interleaved)
    inputs = Inputs((q, k, cos, sin))
    tol = tolerance(dtype, "elementwise")
    for i, (out, ref) in enumerate(zip((q_out, k_out), refs)):
        assert_close(out, ref, tolerance_for(tol, f"out[{i}]", ref, inputs, None), f"out[{i}]")

    grads = [_randn(gen, device, dtype, *t.shape) for t in (q_out, k_out)]
    dq, dk = torch.autograd.grad((q_out, k_out), (q, k), grads)
    dq64, dk64 = torch.autograd.grad(refs, (q64, k64), [g.double() for g in grads])
    assert_close(dq, dq64, tolerance_for(tol, "dq", dq64, inputs, grads), "dq")
    assert_close(dk, dk64, tolerance_for(tol, "dk", dk64, inputs, grads), "dk")


def test_half_rotation_is_transformers_rotate_half(gen, device):
    """Llama's ``q * cos + rotate_half(q) * sin`` with the tables repeated over both halves."""
    q, k = _randn(gen, device, torch.float32, 2, 6, 3, 16), _randn(gen, device, torch.float32, 2, 6, 1, 16)
    cos, sin = tables(6, 16, device=device)
    cos2, sin2 = (torch.cat((t, t), -1)[:, None, :].double() for t in (cos, sin))

    def rotate_half(x):
        return torch.cat((-x[..., 8:], x[..., :8]), -1)

    for out, x in zip(rope(q, k, cos, sin), (q, k)):
        x = x.double()
        assert_close(out, x * cos2 + rotate_half(x) * sin2, tolerance(torch.float32, "elementwise"))


def test_interleaved_is_a_complex_product(gen, device):
    """GPT-J / Meta's pairs (2j, 2j + 1) as complex numbers times e^(i angle)."""
    q = _randn(gen, device, torch.float32, 1, 5, 2, 12)
    cos, sin = tables(5, 12, device=device)
    out, _ = rope(q, q, cos, sin, interleaved=True)
    z = torch.view_as_complex(q.double().reshape(1, 5, 2, 6, 2).contiguous())
    turn = torch.complex(cos.double(), sin.double())[:, None, :]
    expected = torch.view_as_real(z * turn).reshape(q.shape)
    assert_close(out, expected, tolerance(torch.float32, "elementwise"))


def test_backward_is_the_adjoint(gen, device):
    """<rope(q), g> = <q, dq>: the backward kernel (sin negated) is the forward's transpose,
    checked without the reference."""
    q, k = _randn(gen, device, torch.float32, 2, 4, 2, 10).requires_grad_(), \
        _randn(gen, device, torch.float32, 2, 4, 1, 10).requires_grad_()
    cos, sin = tables(4, 8, device=device)
    q_out, k_out = rope(q, k, cos, sin, interleaved=True)
    gq, gk = torch.randn_like(q_out), torch.randn_like(k_out)
    dq, dk = torch.autograd.grad((q_out, k_out), (q, k), (gq, gk))
    for out, g, x, dx in ((q_out.detach(), gq, q.detach(), dq), (k_out.detach(), gk, k.detach(), dk)):
        lhs, rhs = (out.double() * g.double()).sum(), (x.double() * dx.double()).sum()
        assert abs(float(lhs - rhs)) <= 1e-5 * float((out.double() * g.double()).abs().sum())
        # A rotation keeps each pair's norm, so the whole tensor's.
        assert torch.allclose(out.norm(), x.norm(), rtol=1e-5)


def test_packed_and_default_positions_agree_with_batched(gen, device):
    """A packed batch with each sequence's 0..S-1 as positions is the batched call."""
    b, s, h, d = 3, 5, 2, 16
    q, k = _randn(gen, device, torch.float32, b, s, h, d), _randn(gen, device, torch.float32, b, s, 1, d)
    cos, sin = tables(8, 12, device=device)
    batched = rope(q, k, cos, sin)
    explicit = rope(q, k, cos, sin, torch.arange(s, device=device).expand(b, s))
    positions = torch.arange(s, dtype=torch.int32, device=device).repeat(b)
    packed = rope(q.reshape(b * s, h, d), k.reshape(b * s, 1, d), cos, sin, positions)
    for want, got, got2 in zip(batched, explicit, packed):
        assert torch.equal(want, got) and torch.equal(want.reshape(got2.shape), got2)


def test_inputs_untouched_and_outputs_new(gen, device):
    q = _randn(gen, device, torch.float32, 2, 3, 2, 8)
    before = q.clone()
    cos, sin = tables(3, 8, device=device)
    q_out, k_out = rope(q, q, cos, sin)
    assert torch.equal(q, before)
    assert q_out.data_ptr() != q.data_ptr() and k_out.data_ptr() != q_out.data_ptr()


def test_empty(device):
    cos, sin = tables(4, 8, device=device)
    for q in (torch.empty(0, 4, 2, 8, device=device), torch.empty(0, 2, 8, device=device)):
        q_out, k_out = rope(q, q, cos, sin)
        assert q_out.shape == q.shape and k_out.shape == q.shape


def test_position_values_checked_only_when_asked(monkeypatch, gen, device):
    """Positions past the tables need their values on the host to be refused: an error
    under PK_CHECK_VALUES=1; otherwise (no sync) such a token's rows come out NaN, never
    from memory past the tables, and the others are exact."""
    q = _randn(gen, device, torch.float32, 4, 2, 8)
    cos, sin = tables(6, 8, device=device)
    positions = torch.tensor([0, 5, 6, 2], device=device)
    monkeypatch.setenv("PK_CHECK_VALUES", "1")
    with pytest.raises(pk.InputError, match=r"rope: positions must lie in 0\.\.5 .*got 0\.\.6"):
        rope(q, q, cos, sin, positions)
    with pytest.raises(pk.InputError, match=r"got -1\.\.2"):
        rope(q, q, cos, sin, torch.tensor([0, -1, 2, 2], device=device))
    monkeypatch.delenv("PK_CHECK_VALUES")
    q_out, _ = rope(q, q, cos, sin, positions)
    assert q_out[2].isnan().all() and not q_out[[0, 1, 3]].isnan().any()
    good = torch.tensor([0, 1, 3])
    ref, _ = reference(q[good], q[good], cos, sin, positions[good])
    assert_close(q_out[good], ref, tolerance(torch.float32, "elementwise"))


def _errors():
    def args(device, **change):
        a = dict(q=torch.randn(2, 5, 4, 16, device=device), k=torch.randn(2, 5, 2, 16, device=device),
                 cos=torch.randn(8, 6, device=device), sin=torch.randn(8, 6, device=device))
        a.update({k: (v(device) if callable(v) else v) for k, v in change.items()})
        return a

    return [
        (dict(cos=lambda d: torch.randn(8, 9, device=d), sin=lambda d: torch.randn(8, 9, device=d)),
         r"rope: rotary_dim = 2 \* cos.shape\[1\] = 18 must be in 2\.\.D \(D=16\)"),
        (dict(cos=lambda d: torch.randn(8, 0, device=d), sin=lambda d: torch.randn(8, 0, device=d)),
         r"rope: rotary_dim = 2 \* cos.shape\[1\] = 0 must be in 2\.\.D"),
        (dict(sin=lambda d: torch.randn(8, 5, device=d)), r"rope: cos and sin must both be"),
        (dict(cos=lambda d: torch.randn(48, device=d)), r"rope: cos and sin must both be"),
        (dict(cos=lambda d: torch.randn(4, 6, device=d), sin=lambda d: torch.randn(4, 6, device=d)),
         r"rope: cos and sin have 4 positions, fewer than the sequence length S=5"),
        (dict(q=lambda d: torch.randn(10, 4, 16, device=d), k=lambda d: torch.randn(10, 2, 16, device=d),
              cos=lambda d: torch.randn(9, 6, device=d), sin=lambda d: torch.randn(9, 6, device=d)),
         r"rope: cos and sin have 9 positions, fewer than the tokens T=10"),
        (dict(positions=lambda d: torch.zeros(2, 4, dtype=torch.int64, device=d)),
         r"rope: positions must have shape \(2, 5\)"),
        (dict(positions=lambda d: torch.zeros(10, dtype=torch.int64, device=d)),
         r"rope: positions must have shape \(2, 5\)"),
        (dict(positions=lambda d: torch.zeros(2, 5, device=d)), r"rope: positions has dtype float32"),
        (dict(positions=lambda d: torch.zeros(2, 5, dtype=torch.int16, device=d)),
         r"rope: positions has dtype int16"),
        (dict(positions=[0, 1, 2, 3, 4]), r"rope: positions must be a torch.Tensor"),
        (dict(k=lambda d: torch.randn(2, 6, 2, 16, device=d)), r"rope: q and k must share"),
        (dict(k=lambda d: torch.randn(2, 5, 2, 8, device=d)), r"rope: q and k must share"),
        (dict(k=lambda d: torch.randn(10, 2, 16, device=d)), r"rope: q and k must share"),
        (dict(q=lambda d: torch.randn(10, 16, device=d)), r"rope: q must be \(B, S, H, D\) or packed"),
        (dict(k=lambda d: torch.randn(2, 5, 2, 16, device=d).half()), r"rope: dtypes must match"),
        (dict(cos=lambda d: torch.ones(8, 6, dtype=torch.int32, device=d)), r"rope: cos has dtype int32"),
        (dict(interleaved="yes"), r"rope: interleaved must be a bool"),
        (dict(cos=lambda d: torch.randn(8, 6, device=d, requires_grad=True)),
         r"rope: cos and sin take no gradient"),
    ], args


ERRORS, _ARGS = _errors()


@pytest.mark.parametrize("change, match", ERRORS, ids=[f"e{i}" for i in range(len(ERRORS))])
def test_errors_name_the_argument(change, match, device):
    with pytest.raises(pk.PortableKernelsError, match=match):
        rope(**_ARGS(device, **change))


def test_op_refuses_a_differentiable_table(device):
    """The torch operator too: no gradient would reach cos or sin."""
    from portable_kernels import ops

    q = torch.randn(1, 2, 1, 4, device=device, requires_grad=True)
    cos, sin = tables(2, 4, device=device)
    with pytest.raises(pk.InputError, match="rope: cos and sin take no gradient"):
        ops.rope(q, q, cos.requires_grad_(), sin)
