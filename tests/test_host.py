"""The launchers' integer helpers agree with Triton's own (which cost microseconds per call
from host code, so the launch paths do not use them)."""
from __future__ import annotations

import triton

from portable_kernels.kernels import _host


def test_cdiv_and_next_power_of_2_match_triton():
    for n in [0, 1, 2, 3, 4, 5, 63, 64, 65, 127, 128, 129, 1000, 1024, 1025, 2**31 - 1, 2**31, 2**40 + 1]:
        assert _host.next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 16, 64, 100, 128):
            assert _host.cdiv(n, d) == triton.cdiv(n, d), (n, d)
