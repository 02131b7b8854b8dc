"""Sweep flash_attn tile shapes on an NVIDIA GPU, each kernel timed alone.

For each head dim and causal setting, at one (B, H, N) and fp16 or bf16, it times:

- the forward kernel (through ``flash_attn._forward`` on a one-config plan), with tensor
  descriptors (``tma``, the ``nvidia.hopper`` path), with pointer loads (``ptr``, the
  ``generic`` one) and with descriptors in the warp-specialized loop (``ws``, over its own
  short list of tiles: Triton specializes only 4-warp programs for sm_90);
- the dk/dv and the dq backward kernels (``_launch_dkdv``, ``_launch_dq``), with and without
  descriptors, each over its own grid of (BLOCK_M, BLOCK_N, warps, stages), and the Gluon
  dk/dv kernel of ``nvidia.hopper_gluon`` (``gluon``: its one tile, over its buffer counts);
- with ``--kernels bwd``, whole backwards (``flash_attn._backward``: preprocess, dk/dv, dq):
  ``nvidia.hopper``'s (``hopper``, also the reference of this kernel) and
  ``nvidia.hopper_gluon``'s with the family's dq kernel (``gluon``) or with dq fused
  (``gluonq``), counted as 2.5 forwards like SDPA's backward;

and SDPA (cuDNN backend) forward and backward at the same shape for scale. Every candidate
is checked against a reference kernel's output (pointer loads, 64 x 64 tiles) before it is
timed, at the timed shape and, for the forward, at a ragged one (N = 200: partial tiles).
Compiling a few hundred kernels one after another takes minutes, so a pool of processes
compiles them first, on small inputs with the same specializations, into Triton's on-disk
cache; the timing process then loads them.

    python bench/flash_attn_sweep.py [--dims 64,128] [--n 4096] [--batch 4] [--heads 32]
                                     [--dtype fp16] [--jobs 12] [--out PREFIX] [--quick]
                                     [--kernels fwd,dkdv,dq,bwd] [--table]

Prints, per (D, causal) and kernel, the fastest settings and their TFLOP/s; writes every
timing to ``PREFIX.json``. This is a tuning tool: its winners go into the NVIDIA backend's
table (``backends/nvidia/tuning.py``), and ``bench/flash_attn.py`` measures the result.
"""
from __future__ import annotations

import portable_kernels as pk  # first: it chooses the interpreter before triton is imported

import argparse
import concurrent.futures as futures
import contextlib
import itertools
import json
import math
import multiprocessing
import sys
import time
from pathlib import Path

import torch
import triton

from portable_kernels.kernels import _host
from portable_kernels.kernels import flash_attn as fa
from portable_kernels_backends.nvidia.gluon import flash_attn_gluon as fg
from portable_kernels.launch import LaunchPlan

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
DEVICE = "cuda"

# (BLOCK_M, BLOCK_N, num_warps, num_stages)
FWD = [(128, 64, 4, s) for s in (2, 3, 4)] + [(128, 64, 8, s) for s in (2, 3, 4)] \
    + [(128, 128, 8, s) for s in (2, 3)] + [(128, 128, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2)]
# The warp-specialized loop: a producer warpgroup and two consumer warpgroups of 64 rows.
FWD_WS = [(128, 64, 4, 2), (128, 64, 4, 3), (128, 128, 4, 2)]
# dk/dv: BLOCK_N keys held, BLOCK_M queries streamed.
DKDV = [(32, 128, 4, s) for s in (2, 3, 4, 5)] + [(32, 128, 8, s) for s in (2, 3)] \
    + [(64, 128, 8, s) for s in (2, 3)] + [(64, 64, 4, s) for s in (2, 3, 4)] \
    + [(32, 64, 4, s) for s in (3, 5)] + [(16, 128, 4, 4), (64, 128, 4, 2)] \
    + [(64, 64, 8, s) for s in (2, 3)] + [(128, 64, 8, s) for s in (2, 3)] + [(128, 64, 4, 2)]
# dq: BLOCK_M queries held, BLOCK_N keys streamed.
DQ = [(128, 32, 4, s) for s in (2, 3, 4, 5)] + [(128, 32, 8, s) for s in (2, 3)] \
    + [(128, 64, 8, s) for s in (2, 3)] + [(64, 64, 4, s) for s in (2, 3, 4)] \
    + [(64, 32, 4, s) for s in (3, 5)] + [(128, 16, 4, 4), (128, 64, 4, 2), (32, 128, 8, 2)] \
    + [(128, 64, 8, 4), (128, 128, 8, 2), (64, 128, 4, 2), (64, 128, 4, 3)]
