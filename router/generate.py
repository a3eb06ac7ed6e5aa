"""One request's path through the cluster, as the router drives it:

    choose a decode worker D and open its stream  -> D pre-allocates blocks (``allocated``)
    choose a prefill worker P and call Prefill    -> P runs the prompt, pushes KV + first token to D
    stream the first token (from P's answer), then D's tokens, then ``final``

Every exit path of an attempt cancels what is still open, so the workers free the request's
blocks. When a worker fails under the request the attempt is retried (nothing streamed yet) or
the request is migrated (tokens streamed): see :mod:`router.recovery`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc

from pdserve.cluster.registry import WorkerInfo
from pdserve.model.tokenizer import IncrementalDetokenizer, Tokenizer
from pdserve.proto import pdserve_pb2, worker_pb2, worker_pb2_grpc
from pdserve.proto.convert import FINISH_REASONS, sampling_to_wire
from pdserve.router.admission import Admission
from pdserve.router.config import RouterConfig
from pdserve.router.dispatch import DEFAULT_SECONDS_PER_BLOCK, PrefillStats, rank_decode, rank_prefill
from pdserve.router.recovery import (
    NOT_RETRIABLE,
    GenerateError,
    Progress,
    WorkerFailure,
    avoiding,
)
from pdserve.router.request import RequestState, RequestTimes
from pdserve.router.slo import SloGate
from pdserve.router.validation import ValidRequest

log = logging.getLogger(__name__)

__all__ = ["ClusterView", "GenerateError", "run_generate"]


@dataclass
class ClusterView:
    """What the router knows when it dispatches: live workers, its own in-flight counts,
    and a gRPC channel per worker address. ``workers`` returns the registry's latest read
    (retries then see workers that appeared or lapsed meanwhile); ``eos_token_ids`` are the
    checkpoint's, for the stop check of a request whose worker failed after its last token."""

    workers: Callable[[], list[WorkerInfo]]
    inflight: Counter
    channel: Callable[[str], grpc.aio.Channel]
    stats: dict[str, PrefillStats] = field(default_factory=dict)
    cached_blocks: Callable[[list[int], int], dict[str, int]] = lambda ids, block_size: {}
    on_routed: Callable[[str, list[int], int], None] = lambda worker_id, ids, block_size: None
    gate: SloGate | None = None
    outcomes: Admission | None = None
    eos_token_ids: tuple[int, ...] = ()

    def current(self) -> list[WorkerInfo]:
        """The workers to dispatch to now."""
        return self.workers()


async def _open_decode(view: ClusterView, req: ValidRequest, run_id: str, num_tokens: int, cfg: RouterConfig,
                       progress: Progress, role: str = "decode", candidates: list[WorkerInfo] | None = None,
                       kv_backends: tuple[str, ...] | None = None,
                       ) -> tuple[WorkerInfo, grpc.aio.UnaryStreamCall, worker_pb2.Allocated]:
    """Open a decode stream on the best worker of ``role`` that has room (or the first of
    ``candidates`` that takes it), workers that failed this request last; returns it with its
    allocation, counted in ``view.inflight`` (the caller uncounts it when the request leaves the
    worker). Colocated workers (role ``both``) are asked to prefill the prompt themselves. A migrated
    request's streamed tokens go along as ``prior_output_token_ids``.

    Raises:
        GenerateError: UNAVAILABLE (no worker of ``role``, or none answered), RESOURCE_EXHAUSTED
            (no room), INVALID_ARGUMENT (the worker refused the request).
    """
    if candidates is None:
        candidates = avoiding(rank_decode(view.current(), view.inflight, num_tokens, role, kv_backends),
                              progress.avoid)
    if not candidates:
        if not any(w.role == role for w in view.current()):
            raise GenerateError(grpc.StatusCode.UNAVAILABLE, f"no decode worker is available{progress.history()}")
        raise GenerateError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"no decode worker has free KV blocks for {num_tokens} tokens; retry later")
    last_error, unreachable = "", set()
    for worker in candidates:
        view.inflight[worker.worker_id] += 1  # counted while it answers, so concurrent arrivals spread out
        call = worker_pb2_grpc.DecodeWorkerStub(view.channel(worker.address)).Generate(worker_pb2.DecodeRequest(
            request_id=run_id, prompt_token_ids=req.prompt_ids, sampling=sampling_to_wire(req.sampling),
            kv_timeout_s=cfg.kv_timeout_s, local_prefill=role == "both",
            prior_output_token_ids=progress.generated))
        try:
            first = await asyncio.wait_for(call.read(), timeout=cfg.prefill_timeout_s)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, asyncio.CancelledError) as exc:
            call.cancel()
            view.inflight[worker.worker_id] -= 1
            if isinstance(exc, asyncio.CancelledError):
                raise
            if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise GenerateError(exc.code(), exc.details()) from None
            if not isinstance(exc, grpc.aio.AioRpcError) or exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                unreachable.add(worker.worker_id)  # dead or stuck: the next attempt avoids it
            last_error = f"{worker.worker_id}: {exc.details() if isinstance(exc, grpc.aio.AioRpcError) else 'timeout'}"
            continue
        if first is grpc.aio.EOF or first.WhichOneof("event") != "allocated":
            call.cancel()
            view.inflight[worker.worker_id] -= 1
            last_error = f"{worker.worker_id}: no allocation"
            continue
        return worker, call, first.allocated
    if unreachable:  # e.g. the one worker admission reserved died: retry the dispatch without it
        raise WorkerFailure(unreachable, f"no decode worker could take the request (last: {last_error})")
    code = grpc.StatusCode.RESOURCE_EXHAUSTED if "blocks" in last_error else grpc.StatusCode.UNAVAILABLE
    raise GenerateError(code, f"no decode worker could take the request (last: {last_error}){progress.history()}")


