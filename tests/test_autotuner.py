"""The plan autotuner times near-ties again, in turns, before it keeps and stores a pick."""
from __future__ import annotations

import json

import pytest
import torch
import triton

from portable_kernels import Variant, _autotuner, tuning_cache
from portable_kernels.kernels import vector_add
from portable_kernels.launch import LaunchPlan

from fakes import fake_device

CONFIGS = [triton.Config({"BLOCK_SIZE": b}, num_warps=1) for b in (128, 256, 512)]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PK_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PK_TUNING_CACHE", raising=False)
    return tmp_path


def _tune(device, times, confirm=True):
    """Tune vector_add over CONFIGS with a timer that returns ``times`` in order and
    records which config each timing ran; returns (tuner, the configs timed in order)."""
    plan = LaunchPlan(Variant("vector_add", "generic", vector_add.launch), fake_device(), CONFIGS, {})
    timed, times = [], list(times)
    x = torch.randn(1000, device=device)
    out = torch.empty_like(x)

    def do_bench(kernel_call, quantiles=None):
        out.fill_(float("nan"))
        kernel_call()
        # Which config ran: the one whose block size the launch used (its grid's size).
        timed.append(launched[-1])
        return [times.pop(0)] * 3

    launched = []

    def grid(meta):
        launched.append(meta["BLOCK_SIZE"])
        return (triton.cdiv(1000, meta["BLOCK_SIZE"]),)

    kernel = plan.autotuned(vector_add._vector_add_kernel, key=["n_elements"], do_bench=do_bench)
    assert isinstance(kernel, _autotuner.PlanAutotuner)
    kernel.confirm_ties = confirm
    kernel[grid](x, x, out, 1000)
    torch.testing.assert_close(out, 2 * x)
    assert not times, "the timer was asked for fewer timings than the test scripted"
    return kernel, timed


def test_near_ties_are_timed_again_in_turns(cache_dir, device):
    # First pass: 128 fastest, 256 within 5% of it, 512 far behind. The re-timings favour
    # 256, so it wins on the median of its three timings, and that is what persists.
    kernel, timed = _tune(device, [1.00, 1.03, 2.0] + [1.10, 1.00] * _autotuner.TIE_ROUNDS)
    assert timed == [128, 256, 512] + [128, 256] * _autotuner.TIE_ROUNDS
    assert kernel.best_config.kwargs["BLOCK_SIZE"] == 256
    assert list(kernel.cache.values())[0].kwargs["BLOCK_SIZE"] == 256
    stored = json.loads(tuning_cache.path_for(fake_device().fingerprint).read_text())
    assert list(stored["vector_add/generic/_vector_add_kernel"].values()) == [
        tuning_cache.config_id(kernel.best_config)]


def test_the_first_pick_stays_when_the_retimings_agree(cache_dir, device):
    kernel, timed = _tune(device, [1.00, 1.04, 1.045] + [1.0, 1.2, 1.3] * _autotuner.TIE_ROUNDS)
    assert timed == [128, 256, 512] + [128, 256, 512] * _autotuner.TIE_ROUNDS
    assert kernel.best_config.kwargs["BLOCK_SIZE"] == 128


def test_a_clear_winner_is_not_timed_again(cache_dir, device):
    kernel, timed = _tune(device, [2.0, 1.0, 1.5])
    assert timed == [128, 256, 512] and kernel.best_config.kwargs["BLOCK_SIZE"] == 256


def test_no_retiming_when_off(cache_dir, device):
    # Plans under the interpreter turn it off: there every launch costs seconds.
    kernel, timed = _tune(device, [1.00, 1.01, 1.02], confirm=False)
    assert timed == [128, 256, 512] and kernel.best_config.kwargs["BLOCK_SIZE"] == 128


def test_the_first_pick_stands_when_retiming_cannot_run(cache_dir, device, monkeypatch):
    """Re-timing calls Triton internals; if a release changed them, tuning still ends with
    the first pick (and stores it) instead of failing."""
    def changed(*args, **kwargs):
        raise TypeError("_bench() got an unexpected keyword argument 'config'")

    original = _autotuner.PlanAutotuner._confirm

    def confirm_with_changed_bench(self, key, timings, args, kwargs):
        # Triton's first pass has timed every config; only the re-timing meets the change.
        self._bench = changed
        return original(self, key, timings, args, kwargs)

    monkeypatch.setattr(_autotuner.PlanAutotuner, "_confirm", confirm_with_changed_bench)
    kernel, timed = _tune(device, [1.00, 1.01, 1.02])
    assert timed == [128, 256, 512] and kernel.best_config.kwargs["BLOCK_SIZE"] == 128
    assert kernel.nargs is None
    stored = json.loads(tuning_cache.path_for(fake_device().fingerprint).read_text())
    assert list(stored["vector_add/generic/_vector_add_kernel"].values()) == [
        tuning_cache.config_id(kernel.best_config)]


def test_a_plan_autotuner_runs_one_call_at_a_time(monkeypatch):
    """Triton's Autotuner.run keeps the launch's arguments in self.nargs and clears them at
    the end, so calls from several threads at once broke each other on the GPU ("'NoneType'
    object is not a mapping"); a plan's autotuner, one config or several, lets one call in
    at a time. (On the CPU the interpreter's lock serializes whole launches anyway, so the
    race itself only shows on GPUs: this checks the autotuner's own exclusion.)"""
    import threading
    import time

    from triton.runtime.autotuner import Autotuner

    inside, most = [0], [0]
    lock = threading.Lock()

    def run(self, *args, **kwargs):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.02)
        with lock:
            inside[0] -= 1

    monkeypatch.setattr(Autotuner, "run", run)
    for configs in (CONFIGS[:1], CONFIGS):
        plan = LaunchPlan(Variant("vector_add", "generic", vector_add.launch), fake_device(), configs, {})
        kernel = plan.autotuned(vector_add._vector_add_kernel, key=["n_elements"])
        most[0] = 0
        threads = [threading.Thread(target=kernel.run) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert most[0] == 1, f"{len(configs)} config(s): {most[0]} calls inside run at once"
