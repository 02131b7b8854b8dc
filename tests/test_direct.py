"""Direct launches of tuned kernels (``portable_kernels._direct``): which calls may reuse a
compiled binary and which must go through Triton's JIT path again, on stand-ins for the
JIT function and its binary; on an NVIDIA GPU, the real launches against a reference."""
from __future__ import annotations

import types

import pytest
import torch
import triton
import triton.language as tl

import portable_kernels as pk
from portable_kernels import _direct, dispatch
from portable_kernels.kernels import matmul as matmul_module
from portable_kernels.testing import assert_close, tolerance
from test_layer_norm import _column_sum_tolerance
from test_matmul import _rand


class _Binary:
    """A stand-in CompiledKernel: records what its launcher receives."""

    function, packed_metadata = "function", "packed"

    def __init__(self):
        self.runs = []

    def run(self, *args):
        self.runs.append(args)


class _Jit:
    """A stand-in JITFunction of ``kernel(x, y, n, scale, BLOCK: constexpr, FLAG: constexpr
    = True)``: ``fn[grid](...)`` records the call and returns its binary."""

    def __init__(self):
        def param(name, constexpr=False, default=None):
            return types.SimpleNamespace(name=name, is_constexpr=constexpr,
                                         has_default=default is not None, default=default)

        self.params = [param("x"), param("y"), param("n"), param("scale"),
                       param("BLOCK", True), param("FLAG", True, True)]
        self.calls, self.binary = [], _Binary()

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            return self.binary
        return launch


@pytest.fixture
def cuda_stand_ins(monkeypatch):
    """The two CUDA calls a direct launch makes: the current device and its stream."""
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 1000 + index, raising=False)


def _grid(meta):
    return (triton.cdiv(256, meta["BLOCK"]),)


def _tensors(offset=0):
    storage = torch.zeros(64, dtype=torch.float16)
    return storage[offset:offset + 8], torch.zeros(8, dtype=torch.float16)


def test_seen_calls_launch_the_binary(cuda_stand_ins):
    fn = _Jit()
    launch = _direct.DirectLaunch(fn, {"BLOCK": 64, "num_warps": 4}, direct=True)
    x, y = _tensors()
    launch(_grid, (x, y, 8, 0.5), {})
    assert len(fn.calls) == 1 and not fn.binary.runs  # the first call compiles through Triton
    launch(_grid, (x, y, 8, 0.5), {})
    assert len(fn.calls) == 1 and launch.launches == 1
    # grid from the config, stream of the current device, no hooks, then every parameter:
    # the call's arguments and the constexprs (the default FLAG too).
    assert fn.binary.runs == [(4, 1, 1, 1000, "function", "packed", None, None, None, x, y, 8, 0.5, 64, True)]


def test_runtime_scalars_reuse_one_binary_per_integer_width(cuda_stand_ins):
    """A runtime argument (a seed, new on every call) is not keyed by value: every value
    launches the one binary, with its own value; one past int32 needs Triton's i64 binary."""
    fn = _Jit()
    launch = _direct.DirectLaunch(fn, {"BLOCK": 64}, direct=True, runtime=(2,))
    x, y = _tensors()
    for n in (8, 9, 10, 2**40, 2**40 + 1):
        launch(_grid, (x, y, n, 0.5), {})
    assert [call[1][2] for call in fn.calls] == [8, 2**40]  # compiled once per width
    assert [run[11] for run in fn.binary.runs] == [9, 10, 2**40 + 1]  # each call's own value
    assert launch.launches == 3


