"""Calls with wrong arguments: each gets an error that names the kernel and the argument,
before anything is launched, and never runs with a misread value.

A call that does not match a kernel's signature (a missing ``seed``, an unknown keyword)
is an ``ArgumentError`` quoting the signature; a non-tensor argument of the wrong type
(``dim="1"``, ``causal="no"``) an ``ArgumentError`` naming it, where Python's own
comparison errors or a truthy string read as ``causal=True`` used to come through.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import portable_kernels as pk

from conftest import DEVICE


def _x(*shape):
    return torch.randn(*shape, device=DEVICE)


def _qkv():
    return tuple(_x(1, 2, 8, 16) for _ in range(3))


# (kernel, args, kwargs, words the message must contain)
MISSING = [
    ("dropout", lambda: (_x(8), 0.5), {}, ["dropout", "seed", "dropout(x, p, seed)"]),
    ("layer_norm", lambda: (_x(2, 8),), {}, ["layer_norm", "weight", "bias"]),
    ("softmax", lambda: (), {}, ["softmax", "'x'"]),
    ("vector_add", lambda: (_x(4),), {}, ["vector_add", "'y'"]),
    ("matmul", lambda: (_x(4, 4),), {}, ["matmul", "'b'"]),
    ("flash_attn", lambda: _qkv()[:2], {}, ["flash_attn", "'v'"]),
    ("softmax", lambda: (_x(2, 3),), {"axis": 0}, ["softmax", "axis"]),
    ("vector_add", lambda: (_x(4), _x(4), _x(4)), {}, ["vector_add", "positional"]),
]


@pytest.mark.parametrize("kernel, args, kwargs, words", MISSING,
                         ids=[f"{k}-{'-'.join(map(str, kw)) or len(w)}" for k, _, kw, w in MISSING])
def test_a_call_off_the_signature_names_the_kernel_and_argument(kernel, args, kwargs, words):
    with pytest.raises(pk.ArgumentError) as err:
        pk.get_kernel(kernel)(*args(), **kwargs)
    message = str(err.value)
    for word in words:
        assert word in message, message
    assert "launch()" not in message and "problem()" not in message, message


def test_explain_and_plan_report_the_same_signature_errors():
    with pytest.raises(pk.ArgumentError, match="dropout.*seed"):
        pk.explain("dropout", _x(8), 0.5)
    with pytest.raises(pk.ArgumentError, match="layer_norm.*weight"):
        pk.get_kernel("layer_norm").plan(_x(2, 8))


BAD_TYPES = [
    ("softmax", lambda: (_x(2, 3),), {"dim": "1"}, "dim must be an int, got str"),
    ("softmax", lambda: (_x(2, 3),), {"dim": None}, "dim must be an int, got NoneType"),
    ("softmax", lambda: (_x(2, 3),), {"dim": 1.0}, "dim must be an int, got float"),
    ("softmax", lambda: (_x(2, 3),), {"dim": True}, "dim must be an int, got bool"),
    ("flash_attn", _qkv, {"causal": "no"}, "causal must be a bool, got str"),
    ("flash_attn", _qkv, {"causal": 1}, "causal must be a bool, got int"),
    ("flash_attn", _qkv, {"causal": None}, "causal must be a bool, got NoneType"),
    ("flash_attn", _qkv, {"sm_scale": "0.5"}, "sm_scale must be a float or None, got str"),
    ("flash_attn", _qkv, {"sm_scale": True}, "sm_scale must be a float or None, got bool"),
    ("dropout", lambda: (_x(8),), {"p": "0.5", "seed": 1}, "p must be a float"),
    ("dropout", lambda: (_x(8),), {"p": 0.5, "seed": 1.5}, "seed must be an int, got float"),
    ("layer_norm", lambda: (_x(2, 8), _x(8), _x(8)), {"eps": "1e-5"}, "eps must be a float"),
]


@pytest.mark.parametrize("kernel, args, kwargs, message", BAD_TYPES,
                         ids=[f"{k}-{next(iter(kw))}={kw[next(iter(kw))]!r}" for k, _, kw, _ in BAD_TYPES])
def test_a_non_tensor_argument_of_the_wrong_type_is_named(kernel, args, kwargs, message):
    with pytest.raises(pk.ArgumentError, match=message) as err:
        pk.get_kernel(kernel)(*args(), **kwargs)
    assert str(err.value).startswith(kernel)


def test_integer_like_dims_are_taken():
    """numpy integers are ints to torch too (``__index__``)."""
    x = _x(3, 5)
    out = pk.get_kernel("softmax")(x, np.int64(0))
    torch.testing.assert_close(out.cpu(), torch.softmax(x.cpu(), 0), atol=1e-6, rtol=1e-5)


def test_an_argument_error_is_a_type_error_of_the_library():
    """Code that catches TypeError, or the library's errors as one family, keeps working."""
    with pytest.raises(TypeError):
        pk.get_kernel("softmax")(_x(2), dim="0")
    with pytest.raises(pk.PortableKernelsError):
        pk.get_kernel("dropout")(_x(2), 0.5)


def test_a_type_error_inside_a_problem_function_keeps_its_own_message():
    """Only calls that do not bind to the signature are rewritten: a TypeError about a
    value (a non-tensor where a tensor goes) still says what it says."""
    with pytest.raises(pk.DTypeError, match="x must be a torch.Tensor, got list"):
        pk.get_kernel("softmax")([1.0, 2.0])
