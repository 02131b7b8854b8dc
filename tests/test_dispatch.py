"""Selection, caching, overrides and errors of the dispatch layer, with fake plugins.

The fakes follow pluggy's own test style: small classes whose methods are hook
implementations. They detect the ``meta`` device, whose tensors cost nothing, and their
launchers return the variant's name instead of running Triton, so these tests check the
layer alone.
"""
from __future__ import annotations

import pytest
import torch

import portable_kernels as pk
from portable_kernels import KernelSpec, Variant, hookimpl, plugins
from portable_kernels.errors import DeviceError, NoVariantError, VariantUnavailableError

from fakes import FAKE_CAPS, FakeBackend, fake_config, fake_device, launcher, meta, probe_problem


@pytest.fixture
def fake(fresh_host):
    backend = FakeBackend()
    host = fresh_host(backend, autoload=False, catalog=False)
    return backend, host


def test_highest_priority_runnable_variant_wins(fake):
    name, switches, configs = pk.get_kernel("probe")(meta(16))
    assert name == "fake.fast"
    assert switches == {"FAST": True}
    assert configs == [fake_config("fake.fast")]


def test_problem_predicate_rejects_and_falls_back(fake):
    assert pk.get_kernel("probe")(meta(13))[0] == "generic"
    sel = pk.explain("probe", meta(13))
    reasons = {v.name: v.reason for v in sel.verdicts}
    assert sel.variant == "generic"
    assert "multiple of 8" in reasons["fake.fast"]
    assert "tensor_descriptor" in reasons["fake.tma"] and "lacks" in reasons["fake.tma"]


def test_requirements_met_makes_variant_runnable(fresh_host):
    fresh_host(FakeBackend(FAKE_CAPS | {"tensor_descriptor"}), autoload=False, catalog=False)
    assert pk.get_kernel("probe")(meta(16))[0] == "fake.tma"
    assert pk.list_variants("probe", "meta") == ["fake.tma", "fake.fast", "generic"]


def test_list_variants_without_device_lists_all(fake):
    assert pk.list_variants("probe") == ["fake.fast", "fake.tma", "generic"]
    assert pk.list_variants("probe", "meta") == ["fake.fast", "generic"]


def test_steady_state_is_a_cache_hit(fake):
    backend, host = fake
    probe = pk.get_kernel("probe")
    probe(meta(16))
    calls = (backend.detect_calls, backend.accept_calls)
    for _ in range(5):
        probe(meta(16))
    assert (backend.detect_calls, backend.accept_calls) == calls
    probe(meta(13))  # a new problem key: predicates run again, detection stays cached
    assert backend.accept_calls == calls[1] + 1
    assert backend.detect_calls == calls[0]


def test_use_variant_forces_and_restores(fake):
    probe = pk.get_kernel("probe")
    with pk.use_variant(probe="generic"):
        assert probe(meta(16))[0] == "generic"
        assert pk.explain("probe", meta(16)).forced
    assert probe(meta(16))[0] == "fake.fast"


def test_forced_variant_that_cannot_run_says_why(fake):
    with pk.use_variant(probe="fake.fast"):
        with pytest.raises(VariantUnavailableError, match="multiple of 8"):
            pk.get_kernel("probe")(meta(13))
    with pk.use_variant(probe="fake.tma"):
        with pytest.raises(VariantUnavailableError, match="tensor_descriptor"):
            pk.get_kernel("probe")(meta(16))


def test_use_variant_unknown_names(fake):
    with pytest.raises(KeyError, match="registered: fake.fast, fake.tma, generic"):
        with pk.use_variant(probe="nope"):
            pass
    with pytest.raises(KeyError, match="known kernels: probe"):
        with pk.use_variant(nokernel="generic"):
            pass


def test_pk_variant_environment(monkeypatch, fresh_host):
    monkeypatch.setenv("PK_VARIANT", "probe=generic")
    fresh_host(FakeBackend(), autoload=False, catalog=False)
    assert pk.get_kernel("probe")(meta(16))[0] == "generic"
    with pk.use_variant(probe="fake.fast"):  # the context wins over the environment
        assert pk.get_kernel("probe")(meta(16))[0] == "fake.fast"


def test_pk_variant_naming_an_unregistered_variant(monkeypatch, fresh_host):
    monkeypatch.setenv("PK_VARIANT", "probe=fake.nothere")
    with pytest.raises(pk.ConfigurationError, match="PK_VARIANT.*'fake.nothere'.*registered: fake.fast"):
        fresh_host(FakeBackend(), autoload=False, catalog=False)


def test_malformed_pk_variant(monkeypatch, fresh_host):
    monkeypatch.setenv("PK_VARIANT", "probe")
    with pytest.raises(ValueError, match="kernel=variant"):
        fresh_host(FakeBackend(), autoload=False, catalog=False)


