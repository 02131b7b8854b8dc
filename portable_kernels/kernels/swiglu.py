"""swiglu: ``silu(gate) * up``, the gated MLP activation of Llama, Mistral and Qwen.

``gate`` and ``up`` of one shape (..., I), or one fused (..., 2I) gate-up projection (gate
first) with ``up`` omitted; fp32 arithmetic, forward and backward in one kernel each. The
kernels are ``_glu.py``'s, shared with ``geglu`` (its ``GELU`` switch off here).
"""
from __future__ import annotations

from . import _glu

NAME = "swiglu"

launch = _glu.launch_of(NAME, gelu=False)
reference = _glu.reference_of(gelu=False)
inputs = _glu.inputs_of(NAME)


def register(registry) -> None:
    _glu.register(registry, NAME, gelu=False,
                  summary="silu(gate) * up, or of one fused (..., 2I) gate-up tensor; differentiable")
