"""The example third-party backend (examples/acme-backend) installs, loads through the
``portable_kernels`` entry point, and passes conformance.

It is installed with pip into a temporary directory (``--target``), never into the test
environment: subprocesses see it through ``PYTHONPATH``, entry point included (its
``.dist-info`` lies next to the package). pip builds it offline (``--no-index``, no build
isolation, no dependencies), so this works on a CI machine whatever its network.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from portable_kernels.conformance import report

from conftest import DEVICE

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "acme-backend"
VARIANT = "acme.vector_add_wide"
OWN_KERNEL = "acme.grid_stride"  # a kernel the plugin ships itself (acme_pk_backend/kernels.py)


@pytest.fixture(scope="module")
def acme_env(tmp_path_factory) -> dict:
    """Environment variables under which the example is installed."""
    if not EXAMPLE.is_dir():
        pytest.fail(f"the example plugin is missing: {EXAMPLE}")
    work = tmp_path_factory.mktemp("acme")
    # Build from a copy, so that the checkout gets no build/ or .egg-info directories.
    src = shutil.copytree(EXAMPLE, work / "src", ignore=shutil.ignore_patterns("build", "*.egg-info"))
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(work / "site"), str(src)],
        capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and "No module named pip" in proc.stderr:
        pytest.skip("pip is not available in this environment")
    assert proc.returncode == 0, f"pip could not install the example:\n{proc.stdout}\n{proc.stderr}"
    path = os.pathsep.join(filter(None, [str(work / "site"), os.environ.get("PYTHONPATH", "")]))
    # PK_PLUGINS and PK_VARIANT from the caller's environment would change what this checks.
    return {"PYTHONPATH": path, "PK_PLUGINS": "", "PK_VARIANT": "", "PK_EMULATE": ""}


def run(env: dict, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "portable_kernels.cli", *argv], capture_output=True,
                          text=True, env=dict(os.environ, **env), timeout=600)


def test_info_lists_the_plugin(acme_env):
    proc = run(acme_env, "info", "--device", str(DEVICE), "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    plugins = {p["name"]: p["source"] for p in info["plugins"]}
    assert "acme" in plugins and "acme-pk-backend 0.1.0" in plugins["acme"]
    assert not [f for f in info["failed_plugins"] if f["plugin"] == "acme"]
    vector_add = next(k for k in info["kernels"] if k["kernel"] == "vector_add")
    assert VARIANT in vector_add["runnable"] and vector_add["variant"] != VARIANT  # not preferred here
    proc = run(acme_env, "info", "--device", str(DEVICE))
    assert proc.returncode == 0 and "acme" in proc.stdout


def test_selected_on_its_own_hardware(acme_env):
    proc = run(dict(acme_env, PK_EMULATE="acme1"), "explain", "vector_add", "--device", str(DEVICE), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["variant"] == VARIANT


def test_conformance_runs_its_variant_and_passes(acme_env, tmp_path):
    proc = run(acme_env, "conformance", "--device", str(DEVICE), "--kernels", "vector_add",
               "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = report.load(tmp_path / "r.json")
    for variant in (VARIANT, OWN_KERNEL):
        mine = [c for c in rep["cases"] if c["variant"] == variant]
        assert mine and {c["outcome"] for c in mine} == {"pass"} and {c["plugin"] for c in mine} == {"acme"}
        assert {s.id for s in _suite().shapes} == {c["shape"] for c in mine}  # the full suite, not --quick
        assert any(line.split()[:2] == ["vector_add", variant] and "pass" in line
                   for line in proc.stdout.splitlines())


def test_conformance_of_one_backend(acme_env, tmp_path):
    proc = run(acme_env, "conformance", "--device", str(DEVICE), "--backend", "acme", "--quick",
               "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = report.load(tmp_path / "r.json")
    assert {(c["kernel"], c["variant"]) for c in rep["cases"]} == {("vector_add", VARIANT),
                                                                   ("vector_add", OWN_KERNEL)}
    assert rep["options"]["backend"] == "acme"


def test_own_kernel_compiles_for_every_conformance_case(acme_env):
    """ACME's kernel compiled for sm_90 (no GPU needed) the way Triton's JIT specializes
    each conformance case's arguments. The interpreter specializes nothing, so a kernel
    that breaks on a specialization passes every CPU case: the grid-stride kernel took its
    grid size as an argument, which Triton compiles as a constant where it is 1 (every
    one-program case), and failed to compile on the H200 in those cases only."""
    code = (
        "import sys, os, json; sys.path.insert(0, 'ci'); import compile_matrix as cm, torch\n"
        "from triton.runtime import jit\n"
        "from portable_kernels import plugins\n"
        "from portable_kernels.conformance.test_vector_add import SUITE\n"
        "host = plugins.host(); dev = host.emulation_profile('h200')\n"
        "c = cm.Compiler(dev.shared_memory, target=cm.TARGETS['sm_90'])\n"
        "jit.JITFunction.run = lambda self, *a, grid, warmup, **kw: c.run(self, a, kw)\n"
        f"plan = cm.plans(host, dev, 'vector_add', {OWN_KERNEL!r})[0]\n"
        "for shape in SUITE.shapes:\n"
        "    for dtype in SUITE.dtypes:\n"
        "        c.case = f'{shape.id}/{dtype}'\n"
        "        x, y = SUITE.make_inputs(shape, dtype, 'cpu', torch.Generator().manual_seed(0)).args\n"
        "        plan.variant.launch(plan, x, y)\n"
        "print(json.dumps([[r.case, r.error] for r in c.rows])); sys.stdout.flush(); os._exit(0)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=EXAMPLE.parent.parent, capture_output=True,
                          text=True, env=dict(os.environ, **acme_env), timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout.splitlines()[-1])
    # n0 launches nothing; every other case compiles.
    launched = [s for s in _suite().shapes if s.id != "n0"]
    assert len(rows) == len(launched) * len(_suite().dtypes), rows
    failed = [f"{case}: {error}" for case, error in rows if error]
    assert not failed, f"{len(failed)} of {len(rows)} failed to compile:\n" + "\n".join(failed)


def _suite():
    from portable_kernels.conformance import test_vector_add

    return test_vector_add.SUITE
