"""Conformance of ``flash_attn(q, k, v, causal, sm_scale, ...)``: every variant, dtype and
shape below, forward and backward (dq, dk, dv), against the float64 reference, with
FlashAttention's options (bottom-right alignment, window, softcap, ALiBi, sinks) alone and
combined.

Shapes are small and odd (tails in Nq, Nk and D; GQA and MQA; causal with Nq < Nk and
Nq > Nk; (B, N, H, D) storage viewed as (B, H, N, D)), because Triton's CPU interpreter
pays about 4 ms per key-block step; the same shapes run compiled on a GPU.
"""
from __future__ import annotations

import torch

from portable_kernels.conformance.harness import Inputs, KernelSuite, Shape, place
from portable_kernels.testing import Tolerance

FP32 = (torch.float32,)
LOW = (torch.float16, torch.bfloat16)


def _qkv(b, heads, n, d, dtype, device, gen, layout):
    """A (B, H, N, D) tensor; ``bnhd``: a view of (B, N, H, D) storage (strided heads)."""
    if layout == "bnhd":
        values = torch.randn(b, n, heads, d, generator=gen).to(dtype)
        return place(values, device).transpose(1, 2)
    return place(torch.randn(b, heads, n, d, generator=gen).to(dtype), device)


def make_inputs(shape, dtype, device, gen) -> Inputs:
    b, h, h_kv, n_q, n_k, d = shape["dims"]
    layout = shape.get("layout", "bhnd")
    q = _qkv(b, h, n_q, d, dtype, device, gen, layout)
    k = _qkv(b, h_kv, n_k, d, dtype, device, gen, layout)
    v = _qkv(b, h_kv, n_k, d, dtype, device, gen, layout)
    kwargs = {"causal": shape.get("causal", False), "sm_scale": shape.get("sm_scale")}
    kwargs.update(options(shape, b, h, device, gen))
    return Inputs((q, k, v), kwargs)


def options(shape, b, h, device, gen) -> dict:
    """FlashAttention's options a shape names: ``align``, ``window_size``, ``softcap``,
    ``alibi`` ("H" or "BH": random fp32 slopes of that shape), ``sinks`` (random (H,))."""
    kw = {name: shape.get(name) for name in ("align", "window_size", "softcap")
          if shape.get(name) is not None}
    if shape.get("alibi"):
        size = (h,) if shape["alibi"] == "H" else (b, h)
        kw["alibi_slopes"] = place(torch.rand(size, generator=gen), device)
    if shape.get("sinks"):
        kw["sinks"] = place(torch.randn(h, generator=gen), device)
    return kw


def tolerance_for(tol: Tolerance, name: str, ref, inputs: Inputs, grad_outs) -> Tolerance:
    """Gradients are sums over a sequence (dk, dv over queries; dq over keys), so their scale
    is not 1 like attention outputs: the table's absolute part is taken relative to it."""
    if name == "out":
        return tol
    return Tolerance(tol.atol * max(1.0, float(ref.abs().max())), tol.rtol)


SUITE = KernelSuite(
    kernel="flash_attn",
    make_inputs=make_inputs,
    tolerance="attention",
    grad_args=(0, 1, 2),
    arg_names=("q", "k", "v"),
    tolerance_for=tolerance_for,
    # dims: (B, H, H_kv, Nq, Nk, D)
    shapes=(
        Shape("tails_d80", dims=(1, 2, 2, 113, 203, 80), quick=True),            # tails everywhere, D padded
        Shape("gqa_causal_d96", dims=(2, 4, 2, 70, 150, 96), causal=True, dtypes=FP32),  # Nq < Nk
        Shape("mqa_causal_bnhd_d64", dims=(1, 4, 1, 150, 70, 64), causal=True,
              layout="bnhd"),                                                     # Nq > Nk, strided
        Shape("d256_causal", dims=(1, 2, 1, 65, 40, 256), causal=True),           # the largest D
        Shape("d24_scale", dims=(1, 1, 1, 33, 77, 24), sm_scale=0.3),             # small D; scale
        Shape("causal_gqa_d96", dims=(1, 4, 2, 100, 130, 96), causal=True, dtypes=LOW),
        # D = 128: the head size descriptor (TMA) variants take, with tails in Nq and Nk.
        Shape("causal_d128", dims=(1, 2, 1, 100, 130, 128), causal=True, quick=True, dtypes=LOW),
        Shape("gqa_bnhd_d80", dims=(2, 2, 1, 77, 140, 80), layout="bnhd", dtypes=LOW),
        # 1024 <= Nk < 2048 at D = 128: nvidia.hopper_gluon takes the call (MIN_KEYS), its
        # forward in Gluon, its backward in the family's kernels (BWD_MIN_KEYS).
        Shape("keys_1100_gqa_d128", dims=(1, 2, 1, 64, 1100, 128), dtypes=LOW),
        # Nk >= 2048: where the Hopper backward moves its tiles through descriptors
        # (BWD_TMA_MIN_SEQ), and where nvidia.hopper_gluon's backward is Gluon too; the
        # shorter shapes above take nvidia.hopper's pointer loads.
        Shape("long_keys_gqa_d128", dims=(1, 2, 1, 70, 2100, 128), dtypes=LOW),
        # Nk >= 4096 at D = 64: nvidia.hopper_gluon with three consumer warpgroups
        # (D64_CONSUMERS); few queries keep it cheap on the interpreter.
        Shape("keys_4096_gqa_d64", dims=(1, 2, 1, 64, 4096, 64), dtypes=LOW),
        # FlashAttention's options, alone and together (Nq != Nk, GQA, tails).
        Shape("bottom_right_causal", dims=(1, 2, 1, 90, 40, 64), causal=True,
              align="bottom_right", quick=True),                                  # rows see nothing
        Shape("window", dims=(1, 2, 2, 70, 150, 64), window_size=(20, 7)),
        Shape("window_causal_br", dims=(2, 2, 1, 40, 150, 64), causal=True, window_size=(33, -1),
              align="bottom_right", quick=True),
        Shape("softcap", dims=(1, 2, 1, 50, 90, 64), softcap=1.5),
        Shape("alibi", dims=(2, 4, 2, 50, 70, 64), causal=True, alibi="BH"),
        Shape("sinks", dims=(1, 4, 1, 60, 80, 64), sinks=True),
        Shape("all_options", dims=(2, 4, 2, 50, 90, 64), causal=True, align="bottom_right",
              window_size=(24, 0), softcap=3.0, alibi="H", sinks=True, quick=True),
    ),
)


def test_conformance(pk_case):
    """One case; see ``portable_kernels.conformance.harness.CaseRun.check``."""
    pk_case.check()
