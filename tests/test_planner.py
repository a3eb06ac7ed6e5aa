"""The autoscaling planner on hand-built attainment sequences (pure, no cluster)."""

from __future__ import annotations

import pytest

from pdserve.deploy.planner import Action, PlannerConfig, PlannerState, Window, plan, signal

CFG = PlannerConfig(min_prefill=1, max_prefill=3, min_decode=1, max_decode=3, target_attainment=0.9,
                    shrink_attainment=0.98, low_load=1.0, min_requests=10, hold_windows=3, cooldown_s=60.0,
                    window_s=10.0)


def window(t: float, finished: int = 100, ttft_ok: float = 1.0, tpot_ok: float = 1.0, p: int = 1, d: int = 1,
           p_load: float = 5.0, d_load: float = 5.0, fit: int = 4, **kw) -> Window:
    """A window at time ``t`` where fractions ``ttft_ok`` / ``tpot_ok`` of ``finished`` met their SLO."""
    return Window(now=t, finished=finished, met_ttft=round(finished * ttft_ok), met_tpot=round(finished * tpot_ok),
                  num_prefill=p, num_decode=d, prefill_load=p_load, decode_load=d_load, fit_prefill=fit,
                  fit_decode=fit, **kw)


def run(windows: list[Window], cfg: PlannerConfig = CFG) -> list[Action | None]:
    """Feed the windows in order, applying each action to the following windows' pool sizes."""
    state, out, sizes = PlannerState(), [], {"prefill": 0, "decode": 0}
    for w in windows:
        w = Window(**{**w.__dict__, "num_prefill": w.num_prefill + sizes["prefill"],
                      "num_decode": w.num_decode + sizes["decode"]})
        action, state = plan(cfg, state, w)
        if action is not None:
            sizes[action.role] += action.delta
        out.append(action)
    return out


def test_ttft_misses_grow_prefill_only_after_the_signal_holds():
    actions = run([window(10 * i, ttft_ok=0.6, tpot_ok=0.95) for i in range(3)])
    assert actions[:2] == [None, None]
    assert (actions[2].role, actions[2].delta) == ("prefill", 1)


def test_tpot_misses_grow_decode():
    actions = run([window(10 * i, ttft_ok=0.97, tpot_ok=0.5) for i in range(3)])
    assert [(a.role, a.delta) for a in actions if a] == [("decode", 1)]


def test_the_larger_miss_rate_picks_the_pool():
    assert signal(CFG, window(0, ttft_ok=0.8, tpot_ok=0.7))[0] == ("decode", 1)
    assert signal(CFG, window(0, ttft_ok=0.7, tpot_ok=0.8))[0] == ("prefill", 1)


def test_rejections_count_as_misses_of_their_slo():
    # every finished request met both SLOs, but admission turned away 30 for TTFT
    w = window(0, finished=70, rejected_ttft=30)
    assert signal(CFG, w)[0] == ("prefill", 1)
    assert signal(CFG, window(0, finished=70, rejected_tpot=30))[0] == ("decode", 1)


def test_alternating_signals_never_act():
    windows = [window(10 * i, ttft_ok=0.5, tpot_ok=0.95) if i % 2 == 0 else window(10 * i, ttft_ok=0.95, tpot_ok=0.5)
               for i in range(40)]
    assert run(windows) == [None] * 40


def test_cooldown_spaces_actions_and_the_streak_restarts():
    # a persistent TTFT problem, one window every 10 s, cooldown 60 s, hold 3 windows
    actions = run([window(10 * i, ttft_ok=0.5, tpot_ok=0.95) for i in range(20)], CFG)
    acted_at = [i for i, a in enumerate(actions) if a]
    assert acted_at[0] == 2
    assert all(b - a >= 6 for a, b in zip(acted_at, acted_at[1:]))  # 60 s cooldown = 6 windows
    assert all(a.role == "prefill" and a.delta == 1 for a in actions if a)


def test_growth_stops_at_max():
    actions = run([window(100 * i, ttft_ok=0.5, tpot_ok=0.95) for i in range(30)])
    grown = sum(a.delta for a in actions if a and a.role == "prefill")
    assert 1 + grown == CFG.max_prefill


def test_no_growth_without_free_resources():
    assert run([window(100 * i, ttft_ok=0.5, fit=0) for i in range(10)]) == [None] * 10
    # resources appear: the held signal acts at once
    state = PlannerState()
    for i in range(5):
        action, state = plan(CFG, state, window(100 * i, ttft_ok=0.5, fit=0))
        assert action is None
    action, state = plan(CFG, state, window(500, ttft_ok=0.5, fit=1))
    assert action == Action("prefill", 1, action.reason)


def test_comfortable_slos_and_low_load_shrink_the_lightest_pool_down_to_min():
    # 3 + 3 workers, prefill nearly idle, decode busy: only prefill shrinks, and never below 1
    actions = run([window(100 * i, p=3, d=3, p_load=0.2, d_load=9.0) for i in range(30)])
    shrinks = [(a.role, a.delta) for a in actions if a]
    assert shrinks == [("prefill", -1), ("prefill", -1)]


def test_no_shrink_when_the_remaining_workers_would_be_loaded():
    # 2 decode workers with 1.5 requests in total: 1.5 per worker after a removal >= low_load 1.0
    assert run([window(100 * i, p=1, d=2, p_load=0.0, d_load=1.5) for i in range(10)]) == [None] * 10


def test_no_shrink_on_marginal_attainment():
    assert run([window(100 * i, p=2, d=2, p_load=0, d_load=0, ttft_ok=0.95) for i in range(10)]) == [None] * 10


def test_idle_cluster_shrinks_without_traffic():
    actions = run([window(100 * i, finished=0, p=2, d=1, p_load=0, d_load=0) for i in range(5)])
    assert [(a.role, a.delta) for a in actions if a] == [("prefill", -1)]


def test_too_few_requests_give_no_growth_signal():
    assert signal(CFG, window(0, finished=5, ttft_ok=0.0, p_load=50, d_load=50))[0] is None


def test_out_of_bounds_pools_are_repaired_at_once():
    action, _ = plan(CFG, PlannerState(last_action_at=0.0), window(1.0, p=0, d=1))
    assert (action.role, action.delta) == ("prefill", 1)  # despite cooldown and no streak
    action, _ = plan(CFG, PlannerState(), window(1.0, p=1, d=5))
    assert (action.role, action.delta) == ("decode", -1)
    action, _ = plan(CFG, PlannerState(), window(1.0, p=0, d=1, fit=0))
    assert action is None  # below min but nothing free: wait


@pytest.mark.parametrize("bad", [dict(min_prefill=0), dict(min_decode=3, max_decode=2),
                                 dict(target_attainment=0.99, shrink_attainment=0.9), dict(hold_windows=0),
                                 dict(window_s=0), dict(low_load=0)])
def test_bad_planner_configs_are_rejected(bad):
    with pytest.raises(ValueError):
        PlannerConfig(**bad)
