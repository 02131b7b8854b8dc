"""Decode attention over a KV cache on an NVIDIA GPU: ``flash_attn_with_kvcache`` against
torch SDPA on the same contiguous cache, in the same run.

Rows: one decode step (Nq = 1), H = 32 query heads over H_kv = 8, D = 128, B in
{1, 8, 64}, keys in {1k, 8k, 32k, 128k} per sequence (every sequence full), caches paged
(16-key blocks, the block table a random permutation) and contiguous; bf16 by default.
Columns:

- ``ours``: ``flash_attn_with_kvcache`` through its handle, ``num_splits=0`` (the split
  from the device's SM count), device time and the KV-cache read bandwidth it reaches
  (``2·B·keys·H_kv·D`` elements read, K and V, once: the GQA heads share each read);
- ``sdpa``: ``scaled_dot_product_attention(enable_gqa=True)`` on the contiguous cache
  viewed as (B, H_kv, N, D), the fastest of its flash, efficient, cuDNN and math backends
  that takes the call (the ratio ``ours / sdpa`` is of times: below 1 is faster);
- ``copy``: a device-to-device copy of the K and V caches, the bandwidth decode can hope
  for (counted read plus write);
- ``host``: microseconds of host time per eager call of ours (the Python and launch path;
  calls issued back to back, timed before the final synchronize).

Ours is checked against SDPA before it is timed (the library's "attention" tolerance); a
wrong result is reported and not timed. Device times are the median of
``triton.testing.do_bench`` (``--cudagraph``: of CUDA-graph replays).

    python bench/serving_attention.py [--quick] [--batches 1,8,64] [--keys 1024,...]
                                      [--layouts paged,contiguous] [--json PATH]
                                      [--dtypes bf16] [--cudagraph] [--set MODULE.NAME=VALUE]

With ``--json PATH``, writes it and the Markdown table beside it after every row. Needs an
NVIDIA GPU; on a
CPU-only machine it exits with a message. Rows whose caches do not fit in the GPU's
memory are skipped and say so.
"""
from __future__ import annotations

import portable_kernels as pk  # first: it chooses the interpreter before triton is imported

import time

import torch
import triton

from portable_kernels.testing import assert_close, tolerance

import _common  # bench/, beside this script

H, H_KV, D, PAGE = 32, 8, 128, 16


def _ints(arg: str) -> list[int]:
    return [int(x) for x in arg.split(",") if x.strip()]


def _sdpa_backends():
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}


def _host_us(fn, iters: int = 200) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - t0) / iters * 1e6
    torch.cuda.synchronize()
    return host


