"""Which workers serve a request: least-loaded, using the registry's load and the
router's own count of requests in flight (fresher than the last heartbeat)."""

from __future__ import annotations

from collections import Counter

from router.registry import WorkerInfo


def rank_prefill(workers: list[WorkerInfo], inflight: Counter) -> list[WorkerInfo]:
    """Prefill workers, best first: fewest requests in flight from this router, then
    fewest queued prompt tokens, then id (a stable order among equals)."""
    pool = [w for w in workers if w.role == "prefill"]
    return sorted(pool, key=lambda w: (inflight[w.worker_id], w.num_queued_tokens + w.num_waiting, w.worker_id))


def blocks_for(worker: WorkerInfo, num_tokens: int) -> int:
    """KV blocks ``worker`` needs to hold ``num_tokens`` token positions."""
    return -(-num_tokens // worker.block_size)


def rank_decode(workers: list[WorkerInfo], inflight: Counter, num_tokens: int) -> list[WorkerInfo]:
    """Decode workers whose last report had room for ``num_tokens`` positions, best first:
    fewest requests in flight from this router, then most free blocks, then id."""
    pool = [w for w in workers if w.role == "decode" and w.num_free_blocks >= blocks_for(w, num_tokens)]
    return sorted(pool, key=lambda w: (inflight[w.worker_id], -w.num_free_blocks, w.worker_id))
