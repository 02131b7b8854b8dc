"""The NVIDIA backend's C launcher (``backends/nvidia/launcher.c``): which kernels it takes,
how it packs each kind of parameter (on any machine with a C compiler), and on an NVIDIA GPU
under Triton 3.6 its launches against Triton's own."""
from __future__ import annotations

import dataclasses
import struct
import types
import weakref

import pytest
import torch
import triton
import triton.language as tl

import portable_kernels as pk
from portable_kernels import _direct
from portable_kernels_backends import nvidia
from portable_kernels.testing import assert_close, tolerance
from portable_kernels_backends.nvidia import launcher


def _module():
    mod = launcher.module()
    if mod is None:
        pytest.skip("no C compiler here: the NVIDIA backend keeps Triton's launcher")
    return mod


def test_kinds_follow_tritons_signature():
    sig = {"x": "*fp16", "flag": "i1", "n": "i32", "big": "i64", "u": "u64", "s": "fp32",
           "h": "fp16", "b": "bf16", "d": "fp64", "one": "constexpr"}
    assert launcher.kinds(sig) == "PbilLfeEdC"
    assert launcher.kinds({"desc": "tensordesc<fp16[64, 64]>"}) is None
    assert launcher.kinds({"pair": ("*fp32", "i32")}) is None


def _kernel(**meta):
    defaults = dict(num_ctas=1, global_scratch_size=0, profile_scratch_size=0, tensordesc_meta=None,
                    launch_cooperative_grid=False, launch_pdl=False, num_warps=4, shared=0)
    return types.SimpleNamespace(metadata=types.SimpleNamespace(**{**defaults, **meta}),
                                 src=types.SimpleNamespace(signature={"x": "*fp32", "n": "i32"}))


@pytest.mark.parametrize("meta", [{"num_ctas": 2}, {"global_scratch_size": 128},
                                  {"global_scratch_size": 128, "global_scratch_align": 1024},
                                  {"profile_scratch_size": 64}, {"launch_pdl": True},
                                  {"launch_cooperative_grid": True}, {"tensordesc_meta": [{}]}])
def test_kernels_needing_what_it_leaves_out_keep_tritons_launcher(meta, monkeypatch):
    """(Global scratch: off by default, and never past the allocator's alignment.)"""
    if "global_scratch_align" in meta:
        monkeypatch.setenv("PK_C_LAUNCHER_SCRATCH", "1")
    assert launcher.make(_kernel(**meta)) is None


def test_the_hook_answers_for_nvidia_devices_under_a_verified_triton(monkeypatch):
    h100 = nvidia.pk_emulation_profiles()["h100"]
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    assert nvidia.pk_binary_launcher(h100) is launcher.make
    monkeypatch.setenv("PK_C_LAUNCHER", "0")
    assert nvidia.pk_binary_launcher(h100) is None
    monkeypatch.delenv("PK_C_LAUNCHER")
    monkeypatch.setattr(triton, "__version__", "3.9.0")  # launch protocol not checked there
    assert nvidia.pk_binary_launcher(h100) is None
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    assert nvidia.pk_binary_launcher(dataclasses.replace(h100, vendor="amd")) is None


def test_packing_of_every_kind():
    """Each parameter in an 8-byte slot with the bytes the kernel reads, constexprs left
    out, then the two null scratch pointers."""
    mod = _module()
    t = torch.zeros(4)
    packed = mod.pack("PPPbhilBHILfeEdC", t, None, 12345, True, -300, -7, 2**40, 200, 60000,
                      2**32 - 1, 2**64 - 1, 1.5, 0.333, 1.5, 2.5, 99)
    slots = [packed[i:i + 8] for i in range(0, len(packed), 8)]
    assert len(slots) == 15 + 2
    want = [struct.pack("<Q", t.data_ptr()), struct.pack("<Q", 0), struct.pack("<Q", 12345),
            struct.pack("<b", 1), struct.pack("<h", -300), struct.pack("<i", -7),
            struct.pack("<q", 2**40), struct.pack("<B", 200), struct.pack("<H", 60000),
            struct.pack("<I", 2**32 - 1), struct.pack("<Q", 2**64 - 1), struct.pack("<f", 1.5),
            struct.pack("<e", 0.333), struct.pack("<f", 1.5)[2:], struct.pack("<d", 2.5)]
    for i, (got, expected) in enumerate(zip(slots, want)):
        assert got[:len(expected)] == expected, i
    assert slots[-2:] == [bytes(8), bytes(8)]


