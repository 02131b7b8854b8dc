"""Eager calls on small inputs, where the host's launch path, not the GPU, sets the pace:
µs per call of each family, ours with direct launches (the default on NVIDIA GPUs, see
``portable_kernels/_direct.py``), ours through Triton's JIT launch (``PK_DIRECT_LAUNCH=0``),
and torch's own operator on the same inputs.

One process runs both settings, alternating over ``--rounds``. Plans decide on direct
launches when they are built, so each pass sets ``PK_DIRECT_LAUNCH`` and drops the plans
(``PluginHost.clear_caches``); the new plans take their tuned configs from the tuning cache
and Triton's compiled kernels from its in-memory cache. (An earlier version ran a process
per setting; this host's speed differed between processes by up to 2x, more than the effect
measured.) Each case times ``--iters`` calls after a warm-up, then synchronizes once, so a
call costs the larger of its host and device time; the median of five such runs
(``_common.per_call_us``). Torch's operator is timed in every pass too, as
a gauge of the host's drift. Inputs are fresh ``torch.randn`` draws. The table gives the
median over rounds and the median of each round's JIT / direct ratio (two passes next to
each other in time).

    python bench/host_per_call.py [--quick] [--rounds 3] [--iters 2000] [--json PATH]
                                  [--set MODULE.NAME=VALUE ...]

With ``--json PATH``, writes it and the Markdown table beside it.
"""
from __future__ import annotations

import portable_kernels as pk  # first: it chooses the interpreter before triton is imported

import os
import statistics

import torch

from portable_kernels import plugins

import _common  # bench/, beside this script

F = torch.nn.functional
SETTINGS = {"direct": "1", "jit": "0"}


def _rand(*shape, dtype=torch.float16, grad=False):
    return torch.randn(*shape, device="cuda").to(dtype).requires_grad_(grad)


def _backward(fn, leaves, dy):
    def run():
        out = fn(*leaves)
        torch.autograd.grad(out, leaves, dy)
    return run


def cases() -> dict:
    """name -> (ours, torch's), both callables without arguments."""
    out = {}
    for m, n, k in ((16, 4096, 4096), (128, 4096, 4096), (1024, 1024, 1024)):
        a, b = _rand(m, k, dtype=torch.bfloat16), _rand(k, n, dtype=torch.bfloat16)
        out[f"matmul {m}x{n}x{k} bf16"] = (lambda a=a, b=b: pk.get_kernel("matmul")(a, b),
                                           lambda a=a, b=b: torch.matmul(a, b))
    x, y = _rand(4096, dtype=torch.float32), _rand(4096, dtype=torch.float32)
    out["vector_add 4096 fp32"] = (lambda: pk.get_kernel("vector_add")(x, y), lambda: x + y)
    rows = _rand(48, 1000)
    out["softmax 48x1000 fp16"] = (lambda: pk.get_kernel("softmax")(rows), lambda: torch.softmax(rows, -1))
    w, bias = _rand(1000), _rand(1000)
    out["layer_norm 48x1000 fp16"] = (lambda: pk.get_kernel("layer_norm")(rows, w, bias),
                                      lambda: F.layer_norm(rows, (1000,), w, bias))
    leaves, dy = [_rand(48, 1000, grad=True), _rand(1000, grad=True), _rand(1000, grad=True)], _rand(48, 1000)
    out["layer_norm 48x1000 fp16, forward and backward"] = (
        _backward(pk.get_kernel("layer_norm"), leaves, dy),
        _backward(lambda t, g, c: F.layer_norm(t, (1000,), g, c), leaves, dy))
    q, k, v = (_rand(1, 8, 512, 64, grad=True) for _ in range(3))
    attn = pk.get_kernel("flash_attn")
    out["flash_attn 1x8x512x64 causal fp16"] = (
        lambda: attn(q.detach(), k.detach(), v.detach(), causal=True),
        lambda: F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), is_causal=True))
    dq = _rand(1, 8, 512, 64)
    out["flash_attn 1x8x512x64 causal fp16, forward and backward"] = (
        _backward(lambda *t: attn(*t, causal=True), [q, k, v], dq),
        _backward(lambda *t: F.scaled_dot_product_attention(*t, is_causal=True), [q, k, v], dq))
    return out


def measure(iters: int, flag: str) -> dict:
    """µs per call of every case with ``PK_DIRECT_LAUNCH=flag``, on plans built afresh.
    The variable and the plans are put back afterwards: plans built under the flag would
    keep its setting for every later call in the process."""
    before = os.environ.get("PK_DIRECT_LAUNCH")
    os.environ["PK_DIRECT_LAUNCH"] = flag
    plugins.host().clear_caches()
    try:
        return {name: {"ours": _common.per_call_us(ours, iters), "torch": _common.per_call_us(theirs, iters)}
                for name, (ours, theirs) in cases().items()}
    finally:
        if before is None:
            os.environ.pop("PK_DIRECT_LAUNCH", None)
        else:
            os.environ["PK_DIRECT_LAUNCH"] = before
        plugins.host().clear_caches()


def main() -> None:
    parser = _common.options(__doc__, "one round of 200 calls per case", vendor=False)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=2000)
    args = parser.parse_args()
    settings = _common.apply_settings(args.set)
    _common.no_plots("bench/host_per_call.py", args.plot)
    if args.quick:
        args.rounds, args.iters = 1, 200
    info = _common.nvidia_gpu("bench/host_per_call.py", "against torch's operators", "tests/test_direct.py")
    runs: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    for r in range(args.rounds):
        for setting, flag in SETTINGS.items():
            runs[setting].append(measure(args.iters, flag))
            print(f"round {r + 1}/{args.rounds}: {setting} done", flush=True)
    rows = []
    for name in runs["direct"][0]:
        row = {"case": name}
        for setting in SETTINGS:
            row[setting] = statistics.median(run[name]["ours"] for run in runs[setting])
        row["torch"] = statistics.median(run[name]["torch"] for s in SETTINGS for run in runs[s])
        row["jit_over_direct"] = statistics.median(
            j[name]["ours"] / d[name]["ours"] for d, j in zip(runs["direct"], runs["jit"]))
        rows.append(row)
    header = (_common.header("eager host time per call", info, False).replace(" · median of do_bench", "")
              + f" · one process, median of {args.rounds} rounds")
    lines = [header, "", "µs per call (a call costs the larger of its host and device time)", "",
             "| case | ours, direct launches | ours, JIT launches | torch | JIT / direct (per round) "
             "| ours direct / torch |",
             "|:--|--:|--:|--:|--:|--:|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['direct']:.1f} | {r['jit']:.1f} | {r['torch']:.1f} | "
                     f"{r['jit_over_direct']:.2f} | {r['direct'] / r['torch']:.2f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    _common.write(args.json, rows, {**_common.meta(info, False), "rounds": args.rounds,
                                    "iters": args.iters, "settings": settings, "runs": runs},
                  lambda _: table)
    if args.json:
        print(f"wrote {args.json} and its .md")


if __name__ == "__main__":
    main()
