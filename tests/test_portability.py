"""Device descriptions of the GPUs users buy today, what each selects and why, and the
compile matrix that checks those selections without the hardware (ci/compile_matrix.py).

Selection runs on the emulation profiles here, on any machine: kernels are not launched.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import portable_kernels as pk
from portable_kernels_backends import amd, nvidia

from conftest import DEVICE

ROOT = Path(__file__).resolve().parent.parent


# --- capability words per architecture -------------------------------------------------

@pytest.mark.parametrize("cc, has, lacks", [
    ((8, 0), {"mma", "bf16"}, {"fp8", "tensor_descriptor", "wgmma", "tcgen05", "warp_specialize"}),
    ((8, 9), {"bf16", "fp8"}, {"tensor_descriptor", "wgmma", "tcgen05"}),
    ((9, 0), {"fp8", "tensor_descriptor", "wgmma", "warp_specialize"}, {"tcgen05"}),
    # Datacenter Blackwell: tensor memory MMAs, no warpgroup MMA.
    ((10, 0), {"fp8", "tensor_descriptor", "tcgen05", "warp_specialize"}, {"wgmma"}),
    # Consumer Blackwell: TMA and fp8, but mma.sync from registers.
    ((12, 0), {"fp8", "tensor_descriptor"}, {"wgmma", "tcgen05", "warp_specialize"}),
])
def test_nvidia_words_follow_the_architecture(cc, has, lacks):
    caps = nvidia.capabilities(*cc)
    assert has <= caps, f"sm_{cc[0]}{cc[1]} lacks {sorted(has - caps)}"
    assert not lacks & caps, f"sm_{cc[0]}{cc[1]} wrongly has {sorted(lacks & caps)}"


@pytest.mark.parametrize("arch, has, lacks", [
    ("gfx90a", {"wave64", "bf16"}, {"fp8", "fp8_fnuz"}),
    ("gfx942", {"wave64", "fp8_fnuz"}, {"fp8"}),      # CDNA3: the fnuz encodings only
    ("gfx950", {"wave64", "fp8"}, {"fp8_fnuz"}),      # CDNA4: OCP, as NVIDIA
    ("gfx1100", {"bf16"}, {"wave64", "fp8", "fp8_fnuz"}),
])
def test_amd_words_follow_the_architecture(arch, has, lacks):
    caps = amd.capabilities(arch)
    assert has <= caps and not lacks & caps, (arch, sorted(caps))


@pytest.mark.parametrize("profile, arch, warp", [
    ("b200", "sm_100", 32), ("rtx5090", "sm_120", 32), ("l40s", "sm_89", 32),
    ("mi355x", "gfx950", 64), ("rx7900xtx", "gfx1100", 32),
])
def test_profiles_of_current_gpus(profile, arch, warp):
    with pk.emulate(profile):
        info = pk.device_info(DEVICE)
    assert (info.arch, info.warp_size, info.emulated) == (arch, warp, profile)
    assert info.shared_memory > 0 and info.num_sms > 0


# --- what each profile selects, and why ------------------------------------------------

SELECTED = {
    # profile: (matmul, grouped_matmul, flash_attn)
    "a100": ("generic", "generic", "generic"),
    "l40s": ("generic", "generic", "generic"),
    "h200": ("nvidia.hopper_gluon", "nvidia.tma", "nvidia.hopper_gluon"),
    "b200": ("nvidia.persistent_tma", "nvidia.tma", "nvidia.blackwell"),
    "rtx5090": ("generic", "generic", "generic"),
    "mi250x": ("generic", "generic", "amd.rocm"),
    "mi300x": ("generic", "generic", "amd.rocm"),
    "mi355x": ("generic", "generic", "amd.rocm"),
    "rx7900xtx": ("generic", "generic", "generic"),
}


@pytest.mark.parametrize("profile", sorted(SELECTED))
def test_each_profile_selects(profile):
    with pk.emulate(profile):
        got = tuple(pk.explain(k).variant for k in ("matmul", "grouped_matmul", "flash_attn"))
    assert got == SELECTED[profile]


def _verdict(sel, name):
    return next(v for v in sel.verdicts if v.name == name)


def test_blackwell_declines_the_hopper_kernels_with_reasons():
    with pk.emulate("b200"):
        attn, mm = pk.explain("flash_attn"), pk.explain("matmul")
    for sel in (attn, mm):
        gluon = _verdict(sel, "nvidia.hopper_gluon")
        assert not gluon.runnable and "wgmma" in gluon.reason
    # nvidia.hopper can still be forced there, but ranks under generic.
    hopper = _verdict(attn, "nvidia.hopper")
    assert hopper.runnable and hopper.priority < 0


def test_wave32_amd_leaves_the_cdna_variant():
    with pk.emulate("rx7900xtx"):
        rocm = _verdict(pk.explain("flash_attn"), "amd.rocm")
    assert rocm.runnable and rocm.priority < 0


# --- fp8 encodings ---------------------------------------------------------------------

def _fp8(dtype):
    a = torch.randn(32, 64, device=DEVICE).to(dtype)
    return a, torch.randn(64, 48, device=DEVICE).to(dtype).t().contiguous().t()


def test_gfx942_takes_fnuz_fp8():
    with pk.emulate("mi300x"):
        assert pk.explain("matmul", *_fp8(torch.float8_e4m3fnuz)).variant == "generic"
        assert pk.explain("grouped_matmul", *([t] for t in _fp8(torch.float8_e5m2fnuz))).variant == "generic"


@pytest.mark.parametrize("profile, given, named", [
    ("mi300x", torch.float8_e4m3fn, "float8_e4m3fnuz"),
    ("h100", torch.float8_e4m3fnuz, "float8_e4m3fn"),
    ("mi355x", torch.float8_e5m2fnuz, "float8_e4m3fn"),
])
def test_the_other_fp8_encoding_is_refused_with_the_conversion(profile, given, named):
    with pk.emulate(profile), pytest.raises(pk.DTypeError, match=rf"convert with \.to\(torch\.{named}\)"):
        pk.explain("matmul", *_fp8(given))


def test_fp8_where_there_is_none():
    with pk.emulate("rx7900xtx"), pytest.raises(pk.NoVariantError, match="need the fp8 capability"):
        pk.explain("matmul", *_fp8(torch.float8_e4m3fn))


# --- compiled, not run -----------------------------------------------------------------

@pytest.mark.parametrize("profile, arch", [("b200", "sm_100"), ("mi300x", "gfx942"),
                                           ("rx7900xtx", "gfx1100"), ("l40s", "sm_89")])
def test_compiled_only_architectures_say_so(profile, arch):
    with pk.emulate(profile):
        sel = pk.explain("softmax")
    assert sel.device.evidence == f"compiled for {arch} (ci/compile_matrix.py), not run"
    assert not sel.device.has_run
    assert f"on {arch}: compiled for {arch}" in str(sel)


def test_architectures_neither_compiled_nor_run_say_so():
    with pk.emulate("bi150"):  # Triton has no CoreX target here
        info = pk.device_info(DEVICE)
    assert info.evidence.startswith("not compiled or run") and not info.has_run


def test_run_architectures_say_so():
    with pk.emulate("h200"):
        assert pk.device_info(DEVICE).evidence.startswith("run: ")
    assert pk.device_info(DEVICE).has_run  # the interpreter (every test, in CI) or the H200


def test_cli_explain_and_info_show_the_evidence(monkeypatch):
    monkeypatch.setenv("PK_EMULATE", "mi355x")
    for cmd in (["explain", "flash_attn"], ["info"]):
        done = subprocess.run([sys.executable, "-m", "portable_kernels.cli", *cmd],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert "kernels on gfx950: compiled for gfx950 (ci/compile_matrix.py), not run" in done.stdout


def test_merged_report_marks_an_emulated_compiled_only_device():
    from portable_kernels.conformance import report

    dev = {"name": "AMD Instinct MI300X", "arch": "gfx942", "emulated": "mi300x",
           "evidence": "compiled for gfx942 (ci/compile_matrix.py), not run"}
    assert report._device_title({"device": dev}) == "AMD Instinct MI300X (gfx942, compiled, not run)"
    assert report._device_title({"device": {**dev, "emulated": None}}) == "AMD Instinct MI300X (gfx942)"
    corex = {"name": "Iluvatar BI-V150", "arch": "ivcore71", "emulated": "bi150",
             "evidence": "not compiled or run: V1/V2 were tested forced on the interpreter and an H200"}
    assert report._device_title({"device": corex}) == "Iluvatar BI-V150 (ivcore71, not run)"


# --- the compile matrix ----------------------------------------------------------------

def _in_fresh_process(code: str) -> subprocess.CompletedProcess:
    """``code`` run by a new Python in the repository root (ci/compile_matrix.py must turn
    the interpreter off before Triton loads, which this process has done already)."""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def test_compile_matrix_selects_what_dispatch_selects():
    code = (
        "import sys; sys.path.insert(0, 'ci'); import compile_matrix as cm, os\n"
        "from portable_kernels import plugins\n"
        "host = plugins.host()\n"
        "for t in cm.TARGETS.values():\n"
        "    dev = host.emulation_profile(t.profile)\n"
        "    print(t.name, dev.arch, cm.selected(host, dev, 'flash_attn'), cm.selected(host, dev, 'matmul'),"
        " ','.join(cm.selectable(host, dev, 'flash_attn')), [str(d) for d in cm.fp8_dtypes(dev, False)])\n"
        "os._exit(0)\n")
    done = _in_fresh_process(code)
    lines = {line.split()[0]: line.split(maxsplit=4)[1:] for line in done.stdout.splitlines()}
    assert set(lines) == {"sm_80", "sm_89", "sm_90", "sm_100", "sm_120", "gfx90a", "gfx942", "gfx950", "gfx1100"}
    for target, (arch, attn, mm, _) in lines.items():
        assert arch == target
    profile = {t: p for t, p in (("sm_100", "b200"), ("sm_90", "h200"), ("gfx942", "mi300x"), ("gfx1100", "rx7900xtx"))}
    for target, name in profile.items():
        assert tuple(lines[target][1:3]) == (SELECTED[name][2], SELECTED[name][0]), target
    # Variants ranked under generic are compiled only where they can be chosen.
    assert "nvidia.hopper" not in lines["sm_100"][3] and "amd.rocm" not in lines["sm_90"][3]
    assert "float8_e4m3fnuz" in lines["gfx942"][3] and "float8_e4m3fn'" in lines["gfx950"][3]


def test_compile_matrix_takes_forced_only_variants_when_asked():
    """--forced adds the variants ranked under generic (flash_attn_with_kvcache's
    nvidia.hopper on sm_90) to the cases, never to what dispatch is said to select."""
    code = (
        "import sys; sys.path.insert(0, 'ci'); import compile_matrix as cm, os\n"
        "from portable_kernels import plugins\n"
        "host = plugins.host(); dev = host.emulation_profile('h200'); k = 'flash_attn_with_kvcache'\n"
        "print(','.join(cm.selectable(host, dev, k)))\n"
        "cm.FORCED = True\n"
        "print(','.join(cm.selectable(host, dev, k)), cm.selected(host, dev, k))\n"
        "os._exit(0)\n")
    plain, forced = _in_fresh_process(code).stdout.split("\n")[:2]
    assert plain == "generic"
    assert forced.split() == ["generic,nvidia.hopper", "generic"]


@pytest.mark.parametrize("target", ["sm_100", "gfx942", "gfx1100"])
def test_compile_matrix_compiles_a_family(target, tmp_path):
    """One family end to end for a target the machine cannot run: every kernel compiles,
    and its resources are read from the binary (cubin or hsaco)."""
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, "ci/compile_matrix.py", "--quick", "--targets", target,
                           "--families", "softmax,layer_norm", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    import json

    rows = json.loads(out.read_text())["rows"]
    kernels = {r["kernel"] for r in rows}
    assert {"_softmax_kernel", "_layer_norm_fwd_kernel", "_layer_norm_bwd_dx_kernel"} <= kernels
    assert all(r["error"] == "" and r["regs"] for r in rows), rows
    # Compiled in coverage order, reported in family order.
    families = [r["family"] for r in rows]
    assert families == sorted(families, key=["softmax", "layer_norm"].index), families


def test_compile_matrix_coverage_order():
    """A budget that stops early has compiled the first case of every selected variant,
    then of every other variant, before any second case."""
    code = ("import sys, os; sys.path.insert(0, 'ci'); import compile_matrix as cm\n"
            "print(cm._coverage_order([['a1', 'a2', 'a3'], ['b1']], [['c1', 'c2']])); os._exit(0)\n")
    assert _in_fresh_process(code).stdout.strip() == "['a1', 'b1', 'c1', 'a2', 'c2', 'a3']"


def test_compile_matrix_budget_reports_what_it_left():
    """With the budget spent, the cases left are reported and do not fail the run."""
    done = subprocess.run([sys.executable, "ci/compile_matrix.py", "--quick", "--targets", "gfx942",
                           "--families", "softmax,layer_norm", "--budget", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "0 kernels, 0 failed" in done.stdout and "cases left by --budget" in done.stdout, done.stdout
    left = int(done.stdout.split("--budget 0 s left ")[1].split()[0])
    assert left >= 2, done.stdout


def test_compile_matrix_fails_on_a_resource_over_the_limit():
    """The check can fail: a shared-memory limit below what a kernel takes is reported."""
    code = (
        "import sys, os; sys.path.insert(0, 'ci'); import compile_matrix as cm, torch\n"
        "from triton.runtime import jit\n"
        "from portable_kernels import plugins\n"
        "from portable_kernels.kernels import softmax\n"
        "host = plugins.host(); dev = host.emulation_profile('mi300x')\n"
        "c = cm.Compiler(16, target=cm.TARGETS['gfx942'])\n"
        "jit.JITFunction.run = lambda self, *a, grid, warmup, **kw: c.run(self, a, kw)\n"
        "plan = cm.plans(host, dev, 'softmax', 'generic')[0]\n"
        "softmax.launch(plan, torch.empty(4, 20000, dtype=torch.float16))\n"
        "print([r.error for r in c.rows]); os._exit(0)\n")
    done = _in_fresh_process(code)
    assert "> 16 B" in done.stdout, done.stdout
