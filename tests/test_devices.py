"""Detection by the built-in backends and emulated profiles.

Real detection of CUDA-like devices is exercised with ``torch.cuda`` property reads patched,
so every vendor's rule is checked on any machine.
"""
from __future__ import annotations

import types

import pytest
import torch

import portable_kernels as pk
from portable_kernels import KernelSpec, Variant, hookimpl
from portable_kernels.errors import VariantUnavailableError
from portable_kernels_backends import _common, amd, cpu, iluvatar, nvidia

from fakes import launcher, probe_problem

from conftest import ON_CPU


def _props(name, major, minor, sms=132, gcn=""):
    return _common.CudaProps(name, major, minor, sms, 232448, 32, gcn)


@pytest.fixture
def cuda_device(monkeypatch):
    """Pretend torch.cuda has a device described by the returned setter."""
    state = {}

    def set_device(props, hip=None, corex=False):
        state["props"] = props
        monkeypatch.setattr(_common, "props", lambda device: state["props"])
        monkeypatch.setattr(torch.version, "hip", hip)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: state["props"].name)
        if corex:
            monkeypatch.setattr(torch, "corex", types.SimpleNamespace(), raising=False)
        else:
            monkeypatch.delattr(torch, "corex", raising=False)

    return set_device


def _detect(device="cuda:0"):
    # The order the plugin host uses: tryfirst (amd, iluvatar), then nvidia (trylast).
    for backend in (amd, iluvatar, nvidia):
        info = backend.pk_detect_device(torch.device(device))
        if info is not None:
            return info
    return None


def test_nvidia_hopper_has_tma_and_warp_specialization(cuda_device):
    cuda_device(_props("NVIDIA H200", 9, 0))
    info = _detect()
    assert (info.vendor, info.arch, info.warp_size, info.num_sms) == ("nvidia", "sm_90", 32, 132)
    assert info.has("tensor_descriptor", "warp_specialize", "wgmma", "fp8", "bf16")


def test_nvidia_ampere_has_neither(cuda_device):
    cuda_device(_props("NVIDIA A100-SXM4-80GB", 8, 0, 108))
    info = _detect()
    assert info.arch == "sm_80" and info.has("mma", "bf16")
    assert not info.has("tensor_descriptor") and not info.has("warp_specialize") and not info.has("fp8")


def test_rocm_cdna_is_wave64(cuda_device):
    cuda_device(_props("AMD Instinct MI300X", 9, 4, 304, "gfx942:sramecc+:xnack-"), hip="6.2")
    info = _detect()
    assert (info.vendor, info.arch, info.warp_size) == ("amd", "gfx942", 64)
    # CDNA3's fp8 is the fnuz encoding, not NVIDIA's OCP one.
    assert info.has("wave64", "fp8_fnuz") and not info.has("fp8") and not info.has("tensor_descriptor")


def test_rocm_rdna_is_wave32(cuda_device):
    cuda_device(_props("AMD Radeon RX 7900 XTX", 11, 0, 96, "gfx1100"), hip="6.2")
    info = _detect()
    assert info.warp_size == 32 and not info.has("wave64")


@pytest.mark.parametrize("by", ["name", "torch.corex"])
def test_iluvatar_corex(cuda_device, by):
    name = "Iluvatar BI-V150" if by == "name" else "BI-V150"
    cuda_device(_props(name, 7, 1, 64), corex=(by == "torch.corex"))
    info = _detect()
    assert (info.vendor, info.arch, info.warp_size) == ("iluvatar", "ivcore71", 64)
    assert not info.has("tensor_descriptor") and not info.has("warp_specialize")


def test_backends_ignore_the_cpu():
    for backend in (amd, iluvatar, nvidia):
        assert backend.pk_detect_device(torch.device("cpu")) is None


@pytest.mark.skipif(not ON_CPU, reason="needs kernels running under the interpreter")
def test_cpu_backend_reports_the_interpreter():
    info = pk.device_info("cpu")
    assert info.vendor == "cpu" and info.has("interpreter") and not info.has("libdevice")


def test_cpu_tensors_without_the_interpreter_get_a_clear_error(monkeypatch):
    monkeypatch.setattr(cpu._interpreter, "active", lambda: False)
    monkeypatch.setattr(cpu._interpreter, "late_reason", lambda: None)
    with pytest.raises(pk.DeviceError, match="PK_INTERPRET=1"):
        cpu.pk_detect_device(torch.device("cpu"))


def test_interpreter_turned_on_too_late_is_explained(monkeypatch):
    monkeypatch.setattr(cpu._interpreter, "late_reason", lambda: "TRITON_INTERPRET was set after triton was imported")
    with pytest.raises(pk.DeviceError, match="after triton was imported"):
        cpu.pk_detect_device(torch.device("cpu"))


# --- emulation ----------------------------------------------------------------------------

class ProfileProbe:
    """Variants a real backend might register, to see what each profile selects."""

    @hookimpl
    def pk_register_variants(self, registry):
        registry.add_kernel(KernelSpec("probe", "(x) -> out", probe_problem))
        registry.add_variant(Variant("probe", "generic", launcher))
        registry.add_variant(Variant("probe", "t.hopper", launcher, priority=50,
                                     requires={"tensor_descriptor", "warp_specialize", "wgmma"}))
        registry.add_variant(Variant("probe", "t.ampere", launcher, priority=20, requires={"mma", "bf16"}))
        registry.add_variant(Variant("probe", "t.cdna", launcher, requires={"wave64"},
                                     priority=lambda d: 40 if d.vendor == "amd" else -1))
        registry.add_variant(Variant("probe", "t.corex", launcher,
                                     priority=lambda d: 100 if d.vendor == "iluvatar" else -1))


