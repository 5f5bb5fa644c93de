"""Repeated timing with honest statistics.

Every figure of the suite is the median of several timed samples after warm-up runs; the spread (min, p10, p90,
max, coefficient of variation) and the CPU time other processes used meanwhile (:class:`.machine.LoadMeter`) are
kept with it. A sample is one call of ``fn``; ``units`` per call (e.g. graph nodes, tokens) divides the time.

Budgets: a measurement stops taking samples once ``max_seconds`` are spent (after ``min_reps`` samples), and a
single call longer than ``max_seconds`` is measured once and flagged, so slow configurations (the scalar reference
kernels on prefill shapes) cannot stall a run.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .machine import LoadMeter


def warm_page_cache(*paths, chunk: int = 8 << 20) -> dict:
    """Reads each file (or every file of a directory) through once, so that timed runs do not wait on the disk for
    weights they touch for the first time. Both engines map their weights: a decode step of a random-routing MoE
    meets experts no earlier step read, and on a cold page cache each costs a disk read (measured here: the routed
    experts of a bench-preset step at 10.5 ms instead of 8.4). Returns {"bytes", "seconds"}."""
    t0, done = time.perf_counter(), 0
    files = []
    for p in map(Path, paths):
        files += sorted(f for f in p.iterdir() if f.is_file()) if p.is_dir() else [p]
    buf = bytearray(chunk)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while n := fh.readinto(buf):
                done += n
    return {"bytes": done, "seconds": time.perf_counter() - t0}


@dataclass
class Timing:
    """Per-unit seconds of each sample and their statistics."""

    samples: list
    units: int = 1
    warmup: int = 0
    conditions: dict = field(default_factory=dict)
    truncated: bool = False  # fewer samples than asked for (budget)

    @property
    def median(self) -> float:
        return float(np.median(self.samples))

    def stats(self) -> dict:
        a = np.asarray(self.samples, dtype=np.float64)
        out = {"median_s": float(np.median(a)), "min_s": float(a.min()), "max_s": float(a.max()),
               "p10_s": float(np.percentile(a, 10)), "p90_s": float(np.percentile(a, 90)),
               "mean_s": float(a.mean()), "cv": float(a.std() / a.mean()) if a.mean() > 0 and len(a) > 1 else 0.0,
               "n": int(len(a)), "units_per_sample": self.units, "warmup": self.warmup}
        if self.truncated:
            out["truncated"] = True
        out["conditions"] = self.conditions
        return out


def measure(fn, *, units: int = 1, warmup: int = 1, reps: int = 5, min_reps: int = 3, max_seconds: float = 10.0,
            setup=None) -> Timing:
    """Times ``fn()`` (``setup(i)`` runs untimed before call i, e.g. to rotate inputs).

    Warm-up calls are not samples, except when one lasts more than 2 x ``max_seconds``: then it is the only sample
    (flagged ``truncated``). Samples stop after ``reps``, or once ``min_reps`` are taken and ``max_seconds`` spent, or
    when the next call would push the total past 2.5 x ``max_seconds`` (at least one sample is always taken)."""
    meter = LoadMeter()
    calls = 0
    for _ in range(warmup):
        if setup is not None:
            setup(calls)
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        calls += 1
        if dt > 2 * max_seconds:
            return Timing([dt / units], units, 0, meter.stop(), truncated=True)
    meter.start()
    samples = []
    spent = 0.0
    while len(samples) < reps:
        if setup is not None:
            setup(calls)
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        calls += 1
        samples.append(dt / units)
        spent += dt
        if len(samples) >= min_reps and spent > max_seconds:
            break
        if spent + dt > max_seconds * 2.5:
            break
    return Timing(samples, units, warmup, meter.stop(), truncated=len(samples) < min(reps, min_reps))


def alternating_rounds(fns: dict, repeats: int) -> dict:
    """Calls every function of ``fns`` once per round, ``repeats`` rounds, in an order reversed every other round;
    returns {name: [its return values]}. This machine's bandwidth drifts within minutes, so figures that are
    compared with each other (a verify step with a plain one, an option with native) are taken side by side."""
    values = {name: [] for name in fns}
    order = list(fns)
    for r in range(repeats):
        for name in order if r % 2 == 0 else order[::-1]:
            values[name].append(fns[name]())
    return values


def error_text(e: BaseException) -> str:
    """One line for a failed measurement: the exception's type and the last line of its message."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[-1] if text else ''}"


def fmt_time(s: float) -> str:
    if s is None or not math.isfinite(s):
        return "-"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


__all__ = ["Timing", "measure", "fmt_time"]
