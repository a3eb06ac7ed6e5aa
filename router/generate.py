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

A decode worker that stops answering without closing its connection fails the stream by the stall
rule of :mod:`router.stall`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace

import grpc

from pdserve.cluster.lifecycle import RequestState
from pdserve.cluster.logs import request_fields
from pdserve.cluster.registry import WorkerInfo
from pdserve.model.tokenizer import IncrementalDetokenizer, Tokenizer
from pdserve.proto import pdserve_pb2, worker_pb2, worker_pb2_grpc
from pdserve.proto.convert import FINISH_REASONS
from pdserve.router.admission import Admission
from pdserve.router.choose import Chosen, attempt_sampling, choose_workers, open_decode
from pdserve.router.config import RouterConfig
from pdserve.router.logprobs import logprobs_of, name_tokens, prompt_logprobs_of
from pdserve.router.prefill_answer import prefill_or_decode_end
from pdserve.router.recovery import Progress, WorkerFailure
from pdserve.router.request import RequestTimes
from pdserve.router.stall import StallWatch, decode_events
from pdserve.router.stop_strings import StopMatcher
from pdserve.router.validation import ValidRequest
from pdserve.router.view import ClusterView

log = logging.getLogger(__name__)

__all__ = ["run_generate"]


async def run_generate(view: ClusterView, req: ValidRequest, tokenizer: Tokenizer, cfg: RouterConfig,
                       times: RequestTimes, deadline: float | None = None,
                       ) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
    """Drive one request through P and D, yielding the client's messages; a worker failure is
    retried or migrated (:mod:`router.recovery`) up to ``cfg.max_attempts`` dispatches.

    With ``req.n`` > 1 the request's sequences run as requests of their own (sequence ``i`` seeded
    ``seed + i``, its own attempts and stop-string state), their messages interleaved and marked with
    ``index``: sequence 0 first, the others once it streamed its first token, so that their prompt
    finds its KV in the prefill worker's prefix cache (the router routes them there: pending prefixes).

    Args:
        deadline: ``time.monotonic()`` by which the client stops waiting (``None``: none given);
            no recovery starts too close to it.
    Raises:
        GenerateError: no worker, no room, a bad request, or workers kept failing.
    """
    if req.n == 1:
        async with aclosing(_run_sequence(view, req, tokenizer, cfg, times, deadline)) as messages:
            async for msg in messages:
                yield msg
        return
    async with aclosing(_fan_out(view, req, tokenizer, cfg, times, deadline)) as messages:
        async for msg in messages:
            yield msg


async def _fan_out(view: ClusterView, req: ValidRequest, tokenizer: Tokenizer, cfg: RouterConfig,
                   times: RequestTimes, deadline: float | None) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
    """The ``req.n`` sequences of a request (see :func:`run_generate`); closing this cancels them all."""
    def sequence(i: int) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
        seq = replace(req, n=1, sampling=replace(req.sampling, seed=(req.sampling.seed + i) % 2**64))
        return _run_sequence(view, seq, tokenizer, cfg, times if i == 0 else RequestTimes(), deadline,
                             record_outcome=i == 0)

    queue: asyncio.Queue = asyncio.Queue()
    streams = [sequence(0)]

    async def pump(i: int) -> None:
        try:
            async for msg in streams[i]:
                msg.index = i
                queue.put_nowait((msg, None))
                if i == 0 and len(streams) == 1:  # sequence 0's prompt is cached now: start the others
                    for j in range(1, req.n):
                        streams.append(sequence(j))
                        tasks.append(asyncio.create_task(pump(j)))
        except Exception as exc:
            queue.put_nowait((None, exc))

    tasks = [asyncio.create_task(pump(0))]
    num_finals = 0
    try:
        while num_finals < req.n:
            msg, error = await queue.get()
            if error is not None:
                raise error
            num_finals += msg.HasField("final")
            yield msg
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            await s.aclose()


async def _run_sequence(view: ClusterView, req: ValidRequest, tokenizer: Tokenizer, cfg: RouterConfig,
                        times: RequestTimes, deadline: float | None = None, record_outcome: bool = True,
                        ) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
    """One sequence of a request (:func:`_sequence_messages`), its first message carrying the prompt's length."""
    first = True
    async with aclosing(_sequence_messages(view, req, tokenizer, cfg, times, deadline, record_outcome)) as messages:
        async for msg in messages:
            if first:
                msg.prompt_tokens, first = len(req.prompt_ids), False
            yield msg


