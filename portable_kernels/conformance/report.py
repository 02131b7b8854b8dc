"""Conformance reports: the JSON format, the kernel x variant matrix, Markdown and HTML, and
the cross-device matrix merged from several reports.

The JSON format is documented in docs/conformance-report.md; :func:`validate` checks it.
Everything here works on plain dicts loaded from JSON, so reports from other machines (and
other versions of this package with the same ``version``) merge without the kernels.
"""
from __future__ import annotations

import collections
import dataclasses
import datetime
import html
import json
import os
from typing import Any, Iterable, Sequence

__all__ = [
    "FORMAT",
    "MATRIX_FORMAT",
    "OUTCOMES",
    "VERSION",
    "Cell",
    "ReportError",
    "build",
    "cell",
    "load",
    "markdown",
    "merge",
    "merge_notes",
    "merged_html",
    "merged_markdown",
    "matrix_rows",
    "text_matrix",
    "validate",
    "write",
]

FORMAT = "portable-kernels-conformance"
MATRIX_FORMAT = "portable-kernels-conformance-matrix"
VERSION = 1
#: Every case ends in one of these; see docs/conformance-report.md.
OUTCOMES = ("pass", "fail", "error", "skip", "xfail", "xpass")

_TOP_KEYS = {
    "format": str, "version": int, "created": str, "duration_s": (int, float), "fingerprint": str,
    "device": (dict, type(None)), "torch_devices": list, "versions": dict, "plugins": list,
    "failed_plugins": list, "options": dict, "exitstatus": int, "summary": dict, "cases": list,
}
_CASE_KEYS = {
    "id": str, "kernel": str, "variant": str, "plugin": str, "dtype": str, "shape": str,
    "check": str, "outcome": str, "max_error": (int, float, type(None)),
    "error_ratio": (int, float, type(None)), "tolerance": (dict, type(None)),
    "seconds": (int, float, type(None)), "duration": (int, float, type(None)), "reason": str,
    "expected": (str, type(None)),
}
_VERSION_KEYS = ("portable_kernels", "triton", "torch", "python")
_SHORT_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64"}


class ReportError(ValueError):
    """A file is not a conformance report this version understands; the message says where."""


def _now(ts: float | None = None) -> str:
    when = datetime.datetime.fromtimestamp(ts, datetime.timezone.utc) if ts else datetime.datetime.now(
        datetime.timezone.utc)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


# --- building and checking --------------------------------------------------------------------

def summarize(cases: Iterable[dict]) -> dict:
    """Counts per outcome (every outcome present, zeros included) and the total."""
    counts = collections.Counter(c["outcome"] for c in cases)
    out = {o: counts.get(o, 0) for o in OUTCOMES}
    out["total"] = sum(counts.values())
    return out


def build(
    cases: Iterable[dict],
    env: dict,
    *,
    options: dict,
    started: float,
    finished: float,
    exitstatus: int,
    torch_devices: Sequence[str] = (),
) -> dict:
    """A report from case records (see ``harness.Case.record``) and ``harness.environment``."""
    ordered = sorted(cases, key=lambda c: (c["kernel"], c["variant"], c.get("index", 0), c["id"]))
    clean = [{k: v for k, v in c.items() if k != "index"} for c in ordered]
    device = env.get("device")
    return {
        "format": FORMAT,
        "version": VERSION,
        "created": _now(finished),
        "duration_s": round(finished - started, 3),
        "fingerprint": device["fingerprint"] if device else "unknown-device",
        "device": device,
        "device_error": env.get("device_error"),
        "torch_devices": sorted(set(torch_devices)) or ([env["torch_device"]] if env.get("torch_device") else []),
        "versions": env.get("versions", {}),
        "plugins": env.get("plugins", []),
        "failed_plugins": env.get("failed_plugins", []),
        "options": options,
        "exitstatus": int(exitstatus),
        "summary": summarize(clean),
        "cases": clean,
    }


