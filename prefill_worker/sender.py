"""The prefill worker's KV sender thread: moves pages to decode workers while the
engine computes the next chunks, so compute never waits on a socket.

Jobs for one request arrive in order (pages..., then finish or release) on one
queue; the thread opens the request's channel at its first pages and, after its
last job, releases its blocks and delivers the result.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.cluster.lifecycle import RequestState
from pdserve.kvtransfer import KVSender, TransferError
from pdserve.prefill_worker.blocks import BlockSource
from pdserve.prefill_worker.request import PrefillRequest, PrefillResult

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SendPages:
    """Send the request's blocks ``[start, end)`` (all layers)."""

    req: PrefillRequest
    start: int
    end: int


@dataclass(frozen=True)
class Finish:
    """All pages handed over: send the first token, wait for the ack, release, deliver."""

    req: PrefillRequest


@dataclass(frozen=True)
class Release:
    """The request ended early (aborted or failed): abort the channel, release, deliver the error."""

    req: PrefillRequest
    reason: str


class KVSendLoop(threading.Thread):
    """Runs the jobs; ``blocks`` takes a request's blocks back, ``num_layers`` is the page layer range,
    ``hold_s`` the fault-injection hold before each done frame (tests only; 0 in service)."""

    def __init__(self, sender: KVSender, blocks: BlockSource, num_layers: int,
                 on_finished: Callable[[PrefillRequest, PrefillResult], None], hold_s: float = 0.0) -> None:
        super().__init__(name="kv-sender", daemon=True)
        self._hold_s = hold_s  # test hook (PrefillWorkerConfig.fault_hold_transfer_s)
        self._sender, self._blocks, self._num_layers = sender, blocks, num_layers
        self._on_finished = on_finished
        self._jobs: queue.SimpleQueue[SendPages | Finish | Release | None] = queue.SimpleQueue()
        self._num_bytes: dict[str, int] = {}

    def submit(self, job: SendPages | Finish | Release) -> None:
        self._jobs.put(job)

    def close(self) -> None:
        """Finish the queued jobs, then stop."""
        self._jobs.put(None)
        self.join(timeout=10)

    def run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._run(job)
            except Exception as exc:  # the request fails; the thread and the worker live on
                if not isinstance(exc, TransferError):
                    log.exception("KV transfer of %s failed", job.req.attempt_id)
                job.req.error = job.req.error or f"KV transfer to {job.req.dst_kv_address} failed: {exc}"
                if isinstance(job, (Finish, Release)):
                    self._end(job.req)

    def _run(self, job: SendPages | Finish | Release) -> None:
        req = job.req
        if isinstance(job, Release):
            req.error = req.error or job.reason
            self._end(req)
        elif req.error:
            if isinstance(job, Finish):
                self._end(req)
        elif isinstance(job, SendPages):
            if req.channel is None:
                req.first_page_at = time.monotonic()
                req.channel = self._sender.open(req.attempt_id, req.dst_kv_address)  # the transfer's request id
            req.channel.send_pages((0, self._num_layers), req.block_table[job.start:job.end],
                                   req.dst_block_ids[job.start:job.end])
        else:
            if self._hold_s and req.channel is not None:
                time.sleep(self._hold_s)  # fault injection: pages sent, done frame not yet
            stats = req.channel.finish(req.first_token)
            self._num_bytes[req.attempt_id] = stats.num_bytes
            self._end(req)

    def _end(self, req: PrefillRequest) -> None:
        """Last job of the request (TRANSFERRING, or PREFILLING when it failed): close the channel if it
        failed, release its blocks, deliver; the request is FINISHED."""
        if req.state is RequestState.FINISHED:
            return
        done_at = time.monotonic()
        if req.error and req.channel is not None:
            req.channel.abort(req.error)
        req.state = RequestState.FINISHED
        self._blocks.release(req.block_table)
        num_bytes = self._num_bytes.pop(req.attempt_id, 0)
        if req.error:
            result = PrefillResult(error=req.error)
        else:
            result = PrefillResult(
                first_token=req.first_token, queue_s=req.admitted_at - req.arrived_at,
                prefill_s=req.computed_at - req.admitted_at, transfer_s=done_at - req.first_page_at,
                transfer_tail_s=done_at - req.computed_at, num_kv_bytes=num_bytes,
                num_cached_tokens=req.num_cached_tokens)
        self._on_finished(req, result)
