"""The split-K counters kept between launches (``kernels/_counters.py``): one buffer per
stream, its own per graph capture, fresh zeros where neither can be told; and the matmul
on kept counters, through every path that shares them."""
from __future__ import annotations

import pytest
import torch

from conftest import ON_CPU
from portable_kernels.kernels import _counters
from portable_kernels.kernels import matmul as mm
from test_matmul import _check, _plan_with, _rand

NEEDS_CUDA = pytest.mark.skipif(ON_CPU or torch.version.cuda is None,
                                reason="streams and graph capture need a CUDA GPU")


@pytest.fixture
def stream(monkeypatch):
    """Stands in for the current stream: set ``where["key"]`` (None: a device without
    streams) and ``where["capture"]`` (a capture id, or None when not capturing)."""
    where = {"key": ("dev", 1), "capture": None}
    monkeypatch.setattr(_counters, "_kept", {})
    monkeypatch.setattr(_counters, "_kept_scratch", {})
    monkeypatch.setattr(_counters, "_stream_key", lambda device: None if where["key"] is None
                        else (where["key"], where["capture"]))
    return where


def test_one_buffer_per_stream_grown_by_doubling(stream):
    first = _counters.kept_zeros(torch.device("cpu"), 10)
    assert first.dtype == torch.int32 and first.numel() == _counters._MIN and not first.any()
    assert _counters.kept_zeros(torch.device("cpu"), _counters._MIN) is first
    big = _counters.kept_zeros(torch.device("cpu"), first.numel() + 1)
    assert big is not first and big.numel() >= 2 * first.numel() and not big.any()
    assert _counters.kept_zeros(torch.device("cpu"), 3) is big
    stream["key"] = ("dev", 2)  # another stream: its own buffer
    other = _counters.kept_zeros(torch.device("cpu"), 3)
    assert other is not big and not other.any()
    stream["key"] = ("dev", 1)
    assert _counters.kept_zeros(torch.device("cpu"), 3) is big


def test_each_capture_gets_its_own_buffer(stream):
    eager = _counters.kept_zeros(torch.device("cpu"), 8)
    stream["capture"] = 7
    in_graph = _counters.kept_zeros(torch.device("cpu"), 8)
    assert in_graph is not eager
    assert _counters.kept_zeros(torch.device("cpu"), 8) is in_graph  # the same capture
    stream["capture"] = 8  # a second graph on the same stream: zeroed in that graph
    second = _counters.kept_zeros(torch.device("cpu"), 8)
    assert second is not in_graph and second is not eager
    stream["capture"] = None  # eager again: not a buffer a graph zeroes
    after = _counters.kept_zeros(torch.device("cpu"), 8)
    assert after is not second and after is not in_graph and not after.any()


def test_fresh_zeros_without_streams(stream):
    stream["key"] = None
    a, b = (_counters.kept_zeros(torch.device("cpu"), 5) for _ in range(2))
    assert a is not b and a.numel() == 5 and not a.any() and not b.any()


def test_scratch_is_kept_like_the_counters_apart_from_them(stream):
    """fp32 scratch (split-K partials): one buffer per stream and per capture, grown by
    doubling, never the counters' buffer; fresh memory where streams cannot be told."""
    cpu = torch.device("cpu")
    first = _counters.kept_scratch(cpu, 1000)
    assert first.dtype == torch.float32 and first.numel() >= 1000
    assert _counters.kept_scratch(cpu, 10) is first
    assert _counters.kept_zeros(cpu, 10).dtype == torch.int32  # a buffer of its own
    grown = _counters.kept_scratch(cpu, first.numel() + 1)
    assert grown is not first and grown.numel() >= 2 * first.numel()
    stream["capture"] = 3
    assert _counters.kept_scratch(cpu, 10) is not grown
    stream["key"] = None
    a, b = (_counters.kept_scratch(cpu, 7) for _ in range(2))
    assert a is not b and a.numel() == 7


def test_the_interpreter_and_other_devices_get_fresh_zeros():
    # The real key function: only CUDA-type devices have streams to keep buffers on.
    assert _counters._stream_key(torch.device("cpu")) is None
    a, b = (_counters.kept_zeros(torch.device("cpu"), 4) for _ in range(2))
    assert a is not b


def test_matmuls_of_different_splits_share_kept_counters(stream, device, gen):
    """Problems and split factors one after another on one kept buffer: each launch leaves
    its counters at zero for the next (on the interpreter too, through the stand-in
    stream)."""
    shapes = [(67, 45, 200), (130, 72, 264), (67, 45, 200)]
    for (m, n, k), split in zip(shapes, (2, 3, 4)):
        a, b = (_rand(gen, *shape, dtype=torch.float16, device=device) for shape in ((m, k), (k, n)))
        _check(mm.launch(_plan_with("generic", a, b, SPLIT_K=split), a, b), a, b)
        assert not _counters._kept[stream["key"]][1].any()
    assert len(_counters._kept) == 1
    assert len(_counters._kept_scratch) == 1  # the partial tiles' memory, kept too


@NEEDS_CUDA
def test_capture_ids_tell_captures_apart(device):
    s = torch.cuda.Stream(device)
    ids = []
    for _ in range(2):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            ids.append(_counters.capture_id(s.cuda_stream))
            torch.zeros(1, device=device)
    assert None not in ids and ids[0] != ids[1]
    assert _counters.capture_id(s.cuda_stream) is None  # not capturing


@NEEDS_CUDA
def test_split_k_on_streams_and_in_graphs(device, gen):
    """Two streams at once, and two graphs captured on one stream and replayed in the
    other order: each on counters of its own, and the results right."""
    a, b = (_rand(gen, *shape, dtype=torch.float16, device=device) for shape in ((16, 4096), (4096, 4096)))
    plan = _plan_with("generic", a, b, SPLIT_K=4)
    ref = mm.launch(plan, a, b)
    _check(ref, a, b)
    s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)
    torch.cuda.synchronize()
    outs = []
    for s in (s1, s2, s1, s2):
        with torch.cuda.stream(s):
            outs.append(mm.launch(plan, a, b))
    torch.cuda.synchronize()
    assert all(torch.equal(o, ref) for o in outs)
    keys = {k for k in _counters._kept if k[0] == a.device}
    assert (a.device, s1.cuda_stream) in keys and (a.device, s2.cuda_stream) in keys

    graphs, static = [], []
    capture = torch.cuda.Stream(device)
    for _ in range(2):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=capture):
            static.append((mm.launch(plan, a, b), mm.launch(plan, a, b)))
        graphs.append(g)
    for g in reversed(graphs):  # the second graph first: it zeroes its own counters
        g.replay()
    torch.cuda.synchronize()
    for pair in static:
        assert all(torch.equal(o, ref) for o in pair)