def test_integer_like_values_pack_as_ints():
    """numpy integers (and anything with ``__index__``) pack as Triton's launcher takes them."""
    np = pytest.importorskip("numpy")
    packed = _module().pack("iLI", np.int64(-5), np.uint64(2**63), np.int32(4096))
    assert packed[:24] == struct.pack("<iiQII", -5, 0, 2**63, 4096, 0)


@pytest.mark.parametrize("kinds, value, error", [
    ("i", 2**31, OverflowError), ("B", -1, OverflowError), ("h", 2**15, OverflowError),
    ("i", 1.5, TypeError), ("f", "x", TypeError), ("P", object(), AttributeError)])
def test_bad_values_raise(kinds, value, error):
    with pytest.raises(error):
        _module().pack(kinds, value)


def test_guards_decline_other_dtypes_and_alignments():
    """A call whose leading tensors differ in dtype or 16-byte alignment from the binary's
    returns False before the driver is needed (here there may be none)."""
    storage = torch.zeros(64, dtype=torch.float16)
    launch = _module().Launcher(0, 0, 128, 0, "PPi", ((torch.float16, True), (torch.float16, True)))
    for x in (storage[1:9], storage.float()[:8], None):
        assert launch(1, 1, 1, 0, x, storage[:8], 8) is False
    with pytest.raises(ValueError, match="guard 0"):
        _module().Launcher(0, 0, 128, 0, "iP", ((torch.float16, True),))


def test_global_scratch_is_kept_per_stream_and_fresh_while_capturing():
    """Device-side descriptors' global scratch: one buffer per (device, stream), reused
    while it is large enough, grown to at least twice its size when not; under a CUDA graph
    capture a fresh buffer per launch, the kept ones left alone (no graph holds an address
    that eager launches reuse)."""
    mod = _module()
    made = []

    def allocate(nbytes):
        made.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    dev, stream = 97, 0x5000  # a device and stream no real launch uses
    first = mod.scratch(allocate, dev, stream, 100, False)
    assert mod.scratch(allocate, dev, stream, 60, False) == first and made == [100]
    grown = mod.scratch(allocate, dev, stream, 150, False)
    assert made == [100, 200] and (dev, stream, 200) in mod.kept()
    assert mod.scratch(allocate, dev, stream, 200, False) == grown
    assert mod.scratch(allocate, dev, stream + 1, 10, False) != grown  # another stream
    assert made == [100, 200, 10]
    for _ in range(2):
        mod.scratch(allocate, dev, stream, 50, True)
    assert made == [100, 200, 10, 50, 50] and (dev, stream, 200) in mod.kept()
    assert mod.scratch(allocate, dev, stream, 200, False) == grown
    # Past 16 (device, stream) pairs the oldest buffers are replaced (and freed).
    alive = []

    def tracked(nbytes):
        t = torch.empty(nbytes, dtype=torch.uint8)
        alive.append(weakref.ref(t))
        return t

    for s in range(40):
        mod.scratch(tracked, dev + 1, 0x9000 + s, 64, False)
    assert len(mod.kept()) <= 16 and sum(r() is not None for r in alive) <= 16
    with pytest.raises(RuntimeError, match="null buffer"):
        mod.scratch(lambda n: torch.empty(0), dev, stream, 10_000, False)
    with pytest.raises(TypeError, match="bytes_per_program, allocate"):
        mod.Launcher(0, 0, 128, 0, "P", (), (128, None))


