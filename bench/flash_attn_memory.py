"""flash_attn's memory beyond its inputs and outputs grows linearly in N: no N x N matrix.

For each sequence length N (default 4096 and 16384; B=1, H=16, D=128, fp16), runs one
forward pass and reads ``torch.cuda.max_memory_allocated`` after resetting the peak: the
*workspace* is that peak minus the inputs (q, k, v) and the output. It should be the
log-sum-exp saved for the backward, B x H x N fp32 (plus allocator rounding), i.e. linear
in N; the N x N score matrix that plain attention materializes is printed next to it for
scale. With ``--backward`` the same is measured for a backward pass (workspace beyond
inputs, output, saved LSE, upstream gradient and the three gradients: the delta vector).

    python bench/flash_attn_memory.py [--quick] [--n 4096,16384] [--heads 16] [--dim 128]
                                      [--dtype fp16] [--causal] [--backward] [--variant NAME]
                                      [--json PATH] [--set MODULE.NAME=VALUE ...]

Needs a CUDA (or ROCm) GPU; on a CPU-only machine it exits with a message.
"""
from __future__ import annotations

import portable_kernels as pk  # first: it chooses the interpreter before triton is imported

import sys

import torch

import _common

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _mib(n_bytes: float) -> str:
    return f"{n_bytes / 2**20:10.2f}"


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(n: int, args) -> dict:
    """Workspace bytes of one forward (and optionally backward) pass at sequence length n."""
    dtype = DTYPES[args.dtype]
    shape = (args.batch, args.heads, n, args.dim)
    grad = args.backward
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, requires_grad=grad) for _ in range(3))
    attn = pk.get_kernel("flash_attn")
    # Warm up: compile (and autotune) outside the measured region.
    out = attn(q, k, v, causal=args.causal)
    if grad:
        out.backward(torch.ones_like(out))
        q.grad = k.grad = v.grad = None
    del out
    torch.cuda.synchronize()

    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = attn(q, k, v, causal=args.causal)
    torch.cuda.synchronize()
    fwd = torch.cuda.max_memory_allocated() - base - _nbytes(out)
    row = {"n": n, "inputs": _nbytes(q, k, v), "output": _nbytes(out), "forward": fwd,
           "lse": args.batch * args.heads * n * 4,
           "scores": args.batch * args.heads * n * n * torch.finfo(dtype).bits // 8}
    if grad:
        dout = torch.randn_like(out)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()  # inputs, output, saved LSE, dout
        out.backward(dout)
        torch.cuda.synchronize()
        row["backward"] = torch.cuda.max_memory_allocated() - base - _nbytes(q.grad, k.grad, v.grad)
    return row


def main(argv=None) -> int:
    p = _common.options(__doc__, "the first two lengths of --n, B=1 H=4", vendor=False)
    p.add_argument("--n", default="4096,16384", help="comma-separated sequence lengths")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--backward", action="store_true", help="also measure a backward pass")
    p.add_argument("--variant", help="force a flash_attn variant (default: the one selected)")
    args = p.parse_args(argv)
    settings = _common.apply_settings(args.set)
    _common.no_plots("bench/flash_attn_memory.py", args.plot)
    if args.quick:
        args.batch, args.heads = 1, 4
    if not torch.cuda.is_available():
        sys.exit("flash_attn_memory: needs a CUDA or ROCm GPU (torch.cuda.is_available() is "
                 "False); peak-memory counters exist only for GPU allocations.")

    sizes = [int(s) for s in args.n.split(",")][:2 if args.quick else None]
    forced = {"flash_attn": args.variant} if args.variant else {}
    with pk.use_variant(**forced):
        q = torch.empty(1, 1, 1, args.dim, device="cuda", dtype=DTYPES[args.dtype])
        variant = pk.explain("flash_attn", q, q, q, causal=args.causal).variant
        rows = [measure(n, args) for n in sizes]

    lines = [f"flash_attn ({variant}) on {torch.cuda.get_device_name()}: B={args.batch} "
             f"H={args.heads} D={args.dim} {args.dtype}{' causal' if args.causal else ''}"]
    cols = ["N", "inputs MiB", "output MiB", "fwd extra MiB", "LSE MiB"]
    cols += ["bwd extra MiB"] if args.backward else []
    cols += ["N x N scores MiB"]
    lines.append(" | ".join(f"{c:>14}" for c in cols))
    for r in rows:
        cells = [f"{r['n']:>14}"] + [f"{_mib(r[k]):>14}" for k in ("inputs", "output", "forward", "lse")]
        cells += [f"{_mib(r['backward']):>14}"] if args.backward else []
        cells += [f"{_mib(r['scores']):>14}"]
        lines.append(" | ".join(cells))
    print("\n".join(lines))
    _common.write(args.json, rows, {"device": torch.cuda.get_device_name(), "variant": variant,
                                    "torch": torch.__version__, "settings": settings,
                                    "args": vars(args)},
                  lambda _rows: "\n".join(lines) + "\n")
    if len(rows) >= 2:
        a, b = rows[0], rows[-1]
        grow_n = b["n"] / a["n"]
        grow = b["forward"] / a["forward"] if a["forward"] > 0 else float("nan")
        verdict = "linear" if grow <= 1.5 * grow_n else "SUPERLINEAR"
        print(f"forward workspace grew x{grow:.2f} for N x{grow_n:g} ({verdict}; an N x N "
              f"matrix would grow x{grow_n ** 2:g})")
        if args.backward:
            growb = b["backward"] / a["backward"] if a["backward"] > 0 else float("nan")
            verdict = "linear" if growb <= 1.5 * grow_n else "SUPERLINEAR"
            print(f"backward workspace grew x{growb:.2f} for N x{grow_n:g} ({verdict})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
