"""Autotuning results that persist per device fingerprint, across processes.

Triton's own autotune disk cache skips configs that have a ``pre_hook`` (every config that
sets tensor-descriptor block shapes has one), so the library keeps its own: one JSON file per
device fingerprint under ``$PK_CACHE_DIR`` (default ``~/.cache/portable_kernels``), mapping
``kernel/variant/triton-function`` and the autotune key to the chosen config. A new process
pre-fills each autotuner from it and so skips benchmarking; ``portable-kernels tune``
fills it ahead of time. ``PK_TUNING_CACHE=0`` turns it off.

A file that cannot be read, or holds something other than ``{entry: {key: config}}``, costs
only its results: what is malformed is ignored (and logged once) and tuning runs again.
Processes storing at once take a lock on a sibling ``.lock`` file where ``fcntl`` exists.
"""
from __future__ import annotations

import ast
import contextlib
import json
import logging
import os
import re
import tempfile
import threading
from pathlib import Path
from typing import Any

from triton.runtime.autotuner import Autotuner

from ._autotuner import adopt

try:
    import fcntl
except ImportError:  # not POSIX: stores are still atomic, but concurrent ones may lose a key
    fcntl = None

__all__ = ["cache_dir", "enabled", "path_for", "attach"]

_LOCK = threading.Lock()
_log = logging.getLogger("portable_kernels")
#: (what, path) pairs already logged: a broken file is met by every autotuner and store.
_LOGGED: set[tuple[str, str]] = set()


def _warn_once(what: str, path: Path, message: str, *args: Any) -> None:
    if (what, str(path)) not in _LOGGED:
        _LOGGED.add((what, str(path)))
        _log.warning(message, *args)


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


def _read(path: Path) -> dict[str, dict[str, str]]:
    """The file's entries, each ``{key text: config id}``; whatever is not shaped so is
    left out."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        _warn_once("read", path, "ignoring the tuning cache %s, which cannot be read: %s", path, exc)
        return {}
    if not isinstance(data, dict):
        _warn_once("shape", path, "ignoring the tuning cache %s: it holds a JSON %s, not an object",
                   path, type(data).__name__)
        return {}
    entries: dict[str, dict[str, str]] = {}
    malformed = 0
    for entry, results in data.items():
        if not isinstance(results, dict):
            malformed += 1
            continue
        entries[entry] = {k: v for k, v in results.items() if isinstance(v, str)}
        malformed += len(results) - len(entries[entry])
    if malformed:
        _warn_once("shape", path, "ignoring %d malformed entries of the tuning cache %s", malformed, path)
    return entries


@contextlib.contextmanager
def _interprocess_lock(path: Path):
    if fcntl is None:
        yield
        return
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _write(path: Path, entry: str, results: dict[str, str]) -> None:
    """Merge ``results`` into ``entry`` of the file (other processes may have added more)."""
    with _LOCK:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Without it, two processes that read the same file each replace it with their
        # own merge, and the first one's keys are lost.
        with _interprocess_lock(path):
            data = _read(path)
            data.setdefault(entry, {}).update(results)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(data, f, indent=1, sort_keys=True)
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise


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
        except (ValueError, SyntaxError, TypeError):
            continue  # not a key this library wrote (TypeError: unhashable)

    def store(t: Autotuner) -> None:
        try:
            _write(path, entry, {repr(k): config_id(c) for k, c in t.cache.items()})
        except OSError as exc:
            # A read-only home: tuning still works, it is just not remembered.
            _warn_once("store", path, "cannot store tuning results in %s: %s", path, exc)

    tuner = adopt(tuner)
    tuner.store = store
    return tuner
