"""Conformance of ``matmul(a, b)``: every variant, dtype and shape below. Variants that
need aligned rows (tensor descriptors) skip the shapes they do not accept, saying why, and
fp8 cases skip on devices without the case's encoding (``fp8`` for OCP, ``fp8_fnuz``)."""
from __future__ import annotations

import torch

from portable_kernels.conformance.harness import DEFAULT_DTYPES, Inputs, KernelSuite, Shape, randn
from portable_kernels.kernels import _host
from portable_kernels.kernels.matmul import out_dtype


def make_inputs(shape, dtype, device, gen) -> Inputs:
    m, n, k = shape["mnk"]
    a = randn((m, k), dtype, device, gen, layout=shape.get("a", "contiguous"))
    b = randn((k, n), dtype, device, gen, layout=shape.get("b", "contiguous"))
    return Inputs((a, b))


SUITE = KernelSuite(
    kernel="matmul",
    make_inputs=make_inputs,
    tolerance="dot",
    dtypes=(*DEFAULT_DTYPES, *_host.FP8_DTYPES),
    quick_dtypes=(*DEFAULT_DTYPES, _host.FP8_DTYPES[0]),
    out_dtype=out_dtype,
    shapes=(
        Shape("1x1x1", mnk=(1, 1, 1)),                               # one element: every mask on
        Shape("67x45x33", mnk=(67, 45, 33), quick=True),             # odd everywhere: tails in M, N, K
        Shape("64x64x64", mnk=(64, 64, 64), quick=True),             # aligned: descriptor variants run
        Shape("130x72x200", mnk=(130, 72, 200)),                     # several tiles and K steps
        Shape("300x136x130", mnk=(300, 136, 130)),                   # grouped tile order over many rows
        Shape("16x24x520", mnk=(16, 24, 520)),                       # long K, thin output
        Shape("a_t_96x80x72", mnk=(96, 80, 72), a="transposed", quick=True),  # column-major a
        Shape("b_t_50x64x40", mnk=(50, 64, 40), b="transposed"),     # column-major b
        Shape("gap_33x40x24", mnk=(33, 40, 24), a="gap", b="padded"),  # NaN between and past elements
        Shape("0x8x8", mnk=(0, 8, 8)),                               # empty output
        Shape("5x7x0", mnk=(5, 7, 0)),                               # K = 0: zeros
        # 156 output tiles of 128x256, tails in M and N: enough for nvidia.hopper_gluon
        # (MIN_TILES); b column-major, as an (N, K) weight's transpose.
        Shape("b_t_1544x2824x72", mnk=(1544, 2824, 72), b="transposed",
              dtypes=(torch.float16, torch.bfloat16)),
    ),
)


def test_conformance(pk_case):
    """One case; see ``portable_kernels.conformance.harness.CaseRun.check``."""
    pk_case.check()
