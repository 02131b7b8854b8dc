"""Faults injected into the plugin layer: each is contained where it belongs.

A plugin whose hook raises or answers nonsense is recorded and skipped; a variant whose
``priority`` or ``accepts`` raises is set aside while selection goes on; a variant whose
launch raises reaches the caller unchanged, every time; a broken tuning cache costs only
its results. The fakes detect the ``meta`` device (see fakes.py), so nothing here runs a
kernel except where the point is a real launch.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import types
from typing import NamedTuple

import pytest
import torch

import portable_kernels as pk
from portable_kernels import KernelSpec, Variant, cli, hookimpl, tuning_cache
from portable_kernels.errors import InputError, VariantUnavailableError
from portable_kernels.kernels import vector_add

from fakes import (FakeBackend, fake_config, fake_device, launcher, meta, probe_problem,
                   tuned_configs, tuned_vector_add)


def _failures(host) -> dict[tuple[str, str], str]:
    return {(f.plugin, f.stage): f.error for f in host.failures}


class Injected(Exception):
    """What the injected faults raise, so that nothing else can pass for them."""


def _plugin(name: str, hook: str, body, tryfirst: bool = True) -> types.ModuleType:
    """A plugin module whose only hook is ``hook``, answering ``body()``. It takes none of
    the hook's parameters (a hook implementation may take any subset)."""
    mod = types.ModuleType(name)

    def impl():
        return body()

    setattr(mod, hook, hookimpl(tryfirst=tryfirst)(impl))
    return mod


def _raise():
    raise Injected("injected fault")


# --- hooks that raise -------------------------------------------------------------------

def _assert_probe_works():
    name, switches, configs = pk.get_kernel("probe")(meta(16))
    assert (name, dict(switches), configs) == ("fake.fast", {"FAST": True}, [fake_config("fake.fast")])


@pytest.mark.parametrize("hook", [
    "pk_detect_device", "pk_register_variants", "pk_tuning_configs", "pk_variant_switches",
    "pk_emulation_profiles", "pk_binary_launcher",
])
def test_a_hook_that_raises_fails_its_plugin_only(fresh_host, hook):
    host = fresh_host(FakeBackend(), _plugin("faulty", hook, _raise), autoload=False, catalog=False)
    _assert_probe_works()
    assert "Injected: injected fault" in _failures(host)[("faulty", hook)]
    assert "faulty" not in host.plugin_names()


def test_a_hook_that_raises_is_asked_no_more(fresh_host):
    calls = []

    def body():
        calls.append(1)
        _raise()

    fresh_host(FakeBackend(), _plugin("faulty", "pk_detect_device", body), autoload=False, catalog=False)
    pk.get_kernel("probe")(meta(16))
    pk.get_kernel("probe")(meta(13))
    pk.device_info("meta")
    assert calls == [1]


# --- hooks that answer the wrong type ----------------------------------------------------

@pytest.mark.parametrize("hook, answer, words", [
    ("pk_detect_device", lambda: "meta", ("pk_detect_device returned str", "DeviceInfo")),
    ("pk_tuning_configs", lambda: "BLOCK_SIZE=128", ("pk_tuning_configs returned str", "triton.Config")),
    ("pk_tuning_configs", lambda: [{"BLOCK_SIZE": 128}], ("dict", "triton.Config")),
    ("pk_variant_switches", lambda: "FAST", ("pk_variant_switches returned str", "dict")),
    ("pk_variant_switches", lambda: {1: True}, ("int", "str")),
    ("pk_emulation_profiles", lambda: ["h100"], ("pk_emulation_profiles returned list", "dict")),
    ("pk_binary_launcher", lambda: "cuLaunchKernel", ("pk_binary_launcher returned str", "function")),
    ("pk_emulation_profiles", lambda: {"fk9": "Fake 9"}, ("'fk9'", "str", "DeviceInfo")),
])
def test_a_hook_answering_the_wrong_type_fails_its_plugin(fresh_host, hook, answer, words):
    host = fresh_host(FakeBackend(), _plugin("wrong", hook, answer), autoload=False, catalog=False)
    _assert_probe_works()  # the next implementation was asked, or the variant's own value used
    error = _failures(host)[("wrong", hook)]
    for word in words:
        assert word in error
    assert "wrong" not in host.plugin_names()
    assert "fk9" not in host.profiles


