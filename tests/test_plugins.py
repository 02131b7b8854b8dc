"""Plugin loading and isolation: a plugin that raises never breaks the others."""
from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

import portable_kernels as pk
from portable_kernels import KernelSpec, Variant, cli, hookimpl
from portable_kernels.errors import DeviceError

from fakes import FakeBackend, fake_config, launcher, meta, probe_problem


class RaisesOnRegister:
    @hookimpl
    def pk_register_variants(self, registry):
        # Half-way through: the variant below must not survive the failure.
        registry.add_variant(Variant("probe", "broken.half", launcher))
        raise RuntimeError("boom in register")


class RaisesOnDetect:
    @hookimpl(tryfirst=True)
    def pk_detect_device(self, device):
        raise RuntimeError("boom in detect")


class RaisesOnTuning:
    @hookimpl(tryfirst=True)
    def pk_tuning_configs(self, kernel, variant, device):
        raise ZeroDivisionError("boom in tuning")


class MisspeltHook:
    @hookimpl
    def pk_detect_devise(self, device):
        return None


def _failures(host):
    return {(f.plugin, f.stage): f.error for f in host.failures}


def test_plugin_raising_in_register_is_skipped_atomically(fresh_host):
    host = fresh_host(FakeBackend(), RaisesOnRegister(), autoload=False, catalog=False)
    assert ("RaisesOnRegister", "pk_register_variants") in _failures(host)
    assert "broken.half" not in pk.list_variants("probe")
    assert pk.get_kernel("probe")(meta(16))[0] == "fake.fast"


def test_plugin_raising_in_detect_is_skipped(fresh_host):
    host = fresh_host(FakeBackend(), RaisesOnDetect(), autoload=False, catalog=False)
    assert pk.get_kernel("probe")(meta(16))[0] == "fake.fast"
    assert "RuntimeError: boom in detect" in _failures(host)[("RaisesOnDetect", "pk_detect_device")]
    assert "RaisesOnDetect" not in host.plugin_names()


def test_plugin_raising_in_tuning_is_skipped(fresh_host):
    host = fresh_host(FakeBackend(), RaisesOnTuning(), autoload=False, catalog=False)
    assert pk.get_kernel("probe")(meta(16))[2] == [fake_config("fake.fast")]
    assert ("RaisesOnTuning", "pk_tuning_configs") in _failures(host)


def test_misspelt_hook_is_a_recorded_failure(fresh_host):
    host = fresh_host(FakeBackend(), MisspeltHook(), autoload=False, catalog=False)
    assert "pk_detect_devise" in _failures(host)[("MisspeltHook", "load")]
    assert "MisspeltHook" not in host.plugin_names()


def test_pk_plugins_module_that_fails_to_import(monkeypatch, fresh_host):
    monkeypatch.setenv("PK_PLUGINS", "pk_no_such_module_xyz")
    host = fresh_host(FakeBackend(), autoload=False, catalog=False)
    assert "ModuleNotFoundError" in _failures(host)[("pk_no_such_module_xyz", "load")]
    assert pk.get_kernel("probe")(meta(16))[0] == "fake.fast"


def test_pk_plugins_loads_a_module(monkeypatch, fresh_host):
    mod = types.ModuleType("pk_test_inline_plugin")

    @hookimpl
    def pk_register_variants(registry):
        registry.add_variant(Variant("probe", "inline.extra", launcher, priority=99))

    mod.pk_register_variants = pk_register_variants
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setenv("PK_PLUGINS", mod.__name__)
    host = fresh_host(FakeBackend(), autoload=False, catalog=False)
    assert host.sources[mod.__name__] == "PK_PLUGINS"
    assert pk.get_kernel("probe")(meta(16))[0] == "inline.extra"


def test_duplicate_variant_name_rejects_the_second_plugin(fresh_host):
    class Duplicate:
        @hookimpl
        def pk_register_variants(self, registry):
            registry.add_variant(Variant("probe", "fake.fast", launcher, priority=1000))

    host = fresh_host(FakeBackend(), Duplicate(), autoload=False, catalog=False)
    assert "already registered" in _failures(host)[("Duplicate", "pk_register_variants")]
    assert pk.get_kernel("probe")(meta(16))[0] == "fake.fast"


def test_variant_for_an_undeclared_kernel_fails_that_plugin(fresh_host):
    class Orphan:
        @hookimpl
        def pk_register_variants(self, registry):
            registry.add_variant(Variant("nokernel", "orphan.x", launcher))

    host = fresh_host(FakeBackend(), Orphan(), autoload=False, catalog=False)
    assert "undeclared kernel 'nokernel'" in _failures(host)[("Orphan", "pk_register_variants")]


