"""Sweep matmul configs on an NVIDIA GPU, each timed alone as a kernel (CUDA-graph replays).

For each problem (M x N x K) it times the ``nvidia.persistent_tma`` variant's kernel on
one-config plans over a grid of tiles, split-K factors, warps and stages, along two paths:

- ``tma``: tensor descriptors and the persistent grid (the variant's own switches);
- ``ptr``: pointer loads, one program per work unit (``TMA`` and ``PERSISTENT`` off in the
  config, as the table's ``_POINTERS`` entries do);

and the vendor's GEMM (``torch.matmul``, cuBLAS; for fp8, ``torch._scaled_mm``) replayed the
same way, for scale. Every candidate is checked against an fp32 product (the library's
"dot" tolerance; for fp8, twice cuBLAS's own error, see ``bench/matmul.py``) before it is
timed. Compiling a few
hundred kernels one after another takes minutes, so a pool of processes compiles them first,
each config once (M, N and K here are all multiples of 16, so one binary serves every
problem), into Triton's on-disk cache; the timing process then loads them.

    python bench/matmul_sweep.py [--shapes 128x4096x4096,...] [--dtype bf16] [--jobs 12]
                                 [--paths tma,ptr] [--quick] [--cold] [--out PREFIX]

With ``--cold`` every call (cuBLAS's too) takes the next of several operand copies that
together exceed L2, as ``bench/matmul.py --cold`` does: the ranking of tiles when the
weights come from HBM, as in a model, rather than from L2, as in back-to-back replays.

Prints, per problem, the fastest configs of each path and the current table's choice for
comparison; writes every timing to ``PREFIX.json``. A tuning tool: its winners go into the
NVIDIA backend's table (``backends/nvidia/tuning.py``), and ``bench/matmul.py`` measures
the result.
"""
from __future__ import annotations

import portable_kernels as pk  # first: it chooses the interpreter before triton is imported

import argparse
import concurrent.futures as futures
import functools
import itertools
import json
import multiprocessing
import sys
import time
from pathlib import Path

import torch
import triton

from portable_kernels import dispatch
from portable_kernels.kernels import matmul as mm
from portable_kernels.launch import LaunchPlan
from portable_kernels.testing import max_error

import _common
from matmul import check_tolerance, operand_copies, rotating, vendor_matmul, weight_major  # bench/

DTYPES = {**_common.DTYPES, **_common.FP8}
DEVICE = "cuda"
VARIANT = "nvidia.persistent_tma"
SHAPES = "128x4096x4096,1024x1024x1024,128x14336x4096"
SHARED_BYTES = 227 * 1024
NUM_SMS_FALLBACK = 132

# (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) per path, before the filters.
# Five and six stages: with weights read from HBM (--cold), deeper pipelines won on
# 128x4096x4096 (H200: 6 stages 0.84x cuBLAS against 0.78x for the best of 3-4).
GRID = {
    "tma": list(itertools.product((64, 128), (64, 128, 256), (64, 128), (1, 2, 4, 8), (4, 8), (3, 4, 5, 6))),
    "ptr": list(itertools.product((32, 64, 128), (64, 128, 256), (32, 64), (1, 2, 4, 8), (4, 8), (3, 4, 5, 6))),
}
# fp8: the same bytes per K step take twice the K depth.
GRID_FP8 = {
    "tma": list(itertools.product((64, 128), (64, 128, 256), (128, 256), (1, 2, 4), (4, 8), (3, 4, 5))),
    "ptr": list(itertools.product((64, 128), (64, 128, 256), (64, 128), (1, 2, 4), (4, 8), (3, 4, 5))),
}
QUICK = {"tma": [(64, 128, 64, 2, 8, 4), (128, 128, 64, 4, 8, 4)],
         "ptr": [(64, 128, 32, 1, 4, 4), (128, 128, 32, 4, 8, 4)]}


