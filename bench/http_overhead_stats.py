"""The statistics of ``bench/http_overhead.py``: nearest-rank quantiles, summaries of samples, and HTTP - gRPC
differences with 95% bootstrap intervals."""

from __future__ import annotations

import math
import random
import statistics


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank ``q`` quantile (as :func:`bench.load.percentiles`); NaN when empty."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def summary(values: list[float]) -> dict:
    return {"p50": quantile(values, 0.5), "p90": quantile(values, 0.9),
            "mean": statistics.fmean(values) if values else math.nan, "n": len(values)}


def bootstrap_ci(stat, samples: tuple[list[float], ...], iters: int, rng: random.Random) -> list[float]:
    """95% percentile-bootstrap interval of ``stat(*resampled)``, each sample resampled on its own."""
    draws = sorted(stat(*[rng.choices(s, k=len(s)) for s in samples]) for _ in range(iters))
    return [draws[int(0.025 * iters)], draws[min(iters - 1, int(0.975 * iters))]]


def difference(grpc_v: list[float], http_v: list[float], iters: int, seed: int, paired: bool) -> dict:
    """HTTP - gRPC of the medians and the p90s (bootstrap intervals); with ``paired`` (same prompt,
    back to back) also the median of the per-pair differences."""
    rng = random.Random(seed)
    out: dict = {}
    for name, q in (("p50", 0.5), ("p90", 0.9)):
        out[name] = quantile(http_v, q) - quantile(grpc_v, q)
        out[name + "_ci95"] = bootstrap_ci(lambda g, h, q=q: quantile(h, q) - quantile(g, q), (grpc_v, http_v),
                                           iters, rng)
    if paired:
        d = [h - g for g, h in zip(grpc_v, http_v)]
        out["paired_median"] = statistics.median(d)
        out["paired_median_ci95"] = bootstrap_ci(statistics.median, (d,), iters, rng)
    return out
