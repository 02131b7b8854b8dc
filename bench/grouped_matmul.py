"""grouped_matmul throughput on an NVIDIA GPU: our variants against PyTorch's in the same run.

Rows are mixture-of-experts layers: ``G`` experts, each multiplying the tokens routed to
it, ``(T_g, K)``, by its weight, with token counts that differ per expert (a ramp from
half to one and a half times the mean, as routing leaves them). Two weight layouts:
``row``, ``b`` stored (K, N); and ``col``, ``b = w.t()`` of an (N, K) ``nn.Linear`` weight
(how models store them). Columns:

- ``torch_loop``: ``[a @ b for ...]``, one cuBLAS GEMM per expert (``torch.matmul``; for
  fp8 operands ``torch._scaled_mm`` with unit scales and a bf16 output, which needs ``b``
  column-major: ``col`` rows only);
- ``torch_grouped``: ``torch._grouped_mm`` on the tokens concatenated and the weights
  stacked (CUTLASS's grouped GEMM on sm_90; its fast path takes bf16 only, so fp16 rows
  say "n/a"); for fp8, ``torch._scaled_grouped_mm`` with unit row-wise scales;
- ``tma``: our ``nvidia.tma`` variant, forced (device-side descriptors per group);
- ``generic``: our ``generic`` variant, forced (pointer loads).

Ours get the same memory as ``torch_grouped``: views into the concatenated tokens and the
stacked weights. Each is checked against the fp32 product before it is timed (the
library's "dot" tolerance; for fp8, twice cuBLAS's own error, as ``bench/matmul.py``); a
wrong result is reported and not timed. Times are the median of ``triton.testing.do_bench`` with
the host's time per call included (``--cudagraph``: graph replays, the kernels alone).
TFLOP/s count ``2 * T_g * N * K`` per expert.

    python bench/grouped_matmul.py [--quick] [--dtypes bf16,fp16,fp8e4m3] [--layouts row,col]
                                   [--cudagraph] [--json PATH] [--set MODULE.NAME=VALUE ...]

With ``--json PATH``, writes ``PATH`` and the Markdown table beside it after every row.
"""
from __future__ import annotations

import portable_kernels as pk  # first: it chooses the interpreter before triton is imported

import time

import torch

from portable_kernels import dispatch
from portable_kernels.kernels import grouped_matmul as grouped_module
from portable_kernels.testing import max_error, tolerance

import _common  # bench/, beside this script
from matmul import FP8, check_tolerance, vendor_matmul  # bench/

DEVICE = "cuda"
OURS = {"tma": "nvidia.tma", "generic": "generic"}
METHODS = ("torch_loop", "torch_grouped", *OURS)

# (name, experts, mean tokens per expert, N, K): Mixtral-8x7B's expert projections (up
# 4096 -> 14336, down 14336 -> 4096) at decode- and prefill-sized token counts, and a
# fine-grained MoE (64 experts of 1408, Qwen-MoE-like, hidden 2048).
LAYERS = [
    ("8 experts up", 8, 64, 14336, 4096),
    ("8 experts up", 8, 1024, 14336, 4096),
    ("8 experts down", 8, 1024, 4096, 14336),
    ("64 experts up", 64, 32, 1408, 2048),
    ("64 experts up", 64, 256, 1408, 2048),
    ("64 experts down", 64, 256, 2048, 1408),
]
QUICK = [LAYERS[1], LAYERS[4]]


def token_counts(experts: int, mean: int) -> list[int]:
    """A ramp from half the mean to one and a half times it (at least 1 each)."""
    if experts == 1:
        return [mean]
    return [max(1, round(mean * (0.5 + g / (experts - 1)))) for g in range(experts)]


def operands(counts: list[int], n: int, k: int, dtype: torch.dtype, layout: str):
    """Concatenated tokens (sum T, K), stacked weights (G, K, N) (``col``: the transposes
    of (G, N, K) ones), and the per-expert views of both."""
    tokens = torch.randn(sum(counts), k, device=DEVICE).to(dtype)
    if layout == "col":
        weights = torch.randn(len(counts), n, k, device=DEVICE).to(dtype).transpose(1, 2)
    else:
        weights = torch.randn(len(counts), k, n, device=DEVICE).to(dtype)
    list_a = list(torch.split(tokens, counts))
    list_b = list(weights.unbind(0))
    return tokens, weights, list_a, list_b


