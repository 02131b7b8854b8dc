"""A Llama-style model end to end on a GPU: attention through our flash_attn against SDPA.

A randomly initialised ``LlamaForCausalLM`` of realistic size (default: 8 layers, hidden
2048, 16 query heads over 8 key/value heads, head dim 128, MLP 5632, vocabulary 32000;
batch 2 x 2048 tokens; no download) runs with ``attn_implementation="portable_kernels"``
(``portable_kernels.integrations.transformers``: the ``flash_attn`` kernel, GQA passed as is)
and with ``"sdpa"`` (torch SDPA; by default whatever backend torch picks, optionally forced
to its flash or cuDNN backend), in bf16 and fp16, with the same weights.

Checks, per dtype, before timing:

- logits: the error of each implementation against an fp32 SDPA run of the same model;
  ours must stay within ``2 x`` SDPA's own error (plus the library's attention atol), so
  the low-precision model is as good through our kernel as through SDPA's;
- gradients (forward + backward of the LM loss) of the first and last layers' attention
  projection weights: relative L2 error against the fp32 run, ours within ``2 x`` SDPA's
  (plus 0.01);
- no call fell back to SDPA (a fallback would time SDPA twice).

Then times the forward (eval, no grad) and forward + backward (train mode, LM loss on the
input ids) with CUDA events: the median of ``--iters`` runs after ``--warmup`` runs, as ms
and tokens/second, plus the peak memory of the forward + backward. The first calls of our
kernel autotune (the warmup absorbs them; results persist in ``PK_CACHE_DIR``).

    python bench/transformers_model.py [--quick] [--json PATH] [--dtypes bf16,fp16]
        [--sdpa-backends default,flash,cudnn] [--batch 2] [--seq 2048] [--layers 8]
        [--hidden 2048] [--heads 16] [--kv-heads 8] [--iters 10] [--warmup 3]

With ``--patched`` it times a training step of the whole model instead (default shape
then: 8 layers, hidden 2048, vocabulary 128256, batch 1 x 4096, bf16): unpatched on SDPA,
after ``portable_kernels.integrations.transformers.apply(model)`` (norms, MLPs, rotary
embeddings, attention and the fused linear cross-entropy loss on our kernels), and after
Liger-Kernel's ``apply_liger_kernel_to_llama(model=...)`` where Liger is installed (its
attention stays SDPA's; it patches transformers' modules for the rest of the process, so
it runs last). Each one's loss on the same batch must be within 1% of the unpatched
model's; then tokens/s of forward+backward and the peak memory. ``--profile N`` adds each
step's N costliest GPU kernels (torch's profiler), to trace a gap to the layers making it;
``--memory-trace N`` the N largest groups of memory live at a step's peak (CUDA memory
history replayed to the peak, grouped by the first project or transformers frame), to
trace a memory gap the same way.

Prints a table; with ``--json PATH`` writes it and the Markdown table beside it. Exits 1
when a check fails, 2 when there is no CUDA GPU or no transformers.
"""
from __future__ import annotations

import portable_kernels as pk  # first: it chooses the interpreter before triton is imported

import argparse
import contextlib
import statistics
import sys

import torch

import _common
from portable_kernels.testing import tolerance

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
PK = "portable_kernels"


def parse_args(argv=None) -> argparse.Namespace:
    p = _common.options(__doc__.split("\n\n")[0], "2 layers, sequence 512, bf16, 3 timed "
                        "iterations", vendor=False)
    p.add_argument("--dtypes", default="bf16,fp16")
    p.add_argument("--sdpa-backends", default="default,flash,cudnn",
                   help="SDPA rows: default (torch's choice), flash, cudnn, efficient, math")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="with --patched: print each step's N costliest GPU kernels")
    p.add_argument("--breakdown", action="store_true",
                   help="with --patched: each step's GPU time by kind of kernel (matrix "
                        "products, attention, the rest) and the step time a patch could "
                        "reach at best")
    p.add_argument("--memory-trace", type=int, default=0, metavar="N",
                   help="with --patched: print the N largest groups of memory live at a "
                        "step's peak, by allocating frame")
    p.add_argument("--patched", action="store_true",
                   help="time a training step: unpatched, apply(model), Liger's patch")
    args = p.parse_args(argv)
    if args.patched:
        defaults = p.parse_args([])
        for name, value in (("vocab", 128256), ("batch", 1), ("seq", 4096), ("dtypes", "bf16")):
            if getattr(args, name) == getattr(defaults, name):
                setattr(args, name, value)
    if args.quick:
        args.layers, args.seq, args.dtypes, args.iters = 2, 512, "bf16", 3
    return args


