"""The conformance suite itself: cases, outcomes (pass, fail, skip, xfail, xpass), the JSON
report, the matrix, merging, xdist workers, the pytest plugin and the command's exit code.

Runs that go through pytest happen in subprocesses (the suite is a pytest plugin) and are
kept to vector_add's quick cases, a few seconds each. The deliberately broken variants come
from an inline fake plugin loaded through ``PK_PLUGINS``.
"""
from __future__ import annotations

import argparse
import copy
import io
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import portable_kernels as pk
from portable_kernels import cli, testing
from portable_kernels.conformance import harness, plugin, report

FAKE_PLUGIN = textwrap.dedent('''
    """Variants of vector_add that are wrong on purpose, and known failures as data."""
    import torch
    from portable_kernels import ExpectedFailure, Variant, hookimpl


    def wrong(plan, x, y):
        return (x.float() + y.float() + 0.5).to(x.dtype)


    def unwritten(plan, x, y):  # allocates the output and never writes it
        return torch.empty_like(x)


    _calls = {}


    def wrong_later(plan, x, y):  # right on an input's first call only
        key = (tuple(x.shape), x.double().sum().item())  # addresses are reused across cases
        seen = _calls[key] = _calls.get(key, 0) + 1
        return x + y if seen == 1 else wrong(plan, x, y)


    @hookimpl
    def pk_register_variants(registry):
        from portable_kernels.kernels import _host, vector_add  # inside the hook, as plugins must

        add = registry.add_variant
        add(Variant("vector_add", "fake.wrong", wrong, priority=-100))
        add(Variant("vector_add", "fake.unwritten", unwritten, priority=-100))
        add(Variant("vector_add", "fake.libdevice", vector_add.launch, requires={"libdevice", "wgmma"}, priority=-100))
        add(Variant("vector_add", "fake.known_bad", wrong, priority=-100))
        add(Variant("vector_add", "fake.fixed", vector_add.launch, configs=_host.elementwise_configs,
                    priority=-100))
        # Outside the "fake.*" runs: it passes with one call per case.
        add(Variant("vector_add", "fake_later.wrong", wrong_later, priority=-100))


    @hookimpl
    def pk_expected_failures(device):
        return [ExpectedFailure("vector_add/fake.known_bad/*", "tracked in fake#1"),
                ("vector_add/fake.fixed/*/*/forward", "fixed by fake#2?")]
''')

EXPECTED = {
    "generic": "pass",
    "fake.wrong": "fail",
    "fake.unwritten": "fail",
    "fake.libdevice": "skip",
    "fake.known_bad": "xfail",
    "fake.fixed": "xpass",
}


@pytest.fixture(scope="module")
def fake_env(tmp_path_factory):
    """Environment variables that load the fake plugin in a subprocess."""
    where = tmp_path_factory.mktemp("fake_plugin")
    (where / "pk_fake_conformance.py").write_text(FAKE_PLUGIN)
    path = os.pathsep.join(filter(None, [str(where), os.environ.get("PYTHONPATH", "")]))
    return {"PYTHONPATH": path, "PK_PLUGINS": "pk_fake_conformance"}


def run_cli(env: dict, *argv: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "portable_kernels.cli", *argv], capture_output=True,
                          text=True, env=dict(os.environ, **env), timeout=timeout)


def outcomes_by_variant(rep: dict) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for case in rep["cases"]:
        found.setdefault(case["variant"], set()).add(case["outcome"])
    return found


@pytest.fixture(scope="module")
def fake_run(fake_env, tmp_path_factory):
    """One quick conformance run of vector_add with the fake variants."""
    out = tmp_path_factory.mktemp("fake_run")
    proc = run_cli(fake_env, "conformance", "--device", "cpu", "--kernels", "vector_add", "--quick",
                   "--variants", "generic,fake.*", "--json", str(out / "cpu.json"),
                   "--markdown", str(out / "cpu.md"), "--log", str(out / "pytest.log"))
    return proc, report.load(out / "cpu.json"), (out / "cpu.md").read_text()


