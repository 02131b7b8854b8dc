"""Conformance of ``rope(q, k, cos, sin, positions, interleaved)``: every variant, dtype and
shape below, forward (q_out, k_out) and backward (dq, dk): both pair layouts, rotary_dim
below D, GQA, packed tokens with positions, decoding, strided and NaN-gapped inputs."""
from __future__ import annotations

import torch

from portable_kernels.conformance.harness import Inputs, KernelSuite, Shape, randn
from portable_kernels.testing import Tolerance, tolerance


def _tables(max_pos: int, rotary_dim: int, dtype: torch.dtype, device):
    from portable_kernels.kernels.rope import tables

    return tables(max_pos, rotary_dim, device=device, dtype=dtype)


def make_inputs(shape, dtype, device, gen) -> Inputs:
    b, s, h, hk, d = (shape[n] for n in ("b", "s", "h", "hk", "d"))
    packed = shape.get("packed", False)
    lead = (b * s,) if packed else (b, s)
    layout = shape.get("layout", "contiguous")
    if layout == "qkv":  # q and k as views of one fused (..., (H + 2 H_kv) D) projection
        fused = randn((*lead, (h + 2 * hk) * d), dtype, device, gen)
        q = fused[..., : h * d].unflatten(-1, (h, d))
        k = fused[..., h * d: (h + hk) * d].unflatten(-1, (hk, d))
    elif layout == "heads_first":  # (B, H, S, D) memory seen as (B, S, H, D)
        q = randn((b, h, s, d), dtype, device, gen).transpose(1, 2)
        k = randn((b, hk, s, d), dtype, device, gen).transpose(1, 2)
    else:
        q = randn((*lead, h, d), dtype, device, gen, layout=layout)
        k = randn((*lead, hk, d), dtype, device, gen, layout=layout)
    max_pos = shape.get("max_pos", s if not packed else b * s)
    table_dtype = dtype if shape.get("tables_in_dtype") else torch.float32
    cos, sin = _tables(max_pos, shape.get("rot", d), table_dtype, device)
    positions = None
    if shape.get("positions"):
        positions = torch.randint(0, max_pos, lead, generator=gen, dtype=shape["positions"])
        positions = positions.to(device)
    return Inputs((q, k, cos, sin), {"positions": positions,
                                     "interleaved": shape.get("interleaved", False)})


def tolerance_for(tol: Tolerance, name: str, ref, inputs: Inputs, grad_outs) -> Tolerance:
    """The table's tolerance, plus the fp32 arithmetic's rounding (every dtype computes in
    fp32) scaled by the size of the terms: ``x1 cos - x2 sin`` cancels, so its error
    follows |x1| + |x2| <= 2 max|x|, not the result."""
    source = {"out[0]": inputs.args[0], "out[1]": inputs.args[1]}.get(name)
    if source is None:
        source = grad_outs[0 if name == "dq" else 1]
    if not source.numel():
        return tol
    bound = 2 * float(source.detach().double().abs().max())
    return Tolerance(tol.atol + tolerance(torch.float32, "elementwise").rtol * bound, tol.rtol)


I32, I64 = torch.int32, torch.int64

SUITE = KernelSuite(
    kernel="rope",
    make_inputs=make_inputs,
    tolerance="elementwise",
    grad_args=(0, 1),
    arg_names=("q", "k"),
    tolerance_for=tolerance_for,
    shapes=(
        # Llama: half rotation over the whole head, GQA, positions 0..S-1.
        Shape("llama_2x7x4x2_d16", b=2, s=7, h=4, hk=2, d=16, quick=True),
        # GPT-J: interleaved pairs over 12 of 20 dims; the rest passes through.
        Shape("gptj_3x5x2x1_d20_r12", b=3, s=5, h=2, hk=1, d=20, rot=12, interleaved=True,
              quick=True),
        Shape("partial_1x9x3x3_d24_r10", b=1, s=9, h=3, hk=3, d=24, rot=10),  # odd half (5)
        Shape("odd_d7_r6", b=2, s=3, h=2, hk=1, d=7, rot=6, interleaved=True),  # one column through
        # A packed batch: (T, H, D) tokens with their own positions in a longer table.
        Shape("packed_t13_h4x1_d32_pos", b=1, s=13, h=4, hk=1, d=32, packed=True, positions=I32,
              max_pos=64, quick=True),
        # Decoding: one token per sequence, far along a long table.
        Shape("decode_4x1x8x2_d64_pos", b=4, s=1, h=8, hk=2, d=64, positions=I64, max_pos=4096),
        # Views of one fused qkv projection (row stride (H + 2 H_kv) D).
        Shape("qkv_views_2x6x4x2_d16", b=2, s=6, h=4, hk=2, d=16, rot=8, quick=True,
              layout="qkv"),
        Shape("heads_first_2x5x3x3_d12", b=2, s=5, h=3, hk=3, d=12, interleaved=True,
              layout="heads_first"),
        Shape("gap_2x3x2x2_d8", b=2, s=3, h=2, hk=2, d=8, rot=4, layout="gap"),  # NaN between
        Shape("tables_in_dtype_2x4x2x2_d16", b=2, s=4, h=2, hk=2, d=16, tables_in_dtype=True),
        # More rows than one program takes on the interpreter (its TILE is 16384 pairs).
        Shape("long_1x300x2x1_d128_r64", b=1, s=300, h=2, hk=1, d=128, rot=64, positions=I32,
              max_pos=512),
        Shape("empty_0x5x2x1_d8", b=0, s=5, h=2, hk=1, d=8, backward=False),
    ),
)


def test_conformance(pk_case):
    """One case; see ``portable_kernels.conformance.harness.CaseRun.check``."""
    pk_case.check()
