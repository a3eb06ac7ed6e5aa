"""One request's path through the cluster, as the router drives it:

    choose a decode worker D and open its stream  -> D pre-allocates blocks (``allocated``)
    choose a prefill worker P and call Prefill    -> P runs the prompt, pushes KV + first token to D
    stream the first token (from P's answer), then D's tokens, then ``final``

Every exit path cancels what is still open, so the workers free the request's blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from model.tokenizer import IncrementalDetokenizer, Tokenizer
from proto import pdserve_pb2, worker_pb2, worker_pb2_grpc
from proto.convert import sampling_to_wire
from router.config import RouterConfig
from router.dispatch import DEFAULT_SECONDS_PER_BLOCK, PrefillStats, rank_decode, rank_prefill
from router.registry import WorkerInfo
from router.request import RequestState, RequestTimes
from router.slo import SloGate
from router.validation import ValidRequest

log = logging.getLogger(__name__)


class GenerateError(Exception):
    """Ends the client's stream with ``code`` and ``message``."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class ClusterView:
    """What the router knows when it dispatches: live workers, its own in-flight counts,
    and a gRPC channel per worker address."""

    workers: list[WorkerInfo]
    inflight: Counter
    channel: Callable[[str], grpc.aio.Channel]
    stats: dict[str, PrefillStats] = field(default_factory=dict)
    cached_blocks: Callable[[list[int], int], dict[str, int]] = lambda ids, block_size: {}
    on_routed: Callable[[str, list[int], int], None] = lambda worker_id, ids, block_size: None
    gate: SloGate | None = None


async def _open_decode(view: ClusterView, req: ValidRequest, internal_id: str, num_tokens: int,
                       cfg: RouterConfig, role: str = "decode", candidates: list[WorkerInfo] | None = None,
                       ) -> tuple[WorkerInfo, grpc.aio.UnaryStreamCall, worker_pb2.Allocated]:
    """Open a decode stream on the best worker of ``role`` that has room (or the first of
    ``candidates`` that takes it); returns it with its allocation. Colocated workers (role
    ``both``) are asked to prefill the prompt themselves."""
    if candidates is None:
        candidates = rank_decode(view.workers, view.inflight, num_tokens, role)
    if not candidates:
        if not any(w.role == role for w in view.workers):
            raise GenerateError(grpc.StatusCode.UNAVAILABLE, "no decode worker is available")
        raise GenerateError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"no decode worker has free KV blocks for {num_tokens} tokens; retry later")
    last_error = ""
    for worker in candidates:
        call = worker_pb2_grpc.DecodeWorkerStub(view.channel(worker.address)).Generate(worker_pb2.DecodeRequest(
            request_id=internal_id, prompt_token_ids=req.prompt_ids, sampling=sampling_to_wire(req.sampling),
            kv_timeout_s=cfg.kv_timeout_s, local_prefill=role == "both"))
        try:
            first = await asyncio.wait_for(call.read(), timeout=cfg.prefill_timeout_s)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError) as exc:
            call.cancel()
            if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise GenerateError(exc.code(), exc.details()) from None
            last_error = f"{worker.worker_id}: {exc.details() if isinstance(exc, grpc.aio.AioRpcError) else 'timeout'}"
            continue
        if first is grpc.aio.EOF or first.WhichOneof("event") != "allocated":
            call.cancel()
            last_error = f"{worker.worker_id}: no allocation"
            continue
        return worker, call, first.allocated
    code = grpc.StatusCode.RESOURCE_EXHAUSTED if "blocks" in last_error else grpc.StatusCode.UNAVAILABLE
    raise GenerateError(code, f"no decode worker could take the request (last: {last_error})")


