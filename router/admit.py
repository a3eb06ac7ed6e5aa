"""SLO admission of one attempt (the router's ``QUEUED`` state with ``--admission``): one try for the decode worker
whose reservation is taken in Redis. Waiting is the caller's: for KV room in the router's line
(:mod:`router.room_queue`), for admission's "retry after" out of it (:class:`AdmitLater`)."""

from __future__ import annotations

import logging

import grpc
from redis.exceptions import RedisError

from pdserve.cluster.registry import WorkerInfo
from pdserve.router.dispatch import DEFAULT_SECONDS_PER_BLOCK, no_pool_holds, rank_decode
from pdserve.router.recovery import GenerateError, NoRoom
from pdserve.router.validation import ValidRequest
from pdserve.router.view import ClusterView

log = logging.getLogger(__name__)

ADMISSION_UNAVAILABLE = "admission is unavailable (its shared state cannot be reached); retry later"
"""The client's message when admission fails for want of Redis: no key, URL or script text."""


class AdmitLater(Exception):
    """Admission did not admit the request now; ``retry_after_s`` is when it might (None: retrying cannot help).
    :meth:`refusal` is the client's error once waiting is not possible."""

    def __init__(self, decision) -> None:
        super().__init__(decision.reason)
        self.decision, self.retry_after_s = decision, decision.retry_after_s

    def refusal(self) -> GenerateError:
        """RESOURCE_EXHAUSTED naming the reason, the predicted TTFT and TPOT, and the retry-after hint."""
        d, wait = self.decision, self.retry_after_s
        hint = "retrying cannot help" if wait is None else f"retry after {wait:.3f} s"
        return GenerateError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"not admitted: {d.reason} (predicted TTFT {d.predicted_ttft_s:.3f} s,"
                             f" TPOT {d.predicted_tpot_s:.4f} s); {hint}")


async def admit(view: ClusterView, req: ValidRequest, attempt_id: str, prefill: WorkerInfo, work_blocks: int,
                 num_tokens: int, lifetime_tokens: int) -> WorkerInfo:
    """SLO admission, one try: the decode worker whose reservation was taken.

    Raises:
        NoRoom: no decode worker that could hold the request has room for it now.
        AdmitLater: not admitted now (the caller waits its ``retry_after_s`` or refuses with its ``refusal()``).
        GenerateError: INVALID_ARGUMENT when no decode worker's pool could ever hold prompt + max_tokens;
            UNAVAILABLE when no decode worker is available, when Redis fails (:data:`ADMISSION_UNAVAILABLE`) or
            admission cannot evaluate the request: nothing stays reserved (``Admission.try_admit`` deletes
            what a failed script wrote).
    """
    try:
        return await _admit_once(view, req, attempt_id, prefill, work_blocks, num_tokens, lifetime_tokens)
    except RedisError as exc:
        log.warning("admission of %s failed: %s", attempt_id, type(exc).__name__)
        raise GenerateError(grpc.StatusCode.UNAVAILABLE, ADMISSION_UNAVAILABLE) from None
    except ValueError:  # the router's own arguments (SLOs are clamped, step models non-negative): a bug
        log.exception("admission of %s could not evaluate the request", attempt_id)
        raise GenerateError(grpc.StatusCode.UNAVAILABLE,
                            "admission could not evaluate the request (see the router's log); retry later") from None


def no_room_message(num_tokens: int) -> str:
    """The client's message when no decode worker has room for ``num_tokens`` positions now."""
    return f"no decode worker has free KV blocks for {num_tokens} tokens; retry later"


def too_long(lifetime_tokens: int) -> GenerateError:
    """INVALID_ARGUMENT for a request no decode worker's KV pool could ever hold."""
    return GenerateError(grpc.StatusCode.INVALID_ARGUMENT, f"prompt + max_tokens ({lifetime_tokens + 1} tokens) "
                         "is more than any decode worker's KV pool holds; lower max_tokens")


async def _admit_once(view: ClusterView, req: ValidRequest, attempt_id: str, prefill: WorkerInfo,
                      work_blocks: int, num_tokens: int, lifetime_tokens: int) -> WorkerInfo:
    """:func:`admit` without the error mapping (raises ``redis.RedisError`` and ``ValueError`` as they come)."""
    stats = view.stats.get(prefill.worker_id)
    prefill_s = work_blocks * (stats.seconds_per_block if stats and stats.seconds_per_block
                               else DEFAULT_SECONDS_PER_BLOCK)
    decode_ttl_s = req.slo.ttft_s + 2 * req.sampling.max_tokens * req.slo.tpot_s + 5
    if no_pool_holds(view.current(), "decode", lifetime_tokens):   # waiting cannot help
        raise too_long(lifetime_tokens)
    decodes = rank_decode(view.current(), view.inflight, num_tokens, kv_backends=prefill.kv_backends,
                          lifetime_tokens=lifetime_tokens)
    if not decodes and rank_decode(view.current(), view.inflight, 0, kv_backends=prefill.kv_backends,
                                   lifetime_tokens=lifetime_tokens):
        # no room now on decode workers that could hold the request: the caller's line waits for it
        raise NoRoom(no_room_message(num_tokens))
    chosen, decision = await view.gate.admit(attempt_id, prefill.worker_id, prefill_s, decodes,
                                             len(req.prompt_ids) + req.sampling.max_tokens // 2, req.slo,
                                             decode_ttl_s)
    if chosen is not None:
        return chosen
    if decision is None:
        raise GenerateError(grpc.StatusCode.UNAVAILABLE, "no decode worker is available")
    raise AdmitLater(decision)
