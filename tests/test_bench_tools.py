"""The GPU tools' building blocks, run under whatever executes kernels here (the interpreter
on a CPU), so that they do not rot between runs on a GPU: every benchmark's command line,
their helpers, and the autotuner's timer falling back when graph capture fails."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import portable_kernels as pk  # noqa: F401  (chooses the interpreter first)
from portable_kernels import launch

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _load(name: str):
    if str(BENCH) not in sys.path:  # the benches import their shared _common module
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"_pk_bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


#: The maintained benchmarks: one per kind of work (elementwise and norm layers, the matmul
#: families, attention and its memory, serving attention, the losses, a model end to end)
#: and the host's overheads; each shares _common's command line.
KEPT = ["layers", "matmul", "grouped_matmul", "flash_attn", "flash_attn_memory",
        "serving_attention", "losses", "transformers_model", "host_per_call", "host_backward",
        "dispatch_overhead"]


def _run(script: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / f"{script}.py"), *args],
                          capture_output=True, text=True, timeout=300,
                          env=None if env is None else {**os.environ, **env})


# Runs each (script, args) of a JSON list on stdin as ``python bench/script.py args`` would
# (``__main__``, its own argv, its exit status and output), all in one interpreter: each
# fresh Python process spends seconds importing torch, and the command-line tests start
# about thirty of them.
_DRIVER = """
import contextlib, io, json, runpy, sys
bench = sys.argv[1]
sys.path.insert(0, bench)
results = []
for script, args in json.load(sys.stdin):
    out, err, code = io.StringIO(), io.StringIO(), 0
    sys.argv = [f"{bench}/{script}.py", *args]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
        except SystemExit as exc:
            code = exc.code
    if isinstance(code, str):  # sys.exit(message): printed, status 1
        err.write(code + chr(10))
        code = 1
    results.append([code or 0, out.getvalue(), err.getvalue()])
sys.__stdout__.write(json.dumps(results))
"""


def _run_all(calls: list[tuple[str, list[str]]]) -> list[subprocess.CompletedProcess]:
    """``_run(script, *args)`` for each call, in one process (see ``_DRIVER``)."""
    proc = subprocess.run([sys.executable, "-c", _DRIVER, str(BENCH)], input=json.dumps(calls),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return [subprocess.CompletedProcess([script, *args], code, out, err)
            for (script, args), (code, out, err) in zip(calls, json.loads(proc.stdout))]


def test_bench_holds_the_maintained_scripts_only():
    assert sorted(p.stem for p in BENCH.glob("*.py") if not p.stem.startswith("_")) == sorted(KEPT)


def test_a_bench_runs_as_a_script():
    """What the batched runs below stand for: a bench started as a program of its own."""
    proc = _run("layers", "--help")
    assert proc.returncode == 0 and "--set MODULE.NAME=VALUE" in proc.stdout, proc.stderr
    assert _run_all([("layers", ["--help"])])[0].stdout == proc.stdout


@pytest.fixture(scope="module")
def command_lines(tmp_path_factory):
    """Every bench's ``--help``, an unknown option, and (without a GPU) the shared options
    with ``--set``, run once per module in one process: {(script, what): process}; each
    options run writes under its own folder (``dirs``)."""
    calls, keys, dirs = [], [], {}
    gpu = torch.cuda.is_available()  # there the runs below would benchmark: left out
    for script in KEPT:
        calls += [(script, ["--help"]), (script, ["--no-such-option"])]
        keys += [(script, "help"), (script, "bad")]
        if script != "dispatch_overhead" and not gpu:
            d = dirs[script] = tmp_path_factory.mktemp(script)
            calls.append((script, ["--quick", "--json", str(d / "r.json"), "--plot",
                                   str(d / "plots"), "--set", "matmul_gluon.MIN_TILES=1"]))
            keys.append((script, "options"))
    more = {("matmul", "cold"): ["--cold"]}  # a usage error anywhere
    if not gpu:
        more.update({("matmul", "quick"): ["--quick"], ("flash_attn", "quick"): ["--quick"],
                     ("host_backward", "rounds"): ["--rounds", "1"]})
    calls += [(script, args) for (script, _), args in more.items()]
    keys += list(more)
    return dict(zip(keys, _run_all(calls))), dirs


@pytest.mark.parametrize("script", KEPT)
def test_every_bench_shares_the_command_line(script, command_lines):
    """``--help`` lists the shared options; an unknown option is argparse's usage error."""
    runs, _ = command_lines
    proc = runs[script, "help"]
    assert proc.returncode == 0, proc.stderr
    for option in ("--quick", "--json PATH", "--plot DIR", "--set MODULE.NAME=VALUE"):
        assert option in proc.stdout, (script, option)
    bad = runs[script, "bad"]
    assert bad.returncode == 2 and "unrecognized arguments: --no-such-option" in bad.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit on a machine without a GPU")
