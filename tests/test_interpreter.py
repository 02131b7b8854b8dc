"""What users of the CPU backend (Triton's interpreter) see besides results: no numpy
warnings from inputs with NaN or inf, and, when the interpreter cannot be used, advice
that works the first time."""
from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

import portable_kernels as pk
import triton  # after portable_kernels, which chooses the interpreter
import triton.language as tl

from conftest import DEVICE

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="about Triton's CPU interpreter")

INF, NAN = float("inf"), float("nan")


def _special(*shape):
    """Random values with -inf, +inf and NaN planted in them."""
    x = torch.randn(*shape)
    flat = x.view(-1)
    flat[0], flat[-1], flat[flat.numel() // 2] = -INF, INF, NAN
    return x


def _attention_reference(q, k, v):
    from portable_kernels.kernels.flash_attn import reference

    return reference(q, k, v)


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _four_x_plus_one(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, _twice(_twice(tl.load(x_ptr + offs))) + 1)


def _nan_at(x, index):
    x[index] = NAN
    return x


CASES = {
    "softmax": (lambda: (_special(4, 33),), lambda x: torch.softmax(x, -1)),
    "softmax, a row of -inf": (lambda: (torch.full((2, 8), -INF),), lambda x: torch.softmax(x, -1)),
    "layer_norm": (lambda: (_special(4, 33), torch.ones(33), torch.zeros(33)),
                   lambda x, w, b: torch.nn.functional.layer_norm(x, (33,), w, b)),
    # Against the float64 softmax(q·kᵀ)·v written out: SDPA's CPU kernel returns zeros for
    # most of a NaN query's row. Infinite scores have no agreed result at all, so the
    # infinities go into v.
    "flash_attn": (lambda: (_nan_at(torch.randn(1, 2, 9, 16), (0, 1, 3, 5)), torch.randn(1, 2, 11, 16),
                            _special(1, 2, 11, 16)),
                   lambda q, k, v: _attention_reference(q, k, v).float()),
    "grouped_matmul": (lambda: ([_special(5, 16)], [torch.randn(16, 8)]),
                       lambda la, lb: [a @ b for a, b in zip(la, lb)]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_special_values_raise_no_numpy_warnings(case):
    make, reference = CASES[case]
    args = make()
    kernel = case.split(",")[0]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = pk.get_kernel(kernel)(*args)
    runtime = [w for w in seen if issubclass(w.category, RuntimeWarning)]
    assert not runtime, f"{kernel} warned: {[str(w.message) for w in runtime]}"
    # And the values are torch's, NaN where torch has NaN.
    for o, r in zip(out if isinstance(out, list) else [out], _listed(reference(*args))):
        assert torch.equal(o.isnan(), r.isnan()), f"{kernel}: NaNs differ from torch's"
        keep = ~r.isnan()
        torch.testing.assert_close(o[keep], r[keep], atol=1e-4, rtol=1e-4)


def _listed(out):
    return out if isinstance(out, list) else [out]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_triton_imported_first_says_to_import_portable_kernels_first():
    """With triton imported before portable_kernels on a machine without a GPU, no setting
    made afterwards helps: the first error says so, instead of advising PK_INTERPRET=1
    (which then failed with a second error)."""
    code = ("import triton, torch, portable_kernels as pk\n"
            "pk.get_kernel('softmax')(torch.randn(2, 3))\n")
    for env in ({}, {"PK_INTERPRET": "1"}):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=300, env=_env(env))
        assert proc.returncode != 0
        last = proc.stderr.strip().splitlines()[-1]
        assert "DeviceError" in last and "import portable_kernels" in last, last
        assert "move the tensors to the GPU" not in last, last


def _env(extra: dict) -> dict:
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PK_INTERPRET")}
    env.update(extra)
    return env



def test_helpers_share_their_kernels_language_patches(monkeypatch):
    """A ``@triton.jit`` helper called inside an interpreted kernel reuses the patches of
    the kernel's launch instead of walking ``triton.language`` again (``_SharedPatches``);
    results are unchanged, and the launch's end restores the language as Triton would."""
    from triton.runtime import interpreter

    from portable_kernels import _interpreter

    with _interpreter.Serialized():  # installs the wrapper, as every launch of ours does
        pass
    shared = interpreter._patch_lang
    assert isinstance(shared, _interpreter._SharedPatches)
    patched, real = [], shared.patch_lang
    monkeypatch.setattr(shared, "patch_lang", lambda fn: patched.append(fn.__name__) or real(fn))
    load = tl.load
    x, out = torch.randn(16), torch.full((16,), NAN)
    with _interpreter.Serialized():
        _four_x_plus_one[(1,)](x, out, N=16)
    torch.testing.assert_close(out, x * 4 + 1)
    assert patched == ["_four_x_plus_one"]  # the helper's two calls patched nothing
    assert tl.load is load and shared.patched is None  # restored at the launch's end
