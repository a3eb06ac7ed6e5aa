"""Autoscaling decisions for the two pools, from SLO attainment: pure functions, no I/O.

Disaggregation lets each phase scale on its own signal (DistServe, Zhong et al., OSDI 2024;
NVIDIA Dynamo's planner does the same on TTFT/ITL): TTFT misses mean prompts wait for
prefill, so the prefill pool grows; TPOT misses mean decode batches are too large or KV is
short, so the decode pool grows. A pool shrinks when both SLOs are comfortably met and the
remaining workers would still be lightly loaded.

One call of :func:`plan` per observation window::

    Window (attainment counters, pool sizes, load, free Ray resources)
      │
      ├─ outside [min, max] ─────────────────────────────► +1 / -1 at once (repair)
      ├─ signal: grow prefill │ grow decode │ shrink P/D │ hold
      ├─ same signal for ``hold_windows`` windows in a row (hysteresis)
      ├─ ``cooldown_s`` since the last action
      └─ within bounds and the resources Ray reports ─────► Action(role, ±1)

Alternating signals never build a streak, so the planner does not oscillate; after an action
the streak restarts and the cooldown lets the new worker's effect show in the counters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class PlannerConfig:
    """Autoscaling policy (``pdserve up --autoscale``).

    Attributes:
        min_prefill / max_prefill / min_decode / max_decode: pool size bounds (workers).
        target_attainment: a per-SLO attainment (fraction of finished requests meeting it)
            below this is a miss signal.
        shrink_attainment: both attainments at least this (or too little traffic to tell)
            allow a shrink.
        low_load: a pool may shrink only if its requests (running + waiting) per worker after
            removing one stay below this.
        min_requests: finished requests a window needs before its attainment counts.
        hold_windows: consecutive windows a signal must hold before it is acted on.
        cooldown_s: seconds after an action during which no other (non-repair) action is taken.
        window_s: seconds between observations (and the attainment window read from Redis).
    """

    min_prefill: int = 1
    max_prefill: int = 4
    min_decode: int = 1
    max_decode: int = 4
    target_attainment: float = 0.9
    shrink_attainment: float = 0.98
    low_load: float = 1.0
    min_requests: int = 10
    hold_windows: int = 3
    cooldown_s: float = 60.0
    window_s: float = 30.0

    def __post_init__(self) -> None:
        for role in ROLES:
            lo, hi = self.bounds(role)
            if not 1 <= lo <= hi:
                raise ValueError(f"{role} pool bounds must satisfy 1 <= min <= max, got min {lo}, max {hi}")
        if not 0 < self.target_attainment <= self.shrink_attainment <= 1:
            raise ValueError("need 0 < target_attainment <= shrink_attainment <= 1")
        if self.low_load <= 0 or self.min_requests < 1 or self.hold_windows < 1:
            raise ValueError("low_load must be positive, min_requests and hold_windows at least 1")
        if self.cooldown_s < 0 or self.window_s <= 0:
            raise ValueError("cooldown_s must be >= 0 and window_s > 0")

    def bounds(self, role: str) -> tuple[int, int]:
        """``(min, max)`` workers of ``role``."""
        return (self.min_prefill, self.max_prefill) if role == "prefill" else (self.min_decode, self.max_decode)


@dataclass(frozen=True)
class Window:
    """One observation.

    Attributes:
        now: time of the observation (seconds, any monotonic origin).
        finished / met_ttft / met_tpot: request counters of the attainment window (Redis ``slo:*``).
        rejected_ttft / rejected_tpot: requests admission rejected because the TTFT (TPOT) SLO
            was predicted to fail; each counts as a miss of that SLO (0 when not recorded).
        num_prefill / num_decode: live workers per pool.
        prefill_load / decode_load: requests running + waiting, summed over the pool.
        fit_prefill / fit_decode: more workers of that pool the free Ray resources could hold.
    """

    now: float
    finished: int
    met_ttft: int
    met_tpot: int
    num_prefill: int
    num_decode: int
    prefill_load: float = 0.0
    decode_load: float = 0.0
    fit_prefill: int = 0
    fit_decode: int = 0
    rejected_ttft: int = 0
    rejected_tpot: int = 0

    def size(self, role: str) -> int:
        return self.num_prefill if role == "prefill" else self.num_decode

    def load(self, role: str) -> float:
        return self.prefill_load if role == "prefill" else self.decode_load

    def fit(self, role: str) -> int:
        return self.fit_prefill if role == "prefill" else self.fit_decode


@dataclass(frozen=True)
class Action:
    """Add (``delta`` +1) or drain (-1) one worker of ``role``, and why."""

    role: str
    delta: int
    reason: str


@dataclass(frozen=True)
class PlannerState:
    """What :func:`plan` carries between windows: the current signal, how many windows in a
    row it held, and when the last action was taken."""

    signal: tuple[str, int] | None = None
    streak: int = 0
    last_action_at: float = -math.inf


def signal(cfg: PlannerConfig, w: Window) -> tuple[tuple[str, int] | None, str]:
    """The window's raw signal ``(role, ±1)`` or ``None`` (hold), and a reason; no hysteresis."""
    offered = w.finished + w.rejected_ttft + w.rejected_tpot
    if offered >= cfg.min_requests:
        att_ttft = 1 - (w.finished - w.met_ttft + w.rejected_ttft) / offered
        att_tpot = 1 - (w.finished - w.met_tpot + w.rejected_tpot) / offered
        if min(att_ttft, att_tpot) < cfg.target_attainment:
            role = "prefill" if 1 - att_ttft >= 1 - att_tpot else "decode"
            return (role, +1), f"TTFT attainment {att_ttft:.2f}, TPOT attainment {att_tpot:.2f}: {role} misses dominate"
        if min(att_ttft, att_tpot) < cfg.shrink_attainment:
            return None, f"attainment TTFT {att_ttft:.2f} / TPOT {att_tpot:.2f} met, not by enough margin to shrink"
    # SLOs comfortably met (or too little traffic to miss them): shrink the pool that stays lightest.
    after = {r: w.load(r) / (w.size(r) - 1) for r in ROLES if w.size(r) > cfg.bounds(r)[0]}
    if after:
        role = min(after, key=lambda r: (after[r], r))
        if after[role] < cfg.low_load:
            return (role, -1), f"SLOs met; {role} load {after[role]:.2f} requests/worker after removing one"
    return None, "SLOs met; no pool light enough to shrink"


