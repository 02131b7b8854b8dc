"""The replay signature: ``_signature.c`` builds the key the Python reference builds, on
every kind of argument, and each answers None where a call cannot replay."""
from __future__ import annotations

import contextlib

import pytest
import torch

import portable_kernels as pk
from portable_kernels import _replay, _signature

_C = _signature.c_signature()
pytestmark = pytest.mark.skipif(_C is None, reason="the C signature did not build here (no C "
                                "compiler or Python headers); replays key calls in Python")


def _cases(device: torch.device) -> list:
    x = torch.randn(4, 8, device=device)
    y = torch.randn(8, 4, device=device).t()  # strides (1, 8)
    half = torch.randn(33, device=device, dtype=torch.float16)
    p = torch.nn.Parameter(torch.randn(8, device=device))
    wants = torch.randn(3, device=device, requires_grad=True)
    meta = torch.empty(2, 3, device="meta")
    host = torch.randn(2)
    return [
        ((x, y), {}),
        ((x, x), {}),  # one address twice
        ((x, y, x[1:], y), {}),  # a view at another offset; y twice
        ((half[1:], 3, 2.5, True, None, "mode"), {}),  # odd address; every scalar class
        ((x,), {"eps": 1e-5, "window": (-1, 0), "flags": (True, 1.0, "a", None)}),
        ((p, x), {}),  # a Parameter is a tensor too
        ((wants,), {}),  # a gradient in play (grad mode on: None)
        ((meta, meta), {}),  # a device without an index
        ((x, host), {}),  # a host tensor beside another device's (None on GPUs)
        ((host, meta), {}),  # two devices without an index, of two types: None
        ((x, [1, 2]), {}),  # a list of scalars: None
        ((x, (1, [2])), {}),  # a tuple holding a list: None
        (([x, y], [y, x[1:]]), {}),  # lists of tensors (grouped_matmul's); y twice
        (((x, y), [half]), {}),  # a tuple of tensors
        (([x] * 20, [y] * 20), {}),  # more addresses than the C code compares pairwise
        (([torch.randn(3, device=device) for _ in range(20)],), {}),  # 20, none shared
        (([x, 1],), {}),  # a list mixing tensors and scalars: None
        (((x, 1),), {}),  # so a tuple: None
        (([],), {}),  # an empty list: None
        (([x, wants],), {}),  # a list with a gradient in play (grad mode on: None)
        (([x, host],), {}),  # a host tensor in a list beside another device's
        ((x, torch.float16), {}),  # a dtype: None
        ((), {}),
        ((x, 1), {"out": y}),
    ]


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("forced", [False, True])
def test_c_and_python_keys_are_equal(device, grad, forced):
    current = (lambda: 7) if device.type == "cuda" else None
    for i, (args, kwargs) in enumerate(_cases(device)):
        context = pk.use_variant(vector_add="generic") if forced else contextlib.nullcontext()
        with context, torch.set_grad_enabled(grad):
            want = _signature.python_signature(args, kwargs, current)
            got = _C(args, kwargs, current)
        assert got == want, i
        if want is not None:
            key, pointers = got
            assert hash(key) == hash(want[0]), i
            assert pointers == [a.data_ptr() for a in _replay._tensors(args, kwargs)], i


def test_keys_tell_apart_what_selects_another_path(device):
    """A key changes with each tensor's dtype, shape, strides and alignment, each scalar's
    value and type, the keywords' names, and which tensors share an address."""
    x = torch.randn(64, device=device)
    base = (x[:32], x[32:])

    def key(*args, **kwargs):
        return _C(args, kwargs, None)[0]

    keys = [key(*base), key(x[:32].half(), x[32:]), key(x[:16], x[32:48]),
            key(x[:32].view(4, 8), x[32:]), key(x[:32].view(8, 4).t(), x[32:]),
            key(x[1:33], x[32:]), key(*base, 1), key(*base, 1.0), key(*base, True),
            key(*base, a=1), key(*base, b=1), key(x[:32], x[:32]), key(list(base)),
            key(tuple(base)), key([x[:32]], [x[32:]]), key([x[:32], x[:32]])]
    assert len(set(keys)) == len(keys)
    assert key(*base) == key(x[:32].clone(), x[32:].clone())  # only addresses differ


