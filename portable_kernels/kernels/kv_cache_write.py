"""kv_cache_write: store new keys and values into a KV cache in place, by slot.

``kv_cache_write(k, v, k_cache, v_cache, slot_mapping)`` is vLLM's ``reshape_and_cache`` for
engines that keep their own cache: token ``t`` of ``k``/``v`` (T, H_kv, D) goes to flat slot
``slot_mapping[t] = block * block_size + offset`` of the cache, which is either contiguous
(B, N_max, H_kv, D), where the slot is ``b * N_max + position``, or paged
(num_blocks, block_size, H_kv, D). A slot of -1 skips its token (padding of a batch).

One kernel, two ways of finding a token's slot (constexpr ``APPEND``):
    APPEND=False: read it from ``slot_mapping`` (this family's call).
    APPEND=True: compute it on the device from ``cache_seqlens`` and, for a paged cache,
        ``block_table``: token ``i`` of sequence ``b`` goes to position
        ``cache_seqlens[b] + i``. ``flash_attn_with_kvcache`` appends its new tokens this
        way, so that no host work depends on values and the call stays capturable in a CUDA
        graph.
Each program copies ``BLOCK_T`` tokens of one K/V head, keys and values together. The copy
is exact (no arithmetic), so every dtype goes through unchanged, bf16 under the interpreter
included.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..registry import KernelSpec, Variant
from . import _host

NAME = "kv_cache_write"
#: Paged caches' block size must be a multiple of this (FlashAttention's paged KV cache:
#: the attention kernel gathers whole 16-row pieces).
PAGE_MULTIPLE = 16


@triton.jit
def _kv_cache_write_kernel(
    # pointers
    k, v, k_cache, v_cache, slots, seqlens, block_table,
    # sizes
    T, N_NEW, D, seqlen_const, N_MAX,
    # strides: new tokens (sequence, position, head, dim), caches, block table
    s_kb, s_kn, s_kh, s_kd, s_vb, s_vn, s_vh, s_vd,
    s_kcb, s_kcn, s_kch, s_kcd, s_vcb, s_vcn, s_vch, s_vcd, s_bt0, s_bt1,
    # meta-parameters
    APPEND: tl.constexpr, HAS_SEQLENS: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # --- program id to tokens -----------------------------------------------------------------
    pid_t = tl.program_id(0)
    head = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    live = offs_t < T
    # Token t is position i of sequence b (a flat (T,) batch is one sequence of T tokens).
    b = offs_t // N_NEW
    i = offs_t % N_NEW

    # --- where each token goes: (cache row block, row within it) ------------------------------
    if APPEND:
        if HAS_SEQLENS:
            pos = tl.load(seqlens + b, mask=live, other=0) + i
        else:
            pos = seqlen_const + i
        if PAGE > 0:
            # The block table is read only for live tokens: entries past a sequence's
            # blocks may hold anything (-1, stale pages).
            blk = tl.load(block_table + b.to(tl.int64) * s_bt0 + (pos // PAGE) * s_bt1,
                          mask=live, other=0).to(tl.int64)
            row = (pos % PAGE).to(tl.int64)
        else:
            blk = b.to(tl.int64)
            row = pos.to(tl.int64)
    else:
        slot = tl.load(slots + offs_t, mask=live, other=-1).to(tl.int64)
        # -1 marks padding: such tokens are not written anywhere.
        live = live & (slot >= 0)
        slot = tl.maximum(slot, 0)
        blk = slot // N_MAX
        row = slot % N_MAX

    # --- copy: [BLOCK_T, BLOCK_D] of keys and of values ---------------------------------------
    mask = live[:, None] & (offs_d[None, :] < D)
    b64 = b.to(tl.int64)[:, None]
    i64 = i.to(tl.int64)[:, None]
    d64 = offs_d.to(tl.int64)[None, :]
    key = tl.load(k + b64 * s_kb + i64 * s_kn + head * s_kh + d64 * s_kd, mask=mask)
    val = tl.load(v + b64 * s_vb + i64 * s_vn + head * s_vh + d64 * s_vd, mask=mask)
    tl.store(k_cache + blk[:, None] * s_kcb + row[:, None] * s_kcn + head * s_kch + d64 * s_kcd,
             key, mask=mask)
    tl.store(v_cache + blk[:, None] * s_vcb + row[:, None] * s_vcn + head * s_vch + d64 * s_vcd,
             val, mask=mask)


# --- host side --------------------------------------------------------------------------------

class Problem(NamedTuple):
    device: torch.device
    dtype: torch.dtype


def check_cache(kernel: str, k_cache, v_cache) -> torch.device:
    """Checks shared with ``flash_attn_with_kvcache``: two 4-D caches of one shape, dtype and
    device. Returns the device."""
    device = _host.same_device(kernel, k_cache=k_cache, v_cache=v_cache)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _host.check_ndim(kernel, name, t, 4,
                         "(B, N_max, H_kv, D) or paged (num_blocks, block_size, H_kv, D)")
        _host.check_dtype(kernel, name, t)
    _host.check_same_shape(kernel, k_cache=k_cache, v_cache=v_cache)
    _host.check_same_dtype(kernel, k_cache=k_cache, v_cache=v_cache)
    return device


def check_new(kernel: str, k, v, k_cache, ndim: int, layout: str) -> None:
    """``k``/``v`` hold new tokens for ``k_cache``: same dtype, heads and head dim."""
    for name, t in (("k", k), ("v", v)):
        _host.check_ndim(kernel, name, t, ndim, layout)
    _host.check_same_shape(kernel, k=k, v=v)
    _host.check_same_dtype(kernel, k=k, v=v, k_cache=k_cache)
    if tuple(k.shape[-2:]) != tuple(k_cache.shape[-2:]):
        raise _host.InputError(
            f"{kernel}: k and v must have the cache's (H_kv, D) = {tuple(k_cache.shape[-2:])} "
            f"in their last two dimensions, got {tuple(k.shape[-2:])}")


def problem(k, v, k_cache, v_cache, slot_mapping) -> Problem:
    """Check a ``kv_cache_write`` call and return its selection key."""
    device = _host.same_device(NAME, k=k, v=v, k_cache=k_cache, v_cache=v_cache,
                               slot_mapping=slot_mapping)
    check_cache(NAME, k_cache, v_cache)
    check_new(NAME, k, v, k_cache, 3, "(T, H_kv, D)")
    _host.check_dtype(NAME, "slot_mapping", slot_mapping, (torch.int32, torch.int64))
    if tuple(slot_mapping.shape) != (k.shape[0],):
        raise _host.InputError(f"{NAME}: slot_mapping must have shape ({k.shape[0]},) (one slot "
                               f"per token of k), got {tuple(slot_mapping.shape)}")
    if _host.check_values() and slot_mapping.numel():
        slots = k_cache.shape[0] * k_cache.shape[1]
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < -1 or hi >= slots:
            raise _host.InputError(f"{NAME}: slot_mapping values must be -1 (skip) or in "
                                   f"[0, {slots}) (the cache's slots), got {lo} ... {hi}")
    return Problem(device, k_cache.dtype)


def write(plan, k, v, k_cache, v_cache, *, slots=None, seqlens=None, seqlen_const=0,
          block_table=None, block_t: int = 16, num_warps: int = 1) -> None:
    """Launch the copy (module docstring). ``k``/``v`` are (B, N_new, H_kv, D); with
    ``slots`` each token's slot comes from it, else it is appended at ``seqlens[b]`` (a
    device tensor) or ``seqlen_const``, through ``block_table`` for a paged cache."""
    b, n_new, h_kv, d = k.shape
    total = b * n_new
    if total == 0 or h_kv == 0 or d == 0:
        return
    append = slots is None
    paged = block_table is not None
    dummy = k_cache  # an unused pointer argument still needs a tensor
    bt = block_table if paged else dummy
    grid = (_host.cdiv(total, block_t), h_kv)
    _host.launcher(plan, _kv_cache_write_kernel)[grid](
        k, v, k_cache, v_cache, dummy if append else slots,
        seqlens if seqlens is not None else dummy, bt,
        total, n_new, d, int(seqlen_const), k_cache.shape[1],
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        *(block_table.stride() if paged else (0, 0)),
        APPEND=append, HAS_SEQLENS=seqlens is not None,
        PAGE=k_cache.shape[1] if (append and paged) else 0,
        BLOCK_T=block_t, BLOCK_D=max(16, _host.next_power_of_2(d)), num_warps=num_warps)


def launch(plan, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           slot_mapping: torch.Tensor) -> None:
    """Store ``k``, ``v`` (T, H_kv, D) into ``k_cache``, ``v_cache`` in place at the flat
    slots ``slot_mapping`` (T,) int32/int64 (``block * block_size + offset``; -1 skips the
    token). The caches are (B, N_max, H_kv, D) or paged (num_blocks, block_size, H_kv, D),
    of k's dtype (fp16, bf16, fp32). Returns None."""
    cfg = plan.config
    write(plan, k[None], v[None], k_cache, v_cache, slots=slot_mapping,
          block_t=cfg.kwargs.get("BLOCK_T", 16), num_warps=cfg.num_warps)