def _row(batch: int, keys: int, layout: str, dtype: torch.dtype, cudagraph: bool) -> dict:
    from torch.nn.attention import sdpa_kernel

    row = {"batch": batch, "keys": keys, "layout": layout, "dtype": str(dtype).split(".")[-1],
           "ms": {}, "tbps": {}, "error": {}}
    elem = torch.finfo(dtype).bits // 8
    cache_bytes = 2 * batch * keys * H_KV * D * elem
    free, _ = torch.cuda.mem_get_info()
    if cache_bytes * 2.2 > free:  # the caches, plus the copy's destination
        row["error"]["all"] = f"skipped: caches of {cache_bytes / 2**30:.1f} GiB do not fit"
        return row
    gen = torch.Generator(device="cuda").manual_seed(batch * 7 + keys)
    q = torch.randn(batch, 1, H, D, device="cuda", dtype=dtype, generator=gen)
    k_dense = torch.randn(batch, keys, H_KV, D, device="cuda", dtype=dtype, generator=gen)
    v_dense = torch.randn(batch, keys, H_KV, D, device="cuda", dtype=dtype, generator=gen)
    call = pk.get_kernel("flash_attn_with_kvcache")
    seqlens = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
    if layout == "paged":
        per_seq = keys // PAGE
        perm = torch.randperm(batch * per_seq, device="cuda", generator=gen)
        table = perm.to(torch.int32).view(batch, per_seq)
        k_cache = torch.empty(batch * per_seq, PAGE, H_KV, D, device="cuda", dtype=dtype)
        v_cache = torch.empty_like(k_cache)
        k_cache[perm] = k_dense.view(batch * per_seq, PAGE, H_KV, D)
        v_cache[perm] = v_dense.view(batch * per_seq, PAGE, H_KV, D)
        def ours():
            return call(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table)
    else:
        def ours():
            return call(q, k_dense, v_dense, cache_seqlens=seqlens)

    qt, kt, vt = q.transpose(1, 2), k_dense.transpose(1, 2), v_dense.transpose(1, 2)
    sdpa = {}
    for name, backend in _sdpa_backends().items():
        def run(backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        if _common.first_call(row, f"sdpa_{name}", run) is not None:
            sdpa[name] = run
    reference = next(iter(sdpa.values()))() if sdpa else None

    out = _common.first_call(row, "ours", ours)
    if out is not None and reference is not None:
        try:
            assert_close(out, reference.transpose(1, 2), tolerance(dtype, "attention"), "ours")
        except AssertionError as exc:
            row["error"]["ours"] = str(exc)
            out = None
    bench = triton.testing.do_bench_cudagraph if cudagraph else triton.testing.do_bench
    if out is not None:
        row["ms"]["ours"] = bench(ours, return_mode="median")
        row["tbps"]["ours"] = cache_bytes / (row["ms"]["ours"] * 1e-3) / 1e12
        row["host_us"] = _host_us(ours)
    for name, run in sdpa.items():
        row["ms"][f"sdpa_{name}"] = bench(run, return_mode="median")
    best = min((row["ms"][f"sdpa_{n}"], n) for n in sdpa) if sdpa else None
    if best is not None:
        row["sdpa_best"] = best[1]
        row["ms"]["sdpa"] = best[0]
        row["tbps"]["sdpa"] = cache_bytes / (best[0] * 1e-3) / 1e12
    dst_k, dst_v = torch.empty_like(k_dense), torch.empty_like(v_dense)

    def copy():
        dst_k.copy_(k_dense)
        dst_v.copy_(v_dense)

    row["ms"]["copy"] = bench(copy, return_mode="median")
    row["tbps"]["copy"] = 2 * cache_bytes / (row["ms"]["copy"] * 1e-3) / 1e12
    return row


def _table(header: str):
    def table(rows: list[dict]) -> str:
        lines = [header, "",
                 "| B | keys | cache | dtype | ours ms | ours TB/s | SDPA best | SDPA ms | "
                 "ours/SDPA | copy TB/s | ours/copy | host µs |",
                 "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            ms, tb = r["ms"], r["tbps"]
            fmt = lambda x, f="{:.3f}": "-" if x is None else f.format(x)  # noqa: E731
            ratio = (ms["ours"] / ms["sdpa"]) if "ours" in ms and "sdpa" in ms else None
            of_copy = (tb["ours"] / tb["copy"]) if "ours" in tb and "copy" in tb else None
            lines.append(
                f"| {r['batch']} | {r['keys']} | {r['layout']} | {r['dtype']} | "
                f"{fmt(ms.get('ours'))} | {fmt(tb.get('ours'), '{:.2f}')} | "
                f"{r.get('sdpa_best', '-')} | {fmt(ms.get('sdpa'))} | {fmt(ratio, '{:.2f}')} | "
                f"{fmt(tb.get('copy'), '{:.2f}')} | {fmt(of_copy, '{:.2f}')} | "
                f"{fmt(r.get('host_us'), '{:.1f}')} |")
        return "\n".join(lines) + "\n"

    return table


def main() -> None:
    parser = _common.options(__doc__, "B in {1, 64}, keys in {8k, 128k}, paged only")
    parser.set_defaults(dtypes="bf16")
    parser.add_argument("--batches", default="1,8,64", help="comma-separated batch sizes")
    parser.add_argument("--keys", default="1024,8192,32768,131072",
                        help="comma-separated keys per sequence (multiples of 16)")
    parser.add_argument("--layouts", default="paged,contiguous",
                        help="comma-separated: paged (16-key blocks), contiguous")
    args = parser.parse_args()
    settings = _common.apply_settings(args.set)
    _common.no_plots("bench/serving_attention.py", args.plot)
    info = _common.nvidia_gpu("bench/serving_attention.py", "torch SDPA",
                              "tests/test_flash_attn_kvcache.py")
    batches, keys, layouts = _ints(args.batches), _ints(args.keys), args.layouts.split(",")
    if args.quick:
        batches, keys, layouts = [1, 64], [8192, 131072], ["paged"]
    header = _common.header("flash_attn_with_kvcache (decode)", info, args.cudagraph)
    rows, start = [], time.time()
    for dtype in _common.dtypes(args.dtypes):
        for layout in layouts:
            for b in batches:
                for n in keys:
                    rows.append(_row(b, n, layout, dtype, args.cudagraph))
                    _common.write(args.json, rows, {**_common.meta(info, args.cudagraph),
                                                    "settings": settings}, _table(header))
                    torch.cuda.empty_cache()
    print(_table(header)(rows))
    _common.closing(args.json, rows, lambda r: f"B={r['batch']} keys={r['keys']} {r['layout']}",
                    start)


if __name__ == "__main__":
    main()
