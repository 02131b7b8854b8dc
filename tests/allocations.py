"""What a call allocates, seen through a dispatch mode: the tests that hold a family to
the tensors it makes (no fp32 copy of the logits, no statistics without a backward, one
scratch buffer for a split decode).

A mode sees the operators the call runs on this thread below autograd; a custom op's body
is hidden behind the op, so these tests call the kernel handles. Triton's interpreter
copies launch arguments through operators too (uint8 byte copies, ``set_`` views of the
arguments): :meth:`Outputs.new` counts only the tensors ``empty``/``empty_strided`` made.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_NEW = (torch.ops.aten.empty, torch.ops.aten.empty_strided)


class Outputs(TorchDispatchMode):
    """Every tensor an operator returns while the mode is on, as ``(operator, tensor)``
    pairs in ``seen`` (in-place operators, which return their input, left out)."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[object, torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func._schema.name.endswith("_"):
            self.seen.extend((func.overloadpacket, t)
                             for t in (out if isinstance(out, (tuple, list)) else (out,))
                             if isinstance(t, torch.Tensor))
        return out

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor returned."""
        return [t for _, t in self.seen]

    def new(self, dtype: torch.dtype | None = None, shape: tuple | None = None) -> int:
        """How many new tensors (of ``dtype`` and ``shape`` where given) were allocated."""
        return sum(op in _NEW and (dtype is None or t.dtype == dtype)
                   and (shape is None or tuple(t.shape) == tuple(shape))
                   for op, t in self.seen)