async def run_generate(view: ClusterView, req: ValidRequest, tokenizer: Tokenizer, cfg: RouterConfig,
                       times: RequestTimes, deadline: float | None = None,
                       ) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
    """Drive one request through P and D, yielding the client's messages; a worker failure is
    retried or migrated (:mod:`router.recovery`) up to ``cfg.max_attempts`` dispatches.

    Args:
        deadline: ``time.monotonic()`` by which the client stops waiting (``None``: none given);
            no recovery starts too close to it.
    Raises:
        GenerateError: no worker, no room, a bad request, or workers kept failing.
    """
    internal_id = uuid.uuid4().hex
    workers = view.current()
    colocated = not any(w.role == "prefill" for w in workers) and any(w.role == "both" for w in workers)
    progress = Progress()
    detok = IncrementalDetokenizer(tokenizer, req.prompt_ids)
    stop_ids = req.sampling.stop_ids(view.eos_token_ids)
    finished = False
    try:
        while True:
            reason = progress.finish_reason(req.sampling, stop_ids)
            if reason is not None:  # the failed worker had streamed the last token already
                yield _final(req, times, progress, FINISH_REASONS[reason], len(progress.generated))
                finished = True
                return
            run_id = internal_id if progress.num_attempts == 1 else f"{internal_id}-{progress.num_attempts}"
            attempt = (_run_colocated(view, req, cfg, times, run_id, progress, detok) if colocated else
                       _run_disaggregated(view, req, cfg, times, run_id, progress, detok))
            try:
                async with aclosing(attempt) as messages:
                    async for msg in messages:
                        yield msg
                finished = True
                return
            except WorkerFailure as failure:
                backoff = progress.record(failure, deadline, cfg.max_attempts)
                log.warning("request %s: %s; %s (attempt %d)", req.request_id, failure.message,
                            "migrating" if progress.generated else "retrying", progress.num_attempts)
                await asyncio.sleep(backoff)
    finally:
        if times.dispatched and view.outcomes is not None:  # count its SLO outcome (rejections are counted apart)
            _record_outcome(view.outcomes, req, times, finished)


