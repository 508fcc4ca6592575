"""Timing what a benchmark measures: warm-up calls, then the wall time of each timed call.

Every measurement runs its function `warmup` times, then times `reps` calls; the function
must block until its work is done (`jax.block_until_ready`, or plain host work), so a sample
is the wall time of finished work. Summaries are min / median / max (p99 only from 20
samples up); raw samples are kept beside them.
"""

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def timed(fn: Callable[[], Any], warmup: int, reps: int) -> list[float]:
    """Seconds of each of `reps` calls of `fn` (which must block until its work is done), after `warmup` calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return samples


def summary(values: list[float]) -> dict[str, float]:
    """min, median, max and n of samples; p99 from 20 samples up."""
    out = {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}
    if len(values) >= 20:
        out["p99"] = float(np.percentile(values, 99))
    return out
