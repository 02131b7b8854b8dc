"""One config per kernel for Triton's interpreter.

The interpreter costs about 30 µs per program and 60 µs per ``tl`` operation whatever the
block size, so blocks are as large as the kernel allows: fewer programs and fewer loop
iterations. It cannot autotune, so each entry is a single config.
"""
from __future__ import annotations

import triton

from portable_kernels_backends import _common

# (kernel, variant) first, then (kernel, None) for every variant of the kernel.
_CONFIGS: dict[tuple[str, str | None], triton.Config] = {
    ("vector_add", None): triton.Config({"BLOCK_SIZE": 4096}, num_warps=1),
    ("swiglu", None): triton.Config({"BLOCK_SIZE": 4096}, num_warps=1),
    ("geglu", None): triton.Config({"BLOCK_SIZE": 4096}, num_warps=1),
    ("softmax", None): triton.Config({"MAX_BLOCK_N": 1024}, num_warps=1),
    ("dropout", None): triton.Config({"BLOCK_SIZE": 4096}, num_warps=1),
    ("asin", None): triton.Config({"BLOCK_SIZE": 4096}, num_warps=1),
    # Programs run one at a time here, so the lock never contends; two partial rows still
    # make programs share one, which is the path worth exercising.
    ("layer_norm", None): triton.Config({"MAX_BLOCK_N": 1024, "TILE": 16384, "GROUPS": 2},
                                        num_warps=1),
    ("rms_norm", None): triton.Config({"MAX_BLOCK_N": 1024, "TILE": 16384, "GROUPS": 2},
                                      num_warps=1),
    # GEMMs: 64-wide tiles in every dimension, so a test-sized problem is a few programs
    # of one or two K steps. The TMA variants, when forced here, also exercise their
    # two-halves epilogue.
    ("matmul", None): triton.Config(
        {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 4}, num_warps=1),
    ("matmul", "nvidia.persistent_tma"): triton.Config(
        {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 4,
         "EPILOGUE_SUBTILE": True}, num_warps=1),
    ("grouped_matmul", None): triton.Config(
        {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 4}, num_warps=1),
    ("grouped_matmul", "nvidia.tma"): triton.Config(
        {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 4,
         "EPILOGUE_SUBTILE": True}, num_warps=1),
    # Attention: each key-loop step costs about 4 ms whatever the tile, so tiles are large;
    # 64 (not 128) still gives test-sized sequences several query and key blocks, which
    # exercises the causal diagonal and both loop stages. Every variant, forward and back.
    ("flash_attn", None): triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=1),
    ("rope", None): triton.Config({"TILE": 16384}, num_warps=1),
    ("add_rms_norm", None): triton.Config({"MAX_BLOCK_N": 1024, "TILE": 16384, "GROUPS": 2},
                                          num_warps=1),
    # Decode attention: 32 keys a step, so that test-sized caches span several key blocks
    # (the split-K merge runs) and a step spans two 16-key pages (the gather); whole
    # test-sized batches in one append or combine program.
    ("flash_attn_with_kvcache", None): triton.Config(
        {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_R": 64, "WRITE_BLOCK_T": 64}, num_warps=1),
    ("kv_cache_write", None): triton.Config({"BLOCK_T": 64}, num_warps=1),
    # 1024-wide vocabulary chunks: test-sized vocabularies of a few thousand still take
    # several chunks (the online max/sum's rescaling); narrow ones pack rows per program.
    ("cross_entropy", None): triton.Config({"MAX_BLOCK_V": 1024, "TILE": 8192}, num_warps=1),
    ("fused_linear_cross_entropy", None): triton.Config({"MAX_BLOCK_V": 1024, "TILE": 8192},
                                                        num_warps=1),
}


def config(kernel: str, variant: str) -> triton.Config | None:
    """The interpreter config for ``variant`` of ``kernel``, or None."""
    return _common.lookup(_CONFIGS, kernel, variant)