async def _sequence_messages(view: ClusterView, req: ValidRequest, tokenizer: Tokenizer, cfg: RouterConfig,
                             times: RequestTimes, deadline: float | None = None, record_outcome: bool = True,
                             ) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
    """One sequence of a request, across its attempts (see :func:`run_generate`). Stop strings are
    matched here (:class:`~router.stop_strings.StopMatcher`, one per sequence, so a migration keeps
    the held text): on a match the attempt is closed, which cancels its calls and frees its blocks,
    and the sequence ends with finish reason STOP."""
    workers = view.current()
    colocated = not any(w.role == "prefill" for w in workers) and any(w.role == "both" for w in workers)
    progress = Progress()
    stop_ids = req.sampling.stop_ids(view.eos_token_ids)
    detok = IncrementalDetokenizer(tokenizer, req.prompt_ids, req.skip_special_tokens,
                                   () if req.include_stop_str_in_output else stop_ids)
    matcher = StopMatcher(req.stop, req.include_stop_str_in_output)
    finished = False
    try:
        while True:
            reason = progress.finish_reason(req.sampling, stop_ids)
            if reason is not None:  # the failed worker had streamed the last token already
                last = _final(req, times, progress, FINISH_REASONS[reason], len(progress.generated))
                last.text = matcher.flush()
                _set_stop_reason(last.final, req, progress)
                yield last
                finished = True
                return
            run = _run_colocated if colocated else _run_disaggregated
            log.info("request %s: attempt %s", req.request_id, progress.attempt_id,
                     extra=request_fields(progress.attempt_id, req.request_id))
            attempt = run(view, req, cfg, times, progress.attempt_id, progress, detok)
            try:
                async with aclosing(attempt) as messages:
                    async for msg in messages:
                        if msg.logprobs:
                            name_tokens(msg.logprobs, tokenizer)
                        if msg.prompt_logprobs:
                            name_tokens(msg.prompt_logprobs, tokenizer)
                        if msg.HasField("final"):
                            msg.text = matcher.flush() + msg.text
                            _set_stop_reason(msg.final, req, progress)
                        else:
                            # armed once the tokens before this message reach min_tokens (vLLM checks no
                            # stop string in the text of the first min_tokens tokens)
                            armed = len(progress.generated) - len(msg.token_ids) >= req.sampling.min_tokens
                            msg.text, matched = matcher.push(msg.text, armed)
                            if matched:  # leaving the loop closes the attempt: its calls are cancelled
                                yield msg
                                last = _final(req, times, progress, pdserve_pb2.FINISH_REASON_STOP,
                                              len(progress.generated))
                                last.final.stop_string = matcher.matched_string
                                yield last
                                finished = True
                                return
                        yield msg
                finished = True
                return
            except WorkerFailure as failure:
                backoff = progress.record(failure, deadline, cfg.max_attempts)
                log.warning("request %s: %s; %s (attempt %d)", req.request_id, failure.message,
                            "migrating" if progress.generated else "retrying", progress.num_attempts,
                            extra=request_fields(progress.attempt_id, req.request_id))
                await asyncio.sleep(backoff)
    finally:
        if record_outcome and times.dispatched and view.outcomes is not None:  # rejections are counted apart
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
        _forget_if_idle(view, chosen.decode.worker.worker_id)
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
    prefill_call = decode_read = None
    try:
        if progress.num_attempts == 1:
            times.dispatched = time.monotonic()
        prefill_call = worker_pb2_grpc.PrefillWorkerStub(view.channel(prefill.address)).Prefill(
            worker_pb2.PrefillRequest(request_id=attempt_id, token_ids=chosen.context,
                                      sampling=attempt_sampling(req.sampling, progress),
                                      dst_kv_address=decode.allocated.kv_address,
                                      dst_block_ids=decode.allocated.block_ids,
                                      first_output_index=len(progress.generated)),
            timeout=cfg.prefill_timeout_s)
        if not req.sampling.cache_salt:    # a salted prefix is cached apart: the index must not expect it
            view.on_routed(prefill.worker_id, chosen.context, chosen.block_size)
        decode_read = asyncio.ensure_future(decode.call.read())  # D giving up is noticed while P works
        answer = await prefill_or_decode_end(view, chosen, prefill_call, decode_read)
        state = RequestState.DECODING
        if progress.cached_tokens is None:
            progress.cached_tokens = answer.num_cached_tokens
        prompt_logprobs = prompt_logprobs_of(req, progress, answer.prompt_logprobs, prefill.worker_id)
        progress.generated.append(answer.first_token)
        times.token()
        yield pdserve_pb2.GenerateResponse(
            text=detok.push([answer.first_token]), token_ids=[answer.first_token],
            logprobs=logprobs_of([answer.first_token], [answer.first_logprobs])
            if req.sampling.logprobs is not None else (), prompt_logprobs=prompt_logprobs)
        watch = StallWatch(view.heard, decode.worker.worker_id, cfg.stream_idle_timeout_s)  # D has the KV now
        async for msg in _relay(view, decode.call, decode.worker, detok, times, req, progress, watch, decode_read):
            yield msg
        state = RequestState.FINISHED
    finally:
        if state is not RequestState.FINISHED:  # error, failure or client cancel: make both workers let go
            decode.call.cancel()
            if prefill_call is not None and not prefill_call.done():
                prefill_call.cancel()
            if decode_read is not None and not decode_read.done():
                decode_read.cancel()


