"""Choosing one attempt's workers: the router's ``QUEUED`` state (:mod:`cluster.lifecycle`)::

    1. choose P (rank_prefill)         P counted in flight (InFlight) from here
    2. admission (first attempt only)  reservations on P and D in Redis (Reservation; router.admit)
    3. open D.Generate                 each D asked counted while it answers; the one that
                                       pre-allocates the blocks stays counted (DecodeStream)
    ──► Chosen, for the streaming (router.generate), which gives each back exactly once:
        P's count and reservation when P.Prefill returns, D's when the request leaves D

A worker is counted from the moment it is chosen, so that concurrent arrivals spread out. If
choosing fails, whatever it took is given back before the error propagates. Where no decode worker has room,
steps 1-3 are tried again in the request's turn in the router's line (router.room_queue), holding nothing
between tries.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

import grpc
from redis.exceptions import RedisError

from pdserve.cluster.registry import WorkerInfo
from pdserve.model.sampling_types import SamplingParams
from pdserve.proto import worker_pb2, worker_pb2_grpc
from pdserve.proto.convert import sampling_to_wire
from pdserve.router.admission import Admission
from pdserve.router.admit import AdmitLater, admit, no_room_message, too_long
from pdserve.router.config import RouterConfig
from pdserve.router.dispatch import no_pool_holds, rank_decode, rank_prefill
from pdserve.router.recovery import GenerateError, NoRoom, Progress, WorkerFailure, avoiding
from pdserve.router.validation import ValidRequest
from pdserve.router.view import ClusterView, InFlight

log = logging.getLogger(__name__)

@dataclass
class Reservation:
    """An attempt's admission reservations in Redis: prefill seconds on P, a batch slot on D.
    The prefill one is given back once, when P answers or at the end; both at the end."""

    admission: Admission
    attempt_id: str
    prefill_id: str
    decode_id: str
    prefill_held: bool = True

    async def release_prefill(self) -> None:
        """P answered (or failed): its reserved work is no longer queued. Later calls do nothing. Raises
        nothing: when Redis fails, the failure is logged and the reservation lapses at its deadline."""
        if self.prefill_held:
            self.prefill_held = False
            await self._quietly(self.admission.release_prefill, self.prefill_id)

    async def release(self) -> None:
        """The attempt ended, however it ended: give back what is still held. Raises nothing (as
        :meth:`release_prefill`)."""
        await self.release_prefill()
        await self._quietly(self.admission.release_decode, self.decode_id)

    async def _quietly(self, release: Callable[[str, str], Awaitable[None]], worker_id: str) -> None:
        try:
            await release(self.attempt_id, worker_id)
        except RedisError as exc:  # the stream's outcome must not depend on Redis: the entry lapses
            log.warning("admission reservation of %s on %s not released (it lapses): %s", self.attempt_id,
                        worker_id, type(exc).__name__)


@dataclass
class DecodeStream:
    """An open ``DecodeWorker.Generate`` call: the worker (counted by ``count``), the call and
    the blocks it pre-allocated (``allocated``: block ids and KV address)."""

    worker: WorkerInfo
    call: grpc.aio.UnaryStreamCall
    allocated: worker_pb2.Allocated
    count: InFlight


@dataclass
class Chosen:
    """One disaggregated attempt's workers, each counted in flight.

    Attributes:
        prefill: the prefill worker P; ``prefill_count`` counts it.
        decode: the open decode stream on D (counted by ``decode.count``).
        reservation: admission's reservations, or None (admission off, or a later attempt).
        context: token ids whose KV P computes (prompt + the tokens already streamed).
        block_size: tokens per KV block.
        work_blocks: blocks of ``context`` P's prefix cache lacks (the work this router queues there).
    """

    prefill: WorkerInfo
    prefill_count: InFlight
    decode: DecodeStream
    reservation: Reservation | None
    context: list[int]
    block_size: int
    work_blocks: int


async def choose_workers(view: ClusterView, req: ValidRequest, cfg: RouterConfig, attempt_id: str,
                         progress: Progress) -> Chosen:
    """Choose P, take admission (first attempt only) and open the decode stream on D: one try at once, or, where
    no decode worker has room and the request has a ``queue_timeout_s``, tries in its turn in the router's line
    (:mod:`router.room_queue`). P is chosen afresh at each try and counted in flight only from then: a request
    waiting in the line counts on no worker.

    Raises:
        GenerateError: not retriable (no worker, no room, bad request, not admitted).
        WorkerFailure: the decode workers to try were unreachable.
    """
    context = req.prompt_ids + progress.generated  # tokens whose KV the prefill computes
    num_tokens, lifetime = len(context) + 1, len(req.prompt_ids) + req.sampling.max_tokens - 1   # positions
    gate = view.gate if progress.num_attempts == 1 else None  # admission counts a request once, at its first dispatch
    deadline, rank = time.monotonic() + req.queue_timeout_s, line_rank(req, progress, time.monotonic())

    async def attempt() -> Chosen:
        pool = [w for w in view.current() if w.role == "prefill"]
        if not pool:
            raise GenerateError(grpc.StatusCode.UNAVAILABLE, f"no prefill worker is available{progress.history()}")
        block_size = pool[0].block_size
        prompt_blocks = len(context) // block_size
        cached = credited_cache(view, req, progress, context, block_size)
        prefill = avoiding(rank_prefill(view.current(), prompt_blocks, cached, view.stats, view.inflight,
                                        cfg.spill_queue_s), progress.avoid)[0]
        work = -(-len(context) // block_size) - min(cached.get(prefill.worker_id, 0), prompt_blocks)  # to compute
        prefill_count = view.counting(prefill.worker_id)  # from here on, so that concurrent arrivals spread out
        reservation = None
        try:
            candidates = None
            if gate is not None:   # admitted on a view that lagged D, D may refuse for blocks: the line asks again
                candidates = [await admit(view, req, attempt_id, prefill, work, num_tokens, lifetime)]
                reservation = Reservation(gate.admission, attempt_id, prefill.worker_id, candidates[0].worker_id)
            decode = await _open_decode_once(view, req, attempt_id, num_tokens, cfg, progress, "decode", candidates,
                                             prefill.kv_backends, lifetime)
        except BaseException:
            prefill_count.release()
            if reservation is not None:
                await reservation.release()
            raise
        return Chosen(prefill, prefill_count, decode, reservation, context, block_size, work)

    while True:
        try:
            return await view.room.serve(attempt, _no_room, deadline, rank)
        except AdmitLater as later:   # admission's "retry after": waited out of the line, then back in its place
            wait = later.retry_after_s
            if wait is None or time.monotonic() + wait > deadline:
                raise later.refusal() from None
            await asyncio.sleep(wait)


async def open_decode(view: ClusterView, req: ValidRequest, attempt_id: str, num_tokens: int, cfg: RouterConfig,
                      progress: Progress, role: str = "decode", kv_backends: tuple[str, ...] | None = None,
                      lifetime_tokens: int = 0, candidates: list[WorkerInfo] | None = None) -> DecodeStream:
    """Open a decode stream on the best worker of ``role`` that has room for ``num_tokens`` positions now
    and a pool for ``lifetime_tokens`` (:func:`~router.dispatch.rank_decode`), workers that failed this request
    last, or on ``candidates`` in their order where given. Each worker asked is counted while it answers; the
    returned one stays counted until the caller releases it. Colocated workers (role ``both``) are asked to
    prefill the prompt themselves. A migrated request's streamed tokens go along as
    ``prior_output_token_ids``. A request with ``queue_timeout_s`` that finds no room waits up to that long in
    the router's line (:mod:`router.room_queue`: in order, trying again whenever the view of the pools moves); it
    holds no block and is counted on no worker meanwhile (its client's stream slot it keeps).

    Raises:
        NoRoom: no room within ``queue_timeout_s`` (RESOURCE_EXHAUSTED).
        GenerateError: UNAVAILABLE (no worker of ``role``, or none answered), INVALID_ARGUMENT (the worker refused
            the request, or no worker's pool could ever hold prompt + max_tokens).
        WorkerFailure: a worker to try was unreachable (dead or stuck).
    """
    return await view.room.serve(
        lambda: _open_decode_once(view, req, attempt_id, num_tokens, cfg, progress, role, candidates, kv_backends,
                                  lifetime_tokens),
        _no_room, time.monotonic() + req.queue_timeout_s, line_rank(req, progress, time.monotonic()))


def _no_room(exc: BaseException) -> bool:
    """Whether a try failed for want of KV room only (the line tries again)."""
    return isinstance(exc, NoRoom)


def line_rank(req: ValidRequest, progress: Progress, arrived: float) -> tuple[int, int, float]:
    """A request's place in the line for KV room (:class:`~router.room_queue.RoomQueue`): a retry after a worker
    failure first (its client may be mid-stream), then by ``priority`` (lower first; 0 for all under
    ``--scheduling-policy fcfs``), then by ``arrived`` (``time.monotonic()`` when the dispatch began: a request
    that admission told to retry later takes its place back ahead of those that came after it)."""
    return (0 if progress.num_attempts > 1 else 1, req.sampling.priority, arrived)


async def _open_decode_once(view: ClusterView, req: ValidRequest, attempt_id: str, num_tokens: int,
                            cfg: RouterConfig, progress: Progress, role: str, candidates: list[WorkerInfo] | None,
                            kv_backends: tuple[str, ...] | None, lifetime_tokens: int) -> DecodeStream:
    """:func:`open_decode`'s one try on the ranked workers, or on ``candidates`` (admission's) where given; raises as
    it does, :class:`~router.recovery.NoRoom` at once when there is no room."""
    if candidates is None:
        candidates = avoiding(rank_decode(view.current(), view.inflight, num_tokens, role, kv_backends,
                                          lifetime_tokens),
                              progress.avoid)
    if not candidates:
        if not any(w.role == role for w in view.current()):
            raise GenerateError(grpc.StatusCode.UNAVAILABLE, f"no decode worker is available{progress.history()}")
        if no_pool_holds(view.current(), role, lifetime_tokens):   # not worth a retry
            raise too_long(lifetime_tokens)
        raise NoRoom(no_room_message(num_tokens))
    last_error, unreachable = "", set()
    for worker in candidates:
        count = view.counting(worker.worker_id)  # counted while it answers, so concurrent arrivals spread out
        try:
            call, allocated = await _allocate(view, worker, req, attempt_id, cfg, progress, role)
        except BaseException as exc:
            count.release()
            if not isinstance(exc, _Refused):
                raise
            if exc.unreachable:
                unreachable.add(worker.worker_id)  # dead or stuck: the next attempt avoids it
            last_error = f"{worker.worker_id}: {exc}"
            continue
        view.on_pool(worker.worker_id, allocated.pool_version, allocated.num_free_blocks)
        return DecodeStream(worker, call, allocated, count)
    if unreachable:  # e.g. the one worker admission reserved died: retry the dispatch without it
        raise WorkerFailure(unreachable, f"no decode worker could take the request (last: {last_error})")
    message = f"no decode worker could take the request (last: {last_error}){progress.history()}"
    if "blocks" in last_error:
        raise NoRoom(message)
    raise GenerateError(grpc.StatusCode.UNAVAILABLE, message)


def credited_cache(view: ClusterView, req: ValidRequest, progress: Progress, context: list[int],
                   block_size: int) -> dict[str, int]:
    """The blocks of ``context`` each prefill worker's prefix cache holds, as the ranking and the work estimate
    credit them: none for an attempt that computes prompt log-probabilities, whose prefill worker runs the whole
    prompt past its cache (until tokens have been streamed: :func:`attempt_sampling`), and none for a salted
    request (``cache_salt``), whose cached prefixes the index never hears of."""
    if req.sampling.prompt_logprobs is not None and not progress.generated or req.sampling.cache_salt:
        return {}
    return view.cached_blocks(context, block_size)


def attempt_sampling(sampling: SamplingParams, progress: Progress) -> worker_pb2.ResolvedSampling:
    """The workers' sampling for an attempt: the request's, less prompt log-probabilities once tokens have been
    streamed (the first message carried them; a migrated request's prefill does not compute them again)."""
    return sampling_to_wire(replace(sampling, prompt_logprobs=None) if progress.generated else sampling)


class _Refused(Exception):
    """A decode worker did not allocate the request; ``unreachable``: it is dead or stuck (not merely full)."""

    def __init__(self, message: str, unreachable: bool) -> None:
        super().__init__(message)
        self.unreachable = unreachable


async def _allocate(view: ClusterView, worker: WorkerInfo, req: ValidRequest, attempt_id: str, cfg: RouterConfig,
                    progress: Progress, role: str) -> tuple[grpc.aio.UnaryStreamCall, worker_pb2.Allocated]:
    """Call ``worker``'s Generate and read its first event, the allocation; the call is cancelled
    if that fails (or the caller is cancelled).

    Raises:
        _Refused: no answer within ``stream_idle_timeout_s`` (or ``prefill_timeout_s`` if shorter: the
            worker answers at once, before any compute; for a structured answer, whose grammar the worker
            compiles first, ``prefill_timeout_s``), an error status, or no allocation.
        GenerateError: INVALID_ARGUMENT, the worker refused the request itself.
    """
    call = worker_pb2_grpc.DecodeWorkerStub(view.channel(worker.address)).Generate(worker_pb2.DecodeRequest(
        request_id=attempt_id, prompt_token_ids=req.prompt_ids, sampling=attempt_sampling(req.sampling, progress),
        kv_timeout_s=cfg.kv_timeout_s, local_prefill=role == "both", prior_output_token_ids=progress.generated))
    try:
        # a structured answer's grammar is compiled before the allocation (seconds, the first time): prefill's bound
        wait = cfg.prefill_timeout_s if req.sampling.constrained else min(cfg.prefill_timeout_s,
                                                                          cfg.stream_idle_timeout_s)
        first = await asyncio.wait_for(call.read(), timeout=wait)
    except grpc.aio.AioRpcError as exc:
        call.cancel()
        if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
            raise GenerateError(exc.code(), exc.details()) from None
        raise _Refused(exc.details(), unreachable=exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED) from None
    except asyncio.TimeoutError:
        call.cancel()
        raise _Refused("timeout", unreachable=True) from None
    except BaseException:  # cancelled: the client left
        call.cancel()
        raise
    if first is grpc.aio.EOF or first.WhichOneof("event") != "allocated":
        call.cancel()
        raise _Refused("no allocation", unreachable=False)
    return call, first.allocated
