"""Conformance of ``geglu(gate, up)`` (``gelu_tanh(gate) * up``): every variant, dtype and shape
below, forward and backward (dgate, dup); and of one fused (..., 2I) gate-up tensor
(forward: its backward writes both halves of one gradient, tests/test_glu.py)."""
from __future__ import annotations

from portable_kernels.conformance import _glu_suite

SUITE = _glu_suite.suite("geglu")


def test_conformance(pk_case):
    """One case; see ``portable_kernels.conformance.harness.CaseRun.check``."""
    pk_case.check()
