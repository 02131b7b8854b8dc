"""Autotuning results persist per device fingerprint, and `portable-kernels tune` fills them."""
from __future__ import annotations

import importlib.util
import json
import os
import threading

import pytest
import torch
import triton

import portable_kernels as pk
from portable_kernels import Variant, cli, tuning_cache
from portable_kernels.launch import LaunchPlan
from portable_kernels.kernels import vector_add

from fakes import fake_device, tuned_configs, tuned_vector_add


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PK_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PK_TUNING_CACHE", raising=False)
    return tmp_path


CONFIGS = tuned_configs()


def _plan(device_name="Tuned Fake"):
    info = fake_device()
    info = type(info)(**{**info.__dict__, "name": device_name})
    return LaunchPlan(Variant("vector_add", "generic", vector_add.launch), info, CONFIGS, {})


def _launch(plan, bench_calls, device):
    return tuned_vector_add(device, bench_calls, plan)


def test_results_persist_across_plans(cache_dir, device):
    calls: list = []
    first = _launch(_plan(), calls, device)
    assert len(calls) == 2  # both configs benchmarked
    path = tuning_cache.path_for(_plan().device.fingerprint)
    stored = json.loads(path.read_text())
    (entry, results), = stored.items()
    assert entry == "vector_add/generic/_vector_add_kernel"
    assert list(results.values()) == [tuning_cache.config_id(first.best_config)]

    calls.clear()
    second = _launch(_plan(), calls, device)  # a new plan, as in a new process
    assert calls == [] and str(second.best_config) == str(first.best_config)


def test_other_fingerprints_do_not_share(cache_dir, device):
    calls: list = []
    _launch(_plan("Device A"), calls, device)
    calls.clear()
    _launch(_plan("Device B"), calls, device)
    assert len(calls) == 2


def test_changed_configs_are_tuned_again(cache_dir, device):
    calls: list = []
    _launch(_plan(), calls, device)
    path = tuning_cache.path_for(_plan().device.fingerprint)
    data = json.loads(path.read_text())
    for results in data.values():
        for key in results:
            results[key] = "a config that no longer exists"
    path.write_text(json.dumps(data))
    calls.clear()
    _launch(_plan(), calls, device)
    assert len(calls) == 2


def test_disabled(cache_dir, monkeypatch, device):
    monkeypatch.setenv("PK_TUNING_CACHE", "0")
    _launch(_plan(), [], device)
    assert not list(cache_dir.iterdir())


