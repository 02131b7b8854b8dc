"""Conformance of ``rms_norm(x, weight, eps, offset)``: every variant, dtype and shape
below, forward and backward (dx, dweight)."""
from __future__ import annotations

from portable_kernels.conformance.harness import Inputs, KernelSuite, Shape, randn
from portable_kernels.testing import Tolerance


def make_inputs(shape, dtype, device, gen) -> Inputs:
    size = shape["size"]
    x = randn(size, dtype, device, gen, layout=shape.get("layout", "contiguous"), scale=2.0,
              offset=0.5)
    weight = randn(size[-1:], dtype, device, gen, scale=0.5, offset=shape.get("w_mean", 1.0),
                   layout=shape.get("w_layout", "contiguous"))
    return Inputs((x, weight), {"eps": shape.get("eps", 1e-6), "offset": shape.get("offset", 0.0)})


def tolerance_for(tol: Tolerance, name: str, ref, inputs: Inputs, grad_outs) -> Tolerance:
    """The table's tolerance, scaled for gradients by what their rounding error grows with:
    dx = rstd * (g - xhat * mean(g * xhat)), g = dy * (weight + offset), is a difference of
    terms of size rstd * |g|; dweight is a sum over every row of dy * xhat."""
    if name == "out":
        return tol
    x, weight = inputs.args
    eps, offset = inputs.kwargs["eps"], inputs.kwargs["offset"]
    x64 = x.detach().double().reshape(-1, x.shape[-1])
    dy64 = grad_outs[0].detach().double().reshape(x64.shape)
    rstd = (x64.square().mean(-1, keepdim=True) + eps).rsqrt()
    if name == "dx":
        bound = (rstd * (dy64 * (weight.detach().double() + offset)).abs()).max()
    else:
        bound = (dy64.abs() * (x64 * rstd).abs().clamp(min=1)).sum(0).max()
    return Tolerance(tol.atol + tol.rtol * float(bound), tol.rtol)


SUITE = KernelSuite(
    kernel="rms_norm",
    make_inputs=make_inputs,
    tolerance="reduction",
    grad_args=(0, 1),
    arg_names=("x", "weight"),
    tolerance_for=tolerance_for,
    shapes=(
        Shape("1x1", size=(1, 1)),                                   # a row of one
        Shape("7x13x37", size=(7, 13, 37), quick=True),              # odd sizes, leading dims collapse
        Shape("5x2500", size=(5, 2500), quick=True),                 # rows in several column chunks
        Shape("3x1700x37", size=(3, 1700, 37)),                      # many rows: partials share a lock
        Shape("gemma_6x64", size=(6, 64), offset=1.0, w_mean=0.0),   # Gemma's (1 + w), w near 0
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
