"""Host time per ``matmul`` call on small problems, where the launch path, not the GPU,
sets the pace, and where that time goes.

For each shape it times, per call over many calls (``time.perf_counter`` then one
synchronize, so a call costs the larger of its host and device time): ``torch.matmul``, our
variants' launchers on a resolved plan, and ``pk.get_kernel("matmul")`` for the variant
dispatch picks. With ``--profile`` it also prints the functions that take the host time of
each of our launchers (cProfile, sorted by own time). With ``--trace`` it lists, per
call, the CUDA API calls (launches, memsets, allocations, synchronizations) and the GPU
kernels each implementation issues (``torch.profiler``), with the config each of our
variants tuned to: what an eager call costs the GPU beyond the product itself.

    python bench/matmul_launch_overhead.py [--shapes 16x4096x4096,...] [--dtype bf16]
                                           [--iters 2000] [--profile] [--trace]
"""
from __future__ import annotations

import portable_kernels as pk  # first: it chooses the interpreter before triton is imported

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time

import torch

from portable_kernels import dispatch
from portable_kernels.kernels import matmul as mm

from matmul import best_config  # bench/matmul.py (this script's directory is on sys.path)

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
VARIANTS = ("nvidia.persistent_tma", "generic")


def per_call_us(fn, iters: int, rounds: int = 5) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(samples)


def profile(fn, iters: int, top: int = 14) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def trace(fn, calls: int = 20) -> str:
    """What ``calls`` calls of ``fn`` issue, per call: CUDA API calls and GPU kernels."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    lines = []
    for event in sorted(prof.key_averages(), key=lambda e: -e.count):
        name = event.key
        kernel = getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA
        api = not kernel and name.startswith("cu")  # cudaLaunchKernel, cuLaunchKernelEx, ...
        # Fewer than one per call: the measurement's own final synchronize.
        if (api or kernel) and event.count >= calls:
            us = (getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
                  if kernel else event.cpu_time_total) / event.count
            lines.append(f"    {'gpu' if kernel else 'api'} {event.count / calls:5.1f}/call "
                         f"{us:8.1f} µs each  {name[:90]}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="16x4096x4096,1024x1024x1024")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--trace", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/matmul_launch_overhead.py needs a CUDA GPU")
    dtype = DTYPES[args.dtype]
    for shape in args.shapes.split(","):
        m, n, k = (int(x) for x in shape.split("x"))
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        b = torch.randn(k, n, device="cuda", dtype=dtype)
        fns = {"torch.matmul": lambda: torch.matmul(a, b)}
        plans = {}
        for variant in VARIANTS:
            with pk.use_variant(matmul=variant):
                plan = plans[variant] = dispatch._launch_plan(pk.explain("matmul", a, b))
            fns[variant] = (lambda plan: lambda: mm.launch(plan, a, b))(plan)
        handle = pk.get_kernel("matmul")
        fns[f"get_kernel ({pk.explain('matmul', a, b).variant})"] = lambda: handle(a, b)
        for fn in fns.values():
            fn()  # compile and tune before timing
        torch.cuda.synchronize()
        print(f"\n{shape} {args.dtype}: µs per call (host and device, whichever is longer)")
        for name, fn in fns.items():
            print(f"  {name:40s} {per_call_us(fn, args.iters):8.1f}", flush=True)
        if args.trace:
            for name, fn in fns.items():
                chosen = f" (tuned: {best_config(plans[name], a, b)})" if name in plans else ""
                print(f"\n--- {name}: per call, over 20 calls{chosen} ---")
                print(trace(fn))
        if args.profile:
            for variant in VARIANTS:
                print(f"\n--- {variant}, {args.iters} calls ---")
                print(profile(fns[variant], args.iters))


if __name__ == "__main__":
    main()