async def _run_disaggregated(view: ClusterView, req: ValidRequest, cfg: RouterConfig, times: RequestTimes,
                             run_id: str, progress: Progress, detok: IncrementalDetokenizer,
                             ) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
    """One attempt on a prefill and a decode worker. A migrated request's prefill runs prompt +
    the streamed tokens and samples output index ``len(progress.generated)``.

    Raises:
        GenerateError: not retriable (no worker, no room, bad request, not admitted).
        WorkerFailure: a worker failed; the caller decides to retry or migrate.
    """
    state = RequestState.QUEUED
    first_attempt = progress.num_attempts == 1
    pool = [w for w in view.current() if w.role == "prefill"]
    if not pool:
        raise GenerateError(grpc.StatusCode.UNAVAILABLE, f"no prefill worker is available{progress.history()}")
    context = req.prompt_ids + progress.generated  # tokens whose KV the prefill computes
    block_size = pool[0].block_size
    prompt_blocks = len(context) // block_size
    cached = view.cached_blocks(context, block_size)
    prefill = avoiding(rank_prefill(view.current(), prompt_blocks, cached, view.stats, view.inflight,
                                    cfg.spill_queue_s), progress.avoid)[0]
    num_tokens = len(req.prompt_ids) + req.sampling.max_tokens - 1
    work = -(-len(context) // block_size) - min(cached.get(prefill.worker_id, 0), prompt_blocks)  # to compute
    gate = view.gate if first_attempt else None  # admission counts a request once, at its first dispatch
    candidates = None
    view.inflight[prefill.worker_id] += 1  # counted from the moment it is chosen, so concurrent arrivals spread out
    prefill_counted = True
    try:
        if gate is not None:
            candidates = [await _admit(view, req, run_id, prefill, work, num_tokens)]
        decode, stream, allocated = await _open_decode(view, req, run_id, num_tokens, cfg, progress,
                                                       candidates=candidates, kv_backends=prefill.kv_backends)
    except BaseException:
        view.inflight[prefill.worker_id] -= 1
        if candidates is not None:
            await gate.admission.release_prefill(run_id, prefill.worker_id)
            await gate.admission.release_decode(run_id, candidates[0].worker_id)
        raise
    prefill_call = None
    try:
        state = RequestState.PREFILLING
        if first_attempt:
            times.dispatched = time.monotonic()
        prefill_call = worker_pb2_grpc.PrefillWorkerStub(view.channel(prefill.address)).Prefill(
            worker_pb2.PrefillRequest(request_id=run_id, token_ids=context, sampling=sampling_to_wire(req.sampling),
                                      dst_kv_address=allocated.kv_address, dst_block_ids=allocated.block_ids,
                                      first_output_index=len(progress.generated)),
            timeout=cfg.prefill_timeout_s)
        view.on_routed(prefill.worker_id, context, block_size)
        stats = view.stats.setdefault(prefill.worker_id, PrefillStats())
        stats.queued_blocks += work
        try:
            answer = await prefill_call
        except grpc.aio.AioRpcError as exc:
            if exc.code() in NOT_RETRIABLE:
                raise GenerateError(exc.code(), f"prefill worker {prefill.worker_id}: {exc.details()}") from None
            blamed = {prefill.worker_id} | ({decode.worker_id} if stream.done() else set())  # D ended too: suspect
            raise WorkerFailure(blamed, f"prefill worker {prefill.worker_id} failed: {exc.details()}") from None
        finally:
            stats.queued_blocks -= work
            view.inflight[prefill.worker_id] -= 1
            prefill_counted = False
            if gate is not None:
                await gate.admission.release_prefill(run_id, prefill.worker_id)
        state = RequestState.DECODING
        if progress.cached_tokens is None:
            progress.cached_tokens = answer.num_cached_tokens
        progress.generated.append(answer.first_token)
        times.token()
        yield pdserve_pb2.GenerateResponse(text=detok.push([answer.first_token]), token_ids=[answer.first_token])
        async for msg in _relay(stream, decode, detok, times, req, progress):
            yield msg
        state = RequestState.FINISHED
    finally:
        view.inflight[decode.worker_id] -= 1
        if prefill_counted:  # left before the prefill call was awaited
            view.inflight[prefill.worker_id] -= 1
        if state is not RequestState.FINISHED:  # error, failure or client cancel: make both workers let go
            stream.cancel()
            if prefill_call is not None and not prefill_call.done():
                prefill_call.cancel()
        if gate is not None:
            await gate.admission.release_decode(run_id, decode.worker_id)


async def _admit(view: ClusterView, req: ValidRequest, internal_id: str, prefill: WorkerInfo, work_blocks: int,
                 num_tokens: int) -> WorkerInfo:
    """SLO admission: the decode worker whose reservation was taken, waiting up to the request's
    ``queue_timeout_s`` for room.

    Raises:
        GenerateError: RESOURCE_EXHAUSTED with the reason and a retry-after hint.
    """
    stats = view.stats.get(prefill.worker_id)
    prefill_s = work_blocks * (stats.seconds_per_block if stats and stats.seconds_per_block
                               else DEFAULT_SECONDS_PER_BLOCK)
    decode_ttl_s = req.slo.ttft_s + 2 * req.sampling.max_tokens * req.slo.tpot_s + 5
    deadline = time.monotonic() + req.queue_timeout_s
    while True:
        decodes = rank_decode(view.current(), view.inflight, num_tokens, kv_backends=prefill.kv_backends)
        chosen, decision = await view.gate.admit(internal_id, prefill.worker_id, prefill_s, decodes,
                                                 len(req.prompt_ids) + req.sampling.max_tokens // 2, req.slo,
                                                 decode_ttl_s)
        if chosen is not None:
            return chosen
        if decision is None:
            raise GenerateError(grpc.StatusCode.UNAVAILABLE, "no decode worker is available")
        wait = decision.retry_after_s
        if wait is None or time.monotonic() + wait > deadline:
            hint = "retrying cannot help" if wait is None else f"retry after {wait:.3f} s"
            raise GenerateError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"not admitted: {decision.reason} (predicted TTFT {decision.predicted_ttft_s:.3f} s,"
                                f" TPOT {decision.predicted_tpot_s:.4f} s); {hint}")
        await asyncio.sleep(wait)


