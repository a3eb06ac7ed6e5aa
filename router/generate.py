"""One request's path through the cluster, as the router drives it (states: :mod:`cluster.lifecycle`)::

    QUEUED      choose P, admission, open D's stream    -> D pre-allocates blocks (router.choose)
    PREFILLING  call P.Prefill                          -> P runs the prompt, pushes KV + first token to D
    DECODING    stream the first token (P's answer), then D's tokens
    FINISHED    ``final``

Every exit path of an attempt cancels what is still open, so the workers free the request's
blocks, and gives back once what choosing took: each worker's in-flight count
(:class:`~router.choose.InFlight`: P's when its Prefill call returns, D's when the request leaves
D) and admission's reservations. When a worker fails under the request the attempt is retried
(nothing streamed yet) or the request is migrated (tokens streamed): see :mod:`router.recovery`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc

from pdserve.cluster.lifecycle import RequestState
from pdserve.cluster.registry import WorkerInfo
from pdserve.model.tokenizer import IncrementalDetokenizer, Tokenizer
from pdserve.proto import pdserve_pb2, worker_pb2, worker_pb2_grpc
from pdserve.proto.convert import FINISH_REASONS, sampling_to_wire
from pdserve.router.admission import Admission
from pdserve.router.choose import Chosen, ClusterView, choose_workers, open_decode
from pdserve.router.config import RouterConfig
from pdserve.router.dispatch import PrefillStats
from pdserve.router.recovery import NOT_RETRIABLE, GenerateError, Progress, WorkerFailure
from pdserve.router.request import RequestTimes
from pdserve.router.validation import ValidRequest

log = logging.getLogger(__name__)

__all__ = ["ClusterView", "GenerateError", "run_generate"]


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
            run = _run_colocated if colocated else _run_disaggregated
            attempt = run(view, req, cfg, times, progress.attempt_id, progress, detok)
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
                             attempt_id: str, progress: Progress, detok: IncrementalDetokenizer,
                             ) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
    """One attempt on a prefill and a decode worker: choose them (QUEUED), then stream. A migrated
    request's prefill runs prompt + the streamed tokens and samples output index ``len(progress.generated)``.

    Raises:
        GenerateError: not retriable (no worker, no room, bad request, not admitted).
        WorkerFailure: a worker failed; the caller decides to retry or migrate.
    """
    chosen = await choose_workers(view, req, cfg, attempt_id, progress)
    try:
        with chosen.prefill_count, chosen.decode.count:
            async with aclosing(_stream(view, req, cfg, times, attempt_id, progress, detok, chosen)) as messages:
                async for msg in messages:
                    yield msg
    finally:
        if chosen.reservation is not None:
            await chosen.reservation.release()


async def _stream(view: ClusterView, req: ValidRequest, cfg: RouterConfig, times: RequestTimes, attempt_id: str,
                  progress: Progress, detok: IncrementalDetokenizer, chosen: Chosen,
                  ) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
    """PREFILLING -> DECODING -> FINISHED on the chosen workers: P.Prefill (P computes the KV and
    pushes it with the first token to D), the first token from P's answer, then D's stream. Leaving
    before FINISHED (error, failure, client cancel) cancels both calls, so both workers let go.

    Raises:
        GenerateError, WorkerFailure: as :func:`_run_disaggregated`.
    """
    state = RequestState.PREFILLING
    prefill, decode = chosen.prefill, chosen.decode
    prefill_call = None
    try:
        if progress.num_attempts == 1:
            times.dispatched = time.monotonic()
        prefill_call = worker_pb2_grpc.PrefillWorkerStub(view.channel(prefill.address)).Prefill(
            worker_pb2.PrefillRequest(request_id=attempt_id, token_ids=chosen.context,
                                      sampling=sampling_to_wire(req.sampling),
                                      dst_kv_address=decode.allocated.kv_address,
                                      dst_block_ids=decode.allocated.block_ids,
                                      first_output_index=len(progress.generated)),
            timeout=cfg.prefill_timeout_s)
        view.on_routed(prefill.worker_id, chosen.context, chosen.block_size)
        answer = await _prefill_answer(view, chosen, prefill_call)
        state = RequestState.DECODING
        if progress.cached_tokens is None:
            progress.cached_tokens = answer.num_cached_tokens
        progress.generated.append(answer.first_token)
        times.token()
        yield pdserve_pb2.GenerateResponse(text=detok.push([answer.first_token]), token_ids=[answer.first_token])
        async for msg in _relay(decode.call, decode.worker, detok, times, req, progress):
            yield msg
        state = RequestState.FINISHED
    finally:
        if state is not RequestState.FINISHED:  # error, failure or client cancel: make both workers let go
            decode.call.cancel()
            if prefill_call is not None and not prefill_call.done():
                prefill_call.cancel()


async def _prefill_answer(view: ClusterView, chosen: Chosen, call: grpc.aio.UnaryUnaryCall,
                          ) -> worker_pb2.PrefillResponse:
    """P's answer once the KV and the first token reached D. However the call returns, P's queued
    work, its in-flight count and its admission reservation are given back at once.

    Raises:
        GenerateError: P refused the request (not retriable).
        WorkerFailure: P failed (D is blamed too when its stream ended meanwhile).
    """
    prefill, decode = chosen.prefill, chosen.decode
    stats = view.stats.setdefault(prefill.worker_id, PrefillStats())
    stats.queued_blocks += chosen.work_blocks
    try:
        return await call
    except grpc.aio.AioRpcError as exc:
        if exc.code() in NOT_RETRIABLE:
            raise GenerateError(exc.code(), f"prefill worker {prefill.worker_id}: {exc.details()}") from None
        blamed = {prefill.worker_id} | ({decode.worker.worker_id} if decode.call.done() else set())  # D ended too
        raise WorkerFailure(blamed, f"prefill worker {prefill.worker_id} failed: {exc.details()}") from None
    finally:
        stats.queued_blocks -= chosen.work_blocks
        chosen.prefill_count.release()
        if chosen.reservation is not None:
            await chosen.reservation.release_prefill()


async def _run_colocated(view: ClusterView, req: ValidRequest, cfg: RouterConfig, times: RequestTimes,
                         attempt_id: str, progress: Progress, detok: IncrementalDetokenizer,
                         ) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
    """Colocated baseline: one worker (role ``both``) prefills and decodes the request (one attempt).

    Raises:
        GenerateError, WorkerFailure: as :func:`_run_disaggregated`.
    """
    num_tokens = len(req.prompt_ids) + req.sampling.max_tokens - 1
    decode = await open_decode(view, req, attempt_id, num_tokens, cfg, progress, role="both")
    if progress.num_attempts == 1:
        times.dispatched = time.monotonic()
    finished = False
    with decode.count:
        try:
            async for msg in _relay(decode.call, decode.worker, detok, times, req, progress):
                yield msg
            finished = True
        finally:
            if not finished:
                decode.call.cancel()


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
