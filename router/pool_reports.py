"""Decode workers' KV pools as their request streams report them, fresher than the registry.

The registry holds what each worker's last heartbeat said (``WorkerInfo.num_free_blocks``); between
heartbeats it is stale, and a request that has just ended still holds its blocks in the router's view. A
client that sends its next request on the final message of the last one then met a pool that looked full
(RESOURCE_EXHAUSTED, "retry later") for up to a heartbeat. Every decode stream therefore reports the
worker's pool at the allocation and at a normal end (``Allocated`` / ``DecodeFinished``: free blocks and the
pool's version, ``BlockPool.snapshot``), and the router keeps, per worker, whichever of the heartbeat's and
the streams' reports has the highest version. Versions start at the pool's creation time in nanoseconds, so
a restarted worker's reports supersede its earlier incarnation's; and since a report only bridges the gap to
the worker's next heartbeat, one kept longer than the worker's lease is dropped, so that even a stale
incarnation's report (a worker restarted under the same id on a clock that stepped back) rules the view for
a lease at most. A request that is cancelled or fails ends without the end's report (its stream is gone or
carries an error): the decode worker renews its registry entry as soon as its blocks are freed
(``Heartbeat.nudge``), and the router's next registry read carries them.

    stream report (v, free) ──► keep if v > the worker's entry's pool_version, apply to the view now
    registry read            ──► each entry: a kept report of a higher version, younger than the entry's
                                 lease, replaces its free blocks; others, and those of unlisted workers, go
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from pdserve.cluster.registry import WorkerInfo

DEFAULT_LEASE_S = 3.0
"""How long a report is kept for a worker whose entry gives no ``lease_s`` (seconds; the workers' default)."""


class PoolReports:
    """The streams' newest pool report per decode worker (version, free blocks, when it came), bounded by the
    workers listed: a report is dropped once the registry shows that version or a later one, once it is older
    than its worker's lease, or when its worker is gone. ``clock``: seconds, ``time.monotonic`` by default."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._reports: dict[str, tuple[int, int, float]] = {}
        self._clock = clock

    def __len__(self) -> int:
        return len(self._reports)

    def report(self, workers: list[WorkerInfo], worker_id: str, version: int, num_free_blocks: int
               ) -> list[WorkerInfo]:
        """``workers`` with ``worker_id``'s free blocks as a stream reported them at ``version``, kept for later
        registry reads; unchanged for a report no newer than what is known (version 0: a worker that does not
        report), or of a worker not in ``workers``."""
        entry = next((w for w in workers if w.worker_id == worker_id), None)
        kept = self._live(entry) if entry is not None else None
        if entry is None or version <= max(entry.pool_version, kept[0] if kept else 0):
            return workers
        self._reports[worker_id] = (version, num_free_blocks, self._clock())
        return [replace(w, num_free_blocks=num_free_blocks, pool_version=version) if w is entry else w
                for w in workers]

    def apply(self, workers: list[WorkerInfo]) -> list[WorkerInfo]:
        """A registry read's ``workers`` with the kept reports newer than their entries applied; reports the
        entries caught up with, older than their workers' lease, or of workers not listed are forgotten."""
        out, kept = [], {}
        for w in workers:
            report = self._live(w)
            if report is not None and report[0] > w.pool_version:
                kept[w.worker_id] = report
                w = replace(w, num_free_blocks=report[1], pool_version=report[0])
            out.append(w)
        self._reports = kept
        return out

    def _live(self, entry: WorkerInfo) -> tuple[int, int, float] | None:
        """The report kept for ``entry``'s worker, unless it is older than the worker's lease."""
        report = self._reports.get(entry.worker_id)
        lease = entry.lease_s if entry.lease_s > 0 else DEFAULT_LEASE_S
        return report if report is not None and self._clock() - report[2] <= lease else None
