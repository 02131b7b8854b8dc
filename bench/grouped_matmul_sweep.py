"""Sweep grouped_matmul configs on an NVIDIA GPU, each timed alone (CUDA-graph replays).

For each mixture-of-experts layer of ``bench/grouped_matmul.py`` and each weight layout
(``row``: b stored (K, N); ``col``: b = w.t() of (N, K) weights) it times the
``nvidia.tma`` variant's kernel on one-config plans over a grid of tiles, warps and
stages, next to the variant's own autotuned pick and PyTorch's faster grouped product
(``torch._grouped_mm`` or one ``torch.matmul`` per expert), replayed the same way. Every
candidate is checked against an fp32 product first. A pool of processes compiles the
candidates first (each config once per layout and group-count specialization) into
Triton's on-disk cache; the timing process then loads them.

    python bench/grouped_matmul_sweep.py [--dtype bf16] [--layouts row,col] [--jobs 12]
                                         [--quick] [--out PREFIX]

Prints, per layer, the fastest configs and the table's pick; writes every timing to
``PREFIX.json``. A tuning tool: its winners go into ``backends/nvidia/tuning.py``
(``grouped_matmul_tma``), and ``bench/grouped_matmul.py`` measures the result.
"""
from __future__ import annotations

import portable_kernels as pk  # first: it chooses the interpreter before triton is imported

import argparse
import concurrent.futures as futures
import itertools
import json
import multiprocessing
import time
from pathlib import Path

import torch
import triton

from portable_kernels import dispatch
from portable_kernels.kernels import grouped_matmul as gm
from portable_kernels.launch import LaunchPlan
from portable_kernels.testing import max_error, tolerance

import _common
from grouped_matmul import LAYERS, QUICK, operands, token_counts  # bench/

VARIANT = "nvidia.tma"
SHARED_BYTES = 227 * 1024
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), before the filters.
GRID = list(itertools.product((64, 128), (128, 256), (64, 128), (4, 8), (3, 4, 5)))


def fits(tile, itemsize: int = 2) -> bool:
    """Leave out what cannot compile or cannot pay: accumulators past 128 fp32 registers a
    thread, 8 warps on 64 rows (warpgroup MMAs take 64 rows each), and shared memory past
    the limit (operand stages plus the epilogue's buffer, halved by subtiling)."""
    bm, bn, bk, warps, stages = tile
    if bm * bn // (warps * 32) > 128 or (bm == 64 and warps == 8):
        return False
    epilogue = bm * bn * itemsize // (2 if bn >= 256 else 1)
    return stages * (bm * bk + bk * bn) * itemsize + epilogue <= SHARED_BYTES


def config(tile) -> triton.Config:
    bm, bn, bk, warps, stages = tile
    return triton.Config({"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": bk,
                          "GROUP_SIZE_M": 8, "EPILOGUE_SUBTILE": bn >= 256},
                         num_warps=warps, num_stages=stages)


def base_plan(list_a, list_b) -> LaunchPlan:
    with pk.use_variant(grouped_matmul=VARIANT):
        return dispatch._launch_plan(pk.explain("grouped_matmul", list_a, list_b))


def plan_for(base: LaunchPlan, tile) -> LaunchPlan:
    return LaunchPlan(base.variant, base.device, [config(tile)], base.switches)


def compile_one(job) -> str:
    """Worker: compile one candidate into the disk cache with a small launch of the same
    specialization (layout, dtype, group count: 1, divisible by 16, or neither)."""
    tile, layout, experts, dtype_name = job
    try:
        _, _, list_a, list_b = operands([16] * experts, 256, 256, _common.DTYPES[dtype_name], layout)
        gm.launch(plan_for(base_plan(list_a, list_b), tile), list_a, list_b)
        torch.cuda.synchronize()
        return ""
    except Exception as exc:  # reported; the candidate is skipped
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:160]}"