def test_expected_failures_of_the_wrong_type_are_a_plugin_failure(fresh_host):
    good = _plugin("good", "pk_expected_failures", lambda: [("probe/*", "tracked")])
    host = fresh_host(FakeBackend(), good, _plugin("wrong", "pk_expected_failures", lambda: "probe/*"),
                      autoload=False, catalog=False)
    assert host.call("pk_expected_failures", device=fake_device()) == [[("probe/*", "tracked")]]
    assert "pk_expected_failures returned str" in _failures(host)[("wrong", "pk_expected_failures")]


def test_detect_answering_the_wrong_type_is_a_recorded_failure_not_an_error(fresh_host):
    host = fresh_host(FakeBackend(), _plugin("wrong", "pk_detect_device", lambda: object()),
                      autoload=False, catalog=False)
    assert host.detect(torch.device("meta")) == fake_device()
    assert ("wrong", "pk_detect_device") in _failures(host)


# --- a variant whose launch raises ---------------------------------------------------------

def test_a_launch_that_raises_reaches_the_caller_unchanged_every_time(fresh_host):
    error = Injected("launch failed")

    def explodes(plan, x):
        raise error

    class Exploding(FakeBackend):
        @hookimpl
        def pk_register_variants(self, registry):
            super().pk_register_variants(registry)
            registry.add_kernel(KernelSpec("other", "(x) -> out", probe_problem))
            registry.add_variant(Variant("other", "generic", launcher))
            registry.add_variant(Variant("probe", "boom.launch", explodes, priority=100))

    host = fresh_host(Exploding(), autoload=False, catalog=False)
    probe = pk.get_kernel("probe")
    for _ in range(2):  # nothing silently runs another variant the second time
        with pytest.raises(Injected) as info:
            probe(meta(16))
        assert info.value is error
    assert pk.get_kernel("other")(meta(16))[0] == "generic"
    assert pk.explain("probe", meta(16)).variant == "boom.launch"
    assert host.failures == []


# --- variants whose priority or accepts raises --------------------------------------------

def _bad_variant_backend(**fields):
    class BadVariant(FakeBackend):
        @hookimpl
        def pk_register_variants(self, registry):
            super().pk_register_variants(registry)
            registry.add_variant(Variant("probe", "bad.one", launcher, **fields))
            registry.add_variant(Variant("probe", "bad.fine", launcher, priority=-5))

    return BadVariant()


def _explode(*args):
    raise Injected("callback failed")


def _priority_raising_a_library_error(device):
    # It sees only the device, so even the library's own error cannot be about user input.
    raise InputError("not about any input")


@pytest.mark.parametrize("fields, callback", [
    ({"priority": _explode}, "priority"),
    ({"priority": _priority_raising_a_library_error}, "priority"),
    ({"priority": lambda device: "high"}, "priority"),
    ({"priority": 50, "accepts": _explode}, "accepts"),
    ({"priority": 50, "accepts": lambda problem, device: True}, "accepts"),
])
def test_a_raising_variant_callback_sets_the_variant_aside(fresh_host, caplog, fields, callback):
    with caplog.at_level("WARNING", logger="portable_kernels"):
        host = fresh_host(_bad_variant_backend(**fields), autoload=False, catalog=False)
        assert pk.get_kernel("probe")(meta(16))[0] == "fake.fast"  # in the same call
        assert pk.get_kernel("probe")(meta(13))[0] == "generic"
        pk.explain("probe", meta(16))
    (failure,) = host.failures
    assert (failure.plugin, failure.stage) == ("BadVariant", f"probe/bad.one {callback}")
    assert "bad.one" not in pk.list_variants("probe")
    assert "bad.fine" in pk.list_variants("probe")  # the plugin keeps its other variants
    assert "BadVariant" in host.plugin_names()
    assert len([r for r in caplog.records if "bad.one" in r.getMessage()]) == 1  # logged once