# The Gluon dk/dv kernel: 64 queries per step, 128 keys (two consumer warpgroups), its
# buffer count (BWD_STAGES) swept; the warps are its consumers'.
DKDV_GLUON = [(64, 128, 4, s) for s in (2, 3, 4)]
# The whole backward (preprocess, dk/dv, dq) of nvidia.hopper and of nvidia.hopper_gluon
# with its dq kernel (gluon) or with dq added up in its dk/dv kernel (gluonq); the tile is
# the Gluon kernel's, over its buffer counts.
BWD = [(64, 128, 4, s) for s in (2, 3)]
QUICK = {"fwd": FWD[:4], "dkdv": DKDV[:4], "dq": DQ[:4], "bwd": BWD[:1]}
PATHS = {"fwd": ("tma", "ptr", "ws"), "dkdv": ("tma", "ptr", "gluon"), "dq": ("tma", "ptr"),
         "bwd": ("hopper", "gluon", "gluonq")}


def fits(kernel: str, tile, d: int) -> bool:
    """Leave out shapes whose fp32 accumulators cannot fit the registers (they spill or fail
    to compile): the held block times D, per thread of the program."""
    bm, bn, warps, _ = tile
    held = bm if kernel in ("fwd", "dq") else 2 * bn  # dk/dv holds two accumulators
    return held * d / (warps * 32) <= 160


def table_tiles(configs: list, d: int) -> dict[str, list[tuple]]:
    """A flash_attn tuning table's tiles for fp16 rows of head dim ``d``, each as
    (BLOCK_M, BLOCK_N, warps, stages): the forward's candidates (the row class the backward's
    config is in) and the one dk/dv and one dq tile the backward takes (the first config
    whose ``ROW_BYTES_MAX`` fits, as the launcher takes it)."""
    row = fa._block_d(d) * 2
    first = next((c for c in configs if c.kwargs.get("ROW_BYTES_MAX", row) >= row), configs[-1])
    row_class = first.kwargs.get("ROW_BYTES_MAX")
    dkdv_m, dkdv_n, dq_m, dq_n = fa._backward_blocks(first)
    dkdv, dq = fa._options(first, "dkdv"), fa._options(first, "dq")
    return {"fwd": [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
                    for c in configs if c.kwargs.get("ROW_BYTES_MAX") == row_class],
            "dkdv": [(dkdv_m, dkdv_n, dkdv["num_warps"], dkdv["num_stages"])],
            "dq": [(dq_m, dq_n, dq["num_warps"], dq["num_stages"])]}


def hopper_configs() -> list:
    """The ``nvidia.hopper`` variant's tuning table on this device."""
    q = torch.empty(1, 1, 1, 64, device=DEVICE, dtype=torch.float16)
    with pk.use_variant(flash_attn="nvidia.hopper"):
        return pk.get_kernel("flash_attn").plan(q, q, q).configs


def candidates(args) -> list[tuple]:
    """Every (kernel, d, causal, path, tile) to compile and time."""
    def grid(kernel: str, d: int, path: str) -> list[tuple]:
        # The Gluon kernel's one tile and the whole backward first: no table lists them.
        if kernel == "bwd":
            return BWD[:1] if path == "hopper" else BWD
        if path == "gluon":
            return DKDV_GLUON
        if args.table:
            return table_tiles(args.table, d)[kernel]
        if path == "ws":
            return FWD_WS
        return (QUICK if args.quick else {"fwd": FWD, "dkdv": DKDV, "dq": DQ})[kernel]

    return [(kernel, d, causal, path, tile)
            for kernel in args.kernels
            for d in args.dims for causal in (False, True) for path in PATHS[kernel]
            for tile in grid(kernel, d, path)
            if path.startswith(("gluon", "hopper")) or fits(kernel, tile, d)]


def inputs(b, h, n, d, dtype, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q, k, v, do = (torch.randn(b, h, n, d, device=DEVICE, dtype=dtype, generator=gen)
                   for _ in range(4))
    return q, k, v, do


def base_plan(q) -> LaunchPlan:
    with pk.use_variant(flash_attn="generic"):
        return pk.get_kernel("flash_attn").plan(q, q, q)


_PLANS: dict = {}


def fwd_plan(base: LaunchPlan, tile, path: str) -> LaunchPlan:
    """A one-config plan (kept, so that timing loops do not build autotuners)."""
    plan = _PLANS.get((id(base), tile, path))
    if plan is None:
        bm, bn, warps, stages = tile
        cfg = triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "WARP_SPECIALIZE": path == "ws"},
                            num_warps=warps, num_stages=stages)
        plan = _PLANS[(id(base), tile, path)] = LaunchPlan(
            base.variant, base.device, [cfg], {**base.switches, "TMA": path != "ptr"})
    return plan