@pytest.mark.parametrize("answer", ["a launcher", "None", "raises"])
def test_a_backends_binary_launcher_launches_seen_calls(cuda_stand_ins, answer, caplog):
    """The backend's ``pk_binary_launcher`` answer makes, once per binary, the launcher a
    seen call goes through, with the grid, the stream and every parameter; where it answers
    None or fails (logged), the binary's Triton launcher stays."""
    fn = _Jit()
    launched, made = [], []

    def make(kernel, guards):
        made.append((kernel, guards))
        if answer == "raises":
            raise RuntimeError("no driver here")
        return None if answer == "None" else lambda *args: launched.append(args) or True

    launch = _direct.DirectLaunch(fn, {"BLOCK": 64}, direct=True, binary=make)
    x, y = _tensors()
    for _ in range(3):
        launch(_grid, (x, y, 8, 0.5), {})
    guards = ((torch.float16, True), (torch.float16, True))
    assert len(fn.calls) == 1 and launch.launches == 2 and made == [(fn.binary, guards)]
    if answer == "a launcher":
        assert launched == [(4, 1, 1, 1000, x, y, 8, 0.5, 64, True)] * 2 and not fn.binary.runs
    else:
        assert not launched and len(fn.binary.runs) == 2
    assert ("the backend's launcher failed" in caplog.text) == (answer == "raises")
    off = _direct.DirectLaunch(fn, {"BLOCK": 64}, direct=False, binary=make)
    assert off.binary is None  # direct launches off: nothing to launch with it


@pytest.mark.parametrize("change", ["alignment", "dtype"])
def test_a_guard_that_fails_takes_the_full_key(cuda_stand_ins, change):
    """Seen calls are looked up by device, scalars and keywords, the backend's launcher
    checking the tensors' dtypes and alignment: where they differ from its binary's it
    launches nothing, and the call finds (or compiles) its own binary by the full key."""
    fn = _Jit()
    launched = []

    def make(kernel, guards):
        def launch(*args):
            if any((t.dtype, t.data_ptr() % 16 == 0) != g for t, g in zip(args[4:], guards)):
                return False
            launched.append((guards, args[4]))
            return True
        return launch

    launch = _direct.DirectLaunch(fn, {"BLOCK": 64}, direct=True, binary=make)
    x, y = _tensors()
    other = _tensors(offset=1)[0] if change == "alignment" else x.float()
    for args in [(x, y, 8, 0.5)] * 2 + [(other, y, 8, 0.5)] * 3 + [(x, y, 8, 0.5)]:
        launch(_grid, args, {})
    # x: compiled, then launched; other: compiled, then twice by the full key; x again.
    assert len(fn.calls) == 2 and launch.launches == 4 and len(launch.entries) == 2
    assert [a is other for _, a in launched] == [False, True, True, False]
    assert len(launch.guarded) == 1  # the first entry of the (device, scalars, keywords) key


@pytest.mark.parametrize("change", ["alignment", "scalar", "keyword", "dtype"])
def test_calls_that_may_select_another_binary_take_the_jit_path(cuda_stand_ins, change):
    fn = _Jit()
    launch = _direct.DirectLaunch(fn, {"BLOCK": 64}, direct=True)
    x, y = _tensors()
    args, kwargs = (x, y, 16, 0.5), {"FLAG": True}
    launch(_grid, args, kwargs)
    if change == "alignment":
        args = (_tensors(offset=1)[0], y, 16, 0.5)  # 2 bytes off a 16-byte boundary
        assert args[0].data_ptr() % 16 and x.data_ptr() % 16 == 0
    elif change == "scalar":
        args = (x, y, 17, 0.5)  # Triton specializes integers divisible by 16
    elif change == "keyword":
        kwargs = {"FLAG": False}
    else:
        args = (x.float(), y, 16, 0.5)
    launch(_grid, args, kwargs)
    assert len(fn.calls) == 2 and launch.launches == 0
    launch(_grid, args, kwargs)  # now seen
    assert len(fn.calls) == 2 and launch.launches == 1


def _specialized(x_ptr, y_ptr, n, m, BLOCK: tl.constexpr):
    pass  # only Triton's binder reads this kernel's signature


