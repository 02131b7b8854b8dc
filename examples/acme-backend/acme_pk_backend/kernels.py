"""ACME's own kernel: ``vector_add`` as a persistent grid-stride loop.

The smallest example of a backend shipping a kernel that the core does not have. It must
compute exactly what the family promises (``vector_add``: ``x + y`` of one shape and float
dtype, a new contiguous output), so the conformance suite checks it against the same
references as every other variant. Importing this module decorates the kernel, so the
backend imports it inside ``pk_register_variants``, after every plugin's
``pk_runtime_setup`` (which may choose the interpreter), never at the top of the package.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from portable_kernels.kernels import _host


@triton.jit
def _grid_stride_add_kernel(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    # A fixed grid (one program per compute unit) walks the whole vector: on a part whose
    # launches are costly, one launch of few programs beats one program per block.
    # The stride is the grid's size read in the kernel, not passed as an argument: Triton
    # compiles an integer argument equal to 1 as a Python constant, which has no ``.to``
    # (a one-program grid failed to compile on the GPU; the interpreter never specializes).
    start = tl.program_id(0).to(tl.int64) * BLOCK_SIZE
    step = tl.num_programs(0).to(tl.int64) * BLOCK_SIZE
    for base in range(start, n_elements, step):
        offsets = base + tl.arange(0, BLOCK_SIZE)
        mask = offsets < n_elements
        x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
        y = tl.load(y_ptr + offsets, mask=mask).to(tl.float32)
        tl.store(out_ptr + offsets, (x + y).to(out_ptr.dtype.element_ty), mask=mask)


def vector_add(plan, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x + y`` for two tensors of one shape and float dtype (fp16, bf16, fp32); a new
    contiguous tensor. ``plan`` carries the device (its ``num_sms`` sizes the grid) and
    ACME's config (``BLOCK_SIZE``, ``num_warps``)."""
    # The family's own argument checks: the same errors, naming the argument, as generic.
    _host.check_dtype("vector_add", "x", x)
    _host.check_dtype("vector_add", "y", y)
    _host.check_same_dtype("vector_add", x=x, y=y)
    _host.check_same_shape("vector_add", x=x, y=y)
    x, y = x.contiguous(), y.contiguous()
    out = torch.empty_like(x)
    n = out.numel()
    if n == 0:
        return out
    cfg = plan.config
    block = cfg.kwargs["BLOCK_SIZE"]
    programs = max(1, min(plan.device.num_sms, triton.cdiv(n, block)))
    plan.direct(_grid_stride_add_kernel)[(programs,)](
        x, y, out, n, BLOCK_SIZE=block, num_warps=cfg.num_warps)
    return out
