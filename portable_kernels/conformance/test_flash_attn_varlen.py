"""Conformance of ``flash_attn_varlen``: every variant, dtype and packed batch below,
forward and backward (dq, dk, dv), against each sequence's float64 reference: odd
lengths, empty sequences, sequences without keys, one-token sequences, GQA and MQA, and
FlashAttention's options alone and combined (causal is bottom-right per sequence)."""
from __future__ import annotations

import torch

from portable_kernels.conformance.harness import Inputs, KernelSuite, Shape, place
from portable_kernels.conformance.test_flash_attn import FP32, LOW, options, tolerance_for


def make_inputs(shape, dtype, device, gen) -> Inputs:
    h, h_kv, d = shape["heads"]
    lengths_q, lengths_k = shape["lengths"]
    q, k, v = (place(torch.randn(sum(n), heads, d, generator=gen).to(dtype), device)
               for n, heads in ((lengths_q, h), (lengths_k, h_kv), (lengths_k, h_kv)))
    cu_q, cu_k = (place(torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32),
                        device) for n in (lengths_q, lengths_k))
    kwargs = {"causal": shape.get("causal", False)}
    kwargs.update(options(shape, len(lengths_q), h, device, gen))
    return Inputs((q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k)), kwargs)


SUITE = KernelSuite(
    kernel="flash_attn_varlen",
    make_inputs=make_inputs,
    tolerance="attention",
    grad_args=(0, 1, 2),
    arg_names=("q", "k", "v"),
    tolerance_for=tolerance_for,
    # heads: (H, H_kv, D); lengths: (queries per sequence, keys per sequence)
    shapes=(
        Shape("odd_causal_gqa", heads=(4, 2, 64), lengths=([37, 1, 70, 5], [37, 9, 90, 5]),
              causal=True, quick=True),
        Shape("empty_and_keyless", heads=(2, 1, 64), lengths=([0, 13, 4, 0], [6, 0, 4, 0]),
              causal=True, quick=True),                                   # MQA; rows see nothing
        Shape("noncausal_d80", heads=(2, 2, 80), lengths=([50, 17], [30, 101])),
        Shape("fp32_d32", heads=(2, 1, 32), lengths=([21, 8], [33, 8]), causal=True, dtypes=FP32),
        Shape("window", heads=(2, 1, 64), lengths=([60, 40], [60, 90]), causal=True,
              window_size=(16, -1)),
        Shape("softcap_alibi", heads=(4, 2, 64), lengths=([30, 45], [30, 80]), softcap=2.0,
              alibi="BH", dtypes=LOW),
        Shape("all_options", heads=(4, 2, 64), lengths=([40, 1, 25], [70, 3, 25]), causal=True,
              window_size=(20, 0), softcap=3.0, alibi="H", sinks=True, quick=True),
    ),
)


def test_conformance(pk_case):
    """One case; see ``portable_kernels.conformance.harness.CaseRun.check``."""
    pk_case.check()