# --- whole runs ---------------------------------------------------------------------------------


def test_repeated_calls_are_checked(fake_env, tmp_path):
    """With --repeat-calls every case is called and checked again (automatic on NVIDIA GPUs,
    where later calls launch compiled kernels directly): a variant wrong only on later
    calls fails, naming the call; with one call per case it passes."""
    outcomes = {}
    for repeat in ("0", "2"):
        proc = run_cli(fake_env, "conformance", "--device", "cpu", "--kernels", "vector_add", "--quick",
                       "--variants", "fake_later.*", "--repeat-calls", repeat,
                       "--json", str(tmp_path / f"r{repeat}.json"))
        rep = report.load(tmp_path / f"r{repeat}.json")
        assert rep["options"]["repeat_calls"] == int(repeat)
        outcomes[repeat] = {c["outcome"] for c in rep["cases"]}
        # Called once, then (with repeats) failing on the second call.
        assert {c["calls"] for c in rep["cases"]} == {1 if repeat == "0" else 2}
        if repeat == "2":
            assert proc.returncode != 0
            assert all(c["reason"].startswith("call 2: out: max abs error") for c in rep["cases"])
    assert outcomes == {"0": {"pass"}, "2": {"fail"}}


def test_outcomes_of_every_kind(fake_run):
    _, rep, _ = fake_run
    assert {v: {o} for v, o in EXPECTED.items()} == outcomes_by_variant(rep)
    cases = {c["id"]: c for c in rep["cases"]}
    wrong = cases["vector_add/fake.wrong/float32/n4097/forward"]
    assert "exceeds the elementwise tolerance for float32" in wrong["reason"]
    assert wrong["max_error"] == pytest.approx(0.5, rel=1e-3) and wrong["error_ratio"] > 1
    assert wrong["tolerance"] == {"kind": "elementwise", "atol": 1e-6, "rtol": 1e-6}
    # Poisoned allocations: an output never written is NaN, not whatever the memory held.
    assert "NaN or inf where the reference is finite" in cases["vector_add/fake.unwritten/float16/n1/forward"]["reason"]
    skip = cases["vector_add/fake.libdevice/bfloat16/n1/forward"]
    assert skip["reason"].startswith("requires libdevice, wgmma") and skip["max_error"] is None
    assert cases["vector_add/fake.known_bad/float16/n1/forward"]["expected"] == "tracked in fake#1"
    fixed = cases["vector_add/fake.fixed/float32/n4097/forward"]
    assert fixed["expected"] == "fixed by fake#2?" and fixed["error_ratio"] <= 1
    good = cases["vector_add/generic/bfloat16/strided_33x65/forward"]
    assert good["outcome"] == "pass" and 0 <= good["error_ratio"] <= 1 and good["seconds"] > 0


def _matrix_rows(text: str) -> dict[str, str]:
    return {line.split()[1]: line for line in text.splitlines() if line.startswith("vector_add ")}


def test_failures_exit_non_zero_and_print_the_matrix(fake_run):
    """The matrix fits 100 columns with its results whole, the reasons as numbered notes
    under it; ``--verbose`` (``report show --verbose``, the same text) has them in the rows."""
    proc, rep, _ = fake_run
    assert proc.returncode == 1, proc.stderr
    out = proc.stdout
    assert "Conformance on" in out and "fingerprint cpu-" in out
    assert max(len(line) for line in out.splitlines()) <= 100, out
    short = _matrix_rows(out)
    assert set(short) == set(EXPECTED)
    assert "…" not in "".join(short.values()), out
    note = re.search(r"\[(\d+)\]$", short["fake.libdevice"])
    assert note, short["fake.libdevice"]
    assert re.search(rf"^\[{note[1]}\] requires libdevice, wgmma", out, re.M), out
    rows = _matrix_rows(report.text_matrix(rep, width=1_000_000))
    assert set(rows) == set(EXPECTED)
    assert "pass 9/9" in rows["generic"]
    assert "FAIL 9/9" in rows["fake.wrong"] and "exceeds the elementwise tolerance" in rows["fake.wrong"]
    assert "skip" in rows["fake.libdevice"] and "requires libdevice, wgmma" in rows["fake.libdevice"]
    assert "xfail 9/9" in rows["fake.known_bad"] and "tracked in fake#1" in rows["fake.known_bad"]
    assert "XPASS 9/9" in rows["fake.fixed"]
    assert "case(s) failed" in proc.stderr
    assert "conformance [" in proc.stderr  # the progress line (no TTY here: one line per tenth)


