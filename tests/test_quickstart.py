"""README's main job: examples/quickstart.py runs every headline kernel and checks it."""
from __future__ import annotations

import pathlib
import subprocess
import sys

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
QUICKSTART = EXAMPLES / "quickstart.py"


def test_quickstart_runs_and_checks_itself():
    proc = subprocess.run([sys.executable, str(QUICKSTART)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for kernel in ("vector_add", "softmax", "layer_norm", "matmul", "flash_attn"):
        assert kernel in proc.stdout


def test_serving_example_runs_and_checks_itself():
    """examples/serving.py: prefill, cache writes and decode steps, each checked in float64."""
    proc = subprocess.run([sys.executable, str(EXAMPLES / "serving.py")], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "prefill" in proc.stdout and proc.stdout.count("decode   step") == 4
