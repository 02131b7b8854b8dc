"""A Triton kernel that reads and writes past the end of its tensors, on purpose.

``ci/memcheck-cuda.sh`` runs it under ``compute-sanitizer --tool memcheck`` before the test
suite and requires the sanitizer to report the overrun (memcheck stops the kernel at the
first bad access, the read): a memcheck run that reports nothing proves nothing unless the
same settings are seen to catch a known one. (With
PyTorch's caching allocator an overrun that lands inside a cached segment is not reported,
which is why the script turns the cache off.)

Run without the sanitizer, it exits 0 and says what it did; the overrun lands in whatever
follows the 1000-element allocation, so it is only ever run under memcheck.

``--tma``: a second control, for the copy engine. A host tensor descriptor declares twice
the rows its tensor has, and an sm_90 kernel loads the block past the end through it (a
TMA copy, which bounds-checks against the declared shape only). Whether memcheck reports
that tells whether a clean run covers the descriptor kernels' loads at all. On the H200
(compute-sanitizer of CUDA 13) it did not: 0 errors for this overrun, in the
same call that reported the pointer control's (docs/conformance.md).
"""
from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

N = 1000   # elements allocated
BLOCK = 1024  # elements each access touches: 24 past the end


@triton.jit
def _overrun_kernel(src, dst, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs) + 1.0)  # no mask: reads and writes past N


TMA_ROWS, TMA_COLS = 256, 64  # allocated; the descriptor declares 2 * TMA_ROWS rows


@triton.jit
def _tma_overrun_kernel(desc, dst, ROWS: tl.constexpr, COLS: tl.constexpr):
    block = desc.load([ROWS, 0])  # rows ROWS .. 2 * ROWS - 1: past the allocation
    offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    tl.store(dst + offs, block)


def tma_overrun() -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    src = torch.randn(TMA_ROWS, TMA_COLS, device="cuda", dtype=torch.float16)
    dst = torch.empty_like(src)
    desc = TensorDescriptor(src, [2 * TMA_ROWS, TMA_COLS], [TMA_COLS, 1], [TMA_ROWS, TMA_COLS])
    _tma_overrun_kernel[(1,)](desc, dst, ROWS=TMA_ROWS, COLS=TMA_COLS)
    torch.cuda.synchronize()
    print(f"memcheck_control --tma: loaded {TMA_ROWS} rows of {TMA_COLS} fp16 past a "
          f"{TMA_ROWS}-row tensor through a descriptor")


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("memcheck_control: needs a CUDA GPU")
    if "--tma" in sys.argv[1:]:
        return tma_overrun()
    src = torch.randn(N, device="cuda")
    dst = torch.empty(N, device="cuda")
    _overrun_kernel[(1,)](src, dst, BLOCK=BLOCK)
    torch.cuda.synchronize()
    print(f"memcheck_control: read and wrote {BLOCK - N} float32 past {N}-element tensors")


if __name__ == "__main__":
    main()
