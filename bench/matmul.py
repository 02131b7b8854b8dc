"""matmul throughput on an NVIDIA GPU: our variants against cuBLAS in the same run.

Rows: square problems (1024 to 8192) and LLM-shaped ones (M in {16, 128, 4096} tokens,
N and K in {4096, 14336}), in fp16 and bf16 (``--dtypes`` adds ``fp8e4m3``, ``fp8e5m2``),
on fresh ``torch.randn`` inputs. Columns:

- ``cublas``: ``torch.matmul`` (cuBLAS, what PyTorch users get); for fp8 operands, which
  torch.matmul does not take, ``torch._scaled_mm`` with unit scales and a bf16 output
  (cuBLASLt's fp8 GEMM), with ``b`` column-major (an (N, K) weight transposed), the layout
  it requires; ours get the same ``b``;
- ``cublaslt``: cuBLASLt through Triton's own binding (``triton._C.libtriton.nvidia``),
  when this Triton build has it (it computes ``a @ b_t.T``, so ``b`` is passed as (N, K));
- ``hopper_gluon``: our ``nvidia.hopper_gluon`` variant (the Gluon kernel), forced, where
  it takes the problem (16-bit operands, at least ``matmul_gluon.MIN_TILES`` output tiles);
- ``persistent_tma``: our ``nvidia.persistent_tma`` variant, forced;
- ``persistent_tma_nows``: the same kernel with ``WARP_SPECIALIZE=False`` (an ablation:
  does the warp-specialized K loop pay off on this GPU and Triton?; not for fp8, whose
  configs are never warp-specialized);
- ``generic``: our ``generic`` variant (pointer loads, one program per tile), forced.

Each of ours is checked against ``torch.matmul`` in fp32 (the library's "dot" tolerance;
for fp8 operands, twice cuBLAS's own error, see ``check_tolerance``)
before it is timed; a wrong result is reported and not timed. Times are the median of
``triton.testing.do_bench`` (CUDA events; with ``--cudagraph`` replayed from a graph, which
removes host overhead from small problems; a graph replays one call after another on the same
operands, so they stay in L2: add ``--cold`` to rotate each call through copies of the
operands, fresh random values each, that together hold at least three times the L2 cache, as
a model's layers stream weights that L2 does not hold; ``do_bench`` without graphs flushes
L2 before each call itself). The first call of each problem size autotunes
our kernels; results persist in the library's tuning cache (``PK_CACHE_DIR``).

    python bench/matmul.py [--quick | --shapes MxNxK,...] [--json PATH] [--plot DIR]
                           [--dtypes fp16,bf16,fp8e4m3] [--cudagraph [--cold]]
                           [--set MODULE.NAME=VALUE ...]

With ``--json PATH``, writes ``PATH`` and the Markdown table beside it after every row (so an
interrupted run keeps what it measured); with ``--plot DIR``, at the end, plots through
``triton.testing.perf_report`` (TFLOP/s against the size of square problems and against M
for each (N, K); it needs pandas and matplotlib, and says so when they are missing).
``--set`` times a kernel module's setting (``matmul_gluon.STAGES=4``, a threshold such as
``matmul_gluon.MIN_TILES=1``) instead of the shipped one.
"""
from __future__ import annotations

import portable_kernels as pk  # first: it chooses the interpreter before triton is imported

import dataclasses
import functools
import time

import torch
import triton

from portable_kernels import dispatch
from portable_kernels.kernels import _host, matmul as matmul_module
from portable_kernels.launch import LaunchPlan
from portable_kernels.testing import Tolerance, max_error, tolerance

import _common  # bench/, beside this script

SQUARE = [1024, 2048, 4096, 8192]
LLM_M = [16, 128, 4096]
LLM_NK = [(4096, 4096), (4096, 14336), (14336, 4096), (14336, 14336)]
QUICK = [(4096, 4096, 4096), (16, 4096, 4096), (4096, 14336, 4096)]
TMA = "nvidia.persistent_tma"
GLUON = "nvidia.hopper_gluon"
DEVICE = "cuda"
OURS = ("hopper_gluon", "persistent_tma", "persistent_tma_nows", "generic")
METHODS = ("cublas", "cublaslt") + OURS


def shapes(quick: bool, only: str = "") -> list[tuple[int, int, int]]:
    if only:
        return [tuple(int(x) for x in s.lower().split("x")) for s in only.split(",")]
    if quick:
        return QUICK
    return [(s, s, s) for s in SQUARE] + [(m, n, k) for m in LLM_M for n, k in LLM_NK]


