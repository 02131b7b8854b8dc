"""``ci/racecheck_control.py``, checked where it can be: compiled for sm_90 on any machine.

On the H200 racecheck reported a hazard at Triton's partition dispatch in the control's
builds whose default partition passes a barrier of its own (``--smem``) and in none of the
others (docs/conformance.md). These tests keep the builds what that finding describes, so
that a later Triton which changes them shows up here rather than as a silently different
sanitizer run.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PARTITION_BARRIER = re.compile(r"bar\.sync\s+\d+,\s*128;")  # one 4-warp partition's barrier

_COMPILE = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, "ci")
    import sm90_compile as sc
    import torch
    from triton.runtime import jit
    import racecheck_control as rc

    compiler = sc.Compiler(232448, keep_ptx=True)
    jit.JITFunction.run = lambda self, *a, grid, warmup, **kw: compiler.run(self, a, kw)
    builds = {}
    for workers, smem in (((4, 1), False), ((4, 1), True), ((1,), True), ((4,), False)):
        out = torch.empty(rc.PROGRAMS, 3, 32 * rc.DEFAULT_WARPS, dtype=torch.int32)
        rc.launch(out, workers, 0, smem)
        row = compiler.rows[-1]
        builds[f"{workers} smem={smem}"] = [row.error, row.ptx]
    print(json.dumps(builds))
""")


@pytest.fixture(scope="module")
def builds() -> dict[str, tuple[str, str]]:
    """(error, PTX) of four builds of the control, compiled for sm_90 in a fresh process
    (``ci/sm90_compile.py`` turns the interpreter off before Triton loads)."""
    done = subprocess.run([sys.executable, "-c", _COMPILE], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return {k: tuple(v) for k, v in json.loads(done.stdout.splitlines()[-1]).items()}


def test_every_build_compiles_with_the_dispatch_barrier(builds):
    for name, (error, ptx) in builds.items():
        assert error == "", f"{name}: {error}"
        # The CTA-wide barrier between the dispatch bytes' writes and reads.
        assert re.search(r"barrier\.sync\s+1;", ptx), name


def test_only_the_smem_builds_have_a_partition_barrier(builds):
    """The condition racecheck's report followed: warps that passed a barrier of their
    partition (``--smem``) next to warps that did not."""
    for name, (_, ptx) in builds.items():
        assert bool(PARTITION_BARRIER.search(ptx)) == ("smem=True" in name), name


def test_cli_rejects_a_worker_count_it_cannot_build(monkeypatch, capsys):
    sys.path.insert(0, str(ROOT / "ci"))
    try:
        import racecheck_control
    finally:
        sys.path.remove(str(ROOT / "ci"))
    monkeypatch.setattr(sys, "argv", ["racecheck_control.py", "--workers", "2"])
    with pytest.raises(SystemExit):
        racecheck_control.main()
    assert "one or two counts of 1 or 4" in capsys.readouterr().err
