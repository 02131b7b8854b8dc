"""Compile the NVIDIA backend's sm_90 (Hopper) kernels for every tuning config, without a GPU.

GPU time is scarce and CI has no GPU, yet a kernel edit or a new tuning entry can break the
Hopper build (a compiler failure, shared memory past the 227 KB a block may use) in ways the
CPU interpreter never sees. This script runs the real host launchers on CPU tensors, with
plans built as dispatch builds them for an H200 (``pk_tuning_configs``, one config per
plan), and intercepts each kernel launch: the launch's arguments are specialized the way
Triton's JIT specializes them, then compiled for ``GPUTarget("cuda", 90, 32)`` with the
ptxas that ships with Triton, and nothing is launched.

Families: ``flash_attn`` (``nvidia.hopper`` and the generic sm_90 table; forward and the
three backward kernels, causal and not; ``nvidia.hopper_gluon``'s Gluon forward and dk/dv
kernels), ``matmul`` (``nvidia.persistent_tma``, the generic table and
``nvidia.hopper_gluon``'s Gluon kernel), ``grouped_matmul`` (``nvidia.tma`` and generic).
For each compiled kernel it prints shared memory, registers and local memory (spills) from the cubin, and fails when
a kernel does not compile, needs more shared memory than the device has, or (Gluon kernels,
whose MMAs are scheduled by hand) has its warpgroup MMAs serialized by ptxas.

    python ci/sm90_compile.py [--quick] [--families flash_attn,matmul] [--markdown OUT]

``--quick``: fp16 (and fp8 e4m3 for fp8 configs) only, one config per row class. Needs no GPU and no CUDA install.
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "0"  # compile, never interpret (must precede `import triton`)
os.environ.pop("PK_INTERPRET", None)

import argparse  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import CUDABackend  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.runtime import jit  # noqa: E402

import portable_kernels  # noqa: E402,F401  (loads the plugins' entry points)
from portable_kernels import plugins  # noqa: E402
from portable_kernels.launch import LaunchPlan  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
PROFILE = "h200"


@dataclass
class Row:
    case: str
    kernel: str
    shared: int = 0
    regs: int | None = None
    local: int | None = None      # STACK + LOCAL bytes per thread: spills and local arrays
    error: str = ""
    ptx: str = ""                 # with ``Compiler(keep_ptx=True)``: for tests of the code


class Compiler:
    """Stands in for ``JITFunction.run``: specializes the call as the JIT does, compiles it
    for sm_90, records the resources (and with ``keep_ptx`` the PTX), launches nothing."""

    def __init__(self, shared_limit: int, keep_ptx: bool = False) -> None:
        self.backend = CUDABackend(TARGET)
        self.shared_limit = shared_limit
        self.keep_ptx = keep_ptx
        self.rows: list[Row] = []
        self.case = ""
        self._binders: dict = {}
        self._resources: dict = {}

    def run(self, fn, args, kwargs) -> None:
        binder = self._binders.get(fn)
        if binder is None:
            binder = self._binders[fn] = jit.create_function_from_signature(
                fn.signature, fn.params, self.backend)
        row = Row(self.case, fn.__name__)
        try:
            bound, specialization, options = binder(*args, **kwargs)
            options, signature, constexprs, attrs = fn._pack_args(
                self.backend, kwargs, bound, specialization, options)
            gluon = getattr(fn, "is_gluon", lambda: False)()
            src = (GluonASTSource if gluon else ASTSource)(fn, signature, constexprs, attrs)
            compiled = triton.compile(src, target=TARGET, options=options.__dict__)
            row.shared = compiled.metadata.shared
            row.ptx = compiled.asm["ptx"] if self.keep_ptx else ""
            row.regs, row.local = self._resource_usage(compiled)
            if row.shared > self.shared_limit:
                row.error = f"shared memory {row.shared} B > {self.shared_limit} B"
            elif gluon:
                row.error = self._serialized(compiled)
        except Exception as exc:  # recorded; the summary fails the run
            row.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}"
        self.rows.append(row)

    def _serialized(self, compiled) -> str:
        """ptxas's warning that it serialized warpgroup MMAs, or "". The Gluon kernels
        schedule their MMAs by hand, one in flight behind the next; when registers of an
        MMA in flight are touched before its wait, ptxas waits after every MMA instead
        (seen: the Gluon matmul 13-16% slower than unserialized on the H200).
        Triton does not show ptxas's warnings, so its PTX is assembled again here."""
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
        if not tool.exists():
            return ""
        with tempfile.TemporaryDirectory() as tmp:
            ptx = Path(tmp) / "kernel.ptx"
            ptx.write_text(compiled.asm["ptx"])
            log = subprocess.run([str(tool), "-v", "--gpu-name", "sm_90a", str(ptx), "-o",
                                  str(Path(tmp) / "kernel.cubin")],
                                 capture_output=True, text=True).stderr
        warning = next((line for line in log.splitlines() if "are serialized" in line), "")
        return f"ptxas serialized its MMAs: {warning.split(':', 2)[-1].strip()[:160]}" if warning else ""

    def _resource_usage(self, compiled) -> tuple[int | None, int | None]:
        """Registers and STACK + LOCAL bytes, from ``cuobjdump --dump-resource-usage``."""
        key = compiled.hash
        if key not in self._resources:
            tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
            regs = local = None
            if tool.exists():
                with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                    f.write(compiled.asm["cubin"])
                    f.flush()
                    out = subprocess.run([str(tool), "--dump-resource-usage", f.name],
                                         capture_output=True, text=True).stdout
                m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", out)
                if m:
                    regs, local = int(m.group(1)), int(m.group(2)) + int(m.group(3))
            self._resources[key] = (regs, local)
        return self._resources[key]


