"""``portable-kernels conformance`` and ``portable-kernels report``.

    portable-kernels conformance [--device DEV] [--backend PLUGIN] [--kernels a,b]
        [--variants v1,v2] [--quick] [--json PATH] [--markdown PATH] [-n WORKERS]
        [--verbose] [-- PYTEST_ARGS...]
    portable-kernels report show REPORT.json [--markdown OUT] [--verbose]
    portable-kernels report merge A.json B.json ... [--markdown OUT] [--html OUT] [--json OUT]
        [--verbose]

``conformance`` runs pytest on the conformance package in a subprocess (so the interpreter
choice, CUDA state and xdist workers start clean), draws a one-line progress bar on stderr
while it runs, prints the kernel x variant matrix (fit to 100 columns, reasons cut; whole with
``--verbose`` and in the reports), and exits 1 when any case failed
(2 or pytest's own code when the run itself broke). pytest's own output goes to a log file,
kept and named when something went wrong.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

__all__ = ["add_subcommands", "pytest_command", "run_conformance", "run_report"]

PACKAGE = "portable_kernels.conformance"
PLUGIN = "portable_kernels.conformance.plugin"


# --- conformance -----------------------------------------------------------------------------------

def configure_conformance(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None,
                   help="torch device: cpu, cuda, cuda:1 (default: the GPU if torch sees one, else cpu); "
                   "cpu turns on Triton's interpreter (PK_INTERPRET=1)")
    p.add_argument("--backend", default=None, metavar="PLUGIN",
                   help="only variants registered by this plugin (e.g. acme); the generic variants "
                   "belong to portable_kernels.catalog")
    p.add_argument("--kernels", default=None, metavar="K1,K2", help="only these kernels")
    p.add_argument("--variants", default=None, metavar="V1,V2",
                   help="only these variants (fnmatch globs, e.g. 'generic,iluvatar.*')")
    p.add_argument("--quick", action="store_true", help="a quick subset of shapes and dtypes")
    p.add_argument("--repeat-calls", default=None, type=int, metavar="N",
                   help="call and check every case N more times (default: 2 where later calls "
                   "launch compiled kernels directly, NVIDIA GPUs; else 0)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the JSON report here")
    p.add_argument("--markdown", default=None, metavar="PATH", help="write the Markdown report here")
    p.add_argument("-n", "--workers", default=None, metavar="WORKERS",
                   help="run in parallel with pytest-xdist: a number, or 'auto' (one worker per GPU "
                   "with a cuda device, one per CPU core otherwise)")
    p.add_argument("--log", default=None, metavar="PATH", help="keep pytest's own output here")
    _verbose_arg(p)
    p.add_argument("pytest_args", nargs="*", metavar="-- PYTEST_ARGS",
                   help="extra pytest arguments after '--' (e.g. -- -x -k softmax)")


def _workers(value: str | None, device: str | None) -> str | None:
    if value in (None, "", "0"):
        return None
    if value == "auto":
        import torch

        kind = (device or ("cuda" if torch.cuda.is_available() else "cpu")).split(":")[0]
        if kind == "cuda" and ":" not in (device or "") and torch.cuda.device_count() > 0:
            return str(torch.cuda.device_count())  # one worker per GPU
        return "auto"
    if not value.isdigit():
        raise ValueError(f"-n {value}: expected a number of workers or 'auto'")
    return value


def pytest_command(args: argparse.Namespace, json_path: str) -> list[str]:
    """The pytest command line for ``args`` (a parsed ``conformance`` command)."""
    cmd = [sys.executable, "-m", "pytest", "--pyargs", PACKAGE, "-p", PLUGIN,
           "-p", "no:cacheprovider", "-q", "--pk-progress", "--pk-json", json_path]
    for flag, value in (("--pk-device", args.device), ("--pk-backend", args.backend),
                        ("--pk-kernels", args.kernels), ("--pk-variants", args.variants),
                        ("--pk-markdown", args.markdown)):
        if value:
            cmd += [flag, value]
    if args.quick:
        cmd.append("--pk-quick")
    if args.repeat_calls is not None:
        cmd += ["--pk-repeat-calls", str(args.repeat_calls)]
    workers = _workers(args.workers, args.device)
    if workers:
        if importlib.util.find_spec("xdist") is None:
            raise ValueError("-n needs pytest-xdist: pip install pytest-xdist")
        cmd += ["-p", "xdist.plugin", "-n", workers]
    return cmd + list(args.pytest_args)


def _environment(args: argparse.Namespace) -> dict:
    env = dict(os.environ)
    # Only the plugins the suite needs (given with -p): other pytest plugins installed here
    # cannot slow the run down or change it.
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    # The checks that read argument values on the host (a sync per call, off by default).
    env.setdefault("PK_CHECK_VALUES", "1")
    if (args.device or "").split(":")[0] == "cpu" and "TRITON_INTERPRET" not in env:
        env["PK_INTERPRET"] = "1"  # CPU tensors run under the interpreter, also on a GPU machine
    return env


def _verbose_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verbose", action="store_true",
                   help="print the matrix's reasons whole (by default cut to fit 100 columns)")


def _width(args: argparse.Namespace) -> int | None:
    """The matrix's width: 100 columns at most (a narrower terminal: its width), or with
    ``--verbose`` whole lines (the JSON and Markdown reports always hold the whole text)."""
    return 1_000_000 if getattr(args, "verbose", False) else None


def _tail(path: str, lines: int = 40) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def run_conformance(args: argparse.Namespace) -> int:
    from .. import dispatch
    from ..errors import DeviceError
    from . import report as reports

    if importlib.util.find_spec("pytest") is None:
        # pytest is a dependency of the package; a broken environment still gets one clear
        # line (the subprocess's own error goes to the terminal, not to its log).
        print(f"error: the conformance suite runs on pytest, which {sys.executable} cannot "
              "import; install it (pip install pytest) or reinstall portable-kernels",
              file=sys.stderr)
        return 2
    if args.device is not None:
        # Before pytest starts: inside the run a device that is not there fails every case
        # with the same error instead of stopping the run with it.
        try:
            dispatch._resolve_device(args.device)
        except DeviceError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    workdir = tempfile.mkdtemp(prefix="pk-conformance-")
    json_path = os.path.abspath(args.json) if args.json else os.path.join(workdir, "report.json")
    log_path = os.path.abspath(args.log) if args.log else os.path.join(workdir, "pytest.log")
    if args.markdown:
        args.markdown = os.path.abspath(args.markdown)
    if os.path.exists(json_path):
        os.remove(json_path)  # never read a previous run's report as this one's
    cmd = pytest_command(args, json_path)
    with open(log_path, "w", encoding="utf-8") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=None, env=_environment(args), stdin=subprocess.DEVNULL)
    try:
        os.rmdir(workdir)  # unused when --json and --log name both files
    except OSError:
        pass

    if not os.path.exists(json_path):
        print(f"error: the conformance run wrote no report (pytest exit code {rc}); "
              f"pytest output ({log_path}):\n{_tail(log_path)}", file=sys.stderr)
        return rc or 2
    report = reports.load(json_path)
    print(reports.text_matrix(report, width=_width(args)))
    summary = report["summary"]
    failed = summary["fail"] + summary["error"]
    if args.json:
        print(f"JSON report: {json_path}")
    if args.markdown:
        print(f"Markdown report: {args.markdown}")
    if rc not in (0, 1) or (rc == 1 and not failed):
        what = "selected no cases" if rc == 5 else f"did not complete (pytest exit code {rc})"
        print(f"error: the conformance run {what}; pytest output ({log_path}):\n{_tail(log_path)}",
              file=sys.stderr)
        return 2 if rc in (0, 5) else rc
    if failed:
        print(f"{failed} case(s) failed; pytest output: {log_path}", file=sys.stderr)
        return 1
    shutil.rmtree(workdir, ignore_errors=True)  # only what this run wrote there
    return 0


# --- report --------------------------------------------------------------------------------------

def configure_report(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="report_command", metavar="ACTION")
    show = sub.add_parser("show", help="print the matrix of one report",
                          description="print the kernel x variant matrix of one report")
    show.add_argument("report")
    show.add_argument("--markdown", default=None, metavar="OUT", help="also write it as Markdown")
    _verbose_arg(show)
    merge = sub.add_parser("merge", help="merge reports of several devices into one matrix",
                           description="one cross-device matrix: rows kernel/variant, a column per "
                           "device fingerprint")
    merge.add_argument("reports", nargs="+", metavar="REPORT.json")
    merge.add_argument("--markdown", default=None, metavar="OUT", help="write the matrix as Markdown")
    merge.add_argument("--html", default=None, metavar="OUT", help="write the matrix as HTML")
    merge.add_argument("--json", default=None, metavar="OUT", help="write the merged matrix as JSON")
    _verbose_arg(merge)


def run_report(args: argparse.Namespace) -> int:
    from . import report as reports

    action = getattr(args, "report_command", None)
    if action is None:
        print("error: report needs an action: show or merge (see portable-kernels report -h)", file=sys.stderr)
        return 2
    try:
        if action == "show":
            report = reports.load(args.report)
            print(reports.text_matrix(report, width=_width(args)))
            if args.markdown:
                reports.write(reports.markdown(report), args.markdown)
            return 0
        merged = reports.merge([reports.load(path) for path in args.reports], names=args.reports)
    except reports.ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # One column per fingerprint: without these, `merge A.json A.json` would pass for a run
    # of one device.
    for note in reports.merge_notes(merged):
        print(note, file=sys.stderr)
    print(reports.merged_text(merged, width=_width(args)))
    for path, text in ((args.markdown, reports.merged_markdown), (args.html, reports.merged_html),
                       (args.json, lambda m: reports.json.dumps(m, indent=1) + "\n")):
        if path:
            reports.write(text(merged), path)
            print(f"wrote {path}")
    return 0


def add_subcommands(subcommands: dict) -> None:
    """Add ``conformance`` and ``report`` to the ``portable-kernels`` command."""
    subcommands["conformance"] = (
        "run the conformance suite on this device: every kernel x variant x dtype x shape",
        configure_conformance, run_conformance)
    subcommands["report"] = (
        "show conformance reports, or merge several devices' into one matrix",
        configure_report, run_report)
