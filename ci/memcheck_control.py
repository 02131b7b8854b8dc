"""A Triton kernel that reads and writes past the end of its tensors, on purpose.

``ci/memcheck-cuda.sh`` runs it under ``compute-sanitizer --tool memcheck`` before the test
suite and requires the sanitizer to report the overrun (memcheck stops the kernel at the
first bad access, the read): a memcheck run that reports nothing proves nothing unless the
same settings are seen to catch a known one. (With
PyTorch's caching allocator an overrun that lands inside a cached segment is not reported,
which is why the script turns the cache off.)

Run without the sanitizer, it exits 0 and says what it did; the overrun lands in whatever
follows the 1000-element allocation, so it is only ever run under memcheck.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

N = 1000   # elements allocated
BLOCK = 1024  # elements each access touches: 24 past the end


@triton.jit
def _overrun_kernel(src, dst, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs) + 1.0)  # no mask: reads and writes past N


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("memcheck_control: needs a CUDA GPU")
    src = torch.randn(N, device="cuda")
    dst = torch.empty(N, device="cuda")
    _overrun_kernel[(1,)](src, dst, BLOCK=BLOCK)
    torch.cuda.synchronize()
    print(f"memcheck_control: read and wrote {BLOCK - N} float32 past {N}-element tensors")


if __name__ == "__main__":
    main()
