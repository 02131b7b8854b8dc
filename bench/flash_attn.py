"""flash_attn throughput on an NVIDIA GPU: our variants against torch SDPA in the same run.

Rows: B=4, H=32, N in {1024, 4096} and B=1, H=32, N=16384; D in {64, 128}; causal and not;
fp16 and bf16; fresh ``torch.randn`` inputs per row. Columns, forward and backward:

- ``cudnn``: ``torch.nn.functional.scaled_dot_product_attention`` under
  ``sdpa_kernel(SDPBackend.CUDNN_ATTENTION)``, the baseline of the ratios;
- ``flash``: the same under ``SDPBackend.FLASH_ATTENTION`` (FlashAttention-2);
- ``gluon``: our ``nvidia.hopper_gluon`` variant, forced, the one chosen on sm_90 for
  these shapes from N = 4096 on (from 2048 at D = 128; ``flash_attn_gluon.py``,
  FlashAttention-3's schedules in Gluon: the forward, and one backward kernel for dk, dv
  and dq);
- ``hopper``: our ``nvidia.hopper`` variant, forced (descriptor loads, pipelined K/V loop,
  autotuned forward; its backward: the generic kernels' code on descriptors);
- ``generic``: our ``generic`` variant, forced (pointer loads, one config per row size).

Each of ours is checked against SDPA (flash, else cuDNN) before it is timed, output and the
three gradients, with the library's "attention" tolerance (its absolute part scaled by the
gradients' magnitude for those); a wrong result is reported and not timed. Times are the median of
``triton.testing.do_bench`` (with ``--cudagraph``, of replays of a captured CUDA graph of
ten calls, see :func:`graph_bench`: the host's time per call is out, so short rows compare
kernels, not Python and launch paths; nothing clears the L2 cache between calls). The
forward counts ``4·B·H·N²·D`` FLOPs (half when causal), the backward 2.5 times that; the
backward is timed alone, as ``torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)``
after one forward. The first call of each shape compiles and autotunes our kernels; results
persist in the library's tuning cache (``PK_CACHE_DIR``). The autotuner's timing of every
candidate is kept in the JSON (``tuning``), which says what warp specialization is worth on
this GPU.

    python bench/flash_attn.py [--quick | --seqlens 1024,...] [--json PATH] [--plot DIR]
                               [--dtypes fp16,bf16] [--cudagraph] [--set MODULE.NAME=VALUE ...]

With ``--json PATH``, writes ``PATH`` and the Markdown table beside it after every row (an
interrupted run keeps what it measured); with ``--plot DIR``, at the end, plots through
``triton.testing.perf_report`` (TFLOP/s against N per pass, dtype, head dim and masking; it
needs pandas and matplotlib, and says so when they are missing). ``--set`` times a kernel
module's setting instead of the shipped one (``flash_attn_gluon.PINGPONG=False``, or
``flash_attn_gluon.MIN_KEYS={64: 0, 128: 0}`` for the Gluon variant on short sequences).
Needs an NVIDIA GPU; on a CPU-only machine it exits with a message.
"""
from __future__ import annotations

import portable_kernels as pk  # first: it chooses the interpreter before triton is imported

import statistics
import time

import torch
import triton

from portable_kernels.errors import VariantUnavailableError
from portable_kernels.kernels import flash_attn as fa
from portable_kernels.testing import Tolerance, tolerance

import _common  # bench/, beside this script

SHAPES = [(4, 32, 1024), (4, 32, 4096), (1, 32, 16384)]   # (B, H, N)
QUICK = [(4, 32, 4096, 64, False), (4, 32, 4096, 128, True), (1, 32, 16384, 128, True)]
DIMS = (64, 128)
OURS = {"gluon": "nvidia.hopper_gluon", "hopper": "nvidia.hopper", "generic": "generic"}
SDPA = ("cudnn", "flash")
METHODS = SDPA + tuple(OURS)
PASSES = ("fwd", "bwd")
DEVICE = "cuda"


def rows(quick: bool, seqlens: set[int] | None = None) -> list[tuple[int, int, int, int, bool]]:
    if quick:
        return QUICK
    return [(b, h, n, d, causal) for b, h, n in SHAPES for d in DIMS for causal in (False, True)
            if seqlens is None or n in seqlens]


def sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def ours(variant: str, q, k, v, causal):
    """Our variant's launcher on a plan built once (dispatch is not what is measured)."""
    with pk.use_variant(flash_attn=variant):
        plan = pk.get_kernel("flash_attn").plan(q, k, v, causal=causal)

    def run(q, k, v, causal):
        return fa.launch(plan, q, k, v, causal=causal)

    return run, plan


def tuning_record(plan, q, k, causal, timings_before) -> dict:
    """The hopper forward's chosen config for this row's problem and, when this row tuned
    it (not the tuning cache), every candidate's median time (ms)."""
    tuner = fa._autotuned_forward(plan)
    # Asked by problem key (the launcher's): a tuned problem skips the autotuner, so its
    # best_config may be another problem's.
    key = (fa._bucket(q.shape[2], k.shape[2]), fa._block_d(q.shape[-1]), causal, q.dtype)
    best = plan.chosen(tuner, key)
    timings = getattr(tuner, "configs_timings", None)
    fresh = timings is not None and timings is not timings_before
    return {"best": "" if best is None else ", ".join(f"{n}: {v}" for n, v in best.items()),
            "candidates": [{"config": str(c), "ws": bool(c.kwargs.get("WARP_SPECIALIZE")),
                            "ms": t[0] if isinstance(t, (list, tuple)) else t}
                           for c, t in (timings.items() if fresh else ())]}


def ws_summary(tuning: dict) -> str:
    """Best warp-specialized vs best pipelined candidate of one tuning, or ''."""
    best = {ws: min((c["ms"] for c in tuning.get("candidates", ()) if c["ws"] == ws), default=None)
            for ws in (True, False)}
    if None in best.values():
        return ""
    return f"warp-specialized {best[True]:.3f} ms, pipelined {best[False]:.3f} ms"


def _grad_tol(tol: Tolerance, ref: torch.Tensor) -> Tolerance:
    return Tolerance(tol.atol * max(1.0, float(ref.abs().max())), tol.rtol)


