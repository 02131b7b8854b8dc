"""README's main job: examples/quickstart.py runs every headline kernel and checks it."""
from __future__ import annotations

import pathlib
import subprocess
import sys

QUICKSTART = pathlib.Path(__file__).resolve().parent.parent / "examples" / "quickstart.py"


def test_quickstart_runs_and_checks_itself():
    proc = subprocess.run([sys.executable, str(QUICKSTART)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for kernel in ("vector_add", "softmax", "layer_norm", "matmul", "flash_attn"):
        assert kernel in proc.stdout
