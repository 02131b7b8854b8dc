"""The losses of a language model's head: ``cross_entropy`` over (tokens, vocabulary) logits
and ``fused_linear_cross_entropy`` (the head's projection and the loss in chunks of tokens),
ours against torch's eager path and the peer libraries, time and peak memory.

Rows: forward alone and forward+backward (the gradients of the logits, or of the hidden
states and the head's weight), milliseconds (median of ``triton.testing.do_bench``) and the
peak memory a call holds beyond its inputs (GiB; ``torch.cuda.max_memory_allocated`` over
what was allocated before the call; a forward's output and a backward's gradients count).

- torch: ``F.cross_entropy(logits.float(), target)``, as transformers' causal-LM loss
  upcasts; for the fused rows ``hidden @ weight.T`` first, the (T, V) logits materialised.
- Liger-Kernel: ``liger_cross_entropy`` and ``liger_fused_linear_cross_entropy``.
- FlagGems: ``F.cross_entropy`` under ``flag_gems.use_gems()`` (no fused linear loss).

Every implementation's loss and gradients are checked first against torch's on fp32
copies of the same inputs (random targets with 10% ignored), within bf16/fp16 bounds.

    python bench/losses.py [--quick] [--dtypes bf16] [--families ...] [--set ...] [--json PATH]

Needs an NVIDIA GPU; on a CPU-only machine it exits saying what to run instead.
"""
from __future__ import annotations

import portable_kernels  # noqa: F401  (first: it chooses the interpreter before triton is imported)

import time
from typing import Any, Callable

import torch
import triton

from portable_kernels import ops

import _common  # bench/, beside this script
import _peers

F = torch.nn.functional
#: (tokens, vocabulary) of the cross-entropy rows; (tokens, hidden, vocabulary) of the fused.
CE_SHAPES = [(8192, 128256), (16384, 128256)]
FLCE_SHAPES = [(8192, 4096, 128256)]
QUICK_CE, QUICK_FLCE = [(4096, 32000)], [(4096, 2048, 32000)]
PROVIDERS = ("ours", "torch", *_peers.PEERS)
DEVICE = "cuda"  # a name, so that the checks can be tried on the CPU interpreter


def _torch_ce(logits, target):
    return F.cross_entropy(logits.float(), target)


def _torch_flce(hidden, weight, target):
    return F.cross_entropy((hidden @ weight.t()).float(), target)


def implementations(family: str) -> dict[str, _peers.Impl]:
    if family == "cross_entropy":
        mine, theirs = ops.cross_entropy, _torch_ce
    else:
        mine, theirs = ops.fused_linear_cross_entropy, _torch_flce
    return {"ours": _peers.Impl(mine), "torch": _peers.Impl(theirs), **_peers.loss(family)}


def inputs(family: str, shape: tuple, dtype: torch.dtype) -> tuple:
    """Fresh random inputs: logits of unit scale, or hidden states and a head weight scaled
    as a trained model's (logits of about unit scale); targets in range, 10% ignored."""
    tokens, vocab = shape[0], shape[-1]
    target = torch.randint(0, vocab, (tokens,), device=DEVICE)
    target[torch.rand(tokens, device=DEVICE) < 0.1] = -100
    if family == "cross_entropy":
        return torch.randn(tokens, vocab, device=DEVICE).to(dtype), target
    hidden = shape[1]
    return (torch.randn(tokens, hidden, device=DEVICE).to(dtype),
            (torch.randn(vocab, hidden, device=DEVICE) / hidden ** 0.5).to(dtype), target)


def _grads(fn: Callable, args: tuple) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [a.detach().requires_grad_() if a.is_floating_point() else a for a in args]
    loss = fn(*leaves)
    loss = loss[0] if isinstance(loss, (tuple, list)) else loss
    grads = torch.autograd.grad(loss, [t for t in leaves if t.requires_grad])
    return loss.detach(), list(grads)


def check(impl: _peers.Impl, args: tuple, want: tuple) -> None:
    """Loss within 1e-2 relative and every gradient within 2% of its largest element of
    torch's on fp32 copies (``want``)."""
    loss, grads = _grads(impl.fn, args)
    ref_loss, ref_grads = want
    err = abs(loss.double().item() - ref_loss.double().item())
    assert err <= 1e-2 * abs(ref_loss.item()) + 1e-3, f"loss {loss.item()} against {ref_loss.item()}"
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        bound = 2e-2 * r.abs().max().item()
        diff = (g.double() - r.double()).abs().max().item()
        assert diff <= bound, f"gradient {i}: max error {diff:.3g} above {bound:.3g}"


