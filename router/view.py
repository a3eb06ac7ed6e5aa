"""What the router knows when it dispatches one attempt (:class:`ClusterView`), and the in-flight count of one
request on one worker (:class:`InFlight`): shared by choosing workers (``router.choose``), admission
(``router.admit``) and streaming (``router.generate``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from pdserve.cluster.registry import WorkerInfo
from pdserve.router.admission import Admission
from pdserve.router.dispatch import PrefillStats
from pdserve.router.room_queue import RoomQueue
from pdserve.router.slo import SloGate


class InFlight:
    """One request counted on one worker in a router's in-flight counts (``counts[worker_id]``),
    from construction until :meth:`release` or the end of its ``with`` block, whichever comes
    first: every exit path uncounts exactly once."""

    def __init__(self, counts: Counter, worker_id: str) -> None:
        self._counts, self.worker_id, self._held = counts, worker_id, True
        counts[worker_id] += 1

    def release(self) -> None:
        """Uncount the worker; later calls do nothing."""
        if self._held:
            self._held = False
            self._counts[self.worker_id] -= 1

    def __enter__(self) -> InFlight:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


@dataclass
class ClusterView:
    """What the router knows when it dispatches: live workers, its own in-flight counts,
    and a gRPC channel per worker address. ``workers`` returns the registry's latest read
    (retries then see workers that appeared or lapsed meanwhile); ``eos_token_ids`` are the
    checkpoint's, for the stop check of a request whose worker failed after its last token.
    ``heard`` maps a decode worker's id to the ``time.monotonic()`` of its last event on any of the
    router's streams (one dict per router; :mod:`router.generate` keeps it, for the stall rule of
    :mod:`router.stall`). ``on_pool(worker_id, version, num_free_blocks)`` takes a decode worker's KV pool as its
    request streams report it (at the allocation and at a request's normal end; after an error or abort the
    worker renews its registry entry at once), fresher than the registry's last heartbeat: the router keeps the
    report of the highest version (``router.pool_reports``). ``room``: the router's line of requests waiting for KV room
    (:class:`~router.room_queue.RoomQueue`), told of each move of that view (reports, registry reads); a view
    built without one polls every 50 ms."""

    workers: Callable[[], list[WorkerInfo]]
    inflight: Counter
    channel: Callable[[str], grpc.aio.Channel]
    stats: dict[str, PrefillStats] = field(default_factory=dict)
    cached_blocks: Callable[[list[int], int], dict[str, int]] = lambda ids, block_size: {}
    on_routed: Callable[[str, list[int], int], None] = lambda worker_id, ids, block_size: None
    gate: SloGate | None = None
    outcomes: Admission | None = None
    eos_token_ids: tuple[int, ...] = ()
    heard: dict[str, float] = field(default_factory=dict)
    on_pool: Callable[[str, int, int], None] = lambda worker_id, version, num_free_blocks: None
    room: RoomQueue = field(default_factory=lambda: RoomQueue(poll_s=0.05))

    def current(self) -> list[WorkerInfo]:
        """The workers to dispatch to now."""
        return self.workers()

    def counting(self, worker_id: str) -> InFlight:
        """Count a request on ``worker_id`` in ``inflight`` from now until the result is released."""
        return InFlight(self.inflight, worker_id)
