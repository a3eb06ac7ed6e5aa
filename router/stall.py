"""The stall rule of a decode stream, as the router relays it (:mod:`router.generate`).

A worker that stops answering without closing its connection (SIGSTOPped, partitioned, wedged) fails
its calls too. gRPC keepalive (:mod:`cluster.service`) drops a connection whose peer leaves a ping
unacked for 5 s: within about 15 s when idle, about 5 s when it carries data (gRPC pings those too); the
decode stream's relay adds a rule, ``cfg.stream_idle_timeout_s`` (T), that also catches an engine stuck
behind a connection that still acks. Which events of a decode stream can be far apart::

    from -> to                       apart for                                   bounded by
    allocated -> P's answer          P queues, prefills, sends the KV            prefill_timeout_s (P.Prefill)
    allocated -> first token, colo-  the worker prefills the prompt in chunks,   prefill_timeout_s, from
      cated (no P)                   behind older prompts                        the allocation
    P's answer or a token -> the     one engine step; or many while the request  T, from the worker's last
      next token or finished         waits for a batch slot (max_batch_size      event on ANY of this
                                     reached, or an older request whose KV       router's streams
                                     arrived took its slot back), or while it
                                     waits, preempted, for KV blocks

So after the first token the stream fails (:class:`WorkerFailure`, as a crash: the request migrates)
once T passed with no event from its worker on this stream nor on any other stream this router has
there: a worker that streams other requests is alive, and this one only waits for a slot. Limit: a
request queued behind a batch made only of other routers' requests looks stalled and migrates (its
output is unchanged). ``ClusterView.heard`` holds each decode worker's last event while the router
has requests on it.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from pdserve.cluster.registry import WorkerInfo
from pdserve.proto import worker_pb2
from pdserve.router.recovery import WorkerFailure, rpc_failure


async def decode_events(stream: grpc.aio.UnaryStreamCall, decode: WorkerInfo, watch: StallWatch,
                        pending: asyncio.Future | None = None):
    """The stream's events until EOF. A read that outlasts ``watch``'s bound fails the stream; one
    that merely outlasts T while the worker is heard elsewhere goes on (the same read: cancelling a
    grpc.aio read would cancel the call). ``pending``: a ``stream.read()`` already issued (done or not),
    taken as the first read."""
    read: asyncio.Future | None = None
    try:  # read() only: grpc.aio forbids mixing it with async iteration on one call
        while True:
            read, pending = (pending, None) if pending is not None else (asyncio.ensure_future(stream.read()), None)
            while not read.done():
                left = watch.seconds_left()
                if left <= 0:
                    raise WorkerFailure({decode.worker_id}, watch.stalled_message())
                await asyncio.wait((read,), timeout=left)
            event = read.result()
            if event is grpc.aio.EOF:
                return
            watch.on_event(event)
            yield event
            watch.on_resume()  # a slow client held the relay: that time is not the worker's
    except grpc.aio.AioRpcError as exc:
        who = f"decode worker {decode.worker_id}"
        raise rpc_failure(exc, who, f"{who} failed mid-stream", {decode.worker_id}) from None
    finally:
        if read is not None and not read.done():  # stalled, or the client left: the caller cancels the call
            read.cancel()


class StallWatch:
    """Tells when a decode stream's worker counts as stalled (the rule: this module's docstring).

    Args:
        heard: worker id -> ``time.monotonic()`` of its last event on any of this router's streams
            (``ClusterView.heard``); updated here.
        worker_id: the stream's decode worker.
        idle_s: T, ``stream_idle_timeout_s``, in seconds.
        first_token_s: seconds the worker has for the stream's first token (a colocated worker prefills
            first; T does not apply before it); None when the worker already has the KV (P answered).
    Raises:
        ValueError: ``idle_s`` or ``first_token_s`` is not positive.
    """

    def __init__(self, heard: dict[str, float], worker_id: str, idle_s: float,
                 first_token_s: float | None = None) -> None:
        if idle_s <= 0 or (first_token_s is not None and first_token_s <= 0):
            raise ValueError(f"idle_s and first_token_s must be positive, got {idle_s}, {first_token_s}")
        now = time.monotonic()
        self._heard, self.worker_id, self.idle_s, self._first_token_s = heard, worker_id, idle_s, first_token_s
        self._first_token_by = None if first_token_s is None else now + first_token_s
        self._last = now  # this stream's last event, or the moment the worker had the KV

    def on_event(self, event: worker_pb2.DecodeEvent) -> None:
        """Record an event of the stream (a ``tokens`` event ends the first-token wait)."""
        now = time.monotonic()
        self._last = self._heard[self.worker_id] = now
        if event.WhichOneof("event") == "tokens":
            self._first_token_by = None

    def on_resume(self) -> None:
        """The relay asks for the next event only now (it was sending to a client that reads slowly, whose
        flow-control window was full): the wait for the worker starts here, so time the router spent not
        reading never counts as the worker's silence."""
        self._last = max(self._last, time.monotonic())

    def seconds_left(self) -> float:
        """Seconds until the stream counts as stalled if no event comes (<= 0: it does now)."""
        now = time.monotonic()
        if self._first_token_by is not None:
            return self._first_token_by - now
        return max(self._last, self._heard.get(self.worker_id, self._last)) + self.idle_s - now

    def stalled_message(self) -> str:
        """Why the stream failed, for logs and the final error."""
        if self._first_token_by is not None:
            return (f"colocated worker {self.worker_id} sent no token within prefill_timeout_s "
                    f"({self._first_token_s:g} s)")
        return (f"decode worker {self.worker_id} stalled: no event on any stream for {self.idle_s:g} s "
                f"(stream_idle_timeout_s)")
