"""The conformance suite's pytest plugin, registered through the ``pytest11`` entry point.

    pytest --pyargs portable_kernels.conformance [--pk-device DEV] [--pk-backend PLUGIN]
        [--pk-kernels a,b] [--pk-variants v1,v2] [--pk-quick] [--pk-json PATH]
        [--pk-markdown PATH] [-n WORKERS]

What it adds:

- the ``--pk-*`` options;
- parametrization: a conformance file's ``test_conformance(pk_case)`` gets one case per
  registered variant x shape x dtype x check (``harness.generate``), and the ``pk_case``
  fixture binds it to the device under test (``pk_session``, one per worker);
- the report: each case's record travels in its pytest report's ``user_properties`` (so
  pytest-xdist brings the workers' results to the controller), and the controller writes
  one JSON and one Markdown report at the end and prints the kernel x variant matrix;
- under pytest-xdist, each worker takes its own GPU (``--pk-device cuda`` without an index:
  worker ``gwN`` uses ``cuda:N % device_count``).

It stays out of the way of other test sessions in the same environment: importing it loads
only pytest (and ``portable_kernels``, which any module of this package imports first, and
which chooses Triton's interpreter before ``triton`` is imported); the harness, the
registry and the kernels load only when a conformance test is collected; reports are
written only when conformance cases ran or ``--pk-json``/``--pk-markdown`` is given.
"""
from __future__ import annotations

import collections
import json
import shutil
import sys
import time
from typing import Any, TextIO

import pytest

RECORD = "pk_case"
_SESSION_KEY: pytest.StashKey[Any] = pytest.StashKey()
_COLLECTOR = "portable-kernels-conformance-collector"


