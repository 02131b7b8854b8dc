"""What a ``get_kernel(...)`` call adds over launching the Triton kernel directly.

Three ways to compute ``vector_add`` on the same small tensors (so launch cost dominates):

- ``raw``: ``_vector_add_kernel[grid](...)`` with a preallocated output (Triton alone),
  and the same with the output allocated per call, as any wrapper returning a new tensor must;
- ``raw, direct launch``: the same launch through ``plan.direct`` (the compiled kernel
  launched without Triton's per-call dispatch, ``portable_kernels/_direct.py``; the JIT
  path where direct launches are off, as on the interpreter);
- ``launcher``: the family's host launcher called with a resolved plan (checks, allocation,
  launch: what every variant pays);
- ``handle``: ``pk.get_kernel("vector_add")(x, y)`` (the launcher plus selection).

``handle - launcher`` is the dispatch cost. A fourth row times dispatch alone, through a
kernel whose launcher does nothing, so it is measured without any launch noise. Then the
pieces a replayed call (``portable_kernels/_replay.py``) is left with, beside torch's own
add: the handle with its signature keyed in Python instead of C (``_signature.py``), each
signature alone, and the output's allocation two ways; and on a GPU the recipe alone (its
allocation and launch) through the C launcher and through Triton's, beside torch's
operator, for vector_add, asin, softmax and flash_attn, interleaved round by round (drift between separately timed rows moves them by more than the
launchers differ).

    python bench/dispatch_overhead.py [--quick] [--device cuda] [--iters 20000] [--json PATH]

Host time per call is measured with ``time.perf_counter_ns`` over many calls, then the
device is synchronized; the median of several rounds is reported.
"""
from __future__ import annotations

import portable_kernels as pk  # first: chooses the interpreter before triton is imported

import os
import statistics
import time
from typing import NamedTuple

import torch
import triton

from portable_kernels import KernelSpec, Variant, _signature, dispatch, hookimpl, plugins
from portable_kernels.kernels import vector_add

import _common  # bench/, beside this script

F = torch.nn.functional


class _Problem(NamedTuple):
    device: torch.device
    dtype: torch.dtype


class _NoopPlugin:
    """Declares ``noop(x)``: selection as for a real kernel, a launcher that does nothing."""

    @hookimpl
    def pk_register_variants(self, registry):
        registry.add_kernel(KernelSpec("noop", "(x) -> x", lambda x: _Problem(x.device, x.dtype)))
        registry.add_variant(Variant("noop", "generic", lambda plan, x: x))


def _per_call_ns(fn, iters: int, rounds: int, sync) -> float:
    for _ in range(min(iters, 200)):  # warm up: compile, select, fill caches
        fn()
    sync()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        for _ in range(iters):
            fn()
        sync()
        samples.append((time.perf_counter_ns() - t0) / iters)
    return statistics.median(samples)


def _recipe(handle, args: tuple, kwargs: dict, c_launcher: bool):
    """The replay recipe of ``handle(*args, **kwargs)`` on plans built afresh with the
    backend's C launcher on or off (``PK_C_LAUNCHER``), and the call's pointers."""
    before = os.environ.get("PK_C_LAUNCHER")
    os.environ["PK_C_LAUNCHER"] = "1" if c_launcher else "0"
    try:
        plugins.host().clear_caches()
        for _ in range(5):  # compile, record, replay
            handle(*args, **kwargs)
        replays = plugins.host().replays[handle.name]
        key, pointers = replays.key(args, kwargs, replays.current)
        recipe = replays.recipes.get(key)
        if recipe is None:
            raise SystemExit(f"{handle.name} did not replay: {replays.why.get(key, '?')}")
        return recipe, pointers
    finally:
        if before is None:
            os.environ.pop("PK_C_LAUNCHER", None)
        else:
            os.environ["PK_C_LAUNCHER"] = before
        plugins.host().clear_caches()


