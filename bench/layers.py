"""The elementwise and norm layers against torch's own operators, as memory bandwidth.

Families: ``vector_add``, ``softmax``, ``layer_norm``, ``rms_norm``, ``add_rms_norm``
(residual add and RMS norm), ``swiglu`` and ``geglu`` (one fused (..., 2I) gate-up tensor, as
models store it), ``rope`` (q and k of 128-wide heads, GQA 4:1, fp32 tables), ``asin``; on
transformer-sized rows (tokens x hidden). Each is memory-bound, so a row reports GB/s:
the bytes a kernel must move (inputs read once, outputs written once) over its time, ours
and torch's (``torch.nn.functional``'s layer, ``torch.softmax``, ``x + y``; the add then
``rms_norm``; ``silu(g) * u``, ``gelu(g, tanh) * u`` and rotate-half rotary embeddings as eager
torch runs them, a kernel per operation), the peer Triton libraries' where installed
(Liger-Kernel, FlagGems: ``bench/_peers.py`` says how each is called), and ours over
torch's and over the faster peer's.
With ``--backward`` the backward is timed too (every family here is differentiable; its bytes:
the forward's inputs and the incoming gradient read, the gradients written).

Every implementation is checked against the family's float64 reference, within the
tolerance table's bound for its kind, before it is timed. ``--rounds N`` times them N times
in turns and keeps each one's median (two-shape runs once read our layer_norm backward at
873 and 1490 GB/s where it runs 2277 alone: a single pass can catch a slow spell). Dropout is left out: its mask
has no torch counterpart to check against.

    python bench/layers.py [--quick] [--dtypes fp16,bf16] [--cudagraph] [--backward]
                           [--families F,...] [--shapes TOKENSxHIDDEN,...] [--rounds N]
                           [--json PATH] [--plot DIR] [--set MODULE.NAME=VALUE ...]

Needs an NVIDIA GPU; on a CPU-only machine it exits saying what to run instead.
"""
from __future__ import annotations

import portable_kernels  # noqa: F401  (first: it chooses the interpreter before triton is imported)

import statistics
import time
from typing import Any, Callable

import torch
import triton

from portable_kernels import ops, plugins
from portable_kernels.testing import assert_close, tolerance

import _common  # bench/, beside this script
import _peers

F = torch.nn.functional

#: (tokens, hidden): a decode batch, and prefill-sized blocks of two model widths.
SHAPES = [(16, 4096), (4096, 4096), (16384, 4096), (32768, 8192)]
QUICK = [(4096, 4096)]
#: family -> the tolerance kind of its outputs (testing.TOLERANCES).
KINDS = {"vector_add": "elementwise", "softmax": "reduction", "layer_norm": "reduction",
         "rms_norm": "reduction", "add_rms_norm": "reduction", "swiglu": "elementwise",
         "geglu": "elementwise", "rope": "elementwise", "asin": "elementwise"}
#: How many of a family's leading arguments take a gradient (the others: all of them).
GRAD_ARGS = {"rope": 2}
FAMILIES = list(KINDS)


