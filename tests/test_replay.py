"""Replays of seen calls (``portable_kernels._replay``): every family that opts in gives
the full path's result, bit for bit, on new inputs of a recorded signature (its
allocations poisoned, so an element no replayed launch writes shows); calls that do
anything but allocate, view and launch are never replayed; and the signature tells apart
every call that could take another path."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import types

import pytest
import torch

import portable_kernels as pk
from portable_kernels import _direct, _replay, launch, plugins
from portable_kernels.kernels import _host
from conftest import ON_CPU
from test_direct import _grid, _Jit, cuda_stand_ins  # noqa: F401 (a fixture)

#: A small call per family whose variants replay: (kernel, shape string for its
#: ``inputs``, dtype); flash_attn has no ``inputs``.
CASES = [
    ("vector_add", "100", torch.float16), ("softmax", "5x70", torch.float16),
    ("layer_norm", "6x40", torch.bfloat16), ("rms_norm", "6x40", torch.float16),
    ("add_rms_norm", "6x40", torch.float16), ("swiglu", "6x40", torch.float16),
    ("geglu", "6x40", torch.bfloat16), ("rope", "2x3x2x16", torch.float16),
    ("asin", "100", torch.float32), ("matmul", "16x16x16", torch.float16),
    ("cross_entropy", "5x70", torch.float16),
    ("fused_linear_cross_entropy", "6x16x40", torch.float16),
    ("kv_cache_write", "5x4x16x2x16", torch.float16),
    ("flash_attn", None, torch.float16), ("flash_attn_varlen", "7+3x2x16", torch.float16),
    ("flash_attn_with_kvcache", "2x1x4x2x40x16", torch.float16),
    ("dropout", "100", torch.float16), ("grouped_matmul", "3x16x24x32", torch.float16),
]


@pytest.fixture
def replaying(monkeypatch, fresh_host):
    """A plugin host whose handles record every replayable call, JIT launches included (the
    interpreter's), and whose replays allocate NaN-filled (or -1-filled) memory."""
    monkeypatch.setenv("PK_REPLAY", "1")

    def poisoned(*args, **kwargs):
        t = torch.empty_strided(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -1)

    monkeypatch.setattr(_replay, "ALLOCATE", poisoned)
    return fresh_host()


def _inputs(kernel: str, shape: str | None, dtype: torch.dtype, device) -> tuple:
    if kernel == "flash_attn":
        q = torch.randn(1, 2, 24, 16, device=device).to(dtype)
        return (q, torch.randn_like(q), torch.randn_like(q)), {"causal": True}
    return plugins.host().registry.kernels[kernel].inputs(shape, dtype, device)


def _clone(value):
    return value.clone() if isinstance(value, torch.Tensor) else value


def _assert_same(got, want, where: str) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert got.shape == want.shape and got.stride() == want.stride(), where
        assert got.dtype == want.dtype, where
        assert torch.equal(got, want), where
    elif isinstance(want, (tuple, list)):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


@pytest.mark.parametrize("kernel, shape, dtype", CASES, ids=[c[0] for c in CASES])
def test_replays_give_the_full_paths_result(replaying, device, kernel, shape, dtype):
    handle = pk.get_kernel(kernel)
    calls = 5
    with _replaying_matmul(kernel, device):
        _call_both_ways(handle, kernel, shape, dtype, device, calls)
    replays = plugins.host().replays[kernel]
    assert len(replays.recipes) == 1, replays.why
    recipe = next(iter(replays.recipes.values()))
    assert recipe is not None, replays.why
    # The first call compiles; the second records (a tuned kernel's first direct launch
    # may still compile, and then the third does); the rest replay.
    assert recipe.calls >= calls - 3, recipe.source


def _replaying_matmul(kernel: str, device):
    """matmul's Gluon variant (host-built TMA descriptors) does not replay, and the fused
    loss runs its products on matmul's plans: those two families are held to a variant
    that replays, sm_90's persistent TMA kernel where it is listed (device-side
    descriptors in lent scratch), else the portable one."""
    if kernel in ("matmul", "fused_linear_cross_entropy"):
        names = pk.list_variants("matmul", device)
        return pk.use_variant(matmul="nvidia.persistent_tma"
                              if "nvidia.persistent_tma" in names else "generic")
    return contextlib.nullcontext()


def _call_both_ways(handle, kernel, shape, dtype, device, calls: int) -> None:
    for i in range(calls):
        args, kwargs = _inputs(kernel, shape, dtype, device)
        full_args = [_clone(a) for a in args]
        full_kwargs = {k: _clone(v) for k, v in kwargs.items()}
        got = handle(*args, **kwargs)
        plan = handle.plan(*full_args, **full_kwargs)
        with launch.launch_guard(device) or contextlib.nullcontext():
            want = plan.launch(plan, *full_args, **full_kwargs)
        _assert_same(got, want, f"{kernel} call {i + 1}")
        # In-place families write their arguments: the same writes either way.
        for a, b in zip(args, full_args):
            _assert_same(a, b, f"{kernel} call {i + 1}, argument")


def _record(replays, fn, *args, **kwargs):
    """Two calls of ``fn(plan, *args, **kwargs)`` as a handle's full path makes them, on a
    stand-in plan of a replaying variant: the second one recorded."""
    plan = types.SimpleNamespace(
        _direct_launches=lambda: False, variant=types.SimpleNamespace(name="test", replay=True),
        device=types.SimpleNamespace(capabilities=frozenset({"interpreter"})))

    def full(args, kwargs):
        _replay.note_plan(plan, None)
        return fn(plan, *args, **kwargs)

    key = replays.signature(args, kwargs)[0]
    for _ in range(2):
        out = replays.call(key, full, args, kwargs)
    return key, out


def test_a_call_that_runs_another_operator_is_not_replayed(monkeypatch):
    monkeypatch.setenv("PK_REPLAY", "1")
    replays = _replay.Replays("test")

    def fills(plan, x):
        return torch.empty_like(x).fill_(1.0)

    key, out = _record(replays, fills, torch.zeros(4))
    assert torch.equal(out, torch.ones(4))
    assert replays.recipes[key] is None and "fill_" in replays.why[key]


def test_a_copy_is_not_a_view(monkeypatch):
    """contiguous and reshape may alias their input by their schemas, and copy it at times
    (a strided input): only a result in its input's storage is recorded as a view."""
    monkeypatch.setenv("PK_REPLAY", "1")
    replays = _replay.Replays("test")

    def copies(plan, x):
        return torch.ops.aten.contiguous.default(x)

    x = torch.arange(8.0)[::2]
    key, out = _record(replays, copies, x)
    assert torch.equal(out, x) and replays.recipes[key] is None, replays.explain(key)


def test_allocations_and_views_replay_without_the_launcher(monkeypatch):
    """A call that only allocates and makes views replays as such: the launcher does not
    run again, and the views keep their shapes, strides and offsets into the new tensors."""
    monkeypatch.setenv("PK_REPLAY", "1")
    replays = _replay.Replays("test")
    ran = []

    def views(plan, x, n):
        ran.append(n)
        out = torch.zeros(2 * n, dtype=x.dtype, device=x.device)
        return out.view(2, n), x[1:].t(), n

    x = torch.arange(12.0).reshape(3, 4)
    key, _ = _record(replays, views, x, 3)
    assert replays.recipes[key] is not None, replays.why
    y = torch.arange(12.0, 24.0).reshape(3, 4)
    out, tail, n = replays.recipes[key]((y, 3), {}, replays.signature((y, 3), {})[1])
    assert ran == [3, 3] and n == 3
    assert torch.equal(out, torch.zeros(2, 3)) and torch.equal(tail, y[1:].t())
    assert tail.stride() == y[1:].t().stride() and tail.data_ptr() == y[1].data_ptr()


def test_replayed_allocations_keep_dtype_device_and_strides(monkeypatch):
    """Replays allocate through a bound ``new_empty_strided`` of an empty tensor per dtype
    and device: each new tensor has the recorded dtype, device, shape and strides."""
    monkeypatch.setenv("PK_REPLAY", "1")
    replays = _replay.Replays("test")

    def allocations(plan, x):
        return (torch.empty_strided((3, 4), (1, 3), dtype=torch.float16, device=x.device),
                torch.empty(5, dtype=torch.int32, device=x.device), torch.empty_like(x))

    x = torch.randn(2, 7).t()
    key, _ = _record(replays, allocations, x)
    recipe = replays.recipes[key]
    assert recipe is not None, replays.why
    assert "_N" in recipe.source and "_empty_strided" not in recipe.source, recipe.source
    outs = recipe((x,), {}, [x.data_ptr()])
    want = allocations(None, x)
    for got, ref in zip(outs, want):
        assert (got.dtype, got.device, got.shape, got.stride()) == \
            (ref.dtype, ref.device, ref.shape, ref.stride())


def test_the_signature_tells_apart_calls_that_may_take_another_path():
    replays = _replay.Replays("test")
    x, y = torch.zeros(8), torch.zeros(8)

    def key(*args, **kwargs):
        sig = replays.signature(args, kwargs)
        return None if sig is None else sig[0]

    assert key(x, y) == key(torch.ones(8), torch.ones(8))
    assert key(x, y) != key(x, x)  # one tensor twice: the recording may use either index
    assert key(x, 1) != key(x, True) and key(x, 1) != key(x, 2)  # scalars by type and value
    assert key(x, y) != key(x, y.double()) and key(x, y) != key(x, torch.zeros(9))
    assert key(x, y) != key(x, torch.zeros(9)[1:])  # another address modulo 16
    assert key(x, y) != key(x, torch.zeros(16)[::2])  # other strides
    assert key(x, eps=1.0) != key(x, 1.0)  # keywords by name
    assert key(x, [1]) is None  # a list of scalars: not a signature
    assert key(x, [y]) != key(x, (y,)) and key(x, [y]) != key(x, y)  # a list of tensors is
    assert key(x, [y]) != key(x, [y, y])
    assert key(x, (1, 0)) != key(x, (1.0, 0))  # scalars in tuples by type too
    assert key(x, torch.zeros(8, device="meta")) is None  # tensors on two kinds of device
    w = torch.zeros(8, requires_grad=True)
    assert key(x, w) is None  # a gradient in play
    with torch.no_grad():
        assert key(x, w) is not None
    outside = key(x, y)
    with pk.use_variant(vector_add="generic"):
        assert key(x, y) != outside  # the selection context


@pytest.mark.parametrize("value", ["0", "", "direct"])
def test_replay_is_off_with_pk_replay_0(monkeypatch, fresh_host, device, value):
    """Off with PK_REPLAY=0; "direct", the default, records direct launches only, which
    the interpreter does not make."""
    monkeypatch.setenv("PK_REPLAY", value)
    fresh_host()
    handle = pk.get_kernel("vector_add")
    x = torch.randn(64, device=device).half()
    for _ in range(4):
        handle(x, x)
    replays = plugins.host().replays["vector_add"]
    recipes = replays.recipes
    if value in ("direct", "") and not ON_CPU:
        assert len(recipes) == 1 and next(iter(recipes.values())).calls == 2
    elif value in ("direct", ""):
        # Tried once and never recorded where torch is built with CUDA; not even tried
        # where no direct launch can be made (torch's CPU wheel).
        assert list(recipes.values()) == ([None] if replays.active else [])
        assert replays.active == pk._direct.supported("nvidia", False)
    else:
        assert not replays.active and not recipes


@pytest.mark.skipif(not ON_CPU, reason="the interpreter's JIT launches: CPU tensors")
def test_direct_mode_does_not_record_jit_launches(monkeypatch, fresh_host, device):
    """Where direct launches could be made (torch built with CUDA) but a call's launches go
    through Triton's JIT (the interpreter), "direct" tries the signature once and keeps it
    on the full path for good, saying why. (With torch's CPU wheel the handles are not
    even active: the test above.)"""
    monkeypatch.setenv("PK_REPLAY", "direct")
    # As torch built with CUDA answers: direct launches for compiled kernels, not interpreted.
    monkeypatch.setattr(_direct, "supported", lambda vendor, interpreted: not interpreted)
    fresh_host()
    handle = pk.get_kernel("vector_add")
    x = torch.randn(64, device=device).half()
    for _ in range(4):
        assert torch.equal(handle(x, x), x + x)
    replays = plugins.host().replays["vector_add"]
    assert replays.active and list(replays.recipes.values()) == [None]
    assert "launches through Triton's JIT" in next(iter(replays.why.values()))


def test_value_checks_run_when_asked_after_a_recording(replaying, monkeypatch, device):
    """A recipe whose call consulted PK_CHECK_VALUES declines while it is set, so the
    checks it skipped (here: a slot past the cache) run."""
    handle = pk.get_kernel("kv_cache_write")
    for _ in range(3):
        args, _ = _inputs("kv_cache_write", "5x4x16x2x16", torch.float16, device)
        handle(*args)
    (recipe,) = plugins.host().replays["kv_cache_write"].recipes.values()
    assert recipe is not None and recipe.calls == 1
    args[4][0] = 10_000
    monkeypatch.setenv("PK_CHECK_VALUES", "1")
    with pytest.raises(pk.errors.InputError, match="slot_mapping values"):
        handle(*args)


@pytest.mark.skipif(ON_CPU, reason="direct launches and their hooks: NVIDIA GPUs")
def test_a_launch_hook_takes_the_full_path(replaying, device):
    """Profilers read launches through Triton's hooks: a recipe declines while one is set."""
    import triton

    handle = pk.get_kernel("vector_add")
    x = torch.randn(4096, device=device).half()
    for _ in range(3):
        handle(x, x)
    (recipe,) = plugins.host().replays["vector_add"].recipes.values()
    seen = []
    triton.knobs.runtime.launch_enter_hook.add(seen.append)
    try:
        out = handle(x, x)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(seen.append)
    assert torch.equal(out, x + x) and len(seen) == 1 and recipe.calls == 1


def _stand_in_plan():
    """A plan of a replaying variant with direct launches, as the recorder checks it."""
    return types.SimpleNamespace(
        _direct_launches=lambda: True, variant=types.SimpleNamespace(name="test", replay=True),
        device=types.SimpleNamespace(capabilities=frozenset()))


def test_dropout_replays_each_calls_own_seed(replaying, device):
    """dropout's seed is a per-call argument (``KernelSpec.runtime``): one recipe serves
    every seed of an integer width, each call's mask its own seed's; a seed the full path
    rejects is rejected on a replayed signature too."""
    handle = pk.get_kernel("dropout")
    x = torch.randn(300, device=device).half()
    seeds = [7, 8, 2**31 - 1, 0, 123456, 2**40, 2**40 + 5, 2**63 - 1]
    for as_keyword in (False, True):
        for seed in seeds:
            got = handle(x, 0.5, seed=seed) if as_keyword else handle(x, 0.5, seed)
            plan = handle.plan(x, 0.5, seed)
            with launch.launch_guard(device) or contextlib.nullcontext():
                want = plan.launch(plan, x, 0.5, seed)
            _assert_same(got, want, f"seed {seed}")
        assert not torch.equal(handle(x, 0.5, 7), handle(x, 0.5, 8))
    replays = plugins.host().replays["dropout"]
    recipes = [r for r in replays.recipes.values() if r is not None]
    # int32 and int64 seeds, positional and keyword: four recipes, each replayed.
    assert len(recipes) == 4 and all(r.calls >= 1 for r in recipes), replays.why
    for bad in (-1, 2**63):
        with pytest.raises(pk.PortableKernelsError, match="seed must be in"):
            handle(x, 0.5, bad)


def test_dropouts_autograd_stages_replay_each_calls_seed(replaying, monkeypatch, device):
    """dropout's forward and backward stages under autograd replay with each call's seed:
    outputs and gradients equal the stages run in full, seed by seed."""
    handle = pk.get_kernel("dropout")
    x = torch.randn(300, device=device).half()
    grad = torch.randn(300, device=device).half()

    def run(seed):
        leaf = x.clone().requires_grad_()
        out = handle(leaf, 0.5, seed)
        return out.detach(), torch.autograd.grad(out, leaf, grad)[0]

    for seed in (11, 12, 13, 14, 2**40, 2**40 + 1, 2**40 + 2):
        got = run(seed)
        with monkeypatch.context() as m:
            m.setattr(_replay, "stage", lambda plan, fn, static, *a, per_call=None: fn(plan, *a, *static))
            want = run(seed)
        _assert_same(got, want, f"seed {seed}")
    assert not torch.equal(run(11)[1], run(12)[1])
    recipes = [r for s in _stage_replays(handle, (x, 0.5, 11), {}) for r in s.recipes.values()]
    # The forward's x and the backward's gradient have one signature: a recipe per seed
    # width, each replayed.
    assert len(recipes) == 2 and all(r is not None and r.calls >= 1 for r in recipes)


def test_a_per_call_integer_is_read_from_each_call(cuda_stand_ins, monkeypatch):  # noqa: F811
    """A direct launch's runtime scalar that is the call's per-call argument replays with
    each call's value; the recipe reads it from the call."""
    monkeypatch.setenv("PK_REPLAY", "direct")
    launched = []
    launch_ = _direct.DirectLaunch(_Jit(), {"BLOCK": 64}, direct=True, runtime=(3,),
                                   binary=lambda kernel, guards: lambda *a: launched.append(a) or True)
    plan = _stand_in_plan()

    def full(args, kwargs):
        _replay.note_plan(plan, None)
        x, seed = args
        out = torch.empty_like(x)
        launch_(_grid, (x, out, 8, int(seed)), {})
        return out

    replays = _replay.Replays("test", {1: "seed"})
    x = torch.randn(8).half()
    key = replays.signature((x, 5), {})[0]
    assert key == replays.signature((x, 6), {})[0] != replays.signature((x, 2**40), {})[0]
    assert replays.signature((x, -1), {})[0] != key  # the full path's check must see it
    for seed in (5, 6):
        replays.call(key, full, (x, seed), {})
    recipe = replays.recipes[key]
    assert recipe is not None and "args[1]" in recipe.source, replays.why
    launched.clear()
    recipe((x, 99), {}, [x.data_ptr()])
    assert launched[0][4 + 3] == 99


def _recorded_on_stand_ins(body, replayed: bool = True) -> tuple:
    """``(recipe, xs)``: the recipe of ``body(x)`` run as a handle's full path on a stand-in
    plan of a variant with direct launches, recorded at the second of three signature-equal
    fp16 inputs ``xs`` (the third is left for the caller's replay); with ``replayed``
    False, ``(why it was not recorded, xs)``."""
    plan = _stand_in_plan()

    def full(args, kwargs):
        _replay.note_plan(plan, None)
        return body(*args)

    replays = _replay.Replays("test")
    xs = [torch.randn(8).half() for _ in range(3)]
    keys = [replays.signature((x,), {})[0] for x in xs]
    assert keys[0] == keys[1] == keys[2]
    for x in xs[:2]:
        replays.call(keys[0], full, (x,), {})
    recipe = replays.recipes[keys[0]]
    if not replayed:
        assert recipe is None
        return replays.why[keys[0]], xs
    assert recipe is not None, replays.why
    return recipe, xs


def test_a_launch_with_a_runtime_scalar_is_not_recorded(cuda_stand_ins, monkeypatch):  # noqa: F811
    """A recipe holds a launch's scalars as recorded: a seed new on every call that is not
    one of the call's per-call arguments (``KernelSpec.runtime``) would be replayed stale."""
    monkeypatch.setenv("PK_REPLAY", "direct")
    launch = _direct.DirectLaunch(_Jit(), {"BLOCK": 64}, direct=True, runtime=(3,))

    def full(x):
        out = torch.empty_like(x)
        launch(_grid, (x, out, 8, 1234), {})
        return out

    why, _ = _recorded_on_stand_ins(full, replayed=False)
    assert "new on every call" in why


def test_direct_launches_replay_with_the_new_addresses(cuda_stand_ins, monkeypatch):  # noqa: F811
    """What a GPU replay runs, on stand-ins of a direct launch and its backend launcher:
    each launch gets the new call's addresses and the recorded scalars and constexprs; the
    allocations only launches use come from one workspace, each at an aligned offset; the
    result is a view of the new output."""
    monkeypatch.setenv("PK_REPLAY", "direct")
    launched, made = [], []

    def make(kernel, guards):
        made.append(guards)
        return lambda *args: launched.append(args) or True

    first, second = (_direct.DirectLaunch(_Jit(), {"BLOCK": 64}, direct=True, binary=make)
                     for _ in range(2))

    def full(x):
        out = torch.empty_like(x)
        partial, counts = torch.empty(8, dtype=torch.float32), torch.empty(3, dtype=torch.int32)
        first(_grid, (x, out, 8, 0.5), {})
        second(_grid, (partial, counts, 3, 2.0), {})
        return out.view(2, 4)

    recipe, xs = _recorded_on_stand_ins(full)
    launched.clear()
    out = recipe((xs[2],), {}, [xs[2].data_ptr()])
    (gx, gy, gz, stream, x_ptr, out_ptr, *rest), (_, _, _, _, partial, counts, *rest2) = launched
    assert (gx, gy, gz, stream) == (4, 1, 1, 1000) and rest == [8, 0.5, 64, True]
    assert x_ptr == xs[2].data_ptr() and out_ptr == out.data_ptr()
    assert out.shape == (2, 4) and out.dtype == torch.float16
    assert counts - partial == 512 and rest2 == [3, 2.0, 64, True]
    assert made[-1] == ()  # the replay's launcher checks nothing: the signature fixed it all
    assert first.launches == second.launches == 2  # a replay's launches count as direct ones
    assert "w = _N" in recipe.source  # the two launches' temporaries: one workspace


def test_a_kernel_with_global_scratch_replays_through_tritons_launcher(cuda_stand_ins,  # noqa: F811
                                                                        monkeypatch):
    """Device-side tensor descriptors take Triton's global scratch, which its launcher
    allocates per launch through the allocator lent to it (``_host.scratch_allocator``):
    the replay launches such a binary through Triton's launcher, lending the allocator."""
    from triton.runtime import _allocation

    monkeypatch.setenv("PK_REPLAY", "direct")
    fn = _Jit()
    fn.binary.metadata = types.SimpleNamespace(global_scratch_size=128, profile_scratch_size=0)
    lent = []
    fn.binary.run = lambda *args: lent.append((_allocation._allocator.get(), args))
    launch = _direct.DirectLaunch(fn, {"BLOCK": 64}, direct=True, binary=lambda *a: None)

    def full(x):
        out = torch.empty_like(x)
        launch(_grid, (x, out, 8, 0.5), {})
        return out

    recipe, xs = _recorded_on_stand_ins(full)
    lent.clear()
    out = recipe((xs[2],), {}, [xs[2].data_ptr()])
    ((allocator, args),) = lent
    assert isinstance(allocator, functools.partial) and allocator.func is _host._scratch
    assert allocator.args == (torch.device("cuda", 0),)
    assert args[:4] == (4, 1, 1, 1000) and args[9:11] == (xs[2].data_ptr(), out.data_ptr())
    # Lent for the launch only.
    assert not isinstance(_allocation._allocator.get(), functools.partial)


def test_a_table_of_addresses_is_rebuilt_with_the_new_calls(cuda_stand_ins, monkeypatch):  # noqa: F811
    """A table step (grouped_matmul's device table of its groups' addresses): the replay
    builds the table again from the recorded values, each address replaced by the new
    call's (an argument's, an allocation's; a temporary that only the table points at
    lives until the table's last launch), before the launch that reads it."""
    monkeypatch.setenv("PK_REPLAY", "direct")
    launched, built = [], []

    def build(values, device):
        built.append(list(values))
        return torch.tensor(values, dtype=torch.int64)

    launch = _direct.DirectLaunch(_Jit(), {"BLOCK": 64}, direct=True,
                                  binary=lambda kernel, guards: lambda *a: launched.append(a) or True)

    def full(x):
        out, tmp = torch.empty_like(x), torch.empty(4, dtype=torch.float32)
        values = [x.data_ptr(), out[2:].data_ptr(), tmp.data_ptr(), 7]  # a view's too
        table = _replay.table(build, values, x.device, lambda i: i < 3)
        launch(_grid, (table, out, 8, 0.5), {})
        return out

    recipe, xs = _recorded_on_stand_ins(full)
    launched.clear()
    built.clear()
    out = recipe((xs[2],), {}, [xs[2].data_ptr()])
    ((x_ptr, out_ptr, tmp_ptr, seven),) = built
    assert x_ptr == xs[2].data_ptr() and out_ptr == out.data_ptr() + 4 and seven == 7
    assert tmp_ptr not in (x_ptr, out_ptr)
    ((_, _, _, _, table_ptr, launched_out, *_),) = launched
    assert launched_out == out.data_ptr() and table_ptr != tmp_ptr
    assert recipe.source.index(" = _B") < recipe.source.index(".launches += 1")  # built first


def test_a_table_with_an_address_the_call_did_not_make_is_not_recorded(cuda_stand_ins,  # noqa: F811
                                                                         monkeypatch):
    monkeypatch.setenv("PK_REPLAY", "direct")
    elsewhere = torch.empty(4)
    launch = _direct.DirectLaunch(_Jit(), {"BLOCK": 64}, direct=True,
                                  binary=lambda kernel, guards: lambda *a: True)

    def full(x):
        out = torch.empty_like(x)
        table = _replay.table(lambda v, d: torch.tensor(v), [elsewhere.data_ptr()], x.device,
                              lambda i: True)
        launch(_grid, (table, out, 8, 0.5), {})
        return out

    why, _ = _recorded_on_stand_ins(full, replayed=False)
    assert "neither took nor allocated" in why


def test_workspace_shares_bytes_between_allocations_whose_launches_do_not_interleave():
    """(allocation, bytes, first step, last step) -> offsets: a chunk loop's temporaries
    (each used by its own launches only) share one place; one used across them does not."""
    places, total = _replay._places([(0, 512, 0, 1), (1, 512, 2, 3), (2, 1024, 1, 2), (3, 512, 4, 4)])
    offsets = dict(places)
    assert offsets[0] == offsets[1] == offsets[3] == 0  # steps 0-1, 2-3, 4: never at once
    assert offsets[2] >= 512 and total == offsets[2] + 1024  # lives across both chunks
    # Allocations no launch uses (first = last = -1) overlap nothing that launches.
    assert dict(_replay._places([(0, 512, 0, 0), (1, 512, -1, -1)])[0]) == {0: 0, 1: 0}


def test_a_replayed_chunk_loop_holds_one_chunk_at_a_time(replaying, device):
    """The fused loss frees each logits chunk before the next one allocates; its replay
    never holds every chunk at once (the whole (T, V) logits): JIT launches allocate each
    chunk before its first launch and drop it after its last; direct launches carve the
    chunks from one workspace at a shared place."""
    import re

    from portable_kernels.kernels import fused_linear_cross_entropy as flce

    handle = pk.get_kernel("fused_linear_cross_entropy")
    rows = 3 * flce.MIN_CHUNK_ROWS
    (hidden, weight, target), _ = flce.inputs(f"{rows}x16x40", torch.float16, device)
    with torch.no_grad(), _replaying_matmul("fused_linear_cross_entropy", device):
        want = handle(hidden, weight, target)
        for _ in range(3):
            assert torch.equal(handle(hidden, weight, target), want)
    (recipe,) = plugins.host().replays["fused_linear_cross_entropy"].recipes.values()
    assert recipe is not None and recipe.calls >= 1
    names = recipe.run.__globals__  # the constants the source names
    if workspace := re.search(r"^\s*w = _empty_strided\((_c\d+),", recipe.source, re.M):
        offsets = re.findall(r"^\s*q\d+ = qw(?: \+ (\d+))?$", recipe.source, re.M)
        assert len(offsets) > len(set(offsets)), recipe.source  # chunks at one place
        (nbytes,) = names[workspace[1]]
        assert nbytes < rows * 40 * hidden.element_size(), recipe.source
        return
    live, chunks, most = set(), 0, 0
    for line in recipe.source.splitlines():
        if made := re.search(r"\b(a\d+) = _empty_strided\((_c\d+),", line):
            if len(size := names[made[2]]) == 2 and size[1] == 40:  # a (rows, V) logits chunk
                live.add(made[1])
                chunks += 1
        elif dropped := re.search(r"del (a\d+)", line):
            live.discard(dropped[1])
        most = max(most, len(live))
    assert chunks >= 2 and most == 1, recipe.source


def test_signatures_seen_once_make_room_for_new_ones(monkeypatch):
    """Calls whose scalars change every time (a decode step's length) would fill every
    tracked slot: the signature seen longest ago makes room, and a repeated one records."""
    monkeypatch.setenv("PK_REPLAY", "1")
    monkeypatch.setattr(_replay, "MAX_KEYS", 4)
    replays = _replay.Replays("test")
    x = torch.zeros(4)
    for n in range(8):  # eight signatures, each seen once
        replays.call(replays.signature((x, n), {})[0], lambda args, kwargs: None, (x, n), {})
    assert len(replays.tries) == 4
    key, _ = _record(replays, lambda plan, x, n: torch.empty_like(x), x, 99)
    assert replays.recipes.get(key) is not None, replays.why


def test_a_plan_taken_inside_a_recorded_call_must_replay_too(monkeypatch, fresh_host, device):
    """A family that launches another's plan (the fused loss's products) is recorded only
    where that plan's variant replays as well."""
    monkeypatch.setenv("PK_REPLAY", "1")
    variants = fresh_host().registry.variants["matmul"]
    for name, variant in list(variants.items()):  # none of matmul's variants opts in here
        monkeypatch.setitem(variants, name, dataclasses.replace(variant, replay=False))
    replays = _replay.Replays("test")

    def nested(plan, x):
        pk.get_kernel("matmul").plan(x.view(2, 2), x.view(2, 2))
        return torch.empty_like(x)

    key, _ = _record(replays, nested, torch.zeros(4, device=device))
    assert replays.recipes.get(key) is None and "does not replay" in replays.why[key], replays.why


#: Families whose launchers run an autograd ``Function``: (kernel, shape, dtype, indices
#: of the arguments that take a gradient).
GRAD_CASES = [
    ("layer_norm", "6x40", torch.bfloat16, (0, 1, 2)), ("rms_norm", "6x40", torch.float16, (0, 1)),
    ("add_rms_norm", "6x40", torch.float16, (0, 1, 2)), ("swiglu", "6x40", torch.float16, (0, 1)),
    ("geglu", "6x40", torch.bfloat16, (0, 1)), ("rope", "2x3x2x16", torch.float16, (0, 1)),
    ("cross_entropy", "5x70", torch.float16, (0,)), ("flash_attn", None, torch.float16, (0, 1, 2)),
    ("flash_attn_varlen", "7+3x2x16", torch.float16, (0, 1, 2)),
]


def _stage_replays(handle, args, kwargs) -> list:
    plan = handle.plan(*args, **kwargs)
    return [r for r in plan._tuned.values() if isinstance(r, _replay.Replays)]


@pytest.mark.parametrize("kernel, shape, dtype, leaves", GRAD_CASES, ids=[c[0] for c in GRAD_CASES])
def test_autograd_stages_replay_with_the_full_paths_gradients(replaying, monkeypatch, device,
                                                             kernel, shape, dtype, leaves):
    """A call that needs a gradient is not replayed at the handle, but its Function's
    forward and backward stages are (``_replay.stage``): outputs and gradients equal those
    of the stages run in full, on poisoned allocations."""
    handle = pk.get_kernel(kernel)
    full_stage = _replay.stage

    def run(args, kwargs):
        args = [a.detach().clone().requires_grad_(i in leaves) if isinstance(a, torch.Tensor)
                else a for i, a in enumerate(args)]
        out = handle(*args, **kwargs)
        outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o.requires_grad]
        grads = torch.autograd.grad(outs, [args[i] for i in leaves],
                                    [torch.ones_like(o) for o in outs])
        return [o.detach() for o in outs], grads

    calls = 5
    for i in range(calls):
        args, kwargs = _inputs(kernel, shape, dtype, device)
        got = run(args, kwargs)
        with monkeypatch.context() as m:
            m.setattr(_replay, "stage", lambda plan, fn, static, *a: fn(plan, *a, *static))
            want = run(args, kwargs)
        assert _replay.stage is full_stage
        _assert_same(got, want, f"{kernel} call {i + 1}")
    recipes = [r for s in _stage_replays(handle, args, kwargs) for r in s.recipes.values()]
    why = [s.why for s in _stage_replays(handle, args, kwargs)]
    replayed = [r for r in recipes if r is not None]
    # Forward and backward, each recorded at its second call and replayed from the third.
    assert len(replayed) == 2, why
    assert all(r.calls >= calls - 3 for r in replayed), [r.source for r in replayed]


