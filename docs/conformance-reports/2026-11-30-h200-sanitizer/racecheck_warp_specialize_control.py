"""The smallest Gluon kernel with two partitions, for racecheck (run on the H200 on 2026-11-30:
0 hazards, racecheck-warp-specialize-control.log). Its partitions touch no shared memory of
their own; each writes one int per program to global memory. A hazard racecheck reported
here would be in the code Triton generates around the partitions.

    compute-sanitizer --tool racecheck python3 racecheck_warp_specialize_control.py
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _default(out):
    gl.store(out + gl.program_id(0) * 2, 1)


@gluon.jit
def _worker(out):
    gl.store(out + gl.program_id(0) * 2 + 1, 2)


@gluon.jit
def _ws_kernel(out):
    gl.warp_specialize([(_default, (out,)), (_worker, (out,))], [1], [24])


out = torch.zeros(2 * 264, dtype=torch.int32, device="cuda")
_ws_kernel[(264,)](out, num_warps=4)
torch.cuda.synchronize()
assert (out[0::2] == 1).all() and (out[1::2] == 2).all(), out
print("ws_control: ok")
