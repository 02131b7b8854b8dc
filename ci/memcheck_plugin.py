"""pytest plugin for ``ci/memcheck-cuda.sh``: what the test suite needs under memcheck.

- **The autotuner runs each config once, untimed.** Under compute-sanitizer every kernel
  runs many times slower, and a timing is meaningless. Triton's benchmarker would still
  launch each config about ten times, each behind a 256 MB cache-flush memset: a test that
  tuned a problem took minutes. Here each config is launched once (so the sanitizer still
  checks every config the autotuner considers, on the test's shapes) and reported as fast
  as the others, so the first is kept; the test then launches it and checks its results as
  usual. A test that gives the autotuner its own timer keeps it.
- **Tests that capture CUDA graphs skip**, with the reason: the memcheck run turns
  PyTorch's caching allocator off (so that overruns are seen), and an allocation during
  capture then calls ``cudaMalloc``, which capture forbids.
- **Tests that time a spinning kernel against the host skip**: the sanitizer serializes
  launches, so what they measure does not hold under it.
"""
from __future__ import annotations

import portable_kernels  # noqa: F401  (first: it chooses the interpreter before triton loads)

import pytest  # noqa: E402
import torch  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402


def _once(fn, quantiles=None, **kwargs):
    fn()
    return [1.0, 1.0, 1.0] if quantiles else 1.0


def _skip_graph_capture(self, *args, **kwargs):
    pytest.skip("captures a CUDA graph: memcheck runs turn PyTorch's caching allocator off, "
                "and capture forbids the cudaMalloc an allocation then makes")


def _skip_sleep(*args, **kwargs):
    pytest.skip("times a spinning kernel against the host: not meaningful under the sanitizer")


def pytest_configure(config):
    # A property is a data descriptor: it wins over the benchmarker Triton's cached_property
    # may already have stored on an instance.
    Autotuner.do_bench = property(lambda self: getattr(self, "_do_bench", None) or _once)
    torch.cuda.graph.__enter__ = _skip_graph_capture
    torch.cuda._sleep = _skip_sleep
