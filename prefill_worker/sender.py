"""The prefill worker's KV senders: move pages to decode workers while the engine computes the next
chunks, so compute never waits on a socket.

Jobs for one request arrive in order (pages..., then finish or release). Each destination (a decode
worker's KV address) has a lane of its own, a thread and a queue, so a receiver that stalls (a stopped
process whose kernel still takes the bytes, a congested link) holds up only the transfers bound for it,
for at most the transport's I/O timeout each, never those to other decode workers; one thread for all
had queued every transfer behind a stopped decode worker's acknowledgement waits. A lane opens the
request's channel at its first pages and, after its last job, releases its blocks and delivers the
result; a lane idle for :data:`LANE_IDLE_S` ends, and the next job for its destination starts another.
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


LANE_IDLE_S = 30.0  # seconds a destination's lane waits for a job before its thread ends


class KVSendLoop:
    """Runs the jobs, a lane per destination (module docstring); ``blocks`` takes a request's blocks back,
    ``num_layers`` is the page layer range, ``hold_s`` the fault-injection hold before each done frame
    (tests only; 0 in service). ``on_finished`` is called on the lanes' threads."""

    def __init__(self, sender: KVSender, blocks: BlockSource, num_layers: int,
                 on_finished: Callable[[PrefillRequest, PrefillResult], None], hold_s: float = 0.0) -> None:
        self._hold_s = hold_s  # test hook (PrefillWorkerConfig.fault_hold_transfer_s)
        self._sender, self._blocks, self._num_layers = sender, blocks, num_layers
        self._on_finished = on_finished
        self._lanes: dict[str, _Lane] = {}
        self._lock = threading.Lock()       # the lanes map; held while a job is queued or a lane retires
        self._num_bytes: dict[str, int] = {}

    def submit(self, job: SendPages | Finish | Release) -> None:
        """Queue ``job`` on its destination's lane (every job of a request has the same destination)."""
        dst = job.req.dst_kv_address
        with self._lock:
            lane = self._lanes.get(dst)
            if lane is None:
                lane = self._lanes[dst] = _Lane(self, dst)
                lane.start()
            lane.jobs.put(job)

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish the queued jobs, then stop every lane (waiting ``timeout_s`` seconds in all)."""
        with self._lock:
            lanes = list(self._lanes.values())
            for lane in lanes:
                lane.jobs.put(None)
        deadline = time.monotonic() + timeout_s
        for lane in lanes:
            lane.join(timeout=max(0.0, deadline - time.monotonic()))

    def _retire(self, lane: _Lane) -> bool:
        """Whether idle ``lane`` may end: no job came since its wait timed out (then it is unlisted)."""
        with self._lock:
            if not lane.jobs.empty():
                return False
            if self._lanes.get(lane.dst) is lane:
                del self._lanes[lane.dst]
            return True

    def _do(self, job: SendPages | Finish | Release) -> None:
        """One job; a failure fails its request (delivered at its last job), never the lane."""
        try:
            self._run(job)
        except Exception as exc:  # the request fails; the lane and the worker live on
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


class _Lane(threading.Thread):
    """The thread and queue of one destination's transfers, in submission order."""

    def __init__(self, loop: KVSendLoop, dst: str) -> None:
        super().__init__(name=f"kv-sender {dst}", daemon=True)
        self.loop, self.dst = loop, dst
        self.jobs: queue.SimpleQueue[SendPages | Finish | Release | None] = queue.SimpleQueue()

    def run(self) -> None:
        while True:
            try:
                job = self.jobs.get(timeout=LANE_IDLE_S)
            except queue.Empty:
                if self.loop._retire(self):
                    return
                continue
            if job is None:
                return
            self.loop._do(job)
