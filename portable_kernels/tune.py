"""``portable-kernels tune``: autotune and compile ahead of time, so that a service's first
request is not the one that pays for it. Results persist per device fingerprint
(``tuning_cache``), so later processes start with them.

    portable-kernels tune matmul --shapes 4096x4096x4096 16x4096x14336 --dtypes bf16,fp16
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from triton.runtime.autotuner import Autotuner

from . import dispatch, plugins, tuning_cache
from ._table import table
from .errors import DeviceError, PortableKernelsError

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32,
          "fp8e4m3": torch.float8_e4m3fn, "fp8e5m2": torch.float8_e5m2}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _chosen_configs(plan) -> str:
    chosen = []
    for tuner in plan._tuned.values():
        best = getattr(tuner, "best_config", None)
        if best is not None:
            chosen.append(str(best))
    if not chosen and plan.configs:
        chosen.append(str(plan.configs[0]))
    return "; ".join(chosen) or "-"


def _tuned(plan) -> bool:
    """Whether a call of ``plan`` chose among configs (with one, nothing is benchmarked,
    and ``tuning_cache`` stores nothing)."""
    return any(isinstance(t, Autotuner) and len(t.configs) > 1 for t in plan._tuned.values())


def _stamp(path) -> tuple | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


def tune(kernel: str, shapes: list[str], dtypes: list[torch.dtype], device: torch.device) -> list[dict]:
    """Run ``kernel`` once per shape and dtype (tuning and compiling it), then time a call.
    Each row says whether the call tuned (``tuned``: it had more than one config)."""
    spec = plugins.host().registry.spec(kernel)
    if spec.inputs is None:
        raise PortableKernelsError(f"{kernel} has no example-input builder, so it cannot be tuned ahead")
    handle = dispatch.get_kernel(kernel)
    rows = []
    for shape in shapes:
        for dtype in dtypes:
            args, kwargs = spec.inputs(shape, dtype, device)
            sel = handle.select(*args, **kwargs)
            t0 = time.perf_counter()
            handle(*args, **kwargs)
            _sync(device)
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            handle(*args, **kwargs)
            _sync(device)
            steady = time.perf_counter() - t0
            plan = dispatch._launch_plan(sel)
            rows.append({"shape": shape, "dtype": str(dtype).replace("torch.", ""), "variant": sel.variant,
                         "first_call_s": first, "second_call_ms": steady * 1e3,
                         "config": _chosen_configs(plan), "tuned": _tuned(plan)})
    return rows


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("kernel")
    p.add_argument("--shapes", nargs="+", required=True,
                   help="shape strings in the kernel's form (portable-kernels list shows it), e.g. 4096x4096x4096")
    p.add_argument("--dtypes", default="fp16,bf16",
                   help="comma-separated: fp16, bf16, fp32, fp8e4m3, fp8e5m2 (fp8: matmul)")
    p.add_argument("--device", default=None)
    p.add_argument("--json", action="store_true")


def cmd_tune(args: argparse.Namespace) -> int:
    try:
        dtypes = [DTYPES[d.strip()] for d in args.dtypes.split(",") if d.strip()]
    except KeyError as exc:
        print(f"error: unknown dtype {exc.args[0]!r}; use {', '.join(DTYPES)}", file=sys.stderr)
        return 2
    try:
        device = dispatch._resolve_device(args.device)
    except DeviceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    spec = plugins.host().registry.spec(args.kernel)
    info = dispatch.device_info(device)
    print(f"tuning {args.kernel} ({spec.input_shape}) on {info.name}", file=sys.stderr)
    path = tuning_cache.path_for(info.fingerprint)
    before = _stamp(path)
    rows = tune(args.kernel, args.shapes, dtypes, device)
    # Name the file only when this run wrote it: a path for results never stored would
    # send the reader looking for a file that does not exist.
    stored = tuning_cache.enabled() and _stamp(path) not in (None, before)
    if not any(r["tuned"] for r in rows):
        note = "nothing was tuned (one config per kernel on this device); no results were stored"
    elif not tuning_cache.enabled():
        note = "tuning results: not stored (PK_TUNING_CACHE=0)"
    elif stored:
        note = f"tuning results: {path}"
    elif before is not None:
        note = f"tuning results: already in {path} (read from it; nothing new to store)"
    else:
        note = f"tuning results: not stored (writing {path} failed)"
    if args.json:
        print(json.dumps({"device": info.fingerprint, "stored_in": str(path) if stored else None,
                          "note": note, "results": rows}, indent=2))
        return 0
    print(table(["shape", "dtype", "variant", "first call (s)", "second call (ms)", "config"],
                [(r["shape"], r["dtype"], r["variant"], f"{r['first_call_s']:.2f}",
                  f"{r['second_call_ms']:.3f}", r["config"]) for r in rows]))
    print(note)
    return 0


def add_subcommands(subcommands: dict) -> None:
    subcommands["tune"] = ("autotune and compile KERNEL for the given shapes ahead of time",
                           _configure, cmd_tune)