def test_tune_command(capsys, fresh_host, device):
    fresh_host()
    code = cli.main(["tune", "softmax", "--shapes", "8x100", "3x2000", "--dtypes", "fp32,fp16",
                     "--device", str(device), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert [(r["shape"], r["dtype"]) for r in out["results"]] == [
        ("8x100", "float32"), ("8x100", "float16"), ("3x2000", "float32"), ("3x2000", "float16")]
    assert all(r["variant"] == pk.explain("softmax", device=device).variant for r in out["results"])


def test_tune_command_fp8_matmul(capsys, fresh_host, device):
    """fp8 matmuls pre-tune with the weight layout their calls use (b column-major)."""
    fresh_host()
    if not pk.device_info(device).has("fp8"):
        pytest.skip(f"{pk.device_info(device).name} has no fp8 capability")
    code = cli.main(["tune", "matmul", "--shapes", "64x32x48", "--dtypes", "fp8e4m3",
                     "--device", str(device), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and [(r["shape"], r["dtype"]) for r in out["results"]] == [("64x32x48", "float8_e4m3fn")]
    from portable_kernels.kernels import matmul as mm

    (a, b), _ = mm.inputs("64x32x48", torch.float8_e4m3fn, device)
    assert a.is_contiguous() and b.shape == (48, 32) and b.stride() == (1, 48)


def test_tune_rejects_bad_shapes(capsys, fresh_host, device):
    fresh_host()
    code = cli.main(["tune", "softmax", "--shapes", "8x", "--device", str(device)])
    assert code == 1 and "is not RxC" in capsys.readouterr().err


def test_run_tuned_launches_the_chosen_config_directly(cache_dir, device):
    """After the first launch of a problem, ``run_tuned`` skips the autotuner and launches
    the JIT kernel with the config it chose; another problem key is tuned again."""
    plan, calls = _plan("Fast Path Fake"), []

    def do_bench(kernel_call, quantiles=None):
        calls.append(1)
        kernel_call()
        return [1.0 / len(calls)] * 3  # prefers the config benchmarked last (BLOCK_SIZE 512)

    kernel = plan.autotuned(vector_add._vector_add_kernel, key=["n_elements"], do_bench=do_bench)
    autotuner_runs = []
    real_run = kernel.run
    kernel.run = lambda *a, **k: (autotuner_runs.append(1), real_run(*a, **k))[1]

    def launch(n):
        x = torch.randn(n, device=device)
        out = torch.full_like(x, float("nan"))  # poison: every element must be written
        plan.run_tuned(kernel, (n, x.dtype), lambda meta: (triton.cdiv(n, meta["BLOCK_SIZE"]),),
                       x, x, out, n)
        torch.testing.assert_close(out, 2 * x)

    launch(1000)
    assert (len(calls), len(autotuner_runs)) == (2, 1)
    assert kernel.best_config.kwargs == {"BLOCK_SIZE": 512}
    launch(1000)
    launch(1000)
    assert (len(calls), len(autotuner_runs)) == (2, 1)  # no autotuner on the fast path
    launch(3000)  # a new problem key goes through the autotuner again
    assert len(autotuner_runs) == 2


def test_malformed_entries_are_left_out_and_logged_once(cache_dir, caplog):
    path = tuning_cache.path_for("malformed")
    path.write_text(json.dumps({"a/generic/_k": [], "b/generic/_k": {"(1,)": 5, "(2,)": "config"}}))
    with caplog.at_level("WARNING", logger="portable_kernels"):
        assert tuning_cache._read(path) == {"b/generic/_k": {"(2,)": "config"}}
        assert tuning_cache._read(path) == {"b/generic/_k": {"(2,)": "config"}}
    assert caplog.text.count("malformed entries") == 1


def test_a_failed_replace_leaves_no_temporary_file(cache_dir, monkeypatch):
    def refuse(src, dst):
        raise PermissionError("injected: replace refused")

    monkeypatch.setattr(tuning_cache.os, "replace", refuse)
    with pytest.raises(PermissionError):
        tuning_cache._write(tuning_cache.path_for("refused"), "e", {"(1,)": "config"})
    assert not [p for p in cache_dir.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.skipif(importlib.util.find_spec("fcntl") is None, reason="no fcntl: stores take no lock")
def test_a_store_waits_for_the_lock_another_process_holds(cache_dir):
    import fcntl

    path = tuning_cache.path_for("locked")
    # A separate open file description conflicts with the store's, as another process's does.
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        store = threading.Thread(target=tuning_cache._write, args=(path, "e", {"(1,)": "config"}))
        store.start()
        store.join(0.3)
        assert store.is_alive() and not path.exists()
    finally:
        os.close(fd)
    store.join(30)
    assert tuning_cache._read(path) == {"e": {"(1,)": "config"}}


def test_without_fcntl_stores_still_merge(cache_dir, monkeypatch):
    monkeypatch.setattr(tuning_cache, "fcntl", None)
    path = tuning_cache.path_for("no fcntl")
    tuning_cache._write(path, "e", {"(1,)": "a"})
    tuning_cache._write(path, "e", {"(2,)": "b"})
    assert tuning_cache._read(path) == {"e": {"(1,)": "a", "(2,)": "b"}}
    assert not os.path.exists(f"{path}.lock")
