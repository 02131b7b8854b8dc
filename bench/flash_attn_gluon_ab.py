"""Same-run A/B of a ``flash_attn_gluon`` forward knob on an NVIDIA sm_90 GPU.

A module constant of ``backends/nvidia/gluon/flash_attn_gluon.py`` that the forward's
launcher reads on every call (``PINGPONG``, ``STAGES``, ...) takes each of the given
values in turn, round after round, so that the values are timed in alternation in one
process and clock or thermal drift falls on all of them alike. SDPA's forward with the
cuDNN and with the flash backend is timed in the same rounds as the baselines. Each
value's output is checked against SDPA with the library's "attention" tolerance before it
is timed; fresh ``torch.randn`` inputs.

    python bench/flash_attn_gluon_ab.py --knob PINGPONG=0,1 [--seqlens 4096,16384]
                                        [--dims 64,128] [--dtype fp16] [--rounds 5]
                                        [--graphs]

Rows: B=4, H=32 at N=1024, 2048 and 4096, B=1, H=32 at N=16384 (the issue's shapes),
causal and not. Prints TFLOP/s (4·B·H·N²·D, half when causal; the median over rounds of
``triton.testing.do_bench`` medians) and each value's ratio to cuDNN and to SDPA-flash.
``--graphs`` times CUDA-graph replays (``do_bench_cudagraph``): the kernels without the
host's time per call, which at N=1024 is near the kernel's.
"""
from __future__ import annotations

import portable_kernels  # noqa: F401  (first: it chooses the interpreter before triton)

import argparse
import math
import statistics
import sys

import torch
import triton

from portable_kernels_backends.nvidia.gluon import flash_attn_gluon as fg
from portable_kernels.testing import assert_close, tolerance

SHAPES = {1024: (4, 32), 2048: (4, 32), 4096: (4, 32), 16384: (1, 32)}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def sdpa(backend: str, q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
    with sdpa_kernel(chosen[backend]):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--knob", required=True, help="NAME=v1,v2,... (ints)")
    parser.add_argument("--seqlens", default="4096,16384")
    parser.add_argument("--dims", default="64,128")
    parser.add_argument("--dtype", default="fp16", choices=sorted(DTYPES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--graphs", action="store_true",
                        help="time CUDA-graph replays: the kernels without the host")
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        sys.exit("bench/flash_attn_gluon_ab.py times the sm_90 Gluon forward; no sm_90 GPU here")
    name, values = args.knob.split("=")
    if not hasattr(fg, name):
        sys.exit(f"flash_attn_gluon has no {name}")
    values = [int(x) for x in values.split(",")]
    kept = getattr(fg, name)
    dtype = DTYPES[args.dtype]
    print(f"flash_attn_gluon.{name} in {values} · {torch.cuda.get_device_name()} · "
          f"triton {triton.__version__} · torch {torch.__version__} · {args.dtype}")
    bench = (triton.testing.do_bench_cudagraph if args.graphs
             else lambda fn: triton.testing.do_bench(fn, return_mode="median"))
    print(f"timed as {'CUDA-graph replays' if args.graphs else 'eager calls'}; "
          "cells: TFLOP/s (× cuDNN, × SDPA-flash)")
    print(f"{'N':>6} {'D':>4} {'causal':>6} {'cuDNN':>7} {'flash':>7} " +
          " ".join(f"{name}={v:<17}" for v in values))
    try:
        for n in (int(x) for x in args.seqlens.split(",")):
            b, h = SHAPES.get(n, (1, 32))
            for d in (int(x) for x in args.dims.split(",")):
                for causal in (False, True):
                    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype)
                               for _ in range(3))
                    scale = 1.0 / math.sqrt(d)
                    ref = sdpa("cudnn", q, k, v, causal).float()
                    for value in values:
                        setattr(fg, name, value)
                        out = fg.forward(q, k, v, causal, scale)[0]
                        assert_close(out, ref, tolerance(dtype, "attention"),
                                     f"{name}={value} N={n} D={d} causal={causal}")
                    times = {key: [] for key in ["cudnn", "flash", *values]}
                    for _ in range(args.rounds):
                        for backend in ("cudnn", "flash"):
                            times[backend].append(bench(
                                lambda: sdpa(backend, q, k, v, causal)))
                        for value in values:
                            setattr(fg, name, value)
                            times[value].append(bench(
                                lambda: fg.forward(q, k, v, causal, scale)))
                    flops = 4.0 * b * h * n * n * d * (0.5 if causal else 1.0)
                    tf = {key: flops / statistics.median(t) * 1e-9 for key, t in times.items()}
                    cells = " ".join(f"{tf[v]:5.0f} ({tf[v] / tf['cudnn']:.2f}, "
                                     f"{tf[v] / tf['flash']:.2f})" for v in values)
                    print(f"{n:>6} {d:>4} {str(causal):>6} {tf['cudnn']:7.0f} "
                          f"{tf['flash']:7.0f} {cells}", flush=True)
    finally:
        setattr(fg, name, kept)


if __name__ == "__main__":
    main()
