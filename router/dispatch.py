"""Which workers serve a request: one small policy per pool, pure functions of the state
the router knows (the registry's last reports, the prefix index, its own in-flight work).

Prefill worker ``w`` for a prompt of ``B`` blocks, of which ``cached[w]`` are already in
``w``'s prefix cache::

    cost(w) = (B - cached[w]) * seconds_per_block(w) + queued_blocks(w) * seconds_per_block(w)
              └── compute this request needs ──┘   └────── work already waiting ───────┘

lowest cost first, ties broken by load (requests running + waiting + in flight) and
then at random, never by a fixed order. A hot prefix must not pile every request onto
one worker: when the cheapest worker's queue is past ``spill_queue_s`` seconds, the
cheapest worker below that bound goes first instead (spill). This is the cost model of
cache-aware routers such as SGLang's router and NVIDIA Dynamo's KV router.

Decode worker: among those whose last report had room for the request's blocks, the
smallest running batch (with this router's in-flight requests), then the most free blocks.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from pdserve.cluster.registry import WorkerInfo
from pdserve.kvtransfer.backends import choose_backend

DEFAULT_SECONDS_PER_BLOCK = 1e-3  # before any measurement: only ratios between workers matter then


def blocks_for(worker: WorkerInfo, num_tokens: int) -> int:
    """KV blocks ``worker`` needs to hold ``num_tokens`` token positions."""
    return -(-num_tokens // worker.block_size)


@dataclass
class PrefillStats:
    """What this router measured of one prefill worker.

    Attributes:
        seconds_per_block: prefill seconds per computed (uncached) block, as the worker measures
            its own steps (``WorkerInfo.prefill_s_per_block``); ``None`` before its first report.
        queued_blocks: uncached blocks this router dispatched there and has not had answered.
    """

    seconds_per_block: float | None = None
    queued_blocks: int = 0


def _load(w: WorkerInfo, inflight: Counter) -> int:
    return w.num_running + w.num_waiting + inflight[w.worker_id]


def rank_prefill(workers: list[WorkerInfo], prompt_blocks: int, cached: dict[str, int],
                 stats: dict[str, PrefillStats], inflight: Counter, spill_queue_s: float,
                 rng: random.Random | None = None) -> list[WorkerInfo]:
    """Prefill workers, best first, by the cost model above.

    Args:
        workers: the registry's workers (other roles are ignored).
        prompt_blocks: full blocks of the prompt.
        cached: leading blocks of the prompt each worker holds (from the prefix index).
        stats: the router's measurements per worker id (missing: nothing measured yet).
        inflight: this router's requests in flight per worker id.
        spill_queue_s: queue length in seconds beyond which the best worker spills.
        rng: tie-break randomness (seedable in tests).
    """
    rng = rng or random.Random()
    pool = [w for w in workers if w.role == "prefill"]
    measured = [s.seconds_per_block for s in stats.values() if s.seconds_per_block]
    fallback = sum(measured) / len(measured) if measured else DEFAULT_SECONDS_PER_BLOCK

    def spb(w: WorkerInfo) -> float:
        s = stats.get(w.worker_id)
        return s.seconds_per_block if s and s.seconds_per_block else fallback

    def queue_s(w: WorkerInfo) -> float:  # the fresher of the router's count and the worker's own report
        mine = stats[w.worker_id].queued_blocks if w.worker_id in stats else 0
        return max(mine, blocks_for(w, w.num_queued_tokens)) * spb(w)

    def cost(w: WorkerInfo) -> float:
        return (prompt_blocks - min(cached.get(w.worker_id, 0), prompt_blocks)) * spb(w) + queue_s(w)

    ranked = sorted(pool, key=lambda w: (cost(w), _load(w, inflight), rng.random()))
    if ranked and queue_s(ranked[0]) > spill_queue_s:
        below = [w for w in ranked if queue_s(w) <= spill_queue_s]
        if below:
            ranked.remove(below[0])
            ranked.insert(0, below[0])
    return ranked


def _shares_transport(prefill_backends: tuple[str, ...], decode_backends: tuple[str, ...]) -> bool:
    try:
        choose_backend(prefill_backends or ("tcp",), decode_backends or ("tcp",))
    except ValueError:
        return False
    return True


def _pool_holds(worker: WorkerInfo, lifetime_tokens: int) -> bool:
    """Whether ``worker``'s whole KV pool holds ``lifetime_tokens`` positions (prompt + max_tokens - 1)."""
    return worker.num_total_blocks >= blocks_for(worker, lifetime_tokens)


def no_pool_holds(workers: list[WorkerInfo], role: str, lifetime_tokens: int) -> bool:
    """True when there are workers of ``role`` and none has a KV pool for ``lifetime_tokens`` positions (prompt +
    max_tokens - 1): the request can never be served here, however long it waits."""
    pool = [w for w in workers if w.role == role]
    return bool(pool) and not any(_pool_holds(w, lifetime_tokens) for w in pool)


def rank_decode(workers: list[WorkerInfo], inflight: Counter, num_tokens: int, role: str = "decode",
                kv_backends: tuple[str, ...] | None = None, lifetime_tokens: int = 0) -> list[WorkerInfo]:
    """Workers of ``role`` (``decode``, or ``both`` for colocated ones) whose last report had room
    for ``num_tokens`` positions (the blocks a worker takes to admit a request: its context and the next
    token's position) and whose pool can hold ``lifetime_tokens`` (prompt + max_tokens - 1; a worker
    takes more blocks as the request grows), best first: smallest running batch counting this router's
    in-flight requests, then most free blocks. With ``kv_backends`` (the chosen prefill worker's),
    only workers sharing a KV transport with it (:func:`kvtransfer.backends.choose_backend`)."""
    pool = [w for w in workers if w.role == role and w.num_free_blocks >= blocks_for(w, num_tokens)
            and _pool_holds(w, lifetime_tokens)
            and (kv_backends is None or _shares_transport(kv_backends, w.kv_backends))]
    return sorted(pool, key=lambda w: (w.num_running + inflight[w.worker_id], -w.num_free_blocks, w.worker_id))
