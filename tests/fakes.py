"""Fake plugins for testing the dispatch layer alone (pluggy's own test style).

They detect the ``meta`` device, whose tensors cost nothing, and their launchers return
the variant's name, switches and configs instead of running Triton.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from portable_kernels import DeviceInfo, KernelSpec, Variant, hookimpl


class Problem(NamedTuple):
    device: torch.device
    dtype: torch.dtype
    aligned: bool


def probe_problem(x):
    return Problem(x.device, x.dtype, x.shape[-1] % 8 == 0)


def launcher(plan, x):
    return plan.variant.name, plan.switches, plan.configs


def fake_config(variant_name: str) -> triton.Config:
    """The config FakeBackend's ``pk_tuning_configs`` gives ``variant_name``."""
    return triton.Config({"FAKE_CONFIG_FOR": variant_name})


FAKE_CAPS = frozenset({"mma", "bf16", "atomics"})


def fake_device(caps=FAKE_CAPS, vendor="fakevendor") -> DeviceInfo:
    return DeviceInfo(vendor, "fk1", "Fake Accelerator", 32, 4, 65536, "0", caps, backend="fake")


class FakeBackend:
    """Detects the meta device and registers a 'probe' kernel with three variants."""

    def __init__(self, caps=FAKE_CAPS):
        self.caps = caps
        self.detect_calls = 0
        self.accept_calls = 0

    @hookimpl
    def pk_detect_device(self, device):
        if device.type != "meta":
            return None
        self.detect_calls += 1
        return fake_device(self.caps)

    @hookimpl
    def pk_register_variants(self, registry):
        registry.add_kernel(KernelSpec("probe", "(x) -> out", probe_problem, "a fake", None))

        def aligned_only(problem, device):
            self.accept_calls += 1
            return None if problem.aligned else "needs the last dimension to be a multiple of 8"

        registry.add_variant(Variant("probe", "generic", launcher))
        registry.add_variant(Variant("probe", "fake.fast", launcher, priority=10, accepts=aligned_only,
                                     switches={"FAST": True}))
        registry.add_variant(Variant("probe", "fake.tma", launcher, priority=20,
                                     requires={"tensor_descriptor"}))

    @hookimpl
    def pk_tuning_configs(self, kernel, variant, device):
        return [fake_config(variant.name)]


def meta(n=16, dtype=torch.float32):
    return torch.empty(3, n, device="meta", dtype=dtype)


def tuned_configs():
    import triton

    return [triton.Config({"BLOCK_SIZE": 256}, num_warps=1), triton.Config({"BLOCK_SIZE": 512}, num_warps=1)]


def tuned_vector_add(device, bench_calls: list, plan=None, n: int = 1000):
    """A real vector_add launch through a plan's autotuner over :func:`tuned_configs`,
    as a GPU launch is tuned, with a deterministic timer that appends to ``bench_calls``
    and prefers the config timed last (the larger block). Returns the autotuner."""
    import triton

    from portable_kernels import Variant
    from portable_kernels.kernels import vector_add
    from portable_kernels.launch import LaunchPlan

    if plan is None:
        plan = LaunchPlan(Variant("vector_add", "generic", vector_add.launch), fake_device(),
                          tuned_configs(), {})

    def do_bench(kernel_call, quantiles=None):
        bench_calls.append(1)
        kernel_call()
        return [1.0 / len(bench_calls)] * 3

    kernel = plan.autotuned(vector_add._vector_add_kernel, key=["n_elements"], do_bench=do_bench)
    x = torch.randn(n, device=device)
    out = torch.empty_like(x)
    kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_SIZE"]),)](x, x, out, n)
    torch.testing.assert_close(out, 2 * x)
    return kernel
