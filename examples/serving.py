"""A serving loop on a paged KV cache: prefill a batch of prompts, then decode token by token.

The calls an inference engine makes, in FlashAttention's and vLLM's layouts:

1. prefill: the prompts packed into one (tokens, H, D) batch, attended per sequence by
   ``flash_attn_varlen`` (causal, ``cu_seqlens`` marking where each prompt starts);
2. their keys and values written into a paged cache by ``kv_cache_write`` (one flat slot
   per token: block number x block size + offset, from each sequence's block table);
3. decode: one new token per sequence a step, its key and value appended into the cache in
   place by ``flash_attn_with_kvcache`` (at ``cache_seqlens``), which then attends over the
   whole cache with the keys split across programs; the caller advances ``cache_seqlens``.
   On a CUDA GPU the step is also captured in a CUDA graph after one warm call and replayed.

Every step is checked against attention in float64 over the keys so far. The model is
random projections, not a network: the point is the calls and their layouts.

    python examples/serving.py               # the current GPU, else the CPU interpreter
"""
from __future__ import annotations

import portable_kernels as pk  # first: it turns Triton's interpreter on where there is no GPU

import torch

from portable_kernels import ops


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of one sequence's last ``Nq`` queries over its ``Nk`` keys (the
    queries aligned to the end of the keys, as decode needs), in float64: q (Nq, H, D),
    k/v (Nk, H_kv, D) -> (Nq, H, D)."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (t.double().transpose(0, 1) for t in (q, k, v))
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    scores = q @ k.transpose(1, 2) / q.shape[-1] ** 0.5
    nq, nk = q.shape[1], k.shape[1]
    seen = torch.arange(nk) <= torch.arange(nq)[:, None] + (nk - nq)
    scores = scores.masked_fill(~seen.to(scores.device), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.float32
    tol = 2e-2 if dtype == torch.float16 else 1e-4
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, page = 8, 2, 64, 16
    prompts = [5, 23, 40]                       # prompt lengths of the batch's sequences
    steps = 4                                   # tokens decoded per sequence
    batch, pages_per_seq = len(prompts), 4      # room for 64 tokens a sequence

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    # The paged cache: a pool of blocks, each sequence's blocks listed in its table (here a
    # shuffled assignment, as an allocator hands them out).
    k_cache, v_cache = (torch.zeros(batch * pages_per_seq, page, kv_heads, dim, device=device,
                                    dtype=dtype) for _ in range(2))
    table = torch.randperm(batch * pages_per_seq, generator=gen).view(batch, pages_per_seq)
    table = table.to(device, torch.int32)

    # 1. Prefill: every prompt in one packed batch.
    cu = torch.tensor([0] + prompts, device=device).cumsum(0).to(torch.int32)
    total = sum(prompts)
    q, k, v = rand(total, heads, dim), rand(total, kv_heads, dim), rand(total, kv_heads, dim)
    out = ops.flash_attn_varlen(q, k, v, cu, cu, max(prompts), max(prompts), causal=True)
    history = []  # each sequence's keys and values so far, for the reference
    err = 0.0
    for b, (start, n) in enumerate(zip(cu.tolist(), prompts)):
        part = slice(start, start + n)
        want = reference(q[part], k[part], v[part])
        err = max(err, (out[part].double() - want).abs().max().item())
        history.append([k[part], v[part]])
    variant = pk.explain("flash_attn_varlen", q, k, v, cu, cu, max(prompts), max(prompts)).variant
    print(f"prefill  {total:3d} tokens of {batch} prompts, flash_attn_varlen ({variant}): "
          f"max |error| {err:.1e}")
    assert err <= tol, f"prefill error {err} > {tol}"

    # 2. The prompts' keys and values into the cache, one flat slot per token.
    positions = torch.cat([torch.arange(n) for n in prompts]).to(device)
    owner = torch.cat([torch.full((n,), b) for b, n in enumerate(prompts)]).to(device)
    slots = table[owner, positions // page].long() * page + positions % page
    ops.kv_cache_write(k, v, k_cache, v_cache, slots)

    # 3. Decode: one token per sequence a step, appended in place, then attended.
    seqlens = torch.tensor(prompts, device=device, dtype=torch.int32)
    step_q = rand(batch, 1, heads, dim)
    step_k, step_v = rand(batch, 1, kv_heads, dim), rand(batch, 1, kv_heads, dim)

    def decode() -> torch.Tensor:
        return ops.flash_attn_with_kvcache(step_q, k_cache, v_cache, k=step_k, v=step_v,
                                           cache_seqlens=seqlens, block_table=table)

    graph = None
    for step in range(steps):
        if step == 1 and device == "cuda":
            # After one warm call with these shapes: capture the step, then replay it with new
            # values written into the same tensors (lengths included).
            # (A capture records the launches without running them.)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                graph_out = decode()
        for t in (step_q, step_k, step_v):
            t.copy_(torch.randn(t.shape, generator=gen))
        if graph is not None:
            graph.replay()
            out = graph_out
        else:
            out = decode()
        err = 0.0
        for b in range(batch):
            history[b] = [torch.cat([history[b][0], step_k[b]]),
                          torch.cat([history[b][1], step_v[b]])]
            err = max(err, (out[b].double() - reference(step_q[b], *history[b])).abs().max().item())
        how = "CUDA graph replay" if graph is not None else "eager"
        print(f"decode   step {step}: {batch} tokens over {seqlens.tolist()} cached keys, "
              f"flash_attn_with_kvcache ({how}): max |error| {err:.1e}")
        assert err <= tol, f"decode step {step}: error {err} > {tol}"
        seqlens += 1  # the append does not advance the lengths (as FlashAttention)


if __name__ == "__main__":
    main()
