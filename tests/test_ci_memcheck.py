"""``ci/memcheck-cuda.sh`` and its pytest plugin, checked where they can be: on any machine.

The script itself needs a CUDA GPU and compute-sanitizer (docs/conformance.md has its
results); here: the plugin's changes to the autotuner and to CUDA-graph capture, that the
script's default test files exist, and the script's verdicts, with a stand-in sanitizer.
"""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from triton.runtime.autotuner import Autotuner

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "ci" / "memcheck-cuda.sh"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "ci" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def plugin(monkeypatch):
    """The plugin, configured; what it patches is restored after the test."""
    monkeypatch.setattr(Autotuner, "do_bench", Autotuner.__dict__["do_bench"])
    monkeypatch.setattr(torch.cuda.graph, "__enter__", torch.cuda.graph.__enter__)
    monkeypatch.setattr(torch.cuda, "_sleep", torch.cuda._sleep)
    module = _load("memcheck_plugin")
    module.pytest_configure(None)
    return module


def _tuner(own_timer=None) -> Autotuner:
    tuner = object.__new__(Autotuner)  # only do_bench is read
    tuner._do_bench = own_timer
    return tuner


def test_autotuner_launches_each_config_once(plugin):
    tuner = _tuner()
    tuner.__dict__["do_bench"] = "a benchmarker cached before the plugin was configured"
    calls = []
    assert tuner.do_bench(lambda: calls.append(1), quantiles=(0.5, 0.2, 0.8)) == [1.0] * 3
    assert tuner.do_bench(lambda: calls.append(2)) == 1.0
    assert calls == [1, 2]


def test_a_test_s_own_timer_is_kept(plugin):
    def own(fn, quantiles=None):
        return [7.0] * 3

    assert _tuner(own).do_bench is own


def test_graph_capture_and_sleep_skip_with_a_reason(plugin):
    with pytest.raises(pytest.skip.Exception, match="CUDA graph"):
        torch.cuda.graph.__enter__(object())
    with pytest.raises(pytest.skip.Exception, match="spinning kernel"):
        torch.cuda._sleep(1000)


def test_script_parses_and_its_default_files_exist():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text()
    block = text[text.index("set -- "):text.index("\nfi", text.index("set -- "))]
    files = re.findall(r"tests/\S+\.py", block)
    assert len(files) >= 10, block
    missing = [f for f in files if not (ROOT / f).is_file()]
    assert not missing, f"ci/memcheck-cuda.sh names test files that do not exist: {missing}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the control overruns its tensors on a GPU: "
                    "it is run under memcheck only (ci/memcheck-cuda.sh)")
def test_control_refuses_to_run_without_a_gpu():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        _load("memcheck_control").main()


def test_tma_control_overruns_through_the_copy_engine():
    """``memcheck_control.py --tma`` must read past its tensor with a TMA copy, not with
    pointer loads, or its verdict (docs/conformance.md: memcheck does not report it) would
    say nothing about the descriptor kernels. Compiled for sm_90 with Triton's ptxas in a
    fresh process (``ci/sm90_compile.py`` turns the interpreter off before Triton loads)."""
    code = textwrap.dedent("""
        import sys
        sys.path.insert(0, "ci")
        import sm90_compile as sc
        import torch
        from triton.runtime import jit
        from triton.tools.tensor_descriptor import TensorDescriptor
        import memcheck_control as mc

        compiler = sc.Compiler(232448, keep_ptx=True)
        jit.JITFunction.run = lambda self, *a, grid, warmup, **kw: compiler.run(self, a, kw)
        src = torch.empty(mc.TMA_ROWS, mc.TMA_COLS, dtype=torch.float16)
        desc = TensorDescriptor(src, [2 * mc.TMA_ROWS, mc.TMA_COLS], [mc.TMA_COLS, 1],
                                [mc.TMA_ROWS, mc.TMA_COLS])
        mc._tma_overrun_kernel[(1,)](desc, src, ROWS=mc.TMA_ROWS, COLS=mc.TMA_COLS)
        print([row.error for row in compiler.rows])
        print("copy engine load:", "cp.async.bulk.tensor" in compiler.rows[0].ptx)
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "['']" in done.stdout and "copy engine load: True" in done.stdout, done.stdout


FAKE_SANITIZER = r"""#!/usr/bin/env bash
# Stands in for compute-sanitizer: prints what $FAKE says, runs nothing.
if [[ "$*" == *memcheck_control.py* ]]; then
  [[ $FAKE == control-missed ]] || echo "========= Invalid __global__ read of size 4 bytes"
  echo "========= ERROR SUMMARY: 1 error"
  exit 1
fi
[[ $FAKE == no-summary ]] && exit 0
if [[ $FAKE == overrun ]]; then
  echo "========= Invalid __global__ write of size 2 bytes"
  echo "=========     at _some_kernel+0x40 in some_kernel.py:12"
  echo "========= ERROR SUMMARY: 3 errors"
else
  echo "========= ERROR SUMMARY: 0 errors"
fi
echo "============ 5 passed in 1.00s ============"
"""


@pytest.mark.parametrize("fake, code", [("clean", 0), ("overrun", 1), ("control-missed", 2),
                                        ("no-summary", 2)])
def test_script_verdicts(fake, code, tmp_path):
    """The script passes only when the control's overrun was reported and the run's
    summary counts no error."""
    sanitizer = tmp_path / "compute-sanitizer"
    sanitizer.write_text(FAKE_SANITIZER)
    sanitizer.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "OUT": str(tmp_path / "out"),
           "COMPUTE_SANITIZER": str(sanitizer), "FAKE": fake}
    run = subprocess.run(["bash", str(SCRIPT), "tests/test_vector_add.py"], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    assert run.returncode == code, run.stdout + run.stderr
    if fake == "overrun":
        assert "Invalid __global__ write" in run.stdout and "3 sanitizer error(s)" in run.stdout