def _max_error(x: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> tuple[float, float]:
    """testing.max_error's (max abs error, worst error / allowed) computed on the GPU in
    fp32: these tensors have up to 67M elements, too many to copy to the host per row."""
    x, ref = x.detach().float(), ref.detach().float()
    err = torch.nan_to_num((x - ref).abs(), nan=float("inf"))
    allowed = tol.atol + tol.rtol * ref.abs()
    return float(err.max()), float((err / allowed).max())


def check(out, grads, ref_out, ref_grads, dtype) -> str:
    """'' when ``out`` and ``grads`` match the reference, else what is wrong."""
    tol = tolerance(dtype, "attention")
    for name, x, r, t in [("out", out, ref_out, tol)] + [
            (f"d{n}", g, rg, _grad_tol(tol, rg)) for n, g, rg in zip("qkv", grads, ref_grads)]:
        err, ratio = _max_error(x, r, t)
        if not ratio <= 1.0:
            return f"WRONG {name}: max abs error {err:.3g} ({ratio:.3g}x {t})"
    return ""


def bench_row(b, h, n, d, causal, dtype, cudagraph: bool = False) -> dict:
    from torch.nn.attention import SDPBackend

    q, k, v = (torch.randn(b, h, n, d, device=DEVICE, dtype=dtype, requires_grad=True) for _ in range(3))
    dout = torch.randn(b, h, n, d, device=DEVICE, dtype=dtype)
    flops = 4.0 * b * h * n * n * d / (2 if causal else 1)
    row = {"B": b, "H": h, "N": n, "D": d, "causal": causal, "dtype": str(dtype).replace("torch.", ""),
           "tflops": {p: {} for p in PASSES}, "ms": {p: {} for p in PASSES}, "error": {}, "tuning": {}}
    fns = {"cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "flash": sdpa(SDPBackend.FLASH_ATTENTION)}
    plans = {}
    for name, variant in OURS.items():
        try:
            fns[name], plans[name] = ours(variant, q, k, v, causal)
        except VariantUnavailableError as exc:  # it declines this problem or this GPU
            row["error"][name] = f"not timed: {str(exc).splitlines()[0][:300]}"
        except Exception as exc:
            row["error"][name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"

    ref = None
    for name in METHODS:  # SDPA first: the reference for ours
        if name not in fns:
            continue
        fn = fns[name]
        if name == "hopper":
            timings_before = getattr(fa._autotuned_forward(plans[name]), "configs_timings", None)
        try:
            out = fn(q, k, v, causal)  # also compiles and autotunes ours
            grads = torch.autograd.grad(out, (q, k, v), dout)
            torch.cuda.synchronize()
        except Exception as exc:
            row["error"][name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            continue
        if name in SDPA:
            if ref is None or name == "flash":
                ref = (out.detach(), [g.detach() for g in grads])
        elif ref is None:
            row["error"][name] = "not checked: no SDPA backend ran"
            continue
        else:
            wrong = check(out, grads, *ref, dtype)
            if wrong:
                row["error"][name] = wrong
                continue
        if name == "hopper":
            row["tuning"] = tuning_record(plans[name], q, k, causal, timings_before)
        del out, grads
        if cudagraph:
            stream = torch.cuda.Stream()
            ms_fwd = graph_bench(lambda: fn(q, k, v, causal), stream)
            with torch.cuda.stream(stream):
                out = fn(q, k, v, causal)
            ms_bwd = graph_bench(
                lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), stream)
        else:
            ms_fwd = triton.testing.do_bench(lambda: fn(q, k, v, causal), return_mode="median")
            out = fn(q, k, v, causal)
            ms_bwd = triton.testing.do_bench(
                lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
                return_mode="median")
        del out
        for p, ms, f in (("fwd", ms_fwd, flops), ("bwd", ms_bwd, 2.5 * flops)):
            row["ms"][p][name] = ms
            row["tflops"][p][name] = f / (ms * 1e-3) / 1e12
    return row


def graph_bench(fn, stream: torch.cuda.Stream, calls: int = 10, replays: int = 30) -> float:
    """Median ms per call of ``fn`` over ``replays`` replays of a graph capturing ``calls``
    calls, on ``stream``. Not ``do_bench_cudagraph``: that captures on a fresh stream, and
    autograd runs each backward kernel on its forward's stream, so a backward whose forward
    ran elsewhere cannot be captured. The caller runs the forward on ``stream`` too."""
    with torch.cuda.stream(stream):
        fn()  # warm-up off the graph: allocator pools, lazy initialisation
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls):
                fn()
    times = []
    with torch.cuda.stream(stream):  # replay() launches on the current stream
        for _ in range(replays):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / calls)
    del graph
    return statistics.median(times)


def ratio(row: dict, p: str, name: str) -> float | None:
    t, base = row["tflops"][p].get(name), row["tflops"][p].get("cudnn")
    return None if t is None or not base else t / base


def cell(row: dict, p: str, name: str) -> str:
    if name in row["tflops"][p]:
        q = ratio(row, p, name)
        return f"{row['tflops'][p][name]:.0f}" + ("" if name == "cudnn" or q is None else f" ({q:.2f})")
    if name in row["error"]:
        error = row["error"][name]
        return "WRONG" if error.startswith("WRONG") else "n/a" if error.startswith("not timed") else "error"
    return "n/a"


def markdown(rows_: list[dict], header: str) -> str:
    lines = [header, "", "TFLOP/s (ratio to cuDNN SDPA); backward counted as 2.5x the forward's FLOPs", ""]
    for p, title in (("fwd", "Forward"), ("bwd", "Backward")):
        lines += [f"### {title}", "", "| B | H | N | D | causal | dtype | " + " | ".join(METHODS) + " |",
                  "|---:|---:|---:|---:|:---|:---|" + "---:|" * len(METHODS)]
        for r in rows_:
            lines.append(f"| {r['B']} | {r['H']} | {r['N']} | {r['D']} | {'yes' if r['causal'] else 'no'} | "
                         f"{r['dtype']} | " + " | ".join(cell(r, p, m) for m in METHODS) + " |")
        lines.append("")
    errors = [(r, n, e) for r in rows_ for n, e in r["error"].items()]
    if errors:
        lines += ["Errors:", ""] + [f"- {_label(r)} {n}: {e}" for r, n, e in errors] + [""]
    tuned = [r for r in rows_ if r["tuning"].get("best")]
    if tuned:
        lines += ["hopper forward, autotuned config (and the best of each loop shape when this "
                  "run tuned it):", ""]
        for r in tuned:
            ws = ws_summary(r["tuning"])
            lines.append(f"- {_label(r)}: `{r['tuning']['best']}`" + (f"; {ws}" if ws else ""))
    return "\n".join(lines) + "\n"


def plot_benchmarks(rows_: list[dict]) -> list[triton.testing.Benchmark]:
    """The plots of a run, as ``triton.testing.Benchmark`` objects: TFLOP/s against N, one
    plot per pass, dtype, head dim and masking, one line per method that has a time."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows_:
        for p in PASSES:
            groups.setdefault((p, r["dtype"], r["D"], r["causal"]), []).append(r)
    out = []
    for (p, dtype, d, causal), group in groups.items():
        methods = [m for m in METHODS if any(m in r["tflops"][p] for r in group)]
        if not methods:
            continue
        mask = "causal" if causal else "full"
        out.append(triton.testing.Benchmark(
            x_names=["N"], x_vals=sorted({r["N"] for r in group}), line_arg="provider",
            line_vals=methods, line_names=methods,
            plot_name=f"flash_attn-{p}-{dtype}-d{d}-{mask}",
            args={"p": p, "dtype": dtype, "D": d, "causal": causal},
            xlabel=f"N (B=4, H=32; B=1 at 16384), D = {d}, {mask}, {dtype}",
            ylabel=f"{p} TFLOP/s", x_log=True))
    return out


def measured(rows_: list[dict]):
    """``perf_report``'s function for :func:`plot_benchmarks`: a row's TFLOP/s."""
    by_row = {(r["N"], r["D"], r["causal"], r["dtype"]): r for r in rows_}

    def tflops(provider: str, p: str, dtype: str, D: int, causal: bool, N: int) -> float:
        row = by_row.get((N, D, causal, dtype))
        return _common.nan_if_none(None if row is None else row["tflops"][p].get(provider))

    return tflops


def _label(r: dict) -> str:
    return f"B{r['B']} H{r['H']} N{r['N']} D{r['D']} {'causal' if r['causal'] else 'full'} {r['dtype']}"


def main() -> None:
    parser = _common.options(__doc__, f"only (B, H, N, D, causal) in {QUICK}")
    parser.add_argument("--seqlens", default="", help="comma-separated N: only those rows")
    args = parser.parse_args()
    settings = _common.apply_settings(args.set)
    info = _common.nvidia_gpu("bench/flash_attn.py", "against cuDNN and FlashAttention SDPA",
                              "tests/test_flash_attn.py tests/test_flash_attn_hopper.py")
    dtypes = _common.dtypes(args.dtypes)
    header = _common.header("flash_attn", info, args.cudagraph)
    meta = {**_common.meta(info, args.cudagraph), "settings": settings}
    print(header)
    print(f"{'B':>2} {'H':>3} {'N':>6} {'D':>4} {'causal':>6} {'dtype':>9} "
          + " ".join(f"{p}:{m:>8}" for p in PASSES for m in METHODS))
    out, start = [], time.time()
    seqlens = {int(x) for x in args.seqlens.split(",") if x} or None
    for dtype in dtypes:
        for b, h, n, d, causal in rows(args.quick, seqlens):
            row = bench_row(b, h, n, d, causal, dtype, args.cudagraph)
            out.append(row)
            cells = [f"{cell(row, p, m):>13}" for p in PASSES for m in METHODS]
            print(f"{b:2d} {h:3d} {n:6d} {d:4d} {str(causal):>6} {row['dtype']:>9} " + " ".join(cells),
                  flush=True)
            _common.write(args.json, out, {**meta, "elapsed_s": time.time() - start},
                          lambda rows_: markdown(rows_, header))
            torch.cuda.empty_cache()
    print(_common.save_plots(args.plot, plot_benchmarks(out), measured(out)))
    _common.closing(args.json, out, _label, start)


if __name__ == "__main__":
    main()
