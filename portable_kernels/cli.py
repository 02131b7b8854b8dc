"""The ``portable-kernels`` command: what this machine runs, and why.

    portable-kernels info [--device DEV] [--verbose] [--json]
    portable-kernels list [--verbose] [--json]
    portable-kernels explain KERNEL [--device DEV] [--verbose] [--json]

Subcommands of other parts of the library (the conformance suite, tuning) register
themselves in ``SUBCOMMANDS`` below. The CLI owns the terminal: library code never prints.
By default every line fits 100 columns (``_table.WIDTH``; a narrower terminal: its width),
long texts cut in tables; ``--verbose`` prints them whole (wrapped), ``--json`` all of it.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Callable

import torch
import triton

from . import __version__, _direct, dispatch, plugins
from ._table import fill, table
from .device import CAPABILITIES
from .errors import DeviceError, PortableKernelsError


def _device_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", default=None,
        help="torch device to describe, e.g. cuda:0 or cpu (default: current GPU, else cpu)",
    )


def _json_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _verbose_arg(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--verbose", action="store_true",
                        help=f"{what} in full, wrapped (by default cut to fit 100 columns)")


def _device(args: argparse.Namespace) -> torch.device | None:
    """The ``--device`` argument resolved once (the default included), so that every part
    of a command describes the same device; ``None`` after printing why it is not one."""
    try:
        return dispatch._resolve_device(args.device)
    except DeviceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None


def _kernel_rows(device: torch.device) -> list[dict]:
    rows = []
    for name in dispatch.list_kernels():
        try:
            sel = dispatch.explain(name, device=device)
            rows.append({"kernel": name, "variant": sel.variant, "reason": sel.reason,
                         "runnable": dispatch.list_variants(name, device)})
        except PortableKernelsError as exc:
            rows.append({"kernel": name, "variant": None, "reason": str(exc), "runnable": []})
    return rows


def _capability_heading(info) -> str:
    if info.emulated:
        return f"Capabilities of the emulated {info.emulated!r} profile (selection sees these):"
    if info.has("interpreter"):
        # The interpreter executes kernels with numpy: these words are what it emulates in
        # software, and say nothing of the CPU's own instruction set.
        return "Capabilities (what Triton's interpreter emulates in software, not features of this CPU):"
    return "Capabilities (of the hardware, as Triton compiles for it):"


def cmd_info(args: argparse.Namespace) -> int:
    device = _device(args)
    if device is None:
        return 2
    host = plugins.host()
    try:
        info = dispatch.device_info(device)
    except PortableKernelsError as exc:
        info = None
        device_error = str(exc)
    out: dict = {
        "version": __version__,
        "triton": triton.__version__,
        "torch": torch.__version__,
        "plugins": [{"name": n, "source": host.sources.get(n, "")} for n in host.plugin_names()],
        # After detection: a backend that failed there is listed too.
        "failed_plugins": [f.to_dict() for f in host.failures],
        "emulation_profiles": sorted(host.profiles),
    }
    if info is None:
        out["device_error"] = device_error
    out["device"] = info.to_dict() if info else None
    if info is not None and not info.emulated:
        binary = host.call("pk_binary_launcher", firstresult=True, device=info)
        out["launches"] = _direct.describe(info.vendor, info.has("interpreter"), binary)
    out["kernels"] = _kernel_rows(device) if info else []
    # Again: a variant whose priority or accepts failed during selection is listed too.
    out["failed_plugins"] = [f.to_dict() for f in host.failures]
    if args.json:
        print(json.dumps(out, indent=2))
        return 0 if info else 1

    print(fill(f"portable-kernels {__version__} · triton {triton.__version__} · torch {torch.__version__}"))
    print()
    if info is None:
        print(fill(f"Device: unavailable: {out['device_error']}"))
    else:
        emu = f" [emulating {info.emulated!r}; kernels run on the real device]" if info.emulated else ""
        print(fill(f"Device: {info.name} ({info.vendor} {info.arch}){emu}"))
        if info.has("interpreter"):
            # num_sms counts CPU cores here, and the interpreter has no shared memory to size.
            print(fill(f"kernels run in Triton's interpreter on {info.num_sms} CPU core(s) · "
                       f"warp size {info.warp_size} · triton {info.triton_version}", "  "))
        else:
            print(fill(f"warp size {info.warp_size} · {info.num_sms} SMs/CUs · shared memory "
                       f"{info.shared_memory} B/program · triton {info.triton_version}", "  "))
        print(fill(f"fingerprint {info.fingerprint}", "  "))
        if "launches" in out:
            print(fill(f"launches: {out['launches']}", "  "))
        if info.evidence:
            print(fill(f"kernels on {info.arch}: {info.evidence}", "  "))
        print(fill(_capability_heading(info)))
        print(table(["capability", "meaning"],
                    [(c, CAPABILITIES.get(c, "")) for c in sorted(info.capabilities)]))
    print()
    print("Plugins" + ("" if host.autoload else " (entry-point autoload off: PK_DISABLE_PLUGIN_AUTOLOAD)") + ":")
    print(table(["plugin", "source"], [(p["name"], p["source"]) for p in out["plugins"]]) if out["plugins"] else "  none")
    print(fill(f"Emulation profiles: {', '.join(out['emulation_profiles']) or 'none'}"))
    if host.failures:
        print()
        print("Failed plugins (skipped; a failing variant callback sets aside only that variant):")
        if args.verbose:
            for f in host.failures:
                print(fill(f"{f.plugin} ({f.stage}): {f.error}", "  "))
        else:
            print(table(["plugin", "stage", "error"], [(f.plugin, f.stage, f.error) for f in host.failures]))
    if info is not None and args.verbose:
        print()
        print("Selection (portable-kernels explain KERNEL: why each other variant was passed over):")
        for r in out["kernels"]:
            print(fill(f"{r['kernel']}: {r['variant'] or '-'}: {r['reason']}", "  "))
            print(fill(f"runnable here, best first: {', '.join(r['runnable']) or 'none'}", "    "))
    elif info is not None:
        # Two tables, each with its long column last (the only one the table truncates),
        # so that both fit a terminal.
        print()
        print("Selection (portable-kernels explain KERNEL: why each other variant was passed over):")
        print(table(["kernel", "variant", "why"],
                    [(r["kernel"], r["variant"] or "-", r["reason"]) for r in out["kernels"]]))
        print()
        print("Runnable here (requirements met), best first:")
        print(table(["kernel", "variants"],
                    [(r["kernel"], ", ".join(r["runnable"]) or "none") for r in out["kernels"]]))
        print()
        print("Whole reasons and lists: portable-kernels info --verbose (or --json).")
    return 0 if info else 1


def cmd_list(args: argparse.Namespace) -> int:
    registry = plugins.host().registry
    kernels = []
    for name in dispatch.list_kernels():
        spec = registry.kernels[name]
        kernels.append({
            "kernel": name,
            "signature": f"{name}{spec.signature}",
            "summary": spec.summary,
            "variants": [
                {"name": v.name, "plugin": v.plugin, "requires": sorted(v.requires),
                 "switches": dict(v.switches), "description": v.description}
                for v in sorted(registry.variants[name].values(), key=lambda v: v.name)
            ],
        })
    if args.json:
        print(json.dumps(kernels, indent=2, default=str))
        return 0
    if args.verbose:  # every signature and technique in full, wrapped
        for k in kernels:
            print(fill(k["signature"]))
            print(fill(k["summary"], "  "))
            for v in k["variants"] or [{"name": "-", "plugin": "-", "requires": [], "description": "no variants registered"}]:
                print(fill(f"{v['name']} [{v['plugin']}] requires {', '.join(v['requires']) or 'nothing'}",
                           "  "))
                print(fill(v["description"], "    "))
            print()
        return 0
    rows = []
    for k in kernels:
        for i, v in enumerate(k["variants"]):
            # The catalog's own variants: "catalog" (the table fits 100 columns).
            plugin = v["plugin"].removeprefix("portable_kernels.")
            rows.append((k["kernel"] if i == 0 else "", v["name"], plugin, ", ".join(v["requires"]) or "-"))
        if not k["variants"]:
            rows.append((k["kernel"], "-", "-", "no variants registered"))
    print(table(["kernel", "variant", "plugin", "requires"], rows))
    print("\nSignatures and each variant's technique: portable-kernels list --verbose (or --json).")
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    device = _device(args)
    if device is None:
        return 2
    try:
        sel = dispatch.explain(args.kernel, device=device)
    except KeyError as exc:
        print(f"error: {exc.args[0]}", file=sys.stderr)
        return 2
    except PortableKernelsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(sel.to_dict(), indent=2, default=str))
        return 0
    dev = sel.device
    where = f"{dev.name} ({dev.vendor} {dev.arch})"
    if dev.emulated:
        where += f", emulated as {dev.emulated!r}; kernels run on {sel.executor.name}"
    print(fill(f"{sel.kernel} on {where}"))
    print(fill(f"chosen: {sel.variant}: {sel.reason}"))
    if dev.evidence:
        print(fill(f"kernels on {dev.arch}: {dev.evidence}"))
    print(fill("(no call arguments given: per-problem predicates, such as alignment, are not "
               "checked)"))
    print()
    status = ["chosen" if i == 0 else ("runnable" if v.runnable else "rejected")
              for i, v in enumerate(sel.verdicts)]
    if args.verbose:
        for v, st in zip(sel.verdicts, status):
            print(fill(f"{v.name} [{v.plugin}] priority {v.priority}, {st}: {v.reason}"))
        return 0
    print(table(["variant", "plugin", "priority", "status", "reason"],
                [(v.name, v.plugin, v.priority, st, v.reason) for v, st in zip(sel.verdicts, status)]))
    print()
    print("Whole reasons: portable-kernels explain KERNEL --verbose (or --json).")
    return 0


#: name -> (help, configure(parser), run(args) -> exit code). Other modules add entries.
SUBCOMMANDS: dict[str, tuple[str, Callable, Callable]] = {
    "info": ("the device, its capabilities, plugins, and the variant each kernel would run",
             lambda p: (_device_arg(p), _verbose_arg(p, "reasons and runnable variants"),
                        _json_arg(p)), cmd_info),
    "list": ("every kernel and its registered variants",
             lambda p: (_json_arg(p), _verbose_arg(p, "signatures and techniques")), cmd_list),
    "explain": ("which variant of KERNEL runs here and why the others do not",
                lambda p: (p.add_argument("kernel"), _device_arg(p),
                           _verbose_arg(p, "every variant's reason"), _json_arg(p)),
                cmd_explain),
}


#: Modules that add subcommands: each has ``add_subcommands(SUBCOMMANDS)``.
EXTENSIONS: tuple[str, ...] = ("portable_kernels.tune", "portable_kernels.conformance.cli")


def _load_extensions() -> None:
    for name in EXTENSIONS:
        importlib.import_module(name).add_subcommands(SUBCOMMANDS)


def build_parser() -> argparse.ArgumentParser:
    _load_extensions()
    parser = argparse.ArgumentParser(
        prog="portable-kernels",
        description="Triton kernels written once; the best variant for every device.",
        epilog="Environment: PK_EMULATE=<profile> (h100, a100, mi300x, bi150, ...), "
        "PK_VARIANT=kernel=variant,..., PK_DISABLE_PLUGIN_AUTOLOAD=1, PK_PLUGINS=mod,..., "
        "PK_INTERPRET=1.",
    )
    parser.add_argument("--version", action="version", version=f"portable-kernels {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, configure, run) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        configure(p)
        p.set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.run(args) or 0)
    except BrokenPipeError:  # `portable-kernels info | head`: the reader left; not an error
        sys.stderr.close()
        return 0
    except KeyError as exc:
        print(f"error: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    except (PortableKernelsError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