def plan(cfg: PlannerConfig, state: PlannerState, w: Window) -> tuple[Action | None, PlannerState]:
    """Decide at most one action for window ``w``.

    Returns:
        The action (or ``None``) and the state to pass with the next window.
    """
    for role in ROLES:  # repair: a pool outside its bounds (a worker died, bounds changed)
        lo, hi = cfg.bounds(role)
        if w.size(role) > hi:
            return (Action(role, -1, f"{role} pool {w.size(role)} above max {hi}"),
                    PlannerState(last_action_at=w.now))
        if w.size(role) < lo and w.fit(role) > 0:
            return (Action(role, +1, f"{role} pool {w.size(role)} below min {lo}"),
                    PlannerState(last_action_at=w.now))
    sig, reason = signal(cfg, w)
    if sig is None:
        return None, replace(state, signal=None, streak=0)
    state = replace(state, signal=sig, streak=state.streak + 1 if sig == state.signal else 1)
    role, delta = sig
    lo, hi = cfg.bounds(role)
    if (state.streak < cfg.hold_windows or w.now - state.last_action_at < cfg.cooldown_s
            or (delta > 0 and (w.size(role) >= hi or w.fit(role) < 1))
            or (delta < 0 and w.size(role) <= lo)):
        return None, state
    return Action(role, delta, reason), PlannerState(last_action_at=w.now)
