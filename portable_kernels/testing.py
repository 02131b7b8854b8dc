"""Helpers for testing kernels against their references: one tolerance table, poisoned
outputs and fresh random inputs. Used by the tests and the conformance suite.
"""
from __future__ import annotations

import dataclasses
import fnmatch

import torch

__all__ = [
    "ExpectedFailure", "Tolerance", "TOLERANCES", "tolerance", "assert_close", "max_error", "poison",
    "randn",
]


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """``|out - ref| <= atol + rtol * |ref|`` elementwise."""

    atol: float
    rtol: float

    def __str__(self) -> str:
        return f"atol={self.atol:g}, rtol={self.rtol:g}"


# One table for every kernel. Kinds: "elementwise" (one rounding of an fp32 result; the
# interpreter rounds bf16 toward zero, so 2 ulp), "reduction" (sums over a row), "dot"
# (matrix products: K-long fp32 accumulations; fp32 inputs may run as tf32 on GPUs; fp8
# inputs are exact and their bf16 output is rounded once, 2 ulp under the interpreter; on
# sm_90 the fp8 MMA also adds up to 128 products in fewer bits than fp32, which these
# entries cover for K of a few hundred, not thousands: bench/matmul.py checks long-K fp8
# products against cuBLAS's own error instead),
# "attention" (two chained dots through a softmax).
TOLERANCES: dict[tuple[str, torch.dtype], Tolerance] = {
    ("elementwise", torch.float32): Tolerance(1e-6, 1e-6),
    ("elementwise", torch.float16): Tolerance(1e-5, 2e-3),
    ("elementwise", torch.bfloat16): Tolerance(1e-5, 1.6e-2),
    ("reduction", torch.float32): Tolerance(1e-6, 1e-5),
    ("reduction", torch.float16): Tolerance(1e-4, 2e-3),
    ("reduction", torch.bfloat16): Tolerance(1e-3, 1.6e-2),
    ("dot", torch.float32): Tolerance(2e-2, 2e-2),
    ("dot", torch.float16): Tolerance(2e-2, 2e-2),
    ("dot", torch.bfloat16): Tolerance(1e-1, 5e-2),
    ("dot", torch.float8_e4m3fn): Tolerance(1e-2, 1.6e-2),
    ("dot", torch.float8_e5m2): Tolerance(1e-2, 1.6e-2),
    ("dot", torch.float8_e4m3fnuz): Tolerance(1e-2, 1.6e-2),  # the same mantissas as OCP's
    ("dot", torch.float8_e5m2fnuz): Tolerance(1e-2, 1.6e-2),
    ("attention", torch.float32): Tolerance(1e-2, 1e-2),
    ("attention", torch.float16): Tolerance(1e-2, 1e-2),
    ("attention", torch.bfloat16): Tolerance(5e-2, 5e-2),
}


def tolerance(dtype: torch.dtype, kind: str = "elementwise") -> Tolerance:
    """The tolerance for outputs of ``dtype`` from a kernel of ``kind``."""
    try:
        return TOLERANCES[(kind, dtype)]
    except KeyError:
        raise KeyError(f"no tolerance for kind {kind!r} and dtype {dtype}") from None


def max_error(out: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> tuple[float, float]:
    """(max absolute error, max of error / allowed error); NaN anywhere counts as infinite."""
    out64 = out.detach().to(torch.float64).cpu()
    ref64 = ref.detach().to(torch.float64).cpu()
    if out64.shape != ref64.shape:
        raise AssertionError(f"shape {tuple(out64.shape)} != reference {tuple(ref64.shape)}")
    if out64.numel() == 0:
        return 0.0, 0.0
    err = (out64 - ref64).abs()
    # Equal values count as exact, equal infinities included (an LSE of -inf for a row that
    # sees no key), and so do NaNs where the reference has NaN.
    same = (out64 == ref64) | (torch.isnan(out64) & torch.isnan(ref64))
    err = torch.where(same, torch.zeros_like(err), err)
    err = torch.where(torch.isnan(err), torch.full_like(err, float("inf")), err)
    # A NaN reference (matched by a NaN above) must not make the allowed error NaN.
    allowed = tol.atol + tol.rtol * torch.nan_to_num(ref64.abs(), nan=0.0)
    return float(err.max()), float((err / allowed).max())


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: Tolerance, what: str = "") -> float:
    """Assert ``out`` matches ``ref`` within ``tol``; returns the max absolute error."""
    err, ratio = max_error(out, ref, tol)
    if not ratio <= 1.0:
        raise AssertionError(
            f"{what or 'output'}: max abs error {err:.3g} exceeds tolerance ({tol}); "
            f"worst element at {ratio:.3g}x the allowed error"
        )
    return err


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with NaN (floats) so that elements a kernel forgets to write are caught."""
    return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-1)


def randn(*shape: int, dtype: torch.dtype = torch.float32, device="cpu", generator=None) -> torch.Tensor:
    """Fresh standard-normal values of ``dtype`` (drawn in fp32, then rounded)."""
    return torch.randn(*shape, generator=generator, device=device).to(dtype)


@dataclasses.dataclass(frozen=True)
class ExpectedFailure:
    """Conformance cases known to fail on a device: what ``pk_expected_failures`` returns.

    Matching cases are reported as expected failures (xfail); one that passes is reported
    as unexpectedly passing (xpass) so that the entry can be removed.

    Attributes:
        pattern: an ``fnmatch`` glob over the case key
            ``"<kernel>/<variant>/<dtype>/<shape>/<check>"`` (check is ``forward`` or
            ``backward``), e.g. ``"flash_attn/iluvatar.v2/bfloat16/*"``. ``*`` also
            matches ``/``, so ``"matmul/acme.*"`` covers every case of those variants.
        reason: why it fails and where that is tracked; shown in the reports.
    """

    pattern: str
    reason: str

    def matches(self, key: str) -> bool:
        """Whether the case called ``key`` is covered by this entry."""
        return fnmatch.fnmatchcase(key, self.pattern)
