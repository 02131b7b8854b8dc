"""``ci/memcheck-cuda.sh`` and its pytest plugin, checked where they can be: on any machine.

The script itself needs a CUDA GPU and compute-sanitizer (docs/conformance.md has its
results); here: the plugin's changes to the autotuner and to CUDA-graph capture, and that
the script's default test files exist.
"""
from __future__ import annotations

import importlib.util
import re
import subprocess
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
