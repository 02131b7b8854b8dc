"""The peer Triton libraries, Liger-Kernel and FlagGems, as the benchmarks call them: one
:class:`Impl` per family each library has, on the arguments our benchmarks make.

Neither is a dependency. On a GPU machine without a network they travel as wheels
(docs/performance.md, "Reproducing"): ``pip install --no-index --no-deps --target DIR``
of ``liger_kernel-0.8.5``, ``flag_gems-5.0.2`` and ``sqlalchemy`` (FlagGems imports it),
then ``PYTHONPATH=DIR``. A library that does not import is left out of the tables, with
the reason in :func:`missing`.

Each peer is called as its own users call it: Liger's functional API (as its model
patcher wires it), FlagGems' fused operators where it has them and its aten overrides
(``flag_gems.use_gems()``, entered once around a whole timing loop: entering it costs
milliseconds) for the rest. Where a peer wants another layout (Liger's rotary takes
(B, H, S, D) and a full-width table; both libraries' gated activations take gate and up
as two tensors, as Llama's MLP makes them), :attr:`Impl.prepare` builds it once, outside
the timing, and :attr:`Impl.finish` maps the outputs back for the correctness check.
"""
from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

import torch

F = torch.nn.functional
PEERS = ("liger", "flaggems")
_MODULES = {"liger": "liger_kernel.transformers.functional", "flaggems": "flag_gems"}
_VERSIONS = {"liger": "liger_kernel", "flaggems": "flag_gems"}
_loaded: dict[str, Any] = {}
_errors: dict[str, str] = {}


def _same(args: tuple) -> tuple:
    return args


def _identity(out: Any) -> Any:
    return out


@dataclass(frozen=True)
class Impl:
    """One implementation of a family on the benchmark's arguments: ``finish(fn(*prepare(args)))``
    is comparable with the family's reference on ``args``. ``backward``: whether its outputs
    are differentiable; ``context``: entered around its check and its timing."""

    fn: Callable[..., Any]
    prepare: Callable[[tuple], tuple] = _same
    finish: Callable[[Any], Any] = _identity
    backward: bool = True
    context: Callable[[], ContextManager] = field(default=contextlib.nullcontext)


def module(peer: str) -> Any | None:
    """The peer's module, or None (the reason in :func:`missing`)."""
    if peer not in _loaded and peer not in _errors:
        try:
            _loaded[peer] = importlib.import_module(_MODULES[peer])
        except Exception as exc:  # noqa: BLE001 (FlagGems raises RuntimeError without a GPU)
            _errors[peer] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    return _loaded.get(peer)


def missing() -> dict[str, str]:
    """Peer -> why it did not import (only those tried)."""
    return dict(_errors)


def versions() -> dict[str, str | None]:
    """Peer -> installed version, None where it did not import; for the result files."""
    from importlib import metadata

    out = {}
    for peer, dist in _VERSIONS.items():
        try:
            out[peer] = metadata.version(dist) if module(peer) is not None else None
        except metadata.PackageNotFoundError:
            out[peer] = None
    return out


def _gems() -> ContextManager:
    return _loaded["flaggems"].use_gems()


def _halves(args: tuple) -> tuple:
    """A fused (..., 2I) gate-up tensor as two contiguous (..., I) tensors."""
    (gu,) = args
    i = gu.shape[-1] // 2
    return gu[..., :i].contiguous(), gu[..., i:].contiguous()


def _rope_heads_first(args: tuple) -> tuple:
    """(B, S, H, D) q and k as (B, H, S, D) views (Hugging Face's layout, which Liger takes)
    of copies (Liger rotates its inputs in place), and the (S, D/2) tables as full-width
    (S, D) ones."""
    q, k, cos, sin = args
    return (q.clone().transpose(1, 2), k.clone().transpose(1, 2), torch.cat((cos, cos), -1).contiguous(),
            torch.cat((sin, sin), -1).contiguous())


def _seq_first(out: tuple) -> tuple:
    return tuple(t.transpose(1, 2) for t in out)


def _rope_positions(args: tuple) -> tuple:
    q, k, cos, sin = args
    positions = torch.arange(q.shape[1], device=q.device).expand(q.shape[0], -1).contiguous()
    return q, k, cos, sin, positions


def _clones(args: tuple) -> tuple:
    """Copies of tensors a peer updates in place (the benchmark's stay as they are)."""
    return tuple(a.clone() for a in args)


def layer(family: str) -> dict[str, Impl]:
    """The peers' implementations of one of ``bench/layers.py``'s families, on its
    arguments (``layers.inputs``); libraries that did not import are left out."""
    out: dict[str, Impl] = {}
    liger = module("liger")
    if liger is not None:
        impl = {
            "softmax": Impl(liger.liger_softmax),
            "layer_norm": Impl(lambda x, w, b: liger.liger_layer_norm(x, w, b, 1e-5)),
            "rms_norm": Impl(lambda x, w: liger.liger_rms_norm(x, w, 1e-6)),
            "add_rms_norm": Impl(lambda x, r, w: liger.liger_fused_add_rms_norm(x, r, w, 1e-6)),
            "swiglu": Impl(liger.liger_swiglu, prepare=_halves),
            "geglu": Impl(liger.liger_geglu, prepare=_halves),
            "rope": Impl(liger.liger_rope, prepare=_rope_heads_first, finish=_seq_first),
        }.get(family)
        if impl is not None:
            out["liger"] = impl
    gems = module("flaggems")
    if gems is not None:
        aten = {"vector_add": lambda x, y: x + y,
                "softmax": lambda x: torch.softmax(x, -1),
                "layer_norm": lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, 1e-5)}
        # Not asin: FlagGems 5.0.2 registers none (asinh_ only), so torch.asin under
        # use_gems() runs torch's own kernel, not one of FlagGems'.
        # Not rms_norm: FlagGems 5.0.2's rms_norm under use_gems() raised an illegal memory
        # access in this benchmark (16384x4096 and 32768x8192 bf16, H100, triton 3.6), which
        # leaves the CUDA context unusable for every row after it.
        if family in aten:
            out["flaggems"] = Impl(aten[family], context=_gems)
        elif family == "add_rms_norm":
            # In place on x and residual, forward only: (normed x, x + residual).
            out["flaggems"] = Impl(lambda x, r, w: gems.fused_add_rms_norm(x, r, x.shape[-1:], w, 1e-6),
                                   prepare=_clones, backward=False)
        elif family == "swiglu":
            out["flaggems"] = Impl(gems.silu_and_mul, prepare=_halves)
        elif family == "geglu":
            out["flaggems"] = Impl(lambda g, u: gems.gelu_and_mul(g, u, "tanh"), prepare=_halves)
        elif family == "rope":
            out["flaggems"] = Impl(gems.apply_rotary_pos_emb, prepare=_rope_positions, backward=False)
    return out


def loss(family: str) -> dict[str, Impl]:
    """The peers' implementations of ``bench/losses.py``'s families: ``cross_entropy``
    (logits, target) and ``fused_linear_cross_entropy`` (hidden, weight, target), mean
    reduction, ignore_index -100."""
    out: dict[str, Impl] = {}
    liger = module("liger")
    if liger is not None:
        if family == "cross_entropy":
            out["liger"] = Impl(liger.liger_cross_entropy)
        elif family == "fused_linear_cross_entropy":
            out["liger"] = Impl(liger.liger_fused_linear_cross_entropy)
    if module("flaggems") is not None and family == "cross_entropy":
        out["flaggems"] = Impl(F.cross_entropy, context=_gems)
    return out
