"""Conformance of ``dropout(x, p, seed)``: every variant, dtype and shape below, forward and
backward. The reference recomputes the kernel's counter-based mask (Philox, as ``tl.rand``)
from the seed, so outputs compare element by element."""
from __future__ import annotations

from portable_kernels.conformance.harness import Inputs, KernelSuite, Shape, randn


def make_inputs(shape, dtype, device, gen) -> Inputs:
    x = randn(shape["size"], dtype, device, gen, layout=shape.get("layout", "contiguous"))
    return Inputs((x, shape.get("p", 0.3), shape.get("seed", 1234)))


SUITE = KernelSuite(
    kernel="dropout",
    make_inputs=make_inputs,
    tolerance="elementwise",
    grad_args=(0,),
    arg_names=("x",),
    shapes=(
        Shape("n1", size=(1,), quick=True),                           # one element
        Shape("n9000", size=(9000,), quick=True),                     # several blocks and a tail
        Shape("3x5x7", size=(3, 5, 7), p=0.5),                        # several dimensions
        Shape("n100003", size=(100003,), p=0.1),                      # many programs
        Shape("p0_3x70", size=(3, 70), p=0.0),                        # nothing dropped: a copy
        Shape("p1_3x70", size=(3, 70), p=1.0),                        # everything dropped: zeros
        Shape("seed2p63_1000", size=(1000,), seed=2 ** 63 - 1),       # the high word of the seed
        Shape("seed2p40_1000", size=(1000,), seed=2 ** 40 + 7),
        Shape("transposed_33x65", size=(33, 65), layout="transposed", quick=True),
        Shape("gap_7x300", size=(7, 300), layout="gap"),              # NaN between the elements
    ),
)


def test_conformance(pk_case):
    """One case; see ``portable_kernels.conformance.harness.CaseRun.check``."""
    pk_case.check()
