"""Conformance of ``grouped_matmul(list_a, list_b)``: every variant, dtype and group list
below. Each group's output is compared (``out[g]``); variants that need aligned rows skip
the lists they do not accept, saying why. fp8 cases (bf16 outputs) skip on devices without
the ``fp8`` capability."""
from __future__ import annotations

from portable_kernels.conformance.harness import DEFAULT_DTYPES, Inputs, KernelSuite, Shape, randn
from portable_kernels.kernels import _host
from portable_kernels.kernels.matmul import out_dtype


def make_inputs(shape, dtype, device, gen) -> Inputs:
    layout = shape.get("layout", "contiguous")
    list_a = [randn((m, k), dtype, device, gen, layout=layout) for m, _, k in shape["groups"]]
    b_layout = shape.get("b_layout", "contiguous")
    list_b = [randn((k, n), dtype, device, gen, layout=b_layout) for _, n, k in shape["groups"]]
    return Inputs((list_a, list_b))


SUITE = KernelSuite(
    kernel="grouped_matmul",
    make_inputs=make_inputs,
    tolerance="dot",
    # fp8 operands (bf16 outputs) skip on devices without the fp8 capability.
    dtypes=(*DEFAULT_DTYPES, *_host.FP8_DTYPES),
    quick_dtypes=(*DEFAULT_DTYPES, _host.FP8_DTYPES[0]),
    out_dtype=out_dtype,
    shapes=(
        Shape("one_16x16x16", groups=[(16, 16, 16)]),                # one group, one tile
        # (M, N, K) per group: odd sizes, a one-row group, several tiles and K steps.
        Shape("odd5", groups=[(67, 45, 33), (1, 64, 8), (130, 70, 200), (300, 20, 16), (16, 16, 16)],
              quick=True),
        Shape("aligned5", groups=[(67, 48, 40), (1, 64, 8), (130, 72, 200), (300, 24, 16), (16, 16, 16)],
              quick=True),
        Shape("growing12", groups=[(1 + 7 * g, 8 + 5 * g, 3 + 4 * g) for g in range(12)]),  # MoE-like
        Shape("empty_groups", groups=[(0, 5, 4), (3, 0, 4), (3, 5, 0), (7, 9, 11)]),       # empty M, N, K
        Shape("transposed3", groups=[(40, 24, 32), (9, 16, 24), (33, 8, 16)], layout="transposed"),
        # Weights as nn.Linear stores them: every b is w.t() of an (N, K) weight; N and K
        # multiples of 16, so that the rows of every dtype, fp8 too, are 16-byte aligned.
        Shape("weights_t5", groups=[(67, 48, 48), (1, 64, 16), (130, 80, 208), (300, 32, 16), (16, 16, 16)],
              b_layout="transposed", quick=True),
    ),
)


def test_conformance(pk_case):
    """One case; see ``portable_kernels.conformance.harness.CaseRun.check``."""
    pk_case.check()
