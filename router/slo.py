"""SLO admission as the router applies it: per-request SLOs (the request's, else the
cluster's defaults), decode step-time models fed by the decode workers' heartbeats, and
the Redis reservations of :class:`~router.admission.Admission`.

    admit(P, [D1, D2, ...]) ── try_admit(P, Di) for the best few Di ──► Di, or RESOURCE_EXHAUSTED
    prefill answered ──► release_prefill        request ended ──► release_decode + record_outcome
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from redis.exceptions import RedisError

from pdserve.cluster.registry import WorkerInfo
from pdserve.router.admission import Admission, Decision, TpotParams
from pdserve.router.step_model import StepTimeModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Slo:
    """A request's latency targets, seconds."""

    ttft_s: float
    tpot_s: float

    def clamped(self, min_s: float, max_ttft_s: float, max_tpot_s: float) -> Slo:
        """These SLOs moved into the operator's ranges (seconds): TTFT into ``[min_s, max_ttft_s]``, TPOT into
        ``[min_s, max_tpot_s]`` (``RouterConfig.min_slo_s`` etc.). A NaN becomes ``min_s``, infinity the maximum,
        so the result is always finite and positive when the bounds are."""
        return Slo(_clamp(self.ttft_s, min_s, max_ttft_s), _clamp(self.tpot_s, min_s, max_tpot_s))


def _clamp(x: float, lo: float, hi: float) -> float:
    return lo if not x >= lo else hi if x > hi else x  # NaN fails x >= lo


class SloGate:
    """Admission decisions and bookkeeping for one router.

    Args:
        redis_url, cluster: where the reservations live (shared by every router replica).
        reservation_ttl_s: how long an unreleased prefill reservation lives (must exceed the prefill timeout).
    """

    def __init__(self, redis_url: str, cluster: str, reservation_ttl_s: float) -> None:
        self.admission = Admission(redis_url, cluster, reservation_ttl_s=reservation_ttl_s)
        self.step_models: dict[str, StepTimeModel] = {}
        self._seen: dict[str, float] = {}

    def observe(self, workers: list[WorkerInfo]) -> None:
        """Feed each decode worker's last reported step (once per heartbeat) to its step-time model."""
        for w in workers:
            if w.role in ("decode", "both") and w.step_batch and self._seen.get(w.worker_id) != w.heartbeat_at:
                self._seen[w.worker_id] = w.heartbeat_at
                self.step_models.setdefault(w.worker_id, StepTimeModel()).observe(
                    w.step_batch, w.step_context_tokens, w.step_seconds)

    def forget(self, worker_id: str) -> None:
        """Drop what this gate keeps of ``worker_id`` (it left the registry); a no-op if nothing."""
        self.step_models.pop(worker_id, None)
        self._seen.pop(worker_id, None)

    async def admit(self, attempt_id: str, prefill_worker: str, prefill_s: float, decodes: list[WorkerInfo],
                    context_tokens: int, slo: Slo, decode_ttl_s: float) -> tuple[WorkerInfo | None, Decision | None]:
        """Try the best few decode workers for the attempt ``attempt_id``; the first that admits wins (its
        reservations are held, keyed by ``attempt_id``). ``prefill_s``: predicted prefill seconds on
        ``prefill_worker``; ``decode_ttl_s``: lifetime of the decode reservation (seconds).

        Returns:
            (the admitting decode worker, its decision), or (None, the last rejection; None if no
            decode worker was tried). A rejection is counted in Redis (a failure to count it is logged).
        Raises:
            redis.RedisError: Redis is unreachable or failed the admission script (nothing stays reserved).
            ValueError: an SLO or prediction that is not finite (see ``Admission.try_admit``).
        """
        decision = None
        for d in decodes[:3]:
            model = self.step_models.setdefault(d.worker_id, StepTimeModel())
            decision = await self.admission.try_admit(
                attempt_id, prefill_worker, prefill_s, slo.ttft_s, d.worker_id,
                TpotParams(*model.coefficients(), context_tokens), slo.tpot_s, decode_ttl_s=decode_ttl_s)
            if decision.admitted:
                return d, decision
        try:
            await self.admission.record_rejection(reason=decision.reason if decision is not None else "")
        except RedisError as exc:  # the decision stands; only the counter is lost
            log.warning("admission rejection not counted: %s", type(exc).__name__)
        return None, decision

    async def close(self) -> None:
        await self.admission.aclose()