async def run_generate(view: ClusterView, req: ValidRequest, tokenizer: Tokenizer, cfg: RouterConfig,
                       times: RequestTimes) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
    """Drive one request through P and D, yielding the client's messages.

    Raises:
        GenerateError: no worker, no room, or a worker failed (also after tokens were streamed).
    """
    internal_id = uuid.uuid4().hex
    state = RequestState.QUEUED
    pool = [w for w in view.workers if w.role == "prefill"]
    if not pool and any(w.role == "both" for w in view.workers):
        async for msg in _run_colocated(view, req, tokenizer, cfg, times, internal_id):
            yield msg
        return
    if not pool:
        raise GenerateError(grpc.StatusCode.UNAVAILABLE, "no prefill worker is available")
    block_size = pool[0].block_size
    prompt_blocks = len(req.prompt_ids) // block_size
    cached = view.cached_blocks(req.prompt_ids, block_size)
    prefill = rank_prefill(view.workers, prompt_blocks, cached, view.stats, view.inflight, cfg.spill_queue_s)[0]
    num_tokens = len(req.prompt_ids) + req.sampling.max_tokens - 1
    work = -(-len(req.prompt_ids) // block_size) - min(cached.get(prefill.worker_id, 0), prompt_blocks)  # to compute
    candidates = None
    if view.gate is not None:
        candidates = [await _admit(view, req, internal_id, prefill, work, num_tokens)]
    try:
        decode, stream, allocated = await _open_decode(view, req, internal_id, num_tokens, cfg,
                                                       candidates=candidates)
    except BaseException:
        if view.gate is not None:
            await view.gate.admission.release_prefill(internal_id, prefill.worker_id)
            await view.gate.admission.release_decode(internal_id, candidates[0].worker_id)
        raise
    view.inflight[decode.worker_id] += 1
    view.inflight[prefill.worker_id] += 1
    prefill_call = None
    detok = IncrementalDetokenizer(tokenizer, req.prompt_ids)
    try:
        state, times.dispatched = RequestState.PREFILLING, time.monotonic()
        prefill_call = worker_pb2_grpc.PrefillWorkerStub(view.channel(prefill.address)).Prefill(
            worker_pb2.PrefillRequest(request_id=internal_id, token_ids=req.prompt_ids,
                                      sampling=sampling_to_wire(req.sampling),
                                      dst_kv_address=allocated.kv_address, dst_block_ids=allocated.block_ids),
            timeout=cfg.prefill_timeout_s)
        view.on_routed(prefill.worker_id, req.prompt_ids, block_size)
        stats = view.stats.setdefault(prefill.worker_id, PrefillStats())
        stats.queued_blocks += work
        try:
            answer = await prefill_call
        except grpc.aio.AioRpcError as exc:
            raise GenerateError(grpc.StatusCode.UNAVAILABLE,
                                f"prefill worker {prefill.worker_id} failed: {exc.details()}") from None
        finally:
            stats.queued_blocks -= work
            view.inflight[prefill.worker_id] -= 1
            if view.gate is not None:
                await view.gate.admission.release_prefill(internal_id, prefill.worker_id)
        state = RequestState.DECODING
        times.token()
        yield pdserve_pb2.GenerateResponse(text=detok.push([answer.first_token]), token_ids=[answer.first_token])
        async for msg in _relay(stream, decode, detok, times, req, answer.num_cached_tokens):
            yield msg
        state = RequestState.FINISHED
    finally:
        view.inflight[decode.worker_id] -= 1
        if view.gate is not None:
            await _settle(view.gate, req, internal_id, decode, times, state is RequestState.FINISHED)
        if state is not RequestState.FINISHED:  # error or client cancel: make both workers let go
            stream.cancel()
            if prefill_call is not None and not prefill_call.done():
                prefill_call.cancel()


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
        decodes = rank_decode(view.workers, view.inflight, num_tokens)
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


async def _settle(gate: SloGate, req: ValidRequest, internal_id: str, decode: WorkerInfo, times: RequestTimes,
                  finished: bool) -> None:
    """Release the decode reservation and count the request's SLO outcome."""
    await gate.admission.release_decode(internal_id, decode.worker_id)
    t = times.summary()
    await gate.admission.record_outcome(t["ttft_s"] if times.num_tokens else None,
                                        t["tpot_s"] if finished else None, req.slo.ttft_s, req.slo.tpot_s)


async def _run_colocated(view: ClusterView, req: ValidRequest, tokenizer: Tokenizer, cfg: RouterConfig,
                         times: RequestTimes, internal_id: str) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
    """Colocated baseline: one worker (role ``both``) prefills and decodes the request."""
    num_tokens = len(req.prompt_ids) + req.sampling.max_tokens - 1
    worker, stream, _ = await _open_decode(view, req, internal_id, num_tokens, cfg, role="both")
    view.inflight[worker.worker_id] += 1
    times.dispatched = time.monotonic()
    finished = False
    try:
        async for msg in _relay(stream, worker, IncrementalDetokenizer(tokenizer, req.prompt_ids), times, req, 0):
            yield msg
        finished = True
    finally:
        view.inflight[worker.worker_id] -= 1
        if not finished:
            stream.cancel()


async def _relay(stream: grpc.aio.UnaryStreamCall, decode: WorkerInfo, detok: IncrementalDetokenizer,
                 times: RequestTimes, req: ValidRequest, cached_tokens: int,
                 ) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
    """Turn the decode stream's events into client messages, ending with ``final``.

    Raises:
        GenerateError: the stream failed or ended without ``finished``.
    """
    async for event in _decode_events(stream, decode):
        if event.WhichOneof("event") == "tokens":
            ids = list(event.tokens.token_ids)
            for _ in ids:
                times.token()
            yield pdserve_pb2.GenerateResponse(text=detok.push(ids), token_ids=ids)
        elif event.WhichOneof("event") == "finished":
            fin = event.finished
            yield pdserve_pb2.GenerateResponse(final=pdserve_pb2.Final(
                finish_reason=fin.finish_reason, request_id=req.request_id,
                usage=pdserve_pb2.Usage(prompt_tokens=len(req.prompt_ids), completion_tokens=fin.num_output_tokens,
                                        cached_prompt_tokens=cached_tokens),
                timings=pdserve_pb2.Timings(**times.summary()),
                speculative=pdserve_pb2.SpeculativeStats(
                    num_draft_tokens=fin.num_draft_tokens, num_accepted_tokens=fin.num_accepted_tokens,
                    acceptance_rate=fin.num_accepted_tokens / max(1, fin.num_draft_tokens))))
            return
    raise GenerateError(grpc.StatusCode.INTERNAL, f"decode worker {decode.worker_id} ended the stream early")


async def _decode_events(stream: grpc.aio.UnaryStreamCall, decode: WorkerInfo):
    try:  # read() only: grpc.aio forbids mixing it with async iteration on one call
        while (event := await stream.read()) is not grpc.aio.EOF:
            yield event
    except grpc.aio.AioRpcError as exc:
        raise GenerateError(exc.code() if exc.code() != grpc.StatusCode.CANCELLED else grpc.StatusCode.UNAVAILABLE,
                            f"decode worker {decode.worker_id} failed mid-stream: {exc.details()}") from None
