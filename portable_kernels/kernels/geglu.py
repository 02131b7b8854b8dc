"""geglu: ``gelu_tanh(gate) * up``, the gated MLP activation of Gemma.

``gate`` and ``up`` of one shape (..., I), or one fused (..., 2I) gate-up projection (gate
first) with ``up`` omitted; GELU in its tanh approximation (``approximate="tanh"``, as
Gemma's ``gelu_pytorch_tanh``), fp32 arithmetic. The kernels are ``_glu.py``'s, shared
with ``swiglu`` (its ``GELU`` switch on here).
"""
from __future__ import annotations

from . import _glu

NAME = "geglu"

launch = _glu.launch_of(NAME, gelu=True)
reference = _glu.reference_of(gelu=True)
inputs = _glu.inputs_of(NAME)


def register(registry) -> None:
    _glu.register(registry, NAME, gelu=True,
                  summary="gelu_tanh(gate) * up, or of one fused (..., 2I) gate-up tensor; "
                  "differentiable")