def test_no_runnable_variant_lists_each_reason(fresh_host):
    class OnlyTma(FakeBackend):
        @hookimpl
        def pk_register_variants(self, registry):
            registry.add_kernel(KernelSpec("probe", "(x) -> out", probe_problem))
            registry.add_variant(Variant("probe", "fake.tma", launcher, requires={"tensor_descriptor"}))
            registry.add_variant(Variant("probe", "fake.fast", launcher,
                                         accepts=lambda p, d: None if p.aligned else "unaligned"))

    fresh_host(OnlyTma(), autoload=False, catalog=False)
    with pytest.raises(NoVariantError) as info:
        pk.get_kernel("probe")(meta(13))
    msg = str(info.value)
    assert "fake.tma: requires tensor_descriptor" in msg and "fake.fast: unaligned" in msg


def test_unknown_kernel_lists_known(fake):
    with pytest.raises(KeyError, match="unknown kernel 'nope'; known kernels: probe"):
        pk.get_kernel("nope")
    with pytest.raises(KeyError):
        pk.explain("nope")


def test_unknown_device_names_loaded_plugins(fake):
    with pytest.raises(DeviceError, match="no loaded backend recognizes device cpu"):
        pk.get_kernel("probe")(torch.empty(3, 16))


def test_explain_without_arguments_skips_predicates(fake):
    sel = pk.explain("probe", device="meta")
    assert sel.variant == "fake.fast" and sel.problem is None
    assert "fake.fast" in str(sel) and "why:" in str(sel)
    assert sel.to_dict()["variants"][0]["name"] == "fake.fast"


def test_ties_break_by_name_deterministically(fresh_host):
    class Tied(FakeBackend):
        @hookimpl
        def pk_register_variants(self, registry):
            registry.add_kernel(KernelSpec("probe", "(x) -> out", probe_problem))
            for name in ("fake.b", "fake.a", "generic"):
                registry.add_variant(Variant("probe", name, launcher, priority=5))

    fresh_host(Tied(), autoload=False, catalog=False)
    sel = pk.explain("probe", meta())
    assert sel.variant == "fake.a"
    assert "tie broken by name" in {v.name: v.reason for v in sel.verdicts}["fake.b"]


def test_priority_may_depend_on_the_device(fresh_host):
    class Vendor(FakeBackend):
        @hookimpl
        def pk_register_variants(self, registry):
            registry.add_kernel(KernelSpec("probe", "(x) -> out", probe_problem))
            registry.add_variant(Variant("probe", "generic", launcher))
            registry.add_variant(Variant(
                "probe", "fake.home", launcher,
                priority=lambda d: 100 if d.vendor == "fakevendor" else -10))

    fresh_host(Vendor(), autoload=False, catalog=False)
    assert pk.get_kernel("probe")(meta())[0] == "fake.home"


def test_variant_validates_itself():
    with pytest.raises(ValueError, match="unknown capabilities"):
        Variant("probe", "fake.x", launcher, requires={"tma"})
    with pytest.raises(ValueError, match="'<backend>.<variant>'"):
        Variant("probe", "Fake Variant", launcher)
    with pytest.raises(TypeError, match="launch must be callable"):
        Variant("probe", "fake.x", None)


def test_kernel_spec_runtime_names_arguments_of_its_problem():
    """A per-call argument (a seed) is named as the problem function names it; a typo is an
    error at registration, not at the first call."""
    from portable_kernels.registry import KernelSpec

    def problem(x, p, seed):
        return x

    assert KernelSpec("probe", "(x, p, seed)", problem, runtime=("seed",)).runtime == ("seed",)
    with pytest.raises(ValueError, match=r"runtime names \['sed'\]"):
        KernelSpec("probe", "(x, p, seed)", problem, runtime=("sed",))


def test_register_capability_extends_the_vocabulary():
    pk.register_capability("acme_sparse", "Acme sparse tensor cores")
    Variant("probe", "acme.sparse", launcher, requires={"acme_sparse"})
    with pytest.raises(ValueError, match="already defined"):
        pk.register_capability("acme_sparse", "something else")
    with pytest.raises(ValueError, match="lower-case identifier"):
        pk.register_capability("Bad Word", "x")


def test_device_info_rejects_unknown_capabilities():
    with pytest.raises(ValueError, match="unknown capabilities"):
        fake_device(frozenset({"warp_specialise"}))
    info = fake_device()
    assert info.has("mma", "bf16") and not info.has("fp8")
    assert info.fingerprint == "fakevendor-fk1-Fake_Accelerator-4sm-triton0"


def test_host_swap_rebinds_existing_handles(fresh_host):
    fresh_host(FakeBackend(), autoload=False, catalog=False)
    probe = pk.get_kernel("probe")
    assert probe(meta(16))[0] == "fake.fast"
    fresh_host(FakeBackend(FAKE_CAPS | {"tensor_descriptor"}), autoload=False, catalog=False)
    assert probe(meta(16))[0] == "fake.tma"
    assert plugins.host().plans["probe"]  # the new host's cache is the one filled


def test_forced_explain_names_rivals_plainly(fake):
    with pk.use_variant(probe="generic"):
        sel = pk.explain("probe", meta(16))
    reasons = {v.name: v.reason for v in sel.verdicts}
    assert sel.variant == "generic" and reasons["generic"] == "forced by use_variant/PK_VARIANT"
    assert reasons["fake.fast"] == "runnable, passed over for generic"
