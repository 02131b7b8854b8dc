"""Plain-text tables for the CLI (no dependency beyond the standard library)."""
from __future__ import annotations

import shutil
from typing import Sequence


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], max_width: int | None = None) -> str:
    """Render ``rows`` under ``headers`` with aligned columns.

    The last column is truncated with an ellipsis when the table would be wider than the
    terminal (``max_width``), so long reasons never wrap the layout.
    """
    cells = [[str(c) for c in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    limit = max_width or shutil.get_terminal_size((100, 24)).columns
    fixed = sum(widths[:-1]) + 2 * (len(widths) - 1)
    if fixed + widths[-1] > limit and limit - fixed > 20:
        widths[-1] = limit - fixed
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