def peak_gib(call: Callable[[], Any]) -> float:
    """GiB that one ``call()`` holds at its peak beyond what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = call()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del result
    return peak / 2 ** 30


def bench_row(family: str, shape: tuple, dtype: torch.dtype) -> dict:
    row: dict = {"family": family, "shape": "×".join(map(str, shape)),
                 "dtype": str(dtype).removeprefix("torch."), "ms": {}, "gib": {}, "error": {}}
    args = inputs(family, shape, dtype)
    want = _grads(_torch_ce if family == "cross_entropy" else _torch_flce,
                  tuple(a.float() if a.is_floating_point() else a for a in args))
    for name, impl in implementations(family).items():
        with impl.context():
            if _common.first_call(row, name, lambda: check(impl, args, want) or True) is None:
                continue
            leaves = [a.detach().requires_grad_() if a.is_floating_point() else a for a in args]

            def forward(impl=impl):
                with torch.no_grad():
                    return impl.fn(*args)

            def both(impl=impl, leaves=leaves):
                loss = impl.fn(*leaves)
                loss = loss[0] if isinstance(loss, (tuple, list)) else loss
                return torch.autograd.grad(loss, [t for t in leaves if t.requires_grad])

            for p, call in (("fwd", forward), ("fwd+bwd", both)):
                row["gib"][f"{name} {p}"] = peak_gib(call)
                row["ms"][f"{name} {p}"] = triton.testing.do_bench(call, return_mode="median")
    del want
    return row


def markdown(rows: list[dict], header: str) -> str:
    lines = [header, "", "ms (median) and GiB held beyond the inputs at the peak; × best: the "
             "fastest other implementation's time over ours", "",
             "| loss | shape | dtype | pass | ours | torch | Liger | FlagGems | × best | "
             "ours GiB | torch GiB | Liger GiB | FlagGems GiB |",
             "|:--|:--|:--|:--|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]

    def fmt(value, spec=".2f"):
        return "-" if value is None else format(value, spec)

    for r in rows:
        for p in ("fwd", "fwd+bwd"):
            ms, gib = r["ms"], r["gib"]
            if not any(f"{n} {p}" in ms for n in PROVIDERS):
                continue
            others = [ms[f"{n} {p}"] for n in PROVIDERS[1:] if f"{n} {p}" in ms]
            best = (min(others) / ms[f"ours {p}"]) if others and f"ours {p}" in ms else None
            lines.append(f"| {r['family']} | {r['shape']} | {r['dtype']} | {p} | "
                         + " | ".join(fmt(ms.get(f"{n} {p}")) for n in PROVIDERS)
                         + f" | {fmt(best)} | "
                         + " | ".join(fmt(gib.get(f"{n} {p}")) for n in PROVIDERS) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = _common.options(__doc__, f"only {QUICK_CE} and {QUICK_FLCE}")
    parser.set_defaults(dtypes="bf16")
    parser.add_argument("--families", default="cross_entropy,fused_linear_cross_entropy",
                        help="comma-separated: cross_entropy, fused_linear_cross_entropy")
    args = parser.parse_args()
    families = args.families.split(",")
    if unknown := set(families) - {"cross_entropy", "fused_linear_cross_entropy"}:
        parser.error(f"--families: unknown {', '.join(sorted(unknown))}")
    if args.cudagraph:
        parser.error("--cudagraph: the losses allocate per call (their chunks, their outputs); "
                     "timed eagerly only")
    _common.apply_settings(args.set)
    _common.no_plots("bench/losses.py", args.plot)
    info = _common.nvidia_gpu("bench/losses.py", "against torch's eager loss and the peers",
                              "tests/test_cross_entropy.py tests/test_fused_linear_cross_entropy.py")
    header = _common.header("losses", info, False)
    meta = {**_common.meta(info, False), "peers": _peers.versions(), "peers_missing": _peers.missing()}
    print(header)
    for peer, why in _peers.missing().items():
        print(f"{peer} left out: {why}")
    rows, start = [], time.time()
    cases = ([("cross_entropy", s) for s in (QUICK_CE if args.quick else CE_SHAPES)]
             + [("fused_linear_cross_entropy", s) for s in (QUICK_FLCE if args.quick else FLCE_SHAPES)])
    cases = [(family, shape) for family, shape in cases if family in families]
    for dtype in _common.dtypes(args.dtypes):
        for family, shape in cases:
            row = bench_row(family, shape, dtype)
            rows.append(row)
            print(f"{family} {row['shape']} {row['dtype']}: "
                  + "  ".join(f"{k} {v:.2f} ms" for k, v in row["ms"].items()), flush=True)
            _common.write(args.json, rows, {**meta, "elapsed_s": time.time() - start},
                          lambda rows_: markdown(rows_, header))
            torch.cuda.empty_cache()
    print(markdown(rows, header))
    _common.closing(args.json, rows, lambda r: f"{r['family']} {r['shape']} {r['dtype']}", start)


if __name__ == "__main__":
    main()