def sdpa_context(backend: str):
    """A factory of contexts forcing SDPA's backend (``default``: torch chooses). A factory,
    because ``sdpa_kernel`` contexts are single-use and every timed call enters one."""
    if backend == "default":
        return contextlib.nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    return lambda: sdpa_kernel(names[backend])


def cuda_ms(fn, warmup: int, iters: int) -> float:
    """Median milliseconds of ``fn()`` by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def logits(model, impl: str, ids) -> torch.Tensor:
    model.set_attn_implementation(impl)
    model.eval()
    with torch.no_grad():
        return model(ids, use_cache=False).logits.float()


def watched_grads(model, impl: str, ids, names) -> dict[str, torch.Tensor]:
    model.set_attn_implementation(impl)
    model.train()
    model.zero_grad(set_to_none=True)
    model(ids, labels=ids, use_cache=False).loss.backward()
    params = dict(model.named_parameters())
    grads = {n: params[n].grad.float().clone() for n in names}
    model.zero_grad(set_to_none=True)
    return grads


def time_impl(model, impl: str, ids, ctx, args) -> dict:
    tokens = ids.numel()
    model.set_attn_implementation(impl)

    def forward():
        with torch.no_grad(), ctx():
            model(ids, use_cache=False)

    def forward_backward():
        model.zero_grad(set_to_none=True)
        with ctx():
            model(ids, labels=ids, use_cache=False).loss.backward()

    model.eval()
    fwd = cuda_ms(forward, args.warmup, args.iters)
    model.train()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd = cuda_ms(forward_backward, args.warmup, args.iters)
    peak = torch.cuda.max_memory_allocated() / 2**30
    model.zero_grad(set_to_none=True)
    model.eval()
    return {"fwd_ms": fwd, "fwd_tok_s": tokens / (fwd * 1e-3),
            "fwd_bwd_ms": fwd_bwd, "fwd_bwd_tok_s": tokens / (fwd_bwd * 1e-3),
            "peak_gib": peak}


def run_dtype(name: str, dtype: torch.dtype, args, config, pk_hf) -> tuple[list[dict], dict]:
    from transformers import LlamaForCausalLM

    torch.manual_seed(args.seed)
    model32 = LlamaForCausalLM(config).to("cuda").eval()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda")
    last = config.num_hidden_layers - 1
    watched = [f"model.layers.{layer}.self_attn.{proj}.weight"
               for layer in (0, last) for proj in ("q_proj", "k_proj", "v_proj", "o_proj")]
    # The fp32 run is the truth both low-precision runs are measured against.
    ref32 = logits(model32, "sdpa", ids)
    g32 = watched_grads(model32, "sdpa", ids, watched)
    model = model32.to(dtype)  # the same weights, rounded (in place)
    del model32
    torch.cuda.empty_cache()

    check: dict = {"dtype": name, "ok": True, "problems": []}
    pk_hf._warned.clear()
    ours = logits(model, PK, ids)
    sdpa = logits(model, "sdpa", ids)
    atol = tolerance(dtype, "attention").atol
    err_ours = float((ours - ref32).abs().max())
    err_sdpa = float((sdpa - ref32).abs().max())
    check.update(logits_max_abs_ref=float(ref32.abs().max()), err_ours_vs_fp32=err_ours,
                 err_sdpa_vs_fp32=err_sdpa, err_ours_vs_sdpa=float((ours - sdpa).abs().max()))
    if not err_ours <= 2 * err_sdpa + atol:
        check["problems"].append(f"logits: our error vs fp32 {err_ours:.3g} > 2 x SDPA's "
                                 f"{err_sdpa:.3g} + {atol:g}")
    del ours, sdpa, ref32

    g_ours = watched_grads(model, PK, ids, watched)
    g_sdpa = watched_grads(model, "sdpa", ids, watched)

    def rel(g):
        return {n: float((g[n] - g32[n]).norm() / g32[n].norm().clamp_min(1e-30)) for n in watched}

    check["grad_rel_l2_ours"], check["grad_rel_l2_sdpa"] = rel(g_ours), rel(g_sdpa)
    for n in watched:
        ours_err, sdpa_err = check["grad_rel_l2_ours"][n], check["grad_rel_l2_sdpa"][n]
        if not ours_err <= 2 * sdpa_err + 1e-2:
            check["problems"].append(f"{n} gradient: our relative L2 error vs fp32 "
                                     f"{ours_err:.3g} > 2 x SDPA's {sdpa_err:.3g} + 0.01")
    if pk_hf._warned:
        check["problems"].append(f"calls fell back to SDPA: {sorted(pk_hf._warned)}")

    q = torch.empty(args.batch, args.heads, args.seq, config.head_dim, device="cuda", dtype=dtype)
    kv = torch.empty(args.batch, args.kv_heads, args.seq, config.head_dim, device="cuda",
                     dtype=dtype)
    check["variant"] = pk.explain("flash_attn", q, kv, kv, True).variant
    check["ok"] = not check["problems"]

    rows = []
    impls = [(PK, "ours (" + check["variant"] + ")", contextlib.nullcontext)]
    impls += [("sdpa", f"sdpa {b}", sdpa_context(b)) for b in args.sdpa_backends.split(",") if b]
    for impl, label, ctx in impls:
        row = {"dtype": name, "impl": label}
        try:
            row.update(time_impl(model, impl, ids, ctx, args))
        except Exception as exc:  # e.g. an SDPA backend that cannot take this problem
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            torch.cuda.synchronize()
        rows.append(row)
        print(f"  {name} {label}: " + (row.get("error") or
              f"fwd {row['fwd_ms']:.1f} ms, fwd+bwd {row['fwd_bwd_ms']:.1f} ms"), flush=True)
    del model
    torch.cuda.empty_cache()
    return rows, check


def run_patched(dtype: torch.dtype, args, config, pk_hf) -> list[dict]:
    """A training step (forward + backward of the LM loss) unpatched, patched by ours and
    patched by Liger (module docstring): rows of loss, ms, tokens/s and peak GiB."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).to("cuda", dtype).train()
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda")

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.detach()

    def liger(model):
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        pk_hf.undo(model)
        apply_liger_kernel_to_llama(model=model)

    rows, base = [], None
    for label, patch in (("unpatched (SDPA)", None), ("portable_kernels apply()", pk_hf.apply),
                         ("Liger-Kernel", liger)):
        row = {"dtype": str(dtype).removeprefix("torch."), "impl": label}
        try:
            if patch is not None:
                patch(model)
            loss = float(step())
            torch.cuda.synchronize()
            base = loss if base is None else base
            row["loss"] = loss
            if abs(loss - base) > 1e-2 * abs(base):
                row["error"] = f"loss {loss:.4f} differs from the unpatched {base:.4f} by over 1%"
            else:
                model.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                base_mem = torch.cuda.memory_allocated()
                ms = cuda_ms(step, args.warmup, args.iters)
                row.update(ms=ms, tok_s=ids.numel() / (ms * 1e-3),
                           peak_gib=(torch.cuda.max_memory_allocated() - base_mem) / 2**30)
                if args.profile or args.breakdown:
                    kernels = kernel_profile(step, None)
                    row["kernels"] = kernels[:args.profile]
                    if args.breakdown:
                        row["breakdown"] = breakdown(kernels)
                if args.memory_trace:
                    row["memory_at_peak"] = memory_at_peak(step, args.memory_trace)
        except Exception as exc:  # e.g. a peer that does not support this transformers
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        rows.append(row)
        print(f"  {label}: " + (row.get("error") or f"{row['ms']:.1f} ms, {row['tok_s']:,.0f} tok/s, "
                                f"peak {row['peak_gib']:.2f} GiB beyond the weights"), flush=True)
        for name, ms, calls in row.get("kernels", []):
            print(f"      {ms:8.2f} ms {calls:5d}x  {name}")
        if "breakdown" in row:
            print("      GPU ms by kind: " + ", ".join(f"{k} {v:.2f}" for k, v in row["breakdown"].items()))
        for name, mib, blocks in row.get("memory_at_peak", []):
            print(f"      {mib:8.1f} MiB {blocks:5d}x  {name}")
    return rows