def test_a_raising_priority_is_set_aside_under_use_variant(fresh_host):
    host = fresh_host(_bad_variant_backend(priority=_explode), autoload=False, catalog=False)
    with pk.use_variant(probe="generic"):
        assert pk.get_kernel("probe")(meta(16))[0] == "generic"
    assert ("BadVariant", "probe/bad.one priority") in _failures(host)


def test_forcing_a_variant_whose_priority_raises_says_why(fresh_host):
    fresh_host(_bad_variant_backend(priority=_explode), autoload=False, catalog=False)
    with pk.use_variant(probe="bad.one"):
        with pytest.raises(VariantUnavailableError, match="bad.one.*priority raised Injected: callback failed"):
            pk.get_kernel("probe")(meta(16))
    assert pk.get_kernel("probe")(meta(16))[0] == "fake.fast"


def test_list_variants_sets_aside_a_raising_priority(fresh_host):
    host = fresh_host(_bad_variant_backend(priority=_explode), autoload=False, catalog=False)
    assert pk.list_variants("probe", "meta") == ["fake.fast", "generic", "bad.fine"]
    assert ("BadVariant", "probe/bad.one priority") in _failures(host)


def test_info_and_explain_show_a_variant_set_aside(fresh_host, capsys):
    fresh_host(_bad_variant_backend(priority=_explode), autoload=False, catalog=False)
    assert cli.main(["info", "--device", "meta", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {"plugin": "BadVariant", "stage": "probe/bad.one priority",
            "error": "Injected: callback failed"} in data["failed_plugins"]
    assert {r["kernel"]: r["variant"] for r in data["kernels"]} == {"probe": "fake.fast"}

    fresh_host(_bad_variant_backend(priority=_explode), autoload=False, catalog=False)
    assert cli.main(["info", "--device", "meta"]) == 0
    out = capsys.readouterr().out
    assert "Failed plugins" in out and "probe/bad.one priority" in out

    fresh_host(_bad_variant_backend(priority=_explode), autoload=False, catalog=False)
    assert cli.main(["explain", "probe", "--device", "meta"]) == 0
    assert "chosen: fake.fast" in capsys.readouterr().out


def test_a_user_error_from_accepts_propagates(fresh_host):
    def refuses(problem, device):
        raise InputError("x must not be empty")

    host = fresh_host(_bad_variant_backend(priority=50, accepts=refuses), autoload=False, catalog=False)
    with pytest.raises(InputError, match="must not be empty"):
        pk.get_kernel("probe")(meta(16))
    assert host.failures == [] and "bad.one" in pk.list_variants("probe")


def test_a_raising_priority_beside_the_real_catalog(fresh_host, device):
    """The real vector_add keeps running, by default and forced, beside a broken variant."""
    class Acme:
        @hookimpl
        def pk_register_variants(self, registry):
            registry.add_variant(Variant("vector_add", "acme.fast", vector_add.launch, priority=_explode))

    host = fresh_host(Acme())
    x = torch.arange(10.0, device=device)
    with pk.use_variant(vector_add="generic"):
        torch.testing.assert_close(pk.get_kernel("vector_add")(x, x), 2 * x)
    assert ("Acme", "vector_add/acme.fast priority") in _failures(host)
    torch.testing.assert_close(pk.get_kernel("vector_add")(x, x), 2 * x)
    assert pk.explain("vector_add", x, x).variant == "generic"


@pytest.mark.parametrize("configs", [_explode, lambda device: "BLOCK_SIZE=1024"],
                         ids=["raises", "wrong-type"])
def test_failing_configs_set_the_variant_aside_at_its_first_launch(configs, fresh_host, device):
    """A variant's configs run when it is first launched, after selection chose it (for a
    kernel no backend has a tuning table for): the variant is set aside then, and the same
    call runs the next one. On the CPU the backend's own tuning hook asks those configs
    first; the backend is not blamed for them."""
    class Acme:
        @hookimpl
        def pk_register_variants(self, registry):
            registry.add_kernel(KernelSpec("twice", "(x) -> out", _TwiceProblem.of, "x * 2"))
            registry.add_variant(Variant("twice", "generic", lambda plan, x: x * 2))
            registry.add_variant(Variant("twice", "acme.fast", lambda plan, x: x * 2,
                                         priority=100, configs=configs))

    host = fresh_host(Acme())
    x = torch.arange(10.0, device=device)
    assert pk.explain("twice", x).variant == "acme.fast"
    torch.testing.assert_close(pk.get_kernel("twice")(x), 2 * x)
    failures = _failures(host)
    assert ("Acme", "twice/acme.fast configs") in failures
    assert all(plugin == "Acme" for plugin, _ in failures), failures
    assert pk.explain("twice", x).variant == "generic"
    torch.testing.assert_close(pk.get_kernel("vector_add")(x, x), 2 * x)


class _TwiceProblem(NamedTuple):
    device: torch.device

    @staticmethod
    def of(x):
        return _TwiceProblem(x.device)


# --- a broken tuning cache ------------------------------------------------------------------

CONFIGS = tuned_configs()
ENTRY = "vector_add/generic/_vector_add_kernel"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PK_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PK_TUNING_CACHE", raising=False)
    return tmp_path


def _tuned_launch(device, timed: list) -> None:
    """A real launch through an autotuner over two configs, as a GPU launch is tuned."""
    tuned_vector_add(device, timed, n=300)


@pytest.mark.parametrize("content", [
    b"\x00\xffnot json",
    b"[1, 2, 3]",
    json.dumps({ENTRY: []}).encode(),
    json.dumps({ENTRY: {"(300,)": 5}, "other": "text"}).encode(),
    json.dumps({ENTRY: {"(300,)": "a config that does not exist"}}).encode(),
])
def test_a_corrupt_or_misshapen_cache_costs_only_its_results(cache, device, content):
    path = tuning_cache.path_for(fake_device().fingerprint)
    path.write_bytes(content)
    timed: list = []
    _tuned_launch(device, timed)
    assert len(timed) == 2  # tuned again
    stored = json.loads(path.read_text())
    assert list(stored[ENTRY].values()) and all(isinstance(v, str) for v in stored[ENTRY].values())
    timed.clear()
    _tuned_launch(device, timed)
    assert timed == []  # and the new result is used


@pytest.mark.parametrize("obstacle", ["file in place of the directory", "directory in place of the file"])
def test_an_unwritable_cache_costs_only_its_results(cache, device, caplog, monkeypatch, obstacle):
    if obstacle.startswith("file"):
        (cache / "blocked").write_text("")
        monkeypatch.setenv("PK_CACHE_DIR", str(cache / "blocked" / "cache"))
    else:
        tuning_cache.path_for(fake_device().fingerprint).mkdir()
    with caplog.at_level("WARNING", logger="portable_kernels"):
        for _ in range(2):
            timed: list = []
            _tuned_launch(device, timed)
            assert len(timed) == 2
    assert "cannot store tuning results" in caplog.text
    assert not [p for p in cache.rglob("*") if p.name.endswith(".tmp")]


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes to read-only directories")
def test_a_read_only_cache_directory(cache, device, caplog):
    cache.chmod(0o555)
    try:
        with caplog.at_level("WARNING", logger="portable_kernels"):
            _tuned_launch(device, [])
    finally:
        cache.chmod(0o755)
    assert "cannot store tuning results" in caplog.text and not list(cache.iterdir())


def _store_many(directory: str, worker: int, count: int, start) -> None:
    os.environ["PK_CACHE_DIR"] = directory
    path = tuning_cache.path_for("concurrent")
    start.wait()
    for i in range(count):
        tuning_cache._write(path, ENTRY, {f"({worker}, {i})": "config"})


def test_concurrent_writers_lose_no_result(cache):
    """Processes storing at once (pytest-xdist workers, ranks of one job) keep every key."""
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    ctx = multiprocessing.get_context(method)
    start = ctx.Event()
    workers = [ctx.Process(target=_store_many, args=(str(cache), w, 20, start)) for w in range(4)]
    for p in workers:
        p.start()
    start.set()
    for p in workers:
        p.join(timeout=120)
    assert [p.exitcode for p in workers] == [0] * 4
    stored = json.loads(tuning_cache.path_for("concurrent").read_text())[ENTRY]
    assert set(stored) == {f"({w}, {i})" for w in range(4) for i in range(20)}