def fits(path: str, tile, shape, num_sms: int, itemsize: int = 2) -> bool:
    """Leave out what cannot compile or cannot pay: accumulators past 128 fp32 registers a
    thread, stages past shared memory, 4-warp descriptor tiles larger than 64 x 128 (the
    warp-specialized loop fails to compile there, see tuning.py), split-K with more than
    two waves of programs or fewer than two K blocks per slice, tiles overhanging the
    output by more than a 64-wide tile."""
    bm, bn, bk, split, warps, stages = tile
    m, n, k = shape
    if bm * bn / (warps * 32) > 128:
        return False
    if stages * (bm * bk + bk * bn) * itemsize + bm * bn * 2 > SHARED_BYTES:
        return False
    if path == "tma" and warps == 4 and bm * bn > 64 * 128:
        return False
    if bm > max(64, triton.next_power_of_2(m)) or bn > max(64, triton.next_power_of_2(n)):
        return False
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    if split > 1 and (tiles * split > 2 * num_sms or k < 2 * split * bk):
        return False
    return True


def config(path: str, tile) -> triton.Config:
    bm, bn, bk, split, warps, stages = tile
    kwargs = {"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": bk, "GROUP_SIZE_M": 8}
    if split > 1:
        kwargs["SPLIT_K"] = split
    if path == "ptr":
        kwargs.update(TMA=False, PERSISTENT=False)
    else:
        kwargs["EPILOGUE_SUBTILE"] = bn >= 256 and split == 1
    return triton.Config(kwargs, num_warps=warps, num_stages=stages)


def base_plan(a, b) -> LaunchPlan:
    with pk.use_variant(matmul=VARIANT):
        return dispatch._launch_plan(pk.explain("matmul", a, b))


_PLANS: dict = {}


def plan_for(base: LaunchPlan, path: str, tile) -> LaunchPlan:
    """A one-config plan (kept, so that timing loops do not rebuild its autotuner)."""
    plan = _PLANS.get((path, tile))
    if plan is None:
        plan = _PLANS[(path, tile)] = LaunchPlan(base.variant, base.device, [config(path, tile)],
                                                 dict(base.switches))
    return plan


def operands(shape, dtype, seed=0):
    """Random ``(a, b)``, laid out as ``bench/matmul.py`` lays them out (``b`` column-major
    for fp8), so that the compiled kernels are the ones the timing process launches."""
    m, n, k = shape
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    a = torch.randn(m, k, device=DEVICE, generator=gen).to(dtype)
    if weight_major(dtype):
        return a, torch.randn(n, k, device=DEVICE, generator=gen).to(dtype).t()
    return a, torch.randn(k, n, device=DEVICE, generator=gen).to(dtype)