def kernel_profile(step, top: int | None) -> list[tuple[str, float, int]]:
    """The ``top`` GPU kernels of one ``step`` by device time (all with None): (name, ms,
    launches), from torch's profiler (kernel names cut to 90 characters), so that a step's
    gap to another can be traced to the layers that make it."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    total = (lambda e: getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0))
    kernels.sort(key=total, reverse=True)
    return [(e.key[:90], total(e) / 1e3, e.count) for e in kernels[:top]]


#: Kernel-name fragments (lower case) of each kind, first match wins: attention before
#: matrix products, since cuDNN's attention kernels carry "gemm"-like names too.
KINDS = (("attention", ("flash", "fmha", "attn", "sdpa", "cudnn")),
         ("matmul", ("gemm", "xmma", "nvjet", "cutlass", "cublas", "matmul", "sm90_", "sm80_")))


def breakdown(kernels: list[tuple[str, float, int]]) -> dict[str, float]:
    """ms of GPU time per kind of kernel (:data:`KINDS`, then "other": norms, rotary,
    activations, the loss's softmax, casts and copies), and their sum. A patch that made
    every "other" kernel free and kept the matrix products would still take at least
    matmul + attention: that bounds the speedup a layer patch can give."""
    out = {kind: 0.0 for kind, _ in KINDS}
    out["other"] = 0.0
    for name, ms, _ in kernels:
        low = name.lower()
        kind = next((k for k, frags in KINDS if any(f in low for f in frags)), "other")
        out[kind] += ms
    out["sum"] = sum(out.values())
    return out


#: Frames that name an allocation's owner in ``memory_at_peak`` (torch's own are skipped).
_OWNERS = ("portable_kernels", "liger_kernel", "flag_gems", "transformers")


def memory_at_peak(step, top: int) -> list[tuple[str, float, int]]:
    """The ``top`` groups of device memory live at the peak of one ``step``: (allocating
    frame, MiB, blocks). Allocations made before the step (weights, the optimizer's state)
    are not in the trace; the groups are what the step itself holds at its peak, keyed by
    the innermost frame of the library or of transformers that allocated them ("?" for
    allocations without one, e.g. on autograd's device thread)."""
    step()
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return peak_groups(trace, top)


def peak_groups(trace: list[dict], top: int) -> list[tuple[str, float, int]]:
    """:func:`memory_at_peak`'s groups from a CUDA memory-history trace (a device's
    ``device_traces`` of ``torch.cuda.memory._snapshot()``): its allocations and frees
    replayed to the largest total, then the blocks live there summed by allocating frame."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for event in trace:
        if event["action"] == "alloc":
            frame = next((f for f in event.get("frames", [])
                          if any(o in f.get("filename", "") for o in _OWNERS)), None)
            where = "?" if frame is None else (
                f"{frame['filename'].rsplit('site-packages/', 1)[-1]}:{frame['line']} {frame['name']}")
            live[event["addr"]] = (event["size"], where)
            total += event["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif event["action"] == "free_requested" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    groups: dict[str, list[int]] = {}
    for size, where in at_peak.values():
        group = groups.setdefault(where, [0, 0])
        group[0] += size
        group[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    return [(where, size / 2**20, blocks) for where, (size, blocks) in ranked]


def patched_markdown(rows: list[dict], meta: dict) -> str:
    base = next((r for r in rows if "ms" in r and r["impl"].startswith("unpatched")), None)
    lines = [f"# Llama-style model, one training step, {meta['model']}", "",
             f"{meta['device']}; torch {meta['torch']}, triton {meta['triton']}, "
             f"transformers {meta['transformers']}; batch {meta['batch']} x {meta['seq']} tokens",
             "", "| dtype | model | loss | fwd+bwd ms | tok/s | vs unpatched | peak GiB beyond weights |",
             "|:--|:--|--:|--:|--:|--:|--:|"]
    for r in rows:
        if "ms" not in r:
            lines.append(f"| {r['dtype']} | {r['impl']} | {r.get('loss', '-')} | {r.get('error')} | | | |")
            continue
        vs = f"{base['ms'] / r['ms']:.2f}" if base else "-"
        lines.append(f"| {r['dtype']} | {r['impl']} | {r['loss']:.4f} | {r['ms']:.1f} | "
                     f"{r['tok_s']:,.0f} | {vs} | {r['peak_gib']:.2f} |")
    split = [r for r in rows if "breakdown" in r]
    if split:
        lines += ["", "GPU time of one step by kind of kernel (ms; torch's profiler):", "",
                  "| model | matmul | attention | other | sum of kernels | step |",
                  "|:--|--:|--:|--:|--:|--:|"]
        for r in split:
            b = r["breakdown"]
            lines.append(f"| {r['impl']} | {b['matmul']:.2f} | {b['attention']:.2f} | "
                         f"{b['other']:.2f} | {b['sum']:.2f} | {r['ms']:.2f} |")
        if base is not None and "breakdown" in base:
            floor = base["ms"] - base["breakdown"]["other"]
            lines += ["", f"Unpatched step less all its other kernels: {floor:.2f} ms, "
                          f"{base['ms'] / floor:.2f}x the unpatched step: the most a patch "
                          "that keeps its matrix products and attention can give."]
    return "\n".join(lines) + "\n"


def markdown(rows: list[dict], checks: list[dict], meta: dict) -> str:
    lines = [f"# Llama-style model, {meta['model']}", "",
             f"{meta['device']}; torch {meta['torch']}, triton {meta['triton']}, "
             f"transformers {meta['transformers']}; batch {meta['batch']} x {meta['seq']} tokens",
             "", "| dtype | attention | fwd ms | fwd tok/s | vs sdpa | fwd+bwd ms | "
             "fwd+bwd tok/s | vs sdpa | peak GiB |", "|:--|:--|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['dtype']} | {r['impl']} | error: {r['error']} |||||||")
            continue
        base = next((b for b in rows if b["dtype"] == r["dtype"] and b["impl"] == "sdpa default"
                     and "error" not in b), None)
        fwd = f"{r['fwd_tok_s'] / base['fwd_tok_s']:.2f}" if base else ""
        both = f"{r['fwd_bwd_tok_s'] / base['fwd_bwd_tok_s']:.2f}" if base else ""
        lines.append(f"| {r['dtype']} | {r['impl']} | {r['fwd_ms']:.1f} | {r['fwd_tok_s']:,.0f} | "
                     f"{fwd} | {r['fwd_bwd_ms']:.1f} | {r['fwd_bwd_tok_s']:,.0f} | {both} | "
                     f"{r['peak_gib']:.1f} |")
    lines += ["", "Checks against an fp32 SDPA run of the same weights (logits: max abs error; "
              "gradients: worst relative L2 error over the first and last layers' attention "
              "weights):", ""]
    for c in checks:
        lines.append(
            f"- {c['dtype']}: {'ok' if c['ok'] else 'FAILED'}; logits error ours "
            f"{c['err_ours_vs_fp32']:.3g}, sdpa {c['err_sdpa_vs_fp32']:.3g} (|logits| up to "
            f"{c['logits_max_abs_ref']:.3g}); gradient error ours "
            f"{max(c['grad_rel_l2_ours'].values()):.3g}, sdpa "
            f"{max(c['grad_rel_l2_sdpa'].values()):.3g}"
            + "".join(f"\n  - {p}" for p in c["problems"]))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    settings = _common.apply_settings(args.set)
    _common.no_plots("bench/transformers_model.py", args.plot)
    if not torch.cuda.is_available():
        print("bench/transformers_model.py times a model on a CUDA GPU; torch sees none here "
              "(on a CPU, tests/test_transformers.py checks the same integration on a tiny "
              "model under Triton's interpreter).", file=sys.stderr)
        return 2
    try:
        import transformers
        from transformers import LlamaConfig
    except ImportError:
        print("bench/transformers_model.py needs transformers: pip install "
              "'portable-kernels[transformers]'", file=sys.stderr)
        return 2
    import triton

    import portable_kernels.integrations.transformers as pk_hf

    pk_hf.register()
    if args.hidden % args.heads or args.heads % args.kv_heads:
        print("--hidden must be a multiple of --heads, and --heads of --kv-heads", file=sys.stderr)
        return 2
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=max(args.seq, 2048),
        tie_word_embeddings=False)
    model_desc = (f"{args.layers} layers, hidden {args.hidden}, {args.heads} heads / "
                  f"{args.kv_heads} kv heads (head dim {config.head_dim}), MLP "
                  f"{args.intermediate}, vocab {args.vocab}")
    meta = {"model": model_desc, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "transformers": transformers.__version__,
            "batch": args.batch, "seq": args.seq, "iters": args.iters, "warmup": args.warmup,
            "settings": settings}
    print(f"{meta['device']}: {model_desc}; batch {args.batch} x {args.seq}", flush=True)

    rows: list[dict] = []
    checks: list[dict] = []
    if args.patched:
        for name in args.dtypes.split(","):
            rows += run_patched(DTYPES[name], args, config, pk_hf)
            _common.write(args.json, rows, meta, lambda rows_: patched_markdown(rows_, meta))
        print(patched_markdown(rows, meta))
        return 0 if all("error" not in r for r in rows if not r["impl"].startswith("Liger")) else 1
    for name in args.dtypes.split(","):
        if name not in DTYPES:
            print(f"unknown dtype {name!r}; choose from {', '.join(DTYPES)}", file=sys.stderr)
            return 2
        dtype_rows, check = run_dtype(name, DTYPES[name], args, config, pk_hf)
        rows += dtype_rows
        checks.append(check)
        # After every dtype, so an interrupted run keeps what it measured.
        _common.write(args.json, rows, {**meta, "checks": checks},
                      lambda rows_: markdown(rows_, checks, meta))
    print()
    print(markdown(rows, checks, meta))
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
