"""SLO attainment and goodput.

Goodput follows DistServe (Zhong et al., "DistServe: Disaggregating Prefill and Decoding
for Goodput-optimized Large Language Model Serving", OSDI 2024): the highest request rate
(requests/s) at which the SLO attainment (the fraction of requests meeting both the TTFT
and the TPOT SLO) stays at or above a target, 90% by default. It is read off a sweep of
rates, each a separate replay of the same requests:

- sorted by rate, find the first rate whose attainment is below the target; goodput is the
  linear interpolation between it and the rate before it (the last one at or above the
  target). Rates after that first drop are not used (a noisy recovery above the target
  is not trusted; ``monotone`` says whether there was one);
- every rate at or above the target: goodput is the highest rate tested, a lower bound
  (``kind = "lower_bound"``);
- already the lowest rate below the target: goodput is 0, and the true value is below
  the lowest rate tested (``kind = "below_lowest"``; nothing is extrapolated).

A request meets the SLO when it finished (status OK), its TTFT <= ``ttft_s`` and its mean
TPOT <= ``tpot_s``; a request with a single output token has no TPOT and meets the TPOT SLO.
Failed and unfinished requests count in the denominator and meet neither SLO.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from pdserve.bench.replay.records import RequestRecord


@dataclass(frozen=True)
class SLO:
    """Latency objectives in seconds: time to first token and mean time per output token."""

    ttft_s: float
    tpot_s: float


@dataclass(frozen=True)
class Attainment:
    """Fractions (0..1) of ``n`` requests meeting both SLOs, the TTFT SLO only, the TPOT SLO only;
    ``ok`` requests finished without error."""

    n: int
    ok: int
    both: float
    ttft: float
    tpot: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Goodput:
    """Goodput in requests/s and how it was found.

    Attributes:
        rate: goodput (requests/s).
        kind: ``interpolated``, ``lower_bound`` (every rate met the target: the highest
            tested) or ``below_lowest`` (no rate met it: 0, true value below the lowest).
        target: the attainment target (0..1).
        tested: (lowest, highest) rate tested, requests/s.
        bracket: the two (rate, attainment) points interpolated between, if any.
        monotone: False when a rate after the first drop is back at or above the target.
    """

    rate: float
    kind: str
    target: float
    tested: tuple[float, float]
    bracket: tuple[tuple[float, float], tuple[float, float]] | None = None
    monotone: bool = True

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        if self.kind == "lower_bound":
            return f">= {self.rate:.3g} req/s (every rate tested met {self.target:.0%}; a lower bound)"
        if self.kind == "below_lowest":
            return f"< {self.tested[0]:.3g} req/s (no rate tested met {self.target:.0%}; reported as 0)"
        return f"{self.rate:.3g} req/s (interpolated at {self.target:.0%} attainment)"


def meets(rec: RequestRecord, slo: SLO) -> tuple[bool, bool]:
    """(TTFT SLO met, TPOT SLO met) for one request."""
    if not rec.ok or rec.ttft_s is None:
        return False, False
    return rec.ttft_s <= slo.ttft_s, rec.tpot_s is None or rec.tpot_s <= slo.tpot_s


def attainment(records: Iterable[RequestRecord], slo: SLO) -> Attainment:
    """SLO attainment of a replay's records (all zeros for no records)."""
    flags = [(rec.ok, *meets(rec, slo)) for rec in records]
    n = len(flags)
    if n == 0:
        return Attainment(0, 0, 0.0, 0.0, 0.0)
    return Attainment(n, sum(f[0] for f in flags), sum(f[1] and f[2] for f in flags) / n,
                      sum(f[1] for f in flags) / n, sum(f[2] for f in flags) / n)


def goodput(points: Sequence[tuple[float, float]], target: float = 0.9) -> Goodput:
    """Goodput from ``(rate requests/s, attainment 0..1)`` points (see the module docstring).

    Raises:
        ValueError: no points.
    """
    if not points:
        raise ValueError("goodput needs at least one (rate, attainment) point")
    pts = sorted((float(r), float(a)) for r, a in points)
    below = next((i for i, (_, a) in enumerate(pts) if a < target), None)
    tested = (pts[0][0], pts[-1][0])
    if below is None:
        return Goodput(pts[-1][0], "lower_bound", target, tested)
    monotone = all(a < target for _, a in pts[below:])
    if below == 0:
        return Goodput(0.0, "below_lowest", target, tested, None, monotone)
    (r0, a0), (r1, a1) = pts[below - 1], pts[below]
    rate = r0 + (a0 - target) * (r1 - r0) / (a0 - a1)
    return Goodput(rate, "interpolated", target, tested, ((r0, a0), (r1, a1)), monotone)
