"""Two configs of the Hopper matmul table against cuBLAS, timed in alternation.

The autotuner and the full benchmark time one implementation after another, so a clock or
thermal drift between them reads as a difference between configs. This times each of
``--configs`` (indices into the ``nvidia.persistent_tma`` table) and ``torch.matmul`` in
turn, ``--rounds`` times, each a ``triton.testing.do_bench`` median, on fresh random square
operands, after checking each config against an fp32 product. It answers whether two configs
(by default 128x256x64 with 3 and with 4 stages) differ by more than the noise, and where
the variant stands against cuBLAS with that noise in view.

    python bench/matmul_interleaved.py [--sizes 4096,8192] [--dtypes fp16,bf16]
                                       [--configs 0,1] [--rounds 4]
"""
from __future__ import annotations

import portable_kernels as pk  # first: it chooses the interpreter before triton is imported

import argparse
import statistics
import sys

import torch
import triton

from portable_kernels import dispatch
from portable_kernels.kernels import matmul as mm
from portable_kernels.launch import LaunchPlan

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4096,8192")
    parser.add_argument("--dtypes", default="fp16,bf16")
    parser.add_argument("--configs", default="0,1", help="indices into the variant's table")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/matmul_interleaved.py times kernels on an NVIDIA GPU; none here")
    print(f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__}")
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        for n in (int(x) for x in args.sizes.split(",")):
            a = torch.randn(n, n, device="cuda", dtype=dtype)
            b = torch.randn(n, n, device="cuda", dtype=dtype)
            with pk.use_variant(matmul="nvidia.persistent_tma"):
                base = dispatch._launch_plan(pk.explain("matmul", a, b))
            ref = a.float() @ b.float()
            fns = {}
            for i in (int(x) for x in args.configs.split(",")):
                cfg = base.configs[i]
                plan = LaunchPlan(base.variant, base.device, [cfg], base.switches)
                err = float((mm.launch(plan, a, b).float() - ref).abs().max() / ref.abs().max())
                if not err < 1e-2:
                    sys.exit(f"config {i} ({cfg}) is wrong: relative max error {err:.3g}")
                label = (f"{cfg.kwargs['BLOCK_SIZE_M']}x{cfg.kwargs['BLOCK_SIZE_N']}x"
                         f"{cfg.kwargs['BLOCK_SIZE_K']} w{cfg.num_warps} s{cfg.num_stages}")
                fns[label] = (lambda plan: lambda: mm.launch(plan, a, b))(plan)
            fns["cuBLAS"] = lambda: torch.matmul(a, b)
            tflops = {label: [] for label in fns}
            for _ in range(args.rounds):
                for label, fn in fns.items():
                    ms = triton.testing.do_bench(fn, return_mode="median")
                    tflops[label].append(2.0 * n ** 3 / ms * 1e-9)
            cublas = statistics.median(tflops["cuBLAS"])
            print(f"\n{name} {n}^3: TFLOP/s per round, median, ratio to cuBLAS's median")
            for label, values in tflops.items():
                med = statistics.median(values)
                print(f"  {label:24s} {' '.join(f'{v:4.0f}' for v in values)}  "
                      f"median {med:4.0f}  {med / cublas:.2f}", flush=True)


if __name__ == "__main__":
    main()