def _check_fields(record: dict, kinds: dict, where: str) -> None:
    """Every key of ``kinds`` present in ``record`` with a value of its type."""
    for key, kind in kinds.items():
        if key not in record:
            raise ReportError(f"{where} lacks {key!r}")
        if not isinstance(record[key], kind):
            raise ReportError(f"{where}: {key!r} is a {type(record[key]).__name__}")


def validate(report: Any, where: str = "report") -> dict:
    """``report`` if it is a valid conformance report, else :class:`ReportError`."""
    if not isinstance(report, dict):
        raise ReportError(f"{where}: not a JSON object")
    if report.get("format") != FORMAT:
        raise ReportError(f"{where}: format is {report.get('format')!r}, not {FORMAT!r}")
    if report.get("version") != VERSION:
        raise ReportError(f"{where}: version {report.get('version')!r}; this tool reads version {VERSION}")
    _check_fields(report, _TOP_KEYS, where)
    for key in _VERSION_KEYS:
        if key not in report["versions"]:
            raise ReportError(f"{where}: versions lacks {key!r}")
    if report["device"] is not None and "fingerprint" not in report["device"]:
        raise ReportError(f"{where}: device lacks 'fingerprint'")
    for i, case in enumerate(report["cases"]):
        if not isinstance(case, dict):
            raise ReportError(f"{where}: cases[{i}] is not an object")
        _check_fields(case, _CASE_KEYS, f"{where}: cases[{i}] ({case.get('id', '?')})")
        if case["outcome"] not in OUTCOMES:
            raise ReportError(f"{where}: cases[{i}].outcome {case['outcome']!r} is not one of {OUTCOMES}")
    return report