def test_the_key_separates_what_tritons_binder_specializes(cuda_stand_ins):
    """Calls Triton's own binder specializes apart (dtypes, 16-byte alignment, integers
    equal to 1, divisible by 16 or past 32 bits) never share a key, so a seen key never
    launches a binary compiled for another specialization."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime import jit

    fn = jit.JITFunction(_specialized)
    binder = jit.create_function_from_signature(fn.signature, fn.params,
                                                make_backend(GPUTarget("cuda", 90, 32)))
    launch = _direct.DirectLaunch(fn, {}, direct=True)
    storage = torch.zeros(64, dtype=torch.float16)
    seen: dict = {}
    for x in (storage[:8], storage[1:9], storage.float()[:8]):
        for n in (0, 1, 2, 16, 17, 2**31, 2**32):
            for m in (1, 16):
                args = (x, storage[:8], n, m)
                spec = str(binder(*args, BLOCK=64)[1])
                assert seen.setdefault(launch._key(args, {"BLOCK": 64}), spec) == spec
    assert len(set(seen.values())) > 10  # the binder did tell these calls apart


def _descriptor(t, block=(8, 64), swizzle=128):
    """A Gluon host descriptor of the 2-D ``t``: Triton specializes on its type string
    (dtype, block shape, layout), not on the addresses, sizes and strides it carries."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    layout = gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=8 * t.element_size(), rank=2)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block), layout)


@pytest.mark.parametrize("change", ["none", "block shape", "layout", "dtype"])
def test_descriptor_arguments_are_keyed_by_type(cuda_stand_ins, change):
    """Descriptors lead the arguments as tensors do. A later call with new descriptors of
    the same type (other tensors, other sizes) launches the binary with them (its launcher
    encodes their addresses at each launch); one of another type takes the JIT path."""
    fn = _Jit()
    launch = _direct.DirectLaunch(fn, {"BLOCK": 64}, direct=True)
    y = torch.zeros(8, dtype=torch.float16)
    launch(_grid, (_descriptor(torch.zeros(16, 64, dtype=torch.float16)), y, 8, 0.5), {})
    other = torch.zeros(48, 64, dtype=torch.float16)
    desc = {"none": lambda: _descriptor(other),
            "block shape": lambda: _descriptor(other, block=(16, 64)),
            "layout": lambda: _descriptor(other, swizzle=64),
            "dtype": lambda: _descriptor(other.float())}[change]()
    launch(_grid, (desc, y, 8, 0.5), {})
    if change == "none":
        assert len(fn.calls) == 1 and launch.launches == 1
        assert fn.binary.runs[0][9] is desc
    else:
        assert len(fn.calls) == 2 and launch.launches == 0


def test_launch_hooks_keep_the_jit_path(cuda_stand_ins):
    """Profilers read the launch metadata Triton builds for its hooks."""
    fn = _Jit()
    launch = _direct.DirectLaunch(fn, {"BLOCK": 64}, direct=True)
    x, y = _tensors()
    launch(_grid, (x, y, 8, 0.5), {})

    def hook(metadata):
        pass

    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        launch(_grid, (x, y, 8, 0.5), {})
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    assert len(fn.calls) == 2 and launch.launches == 0


def _runtime_grid(meta):
    return (triton.cdiv(meta["n"], meta["BLOCK"]),)


@pytest.mark.parametrize("case", ["grid reads a runtime argument", "tensor among the scalars",
                                  "direct launches off"])
def test_calls_that_always_take_the_jit_path(cuda_stand_ins, case):
    """A grid computed from a runtime argument cannot be recomputed from the constexprs; a
    tensor among the scalars has no alignment in the key; and launchers built with direct
    launches off never keep binaries."""
    fn = _Jit()
    launch = _direct.DirectLaunch(fn, {"BLOCK": 64}, direct=case != "direct launches off")
    x, y = _tensors()
    grid, args = _grid, (x, y, 8, 0.5)
    if case == "grid reads a runtime argument":
        grid = _runtime_grid
    elif case == "tensor among the scalars":
        args = (x, 3, y, 0.5)
    for _ in range(3):
        launch(grid, args, {})
    assert len(fn.calls) == 3 and launch.launches == 0 and not launch.entries


