"""The ``portable-kernels`` command: info, list, explain, as text and JSON."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from portable_kernels import cli

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


def test_console_script_is_installed():
    proc = subprocess.run(["portable-kernels", "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "portable-kernels" in proc.stdout


def test_list(capsys, fresh_host):
    fresh_host()
    code, out, _ = run_cli(capsys, "list")
    assert code == 0 and "softmax(x, dim=-1) -> out" in out
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