def load(path: str | os.PathLike) -> dict:
    """Read and validate a report file."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ReportError(f"{path}: cannot read a report: {exc}") from None
    return validate(data, str(path))


def write(text: str, path: str | os.PathLike) -> None:
    """Write ``text`` to ``path`` atomically (a reader never sees half a report)."""
    path = os.fspath(path)
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def dumps(report: dict) -> str:
    return json.dumps(report, indent=1, sort_keys=False) + "\n"


# --- the matrix -----------------------------------------------------------------------------------

@dataclasses.dataclass
class Cell:
    """The cases of one kernel x variant on one device, summed up."""

    counts: dict
    worst: dict | None  # the case with the largest error relative to its tolerance
    seconds: float
    reason: str

    @property
    def status(self) -> str:
        """fail, xpass, xfail, pass, skip or none, in that precedence."""
        c = self.counts
        if c["fail"] or c["error"]:
            return "fail"
        if c["xpass"]:
            return "xpass"
        if c["xfail"]:
            return "xfail"
        if c["pass"]:
            return "pass"
        return "skip" if c["skip"] else "none"

    @property
    def label(self) -> str:
        c, status = self.counts, self.status
        ran = c["total"] - c["skip"]
        text = {
            "fail": f"FAIL {c['fail'] + c['error']}/{ran}",
            "xpass": f"XPASS {c['xpass']}/{ran}",
            "xfail": f"xfail {c['xfail']}/{ran}",
            "pass": f"pass {c['pass']}/{ran}",
            "skip": "skip",
            "none": "-",
        }[status]
        if c["skip"] and status not in ("skip", "none"):
            text += f" (+{c['skip']} skipped)"
        return text

    @property
    def max_error(self) -> str:
        w = self.worst
        if not w or w.get("max_error") is None:
            return "-"
        return f"{w['max_error']:.2e} ({w['error_ratio']:.2g}x)"

    @property
    def tolerance(self) -> str:
        w = self.worst
        if not w or not w.get("tolerance"):
            return "-"
        t = w["tolerance"]
        return f"{_SHORT_DTYPES.get(w['dtype'], w['dtype'])} atol={t['atol']:.3g} rtol={t['rtol']:.3g}"

    def to_dict(self) -> dict:
        return {"status": self.status, "label": self.label, "counts": self.counts,
                "max_error": self.max_error, "tolerance": self.tolerance,
                "seconds": round(self.seconds, 3), "reason": self.reason}


def cell(cases: Sequence[dict]) -> Cell:
    """Sum up the cases of one kernel x variant."""
    counts = summarize(cases)
    measured = [c for c in cases if c.get("error_ratio") is not None]
    worst = max(measured, key=lambda c: c["error_ratio"], default=None)

    def first(*outcomes: str) -> dict | None:
        return next((c for c in cases if c["outcome"] in outcomes), None)

    reason = ""
    bad = first("fail", "error")
    if bad:
        reason = f"{bad['dtype']}/{bad['shape']}/{bad['check']}: {bad['reason']}"
    elif first("xpass"):
        reason = f"expected to fail ({first('xpass')['expected']}) but passed"
    elif first("xfail"):
        reason = f"expected: {first('xfail')['expected']}"
    else:
        skips = collections.Counter(c["reason"] for c in cases if c["outcome"] == "skip")
        if skips:
            reason = "; ".join(f"{r}" + (f" ({n} cases)" if n > 1 and len(skips) > 1 else "")
                               for r, n in skips.most_common(3))
    seconds = sum(c.get("seconds") or 0.0 for c in cases)
    return Cell(counts, worst, seconds, reason)


def _groups(cases: Iterable[dict]) -> dict[tuple[str, str], list[dict]]:
    groups: dict[tuple[str, str], list[dict]] = {}
    for c in cases:
        groups.setdefault((c["kernel"], c["variant"]), []).append(c)
    return dict(sorted(groups.items()))


def matrix_rows(report: dict) -> list[dict]:
    """One row per kernel x variant of a report: kernel, variant, plugin and the cell."""
    rows = []
    for (kernel, variant), cases in _groups(report["cases"]).items():
        rows.append({"kernel": kernel, "variant": variant, "plugin": cases[0]["plugin"], "cell": cell(cases)})
    return rows


MATRIX_HEADERS = ("kernel", "variant", "result", "max error", "tolerance", "time", "reason")


def _row_cells(row: dict) -> tuple:
    c = row["cell"]
    return (row["kernel"], row["variant"], c.label, c.max_error, c.tolerance, f"{c.seconds:.2f}s", c.reason)


def _device_line(report: dict) -> str:
    d = report.get("device")
    if not d:
        return f"device unavailable: {report.get('device_error') or 'unknown'}"
    emu = f", emulating {d['emulated']!r}" if d.get("emulated") else ""
    line = f"{d['name']} ({d['vendor']} {d['arch']}{emu}) on {', '.join(report['torch_devices']) or '?'}"
    # The backend's record for the architecture before this run (a report from such a
    # device is itself the first run there).
    evidence = d.get("evidence")
    return line + (f"; kernels on {d['arch']} before this run: {evidence}" if evidence else "")


def _summary_line(summary: dict) -> str:
    return " · ".join(f"{summary[o]} {o}" for o in OUTCOMES if summary.get(o)) or "no cases"


def text_matrix(report: dict, width: int | None = None) -> str:
    """The kernel x variant matrix as a plain-text table, with a header and a summary, at
    most ``width`` columns (default: ``_table.width()``).

    Where the whole rows are wider than that, the tolerance and time columns go (the error
    column keeps its ratio to the tolerance; the JSON and Markdown reports hold both) and
    each reason becomes a numbered note under the table, wrapped to the width: the results
    a vendor publishes are never cut."""
    from .._table import fill, table
    from .._table import width as default_width

    limit = width or default_width()
    rows = [_row_cells(r) for r in matrix_rows(report)]
    body = table(MATRIX_HEADERS, rows, max_width=1_000_000) if rows else "(no cases)"
    legend: list[str] = []
    if rows and max(len(line) for line in body.splitlines()) > limit:
        notes: list[str] = []
        short = []
        for *cells, _tolerance, _seconds, reason in rows:
            if reason and reason not in notes:
                notes.append(reason)
            short.append((*cells, f"[{notes.index(reason) + 1}]" if reason else ""))
        body = table((*MATRIX_HEADERS[:4], "note"), short, max_width=limit)
        legend = ["", "max error: the largest error, in parentheses its ratio to the allowed one"]
        legend += [fill(f"[{i + 1}] {text}", max_width=limit) for i, text in enumerate(notes)]
    lines = [
        fill(f"Conformance on {_device_line(report)}", max_width=width),
        fill(f"fingerprint {report['fingerprint']}", max_width=width),
        "",
        body,
        *legend,
    ]
    summary = f"{_summary_line(report['summary'])} in {report['duration_s']:.1f}s"
    lines += ["", fill(summary, max_width=width)]
    return "\n".join(lines)


# --- Markdown -------------------------------------------------------------------------------------

def _md(text: Any) -> str:
    return " ".join(str(text).split()).replace("|", "\\|") if text not in (None, "") else ""


def _md_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(_md(c) for c in row) + " |" for row in rows]
    return lines


def _versions(v: dict) -> str:
    return (f"portable-kernels {v.get('portable_kernels', '?')} · triton {v.get('triton', '?')} · "
            f"torch {v.get('torch', '?')} · python {v.get('python', '?')}")


def markdown(report: dict) -> str:
    """A report as Markdown: where it ran, the matrix, and every case that did not pass."""
    opts = report.get("options", {})
    chosen = ", ".join(f"{k}={v}" for k, v in opts.items() if v not in (None, False, [], ""))
    lines = [
        f"# Conformance: {_device_line(report)}",
        "",
        f"- fingerprint: `{report['fingerprint']}`",
        f"- versions: {_versions(report['versions'])}",
        f"- run: {report['created']}, {report['duration_s']:.1f} s" + (f"; options: {chosen}" if chosen else ""),
        f"- plugins: {', '.join(p['name'] for p in report['plugins']) or 'none'}",
        f"- summary: {_summary_line(report['summary'])}",
    ]
    if report["failed_plugins"]:
        lines.append("- failed plugins: " + "; ".join(
            f"{f['plugin']} ({f['stage']}: {f['error']})" for f in report["failed_plugins"]))
    lines += ["", *_md_table(MATRIX_HEADERS, (_row_cells(r) for r in matrix_rows(report)))]
    notable = [c for c in report["cases"] if c["outcome"] in ("fail", "error", "xfail", "xpass")]
    if notable:
        lines += ["", "## Cases that did not pass", ""]
        lines += _md_table(
            ("case", "outcome", "max error", "error / allowed", "reason"),
            ((c["id"], c["outcome"], "-" if c["max_error"] is None else f"{c['max_error']:.3g}",
              "-" if c["error_ratio"] is None else f"{c['error_ratio']:.3g}",
              c["reason"] + (f" (expected: {c['expected']})" if c["expected"] else ""))
             for c in notable))
    skips = collections.Counter((c["kernel"], c["variant"], c["reason"]) for c in report["cases"]
                                if c["outcome"] == "skip")
    if skips:
        lines += ["", "## Skipped", ""]
        lines += _md_table(("kernel", "variant", "cases", "reason"),
                           ((k, v, n, r) for (k, v, r), n in sorted(skips.items())))
    return "\n".join(lines) + "\n"


# --- several devices ------------------------------------------------------------------------------

def merge(reports: Sequence[dict], names: Sequence[str] | None = None) -> dict:
    """One cross-device matrix from reports of several devices.

    Rows are kernel x variant (the union over the reports), one column per device
    fingerprint in the order first seen. Reports of the same fingerprint (two partial runs,
    two machines of one kind) are combined; a case present in both keeps the later one.
    A report equal to one already merged (the same file given twice) is dropped.
    ``names`` (e.g. the files read) say where each report came from: each device lists
    its ``reports``, and ``dropped`` the repeats; :func:`merge_notes` words both.
    """
    names = list(names) if names is not None else [f"report {i + 1}" for i in range(len(reports))]
    if len(names) != len(reports):
        raise ValueError(f"{len(reports)} reports but {len(names)} names")
    devices: dict[str, dict] = {}
    merged: list[tuple[dict, str]] = []
    dropped: list[dict] = []
    for r, name in zip(reports, names):
        validate(r, name)
        fp = r["fingerprint"]
        twin = next((seen for other, seen in merged if other == r), None)
        if twin is not None:
            dropped.append({"report": name, "repeats": twin, "fingerprint": fp})
            continue
        merged.append((r, name))
        entry = devices.setdefault(fp, {
            "fingerprint": fp, "device": r["device"], "versions": r["versions"],
            "created": r["created"], "torch_devices": [], "reports": [], "cases": {}})
        entry["reports"].append(name)
        entry["created"] = max(entry["created"], r["created"])
        entry["torch_devices"] = sorted(set(entry["torch_devices"]) | set(r["torch_devices"]))
        for c in r["cases"]:
            entry["cases"][c["id"]] = c
    keys = sorted({(c["kernel"], c["variant"]) for d in devices.values() for c in d["cases"].values()})
    rows = []
    for kernel, variant in keys:
        cells = {}
        for fp, d in devices.items():
            cases = [c for c in d["cases"].values() if c["kernel"] == kernel and c["variant"] == variant]
            cells[fp] = cell(cases).to_dict() if cases else None
        plugin = next(c["plugin"] for d in devices.values() for c in d["cases"].values()
                      if c["kernel"] == kernel and c["variant"] == variant)
        rows.append({"kernel": kernel, "variant": variant, "plugin": plugin, "cells": cells})
    return {
        "format": MATRIX_FORMAT,
        "version": VERSION,
        "created": _now(),
        "devices": [{k: v for k, v in d.items() if k != "cases"} | {"summary": summarize(d["cases"].values())}
                    for d in devices.values()],
        "dropped": dropped,
        "rows": rows,
    }


def merge_notes(merged: dict) -> list[str]:
    """What :func:`merge` did that its matrix does not show, one line each: reports dropped
    as repeats, and reports that share a column because they share a fingerprint."""
    notes = []
    for d in merged.get("dropped", []):
        if d["report"] == d["repeats"]:
            notes.append(f"warning: {d['report']} is given more than once: the repeat was dropped "
                         f"(device {d['fingerprint']})")
        else:
            notes.append(f"warning: {d['report']} repeats {d['repeats']} (same device {d['fingerprint']}, "
                         "same cases): dropped")
    for column, d in enumerate(merged["devices"], 1):
        names = d.get("reports") or []
        for name in names[1:]:
            notes.append(f"note: {name} is from the same device as {names[0]} ({d['fingerprint']}): "
                         f"combined into column [{column}]; where both hold a case, the later "
                         "report's result is kept")
    return notes


def _short(cell_dict: dict | None) -> str:
    if cell_dict is None:
        return "not run"
    text = cell_dict["label"]
    if cell_dict["status"] in ("fail", "skip", "xfail", "xpass") and cell_dict["reason"]:
        text += f": {cell_dict['reason']}"
    elif cell_dict["max_error"] not in ("-", None):
        text += f", err {cell_dict['max_error']}"
    return text


def _device_title(d: dict) -> str:
    dev = d.get("device")
    if not dev:
        return d["fingerprint"]
    # An emulated profile's report ran on another device: say when the backend's kernels
    # have not run on its architecture (compiled for it, or not even that).
    evidence = str(dev.get("evidence") or "")
    note = ""
    if dev.get("emulated") and evidence and not evidence.startswith("run: "):
        note = ", compiled, not run" if evidence.startswith("compiled for") else ", not run"
    return f"{dev['name']} ({dev['arch']}{note})"


def merged_text(merged: dict, width: int | None = None) -> str:
    """The cross-device matrix as a plain-text table, at most ``width`` columns (default:
    ``_table.width()``), then a line per device."""
    from .._table import fill, table

    fps = [d["fingerprint"] for d in merged["devices"]]
    headers = ["kernel", "variant"] + [f"[{i + 1}]" for i in range(len(fps))]
    rows = [[r["kernel"], r["variant"]] + [(r["cells"][fp] or {}).get("label", "not run") for fp in fps]
            for r in merged["rows"]]
    lines = [table(headers, rows, max_width=width), ""]
    lines += [fill(f"[{i + 1}] {fp}: {_summary_line(d['summary'])}", max_width=width)
              for i, (fp, d) in enumerate(zip(fps, merged["devices"]))]
    return "\n".join(lines)


def merged_markdown(merged: dict) -> str:
    """The cross-device matrix as Markdown: the matrix, then the devices."""
    fps = [d["fingerprint"] for d in merged["devices"]]
    lines = [
        "# Conformance across devices",
        "",
        f"Merged {merged['created']} from {len(fps)} device(s). Cells: result over the cases "
        "run (skipped cases counted apart), the largest error as a multiple of the allowed "
        "error, and the reason for anything but a pass.",
        "",
        *_md_table(["kernel", "variant", *[f"`{fp}`" for fp in fps]],
                   ([r["kernel"], r["variant"], *[_short(r["cells"][fp]) for fp in fps]] for r in merged["rows"])),
        "",
        "## Devices",
        "",
        *_md_table(("fingerprint", "device", "torch devices", "versions", "run", "summary"),
                   ((f"`{d['fingerprint']}`", _device_title(d), ", ".join(d["torch_devices"]),
                     _versions(d["versions"]), d["created"], _summary_line(d["summary"]))
                    for d in merged["devices"])),
    ]
    return "\n".join(lines) + "\n"


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
td.pass { background: #e6f4e6; } td.fail { background: #f9d6d5; font-weight: bold; }
td.skip, td.none { background: #f3f3f3; color: #666; } td.xfail { background: #fdf1d6; }
td.xpass { background: #dbe8fb; }
"""