_outcome_writes: set[asyncio.Task] = set()  # in flight; referenced so that they are not collected


def _record_outcome(outcomes: Admission, req: ValidRequest, times: RequestTimes, finished: bool) -> None:
    """Count the request's SLO outcome in Redis (for ``GetClusterState`` and the autoscaling planner)
    in the background, so that the client's stream never waits for Redis; a failure is logged. A request
    that ended before its first token missed its TTFT SLO, one that did not finish its TPOT SLO."""
    t = times.summary()

    async def write() -> None:
        try:
            await outcomes.record_outcome(t["ttft_s"] if times.num_tokens else None, t["tpot_s"] if finished else None,
                                          req.slo.ttft_s, req.slo.tpot_s)
        except Exception as exc:
            log.warning("SLO outcome not recorded: %s", exc)

    task = asyncio.get_running_loop().create_task(write())
    _outcome_writes.add(task)
    task.add_done_callback(_outcome_writes.discard)


async def _run_colocated(view: ClusterView, req: ValidRequest, cfg: RouterConfig, times: RequestTimes,
                         run_id: str, progress: Progress, detok: IncrementalDetokenizer,
                         ) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
    """Colocated baseline: one worker (role ``both``) prefills and decodes the request (one attempt).

    Raises:
        GenerateError, WorkerFailure: as :func:`_run_disaggregated`.
    """
    num_tokens = len(req.prompt_ids) + req.sampling.max_tokens - 1
    worker, stream, _ = await _open_decode(view, req, run_id, num_tokens, cfg, progress, role="both")
    if progress.num_attempts == 1:
        times.dispatched = time.monotonic()
    finished = False
    try:
        async for msg in _relay(stream, worker, detok, times, req, progress):
            yield msg
        finished = True
    finally:
        view.inflight[worker.worker_id] -= 1
        if not finished:
            stream.cancel()


def _final(req: ValidRequest, times: RequestTimes, progress: Progress, finish_reason: int, num_output_tokens: int,
           fin: worker_pb2.DecodeFinished | None = None) -> pdserve_pb2.GenerateResponse:
    """The client's last message; speculative counts are the last decode worker's."""
    drafted, accepted = (fin.num_draft_tokens, fin.num_accepted_tokens) if fin is not None else (0, 0)
    return pdserve_pb2.GenerateResponse(final=pdserve_pb2.Final(
        finish_reason=finish_reason, request_id=req.request_id,
        usage=pdserve_pb2.Usage(prompt_tokens=len(req.prompt_ids), completion_tokens=num_output_tokens,
                                cached_prompt_tokens=progress.cached_tokens or 0),
        timings=pdserve_pb2.Timings(**times.summary()),
        speculative=pdserve_pb2.SpeculativeStats(num_draft_tokens=drafted, num_accepted_tokens=accepted,
                                                 acceptance_rate=accepted / max(1, drafted)),
        num_retries=progress.num_retries, num_migrations=progress.num_migrations))


async def _relay(stream: grpc.aio.UnaryStreamCall, decode: WorkerInfo, detok: IncrementalDetokenizer,
                 times: RequestTimes, req: ValidRequest, progress: Progress,
                 ) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
    """Turn the decode stream's events into client messages, ending with ``final``; every token
    relayed is recorded in ``progress.generated`` before it is yielded.

    Raises:
        WorkerFailure: the stream failed or ended without ``finished``.
        GenerateError: the worker refused the request (not retriable).
    """
    async for event in _decode_events(stream, decode):
        if event.WhichOneof("event") == "tokens":
            ids = list(event.tokens.token_ids)
            for _ in ids:
                times.token()
            progress.generated.extend(ids)
            yield pdserve_pb2.GenerateResponse(text=detok.push(ids), token_ids=ids)
        elif event.WhichOneof("event") == "finished":
            fin = event.finished
            yield _final(req, times, progress, fin.finish_reason, fin.num_output_tokens, fin)
            return
    raise WorkerFailure({decode.worker_id}, f"decode worker {decode.worker_id} ended the stream early")


async def _decode_events(stream: grpc.aio.UnaryStreamCall, decode: WorkerInfo):
    try:  # read() only: grpc.aio forbids mixing it with async iteration on one call
        while (event := await stream.read()) is not grpc.aio.EOF:
            yield event
    except grpc.aio.AioRpcError as exc:
        if exc.code() in NOT_RETRIABLE:
            raise GenerateError(exc.code(), f"decode worker {decode.worker_id}: {exc.details()}") from None
        raise WorkerFailure({decode.worker_id},
                            f"decode worker {decode.worker_id} failed mid-stream: {exc.details()}") from None
