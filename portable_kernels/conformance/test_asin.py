"""Conformance of ``asin(x)``: every variant, dtype and shape below."""
from __future__ import annotations

import torch

from portable_kernels.conformance.harness import Inputs, KernelSuite, Shape, place, uniform

# Where arcsine implementations go wrong: the ends of the domain, the switch between the two
# polynomial ranges at |x| = 0.5, tiny values (returned as is, signed zero and subnormals
# included), and inputs outside [-1, 1] (NaN, like torch).
EDGES = [
    -1.0, -0.99999, -0.75, -0.5000001, -0.5, -0.4999999, -0.25, -1e-4, -0.0, 0.0, 1e-40, 1e-30,
    1e-6, 2.0 ** -13, 2.0 ** -12, 0.125, 0.4999, 0.5, 0.5001, 0.7, 0.9, 0.99, 0.99999, 1.0,
    1.0001, 1.5, -2.0, float("inf"), float("-inf"), float("nan"),
]


def make_inputs(shape, dtype, device, gen) -> Inputs:
    if shape.get("edges"):
        return Inputs((place(torch.tensor(EDGES).to(dtype), device),))
    low, high = shape.get("range", (-1.0, 1.0))
    return Inputs((uniform(shape["size"], dtype, device, gen, low=low, high=high,
                           layout=shape.get("layout", "contiguous")),))


SUITE = KernelSuite(
    kernel="asin",
    make_inputs=make_inputs,
    tolerance="elementwise",
    shapes=(
        Shape("n1", size=(1,), quick=True),                          # one element
        Shape("n4097", size=(4097,), quick=True),                    # a 1-element tail
        Shape("edges", edges=True, quick=True),                      # see EDGES
        Shape("3x5x7", size=(3, 5, 7)),                              # several dimensions
        Shape("n100003", size=(100003,)),                            # many programs, ragged tail
        Shape("outside_2000", size=(2000,), range=(-1.5, 1.5)),      # a third out of domain: NaN
        Shape("n0", size=(0,)),                                      # empty
        Shape("transposed_33x65", size=(33, 65), layout="transposed", quick=True),
        Shape("gap_7x300", size=(7, 300), layout="gap"),             # NaN between the elements
    ),
)


def test_conformance(pk_case):
    """One case; see ``portable_kernels.conformance.harness.CaseRun.check``."""
    pk_case.check()
