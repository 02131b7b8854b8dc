"""Autotuning results that persist per device fingerprint, across processes.

Triton's own autotune disk cache skips configs that have a ``pre_hook`` (every config that
sets tensor-descriptor block shapes has one), so the library keeps its own: one JSON file per
device fingerprint under ``$PK_CACHE_DIR`` (default ``~/.cache/portable_kernels``), mapping
``kernel/variant/triton-function`` and the autotune key to the chosen config. A new process
pre-fills each autotuner from it and so skips benchmarking; ``portable-kernels tune``
fills it ahead of time. ``PK_TUNING_CACHE=0`` turns it off.
"""
from __future__ import annotations

import ast
import json
import logging
import os
import re
import tempfile
import threading
from pathlib import Path
from typing import Any

from triton.runtime.autotuner import Autotuner

from ._autotuner import PlanAutotuner

__all__ = ["cache_dir", "enabled", "path_for", "attach"]

_LOCK = threading.Lock()


def enabled() -> bool:
    """Whether tuning results are read from and written to disk."""
    return os.environ.get("PK_TUNING_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    """Where the files live: ``$PK_CACHE_DIR`` or ``~/.cache/portable_kernels``."""
    return Path(os.environ.get("PK_CACHE_DIR") or Path.home() / ".cache" / "portable_kernels")


def path_for(fingerprint: str) -> Path:
    """The file holding the results of the device with ``fingerprint``."""
    return cache_dir() / f"tuning-{re.sub(r'[^A-Za-z0-9_.-]', '_', fingerprint)}.json"


def config_id(config: Any) -> str:
    """A stable text identity of a ``triton.Config`` (its kwargs and launch options)."""
    fields = {
        "kwargs": {k: repr(v) for k, v in sorted(config.kwargs.items())},
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
        "num_ctas": getattr(config, "num_ctas", 1),
        "maxnreg": getattr(config, "maxnreg", None),
    }
    return json.dumps(fields, sort_keys=True)


def _read(path: Path) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(path: Path, entry: str, results: dict[str, str]) -> None:
    """Merge ``results`` into ``entry`` of the file (other processes may have added more)."""
    with _LOCK:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read(path)
        data.setdefault(entry, {}).update(results)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)


def attach(tuner: Any, fingerprint: str, entry: str) -> Any:
    """Pre-fill ``tuner`` (from ``triton.autotune``) with stored results and make it store
    new ones. A tuner with a single config, or with persistence off, is returned as is."""
    if not enabled() or not isinstance(tuner, Autotuner) or len(tuner.configs) < 2:
        return tuner
    path = path_for(fingerprint)
    by_id = {config_id(c): c for c in tuner.configs}
    for key_text, cid in _read(path).get(entry, {}).items():
        config = by_id.get(cid)
        if config is None:
            continue  # the configs changed since: tune again
        try:
            tuner.cache[ast.literal_eval(key_text)] = config
        except (ValueError, SyntaxError):
            continue

    def store(t: Autotuner) -> None:
        try:
            _write(path, entry, {repr(k): config_id(c) for k, c in t.cache.items()})
        except OSError as exc:
            # A read-only home: tuning still works, it is just not remembered.
            logging.getLogger("portable_kernels").warning("cannot store tuning results in %s: %s", path, exc)

    if not isinstance(tuner, PlanAutotuner):
        tuner.__class__ = PlanAutotuner
    tuner.store = store
    return tuner