def plans(host, device, kernel: str, variant: str) -> list[LaunchPlan]:
    """One single-config plan per tuning config, built as dispatch builds plans."""
    v = host.registry.variants[kernel][variant]
    configs = host.call("pk_tuning_configs", firstresult=True, kernel=kernel, variant=v,
                        device=device)
    if configs is None:
        configs = v.configs(device) if v.configs is not None else []
    switches = dict(v.switches)
    switches.update(host.call("pk_variant_switches", firstresult=True, kernel=kernel,
                              variant=v, device=device) or {})
    return [LaunchPlan(v, device, [cfg], switches) for cfg in configs]


def _label(cfg: triton.Config, keys: tuple[str, ...]) -> str:
    tile = "x".join(str(cfg.kwargs[k]) for k in keys if k in cfg.kwargs)
    extra = "".join(f" {k.lower()}={cfg.kwargs[k]}" for k in ("SPLIT_K", "EPILOGUE_SUBTILE")
                    if cfg.kwargs.get(k))
    if cfg.kwargs.get("TMA") is False:  # a descriptor variant's pointer-load config
        extra += " pointers"
    return f"{tile} w{cfg.num_warps} s{cfg.num_stages}{extra}"


def _first_per_class(plan_list: list[LaunchPlan]) -> list[LaunchPlan]:
    seen, out = set(), []
    for p in plan_list:
        row = p.configs[0].kwargs.get("ROW_BYTES_MAX", math.inf)
        if row not in seen:
            seen.add(row)
            out.append(p)
    return out


