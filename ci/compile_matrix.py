"""Compile every kernel a target can select, for nine GPU targets, without a GPU.

Only the CPU interpreter and one H200 ever execute these kernels here. What breaks first
when a Triton kernel tuned on one GPU meets another is visible to the compiler: shared
memory or LDS past the target's limit, more threads than a workgroup holds, dtypes the
target has no instructions for, configs that spill. This script runs the real host
launchers on CPU tensors, with plans built as dispatch builds them for each target's
emulation profile (``pk_tuning_configs``, one config per plan), and intercepts each kernel
launch: the arguments are specialized the way Triton's JIT specializes them, the kernel is
compiled for the target with the compilers that ship with Triton (ptxas for NVIDIA, LLVM's
AMDGPU backend for AMD), and nothing is launched.

Targets: sm_80 (A100), sm_89 (L40S, RTX 4090), sm_90 (H100/H200), sm_100 (B200), sm_120
(RTX 50xx), gfx90a (MI250X), gfx942 (MI300X), gfx950 (MI355X), gfx1100 (RDNA3, wave32).

Per target, every family x every variant the profile can select (its requirements met, a
priority of 0 or more: a variant ranked below generic there runs only when forced) x every
config the backend's table gives that target x the dtypes the variant takes (bf16 where the
target has it, fp8 in the target's own formats: OCP on NVIDIA and gfx950, fnuz on gfx942),
forward and backward. Per compiled kernel: shared memory (NVIDIA) or LDS (AMD) against the
profile's limit, registers (NVIDIA: the cubin's; AMD: VGPRs), spills (NVIDIA: the cubin's
stack and local bytes per thread; AMD: spilled VGPRs and SGPRs, scratch bytes), and for
the Gluon kernels (sm_90, MMAs scheduled by hand) whether ptxas serialized their warpgroup
MMAs. It fails on a compile error, a resource over a limit, or a threads-per-program count
over 1024.

    python ci/compile_matrix.py [--quick] [--targets sm_90,gfx942] [--families matmul,...]
                                [--markdown OUT] [--json OUT] [--portability docs/portability.md]

``--quick``: fp16 only (and one fp8 format for fp8 configs), one config per row class:
the form CI runs, with ``--budget``: no case starts after that many seconds (split evenly
among the targets), and cases compile in coverage order (one case of every family and
variant, the selected variant first, then a second of each...). Triton's cache holds what
compiled before, so the whole quick matrix takes seconds; after a kernel changes, its
recompilation for nine targets takes minutes of CPU, and the budget bounds it, leaving the
rest reported for a later run. ``--portability``: the summary table of docs/portability.md (target x
family: selected variant, configs compiled, worst shared memory, spills). ``ci/sm90_compile.py``
is this script's sm_90 slice. Needs no GPU and no CUDA or ROCm install.
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "0"  # compile, never interpret (must precede `import triton`)
os.environ.pop("PK_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns when it is unset

import argparse  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import multiprocessing  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler.compiler import make_backend  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.runtime import jit  # noqa: E402

import portable_kernels  # noqa: E402,F401  (loads the plugins' entry points)
from portable_kernels import plugins  # noqa: E402
from portable_kernels.launch import LaunchPlan  # noqa: E402

MAX_THREADS = 1024  # per program (block / workgroup), on every target here


@dataclass(frozen=True)
class Target:
    name: str           # "sm_90", "gfx942"
    backend: str        # Triton's backend: "cuda" or "hip"
    arch: int | str     # GPUTarget's arch: 90, "gfx942"
    warp_size: int
    profile: str        # the emulation profile whose selection and tables are compiled
    gpu: str            # what it is, for tables

    @property
    def gpu_target(self) -> GPUTarget:
        return GPUTarget(self.backend, self.arch, self.warp_size)


TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("sm_80", "cuda", 80, 32, "a100", "A100"),
    Target("sm_89", "cuda", 89, 32, "l40s", "L40S, RTX 4090"),
    Target("sm_90", "cuda", 90, 32, "h200", "H100, H200"),
    Target("sm_100", "cuda", 100, 32, "b200", "B200"),
    Target("sm_120", "cuda", 120, 32, "rtx5090", "RTX 5090"),
    Target("gfx90a", "hip", "gfx90a", 64, "mi250x", "MI250X"),
    Target("gfx942", "hip", "gfx942", 64, "mi300x", "MI300X"),
    Target("gfx950", "hip", "gfx950", 64, "mi355x", "MI355X"),
    Target("gfx1100", "hip", "gfx1100", 32, "rx7900xtx", "RX 7900 XTX (RDNA3)"),
)}


@dataclass
class Row:
    target: str
    family: str
    variant: str
    case: str
    kernel: str
    shared: int = 0
    regs: int | None = None
    spill: int | None = None      # NVIDIA: stack + local bytes per thread; AMD: spilled registers
    scratch: int | None = None    # AMD: private segment bytes per lane (spills, local arrays)
    error: str = ""
    ptx: str = ""                 # with ``Compiler(keep_ptx=True)``: for tests of the code

    @property
    def spills(self) -> bool:
        return bool(self.spill) or bool(self.scratch)


class Compiler:
    """Stands in for ``JITFunction.run``: specializes the call as the JIT does, compiles it
    for ``target``, records the resources (and with ``keep_ptx`` the PTX), launches nothing."""

    def __init__(self, shared_limit: int, keep_ptx: bool = False,
                 target: Target = TARGETS["sm_90"]) -> None:
        self.target = target
        self.backend = make_backend(target.gpu_target)
        self.shared_limit = shared_limit
        self.keep_ptx = keep_ptx
        self.rows: list[Row] = []
        self.family = self.variant = self.case = ""
        self._binders: dict = {}
        self._resources: dict = {}

    def run(self, fn, args, kwargs) -> None:
        binder = self._binders.get(fn)
        if binder is None:
            binder = self._binders[fn] = jit.create_function_from_signature(
                fn.signature, fn.params, self.backend)
        row = Row(self.target.name, self.family, self.variant, self.case, fn.__name__)
        try:
            bound, specialization, options = binder(*args, **kwargs)
            options, signature, constexprs, attrs = fn._pack_args(
                self.backend, kwargs, bound, specialization, options)
            threads = options.num_warps * self.target.warp_size
            if threads > MAX_THREADS:
                raise ValueError(f"{options.num_warps} warps of {self.target.warp_size} lanes: "
                                 f"{threads} threads > {MAX_THREADS} per program")
            gluon = getattr(fn, "is_gluon", lambda: False)()
            src = (GluonASTSource if gluon else ASTSource)(fn, signature, constexprs, attrs)
            compiled = triton.compile(src, target=self.target.gpu_target, options=options.__dict__)
            row.shared = compiled.metadata.shared
            if self.target.backend == "cuda":
                row.ptx = compiled.asm["ptx"] if self.keep_ptx else ""
                row.regs, row.spill = self._cubin_usage(compiled)
            else:
                row.regs, row.spill, row.scratch = _hsaco_usage(compiled.asm["amdgcn"])
            if row.shared > self.shared_limit:
                row.error = f"shared memory {row.shared} B > {self.shared_limit} B"
            elif gluon and self.target.name == "sm_90":
                row.error = self._serialized(compiled)
        except Exception as exc:  # recorded; the summary fails the run
            lines = str(exc).strip().splitlines() or [""]
            row.error = f"{type(exc).__name__}: {lines[-1][:200]}"
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

    def _cubin_usage(self, compiled) -> tuple[int | None, int | None]:
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


def _hsaco_usage(amdgcn: str) -> tuple[int | None, int, int]:
    """(VGPRs, spilled VGPRs + SGPRs, scratch bytes per lane) from the kernel descriptor
    metadata that LLVM's AMDGPU backend writes into the assembly."""
    def field(name: str) -> int | None:
        m = re.search(rf"\.{name}:\s+(\d+)", amdgcn)
        return int(m.group(1)) if m else None

    spills = (field("vgpr_spill_count") or 0) + (field("sgpr_spill_count") or 0)
    return field("vgpr_count"), spills, field("private_segment_fixed_size") or 0


