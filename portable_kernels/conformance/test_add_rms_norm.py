"""Conformance of ``add_rms_norm(x, residual, weight, eps, offset)``: every variant, dtype
and shape below, forward (out, new_residual) and backward (dx, dresidual, dweight)."""
from __future__ import annotations

import torch

from portable_kernels.conformance import test_rms_norm
from portable_kernels.conformance.harness import Inputs, KernelSuite, Shape, randn
from portable_kernels.testing import Tolerance


def make_inputs(shape, dtype, device, gen) -> Inputs:
    size = shape["size"]
    x = randn(size, dtype, device, gen, layout=shape.get("layout", "contiguous"), scale=2.0,
              offset=0.5)
    residual = randn(size, dtype, device, gen, layout=shape.get("r_layout", "contiguous"),
                     scale=2.0)
    weight = randn(size[-1:], dtype, device, gen, scale=0.5, offset=shape.get("w_mean", 1.0))
    return Inputs((x, residual, weight),
                  {"eps": shape.get("eps", 1e-6), "offset": shape.get("offset", 0.0)})


def tolerance_for(tol: Tolerance, name: str, ref, inputs: Inputs, grad_outs) -> Tolerance:
    """rms_norm's gradient tolerances, of the norm of the new residual (dx and dresidual
    are its dx plus the new residual's own gradient, added once in fp32)."""
    if name.startswith("out"):
        return tol
    x, residual, weight = inputs.args
    summed = (x.detach().double() + residual.detach().double()).to(x.dtype)
    norm = Inputs((summed, weight), inputs.kwargs)
    return test_rms_norm.tolerance_for(tol, "dweight" if name == "dweight" else "dx", ref,
                                       norm, grad_outs[:1])


SUITE = KernelSuite(
    kernel="add_rms_norm",
    make_inputs=make_inputs,
    tolerance="reduction",
    grad_args=(0, 1, 2),
    arg_names=("x", "residual", "weight"),
    tolerance_for=tolerance_for,
    shapes=(
        Shape("1x1", size=(1, 1)),                                   # a row of one
        Shape("7x13x37", size=(7, 13, 37), quick=True),              # odd sizes: one-chunk rows
        Shape("5x2500", size=(5, 2500), quick=True),                 # rows in several chunks
        Shape("3x1700x37", size=(3, 1700, 37)),                      # many rows: partials share a lock
        Shape("gemma_6x64", size=(6, 64), offset=1.0, w_mean=0.0),   # Gemma's (1 + w)
        Shape("eps_3x40", size=(3, 40), eps=0.25),
        Shape("0x5", size=(0, 5), backward=False),                   # no rows
        Shape("transposed_24x40", size=(24, 40), layout="transposed", r_layout="gap",
              quick=True),                                           # column strides, NaN between
        Shape("padded_5x1100", size=(5, 1100), layout="padded", r_layout="transposed"),
    ),
)


def test_conformance(pk_case):
    """One case; see ``portable_kernels.conformance.harness.CaseRun.check``."""
    pk_case.check()
