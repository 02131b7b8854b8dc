"""Registered variants of matmul or flash_attn timed eagerly in alternation with the vendor's
operator, on an NVIDIA GPU.

The full benchmarks (``matmul.py``, ``flash_attn.py``) time one implementation after
another, once per row, so a drift of the clocks or of the host's speed between two columns
reads as a difference between them. On small problems, where a call is short, that moved
ratios by 0.3 between runs (16x4096x4096: 0.66x cuBLAS in one full run, 0.98x in another,
with the same config). Here each of ``--variants`` and the vendor's operator are timed in
turn, ``--rounds`` times, and the table gives the median over rounds of each
``triton.testing.do_bench`` median (CUDA events, L2 flushed before each call), with the
µs per call of back-to-back calls (300 calls, then one synchronize; median of three, as
``host_per_call.py`` times them): the larger of a call's host and GPU time, so where it
exceeds the do_bench time the host sets the pace of eager calls. ``--kernel-time`` adds
each call's device time, its kernels' time from the torch profiler over 20 back-to-back
calls (host excluded, L2 warm), so a slow eager column can be told apart from a slow
kernel.

- ``matmul``: shapes ``MxNxK``; the vendor is ``torch.matmul`` (cuBLAS).
- ``flash_attn``: shapes ``BxHxNxD`` (self-attention, Nq = Nk = N), full and causal
  (``--causal``); the vendors are torch SDPA with the cuDNN and with the flash backend;
  forward, and with ``--backward`` also ``torch.autograd.grad`` after one forward.

Our variants run forced, through the plans dispatch builds, on fresh ``torch.randn``
inputs, each checked before it is timed (matmul: against an fp32 product, "dot"
tolerance; flash_attn: against cuDNN's output and gradients, "attention" tolerance).
``--set MODULE.NAME=VALUE`` overrides a constant of ``portable_kernels.kernels.MODULE``
first (a Python literal), e.g. ``matmul_gluon.MIN_TILES=1`` to time a variant on problems
its threshold leaves to another.

    python bench/variants_ab.py matmul --shapes 16x4096x4096,128x4096x4096 \\
        [--variants nvidia.persistent_tma,generic] [--dtypes fp16,bf16] [--rounds 5]
    python bench/variants_ab.py flash_attn --shapes 4x32x1024x128 [--causal both]
        [--variants nvidia.hopper,nvidia.hopper_gluon] [--backward] [--set ...]
        [--kernel-time]

Prints TFLOP/s (matmul 2·M·N·K; attention 4·B·H·N²·D, half when causal, the backward 2.5
times that) and ratios to the first vendor column; for matmul also the config each
autotuned variant chose (tuned on the row's first call).
"""
from __future__ import annotations

import portable_kernels as pk  # first: it chooses the interpreter before triton is imported

import argparse
import ast
import functools
import importlib
import statistics

import torch
import triton

from portable_kernels import dispatch
from portable_kernels.errors import VariantUnavailableError
from portable_kernels.kernels import matmul as mm
from portable_kernels.testing import assert_close, tolerance

import _common  # bench/, beside this script
import flash_attn as bench_fa  # bench/flash_attn.py: SDPA backends, our plans, the checks

DEFAULT_VARIANTS = {"matmul": "nvidia.persistent_tma,generic",
                    "flash_attn": "nvidia.hopper_gluon,nvidia.hopper"}


def override(assignment: str) -> None:
    target, value = assignment.split("=", 1)
    module_name, name = target.rsplit(".", 1)
    package = ("portable_kernels_backends.nvidia.gluon" if module_name.endswith("_gluon")
               else "portable_kernels.kernels")
    module = importlib.import_module(f"{package}.{module_name}")
    if not hasattr(module, name):
        raise SystemExit(f"--set: {package}.{module_name} has no {name}")
    setattr(module, name, ast.literal_eval(value))


def matmul_cases(shape: str, dtype: torch.dtype, variants: list[str], _args) -> tuple[dict, float]:
    """``({column: fn}, flops)`` for one matmul row, ours checked."""
    m, n, k = (int(x) for x in shape.lower().split("x"))
    a = torch.randn(m, k, device="cuda").to(dtype)
    b = torch.randn(k, n, device="cuda").to(dtype)
    ref = a.float() @ b.float()
    fns = {"cuBLAS": lambda: torch.matmul(a, b)}
    verdicts = {v.name: v for v in pk.explain("matmul", a, b).verdicts}
    for name in variants:
        verdict = verdicts.get(name)
        if verdict is None or not verdict.runnable:
            print(f"  {name} not timed on {shape}: {verdict.reason if verdict else 'not registered'}")
            continue
        with pk.use_variant(matmul=name):
            plan = dispatch._launch_plan(pk.explain("matmul", a, b))
        fns[name] = functools.partial(mm.launch, plan, a, b)
        assert_close(fns[name](), ref, tolerance(dtype, "dot"), f"{name} {shape}")
        chosen = mm.chosen_config(plan, a, b)  # None for a fixed-tile (Gluon) plan
        if chosen:
            print(f"  {name} {shape} {str(dtype).replace('torch.', '')} config: "
                  + ", ".join(f"{key}: {value}" for key, value in chosen.items()))
    return {"fwd": fns}, 2.0 * m * n * k