def _recipe_cases(x, y) -> dict:
    """Small calls whose replay is one allocation and one launch (flash_attn: two), each
    with torch's operator for it."""
    cases = {"vector_add": ((x, y), {}, lambda: torch.add(x, y))}
    if x.is_cuda:
        rows = torch.randn(8, 4096, device=x.device, dtype=torch.bfloat16)
        q, k, v = (torch.randn(1, 8, 512, 64, device=x.device, dtype=torch.float16)
                   for _ in range(3))
        cases["asin 8x4096 bf16"] = ((rows,), {}, lambda: torch.asin(rows))
        cases["softmax 8x4096 bf16"] = ((rows,), {}, lambda: torch.softmax(rows, -1))
        cases["flash_attn 1x8x512x64 causal fp16"] = (
            (q, k, v), {"causal": True},
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    return cases


def _recipes_paired(x, y, iters: int, rounds: int, sync) -> dict:
    """Each case's replayed call without its signature and handle (the recipe: allocation
    and launch), through the C launcher and through Triton's, and torch's operator:
    interleaved within each round, so that the host's drift moves all three alike."""
    out = {}
    for case, (args, kwargs, reference) in _recipe_cases(x, y).items():
        handle = pk.get_kernel(case.split()[0])
        (c, pointers), (t, _) = (_recipe(handle, args, kwargs, on) for on in (True, False))
        fns = {f"{case}: recipe alone, C launcher": lambda: c.run(args, kwargs, pointers),
               f"{case}: recipe alone, Triton's launcher": lambda: t.run(args, kwargs, pointers),
               f"{case}: torch, beside the recipes": reference}
        samples: dict[str, list[float]] = {name: [] for name in fns}
        with torch.no_grad():
            for _ in range(rounds):
                for name, fn in fns.items():
                    samples[name].append(_per_call_ns(fn, iters, 1, sync))
        out.update({name: statistics.median(v) for name, v in samples.items()})
    return out


def main() -> None:
    parser = _common.options(__doc__, "2000 calls a row, 3 rounds", vendor=False)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--iters", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--numel", type=int, default=4096)
    args = parser.parse_args()
    settings = _common.apply_settings(args.set)
    _common.no_plots("bench/dispatch_overhead.py", args.plot)
    if args.quick:
        args.iters, args.rounds = 2000, 3

    device = torch.device(args.device)
    if device.type == "cpu":
        # The interpreter makes every launch cost ~0.5 ms; only the dispatch-only row is
        # meaningful there, so keep the launching rows short.
        args.iters = min(args.iters, 50)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    plugins.install_host(plugins.PluginHost([_NoopPlugin()]))

    x = torch.randn(args.numel, device=device)
    y = torch.randn(args.numel, device=device)
    handle = pk.get_kernel("vector_add")
    handle(x, y)
    plan = handle._cache[next(iter(handle._cache))]
    cfg = plan.config
    block = cfg.kwargs["BLOCK_SIZE"]
    out = torch.empty_like(x)
    grid = (triton.cdiv(x.numel(), block),)

    def raw():
        vector_add._vector_add_kernel[grid](x, y, out, x.numel(), BLOCK_SIZE=block, num_warps=cfg.num_warps)

    direct = plan.direct(vector_add._vector_add_kernel)

    def raw_direct():
        direct[grid](x, y, out, x.numel(), BLOCK_SIZE=block, num_warps=cfg.num_warps)

    def raw_alloc():
        o = torch.empty_like(x)
        vector_add._vector_add_kernel[grid](x, y, o, x.numel(), BLOCK_SIZE=block, num_warps=cfg.num_warps)
        return o

    rows = {
        "raw": _per_call_ns(raw, args.iters, args.rounds, sync),
        "raw, direct launch": _per_call_ns(raw_direct, args.iters, args.rounds, sync),
        "raw + output allocation": _per_call_ns(raw_alloc, args.iters, args.rounds, sync),
        "launcher": _per_call_ns(lambda: vector_add.launch(plan, x, y), args.iters, args.rounds, sync),
        "handle": _per_call_ns(lambda: handle(x, y), args.iters, args.rounds, sync),
    }
    replays = plugins.host().replays.get("vector_add")
    if replays is not None and replays.active:
        key = replays.key
        replays.key = _signature.python_signature
        rows["handle, signature in Python"] = _per_call_ns(lambda: handle(x, y), args.iters,
                                                           args.rounds, sync)
        replays.key = key
    rows["torch.add"] = _per_call_ns(lambda: torch.add(x, y), args.iters, args.rounds, sync)
    if replays is not None and replays.active:
        rows.update(_recipes_paired(x, y, args.iters, args.rounds, sync))
    c_key = _signature.c_signature()
    if c_key is not None:
        rows["signature in C"] = _per_call_ns(lambda: c_key((x, y), {}, None), args.iters,
                                              args.rounds, lambda: None)
    rows["signature in Python"] = _per_call_ns(
        lambda: _signature.python_signature((x, y), {}, None), args.iters, args.rounds,
        lambda: None)
    size, stride, dtype = tuple(x.shape), x.stride(), x.dtype
    rows["torch.empty_strided"] = _per_call_ns(
        lambda: torch.empty_strided(size, stride, dtype=dtype, device=device), args.iters,
        args.rounds, sync)
    new = torch.empty(0, dtype=dtype, device=device).new_empty_strided
    rows["Tensor.new_empty_strided"] = _per_call_ns(lambda: new(size, stride), args.iters,
                                                    args.rounds, sync)
    noop = pk.get_kernel("noop")
    noop_iters = max(args.iters, 20000 if args.quick else 200000)
    rows["dispatch only (noop kernel)"] = _per_call_ns(lambda: noop(x), noop_iters, args.rounds, lambda: None)
    rows["python call of a no-op lambda"] = _per_call_ns(lambda: None, noop_iters, args.rounds, lambda: None)

    info = dispatch.device_info(device)
    print(f"device {info.name} · torch {torch.__version__} · triton {triton.__version__} · "
          f"vector_add of {args.numel} fp32, median of {args.rounds} rounds")
    width = max(34, *map(len, rows))
    print(f"{'path':{width}s} {'µs/call':>9s}")
    for name, ns in rows.items():
        print(f"{name:{width}s} {ns / 1000:9.2f}")
    added = (rows["handle"] - rows["launcher"]) / 1000
    print(f"{'dispatch added (handle - launcher)':{width}s} {added:9.2f}")
    print(f"{'handle over raw launch + alloc':{width}s} {(rows['handle'] - rows['raw + output allocation']) / 1000:9.2f}")
    print(f"{'direct launch saves (raw - direct)':{width}s} {(rows['raw'] - rows['raw, direct launch']) / 1000:9.2f}"
          f"  ({direct.launches} direct launches)")
    table = [{"path": k, "us_per_call": v / 1000} for k, v in rows.items()]
    _common.write(args.json, table, {"device": info.to_dict(), "torch": torch.__version__,
                                     "triton": triton.__version__, "numel": args.numel,
                                     "settings": settings, "dispatch_added_us": added},
                  lambda rows_: "| path | µs per call |\n|:--|--:|\n" + "".join(
                      f"| {r['path']} | {r['us_per_call']:.2f} |\n" for r in rows_))


if __name__ == "__main__":
    main()