async def _run_colocated(view: ClusterView, req: ValidRequest, cfg: RouterConfig, times: RequestTimes,
                         attempt_id: str, progress: Progress, detok: IncrementalDetokenizer,
                         ) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
    """Colocated baseline: one worker (role ``both``) prefills and decodes the request (one attempt).

    Raises:
        GenerateError, WorkerFailure: as :func:`_run_disaggregated`.
    """
    decode = await open_decode(view, req, attempt_id, len(req.prompt_ids) + len(progress.generated) + 1, cfg,
                               progress, role="both",
                               lifetime_tokens=len(req.prompt_ids) + req.sampling.max_tokens - 1)
    if progress.num_attempts == 1:
        times.dispatched = time.monotonic()
    finished = False
    try:
        with decode.count:
            watch = StallWatch(view.heard, decode.worker.worker_id, cfg.stream_idle_timeout_s,
                               first_token_s=cfg.prefill_timeout_s)  # the worker prefills first
            try:
                async for msg in _relay(view, decode.call, decode.worker, detok, times, req, progress, watch):
                    yield msg
                finished = True
            finally:
                if not finished:
                    decode.call.cancel()
    finally:
        _forget_if_idle(view, decode.worker.worker_id)


def _set_stop_reason(final: pdserve_pb2.Final, req: ValidRequest, progress: Progress) -> None:
    """``final.stop_token_id`` when a token of the request's ``stop_token_ids`` ended the sequence (an EOS
    token leaves it unset, as vLLM's ``stop_reason`` is None then, unless the request listed it itself)."""
    if (final.finish_reason == pdserve_pb2.FINISH_REASON_STOP and progress.generated
            and progress.generated[-1] in req.sampling.stop_token_ids):
        final.stop_token_id = progress.generated[-1]


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


async def _relay(view: ClusterView, stream: grpc.aio.UnaryStreamCall, decode: WorkerInfo,
                 detok: IncrementalDetokenizer, times: RequestTimes, req: ValidRequest, progress: Progress,
                 watch: StallWatch, pending: asyncio.Future | None = None
                 ) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
    """Turn the decode stream's events into client messages, ending with ``final``; every token
    relayed is recorded in ``progress.generated`` before it is yielded. ``pending``: a read of the
    stream already issued (:func:`router.stall.decode_events`). The worker's pool as ``finished`` reports
    it goes to ``view.on_pool`` before the client's ``final``: a client's next request sees the blocks free.

    Raises:
        WorkerFailure: the stream failed, ended without ``finished``, or its worker stalled (``watch``).
        GenerateError: the worker refused the request (not retriable).
    """
    async for event in decode_events(stream, decode, watch, pending):
        if event.WhichOneof("event") == "tokens":
            ids, lps = list(event.tokens.token_ids), list(event.tokens.logprobs)
            prompt_lps = prompt_logprobs_of(req, progress, event.tokens.prompt_logprobs, decode.worker_id)
            # a burst that crosses min_tokens goes out as two messages: stop strings are armed for the second
            cut = req.sampling.min_tokens - len(progress.generated)
            for lo, hi in ((0, cut), (cut, len(ids))) if 0 < cut < len(ids) else ((0, len(ids)),):
                for _ in range(hi - lo):
                    times.token()
                progress.generated.extend(ids[lo:hi])
                yield pdserve_pb2.GenerateResponse(
                    text=detok.push(ids[lo:hi]), token_ids=ids[lo:hi], logprobs=logprobs_of(ids[lo:hi], lps[lo:hi]),
                    prompt_logprobs=prompt_lps if lo == 0 else ())   # a local prefill's, on its first delta
        elif event.WhichOneof("event") == "finished":
            fin = event.finished
            view.on_pool(decode.worker_id, fin.pool_version, fin.num_free_blocks)
            yield _final(req, times, progress, fin.finish_reason, fin.num_output_tokens, fin)
            return
    raise WorkerFailure({decode.worker_id}, f"decode worker {decode.worker_id} ended the stream early")


def _forget_if_idle(view: ClusterView, worker_id: str) -> None:
    """Drop ``worker_id`` from ``view.heard`` once this router has no request on it (bounded state)."""
    if view.inflight[worker_id] <= 0:
        view.heard.pop(worker_id, None)