def merged_html(merged: dict) -> str:
    """The cross-device matrix as a standalone HTML page (cells coloured by status)."""
    e = html.escape
    fps = [d["fingerprint"] for d in merged["devices"]]
    head = "".join(f"<th title='{e(fp)}'>{e(_device_title(d))}<br><small>{e(fp)}</small></th>"
                   for fp, d in zip(fps, merged["devices"]))
    body = []
    for r in merged["rows"]:
        tds = []
        for fp in fps:
            c = r["cells"][fp]
            status = c["status"] if c else "none"
            tip = e(c["reason"]) if c else ""
            tds.append(f"<td class='{status}' title='{tip}'>{e(_short(c))}</td>")
        body.append(f"<tr><td>{e(r['kernel'])}</td><td>{e(r['variant'])}</td>{''.join(tds)}</tr>")
    devices = "".join(
        f"<tr><td><code>{e(d['fingerprint'])}</code></td><td>{e(_device_title(d))}</td>"
        f"<td>{e(_versions(d['versions']))}</td><td>{e(d['created'])}</td>"
        f"<td>{e(_summary_line(d['summary']))}</td></tr>" for d in merged["devices"])
    return (
        "<!doctype html>\n<html><head><meta charset='utf-8'><title>Conformance across devices</title>"
        f"<style>{_CSS}</style></head><body>\n<h1>Conformance across devices</h1>\n"
        f"<p>Merged {e(merged['created'])}.</p>\n"
        f"<table><tr><th>kernel</th><th>variant</th>{head}</tr>\n" + "\n".join(body) + "</table>\n"
        "<h2>Devices</h2>\n<table><tr><th>fingerprint</th><th>device</th><th>versions</th><th>run</th>"
        f"<th>summary</th></tr>{devices}</table>\n</body></html>\n"
    )
