"""What the benchmarks share: one command line (:func:`options`: ``--quick``, ``--json``,
``--plot``, ``--set``; ``--dtypes`` and ``--cudagraph`` for the vendor comparisons), the
check that they time compiled kernels on an NVIDIA GPU, the header and metadata that name
the machine and versions in every result file, the result writer and the plots."""
from __future__ import annotations

import argparse
import ast
import importlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import triton

import portable_kernels as pk
from portable_kernels.device import DeviceInfo

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
#: fp8 operands, for the benches whose kernels take them (``bench/matmul.py``).
FP8 = {"fp8e4m3": torch.float8_e4m3fn, "fp8e5m2": torch.float8_e5m2}


def per_call_us(fn: Callable[[], Any], iters: int, rounds: int = 5) -> float:
    """Microseconds per eager call of ``fn``: ``iters`` calls timed on the host, then one
    synchronize (so a call costs the larger of its host and device time); the median of
    ``rounds`` such passes, after 50 untimed calls."""
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


def options(doc: str, quick: str, vendor: bool = True) -> argparse.ArgumentParser:
    """The parser every benchmark starts from: ``--quick`` (help ``quick``), ``--json PATH``
    (the results as JSON, and the table as Markdown beside it), ``--plot DIR`` (the tables
    drawn through ``triton.testing.perf_report``), ``--set MODULE.NAME=VALUE`` (a kernel
    module's constant set first: a threshold or a knob, to time a setting against the
    shipped one); with ``vendor``, also ``--dtypes`` and ``--cudagraph``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="write the results as JSON here, and the table as Markdown beside "
                        "it (PATH with .md)")
    parser.add_argument("--plot", default=None, metavar="DIR",
                        help="draw the results into DIR (perf_report: needs pandas, matplotlib)")
    parser.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                        help="set a kernel module's constant (a Python literal) before timing, "
                        "e.g. matmul_gluon.MIN_TILES=1; repeatable")
    if vendor:
        parser.add_argument("--dtypes", default="fp16,bf16", help="comma-separated: fp16, bf16")
        parser.add_argument("--cudagraph", action="store_true", help="time CUDA-graph replays")
    return parser


#: Where ``--set`` looks for a module: the families, then the NVIDIA backend's own kernels.
SETTABLE = ("portable_kernels.kernels", "portable_kernels_backends.nvidia.gluon")


def apply_settings(assignments: Sequence[str]) -> dict[str, Any]:
    """Apply ``--set MODULE.NAME=VALUE`` assignments; exits naming what does not exist.
    Returns them as set, for the result file."""
    done = {}
    for assignment in assignments:
        target, sep, value = assignment.partition("=")
        module_name, _, name = target.rpartition(".")
        if not (sep and module_name and name):
            sys.exit(f"--set {assignment}: expected MODULE.NAME=VALUE")
        for package in SETTABLE:
            try:
                module = importlib.import_module(f"{package}.{module_name}")
                break
            except ModuleNotFoundError:
                continue
        else:
            sys.exit(f"--set: no module {module_name} in {' or '.join(SETTABLE)}")
        if not hasattr(module, name):
            sys.exit(f"--set: {module.__name__} has no {name}")
        try:
            setattr(module, name, ast.literal_eval(value))
        except (ValueError, SyntaxError):
            sys.exit(f"--set {assignment}: {value!r} is not a Python literal")
        done[target] = getattr(module, name)
    return done


def no_plots(script: str, plot: str | None) -> None:
    """For a benchmark without plots: say so when ``--plot`` asked for them."""
    if plot:
        print(f"{script} draws no plots (its results are one table); --plot ignored")


def dtypes(arg: str, choices: dict[str, torch.dtype] = DTYPES) -> list[torch.dtype]:
    """The dtypes of a ``--dtypes`` value; exits naming the choices on an unknown one."""
    names = [d.strip() for d in arg.split(",") if d.strip()]
    unknown = [n for n in names if n not in choices]
    if unknown or not names:
        sys.exit(f"--dtypes: unknown {', '.join(unknown) or 'empty list'}; choose among "
                 f"{', '.join(choices)}")
    return [choices[n] for n in names]


def nvidia_gpu(script: str, against: str, tests: str) -> DeviceInfo:
    """The CUDA device's info; exits with the reason when this process cannot time compiled
    kernels on an NVIDIA GPU (``against``: what the script compares with; ``tests``: the
    test files to run instead)."""
    if not torch.cuda.is_available() or torch.version.hip:
        sys.exit(f"{script} measures NVIDIA GPUs ({against}); no CUDA GPU here. On the CPU "
                 "interpreter every launch costs milliseconds, so there is nothing to compare; "
                 f"run the tests instead (python -m pytest {tests}).")
    info = pk.device_info("cuda")
    if "interpreter" in info.capabilities:
        sys.exit(f"{script}: kernels run under Triton's interpreter in this process "
                 "(TRITON_INTERPRET/PK_INTERPRET is set); unset it to benchmark compiled kernels")
    return info


def header(kernel: str, info: DeviceInfo, cudagraph: bool) -> str:
    """The first line of every table: kernel, GPU, versions and timing method."""
    return (f"{kernel} on {info.name} ({info.arch}, {info.num_sms} SMs) · torch {torch.__version__} · "
            f"triton {triton.__version__} · median of do_bench" + (" (CUDA graphs)" if cudagraph else ""))


def meta(info: DeviceInfo, cudagraph: bool) -> dict:
    """The machine and versions, for the JSON file beside the table."""
    return {"device": info.to_dict(), "torch": torch.__version__, "triton": triton.__version__,
            "cudagraph": cudagraph}


def write(path: str | None, rows: list[dict], meta_: dict,
          table: Callable[[list[dict]], str]) -> None:
    """With ``--json PATH``: ``PATH`` (``meta_`` and the rows) and ``PATH`` with ``.md``
    (``table(rows)``), rewritten after every row so that a run cut short keeps what it
    measured; nothing without it."""
    if not path:
        return
    prefix = Path(path)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps({**meta_, "rows": rows}, indent=1,
                                                      default=str))
    prefix.with_suffix(".md").write_text(table(rows))


def first_call(row: dict, name: str, fn: Callable[[], Any]) -> Any:
    """``fn()`` once, waited for (ours compile and autotune there); None, with the error in
    ``row["error"][name]``, when it raises."""
    try:
        out = fn()
        torch.cuda.synchronize()
        return out
    except Exception as exc:  # reported in the row; the method is not timed
        row["error"][name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        return None


def timed(row: dict, name: str, fn: Callable[[], Any], flops: float, cudagraph: bool) -> None:
    """Time ``fn`` and record it in ``row`` (``row["ms"][name]``, ``row["tflops"][name]``):
    the median of ``triton.testing.do_bench`` (CUDA events, L2 flushed before each call),
    or with ``cudagraph`` of replays of a captured graph (no host time)."""
    if cudagraph:
        ms = triton.testing.do_bench_cudagraph(fn, return_mode="median")
    else:
        ms = triton.testing.do_bench(fn, return_mode="median")
    row["ms"][name] = ms
    row["tflops"][name] = flops / (ms * 1e-3) / 1e12


def closing(path: str | None, rows: list[dict], label: Callable[[dict], str],
            start: float) -> None:
    """The end of a run's log: every row's errors (``label(row)`` names the row), and where
    the results went."""
    for r in rows:
        for name, error in r["error"].items():
            print(f"{label(r)} {name}: {error}")
    where = (f"wrote {Path(path).with_suffix('.json')} and {Path(path).with_suffix('.md')}"
             if path else "no files written (--json PATH writes them)")
    print(f"{where}; {time.time() - start:.0f} s")


def plot_missing() -> str:
    """What ``triton.testing.perf_report`` lacks here to draw ("" when nothing): it builds
    a pandas table and draws it with matplotlib."""
    import importlib.util

    return ", ".join(m for m in ("pandas", "matplotlib") if importlib.util.find_spec(m) is None)


def save_plots(directory: str | None, benchmarks: Sequence[triton.testing.Benchmark],
               measured: Callable[..., float]) -> str:
    """Draw ``benchmarks`` through ``triton.testing.perf_report`` into ``directory`` (one
    ``PLOT_NAME.png`` and ``.csv`` per benchmark, and ``results.html``); returns what was
    done, for the log.

    ``measured(provider=..., **x, **args)`` returns a value this run measured (NaN where it
    has none): perf_report draws the run's table rather than timing again, so a plot shows
    the numbers of the table beside it, checked before they were timed."""
    if not directory:
        return "plots not drawn (--plot DIR draws them)"
    directory = Path(directory)
    missing = plot_missing()
    if missing:
        return f"plots not drawn: triton.testing.perf_report needs {missing}, not installed here"
    if not benchmarks:
        return "plots not drawn: no rows"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    # A marker on every point: a series with one measured x (e.g. one LLM shape asked for)
    # would otherwise draw nothing.
    with matplotlib.rc_context({"lines.marker": "o"}):
        triton.testing.perf_report(list(benchmarks))(measured).run(save_path=str(directory))
    plt.close("all")
    return f"plots: {len(benchmarks)} in {directory}/ (results.html shows them all)"


def nan_if_none(value: Any) -> float:
    """``value``, or NaN (a gap in a perf_report line) when nothing was measured."""
    return float("nan") if value is None else float(value)
