"""Eager calls on small inputs, where the host's launch path, not the GPU, sets the pace:
µs per call of each family, ours with direct launches (the default on NVIDIA GPUs, see
``portable_kernels/_direct.py``), ours through Triton's JIT launch (``PK_DIRECT_LAUNCH=0``),
and torch's own operator on the same inputs.

Each setting runs in a child process of its own (plans decide on direct launches when they
are built), the two alternating over ``--rounds``; a child times ``--iters`` calls after a
warm-up (which also tunes and compiles), then synchronizes once, so a call costs the larger
of its host and device time, and reports the median of five such runs
(``matmul_launch_overhead.per_call_us``). Inputs are fresh
``torch.randn`` draws. The table gives the median over rounds.

    python bench/host_per_call.py [--rounds 3] [--iters 2000] [--out PREFIX]

Writes ``PREFIX.json`` and ``PREFIX.md``.
"""
from __future__ import annotations

import portable_kernels as pk  # first: it chooses the interpreter before triton is imported

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

import _common  # bench/, beside this script
from matmul_launch_overhead import per_call_us  # the same timing loop

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


def child(iters: int) -> None:
    result = {}
    for name, (ours, theirs) in cases().items():
        result[name] = {"ours": per_call_us(ours, iters), "torch": per_call_us(theirs, iters)}
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--out", default="host-per-call", help="path prefix of the result files")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    info = _common.nvidia_gpu("bench/host_per_call.py", "against torch's operators", "tests/test_direct.py")
    if args.child:
        child(args.iters)
        return
    runs: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    for r in range(args.rounds):
        for setting, flag in SETTINGS.items():
            env = {**os.environ, "PK_DIRECT_LAUNCH": flag}
            proc = subprocess.run([sys.executable, __file__, "--child", "--iters", str(args.iters)],
                                  env=env, capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"{setting} child failed:\n{proc.stderr[-3000:]}")
            runs[setting].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1}/{args.rounds}: {setting} done", flush=True)
    names = list(runs["direct"][0])
    rows = []
    for name in names:
        row = {"case": name}
        for setting in SETTINGS:
            row[setting] = statistics.median(run[name]["ours"] for run in runs[setting])
        row["torch"] = statistics.median(run[name]["torch"] for s in SETTINGS for run in runs[s])
        rows.append(row)
    header = (_common.header("eager host time per call", info, False).replace(" · median of do_bench", "")
              + f" · median of {args.rounds} rounds")
    lines = [header, "", "µs per call (a call costs the larger of its host and device time)", "",
             "| case | ours, direct launches | ours, JIT launches | torch | JIT / direct | ours direct / torch |",
             "|:--|--:|--:|--:|--:|--:|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['direct']:.1f} | {r['jit']:.1f} | {r['torch']:.1f} | "
                     f"{r['jit'] / r['direct']:.2f} | {r['direct'] / r['torch']:.2f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    prefix = Path(args.out)
    _common.write(prefix, rows, {**_common.meta(info, False), "rounds": args.rounds, "iters": args.iters,
                                 "runs": runs}, lambda _: table)
    print(f"wrote {prefix.with_suffix('.json')} and {prefix.with_suffix('.md')}")


if __name__ == "__main__":
    main()
