"""Conformance of ``vector_add(x, y) -> x + y``: every variant, dtype and shape below."""
from __future__ import annotations

from portable_kernels.conformance.harness import Inputs, KernelSuite, Shape, randn


def make_inputs(shape, dtype, device, gen) -> Inputs:
    x = randn(shape["size"], dtype, device, gen, layout=shape.get("x", "contiguous"))
    y = randn(shape["size"], dtype, device, gen, layout=shape.get("y", "contiguous"))
    return Inputs((x, y))


SUITE = KernelSuite(
    kernel="vector_add",
    make_inputs=make_inputs,
    tolerance="elementwise",
    shapes=(
        Shape("n1", size=(1,), quick=True),             # one element: one program, mostly masked
        Shape("n4097", size=(4097,), quick=True),       # a power of two plus one: a 1-element tail
        Shape("n0", size=(0,)),                          # empty: nothing to launch
        Shape("3x5x7", size=(3, 5, 7)),                  # several dimensions, odd sizes
        Shape("n100003", size=(100003,)),                # many programs and a ragged tail (prime)
        Shape("n1048576", size=(1 << 20,)),              # a round size: no tail at all
        # Non-contiguous inputs, their gaps filled with NaN: a kernel that reads between the
        # elements, or forgets to make them contiguous, gets NaN.
        Shape("strided_33x65", size=(33, 65), x="transposed", y="gap", quick=True),
        Shape("padded_7x300", size=(7, 300), x="padded", y="contiguous"),
    ),
)


def test_conformance(pk_case):
    """One case; see ``portable_kernels.conformance.harness.CaseRun.check``."""
    pk_case.check()