def test_the_call_that_records_allocates_nothing_of_its_own(monkeypatch, fresh_host, device):
    """A dispatch mode that counts a call's allocations (as users and our tests do) sees
    none of the recording's own: the empty tensor whose ``new_empty_strided`` replays
    allocate through is made where no mode sees it."""
    from allocations import Outputs

    monkeypatch.setenv("PK_REPLAY", "1")
    fresh_host()
    monkeypatch.setattr(_replay, "_allocators", {})  # the first recipe of a dtype makes one
    handle = pk.get_kernel("vector_add")
    x = torch.randn(100, device=device).half()
    handle(x, x.clone())  # compiles; the second call records
    with Outputs() as seen:
        handle(x, x.clone())
    (recipe,) = plugins.host().replays["vector_add"].recipes.values()
    assert recipe is not None, plugins.host().replays["vector_add"].why
    assert seen.new(shape=(0,)) == 0  # the allocator's empty tensor, unseen


def test_a_handle_whose_calls_never_repeat_rests(monkeypatch, fresh_host, device):
    """Calls that never repeat (a mixture-of-experts layer's group sizes) would each pay for
    a signature that finds nothing: after MISS_WINDOW of them with no replay, the handle's
    next REST calls take the full path without one; then it keys calls again."""
    monkeypatch.setenv("PK_REPLAY", "1")
    monkeypatch.setattr(_replay, "MISS_WINDOW", 4)
    monkeypatch.setattr(_replay, "REST", 3)
    fresh_host()
    handle = pk.get_kernel("vector_add")
    pairs = [(torch.randn(n, device=device), torch.randn(n, device=device)) for n in range(10, 18)]
    for x, y in pairs[:4]:  # four new signatures
        handle(x, y)
    replays = plugins.host().replays["vector_add"]
    assert replays.resting == 3
    keyed, key = [], replays.key
    monkeypatch.setattr(replays, "key", lambda *a: keyed.append(a) or key(*a))
    for x, y in pairs[4:7]:
        torch.testing.assert_close(handle(x, y), x + y)  # the full path computes them
    assert not keyed and replays.resting == 0
    handle(*pairs[7])
    assert len(keyed) == 1


def test_a_replay_in_the_window_keeps_a_handle_keying(monkeypatch, fresh_host, device):
    monkeypatch.setenv("PK_REPLAY", "1")
    monkeypatch.setattr(_replay, "MISS_WINDOW", 4)
    monkeypatch.setattr(_replay, "REST", 3)
    fresh_host()
    handle = pk.get_kernel("vector_add")
    x, y = torch.randn(64, device=device), torch.randn(64, device=device)
    for _ in range(3):  # seen, recorded, replayed
        handle(x, y)
    replays = plugins.host().replays["vector_add"]
    for n in (10, 11):  # with the first two, four calls missed: one replay among them
        handle(torch.randn(n, device=device), torch.randn(n, device=device))
    assert replays.resting == 0
    for n in (12, 13, 14, 15):  # four misses and no replay
        handle(torch.randn(n, device=device), torch.randn(n, device=device))
    assert replays.resting == 3
