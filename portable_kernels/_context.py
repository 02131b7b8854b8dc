"""The per-context selection state: emulation profile and forced variants.

Both live in one ContextVar holding a small hashable tuple, so that a kernel call reads
one variable and uses the value directly as part of its selection-cache key.
"""
from __future__ import annotations

import contextvars
from typing import NamedTuple


class SelectionContext(NamedTuple):
    #: profile name, "" for "emulation off even if PK_EMULATE is set", None for "as env"
    emulation: str | None = None
    #: sorted ((kernel, variant), ...) pairs forced by use_variant
    forced: tuple[tuple[str, str], ...] = ()


DEFAULT = SelectionContext()
current: contextvars.ContextVar[SelectionContext] = contextvars.ContextVar(
    "pk_selection", default=DEFAULT
)