def reference(k, v, k_cache, v_cache, slot_mapping):
    """The write in plain torch, on the given caches (in place)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    for new, cache in ((k, k_cache), (v, v_cache)):
        flat = cache.view(-1, *cache.shape[2:])
        flat[slots] = new[keep].to(cache.dtype)


def inputs(shape: str, dtype: torch.dtype, device) -> tuple:
    """A random write (shape string ``"TxBLOCKSxBLOCK_SIZExH_KVxD"``): T tokens to distinct
    random slots of a paged cache."""
    t, blocks, size, h_kv, d = _host.parse_shape(NAME, shape, "TxBLOCKSxBLOCK_SIZExH_KVxD")
    k, v = (torch.randn(t, h_kv, d, device=device).to(dtype) for _ in range(2))
    k_cache, v_cache = (torch.zeros(blocks, size, h_kv, d, device=device, dtype=dtype)
                        for _ in range(2))
    slots = torch.randperm(blocks * size, device=device)[:t]
    return (k, v, k_cache, v_cache, slots), {}


def default_configs(device) -> list:
    return [triton.Config({"BLOCK_T": 16}, num_warps=4)]


def register(registry) -> None:
    registry.add_kernel(KernelSpec(
        NAME, "(k, v, k_cache, v_cache, slot_mapping) -> None", problem,
        "store new keys/values into a contiguous or paged KV cache by flat slot (vLLM's "
        "reshape_and_cache; slot -1 skips), in place", reference, inputs,
        "TxBLOCKSxBLOCK_SIZExH_KVxD"))
    registry.add_variant(Variant(
        NAME, "generic", launch, accepts=_host.dtype_supported, configs=default_configs,
        replay=True, description="one program per BLOCK_T tokens of a head; pointer loads and stores"))
