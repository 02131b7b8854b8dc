"""The sm_90 (Hopper) slice of ``ci/compile_matrix.py``: every NVIDIA sm_90 tuning config
of the heavy families compiled with Triton's own ptxas, no GPU needed.

    python ci/sm90_compile.py [--quick] [--families flash_attn,matmul] [--markdown OUT]

is ``python ci/compile_matrix.py --targets sm_90 --families matmul,grouped_matmul,flash_attn``
with the same options. ``Compiler`` is re-exported for the tests that compile a control
kernel for sm_90 (``tests/test_ci_memcheck.py``, ``tests/test_ci_racecheck.py``).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compile_matrix  # noqa: E402  (turns the interpreter off before Triton loads)
from compile_matrix import Compiler, Row  # noqa: E402,F401

HEAVY = "matmul,grouped_matmul,flash_attn"


def main(argv: list[str]) -> int:
    if not any(a == "--families" or a.startswith("--families=") for a in argv):
        argv = [*argv, "--families", HEAVY]
    return compile_matrix.main(["--targets", "sm_90", *argv])


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)
