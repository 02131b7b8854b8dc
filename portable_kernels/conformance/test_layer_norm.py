"""Conformance of ``layer_norm(x, weight, bias, eps)``: every variant, dtype and shape below,
forward and backward (dx, dweight, dbias)."""
from __future__ import annotations

import torch

from portable_kernels.conformance.harness import Inputs, KernelSuite, Shape, randn
from portable_kernels.testing import Tolerance


def make_inputs(shape, dtype, device, gen) -> Inputs:
    size = shape["size"]
    x = randn(size, dtype, device, gen, layout=shape.get("layout", "contiguous"),
              scale=2.0, offset=shape.get("offset", 0.5))
    weight = randn(size[-1:], dtype, device, gen, scale=0.5, offset=1.0, layout=shape.get("w_layout", "contiguous"))
    bias = randn(size[-1:], dtype, device, gen)
    return Inputs((x, weight, bias), {"eps": shape.get("eps", 1e-5)})


def tolerance_for(tol: Tolerance, name: str, ref, inputs: Inputs, grad_outs) -> Tolerance:
    """The table's tolerance, scaled for gradients by what their rounding error grows with.

    dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * weight, is a difference of
    terms of size rstd * |g|: its error scales with those, not with dx (which cancels to 0
    in a one-element row). dweight and dbias are sums over every row: fp32 summation error
    grows with the sum of the terms' magnitudes, |dy| * max(|xhat|, 1), not with the result.
    """
    if name == "out":
        return tol
    x, weight, _ = inputs.args
    eps = inputs.kwargs["eps"]
    x64 = x.detach().double().reshape(-1, x.shape[-1])
    dy64 = grad_outs[0].detach().double().reshape(x64.shape)
    if name == "dx":
        rstd = (x64.var(-1, unbiased=False) + eps).rsqrt()
        bound = (rstd[:, None] * (dy64 * weight.detach().double()).abs()).max()
    else:
        xhat = torch.nn.functional.layer_norm(x64, (x64.shape[-1],), eps=eps)
        bound = (dy64.abs() * xhat.abs().clamp(min=1)).sum(0).max()
    return Tolerance(tol.atol + tol.rtol * float(bound), tol.rtol)


SUITE = KernelSuite(
    kernel="layer_norm",
    make_inputs=make_inputs,
    tolerance="reduction",
    grad_args=(0, 1, 2),
    arg_names=("x", "weight", "bias"),
    tolerance_for=tolerance_for,
    shapes=(
        Shape("1x1", size=(1, 1)),                                   # a row of one: dx cancels to 0
        Shape("7x13x37", size=(7, 13, 37), quick=True),              # odd sizes, leading dims collapse
        Shape("5x2500", size=(5, 2500), quick=True),                 # rows in several column chunks
        Shape("3x1700x37", size=(3, 1700, 37)),                      # many rows: partials share a lock
        Shape("eps_3x40", size=(3, 40), eps=0.25),                   # eps is applied inside the root
        Shape("0x5", size=(0, 5), backward=False),                   # no rows
        Shape("transposed_24x40", size=(24, 40), layout="transposed", quick=True),  # column stride
        Shape("gap_6x129", size=(6, 129), layout="gap", w_layout="gap"),  # NaN between elements
        Shape("padded_5x70", size=(5, 70), layout="padded"),         # NaN past each row's end
    ),
)


def test_conformance(pk_case):
    """One case; see ``portable_kernels.conformance.harness.CaseRun.check``."""
    pk_case.check()