def cublaslt_matmul():
    """``fn(a, b_t, out)`` through Triton's cuBLASLt binding, or None when absent."""
    try:
        from triton._C.libtriton import nvidia

        workspace = torch.empty(32 * 1024 * 1024, device=DEVICE, dtype=torch.uint8)
        handle = nvidia.cublas.CublasLt(workspace)
    except Exception:  # an older/newer Triton without the binding
        return None

    def matmul(a, b_t, out):
        # The binding keeps only the workspace's address: the closure keeps the tensor
        # alive. (Freed, its memory went to later inputs, and cuBLASLt's scratch writes
        # corrupted them: the first run here reported every implementation WRONG.)
        _ = workspace
        return handle.matmul(a, b_t, out)

    return matmul


class Ours:
    """Our launch plans, as dispatch builds them, plus the no-warp-specialization ablation
    (built once, so that its autotuning results carry from row to row)."""

    def __init__(self) -> None:
        self.nows: LaunchPlan | None = None

    def plans(self, a: torch.Tensor, b: torch.Tensor) -> tuple[dict[str, LaunchPlan], dict[str, str]]:
        """``(plans, declined)``: the plans to time, and why a variant that does not take
        this problem declined."""
        out, declined = {}, {}
        sel = pk.explain("matmul", a, b)
        for name, variant in (("hopper_gluon", GLUON), ("persistent_tma", TMA), ("generic", "generic")):
            verdict = next((v for v in sel.verdicts if v.name == variant), None)
            if verdict is None or not verdict.runnable:
                declined[name] = f"not timed: {verdict.reason if verdict else 'not registered'}"
                continue
            with pk.use_variant(matmul=variant):
                out[name] = dispatch._launch_plan(pk.explain("matmul", a, b))
        if self.nows is None:
            tma = out["persistent_tma"]
            # A variant name of its own, so that its tuning results are stored apart.
            variant = dataclasses.replace(tma.variant, name="nvidia.persistent_tma_nows")
            self.nows = LaunchPlan(variant, tma.device, tma.configs,
                                   dict(tma.switches, WARP_SPECIALIZE=False))
        out["persistent_tma_nows"] = self.nows
        if a.dtype in FP8:
            # No fp8 config has the 4 warps Triton warp-specializes on sm_90: the ablation
            # would time the same kernels again.
            del out["persistent_tma_nows"]
        return {name: out[name] for name in OURS if name in out}, declined


def best_config(plan: LaunchPlan, a: torch.Tensor, b: torch.Tensor) -> str:
    """The config the plan's autotuner chose for ``a @ b``. Asked by
    problem: after its first call a problem skips the autotuner, whose ``best_config`` is
    then another problem's."""
    chosen = matmul_module.chosen_config(plan, a, b)
    if chosen is None:
        return ""
    return ", ".join(f"{key}: {value}" for key, value in chosen.items())


FP8 = _host.FP8_DTYPES


def weight_major(dtype: torch.dtype) -> bool:
    """Whether ``b`` is drawn column-major (as ``w.T`` of an (N, K) weight): for fp8, the
    layout cuBLAS's fp8 GEMM requires (``torch._scaled_mm``) and models store."""
    return dtype in FP8