def inputs(family: str, tokens: int, hidden: int, dtype: torch.dtype, device) -> tuple:
    """Fresh ``torch.randn`` arguments of one call (asin's in (-1, 1); the gated
    activations' fused gate-up tensor (tokens, 2 * hidden))."""
    def randn(*shape):
        return torch.randn(*shape, device=device).to(dtype)

    if family == "vector_add":
        return randn(tokens, hidden), randn(tokens, hidden)
    if family == "softmax":
        return (randn(tokens, hidden),)
    if family == "layer_norm":
        return randn(tokens, hidden), randn(hidden), randn(hidden)
    if family == "rms_norm":
        return randn(tokens, hidden), randn(hidden)
    if family == "add_rms_norm":
        return randn(tokens, hidden), randn(tokens, hidden), randn(hidden)
    if family == "rope":
        heads = max(1, hidden // 128)
        d = hidden // heads
        angles = torch.rand(tokens, d // 2, device=device) * 6.283
        return (randn(1, tokens, heads, d), randn(1, tokens, max(1, heads // 4), d),
                angles.cos(), angles.sin())
    if family in ("swiglu", "geglu"):
        return (randn(tokens, 2 * hidden),)
    if family == "asin":
        return (torch.rand(tokens, hidden, device=device).mul(2).sub(1).mul(0.999).to(dtype),)
    raise KeyError(family)


def torch_op(family: str) -> Callable[..., torch.Tensor]:
    """Torch's own operator for ``family``, on the same arguments as ours."""
    if family == "vector_add":
        return lambda x, y: x + y
    if family == "softmax":
        return lambda x: torch.softmax(x, dim=-1)
    if family == "layer_norm":
        return lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, 1e-5)
    if family == "rms_norm":
        return lambda x, w: F.rms_norm(x, x.shape[-1:], w, 1e-6)
    if family == "add_rms_norm":
        def add_rms_norm(x, r, w):
            summed = x + r
            return F.rms_norm(summed, x.shape[-1:], w, 1e-6), summed
        return add_rms_norm
    if family == "rope":
        return _torch_rope
    if family == "swiglu":
        return lambda gu: F.silu(gu[..., :gu.shape[-1] // 2]) * gu[..., gu.shape[-1] // 2:]
    if family == "geglu":
        return lambda gu: (F.gelu(gu[..., :gu.shape[-1] // 2], approximate="tanh")
                           * gu[..., gu.shape[-1] // 2:])
    if family == "asin":
        return torch.asin
    raise KeyError(family)


def _torch_rope(q, k, cos, sin):
    """Rotate-half rotary embeddings as eager torch code writes them (Hugging Face's
    ``apply_rotary_pos_emb``), tables at positions 0..S-1."""
    c = cos[: q.shape[1]][None, :, None, :]
    s = sin[: q.shape[1]][None, :, None, :]

    def rotate(x):
        x1, x2 = x[..., : c.shape[-1]], x[..., c.shape[-1]:]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1).to(x.dtype)

    return rotate(q), rotate(k)


def _tuple(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def ours(family: str) -> Callable[..., torch.Tensor]:
    """Our operator (``portable_kernels.ops``: differentiable in every family here)."""
    return getattr(ops, family)


def moved_bytes(args: tuple, out, backward: bool) -> int:
    """Bytes one call must move: its tensors read once and its outputs written once; for
    the backward, the inputs and the incoming gradients read and a gradient per input
    written."""
    size = sum(a.numel() * a.element_size() for a in args)
    out_size = sum(o.numel() * o.element_size() for o in _tuple(out))
    return 2 * size + out_size if backward else size + out_size


def backward_call(family: str, fn: Callable, args: tuple) -> Callable[[], Any]:
    """One backward of ``fn`` on ``args`` (its forward run once, outside), as a call."""
    n = GRAD_ARGS.get(family, len(args))
    leaves = [a.detach().requires_grad_() for a in args[:n]]
    outs = _tuple(fn(*leaves, *args[n:]))
    dys = [torch.randn_like(o) for o in outs]
    return lambda: torch.autograd.grad(outs, leaves, dys, retain_graph=True)


def check(family: str, impl: _peers.Impl, args: tuple, call_args: tuple) -> Any:
    """``impl`` on ``call_args`` (``impl.prepare(args)``) checked against the family's
    float64 reference on ``args``; returns its output. The reference first: a peer may
    update its arguments in place."""
    ref = plugins.host().registry.spec(family).reference(*(a.double() for a in args))
    out = impl.fn(*call_args)
    tol = tolerance(args[0].dtype, KINDS[family])
    outs, refs = _tuple(impl.finish(_tuple(out))), _tuple(ref)
    assert len(outs) == len(refs), f"{family}: {len(outs)} outputs, the reference {len(refs)}"
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert_close(o, r, tol, f"{family} output {i}")
    return out


def implementations(family: str) -> dict[str, _peers.Impl]:
    """Ours, torch's and the peers' (those installed) for ``family``."""
    return {"ours": _peers.Impl(ours(family)), "torch": _peers.Impl(torch_op(family)),
            **_peers.layer(family)}


def bench_row(family: str, tokens: int, hidden: int, dtype: torch.dtype, args_: Any,
              device: str = "cuda") -> dict:
    """One (family, shape, dtype) row: every implementation checked, then timed
    ``args_.rounds`` times in turns (the median kept; ``row["spread"]`` the range), so that
    a slow spell of the device reads as spread, not as one implementation's number."""
    row: dict = {"family": family, "tokens": tokens, "hidden": hidden,
                 "dtype": str(dtype).removeprefix("torch."), "ms": {}, "tflops": {}, "gbps": {}, "error": {}}
    args = inputs(family, tokens, hidden, dtype, device)
    passes = ["fwd"] + (["bwd"] if args_.backward else [])
    timings = []  # (key, implementation, a function making the timed call, bytes moved)
    for name, impl in implementations(family).items():
        call_args = impl.prepare(args)
        with impl.context():
            out = _common.first_call(row, name, lambda: check(family, impl, args, call_args))
        if out is None:
            continue
        finished = impl.finish(_tuple(out))
        for p in passes:
            key = f"{name} {p}"
            if p == "bwd" and not impl.backward:
                row["error"][key] = "no backward"
                continue
            if p == "fwd":
                make = (lambda impl=impl, call_args=call_args: lambda: impl.fn(*call_args))
            else:
                # Built anew in each round: one retained graph at a time, as in one pass.
                make = (lambda impl=impl, call_args=call_args:
                        backward_call(family, impl.fn, call_args))
            timings.append((key, impl, make, moved_bytes(args, finished, p == "bwd")))
    samples: dict[str, list[float]] = {key: [] for key, *_ in timings}
    for _ in range(max(1, getattr(args_, "rounds", 1))):
        for key, impl, make, _ in timings:
            with impl.context():
                _common.timed(row, key, make(), 0.0, args_.cudagraph)
            samples[key].append(row["ms"][key])
    for key, _, _, moved in timings:
        times = samples[key]
        row["ms"][key] = statistics.median(times)
        row["gbps"][key] = moved / (row["ms"][key] * 1e-3) / 1e9
        if len(times) > 1:
            row.setdefault("spread", {})[key] = (min(times), max(times))
    return row


PROVIDERS = ("ours", "torch", *_peers.PEERS)


def ratio(row: dict, p: str, against: tuple[str, ...] = ("torch",)) -> float | None:
    """Our GB/s over the fastest of ``against`` measured in ``row`` for pass ``p``."""
    theirs = [row["gbps"][f"{o} {p}"] for o in against if f"{o} {p}" in row["gbps"]]
    mine = row["gbps"].get(f"ours {p}")
    return None if mine is None or not theirs else mine / max(theirs)


def markdown(rows: list[dict], header: str) -> str:
    lines = [header, "", "GB/s (bytes a call must move over its time; bwd: the backward alone); "
             "× torch, × peers: ours over torch's, over the faster peer's", "",
             "| family | tokens×hidden | dtype | pass | ours | torch | Liger | FlagGems | × torch | × peers |",
             "|:--|--:|:--|:--|--:|--:|--:|--:|--:|--:|"]

    def fmt(value: float | None, spec: str = ".0f") -> str:
        return "-" if value is None else format(value, spec)

    for r in rows:
        g = r["gbps"]
        for p in ("fwd", "bwd"):
            if not any(f"{name} {p}" in g for name in PROVIDERS):
                continue
            cells = " | ".join(fmt(g.get(f"{name} {p}")) for name in PROVIDERS)
            lines.append(f"| {r['family']} | {r['tokens']}×{r['hidden']} | {r['dtype']} | {p} | {cells} | "
                         f"{fmt(ratio(r, p), '.2f')} | {fmt(ratio(r, p, _peers.PEERS), '.2f')} |")
    return "\n".join(lines) + "\n"


def plot_benchmarks(rows: list[dict]) -> list[triton.testing.Benchmark]:
    """One plot per dtype and pass: GB/s of ours and torch's against the family."""
    plots = []
    for dtype in sorted({r["dtype"] for r in rows}):
        for p in ("fwd", "bwd"):
            if not any(f"ours {p}" in r["gbps"] for r in rows if r["dtype"] == dtype):
                continue
            plots.append(triton.testing.Benchmark(
                x_names=["case"], x_vals=[f"{r['family']} {r['tokens']}x{r['hidden']}"
                                          for r in rows if r["dtype"] == dtype],
                line_arg="provider", line_vals=list(PROVIDERS), line_names=list(PROVIDERS),
                ylabel="GB/s", plot_name=f"layers-{dtype}-{p}", args={"dtype": dtype, "p": p}))
    return plots


def measured(rows: list[dict]) -> Callable[..., float]:
    by_case = {(f"{r['family']} {r['tokens']}x{r['hidden']}", r["dtype"]): r for r in rows}

    def gbps(case, provider, dtype, p):
        row = by_case.get((case, dtype))
        return _common.nan_if_none(None if row is None else row["gbps"].get(f"{provider} {p}"))

    return gbps


def main() -> None:
    parser = _common.options(__doc__, f"only (tokens, hidden) in {QUICK}")
    parser.add_argument("--backward", action="store_true", help="time the backward too")
    parser.add_argument("--families", default=",".join(FAMILIES),
                        help=f"comma-separated, among {', '.join(FAMILIES)}")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time every implementation this many times, in turns (median)")
    parser.add_argument("--shapes", default=None, metavar="TxH,...",
                        help="comma-separated tokens x hidden, e.g. 16384x4096 (default: "
                        + ", ".join(f"{t}x{h}" for t, h in SHAPES) + ")")
    args = parser.parse_args()
    try:
        shapes = ([tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
                  if args.shapes else (QUICK if args.quick else SHAPES))
        if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
            raise ValueError
    except ValueError:
        parser.error(f"--shapes: expected TOKENSxHIDDEN,... (e.g. 16384x4096), got {args.shapes!r}")
    families = [f for f in args.families.split(",") if f]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown or not families:
        parser.error(f"--families: unknown {', '.join(unknown) or 'empty list'}; choose among "
                     f"{', '.join(FAMILIES)}")
    settings = _common.apply_settings(args.set)
    info = _common.nvidia_gpu("bench/layers.py", "against torch's operators",
                              "tests/test_softmax.py tests/test_layer_norm.py ...")
    dtypes = _common.dtypes(args.dtypes)
    header = _common.header("elementwise and norm layers", info, args.cudagraph)
    meta = {**_common.meta(info, args.cudagraph), "settings": settings,
            "peers": _peers.versions(), "peers_missing": _peers.missing()}
    print(header)
    for peer, why in _peers.missing().items():
        print(f"{peer} left out: {why}")
    rows, start = [], time.time()
    for dtype in dtypes:
        for family in families:
            for tokens, hidden in shapes:
                row = bench_row(family, tokens, hidden, dtype, args)
                rows.append(row)
                cells = "  ".join(f"{k} {v:7.0f} GB/s" for k, v in row["gbps"].items())
                print(f"{family:>10} {tokens:>5}x{hidden:<5} {row['dtype']:>8}  {cells}", flush=True)
                _common.write(args.json, rows, {**meta, "elapsed_s": time.time() - start},
                              lambda rows_: markdown(rows_, header))
                torch.cuda.empty_cache()
    print(markdown(rows, header))
    print(_common.save_plots(args.plot, plot_benchmarks(rows), measured(rows)))
    _common.closing(args.json, rows, lambda r: f"{r['family']} {r['tokens']}x{r['hidden']} {r['dtype']}",
                    start)


if __name__ == "__main__":
    main()
