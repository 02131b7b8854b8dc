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

Two more tables (``--modes``; all three by default), for the other serving targets:

- ``prefill``: a packed batch of 16 sequences of random lengths 100-4096 (seeded), causal,
  bf16, H = 32 over H_kv = 8, D = 128: ``flash_attn_varlen`` against our fixed-length
  ``flash_attn`` on an equal-token batch (16 sequences of the mean length, as many
  tokens), each counted with its own causal FLOPs (``2·2·sum(n²/2)·H·D``), and against
  SDPA on the padded (16, H, max, D) batch with a boolean padding-and-causal mask (its
  best backend that takes a mask; counted with the varlen batch's FLOPs, the useful work);
- ``window``: N = 16384, causal, a 1024-key window (``window_size=(1023, 0)``) against the
  same call without the window: the time ratio (the target is at most 0.35).

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
    # The dense caches, the copy's destination and, paged, the pages: 2 or 3 times the caches.
    if cache_bytes * (3.2 if layout == "paged" else 2.2) > free:
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
        try:
            row["ms"][f"sdpa_{name}"] = bench(run, return_mode="median")
        except torch.OutOfMemoryError:  # the math backend expands GQA's K/V to every head
            row["error"][f"sdpa_{name}"] = "out of memory"
            torch.cuda.empty_cache()
    timed = [n for n in sdpa if f"sdpa_{n}" in row["ms"]]
    best = min((row["ms"][f"sdpa_{n}"], n) for n in timed) if timed else None
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


def _prefill_rows(dtype: torch.dtype, quick: bool) -> list[dict]:
    """The packed-batch prefill row (module docstring)."""
    from torch.nn.attention import sdpa_kernel

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(100, 4097, (4 if quick else 16,), generator=gen).tolist()
    total, longest = sum(lengths), max(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    q = torch.randn(total, H, D, device="cuda", dtype=dtype)
    k, v = (torch.randn(total, H_KV, D, device="cuda", dtype=dtype) for _ in range(2))
    flops = sum(2 * 2 * n * n / 2 * H * D for n in lengths)
    row = {"case": f"varlen {len(lengths)} seqs, {total} tokens", "ms": {}, "tflops": {},
           "error": {}}
    varlen = pk.get_kernel("flash_attn_varlen")
    dense = pk.get_kernel("flash_attn")

    def ours():
        return varlen(q, k, v, cu, cu, longest, longest, causal=True)

    mean = round(total / len(lengths))
    q1 = torch.randn(len(lengths), H, mean, D, device="cuda", dtype=dtype)
    k1, v1 = (torch.randn(len(lengths), H_KV, mean, D, device="cuda", dtype=dtype) for _ in range(2))
    fixed_flops = len(lengths) * 2 * 2 * mean * mean / 2 * H * D

    def fixed():
        return dense(q1, k1, v1, causal=True)

    padded = [torch.zeros(len(lengths), heads, longest, D, device="cuda", dtype=dtype)
              for heads in (H, H_KV, H_KV)]
    valid = torch.zeros(len(lengths), longest, dtype=torch.bool, device="cuda")
    for i, n in enumerate(lengths):
        for dst, src in zip(padded, (q, k, v)):
            dst[i, :, :n] = src[cu[i]:cu[i] + n].transpose(0, 1)
        valid[i, :n] = True
    causal = torch.ones(longest, longest, dtype=torch.bool, device="cuda").tril()
    mask = (causal[None] & valid[:, None, :])[:, None]

    sdpa = {}
    for name, backend in _sdpa_backends().items():
        def run(backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(
                    *padded, attn_mask=mask, enable_gqa=True)
        if _common.first_call(row, f"sdpa_{name}", run) is not None:
            sdpa[name] = run
    out = _common.first_call(row, "ours", ours)
    if out is not None and sdpa:
        ref = next(iter(sdpa.values()))()
        got = torch.cat([out[cu[i]:cu[i] + n].transpose(0, 1) for i, n in enumerate(lengths)], 1)
        want = torch.cat([ref[i, :, :n] for i, n in enumerate(lengths)], 1)
        try:
            assert_close(got, want, tolerance(dtype, "attention"), "ours")
        except AssertionError as exc:
            row["error"]["ours"] = str(exc)
            out = None
    timed = {"fixed-length flash_attn": fixed, **{f"sdpa_{n}": r for n, r in sdpa.items()}}
    if out is not None:
        timed["ours"] = ours
    for name, fn in timed.items():
        try:
            row["ms"][name] = triton.testing.do_bench(fn, return_mode="median")
        except torch.OutOfMemoryError as exc:  # SDPA's math backend on a smaller card
            row["error"][name] = f"OutOfMemoryError: {str(exc).splitlines()[0][:120]}"
            torch.cuda.empty_cache()
            continue
        work = fixed_flops if fn is fixed else flops
        row["tflops"][name] = work / (row["ms"][name] * 1e-3) / 1e12
    timed_sdpa = [n for n in sdpa if f"sdpa_{n}" in row["ms"]]  # not those that ran out of memory
    if timed_sdpa:
        best = min(timed_sdpa, key=lambda n: row["ms"][f"sdpa_{n}"])
        row["sdpa_best"], row["ms"]["sdpa"] = best, row["ms"][f"sdpa_{best}"]
    return [row]


def _window_rows(dtype: torch.dtype, quick: bool) -> list[dict]:
    """Sliding-window causal attention against full causal attention (module docstring)."""
    n, window = (4096 if quick else 16384), 1024
    q = torch.randn(1, H, n, D, device="cuda", dtype=dtype)
    k, v = (torch.randn(1, H_KV, n, D, device="cuda", dtype=dtype) for _ in range(2))
    fa = pk.get_kernel("flash_attn")
    row = {"case": f"N={n}, window {window}", "ms": {}, "tflops": {}, "error": {}}
    windowed = _common.first_call(
        row, "window", lambda: fa(q, k, v, causal=True, window_size=(window - 1, 0)))
    if windowed is not None:
        from portable_kernels.kernels import _attn_mods

        # Rows 0 and 5000-ish of one head against the float64 reference of their keys.
        for i in (0, n // 2 + 5):
            lo = max(0, i - window + 1)
            ref, _ = _attn_mods.reference(q[:, :1, i:i + 1], k[:, :1, lo:i + 1],
                                          v[:, :1, lo:i + 1])
            assert_close(windowed[:, :1, i:i + 1], ref, tolerance(dtype, "attention"), "window")
        row["ms"]["window"] = triton.testing.do_bench(
            lambda: fa(q, k, v, causal=True, window_size=(window - 1, 0)), return_mode="median")
    row["ms"]["full"] = triton.testing.do_bench(lambda: fa(q, k, v, causal=True),
                                                return_mode="median")
    return [row]


def _ratio_table(header: str, title: str, base: str):
    def table(rows: list[dict]) -> str:
        names = sorted({n for r in rows for n in r["ms"]})
        lines = [header, "", f"### {title}", "", "| case | " + " | ".join(
            f"{n} ms" for n in names) + f" | ours / {base} |", "|---" * (len(names) + 2) + "|"]
        for r in rows:
            ms = r["ms"]
            mine = ms.get("ours", ms.get("window"))
            ratio = f"{mine / ms[base]:.2f}" if mine and base in ms else "-"
            tf = r.get("tflops", {})
            lines.append(f"| {r['case']} | " + " | ".join(
                (f"{ms[n]:.3f}" + (f" ({tf[n]:.0f} TFLOP/s)" if n in tf else "")) if n in ms else "-"
                for n in names) + f" | {ratio} |")
        return "\n".join(lines) + "\n"

    return table


def _table(header: str):
    def table(rows: list[dict]) -> str:
        lines = [header, "",
                 "| B | keys | cache | dtype | ours ms | ours TB/s | SDPA best | SDPA ms | "
                 "ours/SDPA | copy TB/s | ours/copy | host µs |",
                 "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in (r for r in rows if "batch" in r):  # the decode rows
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
    parser.add_argument("--modes", default="decode,prefill,window",
                        help="comma-separated tables: decode, prefill (flash_attn_varlen), "
                        "window (sliding window against full causal)")
    args = parser.parse_args()
    settings = _common.apply_settings(args.set)
    _common.no_plots("bench/serving_attention.py", args.plot)
    info = _common.nvidia_gpu("bench/serving_attention.py", "torch SDPA",
                              "tests/test_flash_attn_kvcache.py")
    batches, keys, layouts = _ints(args.batches), _ints(args.keys), args.layouts.split(",")
    if args.quick:
        batches, keys, layouts = [1, 64], [8192, 131072], ["paged"]
    header = _common.header("serving attention", info, args.cudagraph)
    modes = args.modes.split(",")
    rows, start = [], time.time()
    sections = []  # the prefill and window tables, for the Markdown file

    def markdown(rows_: list[dict]) -> str:
        return "\n".join([*sections, _table(header)(rows_)])

    for dtype in _common.dtypes(args.dtypes):
        for mode, make, title, base in (
                ("prefill", _prefill_rows, "packed prefill", "sdpa"),
                ("window", _window_rows, "sliding window against full causal", "full")):
            if mode in modes:
                extra = make(dtype, args.quick)
                sections.append(_ratio_table(header, title, base)(extra))
                print(sections[-1])
                rows += extra
                _common.write(args.json, rows, {**_common.meta(info, args.cudagraph),
                                                "settings": settings}, markdown)
        if "decode" not in modes:
            continue
        for layout in layouts:
            for b in batches:
                for n in keys:
                    rows.append(_row(b, n, layout, dtype, args.cudagraph))
                    _common.write(args.json, rows, {**_common.meta(info, args.cudagraph),
                                                    "settings": settings}, markdown)
                    torch.cuda.empty_cache()
    print(_table(header)(rows))
    _common.closing(args.json, rows, lambda r: r.get("case") or
                    f"B={r['batch']} keys={r['keys']} {r['layout']}", start)


if __name__ == "__main__":
    main()