def compile_one(job) -> str:
    """Worker: compile one candidate into the disk cache with one launch."""
    path, tile, shape, dtype_name = job
    try:
        a, b = operands(shape, DTYPES[dtype_name])
        mm.launch(plan_for(base_plan(a, b), path, tile), a, b)
        torch.cuda.synchronize()
        return ""
    except Exception as exc:  # reported, and the candidate is skipped
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:160]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=SHAPES, help="comma-separated MxNxK")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--paths", default="tma,ptr")
    parser.add_argument("--jobs", type=int, default=12, help="compile processes")
    parser.add_argument("--quick", action="store_true", help="two candidates per path")
    parser.add_argument("--cold", action="store_true", help="rotate through operand copies larger than L2")
    parser.add_argument("--out", default="matmul-sweep")
    args = parser.parse_args()
    shapes = [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes.split(",") if s]
    paths = [p for p in args.paths.split(",") if p]
    if not set(paths) <= set(GRID):
        parser.error(f"--paths: choose among {', '.join(GRID)}")
    if not torch.cuda.is_available() or torch.version.hip:
        sys.exit("bench/matmul_sweep.py times kernels on an NVIDIA GPU; none here")
    dtype = DTYPES[args.dtype]
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count or NUM_SMS_FALLBACK
    itemsize = torch.finfo(dtype).bits // 8
    grid = QUICK if args.quick else GRID_FP8 if itemsize == 1 else GRID
    cands = {shape: [(p, t) for p in paths for t in grid[p] if fits(p, t, shape, num_sms, itemsize)]
             for shape in shapes}

    # Compile each (path, tile) once, at the first problem that takes it.
    jobs, seen = [], set()
    for shape in shapes:
        for cand in cands[shape]:
            if cand not in seen:
                seen.add(cand)
                jobs.append((*cand, shape, args.dtype))
    start = time.time()
    errors: dict = {}
    with futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for job, err in zip(jobs, pool.map(compile_one, jobs)):
            if err:
                errors[job[:2]] = err
    print(f"compiled {len(jobs) - len(errors)} of {len(jobs)} candidates in "
          f"{time.time() - start:.0f} s", flush=True)

    results = []
    for shape in shapes:
        m, n, k = shape
        copies = operand_copies(m, n, k, dtype, args.cold)
        a, b = copies[0]
        ref = torch.matmul(a.float(), b.float())
        tol = check_tolerance(dtype, vendor_matmul(dtype)(a, b), ref)
        flops = 2.0 * m * n * k
        cublas = triton.testing.do_bench_cudagraph(rotating(vendor_matmul(dtype), copies), return_mode="median")
        table_plan = base_plan(a, b)  # the current table, autotuned as dispatch does
        mm.launch(table_plan, a, b)
        table_ms = triton.testing.do_bench_cudagraph(rotating(functools.partial(mm.launch, table_plan), copies),
                                                     return_mode="median")
        print(f"\n{m}x{n}x{k} {args.dtype}{' (cold operands)' if args.cold else ''}: cuBLAS {cublas * 1e3:.1f} us "
              f"({flops / cublas * 1e-9:.0f} TFLOP/s); the table's pick {table_ms * 1e3:.1f} us "
              f"({cublas / table_ms:.2f}x cuBLAS): {mm_choice(table_plan, a, b)}", flush=True)
        timed = []
        for cand in cands[shape]:
            if cand in errors:
                continue
            path, tile = cand
            plan = plan_for(table_plan, path, tile)
            try:
                err, ratio = max_error(mm.launch(plan, a, b), ref, tol)
                if not ratio <= 1.0:
                    errors[cand] = f"WRONG at {m}x{n}x{k}: max abs error {err:.3g}"
                    continue
                ms = triton.testing.do_bench_cudagraph(rotating(functools.partial(mm.launch, plan), copies),
                                                       rep=10, return_mode="median")
            except Exception as exc:
                errors[cand] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:160]}"
                continue
            timed.append((ms, path, tile))
            results.append({"shape": shape, "path": path, "tile": tile, "us": ms * 1e3,
                            "vs_cublas": cublas / ms})
        timed.sort()
        for ms, path, tile in timed[:6]:
            print(f"  {path:3s} BM,BN,BK,split,w,s={tile}: {ms * 1e3:.1f} us "
                  f"{flops / ms * 1e-9:.0f} TFLOP/s ({cublas / ms:.2f}x cuBLAS)", flush=True)
        for path in paths:  # the best of each path not shown above
            best = min((t for t in timed if t[1] == path), default=None)
            if best and best not in timed[:6]:
                print(f"  best {path}: {best[2]} {best[0] * 1e3:.1f} us ({cublas / best[0]:.2f}x cuBLAS)")
        Path(args.out).with_suffix(".json").write_text(json.dumps(
            {"dtype": args.dtype, "cold": args.cold, "results": results,
             "errors": {str(key): v for key, v in errors.items()}}, indent=1))
    for cand, err in errors.items():
        print("skipped", cand, err)
    print(f"done in {time.time() - start:.0f} s")


def mm_choice(plan: LaunchPlan, a, b) -> str:
    """The config the plan's autotuner chose for ``a @ b``."""
    chosen = mm.chosen_config(plan, a, b)
    return "" if chosen is None else ", ".join(f"{key}: {v}" for key, v in chosen.items())


if __name__ == "__main__":
    main()
