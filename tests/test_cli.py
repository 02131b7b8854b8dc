"""The ``portable-kernels`` command: info, list, explain, as text and JSON."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import triton

import portable_kernels as pk
from portable_kernels import cli, dispatch

from fakes import FakeBackend


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_info_shows_device_plugins_and_kernels(capsys, fresh_host, device):
    fresh_host()
    code, out, _ = run_cli(capsys, "info", "--device", str(device))
    assert code == 0
    assert "Device:" in out and "capability" in out
    for plugin in ("cpu", "nvidia", "amd", "iluvatar"):
        assert plugin in out
    assert "softmax" in out and "vector_add" in out and "generic" in out


def test_info_json(capsys, fresh_host, device):
    fresh_host()
    code, out, _ = run_cli(capsys, "info", "--device", str(device), "--json")
    data = json.loads(out)
    assert code == 0
    assert {p["name"] for p in data["plugins"]} >= {"cpu", "nvidia", "amd", "iluvatar"}
    assert {k["kernel"] for k in data["kernels"]} >= {"softmax", "vector_add"}
    assert data["device"]["fingerprint"]
    if device.type == "cpu":
        assert data["launches"] == "Triton's interpreter"
    elif torch.version.cuda is not None and triton.__version__.startswith("3.6."):
        assert "by portable_kernels_backends.nvidia.launcher; from a signature's third call" in data["launches"]


def test_the_launch_path_is_described_with_its_reason(monkeypatch):
    """What ``info`` says about launches: the interpreter, Triton's JIT dispatch and why,
    or direct launches by the backend's launcher or Triton's, and whether replays are on."""
    from portable_kernels import _direct
    from portable_kernels_backends.nvidia import launcher

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    assert _direct.describe("nvidia", True, None) == "Triton's interpreter"
    monkeypatch.delenv("PK_REPLAY", raising=False)
    assert "by portable_kernels_backends.nvidia.launcher; from a signature's third call" in \
        _direct.describe("nvidia", False, launcher.make)
    monkeypatch.setenv("PK_REPLAY", "0")
    assert _direct.describe("nvidia", False, None).endswith("by its Triton launcher; replays off (PK_REPLAY=0)")
    assert "need NVIDIA GPUs under triton 3.6.x" in _direct.describe("amd", False, None)
    monkeypatch.setenv("PK_DIRECT_LAUNCH", "0")
    assert _direct.describe("nvidia", False, launcher.make).endswith("(PK_DIRECT_LAUNCH=0)")


def test_info_shows_failed_plugins(capsys, monkeypatch, fresh_host, device):
    monkeypatch.setenv("PK_PLUGINS", "pk_no_such_module_xyz")
    fresh_host()
    code, out, _ = run_cli(capsys, "info", "--device", str(device))
    assert code == 0
    assert "Failed plugins" in out and "pk_no_such_module_xyz" in out and "ModuleNotFoundError" in out


def test_bi150_info_in_a_fresh_process(device):
    env = dict(os.environ, PK_EMULATE="bi150")
    proc = subprocess.run([sys.executable, "-m", "portable_kernels.cli", "info", "--device", str(device), "--json"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)["device"]
    assert info["vendor"] == "iluvatar" and info["warp_size"] == 64
    assert "tensor_descriptor" not in info["capabilities"]


@pytest.mark.parametrize("env, words", [
    ({"PK_VARIANT": "softmx=generic"}, ("PK_VARIANT", "'softmx'", "known kernels: ", "softmax")),
    ({"PK_VARIANT": "softmax=generc"}, ("PK_VARIANT", "'generc'", "generic")),
    ({"PK_EMULATE": "bogus"}, ("PK_EMULATE", "'bogus'", "h100")),
])
def test_info_with_a_mistaken_pk_variable_prints_one_error_line(env, words):
    env = {**os.environ, "PK_VARIANT": "", "PK_EMULATE": "", **env}
    proc = subprocess.run([sys.executable, "-m", "portable_kernels.cli", "info"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1 and proc.stdout == ""
    (line,) = proc.stderr.splitlines()  # no traceback, no plugin-failure warning first
    assert line.startswith("error: ")
    for word in words:
        assert word in line


def test_console_script_is_installed():
    proc = subprocess.run(["portable-kernels", "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "portable-kernels" in proc.stdout


def test_list(capsys, monkeypatch, fresh_host):
    # A 100-column terminal, as test_info_tables_fit_100_columns: the table truncates its
    # last column to the terminal, and under pytest-xdist that is not always 100 wide.
    monkeypatch.setenv("COLUMNS", "100")
    fresh_host()
    code, out, _ = run_cli(capsys, "list")
    assert code == 0 and "softmax" in out and "catalog" in out
    assert max(len(line) for line in out.splitlines()) <= 100, out
    code, out, _ = run_cli(capsys, "list", "--verbose")
    assert code == 0 and "softmax(x, dim=-1) -> out" in out
    assert max(len(line) for line in out.splitlines()) <= 100, out
    code, out, _ = run_cli(capsys, "list", "--json")
    names = {k["kernel"] for k in json.loads(out)}
    assert {"softmax", "vector_add"} <= names


def test_explain_text_and_json(capsys, fresh_host):
    fresh_host(FakeBackend(), autoload=False, catalog=False)
    code, out, _ = run_cli(capsys, "explain", "probe", "--device", "meta")
    assert code == 0
    assert "chosen: fake.fast" in out and "fake.tma" in out and "rejected" in out
    code, out, _ = run_cli(capsys, "explain", "probe", "--device", "meta", "--json")
    assert json.loads(out)["variant"] == "fake.fast"


def test_explain_unknown_kernel(capsys, fresh_host):
    fresh_host(FakeBackend(), autoload=False, catalog=False)
    code, _, err = run_cli(capsys, "explain", "nope", "--device", "meta")
    assert code == 2 and "known kernels: probe" in err


def test_explain_unknown_device(capsys, fresh_host):
    fresh_host(FakeBackend(), autoload=False, catalog=False)
    code, _, err = run_cli(capsys, "explain", "probe", "--device", "cpu")
    assert code == 1 and "no loaded backend recognizes device cpu" in err


def test_no_command_prints_help(capsys):
    code, out, _ = run_cli(capsys)
    assert code == 2 and "info" in out and "explain" in out


@pytest.mark.parametrize("profile,expected", [("bi150", "iluvatar"), ("mi300x", "amd"), ("h100", "nvidia")])
def test_emulated_explain(capsys, monkeypatch, fresh_host, device, profile, expected):
    monkeypatch.setenv("PK_EMULATE", profile)
    fresh_host()
    code, out, _ = run_cli(capsys, "explain", "softmax", "--device", str(device), "--json")
    assert code == 0 and json.loads(out)["device"]["vendor"] == expected


# --- the default device and bad devices -------------------------------------------------------

def test_info_without_device_agrees_with_explain(capsys, fresh_host):
    """Every column of `info` describes the device `info` describes, also by default."""
    fresh_host()
    default = dispatch._resolve_device(None)
    code, out, _ = run_cli(capsys, "info", "--json")
    assert code == 0
    rows = {r["kernel"]: r for r in json.loads(out)["kernels"]}
    for name in pk.list_kernels():
        sel = pk.explain(name, device=default)
        runnable = {v.name for v in sel.verdicts if v.runnable}
        assert rows[name]["variant"] == sel.variant
        assert rows[name]["runnable"] == pk.list_variants(name, default)
        assert set(rows[name]["runnable"]) == runnable, name


def test_info_tables_fit_100_columns(capsys, monkeypatch, fresh_host, device):
    monkeypatch.setenv("COLUMNS", "100")
    fresh_host()
    code, out, _ = run_cli(capsys, "info", "--device", str(device))
    assert code == 0
    wide = [line for line in out.splitlines() if len(line) > 100]
    assert not wide, wide


@pytest.mark.parametrize("profile", [None, "h200", "h100", "a100", "mi300x", "bi150"])
def test_every_default_line_fits_100_columns(profile, capsys, monkeypatch, fresh_host, device):
    """info, list and explain (every kernel) fit 100 columns by default, on the device
    under test and as emulated profiles see it, also in a wider terminal; ``--verbose``
    wraps the whole texts to the same width (the chosen variant's reason in full)."""
    monkeypatch.setenv("COLUMNS", "300")
    if profile:
        monkeypatch.setenv("PK_EMULATE", profile)
    fresh_host()
    commands = [("info", "--device", str(device)), ("list",)]
    commands += [("explain", name, "--device", str(device)) for name in pk.list_kernels()]
    for argv in commands:
        for verbose in ((), ("--verbose",)):
            code, out, err = run_cli(capsys, *argv, *verbose)
            assert code == 0, err
            wide = [line for line in out.splitlines() if len(line) > 100]
            assert not wide, (argv, verbose, wide)
    for name in pk.list_kernels():
        sel = pk.explain(name, device=device)
        _, out, _ = run_cli(capsys, "explain", name, "--device", str(device), "--verbose")
        assert " ".join(sel.reason.split()) in " ".join(out.split()), name


def test_info_says_what_the_interpreter_emulates(capsys, fresh_host, device):
    fresh_host()
    if not pk.device_info(device).has("interpreter"):
        pytest.skip("the device under test is not Triton's interpreter")
    code, out, _ = run_cli(capsys, "info", "--device", str(device))
    assert code == 0
    heading = next(line for line in out.splitlines() if line.startswith("Capabilities"))
    assert "Triton's interpreter emulates in software" in heading and "not features of" in heading
    assert "SMs" not in out.split("Capabilities")[0]  # CPU cores are not streaming multiprocessors


@pytest.fixture
def no_cuda(monkeypatch):
    """torch as it is on a machine without a CUDA device, whatever this machine has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


BAD_DEVICES = {
    "gpu": "device 'gpu': not a torch device",
    "cuda": "device 'cuda': torch sees no CUDA device on this machine (torch.cuda.is_available() is False)",
    "cuda:0": "device 'cuda:0': torch sees no CUDA device",
    "opengl": "device 'opengl': torch has no torch.opengl module",
}
BAD_COMMANDS = {
    "info": ("info",),
    "info --json": ("info", "--json"),
    "explain": ("explain", "softmax"),
    "tune": ("tune", "vector_add", "--shapes", "1000", "--dtypes", "fp32"),
    "conformance": ("conformance", "--kernels", "vector_add", "--quick"),
}


@pytest.mark.parametrize("command", sorted(BAD_COMMANDS))
@pytest.mark.parametrize("bad", sorted(BAD_DEVICES))
def test_bad_device_is_one_error_line(capsys, fresh_host, no_cuda, command, bad):
    host = fresh_host()
    code, out, err = run_cli(capsys, *BAD_COMMANDS[command], "--device", bad)
    assert code == 2, (out, err)
    assert err.startswith(f"error: {BAD_DEVICES[bad]}") and err.count("\n") == 1, err
    assert "devices here: cpu" in err and "Traceback" not in err
    assert not out
    # No detection hook ran on the bad device, so no backend was recorded as failed.
    assert not host.failures and {"nvidia", "iluvatar"} <= set(host.plugin_names())


def test_device_index_past_the_count(capsys, monkeypatch, fresh_host):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    fresh_host()
    code, _, err = run_cli(capsys, "explain", "softmax", "--device", "cuda:2")
    assert code == 2
    assert err.startswith("error: device 'cuda:2': index 2 is out of range: torch sees 2 CUDA devices")
    assert "devices here: cpu, cuda:0, cuda:1" in err


def test_tune_reports_only_what_it_stored(capsys, monkeypatch, tmp_path, fresh_host, device):
    """The interpreter has one config per kernel: nothing is tuned, so nothing is stored,
    and tune must not name a file it never wrote."""
    monkeypatch.setenv("PK_CACHE_DIR", str(tmp_path))
    fresh_host()
    code, out, _ = run_cli(capsys, "tune", "vector_add", "--shapes", "1000", "--dtypes", "fp32",
                           "--device", str(device))
    assert code == 0
    stored = list(tmp_path.glob("tuning-*.json"))
    if stored:
        assert f"tuning results: {stored[0]}" in out
    else:
        assert not list(tmp_path.iterdir())
        assert "tuning results:" not in out and str(tmp_path) not in out
        assert "nothing was tuned (one config per kernel on this device); no results were stored" in out
    code, out, _ = run_cli(capsys, "tune", "vector_add", "--shapes", "1000", "--dtypes", "fp32",
                           "--device", str(device), "--json")
    # Nothing new to store the second time: either nothing is tuned, or it is stored already.
    assert code == 0 and json.loads(out)["stored_in"] is None
