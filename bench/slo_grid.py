"""Goodput over a grid of SLOs, re-scored from the per-request records of one set of runs.

Each configuration (disaggregated, or colocated with one prefill chunk budget) replays the
same requests once per rate and repetition; every request's TTFT and TPOT are kept, so any
(TTFT SLO, TPOT SLO) pair is scored from the same records without running anything again.

Per SLO pair, per configuration and repetition, goodput is exactly what ``pdserve bench``
reports (:func:`pdserve.bench.replay.goodput.goodput`, DistServe, OSDI 2024): the highest
rate with at least ``target`` (90%) of the requests meeting both SLOs, interpolated linearly
between the last tested rate at or above the target and the first below it. Repetitions are
summarised by their median and range; the colocated baseline is the chunk budget with the
highest median goodput for that SLO pair (ties: the smaller spread, then the smaller budget),
so the baseline the disaggregated mode is compared with is the strongest one tested.

Everything here is pure (records in, numbers out): ``tests/test_goodput_scoring.py``.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pdserve.bench.replay.goodput import SLO, Goodput, attainment, goodput
from pdserve.bench.replay.records import RequestRecord

DISAGGREGATED = "disaggregated"
COLOCATED = "colocated"


@dataclass(frozen=True)
class Run:
    """One replay of the requests at one rate.

    Attributes:
        mode: :data:`DISAGGREGATED` or :data:`COLOCATED`.
        budget: the colocated workers' prefill chunk budget (``max_num_batched_tokens``, tokens
            per step); ``None`` for the disaggregated mode.
        rep: repetition index (0-based).
        rate: offered request rate, requests/s.
        records: every request of the replay, timed at the client.
    """

    mode: str
    budget: int | None
    rep: int
    rate: float
    records: tuple[RequestRecord, ...]


def slo_grid(ttft_slos: Iterable[float], tpot_slos: Iterable[float]) -> list[SLO]:
    """Every (TTFT, TPOT) pair, TTFT-major, in the order given (seconds, seconds per token).

    Raises:
        ValueError: an empty axis, a non-positive SLO, or a repeated value on an axis.
    """
    ttfts, tpots = [float(t) for t in ttft_slos], [float(t) for t in tpot_slos]
    for name, axis in (("TTFT", ttfts), ("TPOT", tpots)):
        if not axis or any(t <= 0 for t in axis) or len(set(axis)) != len(axis):
            raise ValueError(f"{name} SLOs must be distinct positive seconds, got {axis}")
    return [SLO(a, b) for a in ttfts for b in tpots]


def parse_floats(text: str) -> list[float]:
    """``"0.5,1,2"`` -> ``[0.5, 1.0, 2.0]`` (empty items skipped)."""
    return [float(x) for x in text.split(",") if x.strip()]


def config_goodput(runs: Sequence[Run], slo: SLO, target: float = 0.9) -> Goodput:
    """Goodput of one configuration and repetition: ``runs`` are its replays, one per rate.

    Raises:
        ValueError: no runs, runs of more than one configuration or repetition, or a rate twice.
    """
    if not runs:
        raise ValueError("no runs to score")
    if len({(r.mode, r.budget, r.rep) for r in runs}) != 1:
        raise ValueError("runs of several configurations or repetitions scored as one")
    if len({r.rate for r in runs}) != len(runs):
        raise ValueError(f"a rate replayed twice in one repetition: {sorted(r.rate for r in runs)}")
    return goodput([(r.rate, attainment(r.records, slo).both) for r in runs], target)


def median_spread(values: Sequence[float]) -> dict:
    """``{"median", "min", "max", "spread" (max - min), "values"}`` of repetitions' results.

    Raises:
        ValueError: no values.
    """
    if not values:
        raise ValueError("median of no values")
    vals = [float(v) for v in values]
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals),
            "spread": max(vals) - min(vals), "values": vals}


def best_budget(by_budget: dict[int, dict]) -> int:
    """The chunk budget whose :func:`median_spread` summary has the highest median goodput
    (ties: the smaller spread, then the smaller budget).

    Raises:
        ValueError: no budgets.
    """
    if not by_budget:
        raise ValueError("no colocated budgets to choose from")
    return min(by_budget, key=lambda b: (-by_budget[b]["median"], by_budget[b]["spread"], b))


def _groups(runs: Iterable[Run]) -> dict[tuple[str, int | None], dict[int, list[Run]]]:
    """(mode, budget) -> rep -> its runs."""
    out: dict[tuple[str, int | None], dict[int, list[Run]]] = {}
    for r in runs:
        out.setdefault((r.mode, r.budget), {}).setdefault(r.rep, []).append(r)
    return out


def _summary(reps: dict[int, list[Run]], slo: SLO, target: float) -> dict:
    goods = [config_goodput(reps[k], slo, target) for k in sorted(reps)]
    return {**median_spread([g.rate for g in goods]), "kinds": [g.kind for g in goods],
            "monotone": all(g.monotone for g in goods)}


def score(runs: Iterable[Run], slos: Sequence[SLO], target: float = 0.9) -> list[dict]:
    """One row per SLO pair (in ``slos`` order), goodputs in requests/s::

        {"ttft_slo_s", "tpot_slo_s",
         "disaggregated": {"median", "min", "max", "spread", "values", "kinds", "monotone"},
         "colocated": {budget: the same summary, ...},
         "best_budget": int, "best_colocated": the winning budget's summary,
         "ratio": disaggregated median / best colocated median (None when that is 0),
         "ratio_kind": :func:`ratio_kind`}

    ``kinds`` are the repetitions' :class:`Goodput` kinds: ``lower_bound`` means every tested
    rate met the target (the true goodput is higher), ``below_lowest`` that none did.

    Raises:
        ValueError: no disaggregated or no colocated runs, or a configuration scored as above.
    """
    groups = _groups(runs)
    disagg = groups.get((DISAGGREGATED, None))
    budgets = sorted(b for (mode, b) in groups if mode == COLOCATED and b is not None)
    if disagg is None or not budgets:
        raise ValueError(f"need disaggregated runs and colocated runs with a budget, got {sorted(groups, key=str)}")
    rows = []
    for slo in slos:
        d = _summary(disagg, slo, target)
        c = {b: _summary(groups[(COLOCATED, b)], slo, target) for b in budgets}
        best = best_budget(c)
        ratio = d["median"] / c[best]["median"] if c[best]["median"] > 0 else None
        rows.append({"ttft_slo_s": slo.ttft_s, "tpot_slo_s": slo.tpot_s, "disaggregated": d, "colocated": c,
                     "best_budget": best, "best_colocated": c[best], "ratio": ratio,
                     "ratio_kind": ratio_kind(d, c[best])})
    return rows


def ratio_kind(disagg: dict, colocated: dict) -> str:
    """What the ratio of two summaries' medians is, given their repetitions' goodput kinds:
    ``exact``, ``lower_bound`` (only the disaggregated side hit the highest rate tested, so the
    true ratio is higher), ``upper_bound`` (only the colocated side did) or ``unknown`` (both)."""
    d, c = "lower_bound" in disagg["kinds"], "lower_bound" in colocated["kinds"]
    return {(False, False): "exact", (True, False): "lower_bound", (False, True): "upper_bound"}.get((d, c), "unknown")


def format_table(rows: Sequence[dict]) -> str:
    """A Markdown table of :func:`score`'s rows: median goodput [min-max] per side, the budget that won."""
    lines = ["| TTFT SLO (s) | TPOT SLO (ms) | disaggregated (req/s) | best colocated (req/s) | budget | ratio |",
             "| ---: | ---: | --- | --- | ---: | ---: |"]
    for row in rows:
        d, c = row["disaggregated"], row["best_colocated"]
        mark = {"lower_bound": ">=", "upper_bound": "<=", "unknown": "?"}.get(row["ratio_kind"], "")
        ratio = "-" if row["ratio"] is None else f"{mark}{row['ratio']:.2f}x"
        lines.append(f"| {row['ttft_slo_s']:g} | {row['tpot_slo_s'] * 1e3:g} | {_cell(d)} | {_cell(c)} | "
                     f"{row['best_budget']} | {ratio} |")
    lines.append("\nmedian [min-max] over repetitions; >=: a repetition met the target at every rate tested (a "
                 "lower bound); ratio ?: both sides are lower bounds")
    return "\n".join(lines)


def _cell(s: dict) -> str:
    mark = ">=" if "lower_bound" in s["kinds"] else ""
    return f"{mark}{s['median']:.3g} [{s['min']:.3g}-{s['max']:.3g}]"


def runs_from_results(results: dict, mode: str, budget: int | None, rep: int) -> list[Run]:
    """The :class:`Run` s of one ``pdserve bench`` ``results.json`` (one per rate)."""
    return [Run(mode, budget, rep, float(run["rate"]), tuple(RequestRecord.from_dict(d) for d in run["records"]))
            for run in results["runs"]]