def test_bad_calls_raise():
    with pytest.raises(TypeError, match="signature"):
        _C([1], {}, None)
    with pytest.raises(ZeroDivisionError):
        _C((torch.zeros(1),), {}, lambda: 1 // 0)


def test_the_key_leads_with_the_selection_context():
    x = torch.zeros(2)
    with pk.use_variant(vector_add="generic"):
        forced = _C((x,), {}, None)[0]
    assert forced[0] == pk._context.current.get()._replace(forced=(("vector_add", "generic"),))
    assert _C((x,), {}, None)[0][0] == pk._context.DEFAULT


def test_active_replays_key_calls_in_c(monkeypatch):
    """Replays that may record build keys in C; inactive ones never build it."""
    monkeypatch.setenv("PK_REPLAY", "1")
    assert _replay.Replays("vector_add").key is _C
    monkeypatch.setenv("PK_REPLAY", "0")
    assert _replay.Replays("vector_add").key is _signature.python_signature


def test_the_python_signature_serves_where_asked(monkeypatch):
    monkeypatch.setattr(_signature, "_c", None)
    monkeypatch.setattr(_signature, "_c_failed", False)
    monkeypatch.setenv("PK_C_SIGNATURE", "0")
    assert _signature.c_signature() is None
    assert _signature.signature() is _signature.python_signature


class _OnDevice:
    """A stand-in for a tensor on an indexed device (a GPU), whose getters the signatures
    read: the CPU machine has no tensor whose ``get_device()`` is an index."""

    def __init__(self, index: int, ptr: int, shape=(4, 8), dtype=torch.float16,
                 requires_grad=False, kind="cuda"):
        self.index, self.ptr, self.shape, self.dtype = index, ptr, torch.Size(shape), dtype
        self.requires_grad, self.is_cuda = requires_grad, kind == "cuda"
        self.device = torch.device(kind, index)

    def data_ptr(self):
        return self.ptr

    def get_device(self):
        return self.index

    def stride(self):
        return (self.shape[1], 1)


def test_c_and_python_keys_are_equal_on_indexed_devices(monkeypatch):
    """The path every GPU call takes (an int device index; once, is_cuda or the device's
    type), through stand-ins registered as the tensor classes of both signatures."""
    monkeypatch.setattr(_signature, "TENSORS", frozenset({_OnDevice}))
    _signature._c_module.init((_OnDevice,), pk._context.current, torch.is_grad_enabled)
    try:
        a, b = _OnDevice(0, 2**40), _OnDevice(0, 2**40 + 4096 + 2, shape=(2, 3))
        cases = [((a, b), {}), ((a, a, 1.5), {}), ((b,), {"x": a}),
                 ((a, _OnDevice(1, 2**41)), {}),  # two indices: both in the key
                 ((_OnDevice(0, 64, kind="xpu"), a), {}),
                 ((_OnDevice(0, 64, requires_grad=True),), {}),
                 ((a, torch.zeros(2)), {}),  # a host tensor (not a TENSORS class here): None
                 (([a, b], [b, _OnDevice(0, 2**40 + 512)]), {}),  # lists of them
                 (([a] * 18,), {})]  # shared addresses past the pairwise test
        for i, (args, kwargs) in enumerate(cases):
            for grad in (True, False):
                with torch.set_grad_enabled(grad):
                    want = _signature.python_signature(args, kwargs, lambda: 3)
                    assert _C(args, kwargs, lambda: 3) == want, (i, grad)
        assert _C((a, b), {}, None)[0][1] is True  # is_cuda, once after the context
        assert _C((_OnDevice(0, 64, kind="xpu"),), {}, None)[0][1] == "xpu"
    finally:
        _signature._c_module.init((torch.Tensor, torch.nn.Parameter), pk._context.current,
                                  torch.is_grad_enabled)
