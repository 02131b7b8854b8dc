"""Plain-text tables and lines for the CLI (no dependency beyond the standard library)."""
from __future__ import annotations

import shutil
import textwrap
from typing import Sequence

#: The widest the CLI's default output gets (a narrower terminal: its width). Whole texts
#: are in each command's ``--verbose`` or ``--json`` output.
WIDTH = 100


def width() -> int:
    """The width to fit: the terminal's, at most :data:`WIDTH`."""
    return min(WIDTH, shutil.get_terminal_size((WIDTH, 24)).columns)


def fill(text: str, indent: str = "", max_width: int | None = None) -> str:
    """``text`` wrapped to :func:`width` (or ``max_width``), continuation lines indented by
    ``indent`` plus two spaces."""
    return textwrap.fill(text, width=max_width or width(), initial_indent=indent,
                         subsequent_indent=indent + "  ", break_on_hyphens=False)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], max_width: int | None = None) -> str:
    """Render ``rows`` under ``headers`` with aligned columns, at most :func:`width` (or
    ``max_width``) characters a line.

    Cells are cut with an ellipsis where the table would be wider: the last column first
    (it holds the long texts: reasons, descriptions), down to 20 characters, then the widest
    of the middle columns, then the last again; the first two (what a row is: a kernel, a
    variant) only when nothing else is left. So long reasons never wrap the layout.
    """
    cells = [[str(c) for c in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    limit = max_width or width()
    excess = sum(widths) + 2 * (len(widths) - 1) - limit
    last = len(widths) - 1
    for columns, floor in (([last], 20), (range(2, last), 8), ([last], 8), (range(last), 4)):
        while excess > 0:
            narrowable = [i for i in columns if widths[i] > floor]
            if not narrowable:
                break
            widest = max(narrowable, key=lambda i: widths[i])
            widths[widest] -= 1
            excess -= 1
    lines = []
    for n, row in enumerate(cells):
        parts = []
        for i, cell in enumerate(row):
            if len(cell) > widths[i]:
                cell = cell[: widths[i] - 1] + "…"
            parts.append(cell.ljust(widths[i]))
        lines.append("  ".join(parts).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
