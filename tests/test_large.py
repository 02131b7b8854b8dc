"""Every family past 2**31 elements, on a GPU: offsets that overflow 32 bits wrap to
negative addresses (an illegal memory access, or silently wrong elements).

What wrapped before: the Gluon attention forward's output store (batch times its stride:
(33, 32, 16384, 128) crashed the default flash_attn variant on the H200) and its backward's
dk/dv stores; column offsets of strided rows in softmax and layer_norm (softmax over dim 0
of a (32769, 65537) tensor: column stride 65537, column index up to 32768); attention's
pointer loads within one head of a (B, N, H, D) layout (sequence stride H·D = 4096 past
524288 keys).

Marked ``large`` (``-m "not large"`` leaves them out); each skips where the GPU has too
little free memory for it. Outputs are poisoned (NaN) before the kernels run, and checked
against torch on the whole tensor, or for attention on the heads where offsets pass 2**31
and on the first one. Run them on their own (``pytest -m large``), not beside other
workers: each holds tens of GB.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch

import portable_kernels as pk

from conftest import DEVICE

pytestmark = [
    pytest.mark.large,
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE.type != "cuda", reason="tensors past 2**31 elements need a GPU "
                       "(the interpreter would take hours)"),
]

INT32_MAX = 2**31 - 1
GiB = 2**30


def _need(gib: float) -> None:
    free, _ = torch.cuda.mem_get_info(DEVICE)
    if free < gib * GiB:
        pytest.skip(f"needs {gib:.0f} GiB of free GPU memory, {free / GiB:.0f} GiB free")


@pytest.fixture(autouse=True)
def _release():
    yield
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


_SEEDS = itertools.count(1)


def _randn(*shape, dtype=torch.bfloat16, scale=1.0):
    """Random values of ``shape``, drawn in chunks (a float32 draw of the whole tensor
    would double the memory a test needs)."""
    g = torch.Generator(device=DEVICE)
    g.manual_seed(next(_SEEDS))  # each draw its own: q, k, v and dO must not be one tensor
    out = torch.empty(shape, device=DEVICE, dtype=dtype)
    flat = out.view(-1)
    step = 2**28
    for i in range(0, flat.numel(), step):
        part = flat[i:i + step]
        part.copy_(torch.randn(part.numel(), device=DEVICE, generator=g) * scale)
    return out


def _rms(t: torch.Tensor) -> float:
    flat, total = t.reshape(-1), 0.0
    for i in range(0, flat.numel(), 2**28):
        total += flat[i:i + 2**28].double().square().sum().item()
    return math.sqrt(total / max(1, flat.numel()))


def _assert_close(out, ref, rtol, what, atol=None):
    """``|out - ref| <= atol + rtol·|ref|`` for every element, in chunks on the GPU, with
    ``atol`` by default ``rtol`` times the reference's RMS: a fixed atol would hide every
    error in outputs as small as a softmax row of 65537 (about 1.5e-5) or attention over
    600000 keys (about 1e-3). NaN (an element left unwritten: outputs are poisoned) fails."""
    assert out.shape == ref.shape, (tuple(out.shape), tuple(ref.shape))
    atol = rtol * _rms(ref) if atol is None else atol
    o, r = out.reshape(-1), ref.reshape(-1)
    worst, at = 0.0, -1
    for i in range(0, o.numel(), 2**28):
        a, b = o[i:i + 2**28].double(), r[i:i + 2**28].double()
        ratio = (a - b).abs() / (atol + rtol * b.abs())
        ratio = torch.where(torch.isnan(ratio), torch.full_like(ratio, math.inf), ratio)
        m = ratio.max().item()
        if m > worst:
            worst, at = m, i + ratio.argmax().item()
    if worst > 1.0:
        raise AssertionError(
            f"{what}: worst element (flat index {at}) at {worst:.3g}x the allowed error: "
            f"{o[at].item():.6g} against {r[at].item():.6g} (atol {atol:.3g}, rtol {rtol:g})")


def _assert_attention_close(out, ref, rtol, what):
    """Attention's outputs and gradients: ``‖out - ref‖ / ‖ref‖ <= rtol`` over the slice
    (bf16 rounds P before P·V, and dS before dS·K: short causal rows, larger than the
    slice's RMS, carry errors that an elementwise bound at the RMS scale would call wrong),
    and every element within 10 rtol of the RMS scale (a tile read from a wrong address is
    off by the scale itself)."""
    o, r = out.double(), ref.double()
    rel = ((o - r).norm() / r.norm()).item()
    assert rel <= rtol, f"{what}: relative error {rel:.3g} > {rtol:g}"
    _assert_close(out, ref, 10 * rtol, what, atol=10 * rtol * _rms(ref))


def test_vector_add(nan_empty):
    _need(20)
    n = 2**31 + 4099
    x, y = _randn(n, dtype=torch.float16), _randn(n, dtype=torch.float16)
    out = pk.get_kernel("vector_add")(x, y)
    assert torch.equal(out, x + y)  # one rounding of the fp32 sum, as torch's


def test_asin_and_dropout(nan_empty):
    _need(32)
    n = 2**31 + 4099
    x = _randn(n, dtype=torch.float16, scale=0.3).clamp_(-1, 1)
    _assert_close(pk.get_kernel("asin")(x), torch.asin(x), 2e-3, "asin")
    out = pk.get_kernel("dropout")(x, 0.25, 1234)
    assert not torch.isnan(out).any(), "dropout left elements unwritten"
    kept = out != 0
    # A kept element is x / (1 - p); a dropped one 0 (x itself may be 0: then either).
    _assert_close(torch.where(kept, out, x / 0.75), x / 0.75, 1e-3, "dropout's kept values")
    frac = kept.float().mean().item()
    assert abs(frac - 0.75) < 1e-3, f"kept {frac:.4f} of the elements, expected 0.75"
    del kept
    # The mask is a function of (seed, offset): the same call draws it again, tail included.
    assert torch.equal(out, pk.get_kernel("dropout")(x, 0.25, 1234))


def test_softmax_rows_and_columns(nan_empty):
    """fp32: a row's values (about 1.5e-5) are subnormal in fp16."""
    _need(40)
    x = _randn(65537, 32769, dtype=torch.float32)
    softmax = pk.get_kernel("softmax")
    _assert_close(softmax(x), torch.softmax(x, -1), 1e-4, "softmax rows")
    # Over dim 0 the kernel reads rows of x.T in place: column stride 32769, column index
    # up to 65536.
    out = softmax(x, 0)
    assert out.shape == x.shape
    _assert_close(out, torch.softmax(x, 0), 1e-4, "softmax over dim 0")


def test_layer_norm_forward_backward_and_strided(nan_empty):
    _need(60)
    m, n = 65537, 32769
    x = _randn(m, n).requires_grad_(True)
    w = (1 + 0.1 * _randn(n, dtype=torch.float32)).to(torch.bfloat16).requires_grad_(True)
    b = (0.1 * _randn(n, dtype=torch.float32)).to(torch.bfloat16).requires_grad_(True)
    out = pk.get_kernel("layer_norm")(x, w, b)
    ref = torch.nn.functional.layer_norm(x.detach().float(), (n,), w.detach().float(),
                                         b.detach().float())
    _assert_close(out, ref, 2e-2, "layer_norm forward")
    del ref
    dy = _randn(m, n)
    out.backward(dy)
    # dx of a row needs only that row: check the first and last rows in float32.
    for rows in (slice(0, 64), slice(m - 64, m)):
        xs = x.detach()[rows].float().requires_grad_(True)
        ws = w.detach().float().requires_grad_(True)
        bs = b.detach().float().requires_grad_(True)
        torch.nn.functional.layer_norm(xs, (n,), ws, bs).backward(dy[rows].float())
        _assert_close(x.grad[rows], xs.grad, 5e-2, f"layer_norm dx rows {rows}")
    assert not torch.isnan(w.grad).any() and not torch.isnan(b.grad).any()
    db = dy.float().sum(0)
    _assert_close(b.grad, db, 2e-2, "layer_norm dbias")
    del out, dy, db
    # Rows of the transposed view: column stride 32769, column index up to 65536.
    x.grad = None
    xt = x.detach().t()
    w2 = torch.ones(xt.shape[-1], device=DEVICE, dtype=torch.bfloat16)
    out_t = pk.get_kernel("layer_norm")(xt, w2, torch.zeros_like(w2))
    ref_t = torch.nn.functional.layer_norm(xt.float(), (xt.shape[-1],))
    _assert_close(out_t, ref_t, 2e-2, "layer_norm of a transposed view")


@pytest.mark.parametrize("variant", [None, "nvidia.persistent_tma", "generic"])
def test_matmul_large_operand_and_output(variant, nan_empty):
    _need(40)
    mm = pk.get_kernel("matmul")
    with pk.use_variant(**({"matmul": variant} if variant else {})):
        # A past 2**31 elements (its rows times K).
        a = _randn(70000, 32768, scale=0.05)
        b = _randn(32768, 128, scale=0.05)
        _assert_close(mm(a, b), a @ b, 2e-2, "matmul, large A")
        del a, b
        # The output past 2**31 elements (its rows times N).
        a = _randn(70000, 64)
        b = _randn(64, 32768)
        _assert_close(mm(a, b), a @ b, 2e-2, "matmul, large output")


@pytest.mark.parametrize("variant", [None, "generic"])
def test_grouped_matmul_large_group(variant, nan_empty):
    _need(30)
    with pk.use_variant(**({"grouped_matmul": variant} if variant else {})):
        a = [_randn(70000, 32768, scale=0.05), _randn(300, 64)]
        b = [_randn(32768, 64, scale=0.05), _randn(64, 100)]
        outs = pk.get_kernel("grouped_matmul")(a, b)
        for g, (o, x, y) in enumerate(zip(outs, a, b)):
            _assert_close(o, x @ y, 2e-2, f"grouped_matmul group {g}")


def _reference_slice(q, k, v, do, causal):
    """Reference output and gradients of one (batch, head), in float64 (the family's
    reference written out: a float32 SDPA is itself a few ulp off at 16384 keys)."""
    from portable_kernels.kernels.flash_attn import reference

    q, k, v = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    out = reference(q, k, v, causal)
    out.backward(do.double())
    return out, q.grad, k.grad, v.grad


ATTENTION_VARIANTS = [None, "nvidia.hopper", "generic", "iluvatar.v2"]


@pytest.mark.parametrize("variant", ATTENTION_VARIANTS)
def test_flash_attn_large_batch(variant, nan_empty):
    """(33, 32, 16384, 128): batch 32 starts 2**31 + 2**26 elements in; the default variant
    on sm_90 (nvidia.hopper_gluon) faulted here. Forward and backward."""
    _need(70)
    shape = (33, 32, 16384, 128)
    assert math.prod(shape) > INT32_MAX
    q, k, v = (_randn(*shape).requires_grad_(True) for _ in range(3))
    attn = pk.get_kernel("flash_attn")
    with pk.use_variant(**({"flash_attn": variant} if variant else {})):
        out = attn(q, k, v, causal=True)
        do = _randn(*shape)
        out.backward(do)
    for b, h in ((32, 31), (32, 0), (0, 0)):  # past 2**31 first
        ref, dq, dk, dv = _reference_slice(q[b:b + 1, h:h + 1], k[b:b + 1, h:h + 1],
                                      v[b:b + 1, h:h + 1], do[b:b + 1, h:h + 1], True)
        where = f"{variant or 'default'} (batch {b}, head {h})"
        _assert_attention_close(out[b:b + 1, h:h + 1], ref, 1e-2, f"out {where}")
        for name, got, want in (("dq", q.grad, dq), ("dk", k.grad, dk), ("dv", v.grad, dv)):
            _assert_attention_close(got[b:b + 1, h:h + 1], want, 2e-2, f"{name} {where}")
    for name, t in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert not torch.isnan(t).any(), f"{name}: elements left unwritten"


@pytest.mark.parametrize("variant", ATTENTION_VARIANTS)
def test_flash_attn_long_keys_in_a_bnhd_layout(variant, nan_empty):
    """k, v (1, 600000, 32, 128) viewed as (B, H, N, D): within one head, key 600000 lies
    600000 · 4096 elements past the head's first, beyond 2**31."""
    _need(40)
    n_k = 600_000
    assert (n_k - 1) * 32 * 128 > INT32_MAX
    q = _randn(1, 128, 32, 128).transpose(1, 2).requires_grad_(True)
    k = _randn(1, n_k, 32, 128).transpose(1, 2).requires_grad_(True)
    v = _randn(1, n_k, 32, 128).transpose(1, 2).requires_grad_(True)
    with pk.use_variant(**({"flash_attn": variant} if variant else {})):
        out = pk.get_kernel("flash_attn")(q, k, v)
        do = _randn(1, 32, 128, 128)
        out.backward(do)
    for h in (31, 0):
        ref, dq, dk, dv = _reference_slice(q[:, h:h + 1], k[:, h:h + 1], v[:, h:h + 1],
                                      do[:, h:h + 1], False)
        where = f"{variant or 'default'} (head {h})"
        _assert_attention_close(out[:, h:h + 1], ref, 1e-2, f"out {where}")
        for name, got, want in (("dq", q.grad, dq), ("dk", k.grad, dk), ("dv", v.grad, dv)):
            _assert_attention_close(got[:, h:h + 1], want, 2e-2, f"{name} {where}")
