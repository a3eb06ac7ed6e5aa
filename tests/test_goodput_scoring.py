"""Goodput over an SLO grid (bench/slo_grid.py): exact goodput of hand-made records, every SLO
pair scored from the same records, median and range over repetitions, the colocated budget choice."""

from __future__ import annotations

import pytest

from pdserve.bench import slo_grid
from pdserve.bench.replay.goodput import SLO
from pdserve.bench.replay.records import RequestRecord
from pdserve.bench.slo_grid import COLOCATED, DISAGGREGATED, Run


def rec(ttft: float, tpot: float | None, status: str = "OK") -> RequestRecord:
    return RequestRecord(ttft_s=ttft, tpot_s=tpot, status=status, tokens=2)


def recs(*groups: tuple[int, float, float | None] | tuple[int, float, float | None, str]) -> tuple:
    """``(count, ttft, tpot[, status])`` groups -> records."""
    return tuple(rec(*g[1:]) for g in groups for _ in range(g[0]))


def sweep(mode: str, budget: int | None, rep: int, by_rate: dict[float, tuple]) -> list[Run]:
    return [Run(mode, budget, rep, rate, records) for rate, records in by_rate.items()]


# rate 1: all fast; rate 2: one of 20 misses TTFT 1 s (but meets 2 s); rate 4: half miss TPOT 50 ms (meet 100 ms)
HAND = {1.0: recs((20, 0.2, 0.01)),
        2.0: recs((19, 0.2, 0.01), (1, 1.5, 0.01)),
        4.0: recs((10, 0.3, 0.02), (10, 0.3, 0.08))}


def test_slo_grid_is_every_pair_ttft_major():
    assert slo_grid.slo_grid([0.5, 1, 2], [0.025, 0.05, 0.1]) == [
        SLO(a, b) for a in (0.5, 1.0, 2.0) for b in (0.025, 0.05, 0.1)]
    assert slo_grid.parse_floats("0.5, 1,,2") == [0.5, 1.0, 2.0]
    for bad in (([], [1.0]), ([1.0, 1.0], [1.0]), ([0.0], [1.0]), ([1.0], [-0.1])):
        with pytest.raises(ValueError):
            slo_grid.slo_grid(*bad)


@pytest.mark.parametrize("slo, rate, kind", [
    (SLO(1.0, 0.05), 2 + 0.05 * 2 / 0.45, "interpolated"),  # 100% / 95% / 50%: between rates 2 and 4
    (SLO(2.0, 0.05), 2 + 0.10 * 2 / 0.50, "interpolated"),  # 100% / 100% / 50%
    (SLO(1.0, 0.1), 4.0, "lower_bound"),                    # 100% / 95% / 100%: every rate >= 90%
    (SLO(2.0, 0.1), 4.0, "lower_bound"),
    (SLO(0.1, 0.1), 0.0, "below_lowest"),                   # TTFT 0.2 s > 0.1 s everywhere
])
def test_exact_goodput_of_hand_made_records_at_each_slo(slo, rate, kind):
    good = slo_grid.config_goodput(sweep(DISAGGREGATED, None, 0, HAND), slo)
    assert good.kind == kind
    assert good.rate == pytest.approx(rate, rel=1e-12)


def test_attainment_edges_failed_requests_and_slo_boundary():
    # 9 of 10 meet (the 10th failed: it counts, meets nothing), exactly 90%: meets the target;
    # a TTFT equal to the SLO meets it; a single-token request (no TPOT) meets the TPOT SLO.
    at1 = recs((8, 1.0, 0.05), (1, 0.5, None), (1, 0.1, 0.01, "UNAVAILABLE"))
    at2 = recs((8, 0.5, 0.01), (2, 1.0 + 1e-9, 0.01))  # 80%
    good = slo_grid.config_goodput(sweep(DISAGGREGATED, None, 0, {1.0: at1, 2.0: at2}), SLO(1.0, 0.05))
    assert good.kind == "interpolated" and good.rate == pytest.approx(1.0)
    assert good.bracket == ((1.0, pytest.approx(0.9)), (2.0, pytest.approx(0.8)))


def test_config_goodput_refuses_mixed_configurations_and_repeated_rates():
    runs = sweep(DISAGGREGATED, None, 0, HAND)
    with pytest.raises(ValueError):
        slo_grid.config_goodput(runs + sweep(DISAGGREGATED, None, 1, {8.0: HAND[1.0]}), SLO(1, 1))
    with pytest.raises(ValueError):
        slo_grid.config_goodput(runs + [Run(DISAGGREGATED, None, 0, 1.0, HAND[1.0])], SLO(1, 1))
    with pytest.raises(ValueError):
        slo_grid.config_goodput([], SLO(1, 1))


def test_median_and_spread():
    assert slo_grid.median_spread([3, 1, 2]) == {"median": 2.0, "min": 1.0, "max": 3.0, "spread": 2.0,
                                                 "values": [3.0, 1.0, 2.0]}
    assert slo_grid.median_spread([1, 2, 3, 10])["median"] == 2.5
    with pytest.raises(ValueError):
        slo_grid.median_spread([])