def test_where_direct_launches_are_used(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    assert _direct.supported("nvidia", interpreted=False) == hasattr(torch._C, "_cuda_getCurrentRawStream")
    assert not _direct.supported("nvidia", interpreted=True)
    assert not _direct.supported("amd", interpreted=False)
    monkeypatch.setattr(triton, "__version__", "3.7.0")  # not checked: the JIT path
    assert not _direct.supported("nvidia", interpreted=False)
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setenv("PK_DIRECT_LAUNCH", "0")
    assert not _direct.supported("nvidia", interpreted=False)


def _direct_launches(plan) -> int:
    launchers = [*plan._chosen.values(), *plan._tuned.values()]
    return sum(x.launches for x in launchers if isinstance(x, _direct.DirectLaunch))


def _needs_nvidia(device):
    if device.type != "cuda" or torch.version.cuda is None:
        pytest.skip("direct launches are used on NVIDIA GPUs only (not on the interpreter)")


def test_tuned_matmuls_launch_their_binaries(device, gen, nan_empty):
    """On an NVIDIA GPU the calls after tuning launch the binary, and an operand 2 bytes off
    a 16-byte boundary gets a binary of its own, computing the same product."""
    _needs_nvidia(device)
    a = _rand(gen, 16, 512, dtype=torch.float16, device=device)
    b = _rand(gen, 512, 256, dtype=torch.float16, device=device)
    with pk.use_variant(matmul="generic"):  # pointer loads: any alignment of the operands
        plan = dispatch._launch_plan(pk.explain("matmul", a, b))
    ref = matmul_module.reference(a, b)
    tol = tolerance(torch.float16, "dot")
    # The plan is shared with every earlier generic matmul of the process (another test's
    # other shapes and dtypes): count this test's launches only.
    before = _direct_launches(plan)
    # Tuning, then the JIT path once more (which keeps the binary), then the binary.
    for _ in range(3):
        assert_close(matmul_module.launch(plan, a, b), ref, tol, "aligned")
    assert _direct_launches(plan) - before == 1
    storage = torch.empty(a.numel() + 8, dtype=a.dtype, device=device)
    shifted = storage[1:1 + a.numel()].view_as(a).copy_(a)
    assert shifted.data_ptr() % 16 == 2
    for _ in range(2):
        assert_close(matmul_module.launch(plan, shifted, b), ref, tol, "2 bytes off")
    assert _direct_launches(plan) - before == 2


def _family_call(name, gen, device):
    """``call()`` of one family on fixed inputs, returning the output and, for the
    differentiable families, the input gradients too; and which of those may differ from
    call to call (summed in an order the GPU schedules) within a tolerance."""
    x = _rand(gen, 48, 1000, dtype=torch.float16, device=device)
    handle = pk.get_kernel(name)
    if name == "vector_add":
        y = _rand(gen, 48, 1000, dtype=torch.float16, device=device)
        return lambda: [handle(x, y)], {}
    if name == "asin":
        u = torch.rand(4099, generator=gen).to(device, torch.float16) * 2 - 1
        return lambda: [handle(u)], {}
    if name == "softmax":
        return lambda: [handle(x)], {}
    if name == "layer_norm":
        w, b = (_rand(gen, 1000, dtype=torch.float16, device=device) for _ in range(2))
        leaves, dy, kwargs = (x, w, b), _rand(gen, *x.shape, dtype=x.dtype, device=device), {}
        # dweight and dbias: fp32 sums over row groups, added under locks in arrival order.
        tol = _column_sum_tolerance(tolerance(torch.float16, "reduction"), x, dy)
        unordered = {2: tol, 3: tol}
    else:
        leaves = tuple(_rand(gen, 1, 4, 320, 64, dtype=torch.float16, device=device) for _ in range(3))
        dy, kwargs, unordered = _rand(gen, *leaves[0].shape, dtype=torch.float16, device=device), {"causal": True}, {}

    def call():
        mine = [t.detach().requires_grad_() for t in leaves]
        out = handle(*mine, **kwargs)
        return [out.detach(), *torch.autograd.grad(out, mine, dy)]

    return call, unordered


@pytest.mark.parametrize("name", ["vector_add", "asin", "softmax", "layer_norm", "flash_attn"])
def test_repeated_calls_launch_binaries_with_the_same_results(name, device, gen, nan_empty):
    """Every family's launches (forward and backward) go direct once seen, and compute
    what the first call (through Triton's JIT launch; checked against references in each
    family's tests) did, every element written (outputs are NaN-poisoned)."""
    _needs_nvidia(device)
    call, unordered = _family_call(name, gen, device)
    first = call()
    plans = set(pk.get_kernel(name)._cache.values())
    before = sum(_direct_launches(p) for p in plans)  # earlier tests' launches of these plans
    for i in range(2):
        for j, (got, want) in enumerate(zip(call(), first)):
            assert not torch.isnan(got).any(), f"{name} call {i + 2} output {j}: unwritten elements"
            if j in unordered:
                assert_close(got, want.double(), unordered[j], f"{name} call {i + 2} output {j}")
            else:
                assert torch.equal(got, want), f"{name} call {i + 2} output {j} differs from the first"
    assert sum(_direct_launches(p) for p in plans) > before


@pytest.mark.parametrize("name", ["vector_add", "asin", "softmax", "layer_norm", "flash_attn"])
def test_family_launches_pass_tensors_before_scalars(name, device, gen, monkeypatch, fresh_host):
    """A tensor among the scalars keeps Triton's JIT launch on every call (its alignment is
    not in the key), so every family launch passes its tensors first (for flash_attn also
    the options' pointers: cu_seqlens, ALiBi slopes and sinks, or their placeholders).
    Checked on any device: the launches go through ``DirectLaunch`` here too."""
    seen = []
    call_launch = _direct.DirectLaunch.__call__

    def record(self, grid, args, kwargs):
        n = next((i for i, a in enumerate(args) if not _direct._leading(a)), len(args))
        late = [i for i, a in enumerate(args[n:], n) if _direct._leading(a)]
        late += [k for k, a in kwargs.items() if _direct._leading(a)]
        seen.append((getattr(self.fn, "__name__", None) or self.fn.fn.__name__, late))
        return call_launch(self, grid, args, kwargs)

    monkeypatch.setattr(_direct.DirectLaunch, "__call__", record)
    # Every call on the full path: a signature an earlier test recorded would replay its
    # binaries without DirectLaunch.
    monkeypatch.setenv("PK_REPLAY", "0")
    fresh_host()
    call, _ = _family_call(name, gen, device)
    for _ in range(2):  # a tuned launch's first call goes through the autotuner
        call()
    if name == "flash_attn":
        # With every option, as a packed batch sets cu_seqlens too.
        q, k, v = (_rand(gen, 9, 2, 16, dtype=torch.float32, device=device).requires_grad_()
                   for _ in range(3))
        cu = torch.tensor([0, 4, 9], dtype=torch.int32, device=device)
        out = pk.get_kernel("flash_attn_varlen")(
            q, k, v, cu, cu, 5, 5, causal=True, window_size=(3, 0), softcap=2.0,
            alibi_slopes=torch.rand(2, generator=gen).to(device),
            sinks=torch.randn(2, generator=gen).to(device))
        out.sum().backward()
    assert seen, "no launch went through DirectLaunch"
    assert all(not late for _, late in seen), [s for s in seen if s[1]]