# --- what a target selects --------------------------------------------------------------

#: Whether the cases also compile variants that run only when forced (``--forced``).
FORCED = False


def selectable(host, device, kernel: str, forced: bool | None = None) -> list[str]:
    """Variants of ``kernel`` that ``device``'s dispatch can choose: requirements met and a
    priority of 0 or more (a lower one ranks under generic: it runs only when forced);
    with ``forced`` (default :data:`FORCED`) those too."""
    floor = -math.inf if (FORCED if forced is None else forced) else 0
    out = []
    for v in host.registry.variants[kernel].values():
        if v.missing(device):
            continue
        priority = v.priority(device) if callable(v.priority) else v.priority
        if priority >= floor:
            out.append(v.name)
    return out


def selected(host, device, kernel: str) -> str:
    """The variant dispatch ranks first on ``device`` (before any problem's predicate)."""
    def rank(name: str) -> int:
        v = host.registry.variants[kernel][name]
        return v.priority(device) if callable(v.priority) else v.priority
    names = selectable(host, device, kernel, forced=False)
    return min(names, key=lambda n: (-rank(n), n)) if names else ""  # dispatch's order


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
    return f"{tile} w{cfg.num_warps} s{cfg.num_stages}{extra}".strip()


def _first_per_class(plan_list: list[LaunchPlan]) -> list[LaunchPlan]:
    seen, out = set(), []
    for p in plan_list:
        row = p.configs[0].kwargs.get("ROW_BYTES_MAX", math.inf)
        if row not in seen:
            seen.add(row)
            out.append(p)
    return out


def _dtypes(device, quick: bool) -> list[torch.dtype]:
    """The 16-bit float dtypes compiled for ``device`` (bf16 where it has it)."""
    if quick:
        return [torch.float16]
    return [torch.float16] + ([torch.bfloat16] if device.has("bf16") else [])


def fp8_dtypes(device, quick: bool) -> list[torch.dtype]:
    """``device``'s fp8 formats: OCP (``fp8``) or fnuz (``fp8_fnuz``); none without either."""
    if device.has("fp8"):
        formats = [torch.float8_e4m3fn, torch.float8_e5m2]
    elif device.has("fp8_fnuz"):
        formats = [torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]
    else:
        return []
    return formats[:1] if quick else formats


