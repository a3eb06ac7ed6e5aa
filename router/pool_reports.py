"""Decode workers' KV pools as their request streams report them, fresher than the registry.

The registry holds what each worker's last heartbeat said (``WorkerInfo.num_free_blocks``); between
heartbeats it is stale, and a request that has just ended still holds its blocks in the router's view. A
client that sends its next request on the final message of the last one then met a pool that looked full
(RESOURCE_EXHAUSTED, "retry later") for up to a heartbeat. Every decode stream therefore reports the
worker's pool at the allocation and at the end (``Allocated`` / ``DecodeFinished``: free blocks and the
pool's version, ``BlockPool.snapshot``), and the router keeps, per worker, whichever of the heartbeat's and
the streams' reports has the highest version. Versions start at the pool's creation time in nanoseconds, so
a restarted worker's reports supersede its earlier incarnation's.

    stream report (v, free) ──► keep if v > the worker's entry's pool_version, apply to the view now
    registry read            ──► each entry: a kept report of a higher version replaces its free blocks;
                                 reports the registry caught up with, or of unlisted workers, are dropped
"""

from __future__ import annotations

from dataclasses import replace

from pdserve.cluster.registry import WorkerInfo


class PoolReports:
    """The streams' newest pool report per decode worker (version, free blocks), bounded by the workers
    listed: a report is dropped once the registry shows that version or a later one, or its worker is gone."""

    def __init__(self) -> None:
        self._reports: dict[str, tuple[int, int]] = {}

    def __len__(self) -> int:
        return len(self._reports)

    def report(self, workers: list[WorkerInfo], worker_id: str, version: int, num_free_blocks: int
               ) -> list[WorkerInfo]:
        """``workers`` with ``worker_id``'s free blocks as a stream reported them at ``version``, kept for later
        registry reads; unchanged for a report no newer than what is known (version 0: a worker that does not
        report), or of a worker not in ``workers``."""
        entry = next((w for w in workers if w.worker_id == worker_id), None)
        if entry is None or version <= max(entry.pool_version, self._reports.get(worker_id, (0, 0))[0]):
            return workers
        self._reports[worker_id] = (version, num_free_blocks)
        return [replace(w, num_free_blocks=num_free_blocks, pool_version=version) if w is entry else w
                for w in workers]

    def apply(self, workers: list[WorkerInfo]) -> list[WorkerInfo]:
        """A registry read's ``workers`` with the kept reports newer than their entries applied; reports the
        entries caught up with, and those of workers not listed, are forgotten."""
        out, kept = [], {}
        for w in workers:
            version, free = self._reports.get(w.worker_id, (0, 0))
            if version > w.pool_version:
                kept[w.worker_id] = (version, free)
                w = replace(w, num_free_blocks=free, pool_version=version)
            out.append(w)
        self._reports = kept
        return out