def torch_grouped(tokens, weights, counts):
    """``torch._grouped_mm`` (for fp8 ``torch._scaled_grouped_mm`` with unit row-wise
    scales and a bf16 output) where this torch has it, else None."""
    offs = torch.tensor(counts, device=DEVICE, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    if tokens.dtype in FP8:
        fn = getattr(torch, "_scaled_grouped_mm", None)
        if fn is None:
            return None
        scale_a = torch.ones(tokens.shape[0], device=DEVICE, dtype=torch.float32)
        scale_b = torch.ones(weights.shape[0], weights.shape[2], device=DEVICE, dtype=torch.float32)
        return lambda: fn(tokens, weights, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16)
    fn = getattr(torch, "_grouped_mm", None)
    if fn is None:
        return None
    return lambda: fn(tokens, weights, offs)


def bench_row(layer, dtype, layout, args) -> dict:
    name, experts, mean, n, k = layer
    counts = token_counts(experts, mean)
    tokens, weights, list_a, list_b = operands(counts, n, k, dtype, layout)
    refs = [a.float() @ b.float() for a, b in zip(list_a, list_b)]
    tol = tolerance(dtype, "dot")
    flops = sum(2.0 * t * n * k for t in counts)
    row = {"layer": name, "G": experts, "tokens": sum(counts), "N": n, "K": k,
           "dtype": str(dtype).replace("torch.", ""), "layout": layout,
           "tflops": {}, "ms": {}, "error": {}}

    fns = {}
    vendor = vendor_matmul(dtype)
    if dtype in FP8 and layout != "col":
        row["error"]["torch_loop"] = "not timed: torch._scaled_mm needs b column-major"
    else:
        fns["torch_loop"] = lambda: [vendor(a, b) for a, b in zip(list_a, list_b)]
    grouped = torch_grouped(tokens, weights, counts)
    if grouped is None:
        row["error"]["torch_grouped"] = "not timed: this torch has no grouped GEMM for it"
    elif dtype == torch.float16:
        row["error"]["torch_grouped"] = "not timed: its fast path (CUTLASS) takes bf16 only"
    else:
        fns["torch_grouped"] = lambda: list(torch.split(grouped(), counts))
    for method, variant in OURS.items():
        with pk.use_variant(grouped_matmul=variant):
            try:
                plan = dispatch._launch_plan(pk.explain("grouped_matmul", list_a, list_b))
            except Exception as exc:  # e.g. the descriptor variant refusing a layout
                row["error"][method] = f"not timed: {str(exc).splitlines()[0][:200]}"
                continue
        fns[method] = (lambda plan=plan: grouped_module.launch(plan, list_a, list_b))

    for method, fn in fns.items():
        outs = _common.first_call(row, method, fn)
        if outs is None:
            continue
        if dtype in FP8 and method in ("torch_loop", "torch_grouped") and "tolerance" not in row:
            # The first vendor result sets the fp8 tolerance (its error, twice).
            tol = max((check_tolerance(dtype, o, r) for o, r in zip(outs, refs)),
                      key=lambda t: t.atol)
            row["tolerance"] = str(tol)
        worst = max(max_error(o, r, tol)[1] for o, r in zip(outs, refs))
        if not worst <= 1.0:
            row["error"][method] = f"WRONG: {worst:.3g}x the {tol} tolerance"
            continue
        _common.timed(row, method, fn, flops, args.cudagraph)
    return row


def _base(row: dict) -> float | None:
    """The faster of PyTorch's two, the one to beat."""
    times = [row["tflops"][m] for m in ("torch_loop", "torch_grouped") if m in row["tflops"]]
    return max(times) if times else None


def _cell(row: dict, method: str) -> str:
    if method in row["tflops"]:
        base = _base(row)
        t = row["tflops"][method]
        if method in OURS and base:
            return f"{t:.1f} ({t / base:.2f})"
        return f"{t:.1f}"
    error = row["error"].get(method, "")
    return "WRONG" if error.startswith("WRONG") else ("n/a" if error.startswith("not timed") or not error else "error")


def markdown(rows: list[dict], header: str) -> str:
    lines = [header, "", "TFLOP/s; ours with their ratio to the faster of torch_loop and "
             "torch_grouped", "",
             "| layer | G | tokens | N | K | dtype | b | " + " | ".join(METHODS) + " |",
             "|:--|--:|--:|--:|--:|:--|:--|" + "--:|" * len(METHODS)]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['G']} | {r['tokens']} | {r['N']} | {r['K']} | "
                     f"{r['dtype']} | {r['layout']} | " + " | ".join(_cell(r, m) for m in METHODS) + " |")
    errors = [(r, m, e) for r in rows for m, e in r["error"].items()]
    if errors:
        lines += ["", "Not timed:", ""]
        lines += [f"- {r['layer']} T={r['tokens']} {r['dtype']} b {r['layout']} {m}: {e}"
                  for r, m, e in errors]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = _common.options(__doc__, "two layers only")
    parser.add_argument("--layouts", default="row,col", help="comma-separated: row, col")
    args = parser.parse_args()
    settings = _common.apply_settings(args.set)
    _common.no_plots("bench/grouped_matmul.py", args.plot)
    info = _common.nvidia_gpu("bench/grouped_matmul.py", "torch's grouped GEMMs",
                              "tests/test_grouped_matmul.py")
    dtypes = _common.dtypes(args.dtypes, {**_common.DTYPES, **_common.FP8})
    layouts = [x for x in args.layouts.split(",") if x]
    if not layouts or set(layouts) - {"row", "col"}:
        parser.error("--layouts: choose among row, col")
    header = _common.header("grouped_matmul", info, args.cudagraph)
    print(header, flush=True)
    rows, start = [], time.time()
    for dtype in dtypes:
        for layout in layouts:
            for layer in (QUICK if args.quick else LAYERS):
                row = bench_row(layer, dtype, layout, args)
                rows.append(row)
                print(f"{row['layer']:>16} G={row['G']:<3} T={row['tokens']:<6} {row['dtype']:>8} "
                      f"b {layout}: " + "  ".join(f"{m} {_cell(row, m)}" for m in METHODS), flush=True)
                _common.write(args.json, rows, {**_common.meta(info, args.cudagraph),
                                                "settings": settings,
                                                "elapsed_s": time.time() - start},
                              lambda rows_: markdown(rows_, header))
    _common.closing(args.json, rows, lambda r: f"{r['layer']} T={r['tokens']} {r['dtype']} b {r['layout']}",
                    start)


if __name__ == "__main__":
    main()
