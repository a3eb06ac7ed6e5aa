"""The KV receiver's table of pending transfers: the requests it expects pages for (registered
with ``KVReceiver.expect``), their page bookkeeping, deadlines and exactly-once endings.

Not to be confused with the worker registry (:mod:`cluster.registry`). A pending transfer
leaves the table exactly once, under the table lock, through one of the ``take*`` methods;
whoever takes it owns its single callback. Nothing here calls callbacks or touches sockets.
"""

from __future__ import annotations

import operator
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.kvtransfer.base import OnComplete, OnFailed
from pdserve.kvtransfer.wire.frames import FrameError

MAX_REAPER_WAIT_S = 60.0
"""The reaper sleeps at most this long (seconds) between deadline checks, whatever the deadlines: a far or
infinite deadline (``timeout_s`` of 1e300, inf) would overflow ``Condition.wait``."""


@dataclass(eq=False)
class PendingTransfer:
    """One expected request's transfer.

    ``conn`` is the connection feeding it (at most one). ``write_lock`` is held by
    that connection's handler while it writes pages into the request's blocks, so
    whoever takes the transfer can wait out an in-flight write before the blocks
    are reused. ``ended`` says why it left the table.
    """

    request_id: str
    block_ids: tuple[int, ...]
    num_layers: int
    timeout_s: float
    deadline: float  # time.monotonic() seconds
    on_complete: OnComplete
    on_failed: OnFailed
    block_set: frozenset[int] = frozenset()
    arrived: set[tuple[int, int]] = field(default_factory=set)  # (block id, layer)
    conn: socket.socket | None = None
    write_lock: threading.Lock = field(default_factory=threading.Lock)
    ended: str | None = None

    @property
    def num_pages(self) -> int:
        """Pages (block x single layer) the request needs."""
        return len(self.block_ids) * self.num_layers


class PendingTransfers:
    """Thread-safe table of :class:`PendingTransfer` keyed by request id."""

    def __init__(self, num_blocks: int, num_layers: int) -> None:
        self._num_blocks = num_blocks
        self._num_layers = num_layers
        self._transfers: dict[str, PendingTransfer] = {}
        self._cond = threading.Condition()
        self._closed = False

    def add(self, request_id: str, block_ids: Sequence[int], timeout_s: float,
            on_complete: OnComplete, on_failed: OnFailed) -> None:
        """Register a request.

        Raises:
            ValueError: already registered, empty/out-of-range/repeated block ids, timeout_s <= 0.
            RuntimeError: the receiver is closed.
        """
        ids = tuple(operator.index(b) for b in block_ids)
        if not ids:
            raise ValueError(f"request {request_id!r}: no block ids")
        bad = [b for b in ids if not 0 <= b < self._num_blocks]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"request {request_id!r}: block ids must be distinct and in [0, {self._num_blocks}), "
                             f"got {list(ids)}")
        if not timeout_s > 0:
            raise ValueError(f"request {request_id!r}: timeout_s must be positive, got {timeout_s}")
        transfer = PendingTransfer(request_id, ids, self._num_layers, timeout_s, time.monotonic() + timeout_s,
                                   on_complete, on_failed, block_set=frozenset(ids))
        with self._cond:
            if self._closed:
                raise RuntimeError("receiver is closed")
            if request_id in self._transfers:
                raise ValueError(f"request {request_id!r} is already registered")
            self._transfers[request_id] = transfer
            self._cond.notify_all()

    def bind(self, request_id: str, conn: socket.socket) -> PendingTransfer:
        """Attach ``conn`` as the one connection feeding ``request_id``.

        Raises:
            FrameError: the request is not registered or already has a connection.
        """
        with self._cond:
            transfer = self._transfers.get(request_id)
            if transfer is None:
                raise FrameError(f"unknown request {request_id!r} (not registered, cancelled or already ended)")
            if transfer.conn is not None:
                raise FrameError(f"request {request_id!r} already has a connection")
            transfer.conn = conn
            return transfer

    def is_live(self, transfer: PendingTransfer) -> bool:
        """Whether ``transfer`` is still in the table."""
        with self._cond:
            return self._transfers.get(transfer.request_id) is transfer

    def mark(self, transfer: PendingTransfer, block_ids: Sequence[int], layer_start: int, layer_end: int) -> None:
        """Record that the pages ``block_ids x [layer_start, layer_end)`` arrived."""
        with self._cond:
            transfer.arrived.update((b, layer) for b in block_ids for layer in range(layer_start, layer_end))

    def finish(self, transfer: PendingTransfer) -> tuple[bool, bool]:
        """On ``done``: take ``transfer`` if still live. Returns (taken, complete); when taken
        incomplete, ``transfer.ended`` is the failure reason."""
        with self._cond:
            n, m = len(transfer.arrived), transfer.num_pages
            taken = self._take(transfer, "completed" if n == m else f"incomplete transfer: {n} of {m} pages")
            return taken, n == m

    def take(self, transfer: PendingTransfer, why: str) -> bool:
        """Remove ``transfer`` if still live; True if this call removed it (and owns its callback)."""
        with self._cond:
            return self._take(transfer, why)

    def take_id(self, request_id: str, why: str) -> PendingTransfer | None:
        """Remove and return the pending transfer of ``request_id``, if any."""
        with self._cond:
            transfer = self._transfers.get(request_id)
            return transfer if transfer is not None and self._take(transfer, why) else None

    def wait_expired(self) -> list[PendingTransfer] | None:
        """Block until some pending transfers pass their deadline; take and return them.
        Returns None once the table is closed. Each wait lasts at most :data:`MAX_REAPER_WAIT_S`
        seconds, so no deadline, however far, can make it raise."""
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                expired = [r for r in self._transfers.values() if r.deadline <= now]
                if expired:
                    for transfer in expired:
                        self._take(transfer, f"timed out after {transfer.timeout_s:g} s waiting for KV pages")
                    return expired
                nxt = min((r.deadline for r in self._transfers.values()), default=None)
                wait_s = MAX_REAPER_WAIT_S if nxt is None else nxt - now
                self._cond.wait(wait_s if 0 < wait_s < MAX_REAPER_WAIT_S else MAX_REAPER_WAIT_S)  # NaN, inf: the cap
            return None

    def close(self) -> list[PendingTransfer]:
        """Refuse further registrations; take and return every pending transfer."""
        with self._cond:
            self._closed = True
            transfers = list(self._transfers.values())
            for transfer in transfers:
                self._take(transfer, "receiver closed")
            self._cond.notify_all()
            return transfers

    def _take(self, transfer: PendingTransfer, why: str) -> bool:
        if self._transfers.get(transfer.request_id) is not transfer:
            return False
        del self._transfers[transfer.request_id]
        transfer.ended = why
        return True