def torch_best(list_a, list_b, tokens, weights, counts, dtype) -> float:
    """Milliseconds of PyTorch's faster grouped product, replayed from a graph."""
    fns = [lambda: [torch.matmul(a, b) for a, b in zip(list_a, list_b)]]
    if dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        offs = torch.tensor(counts, device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)
        fns.append(lambda: torch._grouped_mm(tokens, weights, offs))
    return min(triton.testing.do_bench_cudagraph(f, return_mode="median") for f in fns)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bf16", choices=sorted(_common.DTYPES))
    parser.add_argument("--layouts", default="row,col")
    parser.add_argument("--jobs", type=int, default=12, help="compile processes")
    parser.add_argument("--quick", action="store_true", help="two layers only")
    parser.add_argument("--out", default="grouped-matmul-sweep")
    args = parser.parse_args()
    _common.nvidia_gpu("bench/grouped_matmul_sweep.py", "torch's grouped GEMMs",
                       "tests/test_grouped_matmul.py")
    dtype = _common.DTYPES[args.dtype]
    layouts = [x for x in args.layouts.split(",") if x]
    layers = QUICK if args.quick else LAYERS
    tiles = [t for t in GRID if fits(t)]
    start = time.time()
    jobs = [(t, layout, g, args.dtype) for t in tiles for layout in layouts
            for g in sorted({layer[1] for layer in layers})]
    ctx = multiprocessing.get_context("spawn")
    with futures.ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
        failed = {job[:2]: err for job, err in zip(jobs, pool.map(compile_one, jobs)) if err}
    print(f"compiled {len(jobs) - len(failed)} of {len(jobs)} candidates in "
          f"{time.time() - start:.0f} s", flush=True)
    results = []
    for layout in layouts:
        for name, experts, mean, n, k in layers:
            counts = token_counts(experts, mean)
            tokens, weights, list_a, list_b = operands(counts, n, k, dtype, layout)
            refs = [a.float() @ b.float() for a, b in zip(list_a, list_b)]
            tol = tolerance(dtype, "dot")
            flops = sum(2.0 * t * n * k for t in counts)
            base = base_plan(list_a, list_b)
            vendor = torch_best(list_a, list_b, tokens, weights, counts, dtype)
            gm.launch(base, list_a, list_b)  # the table's autotuned pick
            table = triton.testing.do_bench_cudagraph(lambda: gm.launch(base, list_a, list_b),
                                                      return_mode="median")
            timed = []
            for tile in tiles:
                if (tile, layout) in failed:
                    continue
                plan = plan_for(base, tile)
                outs = gm.launch(plan, list_a, list_b)
                worst = max(max_error(o, r, tol)[1] for o, r in zip(outs, refs))
                if not worst <= 1.0:
                    print(f"  WRONG {tile}: {worst:.3g}x the tolerance")
                    continue
                ms = triton.testing.do_bench_cudagraph(lambda: gm.launch(plan, list_a, list_b),
                                                       return_mode="median")
                timed.append((ms, tile))
                results.append({"layer": name, "G": experts, "tokens": sum(counts), "N": n,
                                "K": k, "layout": layout, "tile": tile, "ms": ms,
                                "vs_torch": vendor / ms})
            timed.sort()
            print(f"{name} G={experts} T={sum(counts)} b {layout}: torch "
                  f"{flops / vendor / 1e9:.0f} TFLOP/s; table pick {flops / table / 1e9:.0f} "
                  f"({vendor / table:.2f}x)", flush=True)
            for ms, tile in timed[:5]:
                print(f"  BM,BN,BK,w,s={tile}: {flops / ms / 1e9:.0f} TFLOP/s ({vendor / ms:.2f}x)")
            Path(args.out).with_suffix(".json").write_text(json.dumps(
                {"dtype": args.dtype, "results": results,
                 "failed": {str(k): v for k, v in failed.items()}}, indent=1))
    print(f"done in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
