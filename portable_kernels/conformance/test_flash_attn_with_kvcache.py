"""Conformance of ``flash_attn_with_kvcache``: every variant, dtype and call below against
the float64 reference (``_attn_mods.reference`` per sequence over the gathered cache):
contiguous and paged caches, decode (Nq = 1) and several queries with bottom-right causal,
new tokens appended in place, odd lengths, empty and one-token sequences, GQA and MQA,
FlashAttention's options alone and combined, and forced split counts.

Each call compares four tensors: the output, the LSE (rounded to the inputs' dtype, so
that the harness's one-dtype check holds; the rounding is far inside the tolerance), and
both caches after the append. Cache rows past each sequence's length and the blocks no
sequence uses are NaN, and block-table entries past a sequence's blocks name no block:
reading any of them shows up as NaN in the output.
"""
from __future__ import annotations

import torch

from portable_kernels.conformance.harness import Inputs, KernelSuite, Shape, place
from portable_kernels.conformance.test_flash_attn import FP32, LOW, options

#: What block-table entries past a sequence's blocks hold: far outside any cache, so that
#: a kernel reading one faults or reads garbage instead of passing by luck.
UNUSED_BLOCK = 1 << 30


def paged_cache(lengths, n_new: int, page: int, per_seq: int, h_kv: int, d: int,
                gen: torch.Generator, spare: int = 2) -> tuple:
    """``(k_cache, v_cache, block_table)`` on the CPU, fp32: sequence ``i`` holds
    ``lengths[i]`` random keys and values in blocks drawn at random, room for ``n_new``
    more; NaN everywhere no sequence holds a key (rows past the lengths, ``spare`` blocks
    no sequence uses), and table entries past each sequence's blocks ``UNUSED_BLOCK``."""
    blocks = len(lengths) * per_seq + spare
    caches = [torch.full((blocks, page, h_kv, d), float("nan")) for _ in range(2)]
    order = torch.randperm(blocks, generator=gen)
    table = torch.full((len(lengths), per_seq), UNUSED_BLOCK, dtype=torch.int32)
    used = 0
    for i, n in enumerate(lengths):
        count = -(-(n + n_new) // page)
        table[i, :count] = order[used:used + count].to(torch.int32)
        used += count
        for cache in caches:
            flat = cache[table[i, :count].long()].flatten(0, 1)
            flat[:n] = torch.randn(n, h_kv, d, generator=gen)
            cache[table[i, :count].long()] = flat.view(count, page, h_kv, d)
    return (*caches, table)


def make_inputs(shape, dtype, device, gen) -> Inputs:
    b, n_q, h, h_kv, d = shape["dims"]
    lengths = shape["lengths"]
    n_new = shape.get("new", 0)
    page = shape.get("page", 0)
    capacity = shape["capacity"]
    nan = float("nan")
    q = place(torch.randn(b, n_q, h, d, generator=gen).to(dtype), device)
    if page:
        *caches, table = paged_cache(lengths, n_new, page, capacity // page, h_kv, d, gen)
        block_table = place(table, device)
    else:
        caches = []
        for _ in range(2):
            cache = torch.full((b, capacity, h_kv, d), nan)
            for i, n in enumerate(lengths):
                cache[i, :n] = torch.randn(n, h_kv, d, generator=gen)
            caches.append(cache)
        block_table = None
    k_cache, v_cache = (place(c.to(dtype), device) for c in caches)
    k = v = None
    if n_new:
        k, v = (place(torch.randn(b, n_new, h_kv, d, generator=gen).to(dtype), device)
                for _ in range(2))
    seqlens = shape.get("seqlens", "tensor")
    if seqlens == "tensor":
        cache_seqlens = place(torch.tensor(lengths, dtype=torch.int32), device)
    elif seqlens == "int":
        cache_seqlens = lengths[0]
    else:
        cache_seqlens = None
    kwargs = {"causal": shape.get("causal", False), "sm_scale": shape.get("sm_scale"),
              "num_splits": shape.get("splits", 0)}
    kwargs.update(options(shape, b, h, device, gen))
    return Inputs((q, k_cache, v_cache, k, v, cache_seqlens, block_table), kwargs)


def call(fn, inputs: Inputs):
    """``fn`` on its own copies of the caches (the call appends into them, and the kernel,
    the reference and repeated calls must each start from the same cache): the output,
    the LSE in the output's dtype, and both caches after the call."""
    q, k_cache, v_cache, *rest = inputs.args
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    out, lse = fn(q, k_cache, v_cache, *rest, **inputs.kwargs, return_lse=True)
    return out, lse.to(q.dtype), k_cache, v_cache


SUITE = KernelSuite(
    kernel="flash_attn_with_kvcache",
    make_inputs=make_inputs,
    tolerance="attention",
    arg_names=("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "block_table"),
    call=call,
    # dims: (B, Nq, H, H_kv, D); lengths: keys in the cache per sequence before the append;
    # new: tokens appended; page: block size (0: contiguous); capacity: keys a sequence holds
    shapes=(
        # Decode, paged 16-key blocks (a key step spans two), GQA group of 4, an empty
        # sequence that gets its first token.
        Shape("decode_paged_gqa", dims=(3, 1, 8, 2, 64), lengths=[37, 0, 70], new=1, page=16,
              capacity=96, causal=True, quick=True),
        # Decode, contiguous, MQA, D padded to 128, a one-token sequence, no append.
        Shape("decode_contig_mqa_d80", dims=(2, 1, 4, 1, 80), lengths=[1, 50], capacity=64,
              causal=True),
        # Speculative decoding: 4 new tokens appended and attended, bottom-right causal,
        # split in 3.
        Shape("spec_decode_splits", dims=(3, 4, 4, 2, 64), lengths=[0, 20, 45], new=4,
              page=16, capacity=64, causal=True, splits=3, quick=True),
        # Chunked prefill: more queries than some sequences have keys (rows see nothing).
        Shape("chunked_prefill", dims=(2, 24, 2, 1, 32), lengths=[5, 40], capacity=48,
              causal=True, dtypes=FP32),
        # A 64-key page holds two key steps; sliding window.
        Shape("window_page64", dims=(2, 3, 4, 2, 64), lengths=[100, 13], new=3, page=64,
              capacity=128, causal=True, window_size=(16, -1)),
        Shape("softcap_alibi", dims=(2, 2, 4, 2, 64), lengths=[30, 57], capacity=64,
              softcap=2.0, alibi="BH", dtypes=LOW),
        # Sinks with several splits (the sink counts once, in the combine), and a sequence
        # with no key at all (its rows: zeros, LSE = the sink).
        Shape("sinks_splits", dims=(2, 1, 4, 1, 64), lengths=[90, 0], page=16, capacity=96,
              sinks=True, splits=4),
        Shape("all_options", dims=(2, 2, 4, 2, 64), lengths=[70, 3], new=2, page=16,
              capacity=96, causal=True, window_size=(20, 0), softcap=3.0, alibi="H",
              sinks=True, splits=3, quick=True),
        # cache_seqlens as an int, and as None (every slot holds a key).
        Shape("int_seqlens", dims=(2, 1, 2, 2, 32), lengths=[33, 33], new=1, capacity=40,
              seqlens="int", causal=True, sm_scale=0.3),
        Shape("full_cache_none", dims=(2, 1, 4, 2, 32), lengths=[48, 48], page=16, capacity=48,
              seqlens="none", causal=True),
    ),
)


def test_conformance(pk_case):
    """One case; see ``portable_kernels.conformance.harness.CaseRun.check``."""
    pk_case.check()