def test_report_show_and_merge_fit_100_columns_unless_verbose(fake_run, tmp_path, capsys,
                                                               monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # a wide terminal: still 100 columns
    _, rep, _ = fake_run
    path = tmp_path / "cpu.json"
    report.write(report.dumps(rep), path)
    outputs = {}
    for argv in (["report", "show", str(path)], ["report", "merge", str(path)]):
        for verbose in ([], ["--verbose"]):
            assert cli.main(argv + verbose) == 0
            outputs[argv[1], bool(verbose)] = capsys.readouterr().out
    for (action, verbose), out in outputs.items():
        widest = max(len(line) for line in out.splitlines())
        assert (widest > 100) if verbose and action == "show" else (widest <= 100), (action, out)
    assert _matrix_rows(outputs["show", True]) == _matrix_rows(report.text_matrix(rep, 1_000_000))


def test_json_report_format(fake_run):
    _, rep, _ = fake_run
    report.validate(rep)
    assert rep["device"]["vendor"] == "cpu" and rep["fingerprint"] == rep["device"]["fingerprint"]
    assert rep["torch_devices"] == ["cpu"]
    assert set(rep["versions"]) >= {"portable_kernels", "triton", "torch", "python"}
    assert rep["options"]["kernels"] == ["vector_add"] and rep["options"]["quick"] is True
    assert "pk_fake_conformance" in {p["name"] for p in rep["plugins"]}
    assert rep["summary"] == {"pass": 9, "fail": 18, "error": 0, "skip": 9, "xfail": 9, "xpass": 9, "total": 54}
    assert rep["exitstatus"] == 1
    json.dumps(rep, allow_nan=False)  # strict JSON: no NaN or inf anywhere
    broken = copy.deepcopy(rep)
    del broken["cases"][0]["outcome"]
    with pytest.raises(report.ReportError, match=r"cases\[0\].*lacks 'outcome'"):
        report.validate(broken)
    with pytest.raises(report.ReportError, match="format"):
        report.validate(dict(rep, format="something-else"))


def test_markdown_report(fake_run):
    _, _, md = fake_run
    assert md.startswith("# Conformance: ")
    assert "| kernel | variant | result | max error | tolerance | time | reason |" in md
    assert "## Cases that did not pass" in md and "## Skipped" in md
    assert "| vector_add | fake.libdevice | 9 | requires libdevice, wgmma" in md  # skips grouped by reason


def test_xdist_workers_report_as_one_run(fake_env, fake_run, tmp_path):
    _, single, _ = fake_run
    proc = run_cli(fake_env, "conformance", "--device", "cpu", "--kernels", "vector_add", "--quick",
                   "--variants", "generic,fake.*", "-n", "2", "--json", str(tmp_path / "x.json"),
                   "--log", str(tmp_path / "pytest.log"))
    assert proc.returncode == 1, proc.stderr
    rep = report.load(tmp_path / "x.json")
    assert rep["options"]["workers"] == 2
    assert {c["id"]: c["outcome"] for c in rep["cases"]} == {c["id"]: c["outcome"] for c in single["cases"]}
    assert rep["device"] == single["device"]


def test_pytest_pyargs_through_the_entry_point(tmp_path):
    """`pytest --pyargs portable_kernels.conformance` finds the plugin through pytest11."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "portable_kernels.conformance", "-q",
         "-p", "no:cacheprovider", "--pk-kernels", "softmax", "--pk-variants", "generic", "--pk-quick",
         "--pk-json", str(tmp_path / "s.json")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "portable-kernels conformance" in proc.stdout
    assert re.search(r"^softmax\s+generic\s+pass 9/9", proc.stdout, re.M), proc.stdout
    rep = report.load(tmp_path / "s.json")
    assert {c["kernel"] for c in rep["cases"]} == {"softmax"}
    assert {c["outcome"] for c in rep["cases"]} == {"pass"}


def test_unknown_kernel_is_a_usage_error(tmp_path):
    proc = run_cli({}, "conformance", "--device", "cpu", "--kernels", "no_such_kernel",
                   "--json", str(tmp_path / "r.json"), "--log", str(tmp_path / "pytest.log"))
    assert proc.returncode not in (0, 1)
    assert "unknown kernel(s) no_such_kernel; registered:" in proc.stderr


# --- merging and showing reports -------------------------------------------------------------------

def other_device(rep: dict) -> dict:
    """The same report as if it came from an emulated H100 where one variant failed."""
    other = copy.deepcopy(rep)
    device = dict(other["device"], vendor="nvidia", arch="sm_90", name="NVIDIA H100",
                  fingerprint="nvidia-sm_90-NVIDIA_H100-132sm-triton3.6.0")
    other.update(device=device, fingerprint=device["fingerprint"], torch_devices=["cuda:0", "cuda:1"])
    for case in other["cases"]:
        if case["variant"] == "fake.libdevice":
            case.update(outcome="pass", reason="", max_error=0.0, error_ratio=0.0)
    return other


def test_merge_builds_a_cross_device_matrix(fake_run):
    _, rep, _ = fake_run
    merged = report.merge([rep, other_device(rep)])
    assert [d["fingerprint"] for d in merged["devices"]] == [rep["fingerprint"], other_device(rep)["fingerprint"]]
    rows = {(r["kernel"], r["variant"]): r["cells"] for r in merged["rows"]}
    assert set(rows) == {("vector_add", v) for v in EXPECTED}
    fp8 = rows[("vector_add", "fake.libdevice")]
    assert fp8[rep["fingerprint"]]["status"] == "skip" and "requires libdevice" in fp8[rep["fingerprint"]]["reason"]
    assert fp8["nvidia-sm_90-NVIDIA_H100-132sm-triton3.6.0"]["status"] == "pass"
    md = report.merged_markdown(merged)
    assert f"`{rep['fingerprint']}`" in md and "`nvidia-sm_90-NVIDIA_H100-132sm-triton3.6.0`" in md
    assert "| vector_add | fake.wrong | FAIL 9/9" in md
    html = report.merged_html(merged)
    assert html.startswith("<!doctype html>") and "class='fail'" in html and "class='xpass'" in html


def test_merge_combines_reports_of_one_device(fake_run):
    _, rep, _ = fake_run
    first, second = copy.deepcopy(rep), copy.deepcopy(rep)
    first["cases"] = [c for c in rep["cases"] if c["variant"] == "generic"]
    second["cases"] = [c for c in rep["cases"] if c["variant"] != "generic"]
    merged = report.merge([first, second])
    assert len(merged["devices"]) == 1 and merged["devices"][0]["summary"]["total"] == len(rep["cases"])


def test_report_merge_and_show_commands(fake_run, tmp_path, capsys):
    _, rep, _ = fake_run
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(rep))
    b.write_text(json.dumps(other_device(rep)))
    code = cli.main(["report", "merge", str(a), str(b), "--markdown", str(tmp_path / "m.md"),
                     "--html", str(tmp_path / "m.html"), "--json", str(tmp_path / "m.json")])
    out = capsys.readouterr().out
    assert code == 0 and "[1]" in out and "[2]" in out
    assert "nvidia-sm_90" in (tmp_path / "m.md").read_text()
    assert (tmp_path / "m.html").read_text().startswith("<!doctype html>")
    assert json.loads((tmp_path / "m.json").read_text())["format"] == report.MATRIX_FORMAT
    assert cli.main(["report", "show", str(a)]) == 0
    assert "fake.wrong" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("{}")
    assert cli.main(["report", "merge", str(a), str(tmp_path / "bad.json")]) == 2
    assert "bad.json: format is None" in capsys.readouterr().err


def test_report_merge_says_what_it_combined(fake_run, tmp_path, capsys):
    """Reports keyed by one fingerprint share a column: the command says so on stderr,
    naming the files, so that `merge A.json A.json` does not look like a one-device run."""
    _, rep, _ = fake_run
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    a.write_text(json.dumps(rep))
    b.write_text(json.dumps(other_device(rep)))
    c.write_text(json.dumps(dict(rep, created="2000-01-01T00:00:00Z")))
    assert cli.main(["report", "merge", str(a), str(b), str(a)]) == 0
    out, err = capsys.readouterr()
    assert "[1]" in out and "[2]" in out and "[3]" not in out
    assert err == (f"warning: {a} is given more than once: the repeat was dropped "
                   f"(device {rep['fingerprint']})\n")
    assert cli.main(["report", "merge", str(a), str(c)]) == 0
    out, err = capsys.readouterr()
    assert "[2]" not in out
    assert err == (f"note: {c} is from the same device as {a} ({rep['fingerprint']}): combined "
                   "into column [1]; where both hold a case, the later report's result is kept\n")
    assert cli.main(["report", "merge", str(a), str(b)]) == 0
    assert capsys.readouterr().err == ""
    merged = report.merge([rep, other_device(rep), copy.deepcopy(rep)], names=["a.json", "b.json", "d.json"])
    assert [d["reports"] for d in merged["devices"]] == [["a.json"], ["b.json"]]
    assert merged["dropped"] == [{"report": "d.json", "repeats": "a.json", "fingerprint": rep["fingerprint"]}]
    assert report.merge_notes(merged) == [
        f"warning: d.json repeats a.json (same device {rep['fingerprint']}, same cases): dropped"]


def test_conformance_rejects_a_bad_device_before_pytest(tmp_path):
    proc = run_cli({}, "conformance", "--device", "gpu", "--kernels", "vector_add", "--quick",
                   "--json", str(tmp_path / "r.json"), "--log", str(tmp_path / "pytest.log"), timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: device 'gpu': not a torch device") and proc.stderr.count("\n") == 1
    assert not (tmp_path / "pytest.log").exists() and not proc.stdout


@pytest.mark.parametrize("device, message", [
    ("gpu", "--pk-device gpu: not a device name"),
    ("cpu:3", "--pk-device cpu:3: the CPU has no index but 0"),
    ("cuda:99", "--pk-device cuda:99: torch sees"),
])
def test_pytest_with_a_bad_device_stops_with_one_error(device, message):
    """Run through pytest directly, a device that cannot be tested is one usage error before
    collection, not a failure of every case."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "portable_kernels.conformance",
                           "--pk-device", device, "--pk-quick", "-q", "-p", "no:cacheprovider",
                           "-k", "vector_add"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 4, proc.stdout[-2000:]  # pytest's usage-error exit code
    assert message in proc.stderr and "FAILED" not in proc.stdout, proc.stderr[-2000:]


# --- the pieces, in-process ------------------------------------------------------------------------

def suite_module(kernel: str):
    import importlib

    return importlib.import_module(f"portable_kernels.conformance.test_{kernel}")


def test_cases_come_from_the_registry():
    suite = suite_module("vector_add").SUITE
    registered = pk.list_variants("vector_add")
    full = harness.generate(suite)
    quick = harness.generate(suite, quick=True)
    assert {c.variant for c in full} == set(registered)
    assert len(full) == len(registered) * len(suite.shapes) * len(suite.dtypes)
    assert 0 < len(quick) < len(full) and all(c.shape.quick for c in quick)
    ids = [c.id for c in full]
    assert len(set(ids)) == len(ids) and "generic-float16-n4097" in ids
    assert {c.key for c in full} >= {"vector_add/generic/bfloat16/strided_33x65/forward"}
    only = harness.generate(suite, backend="portable_kernels.catalog", variants=["gen*"])
    assert {c.variant for c in only} == {"generic"}
    assert harness.generate(suite, backend="no_such_plugin") == []


def test_same_inputs_for_every_variant_and_check():
    suite = suite_module("softmax").SUITE
    shape = suite.shapes[1]
    a = harness.Case(suite, "generic", "", torch.float16, shape)
    b = harness.Case(suite, "other.variant", "", torch.float16, shape, harness.BACKWARD)
    c = harness.Case(suite, "generic", "", torch.float32, shape)
    assert a.seed == b.seed != c.seed


def test_backward_cases_where_the_kernel_has_one():
    def make(shape, dtype, device, gen):
        return harness.Inputs((harness.randn(shape["size"], dtype, device, gen),))

    suite = harness.KernelSuite("softmax", (harness.Shape("a", size=(2, 3), quick=True),
                                            harness.Shape("b", size=(2, 3), backward=False)),
                                make, grad_args=(0,))
    checks = [(c.shape.id, c.check) for c in harness.generate(suite, variants=["generic"])]
    assert checks.count(("a", "backward")) == 3 and ("b", "backward") not in checks
    assert [c.id for c in harness.generate(suite, variants=["generic"])][:2] == [
        "generic-float32-a", "generic-float32-a-bwd"]


def test_suite_declarations_are_checked():
    with pytest.raises(ValueError, match="duplicate shape ids"):
        harness.KernelSuite("x", (harness.Shape("a", quick=True), harness.Shape("a")), lambda *a: ())
    with pytest.raises(ValueError, match="quick=True"):
        harness.KernelSuite("x", (harness.Shape("a"),), lambda *a: ())
    with pytest.raises(KeyError, match="no tolerance for kind 'nonsense'"):
        harness.KernelSuite("x", (harness.Shape("a", quick=True),), lambda *a: (), tolerance="nonsense")
    with pytest.raises(ValueError, match="may only hold"):
        harness.Shape("a-b")


def test_unregistered_kernel_is_a_failing_case():
    suite = harness.KernelSuite("not_a_kernel", (harness.Shape("a", quick=True),), lambda *a: ())
    (case,) = harness.generate(suite)
    assert case.broken.startswith("kernel 'not_a_kernel' is not registered")


def test_layouts_are_strided_and_poisoned():
    gen = torch.Generator().manual_seed(0)
    gap = harness.randn((3, 5), torch.float32, torch.device("cpu"), gen, layout="gap")
    assert gap.stride() == (10, 2) and torch.isnan(gap.as_strided((29,), (1,))[1::2]).all()
    padded = harness.randn((3, 5), torch.float16, torch.device("cpu"), gen, layout="padded")
    assert padded.stride() == (10, 1) and not torch.isnan(padded).any()
    transposed = harness.randn((3, 5), torch.float32, torch.device("cpu"), gen, layout="transposed")
    assert transposed.stride() == (1, 3)
    with pytest.raises(ValueError, match="unknown layout"):
        harness.randn((3,), torch.float32, torch.device("cpu"), gen, layout="diagonal")


def test_poisoned_allocations_fill_and_restore():
    with harness.poisoned_allocations():
        assert torch.isnan(torch.empty(4)).all()
        assert (torch.empty(2, dtype=torch.int32) == torch.iinfo(torch.int32).max).all()
    assert not torch.are_deterministic_algorithms_enabled()


def test_expected_failure_patterns():
    e = testing.ExpectedFailure("flash_attn/iluvatar.*/bfloat16/*", "why")
    assert e.matches("flash_attn/iluvatar.v2/bfloat16/causal_odd/backward")
    assert not e.matches("flash_attn/iluvatar.v2/float16/causal_odd/forward")
    assert not e.matches("matmul/iluvatar.v2/bfloat16/a/forward")


def test_expected_failures_hook(fresh_host, monkeypatch, device):
    class Plugin:
        @pk.hookimpl
        def pk_expected_failures(self, device):
            return [("softmax/*", f"broken on {device.vendor}")]

    fresh_host(Plugin())
    info = pk.device_info(device)
    (entry,) = harness.expected_failures(info)
    assert entry == testing.ExpectedFailure("softmax/*", f"broken on {info.vendor}")

    class Bad:
        @pk.hookimpl
        def pk_expected_failures(self, device):
            return ["softmax/*"]

    fresh_host(Bad())
    with pytest.raises(pk.PluginError, match="expected ExpectedFailure"):
        harness.expected_failures(pk.device_info(device))


def test_cell_status_precedence():
    def case(outcome, ratio=None):
        return {"outcome": outcome, "error_ratio": ratio, "max_error": ratio, "reason": outcome,
                "expected": "e", "dtype": "float16", "shape": "s", "check": "forward", "seconds": 0.1,
                "tolerance": {"kind": "elementwise", "atol": 1e-5, "rtol": 2e-3}}

    assert report.cell([case("pass", 0.5), case("fail", 3.0), case("xpass")]).status == "fail"
    assert report.cell([case("pass", 0.5), case("xpass")]).status == "xpass"
    assert report.cell([case("pass", 0.5), case("xfail")]).status == "xfail"
    c = report.cell([case("pass", 0.5), case("skip")])
    assert c.status == "pass" and c.label == "pass 1/1 (+1 skipped)" and c.max_error == "5.00e-01 (0.5x)"
    assert report.cell([case("skip"), case("skip")]).label == "skip"


def test_progress_line_without_a_tty():
    stream = io.StringIO()
    progress = plugin.Progress(stream)
    progress.start(100)
    for i in range(100):
        progress.update({"outcome": "pass" if i % 10 else "fail", "id": f"k/v/float16/s{i}/forward"})
    progress.finish()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 11 and "\r" not in stream.getvalue()
    assert lines[-1].startswith("conformance [########################] 100/100 100%")
    assert "10 fail 90 pass" in lines[-1]


def test_plugin_import_is_light():
    """pytest imports the plugin in every session: it must not load the kernels or the harness."""
    code = ("import sys, portable_kernels.conformance.plugin; "
            "print(sorted(m for m in sys.modules if m.startswith('portable_kernels.') and "
            "m.split('.')[1] in ('conformance', 'kernels')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['portable_kernels.conformance', 'portable_kernels.conformance.plugin']"


def test_the_plain_install_has_what_the_conformance_suite_runs_on():
    """README's "install and run" command installs the package without extras, and
    `portable-kernels conformance` must work after it: pytest is a runtime dependency."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=!~ \[;]", d, maxsplit=1)[0].lower() for d in project["dependencies"]}
    assert "pytest" in names, project["dependencies"]


def test_conformance_without_pytest_says_so(monkeypatch, capsys):
    import importlib.util

    from portable_kernels.conformance import cli as conformance_cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "pytest" else real(name, *a))
    parser = argparse.ArgumentParser()
    conformance_cli.configure_conformance(parser)
    assert conformance_cli.run_conformance(parser.parse_args([])) == 2
    assert "runs on pytest" in capsys.readouterr().err