def test_autoload_off_loads_no_entry_points(monkeypatch, fresh_host):
    monkeypatch.setenv("PK_DISABLE_PLUGIN_AUTOLOAD", "1")
    host = fresh_host()
    assert host.plugin_names() == ["portable_kernels.catalog"]
    with pytest.raises(DeviceError, match="PK_DISABLE_PLUGIN_AUTOLOAD"):
        pk.device_info("cpu")


def test_builtin_backends_load_through_entry_points(fresh_host):
    host = fresh_host()
    for name in ("nvidia", "amd", "iluvatar", "cpu"):
        assert host.sources[name].startswith("entry point portable_kernels_backends."), host.sources


def test_user_errors_from_plugins_propagate(fresh_host):
    class Refuses(FakeBackend):
        @hookimpl(tryfirst=True)
        def pk_detect_device(self, device):
            raise DeviceError("this fake device is switched off")

    host = fresh_host(Refuses(), autoload=False, catalog=False)
    with pytest.raises(DeviceError, match="switched off"):
        pk.get_kernel("probe")(meta(16))
    assert not host.failures


def test_a_kernel_declared_twice_identically_is_fine(fresh_host):
    class Redeclare:
        @hookimpl
        def pk_register_variants(self, registry):
            registry.add_kernel(KernelSpec("probe", "(x) -> out", probe_problem, "a fake", None))

    host = fresh_host(FakeBackend(), Redeclare(), autoload=False, catalog=False)
    assert not host.failures
    assert pk.list_kernels() == ["probe"]



def test_builtin_plugins_load_cleanly(fresh_host):
    # A built-in backend failing to register (a missing tuning function, a typo) would
    # otherwise only show as a variant that is never selected.
    host = fresh_host()
    assert host.failures == []
    assert {"cpu", "nvidia", "amd", "iluvatar", "portable_kernels.catalog"} <= set(host.plugin_names())


def test_failures_are_logged(fresh_host, caplog):
    with caplog.at_level("WARNING", logger="portable_kernels"):
        fresh_host(FakeBackend(), RaisesOnRegister(), autoload=False, catalog=False)
    assert "RaisesOnRegister failed in pk_register_variants" in caplog.text


def test_plugin_importing_kernel_modules_at_load_time(tmp_path):
    # Such a plugin is imported while the host is being built; it must not deadlock.
    (tmp_path / "pk_eager_plugin.py").write_text(
        "import portable_kernels.kernels.softmax as sm\n"
        "from portable_kernels import hookimpl, Variant\n"
        "@hookimpl\n"
        "def pk_register_variants(registry):\n"
        "    registry.add_variant(Variant('softmax', 'eager.copy', sm.launch, priority=-5))\n")
    env = dict(os.environ, PK_PLUGINS="pk_eager_plugin",
               PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", "import portable_kernels as pk; print(pk.list_variants('softmax'))"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "eager.copy" in proc.stdout


@pytest.mark.parametrize("value, words", [
    ("prob=generic", ("PK_VARIANT", "unknown kernel 'prob'", "known kernels: probe")),
    ("probe=fake.fsat", ("PK_VARIANT", "'fake.fsat'", "registered: fake.fast, fake.tma, generic")),
])
def test_pk_variant_naming_nothing_fails_when_the_host_is_built(monkeypatch, fresh_host, value, words):
    monkeypatch.setenv("PK_VARIANT", value)
    with pytest.raises(pk.ConfigurationError) as info:
        fresh_host(FakeBackend(), autoload=False, catalog=False)
    assert isinstance(info.value, ValueError)
    for word in words:
        assert word in str(info.value)


def test_pk_variant_mistake_names_the_failed_plugin_that_might_have_registered_it(monkeypatch, fresh_host):
    # The variant may be missing only because its plugin broke; say so.
    monkeypatch.setenv("PK_VARIANT", "probe=broken.half")
    with pytest.raises(pk.ConfigurationError, match="failed plugins: RaisesOnRegister"):
        fresh_host(FakeBackend(), RaisesOnRegister(), autoload=False, catalog=False)


@pytest.mark.parametrize("value", ["softmx=generic", "softmax=generc"])
def test_pk_variant_mistakes_reach_every_entry_point(monkeypatch, fresh_host, capsys, value):
    monkeypatch.setenv("PK_VARIANT", value)
    with pytest.raises(pk.ConfigurationError, match="PK_VARIANT"):
        pk.get_kernel("vector_add")
    with pytest.raises(pk.ConfigurationError, match="PK_VARIANT"):
        pk.explain("vector_add", device="cpu")
    assert cli.main(["info", "--device", "cpu"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: PK_VARIANT") and err.count("\n") == 1
