"""The conformance cases of the gated activations (``swiglu``, ``geglu``): one list of
shapes for both, since they share their kernels and their contract."""
from __future__ import annotations

from portable_kernels.conformance.harness import Inputs, KernelSuite, Shape, randn
from portable_kernels.testing import Tolerance


def make_inputs(shape, dtype, device, gen) -> Inputs:
    size = shape["size"]
    if shape.get("fused"):
        return Inputs((randn((*size[:-1], 2 * size[-1]), dtype, device, gen, scale=2.0),))
    gate = randn(size, dtype, device, gen, layout=shape.get("gate", "contiguous"), scale=2.0)
    up = randn(size, dtype, device, gen, layout=shape.get("up", "contiguous"))
    return Inputs((gate, up))


def tolerance_for(tol: Tolerance, name: str, ref, inputs: Inputs, grad_outs) -> Tolerance:
    """The table's tolerance; for dgate = dy * up * act'(gate) scaled by the size of the
    derivative's terms (fp32 rounds each: geglu's 0.5 * g * (1 - t^2) * k * (1 + 3c g^2)
    grows as |g|^3 where the result stays small), not by the result."""
    if name != "dgate":
        return tol
    gate, up = (t.detach().double() for t in inputs.args)
    dy = grad_outs[0].detach().double()
    bound = (dy * up).abs() * (1 + gate.abs() + 0.134145 * gate.abs() ** 3)
    return Tolerance(tol.atol + tol.rtol * float(bound.max()) if bound.numel() else tol.atol, tol.rtol)


def suite(kernel: str) -> KernelSuite:
    return KernelSuite(
        kernel=kernel,
        make_inputs=make_inputs,
        tolerance="elementwise",
        grad_args=(0, 1),
        arg_names=("gate", "up"),
        tolerance_for=tolerance_for,
        shapes=(
            Shape("n1", size=(1,), quick=True),                      # one element
            Shape("7x13x37", size=(7, 13, 37), quick=True),          # odd sizes, rows fold
            Shape("3x5000", size=(3, 5000)),                         # rows of several blocks
            Shape("0x8", size=(0, 8), backward=False),               # no rows
            Shape("transposed_33x65", size=(33, 65), gate="transposed", up="gap", quick=True),
            Shape("padded_7x300", size=(7, 300), gate="padded"),     # NaN past each row's end
            # One (..., 2I) projection, gate then up, read in place (row stride 2I).
            Shape("fused_4x9x70", size=(4, 9, 70), fused=True, backward=False, quick=True),
        ),
    )