def flash_attn_cases(host, device, quick: bool):
    from portable_kernels.kernels import flash_attn as fa

    dtypes = [torch.float16] if quick else [torch.float16, torch.bfloat16]
    for variant in ("nvidia.hopper", "generic"):
        plan_list = plans(host, device, "flash_attn", variant)
        if quick:
            plan_list = _first_per_class(plan_list)
        for plan in plan_list:
            cfg = plan.configs[0]
            row = cfg.kwargs.get("ROW_BYTES_MAX", 2048)
            # The widest head dim of the row class, in each dtype the class serves.
            for dtype in dtypes + ([] if variant == "nvidia.hopper" or quick else [torch.float32]):
                d = min(256, row // torch.empty(0, dtype=dtype).element_size())
                if variant == "nvidia.hopper" and d not in fa.TMA_HEAD_DIMS:
                    continue
                for causal in (False, True):
                    name = (f"flash_attn/{variant} {_label(cfg, ('BLOCK_M', 'BLOCK_N'))} "
                            f"{str(dtype)[6:]} D={d} {'causal' if causal else 'full'}")
                    # Long enough for the backward's descriptor path (BWD_TMA_MIN_SEQ).
                    n = max(256, cfg.kwargs.get("BWD_TMA_MIN_SEQ", 0))
                    q, k, v, do = (torch.empty(1, 2, n, d, dtype=dtype) for _ in range(4))
                    scale = 1.0 / math.sqrt(d)

                    def launch(plan=plan, q=q, k=k, v=v, do=do, causal=causal, scale=scale):
                        out, lse = fa._forward(plan, q, k, v, causal, scale)
                        fa._backward(plan, do, q, k, v, out, lse, causal, scale)

                    yield name, launch
    # nvidia.hopper_gluon: its forward and dk/dv kernels are Gluon (one tile each, no
    # table); the rest of its backward is nvidia.hopper's, compiled above.
    from portable_kernels.kernels import flash_attn_gluon as fg

    # Compiled on every Triton, also where the variant declines to run (TRITON_OK): a
    # release that breaks its Gluon shows here before anyone enables it there.
    for dtype in dtypes:
        for d in fa.TMA_HEAD_DIMS:
            for causal in (False, True):
                name = (f"flash_attn/nvidia.hopper_gluon forward {str(dtype)[6:]} D={d} "
                        f"{'causal' if causal else 'full'}")
                q = torch.empty(1, 2, 256, d, dtype=dtype)
                yield name, (lambda q=q, causal=causal, d=d:
                             fg.forward(q, q, q, causal, 1.0 / math.sqrt(d)))
                if d == 64:  # long key loops at D=64 take three consumer warpgroups
                    yield (name.replace("forward", "forward, 3 consumers"),
                           lambda q=q, causal=causal: _three_consumers(fg, q, causal))
                # More tiles than an H200 has SMs: a persistent grid walks them (PERSISTENT;
                # two consumers only).
                wide = torch.empty(1, 64, 512, d, dtype=dtype)
                yield (name.replace("forward", "forward, persistent"),
                       lambda q=wide, causal=causal, d=d:
                       fg.forward(q, q, q, causal, 1.0 / math.sqrt(d)))
                lse = torch.empty(1, 2, 256)
                for acc in (None, torch.empty(1, 2, 256, d)):  # with dq added up in it
                    yield (name.replace("forward", "dk/dv" if acc is None else "dk/dv/dq"), (
                        lambda q=q, lse=lse, causal=causal, d=d, acc=acc:
                        fg.backward(q, q, q, q, lse, lse, q, q, causal, 1.0 / math.sqrt(d),
                                         dq_acc=acc)))


def _three_consumers(fg, q, causal: bool) -> None:
    """The Gluon forward with the three consumer warpgroups it takes at D=64 from
    ``D64_CONSUMERS_MIN_KEYS`` keys on, on a short sequence."""
    kept = fg.D64_CONSUMERS_MIN_KEYS
    fg.D64_CONSUMERS_MIN_KEYS = 0
    try:
        fg.forward(q, q, q, causal, 0.125)
    finally:
        fg.D64_CONSUMERS_MIN_KEYS = kept


def matmul_cases(host, device, quick: bool):
    from portable_kernels.kernels import matmul as mm

    dtypes = [torch.float16] if quick else [torch.float16, torch.bfloat16]
    fp8_dtypes = [torch.float8_e4m3fn] if quick else [torch.float8_e4m3fn, torch.float8_e5m2]
    for variant in ("nvidia.persistent_tma", "generic"):
        plan_list = plans(host, device, "matmul", variant)
        if quick:
            plan_list = plan_list[:1] + [p for p in plan_list if p.configs[0].kwargs.get("SPLIT_K", 1) > 1][:1]
        for plan in plan_list:
            cfg = plan.configs[0]
            # A table's fp8 configs (OPERAND_BYTES=1) with fp8 operands, b in both layouts:
            # column-major (a weight's transpose) takes the fp8 MMA, row-major converts
            # tiles to fp16. The generic table serves fp8 too (converted tiles).
            if cfg.kwargs.get("OPERAND_BYTES") == 1:
                cases = [(d, lay) for d in fp8_dtypes for lay in ("col", "row")]
            else:
                cases = [(d, "row") for d in dtypes]
                if variant == "generic" and not quick:
                    cases.append((torch.float8_e4m3fn, "row"))
            for dtype, layout in cases:
                name = (f"matmul/{variant} "
                        f"{_label(cfg, ('BLOCK_SIZE_M', 'BLOCK_SIZE_N', 'BLOCK_SIZE_K'))} "
                        f"{str(dtype)[6:]}" + (" b col-major" if layout == "col" else ""))
                a = torch.empty(512, 512, dtype=dtype)
                b = torch.empty(512, 512, dtype=dtype)
                b = b.t() if layout == "col" else b
                yield name, (lambda plan=plan, a=a, b=b: mm.launch(plan, a, b))
    # nvidia.hopper_gluon's Gluon kernel (one tile, no table), every operand layout;
    # compiled on every Triton, also where the variant declines to run (TRITON_OK).
    from portable_kernels.kernels import matmul_gluon as mg

    for dtype in dtypes:
        for a_col in (False, True):
            for b_col in (False, True):
                a = torch.empty(512, 512, dtype=dtype)
                b = torch.empty(512, 512, dtype=dtype)
                a, b = (a.t() if a_col else a), (b.t() if b_col else b)
                name = (f"matmul/nvidia.hopper_gluon {str(dtype)[6:]} "
                        f"a {'col' if a_col else 'row'}-major, b {'col' if b_col else 'row'}-major")
                out = torch.empty(512, 512, dtype=dtype)
                yield name, (lambda a=a, b=b, out=out: mg.matmul(a, b, out, device.num_sms))


def grouped_matmul_cases(host, device, quick: bool):
    from portable_kernels.kernels import grouped_matmul as gmm

    for variant in ("nvidia.tma", "generic"):
        plan_list = plans(host, device, "grouped_matmul", variant)
        if quick:
            plan_list = plan_list[:1]
        fp8 = [torch.float8_e4m3fn] if quick else [torch.float8_e4m3fn, torch.float8_e5m2]
        for plan in plan_list:
            # b row-major, and column-major (w.t() of (N, K) weights: descriptors of the
            # transposes, or vectorized loads along K; fp8 MMAs on the descriptor path).
            cases = [(d, lay) for d in fp8 for lay in ("col", "row")]
            if plan.configs[0].kwargs.get("OPERAND_BYTES") != 1:  # fp8-only tiles: fp8 only
                cases = [(torch.float16, "row"), (torch.float16, "col")] + cases
            for dtype, layout in cases:
                name = (f"grouped_matmul/{variant} "
                        f"{_label(plan.configs[0], ('BLOCK_SIZE_M', 'BLOCK_SIZE_N', 'BLOCK_SIZE_K'))} "
                        f"{str(dtype)[6:]}" + (" b col-major" if layout == "col" else ""))
                la = [torch.empty(m, 256, dtype=dtype) for m in (64, 128, 256)]
                if layout == "col":
                    lb = [torch.empty(128, 256, dtype=dtype).t() for _ in la]
                else:
                    lb = [torch.empty(256, 128, dtype=dtype) for _ in la]
                yield name, (lambda plan=plan, la=la, lb=lb: gmm.launch(plan, la, lb))


FAMILIES = {"flash_attn": flash_attn_cases, "matmul": matmul_cases,
            "grouped_matmul": grouped_matmul_cases}


def markdown(rows: list[Row], header: str) -> str:
    lines = [header, "", "| case | kernel | shared KB | registers | local B | |",
             "|:--|:--|--:|--:|--:|:--|"]
    for r in rows:
        lines.append(f"| {r.case} | {r.kernel} | {r.shared / 1024:.0f} | "
                     f"{'' if r.regs is None else r.regs} | {'' if r.local is None else r.local} | "
                     f"{r.error} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fp16, one config per row class")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--markdown", default=None, help="write the table here")
    args = parser.parse_args()

    host = plugins.host()
    device = host.emulation_profile(PROFILE)
    compiler = Compiler(device.shared_memory)
    real_run = jit.JITFunction.run

    def intercept(self, *a, grid, warmup, **kw):
        compiler.run(self, a, kw)

    jit.JITFunction.run = intercept
    start = time.time()
    try:
        for family in args.families.split(","):
            for name, launch in FAMILIES[family](host, device, args.quick):
                compiler.case = name
                before = len(compiler.rows)
                try:
                    launch()
                except Exception as exc:  # a launcher failing before any kernel compiled
                    compiler.rows.append(Row(name, "(launcher)",
                                             error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"))
                if len(compiler.rows) == before:
                    compiler.rows.append(Row(name, "(none)", error="no kernel was launched"))
                print(f"{time.time() - start:6.0f}s {name}", flush=True)
    finally:
        jit.JITFunction.run = real_run

    rows = compiler.rows
    header = (f"sm_90 compile check · triton {triton.__version__} · {len(rows)} kernels · "
              f"shared memory limit {device.shared_memory} B ({device.name} profile)")
    table = markdown(rows, header)
    if args.markdown:
        Path(args.markdown).write_text(table)
    failed = [r for r in rows if r.error]
    spills = [r for r in rows if r.local]
    print("\n" + header)
    print(f"compiled {len(rows) - len(failed)} of {len(rows)} in {time.time() - start:.0f} s; "
          f"largest shared memory {max((r.shared for r in rows), default=0) / 1024:.0f} KB; "
          f"{len(spills)} with local memory (spills)")
    for r in spills:
        print(f"  local memory {r.local} B/thread: {r.case} {r.kernel}")
    for r in failed:
        print(f"FAILED {r.case} {r.kernel}: {r.error}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