def operand_copies(m: int, n: int, k: int, dtype: torch.dtype, cold: bool) -> list[tuple]:
    """``(a, b)`` pairs of fresh random values (``b`` column-major for fp8, see
    :func:`weight_major`): one, or with ``cold`` enough that together they hold three times
    the L2 cache (at most 64)."""
    count = 1
    if cold:
        l2 = getattr(torch.cuda.get_device_properties(DEVICE), "L2_cache_size", 50 << 20)
        pair = (m * k + k * n) * torch.finfo(dtype).bits // 8
        count = min(64, max(1, -(-3 * l2 // pair)))

    def draw(rows, cols):  # randn has no fp8 kernel: draw in fp32, then round
        return torch.randn(rows, cols, device=DEVICE).to(dtype)

    if weight_major(dtype):
        return [(draw(m, k), draw(n, k).t()) for _ in range(count)]
    return [(draw(m, k), draw(k, n)) for _ in range(count)]


def vendor_matmul(dtype: torch.dtype):
    """The vendor library's ``a @ b`` for operands of ``dtype``: ``torch.matmul`` (cuBLAS),
    or for fp8, which torch.matmul does not take, ``torch._scaled_mm`` with unit scales and
    a bf16 output (cuBLASLt's fp8 GEMM; ``b`` must be column-major)."""
    if dtype not in FP8:
        return torch.matmul
    one = torch.ones((), device=DEVICE, dtype=torch.float32)

    def scaled_mm(a, b):
        return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    return scaled_mm


def check_tolerance(dtype: torch.dtype, vendor_out: torch.Tensor | None, ref: torch.Tensor) -> Tolerance:
    """What ours must match ``ref`` (the fp32 product) within. For fp8 operands, twice the
    vendor's own largest error, at least the library's: sm_90's fp8 MMAs add products in
    fewer bits than fp32 between their additions into the fp32 accumulator, so long-K
    products are off by more than the bf16 output's rounding, cuBLAS's as much as ours."""
    base = tolerance(dtype, "dot")
    if dtype not in FP8 or vendor_out is None:
        return base
    err = float((vendor_out.float() - ref).abs().max())
    return Tolerance(max(base.atol, 2.0 * err), base.rtol)


def rotating(call, copies: list[tuple]):
    """``call(a, b)`` on the next pair of ``copies`` at each call, the first pair first (the
    one results are checked on); a graph captures each call with its own pair."""
    turn = [0]

    def fn():
        a, b = copies[turn[0] % len(copies)]
        turn[0] += 1
        return call(a, b)

    return fn


def bench_row(m, n, k, dtype, args, lt, ours: Ours) -> dict:
    copies = operand_copies(m, n, k, dtype, args.cold)
    a, b = copies[0]
    b_t = b.t().contiguous()
    c = torch.empty(m, n, device=DEVICE, dtype=matmul_module.out_dtype(dtype))
    ref = torch.matmul(a.float(), b.float())
    tol = tolerance(dtype, "dot")
    flops = 2.0 * m * n * k
    row = {"M": m, "N": n, "K": k, "dtype": str(dtype).replace("torch.", ""),
           "tflops": {}, "ms": {}, "error": {}, "config": {}, "operand_copies": len(copies)}

    def cublaslt():
        lt(a, b_t, c)  # c = a @ b_t.T
        return c

    fns = {"cublas": rotating(vendor_matmul(dtype), copies)}  # checked too: the reference is fp32
    if lt is not None and dtype in FP8:
        # Seen on the H200 (triton 3.6): "Data types do not match" for fp8 operands with a
        # bf16 output; torch._scaled_mm (the cublas column) is cuBLASLt's fp8 GEMM anyway.
        row["error"]["cublaslt"] = "not timed: Triton's cuBLASLt binding wants the output in the operands' dtype"
    elif lt is not None and args.cudagraph:
        # Seen on the H200 (triton 3.6): the binding's launches are not captured (torch
        # warns "The CUDA Graph is empty"), so its replays time nothing.
        row["error"]["cublaslt"] = "not timed: Triton's cuBLASLt binding records an empty CUDA graph"
    elif lt is not None:
        fns["cublaslt"] = cublaslt
    try:
        plans, declined = ours.plans(a, b)
        row["error"].update(declined)
    except Exception as exc:
        plans = {}
        for name in OURS:
            row["error"][name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    for name, plan in plans.items():
        fns[name] = rotating(functools.partial(matmul_module.launch, plan), copies)

    for name, fn in fns.items():  # cuBLAS first: fp8 rows take their tolerance from it
        out = _common.first_call(row, name, fn)
        if out is None:
            continue
        if name == "cublas":
            tol = check_tolerance(dtype, out, ref)
            row["tolerance"] = str(tol)
        if name in plans:
            row["config"][name] = best_config(plans[name], a, b)
        err, ratio_ = max_error(out, ref, tol)
        if not ratio_ <= 1.0:
            row["error"][name] = f"WRONG: max abs error {err:.3g} ({ratio_:.3g}x {tol})"
            continue
        _common.timed(row, name, fn, flops, args.cudagraph)
    return row


def ratio(row: dict, name: str) -> float | None:
    t, base = row["tflops"].get(name), row["tflops"].get("cublas")
    return None if t is None or not base else t / base


def _failure(error: str) -> str:
    """A table cell for a method without a time."""
    if error.startswith("WRONG"):
        return "WRONG"
    return "n/a" if error.startswith("not timed") else "error"


def markdown(rows: list[dict], header: str) -> str:
    cols = [m for m in METHODS if any(m in r["tflops"] or m in r["error"] for r in rows)]
    lines = [header, "", "TFLOP/s (ratio to cuBLAS: torch.matmul; for fp8, torch._scaled_mm)", "",
             "| M | N | K | dtype | " + " | ".join(cols) + " |",
             "|---:|---:|---:|:---|" + "---:|" * len(cols)]
    for r in rows:
        cells = []
        for c in cols:
            if c in r["tflops"]:
                q = ratio(r, c)
                cells.append(f"{r['tflops'][c]:.1f}" + ("" if c == "cublas" or q is None else f" ({q:.2f})"))
            elif c in r["error"]:
                cells.append(_failure(r["error"][c]))
            else:
                cells.append("n/a")
        lines.append(f"| {r['M']} | {r['N']} | {r['K']} | {r['dtype']} | " + " | ".join(cells) + " |")
    errors = [(r, n, e) for r in rows for n, e in r["error"].items()]
    if errors:
        lines += ["", "Errors:", ""]
        lines += [f"- {r['M']}x{r['N']}x{r['K']} {r['dtype']} {n}: {e}" for r, n, e in errors]
    configs = [(r, n, c) for r in rows for n, c in r["config"].items() if c]
    if configs:
        lines += ["", "Autotuned configs:", ""]
        lines += [f"- {r['M']}x{r['N']}x{r['K']} {r['dtype']} {n}: `{c}`" for r, n, c in configs]
    return "\n".join(lines) + "\n"


def plot_benchmarks(rows: list[dict]) -> list[triton.testing.Benchmark]:
    """The plots of a run, as ``triton.testing.Benchmark`` objects: per dtype, TFLOP/s
    against the size of the square problems, and against M (tokens) for each (N, K) of the
    LLM shapes (and of any other non-square rows); one line per method that has a time."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["M"] == r["N"] == r["K"]:
            groups.setdefault((r["dtype"], "square"), []).append(r)
        if r["M"] != r["N"] or (r["N"], r["K"]) in LLM_NK:
            groups.setdefault((r["dtype"], r["N"], r["K"]), []).append(r)
    out = []
    for key, group in groups.items():
        methods = [m for m in METHODS if any(m in r["tflops"] for r in group)]
        if not methods:
            continue
        if key[1] == "square":
            x_name, x_vals, args, name = "size", sorted({r["M"] for r in group}), {}, f"matmul-square-{key[0]}"
            xlabel = "M = N = K"
        else:
            _, n, k = key
            x_name, x_vals, args = "M", sorted({r["M"] for r in group}), {"N": n, "K": k}
            name, xlabel = f"matmul-{key[0]}-N{n}-K{k}", f"M (tokens), N = {n}, K = {k}"
        out.append(triton.testing.Benchmark(
            x_names=[x_name], x_vals=x_vals, line_arg="provider", line_vals=methods,
            line_names=methods, plot_name=name, args={"dtype": key[0], **args},
            xlabel=xlabel, ylabel="TFLOP/s", x_log=True))
    return out


def measured(rows: list[dict]):
    """``perf_report``'s function for :func:`plot_benchmarks`: a row's TFLOP/s."""
    by_shape = {(r["M"], r["N"], r["K"], r["dtype"]): r for r in rows}

    def tflops(provider: str, dtype: str, size: int | None = None, M: int | None = None,
               N: int | None = None, K: int | None = None) -> float:
        shape = (size, size, size) if size is not None else (M, N, K)
        row = by_shape.get((*shape, dtype))
        return _common.nan_if_none(None if row is None else row["tflops"].get(provider))

    return tflops


def main() -> None:
    parser = _common.options(__doc__, f"only {QUICK}")
    parser.add_argument("--shapes", default="", help="comma-separated MxNxK list instead")
    parser.add_argument("--cold", action="store_true",
                        help="with --cudagraph: rotate through operand copies larger than L2")
    args = parser.parse_args()
    if args.cold and not args.cudagraph:
        parser.error("--cold needs --cudagraph: do_bench without graphs flushes L2 before each call")
    settings = _common.apply_settings(args.set)
    info = _common.nvidia_gpu("bench/matmul.py", "cuBLAS, TMA", "tests/test_matmul.py")
    dtypes = _common.dtypes(args.dtypes, {**_common.DTYPES, **_common.FP8})
    lt = cublaslt_matmul()
    header = (_common.header("matmul", info, args.cudagraph)
              + (" · cold operands (copies larger than L2)" if args.cold else "")
              + ("" if lt is not None else " · cuBLASLt binding not available"))
    meta = {**_common.meta(info, args.cudagraph), "cublaslt": lt is not None, "cold": args.cold,
            "settings": settings}
    print(header)
    print(f"{'M':>6} {'N':>6} {'K':>6} {'dtype':>8} " + " ".join(f"{m:>20}" for m in METHODS))
    rows = []
    ours = Ours()
    start = time.time()
    for dtype in dtypes:
        for m, n, k in shapes(args.quick, args.shapes):
            row = bench_row(m, n, k, dtype, args, lt, ours)
            rows.append(row)
            cells = []
            for name in METHODS:
                if name in row["tflops"]:
                    q = ratio(row, name)
                    cells.append(f"{row['tflops'][name]:8.1f}" + (f" ({q:4.2f})" if q is not None and name != "cublas" else "       "))
                else:
                    cells.append(_failure(row["error"].get(name, "not timed")))
            print(f"{m:6d} {n:6d} {k:6d} {row['dtype']:>8} " + " ".join(f"{c:>20}" for c in cells), flush=True)
            _common.write(args.json, rows, {**meta, "elapsed_s": time.time() - start},
                          lambda rows_: markdown(rows_, header))
    print(_common.save_plots(args.plot, plot_benchmarks(rows), measured(rows)))
    _common.closing(args.json, rows, lambda r: f"{r['M']}x{r['N']}x{r['K']} {r['dtype']}", start)


if __name__ == "__main__":
    main()