EXPECTED = {
    "h100": "t.hopper", "h200": "t.hopper", "a100": "t.ampere",
    "mi300x": "t.cdna", "mi250x": "t.cdna", "bi150": "t.corex", "bi100": "t.corex",
}


@pytest.mark.parametrize("profile", sorted(EXPECTED))
def test_every_profile_selects_its_variant(fresh_host, device, profile):
    fresh_host(ProfileProbe())
    with pk.emulate(profile):
        assert pk.explain("probe", device=device).variant == EXPECTED[profile]


def test_profiles_cover_the_issue_list(fresh_host):
    host = fresh_host()
    assert {"h100", "h200", "a100", "mi300x", "bi150"} <= set(host.profiles)


def test_bi150_profile(fresh_host, device):
    fresh_host()
    with pk.emulate("bi150"):
        info = pk.device_info(device)
    assert (info.vendor, info.warp_size, info.emulated) == ("iluvatar", 64, "bi150")
    assert not info.has("tensor_descriptor") and not info.has("warp_specialize")


def test_pk_emulate_environment_and_override(monkeypatch, fresh_host, device):
    monkeypatch.setenv("PK_EMULATE", "mi300x")
    fresh_host()
    assert pk.device_info(device).vendor == "amd"
    with pk.emulate(None):
        assert pk.device_info(device).emulated is None
    with pk.emulate("h100"):
        assert pk.device_info(device).arch == "sm_90"


def test_unknown_profile(fresh_host):
    fresh_host()
    with pytest.raises(ValueError, match="unknown emulation profile 'h900'; known: a100"):
        with pk.emulate("h900"):
            pass


def test_unknown_pk_emulate_is_a_configuration_error(monkeypatch, fresh_host, caplog):
    monkeypatch.setenv("PK_EMULATE", "h900")
    with caplog.at_level("WARNING", logger="portable_kernels"):
        with pytest.raises(pk.ConfigurationError, match=r"PK_EMULATE='h900'.*known profiles: a100, .*h100"):
            fresh_host()
    assert "failed" not in caplog.text  # a mistake in the environment, not a plugin failure


def test_emulated_selection_runs_on_the_real_device(fresh_host, device, gen):
    fresh_host()
    x = torch.randn(4, 37, generator=gen).to(device)
    with pk.emulate("bi150"):
        sel = pk.explain("softmax", x)
        out = pk.get_kernel("softmax")(x)
    assert sel.device.emulated == "bi150" and sel.executor.emulated is None
    torch.testing.assert_close(out, torch.softmax(x, -1))


def test_emulated_variant_the_executor_cannot_run(fresh_host, device):
    class NeedsFp8:
        @hookimpl
        def pk_register_variants(self, registry):
            registry.add_variant(Variant("softmax", "t.fp8only", launcher, priority=100, requires={"fp8", "wgmma"}))

    fresh_host(NeedsFp8())
    x = torch.randn(2, 8, device=device)
    if pk.device_info(device).has("fp8", "wgmma"):
        pytest.skip("the executing device can run the variant")
    with pk.emulate("h100"):
        assert pk.explain("softmax", x).variant == "t.fp8only"
        with pytest.raises(VariantUnavailableError, match="executing device"):
            pk.get_kernel("softmax")(x)


# --- device arguments ---------------------------------------------------------------------

class DetectionRecorder:
    """Records every device a detection hook is asked about, claiming none."""

    def __init__(self):
        self.asked = []

    @hookimpl(tryfirst=True)
    def pk_detect_device(self, device):
        self.asked.append(device)


@pytest.fixture
def no_cuda(monkeypatch):
    """torch as it is on a machine without a CUDA device, whatever this machine has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.mark.parametrize("call", ["device_info", "explain", "list_variants"])
@pytest.mark.parametrize("bad,message", [
    ("cuda", r"device 'cuda': torch sees no CUDA device on this machine \(torch.cuda.is_available\(\) "
             r"is False\); devices here: cpu$"),
    (torch.device("cuda", 1), r"device 'cuda:1': torch sees no CUDA device"),
    ("gpu", r"device 'gpu': not a torch device .*; devices here: cpu$"),
    (2.5, r"device 2.5: not a torch device"),
    ("opengl", r"device 'opengl': torch has no torch.opengl module"),
])
def test_bad_device_arguments(fresh_host, no_cuda, call, bad, message):
    recorder = DetectionRecorder()
    host = fresh_host(recorder)
    run = {"device_info": lambda: pk.device_info(bad),
           "explain": lambda: pk.explain("softmax", device=bad),
           "list_variants": lambda: pk.list_variants("softmax", bad)}[call]
    with pytest.raises(pk.DeviceError, match=message):
        run()
    # Checked before any backend looked: none is recorded as failed, none is disabled.
    assert recorder.asked == [] and host.failures == []


def test_device_index_past_the_count(fresh_host, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    fresh_host()
    with pytest.raises(pk.DeviceError, match=r"^device 'cuda:2': index 2 is out of range: torch sees 2 "
                       r"CUDA devices; devices here: cpu, cuda:0, cuda:1$"):
        pk.device_info("cuda:2")


def test_kernel_calls_do_not_resolve_devices(fresh_host, monkeypatch, device):
    """Validation belongs to the calls that take a device argument; a kernel call gets its
    device from its tensors and stays a cache lookup."""
    from portable_kernels import dispatch

    fresh_host()
    add = pk.get_kernel("vector_add")
    x = torch.ones(5, device=device)
    add(x, x)

    def refuse(device):
        raise AssertionError("a kernel call resolved a device argument")

    monkeypatch.setattr(dispatch, "_resolve_device", refuse)
    assert add(x, x).sum().item() == 10
    assert add(torch.ones(7, device=device), torch.ones(7, device=device)).sum().item() == 14
