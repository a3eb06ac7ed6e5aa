"""What the router does when a worker fails under a request: retry or migrate, a bounded number of times.

::

    attempt k ──(worker failed)──► no token streamed yet? ──yes──► RETRY: the whole dispatch again
       ▲                                   │ no                     (new decode allocation, new prefill)
       │                                   ▼
       │                          MIGRATE: prefill prompt + the tokens already streamed on a prefill
       │                          worker, decode on another decode worker, resume the stream after them
       └───────────── while attempts < max_attempts and the request's deadline allows ─────────────┘
                      else UNAVAILABLE naming every failure

Migration follows NVIDIA Dynamo's request migration: the new prefill recomputes (mostly from the
prefix cache) the KV of everything the client already has, samples the next token with output index
``len(streamed)`` (seeded sampling stays one stream), and the new decode worker counts the streamed
tokens towards ``max_tokens`` and stop checks, so a greedy request with a migration is token-identical
to an uninterrupted run and no token is duplicated or dropped.

Workers that failed under this request are *avoided*, not banned: they go last in every ranking
(a dead worker is in the registry until its lease lapses; one that failed for a passing reason may
be the only one left).

Every attempt is a new request on the workers, under its own **attempt id**: the router's id for
the request (drawn per request: clients' ids need not be unique), with ``-k`` appended for attempt
``k >= 2`` (a failed attempt may still be live on a worker for a moment, and a worker refuses an id
it holds). The workers see it as the ``request_id`` of their RPCs and KV transfers. States and
their names: :mod:`cluster.lifecycle`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field

import grpc

from pdserve.cluster.registry import WorkerInfo
from pdserve.model.sampling_types import SamplingParams

MAX_ATTEMPTS = 4  # default dispatches per request, the first included (RouterConfig.max_attempts)
MIN_ATTEMPT_S = 0.5       # no new attempt with less time than this left before the request's deadline
RETRY_BACKOFF_S = 0.05    # pause before attempt k is k times this (leases and connections settle)

# Statuses a worker ends a call with that another worker cannot fix: the request itself is wrong.
NOT_RETRIABLE = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION})


class GenerateError(Exception):
    """Ends the client's stream with ``code`` and ``message``."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class NoRoom(GenerateError):
    """RESOURCE_EXHAUSTED for want of KV room on the decode workers now: what a request with a
    ``queue_timeout_s`` waits out in the router's line (:mod:`router.room_queue`)."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


class WorkerFailure(Exception):
    """One attempt failed because of a worker (died, cut the stream, failed the transfer).

    Attributes:
        worker_ids: the workers to avoid in the next attempts of this request.
        message: what failed, for logs and the final error.
    """

    def __init__(self, worker_ids: Iterable[str], message: str) -> None:
        super().__init__(message)
        self.worker_ids, self.message = frozenset(worker_ids), message


def rpc_failure(exc: grpc.aio.AioRpcError, who: str, failure: str,
                blamed: Iterable[str]) -> GenerateError | WorkerFailure:
    """How a worker's call error ends an attempt: a refusal of the request itself (:data:`NOT_RETRIABLE`)
    as the client's error, ``"{who}: {details}"`` (``who``: e.g. ``"decode worker d0"``); anything else as a
    :class:`WorkerFailure` blaming ``blamed``, ``"{failure}: {details}"``."""
    if exc.code() in NOT_RETRIABLE:
        return GenerateError(exc.code(), f"{who}: {exc.details()}")
    return WorkerFailure(blamed, f"{failure}: {exc.details()}")


@dataclass
class Progress:
    """What survives from one attempt to the next.

    Attributes:
        generated: output token ids already streamed to the client, in order.
        avoid: ids of workers that failed under this request.
        failures: one message per failed attempt.
        num_retries: attempts restarted before any token was streamed.
        num_migrations: attempts restarted after tokens were streamed.
        cached_tokens: prompt tokens the first successful prefill served from its prefix cache.
        request_uid: the router's id for the request, the stem of its attempt ids.
    """

    generated: list[int] = field(default_factory=list)
    avoid: set[str] = field(default_factory=set)
    failures: list[str] = field(default_factory=list)
    num_retries: int = 0
    num_migrations: int = 0
    cached_tokens: int | None = None
    request_uid: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def num_attempts(self) -> int:
        """Attempts so far, the current one included."""
        return 1 + self.num_retries + self.num_migrations

    @property
    def attempt_id(self) -> str:
        """The current attempt's id, the request id its workers see: ``request_uid`` for the first
        attempt, ``request_uid-k`` for the k-th."""
        return self.request_uid if self.num_attempts == 1 else f"{self.request_uid}-{self.num_attempts}"

    def history(self) -> str:
        """The failures so far, for error messages (empty when none)."""
        return f" (after {len(self.failures)} failed attempt(s): {'; '.join(self.failures)})" if self.failures else ""

    def finish_reason(self, sampling: SamplingParams, stop_ids: frozenset[int]) -> str | None:
        """``"stop"``/``"length"`` when the streamed output already ends the request (a worker died between
        its last token and its ``finished``), else ``None``."""
        if self.generated and self.generated[-1] in stop_ids:
            return "stop"
        if len(self.generated) >= sampling.max_tokens:
            return "length"
        return None

    def record(self, failure: WorkerFailure, deadline: float | None, max_attempts: int = MAX_ATTEMPTS) -> float:
        """Count ``failure`` and decide whether to try again.

        Returns:
            Seconds to wait before the next attempt.
        Raises:
            GenerateError: UNAVAILABLE naming every failure, when the attempts or the deadline are used up.
        """
        self.failures.append(failure.message)
        self.avoid |= failure.worker_ids
        if self.generated:
            self.num_migrations += 1
        else:
            self.num_retries += 1
        if self.num_attempts > max_attempts:
            raise GenerateError(grpc.StatusCode.UNAVAILABLE,
                                f"request failed after {max_attempts} attempts: {'; '.join(self.failures)}")
        backoff = RETRY_BACKOFF_S * (self.num_attempts - 1)
        if deadline is not None and deadline - time.monotonic() < MIN_ATTEMPT_S + backoff:
            raise GenerateError(grpc.StatusCode.UNAVAILABLE,
                                f"no time left before the request's deadline to recover: {'; '.join(self.failures)}")
        return backoff


def avoiding(ranked: list[WorkerInfo], avoid: set[str]) -> list[WorkerInfo]:
    """``ranked`` with the workers in ``avoid`` moved to the end (order kept otherwise)."""
    return [w for w in ranked if w.worker_id not in avoid] + [w for w in ranked if w.worker_id in avoid]


class RegistryMemory:
    """Bridges a Redis restart in the router's view of the workers.

    Redis restarted empty lists no worker until each renews its lease (within ``lease_s / 4``).
    The workers of the previous view are kept for ``grace_s`` seconds after Redis was seen
    unreachable (the first successful read after failed ones) or empty (a read listing no
    worker where the last view had some: it restarted between two polls). A worker missing
    while others are listed released its lease (drain) or let it lapse: it is dropped at once,
    so routers stop sending it requests. A kept worker that really died fails fast at connect,
    and :func:`run_generate`'s retries move its requests on.
    """

    def __init__(self, grace_s: float = 2.0) -> None:
        if grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {grace_s}")
        self.grace_s = grace_s
        self._down = False
        self._emptied = False
        self._recovered_at = float("-inf")

    def read_failed(self) -> None:
        """The registry could not be read (the caller keeps its last view)."""
        self._down = True

    def merge(self, previous: list[WorkerInfo], fresh: list[WorkerInfo], now_mono: float | None = None,
              ) -> list[WorkerInfo]:
        """The view after a successful read: ``fresh`` plus, while recovering (see the class
        docstring), the workers of ``previous`` it lacks; sorted by id. ``now_mono`` defaults to
        ``time.monotonic()``."""
        now_mono = time.monotonic() if now_mono is None else now_mono
        emptied = bool(previous) and not fresh
        if self._down or (emptied and not self._emptied):
            self._recovered_at = now_mono
        self._down, self._emptied = False, emptied
        if now_mono - self._recovered_at >= self.grace_s:
            return sorted(fresh, key=lambda w: w.worker_id)
        listed = {w.worker_id for w in fresh}
        return sorted(fresh + [w for w in previous if w.worker_id not in listed], key=lambda w: w.worker_id)
