"""The router's wait for a prefill worker's answer: P computes the KV, pushes it with the first token to
the decode worker D, then answers. While it works, D's stream is watched too, so that D giving the
request up (its KV wait timed out, it failed or is draining) ends the attempt at once, blamed on D,
with P's call cancelled, instead of when P's transfer to D fails (up to ``prefill_timeout_s`` later,
blamed on P)."""

from __future__ import annotations

import asyncio

import grpc

from pdserve.proto import worker_pb2
from pdserve.router.choose import Chosen
from pdserve.router.dispatch import PrefillStats
from pdserve.router.recovery import WorkerFailure, rpc_failure
from pdserve.router.view import ClusterView


async def prefill_or_decode_end(view: ClusterView, chosen: Chosen, prefill_call: grpc.aio.UnaryUnaryCall,
                                 decode_read: asyncio.Future) -> worker_pb2.PrefillResponse:
    """P's answer (:func:`_prefill_answer`), unless D's stream ends first: D gave the request up while P
    worked (its KV wait timed out, it failed or is draining). Then P's call is cancelled, so P drops
    the work, and the attempt fails at once, blamed on D, rather than when P's transfer to D fails. A
    token event D sends before P's answer reaches the router (D has the KV by then) stays in
    ``decode_read`` for the relay.

    Raises:
        GenerateError: P or D refused the request (not retriable).
        WorkerFailure: P failed, or D's stream ended before P answered.
    """
    answer = asyncio.ensure_future(_prefill_answer(view, chosen, prefill_call))
    await asyncio.wait((answer, decode_read), return_when=asyncio.FIRST_COMPLETED)
    if answer.done() or not _ended(decode_read):
        return await answer
    prefill_call.cancel()
    await asyncio.gather(answer, return_exceptions=True)   # its bookkeeping runs; its error is P's cancel
    worker = chosen.decode.worker.worker_id
    exc = None if decode_read.cancelled() else decode_read.exception()
    failure = (f"decode worker {worker} gave the request up before the prefill worker "
               f"{chosen.prefill.worker_id} answered")
    if isinstance(exc, grpc.aio.AioRpcError):
        raise rpc_failure(exc, f"decode worker {worker}", failure, {worker})
    raise WorkerFailure({worker}, f"{failure}: its stream ended")


def _ended(read: asyncio.Future) -> bool:
    """Whether a done ``stream.read()`` ended the stream (an error, cancellation or EOF) rather than
    bringing an event."""
    return read.done() and (read.cancelled() or read.exception() is not None or read.result() is grpc.aio.EOF)


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
        blamed = {prefill.worker_id} | ({decode.worker.worker_id} if decode.call.done() else set())  # D ended too
        who = f"prefill worker {prefill.worker_id}"
        raise rpc_failure(exc, who, f"{who} failed", blamed) from None
    finally:
        stats.queued_blocks -= chosen.work_blocks
        chosen.prefill_count.release()
        if chosen.reservation is not None:
            await chosen.reservation.release_prefill()