def _csv(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def options(config: pytest.Config) -> dict:
    """The ``--pk-*`` selection, as the report records it."""
    workers = getattr(config.option, "numprocesses", None)
    return {
        "device": config.getoption("pk_device"),
        "backend": config.getoption("pk_backend"),
        "kernels": _csv(config.getoption("pk_kernels")),
        "variants": _csv(config.getoption("pk_variants")),
        "quick": bool(config.getoption("pk_quick")),
        "repeat_calls": config.getoption("pk_repeat_calls"),
        "workers": workers if isinstance(workers, int) else 0,
    }


# --- options and configuration -------------------------------------------------------------------

def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup(
        "portable-kernels", "portable-kernels conformance (pytest --pyargs portable_kernels.conformance)")
    group.addoption("--pk-device", metavar="DEV", default=None,
                    help="torch device to test: cpu, cuda, cuda:1 (default: the GPU if torch sees "
                    "one, else cpu). Under pytest-xdist, 'cuda' gives worker gwN the GPU N.")
    group.addoption("--pk-backend", metavar="PLUGIN", default=None,
                    help="only variants registered by this plugin (e.g. acme, nvidia, cpu; the "
                    "generic variants belong to portable_kernels.catalog)")
    group.addoption("--pk-kernels", metavar="K1,K2", default=None, help="only these kernels")
    group.addoption("--pk-variants", metavar="V1,V2", default=None,
                    help="only these variants (fnmatch globs, e.g. 'generic,iluvatar.*')")
    group.addoption("--pk-quick", action="store_true", default=False,
                    help="a quick subset of shapes and dtypes")
    group.addoption("--pk-json", metavar="PATH", default=None,
                    help="write the JSON report here (format: docs/conformance-report.md)")
    group.addoption("--pk-markdown", metavar="PATH", default=None, help="write the Markdown report here")
    group.addoption("--pk-repeat-calls", metavar="N", type=int, default=None,
                    help="call and check every case N more times (default: 2 where later calls "
                    "launch compiled kernels directly, NVIDIA GPUs; else 0)")
    group.addoption("--pk-progress", action="store_true", default=False,
                    help="draw a one-line progress bar on stderr")


def pytest_configure(config: pytest.Config) -> None:
    if not _is_worker(config):
        config.pluginmanager.register(Collector(config), _COLLECTOR)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Check ``--pk-device`` once (not as a failure of every case), and ``--pk-kernels`` and
    ``--pk-backend`` against the registry, before collecting."""
    config = session.config
    from portable_kernels import errors
    from portable_kernels.conformance import harness

    try:
        harness.check_device(config.getoption("pk_device"))
    except errors.DeviceError as exc:
        raise pytest.UsageError(str(exc)) from None
    kernels, backend = _csv(config.getoption("pk_kernels")), config.getoption("pk_backend")
    if not kernels and not backend:
        return
    from portable_kernels import plugins

    host = plugins.host()
    failed = "; ".join(f"{f.plugin} ({f.stage}: {f.error})" for f in host.failures)
    failed = f"; failed plugins: {failed}" if failed else ""
    unknown = [k for k in kernels if k not in host.registry.kernels]
    if unknown:
        raise pytest.UsageError(
            f"--pk-kernels: unknown kernel(s) {', '.join(unknown)}; registered: "
            f"{', '.join(sorted(host.registry.kernels))}{failed}")
    if backend:
        owners = sorted({v.plugin for vs in host.registry.variants.values() for v in vs.values()})
        if backend not in owners:
            raise pytest.UsageError(
                f"--pk-backend {backend}: that plugin registered no variants; plugins with "
                f"variants: {', '.join(owners)}{failed}")


# --- collection --------------------------------------------------------------------------------

def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "pk_case" not in metafunc.fixturenames:
        return
    suite = getattr(metafunc.module, "SUITE", None)
    if suite is None:
        raise TypeError(f"{metafunc.module.__name__} uses pk_case but defines no SUITE (a KernelSuite)")
    from . import harness

    config = metafunc.config
    kernels = _csv(config.getoption("pk_kernels"))
    cases = [] if kernels and suite.kernel not in kernels else harness.generate(
        suite,
        quick=config.getoption("pk_quick"),
        backend=config.getoption("pk_backend"),
        variants=_csv(config.getoption("pk_variants")),
    )
    metafunc.parametrize("pk_case", cases, ids=[c.id for c in cases], indirect=True)


def _case_of(item: pytest.Item) -> Any:
    callspec = getattr(item, "callspec", None)
    case = callspec.params.get("pk_case") if callspec is not None else None
    return case if hasattr(case, "record") else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    keep, drop = [], []
    for item in items:
        if "pk_case" not in getattr(item, "fixturenames", ()):
            keep.append(item)
            continue
        case = _case_of(item)
        if case is None:  # a suite left with no cases by the selection: not a skip, just absent
            drop.append(item)
            continue
        # The record rides along in every report of the item, also from xdist workers.
        item.user_properties.append((RECORD, case.record()))
        keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


# --- fixtures ----------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def pk_session(request: pytest.FixtureRequest) -> Any:
    """The device under test (this worker's GPU under xdist) and its expected failures."""
    from . import harness

    session = harness.Session(request.config.getoption("pk_device"),
                              request.config.getoption("pk_repeat_calls"))
    request.config.stash[_SESSION_KEY] = session
    return session


@pytest.fixture
def pk_case(request: pytest.FixtureRequest, pk_session: Any) -> Any:
    """The case to check (a ``harness.CaseRun``): the test body calls ``pk_case.check()``."""
    from . import harness

    record = next(v for k, v in request.node.user_properties if k == RECORD)
    return harness.CaseRun(request.param, pk_session, record, request.node)


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    if not _is_worker(config):
        return
    pk = config.stash.get(_SESSION_KEY, None)
    if pk is not None:  # tell the controller where this worker ran
        from . import harness

        env = harness.environment(pk.torch_device)
        env["device_error"] = env["device_error"] or pk.error or None
        config.workeroutput["pk_environment"] = json.dumps(env)


# --- outcomes and the report (controller) ----------------------------------------------------------

def outcome(report: pytest.TestReport) -> str:
    """pass, fail, error, skip, xfail or xpass, from a pytest report."""
    if hasattr(report, "wasxfail"):
        return "xpass" if report.passed else ("xfail" if report.skipped else "fail")
    if report.skipped:
        return "skip"
    if report.failed:
        return "fail" if report.when == "call" else "error"
    return "pass"


def _reason(report: pytest.TestReport) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        text = str(report.longrepr[2])
        return text[len("Skipped: "):] if text.startswith("Skipped: ") else text
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    if crash is not None:
        return " ".join(str(crash.message).split())[:400]
    if report.failed:
        lines = [ln for ln in report.longreprtext.splitlines() if ln.strip()]
        return lines[-1][:400] if lines else "failed"
    return ""


class Collector:
    """Gathers case records on the controller, writes the reports, prints the matrix."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.cases: dict[str, dict] = {}
        self.envs: list[dict] = []
        self.started = time.time()
        self.report: dict | None = None
        self.progress = Progress(sys.stderr) if config.getoption("pk_progress") else None

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if self.progress is not None:
            self.progress.start(sum(1 for i in session.items if _case_of(i) is not None))

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: Any, ids: list[str]) -> None:
        if self.progress is not None and self.progress.total is None:
            self.progress.start(len(ids))

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        env = (getattr(node, "workeroutput", None) or {}).get("pk_environment")
        if env:
            self.envs.append(json.loads(env))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        record = next((v for k, v in report.user_properties if k == RECORD), None)
        if record is None:
            return
        if report.when == "teardown":
            if report.failed and report.nodeid in self.cases:
                self.cases[report.nodeid].update(outcome="error", reason=_reason(report))
            return
        if report.when == "setup" and report.passed:
            return
        rec = dict(record)
        rec["outcome"] = outcome(report)
        rec["duration"] = round(report.duration, 4)
        if not rec["reason"] and rec["outcome"] != "pass":
            rec["reason"] = _reason(report)
        self.cases[report.nodeid] = rec
        if self.progress is not None:
            self.progress.update(rec)

    def _environment(self) -> tuple[dict, list[str]]:
        from . import harness

        if self.envs:
            devices = [e["torch_device"] for e in self.envs if e.get("torch_device")]
            return self.envs[0], devices
        session = self.config.stash.get(_SESSION_KEY, None)
        if session is not None:
            env = harness.environment(session.torch_device)
            env["device_error"] = env["device_error"] or session.error or None
            return env, []
        try:  # nothing ran here: describe the device the options name
            return harness.environment(harness.resolve_device(self.config.getoption("pk_device"))), []
        except Exception as exc:
            env = harness.environment(None)
            env["device_error"] = str(exc)
            return env, []

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        from . import report as reports

        json_path, md_path = self.config.getoption("pk_json"), self.config.getoption("pk_markdown")
        if self.progress is not None:
            self.progress.finish()
        if not self.cases and not (json_path or md_path):
            return
        env, devices = self._environment()
        self.report = reports.build(
            self.cases.values(), env, options=options(self.config), started=self.started,
            finished=time.time(), exitstatus=int(exitstatus), torch_devices=devices)
        if json_path:
            reports.write(reports.dumps(self.report), json_path)
        if md_path:
            reports.write(reports.markdown(self.report), md_path)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.report or not self.report["cases"]:
            return
        from . import report as reports

        terminalreporter.write_sep("=", "portable-kernels conformance")
        terminalreporter.write_line(reports.text_matrix(self.report))
        for opt, what in (("pk_json", "JSON"), ("pk_markdown", "Markdown")):
            if self.config.getoption(opt):
                terminalreporter.write_line(f"{what} report: {self.config.getoption(opt)}")


class Progress:
    """A one-line progress bar: redrawn in place on a terminal; without one (CI logs), a
    new line at every tenth of the cases, so logs stay short."""

    WIDTH = 24

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.total: int | None = None
        self.done = 0
        self.counts: collections.Counter = collections.Counter()
        self.current = ""
        self.t0 = time.monotonic()
        self._drawn = 0.0
        self._tenth = -1
        self._open = False

    def start(self, total: int) -> None:
        self.total = total
        self.t0 = time.monotonic()
        self.draw(force=True)

    def update(self, record: dict) -> None:
        self.done += 1
        self.counts[record["outcome"]] += 1
        self.current = record["id"]
        self.draw()

    def line(self) -> str:
        total = self.total or max(self.done, 1)
        frac = min(self.done / total, 1.0) if total else 1.0
        filled = int(self.WIDTH * frac)
        counts = " ".join(f"{n} {o}" for o, n in sorted(self.counts.items()) if n)
        return (f"conformance [{'#' * filled}{'.' * (self.WIDTH - filled)}] {self.done}/{self.total or '?'} "
                f"{frac:4.0%} {time.monotonic() - self.t0:5.0f}s  {counts}  {self.current}").rstrip()

    def draw(self, force: bool = False) -> None:
        now = time.monotonic()
        finished = self.total is not None and self.done >= self.total
        if self.tty:
            if not (force or finished or now - self._drawn > 0.1):
                return
            width = shutil.get_terminal_size((100, 20)).columns - 1
            self.stream.write("\r" + self.line()[:width] + "\x1b[K")
            self._open = True
        else:
            tenth = int(10 * self.done / self.total) if self.total else 0
            if not (force or tenth > self._tenth):
                return
            self._tenth = tenth
            self.stream.write(self.line() + "\n")
        self._drawn = now
        self.stream.flush()

    def finish(self) -> None:
        if self.tty and self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False
