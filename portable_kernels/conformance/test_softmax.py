"""Conformance of ``softmax(x, dim=-1)``: every variant, dtype and shape below."""
from __future__ import annotations

import torch

from portable_kernels.conformance.harness import Inputs, KernelSuite, Shape, randn


def make_inputs(shape, dtype, device, gen) -> Inputs:
    x = randn(shape["size"], dtype, device, gen, layout=shape.get("layout", "contiguous"),
              scale=shape.get("scale", 1.0))
    if shape.get("masked"):
        # Attention-style masking: every other column -inf, and one row all -inf but one
        # element, so lanes that see only -inf must not turn the row into NaN.
        x[..., 1::2] = float("-inf")
        x[0, 1:] = float("-inf")
    return Inputs((x,), {"dim": shape.get("dim", -1)})


SUITE = KernelSuite(
    kernel="softmax",
    make_inputs=make_inputs,
    tolerance="reduction",
    shapes=(
        Shape("1x1", size=(1, 1)),                                # a row of one
        Shape("4x7", size=(4, 7), quick=True),                   # short odd rows: masked lanes
        Shape("3x1000", size=(3, 1000), quick=True),             # not a power of two
        Shape("2x5000", size=(2, 5000)),                          # past the interpreter's block: two passes
        Shape("2x20000", size=(2, 20000)),                        # past every backend's block: two passes
        Shape("2x3x33", size=(2, 3, 33)),                         # leading dimensions collapse to rows
        Shape("0x5", size=(0, 5)),                                # no rows
        Shape("dim0_17x6", size=(17, 6), dim=0),                  # along another dimension
        Shape("transposed_40x24", size=(40, 24), layout="transposed", quick=True),  # column stride
        Shape("gap_5x129", size=(5, 129), layout="gap"),          # stride-2 rows, NaN between
        Shape("padded_6x70", size=(6, 70), layout="padded"),      # NaN past each row's end
        Shape("large_4x300", size=(4, 300), scale=30.0),          # large logits: needs the max shift
        Shape("masked_5x2100", size=(5, 2100), masked=True, dtypes=(torch.float32, torch.float16)),
    ),
)


def test_conformance(pk_case):
    """One case; see ``portable_kernels.conformance.harness.CaseRun.check``."""
    pk_case.check()
