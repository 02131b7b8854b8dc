"""The autotuner of a launch plan: Triton's ``Autotuner``, plus what a plan needs of it.

- **Near-ties are timed again before a pick is kept.** Triton times each config once, one
  after another. Two configs a few percent apart can then swap places from run to run (the
  GPU's clocks, what ran just before), and a pick that persists (``tuning_cache``) keeps the
  slower one on that machine for good. Seen on the H200: 128x14336x4096 fp16 tuned to a
  descriptor config (0.88x cuBLAS) in one run and to a pointer-load one (0.96x) in
  another; two later tunings timed them 37 and 35-36 us. So the configs within
  :data:`TIE_MARGIN` of the fastest (at most :data:`TIE_MAX`) are timed :data:`TIE_ROUNDS`
  more times, in turns, and the lowest median of all their timings wins.
- **New picks are handed to a store** (``tuning_cache`` writes them per device
  fingerprint), after the re-timing, so what persists is the confirmed pick.
- **One call at a time.** Triton's ``Autotuner.run`` keeps the launch's arguments in
  ``self.nargs`` and clears them when it is done, so two threads in it at once read each
  other's (seen on the H200: 7 of 8 threads calling kernels at once failed with
  "'NoneType' object is not a mapping"). Every plan's autotuner holds its own lock around
  ``run``; a tuned problem that launches its binary directly (``LaunchPlan.run_tuned``)
  does not enter it.

A plan turns the re-timing on for compiled kernels (``confirm_ties``); under the
interpreter a timing is meaningless and every config costs seconds.
"""
from __future__ import annotations

import statistics
import threading
from typing import Any, Callable

from triton.runtime.autotuner import Autotuner

#: Configs timed within this fraction of the fastest are timed again.
TIE_MARGIN = 0.05
#: At most this many (the fastest first).
TIE_MAX = 3
#: Further timings of each, in turns.
TIE_ROUNDS = 2


def _median(timing: Any) -> float:
    # Triton's _bench returns [median, 20th, 80th percentile] (quantiles), or a number.
    return float(timing[0] if isinstance(timing, (list, tuple)) else timing)


def adopt(tuner: Autotuner) -> "PlanAutotuner":
    """``tuner`` (from ``triton.autotune``) as a :class:`PlanAutotuner`, in place."""
    if not isinstance(tuner, PlanAutotuner):
        tuner.__class__ = PlanAutotuner
        tuner._run_lock = threading.RLock()
    return tuner


class PlanAutotuner(Autotuner):
    """An ``Autotuner`` (installed on one by :func:`adopt`) that runs one call at a time,
    re-times near-ties when ``confirm_ties`` is set and calls ``store(self)`` after tuning
    a new key."""

    confirm_ties: bool = False
    store: Callable[["PlanAutotuner"], None] | None = None
    _run_lock: Any

    def run(self, *args: Any, **kwargs: Any) -> Any:
        with self._run_lock:
            return self._run(*args, **kwargs)

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        before = len(self.cache)  # keys are only added, in order
        timings_before = getattr(self, "configs_timings", None)
        result = super().run(*args, **kwargs)
        if len(self.cache) == before:
            return result
        new = list(self.cache)[before:]
        timings = getattr(self, "configs_timings", None)
        # Only a key this call benchmarked (not one read from Triton's own disk cache).
        if self.confirm_ties and timings is not None and timings is not timings_before:
            for key in new:
                self._confirm(key, timings, args, kwargs)
        if self.store is not None:
            self.store(self)
        return result

    def _confirm(self, key: Any, timings: dict, args: tuple, kwargs: dict) -> None:
        ranked = sorted(timings, key=lambda c: _median(timings[c]))
        if not ranked or self.cache.get(key) is not ranked[0]:
            return
        best = _median(timings[ranked[0]])
        close = [c for c in ranked[:TIE_MAX] if _median(timings[c]) <= best * (1 + TIE_MARGIN)]
        if len(close) < 2:
            return
        samples = {c: [_median(timings[c])] for c in close}
        # _bench reads the launch's named arguments from self.nargs, which run() clears.
        self.nargs = dict(zip(self.arg_names, args))
        try:
            for _ in range(TIE_ROUNDS):
                for c in close:
                    samples[c].append(_median(self._bench(*args, config=c, **kwargs)))
        except (TypeError, AttributeError):
            # _bench and nargs are Triton internals (3.6); where a later release changed
            # them, the first pick stands rather than tuning failing.
            return
        finally:
            self.nargs = None
        pick = min(close, key=lambda c: statistics.median(samples[c]))
        self.cache[key] = pick
        self.best_config = pick
        self.configs_timings = {**timings, **{c: [statistics.median(s)] * 3 for c, s in samples.items()}}