@pytest.mark.parametrize("script", [s for s in KEPT if s != "dispatch_overhead"])
def test_every_bench_takes_the_shared_options_then_asks_for_a_gpu(script, command_lines):
    """The shared options parse and ``--set`` applies; the run then stops on this machine
    saying it needs a GPU, and writes nothing."""
    runs, dirs = command_lines
    proc = runs[script, "options"]
    assert proc.returncode != 0 and "GPU" in proc.stderr, proc.stderr
    assert "usage:" not in proc.stderr and not list(dirs[script].iterdir())


def test_dispatch_overhead_runs_here_and_writes_its_results(tmp_path, device):
    """The one bench that also runs on the interpreter (the dispatch cost is host time); on
    the suite's device (a GPU machine runs no CPU tensors without the interpreter). With
    replays forced (``PK_REPLAY=1``) its paired rows, the recipes alone through each
    launcher beside torch's operator, run here too (on the interpreter both launchers are
    Triton's JIT: only that they run is checked)."""
    proc = _run("dispatch_overhead", "--quick", "--device", str(device), "--numel", "64",
                "--json", str(tmp_path / "dispatch.json"), env={"PK_REPLAY": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "dispatch added (handle - launcher)" in proc.stdout
    saved = json.loads((tmp_path / "dispatch.json").read_text())
    assert {r["path"] for r in saved["rows"]} >= {
        "handle", "launcher", "raw", "vector_add: recipe alone, C launcher",
        "vector_add: recipe alone, Triton's launcher", "vector_add: torch, beside the recipes"}
    assert (tmp_path / "dispatch.md").read_text().startswith("| path |")


def test_set_overrides_a_kernel_modules_constant(monkeypatch):
    """``--set MODULE.NAME=VALUE``: a family's module or the NVIDIA backend's Gluon one, a
    Python literal; what does not exist, or is not a literal, is named."""
    from portable_kernels.kernels import flash_attn as fa
    from portable_kernels_backends.nvidia.gluon import flash_attn_gluon as fg
    from portable_kernels_backends.nvidia.gluon import matmul_gluon as mg

    common = _load("_common")
    monkeypatch.setattr(mg, "MIN_TILES", mg.MIN_TILES)
    monkeypatch.setattr(fg, "MIN_KEYS", fg.MIN_KEYS)
    monkeypatch.setattr(fa, "TMA_HEAD_DIMS", fa.TMA_HEAD_DIMS)
    done = common.apply_settings(["matmul_gluon.MIN_TILES=1",
                                  "flash_attn_gluon.MIN_KEYS={64: 0, 128: 1024}",
                                  "flash_attn.TMA_HEAD_DIMS=(64,)"])
    assert mg.MIN_TILES == 1 and fg.MIN_KEYS == {64: 0, 128: 1024} and fa.TMA_HEAD_DIMS == (64,)
    assert done["matmul_gluon.MIN_TILES"] == 1
    for bad, message in (("matmul_gluon.NOPE=1", "matmul_gluon has no NOPE"),
                         ("nowhere.X=1", "no module nowhere"),
                         ("matmul_gluon.MIN_TILES=lots", "not a Python literal"),
                         ("MIN_TILES", "expected MODULE.NAME=VALUE")):
        with pytest.raises(SystemExit, match=message):
            common.apply_settings([bad])


def test_layers_bench_checks_ours_and_torchs_against_the_references(device):
    """What bench/layers.py times, on small inputs here: ours and torch's operator pass the
    family's float64 reference (a wrong torch counterpart would fail too), forward and
    backward run, and the table and plots take the rows."""
    bench = _load("layers")
    for family in bench.FAMILIES:
        args = bench.inputs(family, 4, 64, torch.float32, device)
        impls = bench.implementations(family)
        out = bench.check(family, impls["ours"], args, args)
        bench.check(family, impls["torch"], args, args)
        grads = bench.backward_call(family, bench.ours(family), args)()
        assert [g.shape for g in grads] == [a.shape for a in args][:len(grads)] and grads
        assert bench.moved_bytes(args, out, True) > bench.moved_bytes(args, out, False) > 0
    wrong = bench._peers.Impl(lambda x: torch.softmax(x, dim=0))
    args = bench.inputs("softmax", 4, 64, torch.float32, device)
    with pytest.raises(AssertionError, match="softmax"):
        bench.check("softmax", wrong, args, args)
    row = {"family": "softmax", "tokens": 4, "hidden": 64, "dtype": "float16",
           "gbps": {"ours fwd": 900.0, "torch fwd": 1000.0, "liger fwd": 800.0}}
    table = bench.markdown([row], "header")
    assert "| softmax | 4×64 | float16 | fwd | 900 | 1000 | 800 | - | 0.90 | 1.12 |" in table
    (plot,) = bench.plot_benchmarks([row])
    assert plot.x_vals == ["softmax 4x64"] and plot.plot_name == "layers-float16-fwd"
    assert bench.measured([row])("softmax 4x64", "torch", "float16", "fwd") == 1000.0


def test_layers_bench_times_in_rounds(monkeypatch, device):
    """``--rounds N``: every implementation is checked once, then timed N times in turns
    (ours, torch, ours, torch, ...), and the row keeps the median and the range."""
    bench = _load("layers")
    timed = []

    def fake_timed(row, key, fn, flops, cudagraph):
        fn()
        timed.append(key)
        row["ms"][key] = {1: 2.0, 2: 1.0, 3: 9.0}[sum(k == key for k in timed)]

    monkeypatch.setattr(bench._common, "timed", fake_timed)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    every = bench.implementations  # the peers, where installed, are left out here
    monkeypatch.setattr(bench, "implementations", lambda family: {
        k: v for k, v in every(family).items() if k in ("ours", "torch")})
    args = types.SimpleNamespace(backward=True, cudagraph=False, rounds=3)
    row = bench.bench_row("softmax", 4, 64, torch.float32, args, device=str(device))
    keys = ["ours fwd", "ours bwd", "torch fwd", "torch bwd"]
    assert timed == keys * 3 and not row["error"]
    assert all(row["ms"][k] == 2.0 and row["spread"][k] == (1.0, 9.0) for k in keys)
    assert row["gbps"]["ours fwd"] == row["gbps"]["torch fwd"] > 0


def test_flash_bench_rows_by_sequence_length():
    bench = _load("flash_attn")
    every = bench.rows(False)
    assert len(every) == len(bench.SHAPES) * len(bench.DIMS) * 2
    short = bench.rows(False, {1024})
    assert short and {r[2] for r in short} == {1024} and set(short) < set(every)
    assert bench.rows(True, {1024}) == bench.QUICK  # --quick wins


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit on a machine without a GPU")
@pytest.mark.parametrize("script,tests", [("matmul", "tests/test_matmul.py"),
                                          ("flash_attn", "tests/test_flash_attn.py")])
def test_benches_exit_with_the_reason_without_a_gpu(script, tests, command_lines):
    """Without a CUDA GPU a bench exits non-zero, saying why and what to run instead."""
    proc = command_lines[0][script, "quick"]
    assert proc.returncode != 0
    assert f"bench/{script}.py measures NVIDIA GPUs" in proc.stderr and tests in proc.stderr


def test_matmul_bench_cold_rotates_operand_copies(command_lines):
    bench = _load("matmul")
    copies = [(i, -i) for i in range(3)]
    fn = bench.rotating(lambda a, b: (a, b), copies)
    assert [fn() for _ in range(5)] == [copies[0], copies[1], copies[2], copies[0], copies[1]]
    proc = command_lines[0]["matmul", "cold"]
    assert proc.returncode == 2 and "--cold needs --cudagraph" in proc.stderr


def test_bench_dtype_option_names_the_choices():
    common = _load("_common")
    assert common.dtypes("fp16, bf16") == [torch.float16, torch.bfloat16]
    with pytest.raises(SystemExit, match="unknown fp8; choose among fp16, bf16"):
        common.dtypes("fp16,fp8")


def test_autotuner_timer_falls_back_when_capture_fails(monkeypatch):
    calls = []

    def graph_bench(fn, quantiles=None):
        raise RuntimeError("operation not permitted when stream is capturing")

    def plain_bench(fn, quantiles=None):
        fn()
        calls.append("do_bench")
        return [1.0, 1.0, 1.0]

    monkeypatch.setattr(launch, "_graph_replays", graph_bench)
    monkeypatch.setattr(launch.triton.testing, "do_bench", plain_bench)
    ran = []
    assert launch._bench_replayed(lambda: ran.append(1), quantiles=(0.5,)) == [1.0, 1.0, 1.0]
    assert calls == ["do_bench"] and len(ran) == 2  # a first call outside any capture, then do_bench's


def test_autotuner_timer_lets_compile_errors_through(monkeypatch):
    """The first call runs outside the timers, so a config that fails to compile raises
    what the autotuner catches (it marks the config infinitely slow)."""
    monkeypatch.setattr(launch, "_graph_replays",
                        lambda fn, quantiles=None: pytest.fail("timed a failing config"))

    def failing():
        raise ValueError("out of resources")

    with pytest.raises(ValueError, match="out of resources"):
        launch._bench_replayed(failing)


def test_benches_report_the_config_of_each_problem(device, gen):
    """The benches ask the plan which config a problem runs with (a tuned problem skips the
    autotuner, whose own best_config may be another problem's)."""
    from portable_kernels import dispatch
    from portable_kernels.kernels import flash_attn as fa
    from portable_kernels.kernels import matmul as mm

    bench_mm = _load("matmul")
    a = torch.randn(64, 32, generator=gen).half().to(device)
    b = torch.randn(32, 48, generator=gen).half().to(device)
    with pk.use_variant(matmul="generic"):
        base = dispatch._launch_plan(pk.explain("matmul", a, b))
    plan = pk.LaunchPlan(base.variant, base.device, base.configs[:1], base.switches)
    assert bench_mm.best_config(plan, a, b) == ""  # not launched yet
    mm.launch(plan, a, b)
    cfg = plan.configs[0]
    assert bench_mm.best_config(plan, a, b).startswith(f"BLOCK_SIZE_M: {cfg.kwargs['BLOCK_SIZE_M']}")
    assert bench_mm.best_config(plan, a[:32], b) == ""  # another problem

    if "nvidia.hopper" not in pk.list_variants("flash_attn", device):
        pytest.skip(f"nvidia.hopper cannot run on {pk.device_info(device).name}")
    bench_fa = _load("flash_attn")
    q = torch.randn(1, 2, 40, 64, generator=gen).half().to(device)
    with pk.use_variant(flash_attn="nvidia.hopper"):
        base = pk.get_kernel("flash_attn").plan(q, q, q)
    plan = pk.LaunchPlan(base.variant, base.device, base.configs[:1], base.switches)
    fa.launch(plan, q, q, q, causal=True)
    record = bench_fa.tuning_record(plan, q, q, True, None)
    assert f"BLOCK_M: {plan.configs[0].kwargs['BLOCK_M']}" in record["best"]
    assert bench_fa.tuning_record(plan, q, q, False, None)["best"] == ""  # not launched


def _matmul_row(m, n, k, dtype, **tflops):
    return {"M": m, "N": n, "K": k, "dtype": dtype, "tflops": tflops, "error": {}}


def test_matmul_plots_square_sizes_and_m_per_llm_shape():
    """One plot of the square sizes and one per (N, K), per dtype; 4096^3 is on both; each
    line's points are the row's TFLOP/s, and NaN (a gap) where a method has no time."""
    bench = _load("matmul")
    rows = [_matmul_row(1024, 1024, 1024, "float16", cublas=100.0, generic=90.0),
            _matmul_row(4096, 4096, 4096, "float16", cublas=700.0, generic=650.0),
            _matmul_row(16, 4096, 4096, "float16", cublas=20.0, generic=21.0),
            _matmul_row(128, 4096, 4096, "float16", cublas=150.0),
            _matmul_row(16, 4096, 4096, "bfloat16", cublas=19.0, generic=18.0)]
    plots = {b.plot_name: b for b in bench.plot_benchmarks(rows)}
    assert set(plots) == {"matmul-square-float16", "matmul-float16-N4096-K4096",
                          "matmul-bfloat16-N4096-K4096"}
    assert plots["matmul-square-float16"].x_vals == [1024, 4096]
    assert plots["matmul-float16-N4096-K4096"].x_vals == [16, 128, 4096]
    assert plots["matmul-float16-N4096-K4096"].line_vals == ["cublas", "generic"]
    tflops = bench.measured(rows)
    assert tflops(provider="generic", dtype="float16", size=4096) == 650.0
    assert tflops(provider="generic", dtype="float16", M=16, N=4096, K=4096) == 21.0
    assert tflops(provider="generic", dtype="bfloat16", M=16, N=4096, K=4096) == 18.0
    nan = tflops(provider="generic", dtype="float16", M=128, N=4096, K=4096)
    assert nan != nan


def test_flash_plots_per_pass_dtype_dim_and_mask():
    bench = _load("flash_attn")

    def row(n, d, causal, fwd, bwd):
        return {"B": 4, "H": 32, "N": n, "D": d, "causal": causal, "dtype": "float16",
                "tflops": {"fwd": fwd, "bwd": bwd}, "error": {}}

    rows = [row(1024, 128, False, {"cudnn": 500.0, "hopper": 400.0}, {"cudnn": 300.0}),
            row(4096, 128, False, {"cudnn": 580.0, "hopper": 490.0}, {"cudnn": 500.0, "hopper": 390.0})]
    plots = {b.plot_name: b for b in bench.plot_benchmarks(rows)}
    assert set(plots) == {"flash_attn-fwd-float16-d128-full", "flash_attn-bwd-float16-d128-full"}
    assert plots["flash_attn-fwd-float16-d128-full"].x_vals == [1024, 4096]
    assert plots["flash_attn-bwd-float16-d128-full"].line_vals == ["cudnn", "hopper"]
    tflops = bench.measured(rows)
    assert tflops(provider="hopper", p="bwd", dtype="float16", D=128, causal=False, N=4096) == 390.0
    gap = tflops(provider="hopper", p="bwd", dtype="float16", D=128, causal=False, N=1024)
    assert gap != gap


def test_plots_say_what_perf_report_lacks(tmp_path, monkeypatch):
    common = _load("_common")
    monkeypatch.setattr(common, "plot_missing", lambda: "pandas")
    message = common.save_plots(tmp_path / "plots", [object()], lambda **kw: 0.0)
    assert "needs pandas" in message and not (tmp_path / "plots").exists()


@pytest.mark.skipif(bool(_load("_common").plot_missing()),
                    reason="triton.testing.perf_report needs pandas and matplotlib, not installed here")
def test_plots_drawn_through_perf_report(tmp_path):
    """The run's own numbers end up in perf_report's table beside the drawing."""
    bench = _load("matmul")
    rows = [_matmul_row(16, 4096, 4096, "float16", cublas=20.0, generic=21.5),
            _matmul_row(128, 4096, 4096, "float16", cublas=150.0, generic=140.0)]
    message = bench._common.save_plots(tmp_path, bench.plot_benchmarks(rows), bench.measured(rows))
    assert "plots: 1" in message
    assert (tmp_path / "matmul-float16-N4096-K4096.png").stat().st_size > 0
    csv = (tmp_path / "matmul-float16-N4096-K4096.csv").read_text().splitlines()
    assert csv[0].split(",")[0] == "M"
    assert [float(v) for v in csv[1].split(",")] == [16, 20.0, 21.5]
    assert [float(v) for v in csv[2].split(",")] == [128, 150.0, 140.0]


def test_host_per_call_rebuilds_plans_for_each_setting(monkeypatch, device):
    """Each pass of bench/host_per_call.py sets PK_DIRECT_LAUNCH, PK_C_LAUNCHER and
    PK_REPLAY and drops the plans (and recorded calls), so the calls it times run on plans
    built under that setting."""
    bench = _load("host_per_call")
    x = torch.randn(64, device=device)
    handle = pk.get_kernel("vector_add")
    seen = []

    def cases():
        def ours():
            handle(x, x)
            seen.append((os.environ.get("PK_DIRECT_LAUNCH"), os.environ.get("PK_REPLAY"),
                         handle.plan(x, x)))
        return {"vector_add": {"ours": ours, "torch": lambda: x + x}}

    monkeypatch.setattr(bench, "cases", cases)
    monkeypatch.setattr(bench._common, "per_call_us", lambda fn, iters: (fn(), 1.0)[1])
    monkeypatch.delenv("PK_DIRECT_LAUNCH", raising=False)
    handle(x, x)
    before = handle.plan(x, x)
    monkeypatch.delenv("PK_C_LAUNCHER", raising=False)
    monkeypatch.delenv("PK_REPLAY", raising=False)
    results = [bench.measure(1, env) for env in bench.SETTINGS.values()]
    assert results[0] == {"vector_add": {"ours": 1.0, "torch": 1.0}}
    assert [(direct, replay) for direct, replay, _ in seen] == [
        ("1", "direct"), ("1", "0"), ("1", "direct"), ("0", "direct")]
    plans = [plan for *_, plan in seen]
    assert plans[0] is not before and all(b is not a for a, b in zip(plans, plans[1:]))
    # Nothing of the last pass outlives it: neither the variables nor plans built under
    # them (they would keep later calls of the process off direct launches).
    assert not {"PK_DIRECT_LAUNCH", "PK_C_LAUNCHER", "PK_REPLAY"} & os.environ.keys()
    after = handle.plan(x, x)
    assert after is not plans[-1]


def test_host_per_call_keeps_the_rounds_it_finished(monkeypatch, tmp_path, device):
    """A run cut short (a device call's time limit) leaves the table of its finished
    rounds: host_per_call writes JSON and Markdown after every round. The untimed pass of
    every setting before the rounds is in none of them."""
    bench = _load("host_per_call")
    passes = iter(range(100))
    settings = len(bench.SETTINGS)

    def measure(iters, env):
        n = next(passes)
        if n == 2 * settings:  # the second round's first pass: cut short
            raise KeyboardInterrupt
        return {"vector_add": {"ours": 10.0 + n, "torch": 5.0}}

    monkeypatch.setattr(bench, "measure", measure)
    monkeypatch.setattr(bench._common, "nvidia_gpu", lambda *a: pk.device_info(device))
    monkeypatch.setattr(sys, "argv", ["host_per_call.py", "--rounds", "2", "--json",
                                      str(tmp_path / "host.json")])
    with pytest.raises(KeyboardInterrupt):
        bench.main()
    saved = json.loads((tmp_path / "host.json").read_text())
    first = 10.0 + settings  # the first round's first pass
    assert saved["rounds"] == 1 and saved["rows"][0]["direct"] == first
    assert saved["rows"][0]["jit"] == first + list(bench.SETTINGS).index("jit")
    assert f"| vector_add | {first:.1f} |" in (tmp_path / "host.md").read_text()


@pytest.mark.parametrize("script", ["flash_attn", "matmul"])
def test_declined_variants_read_n_a_not_error(script):
    """A variant that declines a row (too few tiles or keys) is listed with its reason and
    shows as n/a, apart from wrong results and failures."""
    bench = _load(script)
    if script == "flash_attn":
        row = {"tflops": {"fwd": {}}, "error": {"gluon": "not timed: Nk is below MIN_KEYS",
                                                 "hopper": "WRONG: out", "generic": "RuntimeError: x"}}
        cells = [bench.cell(row, "fwd", name) for name in ("gluon", "hopper", "generic")]
    else:
        cells = [bench._failure(e) for e in ("not timed: fewer than MIN_TILES", "WRONG: x",
                                             "RuntimeError: x")]
    assert cells == ["n/a", "WRONG", "error"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit on a machine without a GPU")
def test_host_backward_exits_with_the_reason_without_a_gpu(command_lines):
    proc = command_lines[0]["host_backward", "rounds"]
    assert proc.returncode != 0 and "bench/host_backward.py measures NVIDIA GPUs" in proc.stderr


def test_host_backward_hands_each_call_to_one_helper_thread():
    import threading

    bench = _load("host_backward")
    helper, seen = bench.Helper(), []
    for i in range(3):
        helper(lambda i=i: seen.append((i, threading.get_ident())))
        assert len(seen) == i + 1  # the caller waited for the call
    threads = {ident for _, ident in seen}
    assert [i for i, _ in seen] == [0, 1, 2] and len(threads) == 1
    assert threading.get_ident() not in threads
    with pytest.raises(ZeroDivisionError):  # raised to the caller; the thread lives on
        helper(lambda: 1 / 0)
    helper(lambda: seen.append(("after", threading.get_ident())))
    assert seen[-1][1] in threads


def test_host_backward_rounds_rotate_the_order():
    bench = _load("host_backward")
    names = ["a", "b", "c", "d"]
    orders = [bench.rotated(names, r) for r in range(4)]
    assert all(sorted(o) == names for o in orders)
    assert len({tuple(o) for o in orders}) == 4


def test_host_backward_cases_run(device):
    """Every case runs once (on the CPU: the interpreter, no cuDNN case), and the no-op case
    puts the backward stage back."""
    bench = _load("host_backward")
    table = bench.cases((1, 2, 64, 16), torch.float16, True, "generic", device=device.type)
    assert ("cuDNN SDPA, grad" in table) == (device.type == "cuda")
    from portable_kernels.kernels import flash_attn as fa
    stage = fa._run_stage
    for name, fn in table.items():
        fn()
    assert fa._run_stage is stage
    assert len(table) == 11 + (device.type == "cuda")


def test_host_backward_layer_norm_cases_run(device):
    """``--family layer_norm``: every case runs, and ours gives torch's gradients (the
    pieces time what the row computes)."""
    bench = _load("host_backward")
    table = bench.layer_norm_cases((4, 64), torch.float32, device=device.type)
    for fn in table.values():
        fn()
    ours, theirs = table["ours, forward and grad"](), table["torch, forward and grad"]()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert len(table) == 11


def test_breakdown_sorts_a_steps_kernels_by_kind_and_bounds_a_patch():
    """transformers_model's --breakdown: cuDNN's attention is attention though its name
    says sm90 (attention is matched first), cuBLAS/nvjet and our matmul are products, the
    rest is other; the bound is the unpatched step less its other kernels."""
    bench = _load("transformers_model")
    b = bench.breakdown([("sm90_xmma_gemm_bf16bf16", 20.0, 5), ("nvjet_tst_128x256", 10.0, 3),
                         ("cudnn_generated_fort_native_sdpa_sm90_flash", 4.0, 8),
                         ("_flash_attn_fwd_kernel", 1.0, 8), ("_matmul_kernel", 2.0, 1),
                         ("_rms_norm_fwd", 3.0, 17), ("void at::native::elementwise", 5.0, 40)])
    assert b == {"attention": 5.0, "matmul": 32.0, "other": 8.0, "sum": 45.0}
    meta = {"model": "m", "device": "d", "torch": "t", "triton": "x", "transformers": "y",
            "batch": 1, "seq": 2}
    rows = [{"dtype": "bf16", "impl": "unpatched (SDPA)", "loss": 1.0, "ms": 50.0, "tok_s": 1.0,
             "peak_gib": 1.0, "breakdown": b}]
    text = bench.patched_markdown(rows, meta)
    assert "| unpatched (SDPA) | 32.00 | 5.00 | 8.00 | 45.00 | 50.00 |" in text
    assert "42.00 ms, 1.19x the unpatched step" in text


def test_memory_trace_groups_what_is_live_at_the_peak():
    """transformers_model's --memory-trace: a trace's allocations and frees replayed to the
    largest total; blocks freed before it, or allocated after it, are not in the groups."""
    bench = _load("transformers_model")
    ours = [{"filename": "/x/site-packages/torch/functional.py", "line": 1, "name": "mm"},
            {"filename": "/w/portable_kernels/kernels/fused.py", "line": 7, "name": "_chunks"}]
    model = [{"filename": "/x/site-packages/transformers/models/llama.py", "line": 3,
              "name": "forward"}]
    mib = 2**20

    def alloc(addr, size, frames):
        return {"action": "alloc", "addr": addr, "size": size * mib, "frames": frames}

    trace = [alloc(1, 10, model), alloc(2, 4, ours),
             {"action": "free_requested", "addr": 2, "size": 4 * mib},
             alloc(3, 4, ours), alloc(4, 4, ours), alloc(5, 1, []),       # the peak: 23 MiB
             {"action": "free_requested", "addr": 4, "size": 4 * mib},
             {"action": "free_completed", "addr": 4, "size": 4 * mib},
             alloc(6, 2, model)]                                          # 21 MiB: after it
    assert bench.peak_groups(trace, 5) == [
        ("transformers/models/llama.py:3 forward", 10.0, 1),
        ("/w/portable_kernels/kernels/fused.py:7 _chunks", 8.0, 2),
        ("?", 1.0, 1)]
    assert bench.peak_groups(trace, 1) == [("transformers/models/llama.py:3 forward", 10.0, 1)]