def test_a_call_with_the_wrong_argument_count_names_them():
    launch = _module().Launcher(0, 0, 128, 0, "PiC")
    with pytest.raises(TypeError, match="grid x, y, z, stream, then 3 kernel arguments"):
        launch(1, 1, 1, 0, torch.zeros(1), 3)
    with pytest.raises(ValueError, match="unknown parameter kind"):
        _module().Launcher(0, 0, 128, 0, "Pq")


@triton.jit
def _scalars(x_ptr, out_ptr, ints_ptr, n, big, scale, one, flag, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    y = tl.load(x_ptr + offs, mask=mask) * scale + one
    tl.store(out_ptr + offs, tl.where(flag, y, -y), mask=mask)
    tl.store(ints_ptr, big)
    tl.store(ints_ptr + 1, n.to(tl.int64))


def test_launches_match_tritons_on_the_gpu(device, gen):
    """A kernel with a pointer of each use, i32, i64, fp32, an integer Triton folds into a
    constexpr (1) and a bool, launched by Triton, then by the C launcher into poisoned
    outputs: the same results."""
    if device.type != "cuda" or torch.version.cuda is None or not launcher.available():
        pytest.skip("the C launcher runs on NVIDIA GPUs under Triton 3.6 only")
    x = torch.randn(100, generator=gen).to(device)
    outs = {}
    for how in ("triton", "c"):
        out = torch.full((128,), float("nan"), device=device)
        ints = torch.full((2,), -1, dtype=torch.int64, device=device)
        args = (x, out, ints, 100, 2**40 + 3, 0.5, 1, False)
        compiled = _scalars[(1,)](*args, BLOCK=128)
        if how == "c":
            launch = launcher.make(compiled, tuple((t.dtype, True) for t in args[:3]))
            assert launch is not None and launcher.kinds(compiled.src.signature).count("C") == 2
            out.fill_(float("nan"))
            ints.fill_(-1)
            assert launch(1, 1, 1, torch.cuda.current_stream().cuda_stream, *args, 128) is True
        torch.cuda.synchronize()
        outs[how] = (out.clone(), ints.clone())
    want = -(x.double() * 0.5 + 1)
    torch.testing.assert_close(outs["c"][0][:100].double(), want, rtol=1e-6, atol=1e-6)
    assert torch.isnan(outs["c"][0][100:]).all()  # masked lanes untouched
    assert outs["c"][1].tolist() == [2**40 + 3, 100]
    assert torch.equal(outs["c"][1], outs["triton"][1])


def test_family_calls_go_through_it_on_the_gpu(device, gen):
    """On an NVIDIA GPU under Triton 3.6 the direct launches of a family use the C launcher."""
    if device.type != "cuda" or torch.version.cuda is None or not launcher.available():
        pytest.skip("the C launcher runs on NVIDIA GPUs under Triton 3.6 only")
    x, y = (torch.randn(5000, generator=gen).to(device, torch.float16) for _ in range(2))
    add = pk.get_kernel("vector_add")
    for _ in range(3):
        out = add(x, y)
    torch.testing.assert_close(out, (x.float() + y.float()).half())
    assert _entries(add) and all(e.launch is not None for e in _entries(add))


def _entries(handle) -> list:
    return [e for p in set(handle._cache.values()) for d in p._tuned.values()
            if isinstance(d, _direct.DirectLaunch) for e in d.entries.values()]


def test_attention_calls_go_through_it_on_the_gpu(device, gen, monkeypatch, request):
    """flash_attn and flash_attn_varlen on an NVIDIA GPU: every binary a call launches goes
    through the C launcher, those building device-side descriptors (global scratch) too,
    with the results of the reference."""
    if device.type != "cuda" or torch.version.cuda is None or not launcher.available():
        pytest.skip("the C launcher runs on NVIDIA GPUs under Triton 3.6 only")
    from portable_kernels.kernels import flash_attn_varlen as fv

    from portable_kernels import plugins

    monkeypatch.setenv("PK_C_LAUNCHER_SCRATCH", "1")
    # Plans made before hold launchers made without it; those made here must not outlive it.
    plugins.host().clear_caches()
    request.addfinalizer(plugins.host().clear_caches)
    args, kwargs = fv.inputs("100+300+7x8x64", torch.float16, device)
    varlen = pk.get_kernel("flash_attn_varlen")
    for _ in range(3):
        out = varlen(*args, **kwargs)
    want = fv.reference(*(a.double() if torch.is_tensor(a) and a.is_floating_point() else a
                          for a in args), **kwargs)
    assert_close(out, want, tolerance(torch.float16, "attention"))
    attn = pk.get_kernel("flash_attn")
    q, k, v = (torch.randn(1, 8, 2048, 128, generator=gen).to(device, torch.bfloat16)
               for _ in range(3))
    for _ in range(3):
        attn(q, k, v, causal=True)
    entries = _entries(varlen) + _entries(attn)
    assert entries and all(e.launch is not None for e in entries)
    scratch = [e for e in entries if getattr(e.kernel.metadata, "global_scratch_size", 0)]
    print(f"{len(scratch)} of {len(entries)} binaries take global scratch")


@triton.jit
def _tile_copy(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    # A device-side descriptor per program: the kernel takes Triton's global scratch.
    desc = tl.make_tensor_descriptor(x_ptr, shape=[n, BLOCK], strides=[BLOCK, 1],
                                     block_shape=[BLOCK, BLOCK])
    pid = tl.program_id(0)
    tile = desc.load([pid * BLOCK, 0])
    offs = pid * BLOCK + tl.arange(0, BLOCK)[:, None]
    tl.store(out_ptr + offs * BLOCK + tl.arange(0, BLOCK)[None, :], tile * 2, mask=offs < n)


def test_global_scratch_launches_eagerly_and_in_a_graph_on_the_gpu(device, gen, monkeypatch):
    """A kernel building device-side descriptors, launched by the C launcher eagerly (the
    stream's kept scratch), then captured into a CUDA graph (fresh scratch) and replayed
    with new input values, beside eager launches on the same stream: the results of
    Triton's launch."""
    if device.type != "cuda" or torch.version.cuda is None or not launcher.available():
        pytest.skip("the C launcher runs on NVIDIA GPUs under Triton 3.6 only")
    if torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("device-side tensor descriptors need a Hopper GPU or newer")
    from portable_kernels.kernels import _host

    monkeypatch.setenv("PK_C_LAUNCHER_SCRATCH", "1")
    n, block = 200, 32
    grid = (triton.cdiv(n, block), 1, 1)
    x = torch.randn(n, block, generator=gen).to(device)
    out = torch.full_like(x, float("nan"))
    with _host.scratch_allocator(device):
        compiled = _tile_copy[grid[:1]](x, out, n, BLOCK=block)
    assert compiled.metadata.global_scratch_size > 0
    torch.testing.assert_close(out, x * 2)
    launch = launcher.make(compiled, ((x.dtype, True), (out.dtype, True)))
    assert launch is not None
    stream = torch.cuda.current_stream().cuda_stream
    out.fill_(float("nan"))
    assert launch(*grid, stream, x, out, n, block) is True
    torch.cuda.synchronize()
    torch.testing.assert_close(out, x * 2)
    assert any(s == stream for _, s, _ in launcher.module().kept())

    side = torch.cuda.Stream(device)
    graph = torch.cuda.CUDAGraph()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        launch(*grid, side.cuda_stream, x, out, n, block)  # warm on the capture's stream
        side.synchronize()
        with torch.cuda.graph(graph, stream=side):
            launch(*grid, side.cuda_stream, x, out, n, block)
    torch.cuda.current_stream().wait_stream(side)
    other = torch.full_like(x, float("nan"))
    for _ in range(3):
        x.copy_(torch.randn(n, block, generator=gen))
        out.fill_(float("nan"))
        graph.replay()
        launch(*grid, stream, x, other, n, block)  # eager, beside the replay
        torch.cuda.synchronize()
        torch.testing.assert_close(out, x * 2)
        torch.testing.assert_close(other, x * 2)