def attention_cases(shape: str, dtype: torch.dtype, variants: list[str], args,
                    causal: bool) -> tuple[dict, float]:
    """``({pass: {column: fn}}, forward flops)`` for one attention row, ours checked."""
    from torch.nn.attention import SDPBackend

    b, h, n, d = (int(x) for x in shape.lower().split("x"))
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    runs = {"cuDNN": bench_fa.sdpa(SDPBackend.CUDNN_ATTENTION),
            "SDPA-flash": bench_fa.sdpa(SDPBackend.FLASH_ATTENTION)}
    for name in variants:
        try:
            runs[name] = bench_fa.ours(name, q, k, v, causal)[0]
        except VariantUnavailableError as exc:
            print(f"  {name} not timed on {shape}: {str(exc).splitlines()[0]}")
    passes = {"fwd": {}, "bwd": {}}
    ref = None
    for name, run in runs.items():
        out = run(q, k, v, causal)
        grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        if ref is None:
            ref = (out.detach(), grads)
        elif name in variants:
            wrong = bench_fa.check(out, grads, *ref, dtype)
            if wrong:
                raise SystemExit(f"{name} {shape} causal={causal}: {wrong}")
        passes["fwd"][name] = functools.partial(run, q, k, v, causal)
        if args.backward:
            passes["bwd"][name] = functools.partial(torch.autograd.grad, out, (q, k, v), dout,
                                                    retain_graph=True)
    flops = 4.0 * b * h * n * n * d / (2 if causal else 1)
    return {p: fns for p, fns in passes.items() if fns}, flops


def device_us(events, calls: int) -> float:
    """Device µs per call from the torch profiler's ``key_averages()`` of ``calls`` calls:
    every kernel's own device time (a CPU-side event's time on the device is its kernels',
    already counted), summed."""
    return sum(e.self_device_time_total for e in events) / calls


def kernel_us(fn, calls: int = 20) -> float:
    """Device time per call of ``fn`` in µs (its CUDA kernels; host time excluded)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return device_us(prof.key_averages(), calls)


def time_row(passes: dict, flops: float, rounds: int, kernel_time: bool = False) -> dict:
    """``{pass: {column: (TFLOP/s, µs per back-to-back call, device µs or None)}}``,
    columns timed in alternation."""
    times = {p: {name: [] for name in fns} for p, fns in passes.items()}
    for _ in range(rounds):
        for p, fns in passes.items():
            for name, fn in fns.items():
                times[p][name].append(triton.testing.do_bench(fn, return_mode="median"))
    out = {}
    for p, fns in passes.items():
        scale = 2.5 if p == "bwd" else 1.0
        out[p] = {name: (scale * flops / statistics.median(times[p][name]) * 1e-9,
                         _common.per_call_us(fn, 300, 3), kernel_us(fn) if kernel_time else None)
                  for name, fn in fns.items()}
    return out


def cell(name: str, tflops: float, base: float, call_us: float, device: float | None) -> str:
    """One column of a printed row: ``name TF/s (ratio) [µs per call] {device µs}``."""
    text = f"{name} {tflops:.0f} ({tflops / base:.2f}) [{call_us:.0f}]"
    return text if device is None else text + f" {{{device:.0f}}}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", choices=sorted(DEFAULT_VARIANTS))
    parser.add_argument("--shapes", required=True, help="comma-separated MxNxK or BxHxNxD")
    parser.add_argument("--variants", default="", help="comma-separated registered variants")
    parser.add_argument("--dtypes", default="fp16", help="comma-separated: fp16, bf16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--causal", default="both", choices=["both", "yes", "no"])
    parser.add_argument("--backward", action="store_true", help="flash_attn: time the backward too")
    parser.add_argument("--set", action="append", default=[], dest="overrides",
                        help="MODULE.NAME=VALUE, a constant of portable_kernels.kernels.MODULE")
    parser.add_argument("--kernel-time", action="store_true",
                        help="also each call's device time from the torch profiler")
    args = parser.parse_args()
    info = _common.nvidia_gpu("bench/variants_ab.py", "our variants against the vendor's operators",
                              f"tests/test_{args.kernel}.py")
    for assignment in args.overrides:
        override(assignment)
    variants = [v for v in (args.variants or DEFAULT_VARIANTS[args.kernel]).split(",") if v]
    print(f"{args.kernel} eager, in alternation · {info.name} · torch {torch.__version__} · "
          f"triton {triton.__version__} · {args.rounds} rounds"
          + (f" · set {', '.join(args.overrides)}" if args.overrides else ""))
    print("TFLOP/s (ratio to the first vendor column) [µs per back-to-back call]"
          + (" {device µs per call}" if args.kernel_time else ""))
    rows = [(shape, dtype, causal) for dtype in _common.dtypes(args.dtypes)
            for shape in args.shapes.split(",")
            for causal in ({"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
                           if args.kernel == "flash_attn" else (None,))]
    for shape, dtype, causal in rows:
        if args.kernel == "matmul":
            passes, flops = matmul_cases(shape, dtype, variants, args)
        else:
            passes, flops = attention_cases(shape, dtype, variants, args, causal)
        result = time_row(passes, flops, args.rounds, args.kernel_time)
        label = f"{shape} {str(dtype).replace('torch.', '')}"
        if causal is not None:
            label += " causal" if causal else " full"
        for p, cells in result.items():
            base = next(iter(cells.values()))[0]
            text = " | ".join(cell(name, tf, base, us, dev) for name, (tf, us, dev) in cells.items())
            print(f"{label} {p}: {text}", flush=True)


if __name__ == "__main__":
    main()