def _short(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# --- cases per family: (variant, case name, a call of the host launcher) -----------------

def memory_bound_cases(kernel: str):
    """The memory-bound families: each config of each selectable variant, in each dtype,
    on a short and a long row (one pass and the chunked loop) where rows matter; the norms
    also on the widest row a GPU config keeps in registers (8192 columns, one chunk: their
    most registers)."""
    shapes = {"vector_add": ["4099"], "dropout": ["4099"], "asin": ["4099"],
              "softmax": ["4x1000", "4x20000"], "layer_norm": ["8x1000", "8x20000", "8x8192"],
              "rms_norm": ["8x1000", "8x20000", "8x8192"], "swiglu": ["8x5000"], "geglu": ["8x5000"],
              "rope": ["1x256x32x128"], "add_rms_norm": ["8x1000", "8x20000", "8x8192"],
              "kv_cache_write": ["40x8x16x8x128"]}[kernel]

    def cases(host, device, quick: bool):
        module = importlib.import_module(f"portable_kernels.kernels.{kernel}")
        for variant in selectable(host, device, kernel):
            plan_list = plans(host, device, kernel, variant)
            for plan in plan_list[:1] if quick else plan_list:
                dtypes = _dtypes(device, quick) + ([] if quick else [torch.float32])
                for dtype in dtypes:
                    for shape in shapes[:1] if quick else shapes:
                        args, kwargs = module.inputs(shape, dtype, "cpu")
                        name = f"{_label(plan.configs[0], ())} {_short(dtype)} {shape}"
                        if kernel in NORMS:
                            yield variant, name, (lambda plan=plan, args=args: NORMS[kernel](module, plan, *args))
                        else:
                            yield variant, name, (lambda plan=plan, args=args, kwargs=kwargs:
                                                  plan.variant.launch(plan, *args, **kwargs))

    return cases


def _layer_norm(module, plan, x, weight, bias) -> None:
    y, rows, mean, rstd = module._forward(plan, x, weight, bias, 1e-5)
    module._backward(plan, torch.empty_like(rows), rows, weight, mean, rstd)
    module._forward(plan, x, weight, bias, 1e-5, stats=False)  # inference: no statistics


def _rms_norm(module, plan, x, weight) -> None:
    y, rows, rstd = module._forward(plan, x, weight, 1e-6, 1.0)
    module._backward(plan, torch.empty_like(rows), rows, weight, rstd, 1.0)
    module._forward(plan, x, weight, 1e-6, 1.0, stats=False)


#: Families whose backward kernels are called through their stages (forward and backward).
NORMS = {"layer_norm": _layer_norm, "rms_norm": _rms_norm}


def _glu_both(module, plan, gate, up) -> None:
    """Forward and backward of a gated activation (the backward is one kernel)."""
    out = plan.variant.launch(plan, gate, up)
    from portable_kernels.kernels import _glu

    _glu.backward(plan, torch.empty_like(out), gate, up, module.NAME == "geglu", fused=False)


NORMS.update(swiglu=_glu_both, geglu=_glu_both)


def _rope_both(module, plan, q, k, cos, sin) -> None:
    """The forward (half pairs, positions 0..S-1) and the backward (INVERSE), the latter
    with positions and interleaved pairs: every switch compiled once."""
    module._apply(plan, q, k, cos, sin, None, False)
    positions = torch.zeros(q.shape[:2], dtype=torch.int32)
    module._apply(plan, q, k, cos, sin, positions, True, inverse=True)


def _add_rms_norm(module, plan, x, residual, weight) -> None:
    out, summed, rstd = module._forward(plan, x, residual, weight, 1e-6, 0.0)
    module._backward(plan, torch.empty_like(summed), torch.empty_like(summed), summed, weight,
                     rstd, 0.0)
    module._forward(plan, x, residual, weight, 1e-6, 0.0, stats=False)


NORMS.update(rope=_rope_both, add_rms_norm=_add_rms_norm)


def flash_attn_cases(host, device, quick: bool):
    from portable_kernels.kernels import flash_attn as fa

    dtypes = _dtypes(device, quick)
    names = selectable(host, device, "flash_attn")
    for variant in names:
        plan_list = plans(host, device, "flash_attn", variant)
        if variant == "nvidia.hopper_gluon":
            continue  # below: the Gluon kernels have one tile each, no table
        tma = bool(plan_list and plan_list[0].switches.get("TMA"))
        if quick:
            plan_list = _first_per_class(plan_list)
        for plan in plan_list:
            cfg = plan.configs[0]
            row = cfg.kwargs.get("ROW_BYTES_MAX", 2048)
            # The widest head dim of the row class, in each dtype the class serves.
            for dtype in dtypes + ([] if tma or quick else [torch.float32]):
                d = min(256, row // torch.empty(0, dtype=dtype).element_size())
                if tma and d not in fa.TMA_HEAD_DIMS:
                    continue
                # The options' code: every option at once; in the quick form only through
                # flash_attn_varlen's cases (the same kernels, VARLEN on), to keep CI short.
                for causal in (False, True) + (() if quick else ("options",)):
                    name = (f"{_label(cfg, ('BLOCK_M', 'BLOCK_N'))} {_short(dtype)} D={d} "
                            f"{causal if causal == 'options' else 'causal' if causal else 'full'}")
                    # Long enough for the backward's descriptor path (BWD_TMA_MIN_SEQ).
                    n = max(256, cfg.kwargs.get("BWD_TMA_MIN_SEQ", 0))
                    q, k, v, do = (torch.empty(1, 2, n, d, dtype=dtype) for _ in range(4))
                    scale = 1.0 / math.sqrt(d)
                    # Every option at once (the most code each kernel can hold).
                    mods = fa.Mods(_ALL_OPTIONS(2), True) if causal == "options" else None

                    def launch(plan=plan, q=q, k=k, v=v, do=do, causal=bool(causal), scale=scale,
                               mods=mods):
                        out, lse = fa._forward(plan, q, k, v, causal, scale, mods)
                        fa._backward(plan, do, q, k, v, out, lse, causal, scale, mods)

                    yield variant, name, launch
    gluon = [n for n in names if n == "nvidia.hopper_gluon"]
    if gluon:
        yield from _flash_attn_gluon_cases(dtypes, gluon[0])


def _ALL_OPTIONS(heads: int):
    """flash_attn's options, every one set: causal with a window, softcap, ALiBi, sinks."""
    from portable_kernels.kernels import _attn_mods

    return _attn_mods.check_options(
        "compile_matrix", causal=True, window_size=(64, 0), softcap=30.0,
        alibi_slopes=torch.ones(heads), sinks=torch.zeros(heads), batch=1, heads=heads,
        device=torch.device("cpu"))


def flash_attn_varlen_cases(host, device, quick: bool):
    """A packed batch (the kernels' VARLEN switch) with every option, per selectable
    variant and row class (one config each in the quick form)."""
    from portable_kernels.kernels import flash_attn as fa
    from portable_kernels.kernels import flash_attn_varlen as fv

    for variant in selectable(host, device, "flash_attn_varlen"):
        plan_list = plans(host, device, "flash_attn_varlen", variant)
        tma = bool(plan_list and plan_list[0].switches.get("TMA"))
        for plan in _first_per_class(plan_list) if quick else plan_list:
            cfg = plan.configs[0]
            for dtype in _dtypes(device, quick):
                d = min(256, cfg.kwargs.get("ROW_BYTES_MAX", 2048) // dtype.itemsize)
                if tma and d not in fa.TMA_HEAD_DIMS:
                    continue
                n = max(256, cfg.kwargs.get("BWD_TMA_MIN_SEQ", 0))
                cu = torch.tensor([0, n // 2, n], dtype=torch.int32)
                packed = [torch.empty(n, 2, d, dtype=dtype) for _ in range(4)]
                options = _ALL_OPTIONS(2)
                # Only what the variant takes: its predicate may send some options elsewhere.
                problem = fv.problem(*packed[:3], cu, cu, n // 2, n // 2, causal=True,
                                     window_size=(64, 0), softcap=30.0,
                                     alibi_slopes=options.alibi[0], sinks=options.sinks)
                if plan.variant.accepts(problem, device) is not None:
                    continue
                q, k, v, do = fv.views(*packed)
                mods = fa.Mods(options, True, cu, cu, 2, n // 2, n // 2, n)
                name = f"{_label(cfg, ('BLOCK_M', 'BLOCK_N'))} {_short(dtype)} D={d} options"

                def launch(plan=plan, q=q, k=k, v=v, do=do, mods=mods, d=d):
                    out, lse = fa._forward(plan, q, k, v, True, 1.0 / math.sqrt(d), mods)
                    fa._backward(plan, do, q, k, v, out, lse, True, 1.0 / math.sqrt(d), mods)

                yield variant, name, launch


def _flash_attn_gluon_cases(dtypes, variant: str):
    # nvidia.hopper_gluon: its forward and dk/dv kernels are Gluon (one tile each, no
    # table); the rest of its backward is nvidia.hopper's, compiled with that variant.
    from portable_kernels.kernels import flash_attn as fa
    from portable_kernels_backends.nvidia.gluon import flash_attn_gluon as fg

    # Compiled on every Triton, also where the variant declines to run (TRITON_OK): a
    # release that breaks its Gluon shows here before anyone enables it there.
    for dtype in dtypes:
        for d in fa.TMA_HEAD_DIMS:
            for causal in (False, True):
                name = f"forward {_short(dtype)} D={d} {'causal' if causal else 'full'}"
                q = torch.empty(1, 2, 256, d, dtype=dtype)
                yield variant, name, (lambda q=q, causal=causal, d=d:
                                      fg.forward(q, q, q, causal, 1.0 / math.sqrt(d)))
                if d == 64:  # long key loops at D=64 take three consumer warpgroups
                    yield (variant, name.replace("forward", "forward, 3 consumers"),
                           lambda q=q, causal=causal: _three_consumers(fg, q, causal))
                # More tiles than an H200 has SMs: a persistent grid walks them (PERSISTENT;
                # two consumers only).
                wide = torch.empty(1, 64, 512, d, dtype=dtype)
                yield (variant, name.replace("forward", "forward, persistent"),
                       lambda q=wide, causal=causal, d=d:
                       fg.forward(q, q, q, causal, 1.0 / math.sqrt(d)))
                lse = torch.empty(1, 2, 256)
                for acc in (None, torch.empty(1, 2, 256, d)):  # with dq added up in it
                    yield (variant, name.replace("forward", "dk/dv" if acc is None else "dk/dv/dq"), (
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

    dtypes = _dtypes(device, quick)
    fp8 = fp8_dtypes(device, quick)
    names = selectable(host, device, "matmul")
    for variant in names:
        plan_list = plans(host, device, "matmul", variant)
        if variant == "nvidia.hopper_gluon":
            continue  # below: one tile, no table
        if quick:
            plan_list = (plan_list[:1]
                         + [p for p in plan_list if p.configs[0].kwargs.get("SPLIT_K", 1) > 1][:1]
                         + [p for p in plan_list if p.configs[0].kwargs.get("OPERAND_BYTES") == 1][:1])
        for plan in plan_list:
            cfg = plan.configs[0]
            # A table's fp8 configs (OPERAND_BYTES=1) with fp8 operands, b in both layouts:
            # column-major (a weight's transpose) takes the fp8 MMA, row-major converts
            # tiles to fp16. The generic table serves fp8 too (converted tiles).
            if cfg.kwargs.get("OPERAND_BYTES") == 1:
                cases = [(d, lay) for d in fp8 for lay in ("col", "row")]
            else:
                cases = [(d, "row") for d in dtypes]
                if variant == "generic" and not quick:
                    cases += [(d, "row") for d in fp8[:1]]
            for dtype, layout in cases:
                name = (f"{_label(cfg, ('BLOCK_SIZE_M', 'BLOCK_SIZE_N', 'BLOCK_SIZE_K'))} "
                        f"{_short(dtype)}" + (" b col-major" if layout == "col" else ""))
                a = torch.empty(512, 512, dtype=dtype)
                b = torch.empty(512, 512, dtype=dtype)
                b = b.t() if layout == "col" else b
                yield variant, name, (lambda plan=plan, a=a, b=b: mm.launch(plan, a, b))
            if cfg.kwargs.get("OPERAND_BYTES") != 1:
                # acc= (the fused linear cross-entropy's weight gradient): the epilogue
                # reads the old tile beside the fp32 accumulator.
                a, b, acc = (torch.empty(512, 512, dtype=dtypes[0]) for _ in range(3))
                name = f"{_label(cfg, ('BLOCK_SIZE_M', 'BLOCK_SIZE_N', 'BLOCK_SIZE_K'))} {_short(dtypes[0])} acc="
                yield variant, name, (lambda plan=plan, a=a, b=b, acc=acc: mm.launch(plan, a, b, acc=acc))
    if "nvidia.hopper_gluon" in names:
        # The Gluon kernel (one tile, no table), every operand layout; compiled on every
        # Triton, also where the variant declines to run (TRITON_OK).
        from portable_kernels_backends.nvidia.gluon import matmul_gluon as mg

        for dtype in dtypes:
            for a_col in (False, True):
                for b_col in (False, True):
                    a = torch.empty(512, 512, dtype=dtype)
                    b = torch.empty(512, 512, dtype=dtype)
                    a, b = (a.t() if a_col else a), (b.t() if b_col else b)
                    name = (f"{_short(dtype)} a {'col' if a_col else 'row'}-major, "
                            f"b {'col' if b_col else 'row'}-major")
                    out = torch.empty(512, 512, dtype=dtype)
                    yield "nvidia.hopper_gluon", name, (
                        lambda a=a, b=b, out=out: mg.matmul(a, b, out, device.num_sms))


def grouped_matmul_cases(host, device, quick: bool):
    from portable_kernels.kernels import grouped_matmul as gmm

    fp8 = fp8_dtypes(device, quick)
    for variant in selectable(host, device, "grouped_matmul"):
        plan_list = plans(host, device, "grouped_matmul", variant)
        if quick:
            plan_list = plan_list[:1]
        for plan in plan_list:
            # b row-major, and column-major (w.t() of (N, K) weights: descriptors of the
            # transposes, or vectorized loads along K; fp8 MMAs on the descriptor path).
            cases = [(d, lay) for d in fp8 for lay in ("col", "row")]
            if plan.configs[0].kwargs.get("OPERAND_BYTES") != 1:  # fp8-only tiles: fp8 only
                cases = [(torch.float16, "row"), (torch.float16, "col")] + cases
            for dtype, layout in cases:
                name = (f"{_label(plan.configs[0], ('BLOCK_SIZE_M', 'BLOCK_SIZE_N', 'BLOCK_SIZE_K'))} "
                        f"{_short(dtype)}" + (" b col-major" if layout == "col" else ""))
                la = [torch.empty(m, 256, dtype=dtype) for m in (64, 128, 256)]
                if layout == "col":
                    lb = [torch.empty(128, 256, dtype=dtype).t() for _ in la]
                else:
                    lb = [torch.empty(256, 128, dtype=dtype) for _ in la]
                yield variant, name, (lambda plan=plan, la=la, lb=lb: gmm.launch(plan, la, lb))


def flash_attn_with_kvcache_cases(host, device, quick: bool):
    """Decode over a paged and a contiguous cache with one new token appended, one split
    (the output written directly) and four (partials and the combine kernel), at the
    head dims decode serves; GQA group 4."""
    from portable_kernels.kernels import flash_attn_with_kvcache as kv

    for variant in selectable(host, device, kv.NAME):
        for plan in plans(host, device, kv.NAME, variant)[:1] if quick else plans(
                host, device, kv.NAME, variant):
            for dtype in _dtypes(device, quick) + ([] if quick else [torch.float32]):
                for d in (128,) if quick else (64, 128, 256):
                    for paged in (True, False):
                        for splits in (1, 4):
                            name = (f"{_label(plan.configs[0], ('BLOCK_M', 'BLOCK_N'))} "
                                    f"{_short(dtype)} D={d} {'paged' if paged else 'contiguous'} "
                                    f"splits={splits}")
                            q = torch.empty(2, 1, 8, d, dtype=dtype)
                            rows = (8, 16) if paged else (2, 64)
                            k_cache, v_cache = (torch.empty(*rows, 2, d, dtype=dtype)
                                                for _ in range(2))
                            k, v = (torch.empty(2, 1, 2, d, dtype=dtype) for _ in range(2))
                            table = (torch.arange(8, dtype=torch.int32).view(2, 4) if paged
                                     else None)
                            seqlens = torch.tensor([30, 40], dtype=torch.int32)

                            def launch(plan=plan, q=q, kc=k_cache, vc=v_cache, k=k, v=v,
                                       table=table, seqlens=seqlens, splits=splits):
                                kv.launch(plan, q, kc, vc, k, v, seqlens, table, causal=True,
                                          num_splits=splits)

                            yield variant, name, launch
def loss_cases(kernel: str):
    """cross_entropy's kernel in the pass combinations its launchers launch: for
    cross_entropy its forward (pass 1, then the reduction's kernel) and backward (pass 2); for fused_linear_cross_entropy
    both passes in one launch with the bias, in place. Each with every option off and on,
    over a 50000-class vocabulary (the chunk loop)."""
    options = ({}, {"label_smoothing": 0.1, "z_loss": 1e-4, "softcap": 30.0})

    def cases(host, device, quick: bool):
        for variant in selectable(host, device, kernel):
            plan_list = plans(host, device, kernel, variant)
            for plan in plan_list[:1] if quick else plan_list:
                for dtype in _dtypes(device, quick) + ([] if quick else [torch.float32]):
                    for opts in options:
                        name = (f"{_label(plan.configs[0], ('MAX_BLOCK_V', 'TILE'))} {_short(dtype)} "
                                f"8x50000{' options' if opts else ''}")
                        yield variant, name, (lambda plan=plan, dtype=dtype, opts=opts:
                                              _loss_passes(kernel, plan, dtype, opts))

    return cases


def _loss_passes(kernel: str, plan, dtype, opts) -> None:
    from portable_kernels.kernels import cross_entropy

    logits = torch.randn(8, 50000).to(dtype)
    target = torch.randint(50000, (8,))
    rows, lse, one = torch.empty(8), torch.empty(8), torch.ones(())
    if kernel == "cross_entropy":
        cross_entropy.run(plan, logits, target, loss=rows, lse=lse, **opts)
        cross_entropy.run(plan, logits, target, loss=rows, **opts)  # inference: no LSE kept
        if not opts:  # the reduction's kernel (it takes none of the options)
            cross_entropy.reduce(plan, rows, target, -100, "mean")
        cross_entropy.run(plan, logits, target, lse=lse, grad=torch.empty_like(logits), scale=one,
                          **opts)
    else:
        cross_entropy.run(plan, logits, target, loss=rows, grad=logits, scale=one,
                          bias=torch.randn(50000).to(dtype), **opts)


FAMILIES = {
    "vector_add": memory_bound_cases("vector_add"),
    "softmax": memory_bound_cases("softmax"),
    "dropout": memory_bound_cases("dropout"),
    "asin": memory_bound_cases("asin"),
    "layer_norm": memory_bound_cases("layer_norm"),
    "rms_norm": memory_bound_cases("rms_norm"),
    "swiglu": memory_bound_cases("swiglu"),
    "geglu": memory_bound_cases("geglu"),
    "matmul": matmul_cases,
    "grouped_matmul": grouped_matmul_cases,
    "flash_attn": flash_attn_cases,
    "flash_attn_varlen": flash_attn_varlen_cases,
    "rope": memory_bound_cases("rope"),
    "add_rms_norm": memory_bound_cases("add_rms_norm"),
    "kv_cache_write": memory_bound_cases("kv_cache_write"),
    "flash_attn_with_kvcache": flash_attn_with_kvcache_cases,
    "cross_entropy": loss_cases("cross_entropy"),
    "fused_linear_cross_entropy": loss_cases("fused_linear_cross_entropy"),
}


# --- running and reporting ----------------------------------------------------------------

def _coverage_order(first: list[list], rest: list[list]) -> list:
    """Round-robin over case lists: the first case of each list in ``first``, then of each
    in ``rest``, then the second cases likewise, ... so that a budget that stops early has
    compiled every list's first cases."""
    streams = first + rest
    return [s[i] for i in range(max(map(len, streams), default=0)) for s in streams if i < len(s)]


def compile_target(target: Target, families: list[str], quick: bool, log=print,
                   budget: float | None = None) -> tuple[list[Row], dict]:
    """Every case of ``families`` compiled for ``target``; (rows, what the profile selects,
    and with ``budget`` how many cases it left uncompiled).

    Cases compile in coverage order: one case of every family's selected variant, one of
    each other variant, then a second of each, and so on. With ``budget`` (seconds) no case
    starts after it is spent, so a cold Triton cache (a kernel changed) costs a bounded
    time and still compiles each family's first cases; rows come back in family order."""
    host = plugins.host()
    device = host.emulation_profile(target.profile)
    compiler = Compiler(device.shared_memory, target=target)
    real_run = jit.JITFunction.run

    def intercept(self, *a, grid, warmup, **kw):
        compiler.run(self, a, kw)

    start = time.time()
    choice = {f: selected(host, device, f) for f in families}
    selected_cases: list[list] = []  # per family, its selected variant's cases
    other_cases: list[list] = []     # per family and other variant, its cases
    keyed: list[tuple[tuple[int, int], Row]] = []
    left = 0
    jit.JITFunction.run = intercept
    try:
        for f, family in enumerate(families):
            by_variant: dict[str, list] = {}
            for i, (variant, name, launch) in enumerate(FAMILIES[family](host, device, quick)):
                # (f, i): the case's place in family order, the order rows come back in
                by_variant.setdefault(variant, []).append(((f, i), family, variant, name, launch))
            for variant, cases in by_variant.items():
                (selected_cases if variant == choice[family] else other_cases).append(cases)
        for place, family, variant, name, launch in _coverage_order(selected_cases, other_cases):
            if budget is not None and time.time() - start > budget:
                left += 1
                continue
            compiler.family, compiler.variant, compiler.case = family, variant, name
            before = len(compiler.rows)
            try:
                launch()
            except Exception as exc:  # a launcher failing before any kernel compiled
                first = (str(exc).splitlines() or [""])[0][:200]
                compiler.rows.append(Row(target.name, family, variant, name, "(launcher)",
                                         error=f"{type(exc).__name__}: {first}"))
            if len(compiler.rows) == before:
                compiler.rows.append(Row(target.name, family, variant, name, "(none)",
                                         error="no kernel was launched"))
            keyed += [(place, row) for row in compiler.rows[before:]]
            log(f"{time.time() - start:6.0f}s {target.name} {family}/{variant} {name}")
    finally:
        jit.JITFunction.run = real_run
    rows = [row for _, row in sorted(keyed, key=lambda kr: kr[0])]
    return rows, {"profile": target.profile, "name": device.name,
                  "shared_memory": device.shared_memory, "selected": choice,
                  "capabilities": sorted(device.capabilities), "uncompiled": left}


def markdown(rows: list[Row], header: str) -> str:
    lines = [header, "", "| target | family | variant | case | kernel | shared KB | registers | spills | |",
             "|:--|:--|:--|:--|:--|--:|--:|--:|:--|"]
    for r in rows:
        spill = "" if r.spill is None and r.scratch is None else (
            f"{r.spill or 0}" + (f" ({r.scratch} B scratch)" if r.scratch else ""))
        lines.append(f"| {r.target} | {r.family} | {r.variant} | {r.case} | {r.kernel} | "
                     f"{r.shared / 1024:.0f} | {'' if r.regs is None else r.regs} | {spill} | "
                     f"{r.error} |")
    return "\n".join(lines) + "\n"


def portability_table(rows: list[Row], targets: dict[str, dict], families: list[str]) -> str:
    """Two Markdown tables: per target its profile, limit and totals; then family x target,
    each cell the selected variant, the kernels compiled, the largest shared memory or LDS
    and how many kernels use local memory (spills, or stack)."""
    lines = ["| target | GPU | profile | shared memory / LDS limit | kernels | failed | with local memory |",
             "|:--|:--|:--|--:|--:|--:|--:|"]
    for name, meta in targets.items():
        mine = [r for r in rows if r.target == name]
        lines.append(f"| {name} | {TARGETS[name].gpu} | `{meta['profile']}` | "
                     f"{meta['shared_memory'] / 1024:.0f} KB | {len(mine)} | "
                     f"{sum(1 for r in mine if r.error)} | {sum(1 for r in mine if r.spills)} |")
    lines += ["", "| family | " + " | ".join(targets) + " |", "|:--|" + ":--|" * len(targets)]
    for family in families:
        cells = []
        for name, meta in targets.items():
            mine = [r for r in rows if r.target == name and r.family == family]
            if not mine:
                cells.append("")
                continue
            failed = sum(1 for r in mine if r.error)
            spills = sum(1 for r in mine if r.spills)
            cell = (f"`{meta['selected'][family]}` · {len(mine)}"
                    + (f" ({failed} failed)" if failed else "")
                    + f" · {max(r.shared for r in mine) / 1024:.0f} KB"
                    + (f" · {spills} local" if spills else ""))
            cells.append(cell)
        lines.append(f"| {family} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _compile_one(work: tuple) -> tuple[str, list[Row], dict, float]:
    """One target's ``compile_target`` (in a worker process where ``--jobs`` asks)."""
    global FORCED
    name, families, quick, verbose, budget, FORCED = work
    t0 = time.time()
    got, meta = compile_target(TARGETS[name], families, quick,
                               log=print if verbose else (lambda *_: None), budget=budget)
    return name, got, meta, time.time() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="fp16 (one fp8 format), one config per row class")
    parser.add_argument("--targets", default=",".join(TARGETS),
                        help=f"comma-separated, of {', '.join(TARGETS)}")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--markdown", default=None, help="write every kernel's row here")
    parser.add_argument("--json", default=None, help="write rows and selections here")
    parser.add_argument("--portability", default=None,
                        help="write the target x family summary table here")
    parser.add_argument("--verbose", action="store_true", help="print each case as it compiles")
    parser.add_argument("--jobs", type=int, default=0,
                        help="targets compiled at once, each in its own process (default: "
                        "one per CPU core)")
    parser.add_argument("--forced", action="store_true",
                        help="also the variants that run only when forced (priority below 0)")
    parser.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                        help="start no case after this many seconds, shared evenly by the "
                        "targets (cases in coverage order: each family's selected variant "
                        "first); the cases left are reported, not failed")
    args = parser.parse_args(argv)
    global FORCED
    FORCED = args.forced
    targets = [t for t in args.targets.split(",") if t]
    families = [f for f in args.families.split(",") if f]
    for bad in [t for t in targets if t not in TARGETS] + [f for f in families if f not in FAMILIES]:
        parser.error(f"unknown target or family {bad!r}; targets: {', '.join(TARGETS)}; "
                     f"families: {', '.join(FAMILIES)}")

    start = time.time()
    rows: list[Row] = []
    meta: dict[str, dict] = {}
    jobs = max(1, min(args.jobs or os.cpu_count() or 1, len(targets)))
    # Each worker takes about ceil(targets / jobs) targets in turn: each gets that share.
    share = None if args.budget is None else args.budget / math.ceil(len(targets) / jobs)
    work = [(name, families, args.quick, args.verbose, share, FORCED) for name in targets]
    if jobs == 1:
        results = map(_compile_one, work)
    else:
        # Forked before any kernel is compiled or tensor made here: nothing to inherit but
        # imports. A forked worker ends with os._exit, as this script does (see the end).
        pool = multiprocessing.get_context("fork").Pool(jobs)
        results = pool.imap(_compile_one, work)  # in target order, as each finishes
    for name, got, meta[name], seconds in results:
        rows += got
        bad = sum(1 for r in got if r.error)
        print(f"{name:8} {TARGETS[name].gpu:20} {len(got):4} kernels, {bad} failed, "
              f"largest shared {max((r.shared for r in got), default=0) / 1024:.0f} of "
              f"{meta[name]['shared_memory'] / 1024:.0f} KB, "
              f"{sum(1 for r in got if r.spills)} spill, {seconds:.0f} s"
              + (f", {meta[name]['uncompiled']} cases left by --budget" if meta[name]["uncompiled"]
                 else ""), flush=True)
    if jobs > 1:
        pool.close()
        pool.join()

    header = (f"compile matrix · triton {triton.__version__} · {len(rows)} kernels · "
              f"{'quick' if args.quick else 'full'}"
              + (f" · budget {args.budget:g} s" if args.budget is not None else "")
              + f" · targets {', '.join(targets)}")
    if args.markdown:
        Path(args.markdown).write_text(markdown(rows, header))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"triton": triton.__version__, "quick": args.quick, "targets": meta,
             "rows": [{k: v for k, v in asdict(r).items() if k != "ptx"} for r in rows]}, indent=1))
    if args.portability:
        Path(args.portability).write_text(portability_table(rows, meta, families))
    failed = [r for r in rows if r.error]
    print(f"\n{header}\ncompiled {len(rows) - len(failed)} of {len(rows)} in {time.time() - start:.0f} s")
    for r in rows:
        if r.spills and not r.error:
            print(f"  spills: {r.target} {r.family}/{r.variant} {r.case} {r.kernel}: "
                  f"{r.spill or 0} (scratch {r.scratch or 0} B)")
    for r in failed:
        print(f"FAILED {r.target} {r.family}/{r.variant} {r.case} {r.kernel}: {r.error}")
    left = sum(m["uncompiled"] for m in meta.values())
    if left:
        print(f"--budget {args.budget:g} s left {left} cases uncompiled: Triton's cache did not "
              f"hold them (a kernel or config changed); without --budget every case compiles")
    return 1 if failed else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # Skips interpreter teardown, where Triton's bindings print hundreds of nanobind
    # "leaked" lines that bury the summary.
    os._exit(code)
