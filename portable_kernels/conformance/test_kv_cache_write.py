"""Conformance of ``kv_cache_write(k, v, k_cache, v_cache, slot_mapping)``: every variant
and dtype, paged and contiguous caches, int32 and int64 slots, padding slots (-1), strided
new tokens. The caches start NaN, so the comparison of both caches after the write checks
every slot: written where the mapping says, untouched elsewhere."""
from __future__ import annotations

import torch

from portable_kernels.conformance.harness import Inputs, KernelSuite, Shape, place


def make_inputs(shape, dtype, device, gen) -> Inputs:
    t, h_kv, d = shape["tokens"]
    rows, cols = shape["cache"]  # (num_blocks, block_size) or (B, N_max)
    new = []
    for _ in range(2):
        values = torch.randn(t, h_kv, d, generator=gen).to(dtype)
        if shape.get("layout") == "thd_strided":
            # Tokens of a fused QKV-like buffer: heads and tokens strided, D contiguous.
            base = torch.full((t, h_kv + 3, d), float("nan"), dtype=dtype)
            base[:, :h_kv] = values
            new.append(place(base, device)[:, :h_kv])
        else:
            new.append(place(values, device))
    caches = [place(torch.full((rows, cols, h_kv, d), float("nan")).to(dtype), device)
              for _ in range(2)]
    slots = torch.randperm(rows * cols, generator=gen)[:t]
    padding = shape.get("padding", 0)
    if padding:
        slots[torch.randperm(t, generator=gen)[:padding]] = -1
    slots = place(slots.to(shape.get("slot_dtype", torch.int32)), device)
    return Inputs((*new, *caches, slots))


def call(fn, inputs: Inputs):
    """``fn`` on copies of the caches (kernel and reference each write their own); returns
    both caches after the write."""
    k, v, k_cache, v_cache, slots = inputs.args
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    fn(k, v, k_cache, v_cache, slots)
    return k_cache, v_cache


SUITE = KernelSuite(
    kernel="kv_cache_write",
    make_inputs=make_inputs,
    tolerance="elementwise",
    arg_names=("k", "v", "k_cache", "v_cache", "slot_mapping"),
    call=call,
    # tokens: (T, H_kv, D); cache: (num_blocks, block_size) paged, or (B, N_max) contiguous
    shapes=(
        Shape("paged_padding", tokens=(37, 2, 64), cache=(5, 16), padding=6, quick=True),
        Shape("paged_int64_d80", tokens=(20, 1, 80), cache=(3, 32), slot_dtype=torch.int64),
        Shape("contiguous", tokens=(9, 4, 32), cache=(2, 40), quick=True),
        Shape("strided_tokens", tokens=(70, 2, 128), cache=(6, 16), layout="thd_strided",
              padding=3),
        Shape("no_tokens", tokens=(0, 2, 64), cache=(2, 16)),
    ),
)


def test_conformance(pk_case):
    """One case; see ``portable_kernels.conformance.harness.CaseRun.check``."""
    pk_case.check()