def test_best_budget_highest_median_then_smaller_spread_then_smaller_budget():
    s = {128: {"median": 2.0, "spread": 0.5}, 256: {"median": 3.0, "spread": 1.0}, 512: {"median": 3.0, "spread": 0.2},
         1024: {"median": 3.0, "spread": 0.2}}
    assert slo_grid.best_budget(s) == 512
    assert slo_grid.best_budget({1024: {"median": 1.0, "spread": 0}, 128: {"median": 1.0, "spread": 0}}) == 128
    with pytest.raises(ValueError):
        slo_grid.best_budget({})


def colocated_and_disaggregated_runs() -> list[Run]:
    """Rate 1 meets or misses by latency, rate 2 always fails (goodput 1 + 0.1 = 1.1 when rate 1
    meets): budget 128 has slow TTFT and fast TPOT, 1024 the opposite. Disaggregated, 3 reps,
    meets at rate 1 and reaches 50% / 70% / 30% at rate 2: goodputs 1.2, 1.333, 1.143."""
    fail = recs((10, 0.1, 0.01, "RESOURCE_EXHAUSTED"))
    runs = []
    for rep in range(3):
        runs += sweep(COLOCATED, 128, rep, {1.0: recs((10, 0.8, 0.02)), 2.0: fail})
        runs += sweep(COLOCATED, 1024, rep, {1.0: recs((10, 0.3, 0.06)), 2.0: fail})
        good = (5, 7, 3)[rep]
        runs += sweep(DISAGGREGATED, None, rep, {1.0: recs((10, 0.2, 0.01)),
                                                 2.0: recs((good, 0.2, 0.01), (10 - good, 5.0, 0.01))})
    return runs


def test_score_picks_the_best_budget_per_slo_pair_and_reports_median_and_range():
    slos = slo_grid.slo_grid([0.5, 1.0], [0.025, 0.1])
    rows = {(r["ttft_slo_s"], r["tpot_slo_s"]): r for r in slo_grid.score(colocated_and_disaggregated_runs(), slos)}
    assert list(rows) == [(0.5, 0.025), (0.5, 0.1), (1.0, 0.025), (1.0, 0.1)]
    d = rows[(1.0, 0.1)]["disaggregated"]
    assert d["values"] == pytest.approx([1.2, 1 + 0.1 / 0.3, 1 + 0.1 / 0.7])
    assert d["median"] == pytest.approx(1.2) and d["spread"] == pytest.approx(0.1 / 0.3 - 0.1 / 0.7)
    assert d["kinds"] == ["interpolated"] * 3
    # TTFT 0.5 s: only budget 1024 meets it (with TPOT 100 ms); TPOT 25 ms: only budget 128 (with TTFT 1 s)
    assert rows[(0.5, 0.1)]["best_budget"] == 1024
    assert rows[(1.0, 0.025)]["best_budget"] == 128
    assert rows[(1.0, 0.1)]["best_budget"] == 128  # a tie (1.1 each): the smaller budget
    for key in ((0.5, 0.1), (1.0, 0.025), (1.0, 0.1)):
        assert rows[key]["best_colocated"]["median"] == pytest.approx(1.1)
        assert rows[key]["ratio"] == pytest.approx(1.2 / 1.1)
        assert rows[key]["colocated"][rows[key]["best_budget"]] is rows[key]["best_colocated"]
    # TTFT 0.5 s and TPOT 25 ms: no budget meets both at rate 1, so there is no ratio
    worst = rows[(0.5, 0.025)]
    assert worst["best_colocated"]["median"] == 0.0 and worst["best_colocated"]["kinds"] == ["below_lowest"] * 3
    assert worst["ratio"] is None
    assert all(r["ratio_kind"] == "exact" for r in rows.values())
    assert "| 1 | 100 | 1.2 [1.14-1.33] | 1.1 [1.1-1.1] | 128 | 1.09x |" in slo_grid.format_table(list(rows.values()))


def test_ratio_kind_says_which_side_only_has_a_lower_bound():
    exact, lower = {"kinds": ["interpolated", "below_lowest"]}, {"kinds": ["interpolated", "lower_bound"]}
    assert slo_grid.ratio_kind(exact, exact) == "exact"
    assert slo_grid.ratio_kind(lower, exact) == "lower_bound"
    assert slo_grid.ratio_kind(exact, lower) == "upper_bound"
    assert slo_grid.ratio_kind(lower, lower) == "unknown"


def test_score_needs_both_modes():
    runs = [r for r in colocated_and_disaggregated_runs() if r.mode == COLOCATED]
    with pytest.raises(ValueError):
        slo_grid.score(runs, [SLO(1, 1)])


def test_runs_from_results_round_trip_the_records():
    results = {"runs": [{"rate": 2, "records": [r.to_dict() for r in HAND[2.0]]}]}
    (run,) = slo_grid.runs_from_results(results, COLOCATED, 256, 1)
    assert (run.mode, run.budget, run.rep, run.rate) == (COLOCATED, 256, 1, 2.0)
    assert run.records == HAND[2.0]