def run(kernel, tile, path, causal, q, k, v, do, out, lse, delta, base):
    """One launch of the candidate; returns its output, or its outputs as a tuple (joined
    by :func:`joined` for checks, not in the timed call)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    bm, bn, warps, stages = tile
    opts = {"num_warps": warps, "num_stages": stages}
    tma = path != "ptr"
    if kernel == "fwd":
        return fa._forward(fwd_plan(base, tile, path), q, k, v, causal, scale)[0]
    if kernel == "bwd":
        fg.BWD_STAGES = stages
        plan = bwd_plan(q, path)
        return fa.stages(plan).backward(plan, do, q, k, v, out, lse, causal, scale)
    with _host.scratch_allocator(q.device) if tma else contextlib.nullcontext():
        if kernel == "dkdv" and path == "gluon":
            dk, dv = torch.empty_like(k), torch.empty_like(v)
            fg.BWD_STAGES = stages
            fg.backward(q, k, v, do, lse, delta, dk, dv, causal, scale)
            return dk, dv
        if kernel == "dkdv":
            dk, dv = torch.empty_like(k), torch.empty_like(v)
            fa._launch_dkdv(q, k, v, do, lse, delta, dk, dv, causal, scale, bm, bn, False, tma, opts)
            return dk, dv
        dq = torch.empty_like(q)
        fa._launch_dq(q, k, v, do, lse, delta, dq, causal, scale, bm, bn, False, tma, opts)
        return dq


def bwd_plan(q, path: str) -> LaunchPlan:
    """nvidia.hopper's plan, or nvidia.hopper_gluon's with GLUON_DQ as ``path`` says."""
    plan = _PLANS.get(("bwd", q.shape[-1], q.dtype, path))
    if plan is None:
        fg.MIN_KEYS = {}  # the compile workers' short sequences too
        name = "nvidia.hopper" if path == "hopper" else "nvidia.hopper_gluon"
        with pk.use_variant(flash_attn=name):
            chosen = pk.get_kernel("flash_attn").plan(q, q, q)
        switches = dict(chosen.switches)
        if path != "hopper":
            switches["GLUON_DQ"] = path == "gluonq"
        plan = _PLANS[("bwd", q.shape[-1], q.dtype, path)] = LaunchPlan(
            chosen.variant, chosen.device, chosen.configs, switches)
    return plan


def state(b, h, n, d, dtype, causal, seed=0):
    """Inputs plus the forward's out, LSE and the backward's delta, from the generic plan."""
    q, k, v, do = inputs(b, h, n, d, dtype, seed=seed)
    base = base_plan(q)
    scale = 1.0 / math.sqrt(d)
    out, lse = fa._forward(base, q, k, v, causal, scale)
    delta = (out.float() * do.float()).sum(-1)
    return q, k, v, do, out, lse, delta, base


def joined(out) -> torch.Tensor:
    return torch.cat(out) if isinstance(out, tuple) else out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference over the reference's largest magnitude (NaN: inf)."""
    err = float((out.float() - ref).abs().max() / ref.abs().max())
    return err if math.isfinite(err) else math.inf


def compile_one(cand, dtype_name) -> str:
    """Worker: compile one candidate into the disk cache with a small launch."""
    kernel, d, causal, path, tile = cand
    try:
        st = state(1, 2, 256, d, DTYPES[dtype_name], causal)
        run(kernel, tile, path, causal, *st)
        torch.cuda.synchronize()
        return ""
    except Exception as exc:  # reported, and the candidate is skipped
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"


def flops(kernel, b, h, n, d, causal) -> float:
    f = 4.0 * b * h * n * n * d * (0.5 if causal else 1.0)
    # dk/dv: 4 of the backward's 7 dots (K·Qᵀ, Pᵀ·dO, V·dOᵀ, dSᵀ·Q); dq: 3 (Q·Kᵀ, dO·Vᵀ, dS·K).
    # bwd: counted as SDPA's backward is, 2.5 forwards (5 dots), whichever dots it runs.
    return {"fwd": f, "dkdv": f * 2.0, "dq": f * 1.5, "bwd": f * 2.5}[kernel]


