"""Same-run A/B of settings of the sm_90 Gluon matmul (``matmul_gluon.py``) against cuBLAS.

Each ``--set`` is a comma-separated list of module constants of
``backends/nvidia/gluon/matmul_gluon.py`` (``BLOCK_N=128,STAGES=5``; an empty one keeps
the module's values); every setting is applied in turn, round after round, and timed with
``torch.matmul`` (cuBLAS) in the same rounds, so that clock or thermal drift falls on all of
them alike; ``--variant`` adds registered matmul variants (forced, autotuned on their
first call) to the same rounds. Each output is checked against an fp32 product with the
library's "dot" tolerance before it is timed; fresh ``torch.randn`` operands, ``b``
row-major (``--b-col``: column-major, an (N, K) weight's transpose).

    python bench/matmul_gluon_ab.py --set "" --set BLOCK_K=32,STAGES=6 \\
        [--shapes 4096x4096x4096,8192x8192x8192] [--dtype fp16] [--rounds 5] [--b-col]
        [--variant nvidia.persistent_tma ...]

Prints TFLOP/s (2·M·N·K over the median of the rounds' ``triton.testing.do_bench``
medians) and each setting's ratio to cuBLAS.
"""
from __future__ import annotations

import portable_kernels as pk  # first: it chooses the interpreter before triton

import argparse
import statistics
import sys

import torch
import triton

from portable_kernels_backends.nvidia.gluon import matmul_gluon as mg
from portable_kernels.testing import assert_close, tolerance

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def parse_setting(text: str) -> dict[str, int]:
    setting = {}
    for item in filter(None, text.split(",")):
        name, value = item.split("=")
        if not hasattr(mg, name):
            sys.exit(f"matmul_gluon has no {name}")
        setting[name] = int(value)
    return setting


def _forced(mm, variant: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    with pk.use_variant(matmul=variant):
        return mm(a, b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", action="append", required=True, dest="settings",
                        help="NAME=v,NAME=v,... (ints); repeat for each setting")
    parser.add_argument("--shapes", default="4096x4096x4096,8192x8192x8192")
    parser.add_argument("--dtype", default="fp16", choices=sorted(DTYPES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--b-col", action="store_true", help="b column-major")
    parser.add_argument("--variant", action="append", default=[], dest="variants",
                        help="a registered matmul variant to time too; repeatable")
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        sys.exit("bench/matmul_gluon_ab.py times the sm_90 Gluon matmul; no sm_90 GPU here")
    settings = [parse_setting(s) for s in args.settings]
    labels = [",".join(f"{k}={v}" for k, v in s.items()) or "module" for s in settings]
    kept = {name: getattr(mg, name) for s in settings for name in s}
    dtype = DTYPES[args.dtype]
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"matmul_gluon settings · {torch.cuda.get_device_name()} · triton {triton.__version__} "
          f"· torch {torch.__version__} · {args.dtype} · b {'col' if args.b_col else 'row'}-major")
    mm = pk.get_kernel("matmul")
    forced = {name: (lambda a, b, name=name: _forced(mm, name, a, b)) for name in args.variants}
    print(f"{'shape':>18} {'cuBLAS':>7} "
          + " ".join(f"{label:>22}" for label in [*labels, *forced]))

    def apply(setting):
        for name, value in {**kept, **setting}.items():
            setattr(mg, name, value)

    try:
        for shape in args.shapes.split(","):
            m, n, k = (int(x) for x in shape.lower().split("x"))
            a = torch.randn(m, k, device="cuda", dtype=dtype)
            b = (torch.randn(n, k, device="cuda", dtype=dtype).t() if args.b_col
                 else torch.randn(k, n, device="cuda", dtype=dtype))
            out = torch.empty(m, n, device="cuda", dtype=dtype)
            ref = torch.matmul(a.float(), b.float())
            for setting, label in zip(settings, labels):
                apply(setting)
                out.fill_(float("nan"))
                assert_close(mg.matmul(a, b, out, num_sms), ref, tolerance(dtype, "dot"),
                             f"{label} {shape}")
            for name, fn in forced.items():
                assert_close(fn(a, b), ref, tolerance(dtype, "dot"), f"{name} {shape}")
            times = {label: [] for label in ["cublas", *labels, *forced]}
            for _ in range(args.rounds):
                times["cublas"].append(triton.testing.do_bench(lambda: torch.matmul(a, b),
                                                               return_mode="median"))
                for setting, label in zip(settings, labels):
                    apply(setting)
                    times[label].append(triton.testing.do_bench(
                        lambda: mg.matmul(a, b, out, num_sms), return_mode="median"))
                for name, fn in forced.items():
                    times[name].append(triton.testing.do_bench(lambda: fn(a, b),
                                                               return_mode="median"))
            tf = {key: 2.0 * m * n * k / statistics.median(t) * 1e-9 for key, t in times.items()}
            cells = " ".join(f"{tf[lab]:14.0f} ({tf[lab] / tf['cublas']:.2f})"
                             for lab in [*labels, *forced])
            print(f"{shape:>18} {tf['cublas']:7.0f} {cells}", flush=True)
    finally:
        apply({})


if __name__ == "__main__":
    main()