def sdpa_times(b, h, n, d, dtype, causal) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, do = (x.requires_grad_() for x in inputs(b, h, n, d, dtype, seed=1))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        fwd = triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal), return_mode="median")
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        bwd = triton.testing.do_bench(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
                                      return_mode="median")
    return {"fwd": fwd, "bwd": bwd}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", default="64,128")
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--dtype", default="fp16", choices=sorted(DTYPES))
    parser.add_argument("--jobs", type=int, default=12, help="compile processes")
    parser.add_argument("--out", default="flash-attn-sweep")
    parser.add_argument("--quick", action="store_true", help="four candidates per kernel")
    parser.add_argument("--table", action="store_true",
                        help="only the nvidia.hopper table's tiles, on every path (e.g. to "
                             "see which path its backward should take at this --n)")
    parser.add_argument("--kernels", default="fwd,dkdv,dq", help="which of fwd, dkdv, dq, bwd")
    args = parser.parse_args()
    args.dims = [int(x) for x in args.dims.split(",")]
    args.kernels = [x for x in args.kernels.split(",") if x]
    if not set(args.kernels) <= set(PATHS):
        parser.error(f"--kernels: choose among {', '.join(PATHS)}")
    if not torch.cuda.is_available() or torch.version.hip:
        sys.exit("bench/flash_attn_sweep.py times kernels on an NVIDIA GPU; none here")
    dtype = DTYPES[args.dtype]
    b, h, n = args.batch, args.heads, args.n
    args.table = hopper_configs() if args.table else None
    cands = candidates(args)
    start = time.time()
    errors = {}
    ctx = multiprocessing.get_context("spawn")
    with futures.ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
        for cand, err in zip(cands, pool.map(compile_one, cands, itertools.repeat(args.dtype))):
            if err:
                errors[cand] = err
    print(f"compiled {len(cands) - len(errors)} of {len(cands)} candidates in "
          f"{time.time() - start:.0f} s", flush=True)

    results = []
    for d in args.dims:
        for causal in (False, True):
            st = state(b, h, n, d, dtype, causal, seed=2)
            base = st[-1]
            # References: pointer-load candidates of 64 x 64 tiles (compiled with the rest).
            refs = {kernel: joined(run(kernel, tile, "hopper" if kernel == "bwd" else "ptr",
                                       causal, *st)).float() for kernel, tile in
                    (("fwd", (64, 64, 4, 3)), ("dkdv", (64, 64, 4, 2)), ("dq", (64, 64, 4, 2)),
                     ("bwd", BWD[0]))
                    if kernel in args.kernels}
            if "fwd" in args.kernels:  # partial tiles (N = 200) for the forward candidates
                ragged = state(1, 2, 200, d, dtype, causal, seed=3)
                ragged_ref = run("fwd", (64, 64, 4, 3), "ptr", causal, *ragged).float()
            sdpa = sdpa_times(b, h, n, d, dtype, causal)
            f = 4.0 * b * h * n * n * d * (0.5 if causal else 1.0)
            print(f"\nD={d} causal={causal}: cuDNN fwd {f / sdpa['fwd'] * 1e-9:.0f} TFLOP/s, "
                  f"bwd {2.5 * f / sdpa['bwd'] * 1e-9:.0f} TFLOP/s ({sdpa['bwd']:.3f} ms)")
            for kernel in args.kernels:
                timed = []
                for cand in cands:
                    if cand[:3] != (kernel, d, causal) or cand in errors:
                        continue
                    _, _, _, path, tile = cand
                    try:
                        err = relative_error(joined(run(kernel, tile, path, causal, *st)),
                                             refs[kernel])
                        if kernel == "fwd":
                            err = max(err, relative_error(run(kernel, tile, path, causal, *ragged),
                                                          ragged_ref))
                        if not err < 2e-2:
                            errors[cand] = f"WRONG: relative max error {err:.3g}"
                            continue
                        ms = triton.testing.do_bench(
                            lambda: run(kernel, tile, path, causal, *st), return_mode="median")
                    except Exception as exc:
                        errors[cand] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                        continue
                    tf = flops(kernel, b, h, n, d, causal) / ms * 1e-9
                    timed.append((ms, path, tile, tf))
                    results.append({"kernel": kernel, "D": d, "causal": causal, "path": path,
                                    "tile": tile, "ms": ms, "tflops": tf})
                timed.sort()
                for ms, path, tile, tf in timed[:4]:
                    print(f"  {kernel:5s} {path:3s} BM,BN,w,s={tile}: "
                          f"{ms:.3f} ms {tf:.0f} TFLOP/s", flush=True)
                for path in PATHS[kernel]:  # the best of each path not shown above
                    best = min((t for t in timed if t[1] == path), default=None)
                    if best and best not in timed[:4]:
                        print(f"  {kernel:5s} best {path}: {best[2]} {best[0]:.3f} ms "
                              f"{best[3]:.0f} TFLOP/s")
            Path(args.out).with_suffix(".json").write_text(json.dumps(
                {"shape": [b, h, n], "dtype": args.dtype, "results": results,
                 "errors": {str(k): v for k, v in errors.items()}}, indent=1))
    for cand, err in errors.items():
        print("skipped", cand, err)
    print(f"done in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
