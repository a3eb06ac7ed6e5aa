"""The receiver's table of expected requests: page bookkeeping, deadlines, exactly-once endings.

A registration leaves the table exactly once, under the table lock, through one of
the ``take*`` methods; whoever takes it owns its single callback. Nothing here
calls callbacks or touches sockets.
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


@dataclass(eq=False)
class Registration:
    """One expected request.

    ``conn`` is the connection feeding it (at most one). ``write_lock`` is held by
    that connection's handler while it writes pages into the request's blocks, so
    whoever takes the registration can wait out an in-flight write before the blocks
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


class Registry:
    """Thread-safe table of :class:`Registration` keyed by request id."""

    def __init__(self, num_blocks: int, num_layers: int) -> None:
        self._num_blocks = num_blocks
        self._num_layers = num_layers
        self._regs: dict[str, Registration] = {}
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
        reg = Registration(request_id, ids, self._num_layers, timeout_s, time.monotonic() + timeout_s,
                           on_complete, on_failed, block_set=frozenset(ids))
        with self._cond:
            if self._closed:
                raise RuntimeError("receiver is closed")
            if request_id in self._regs:
                raise ValueError(f"request {request_id!r} is already registered")
            self._regs[request_id] = reg
            self._cond.notify_all()

    def bind(self, request_id: str, conn: socket.socket) -> Registration:
        """Attach ``conn`` as the one connection feeding ``request_id``.

        Raises:
            FrameError: the request is not registered or already has a connection.
        """
        with self._cond:
            reg = self._regs.get(request_id)
            if reg is None:
                raise FrameError(f"unknown request {request_id!r} (not registered, cancelled or already ended)")
            if reg.conn is not None:
                raise FrameError(f"request {request_id!r} already has a connection")
            reg.conn = conn
            return reg

    def is_live(self, reg: Registration) -> bool:
        """Whether ``reg`` is still in the table."""
        with self._cond:
            return self._regs.get(reg.request_id) is reg

    def mark(self, reg: Registration, block_ids: Sequence[int], layer_start: int, layer_end: int) -> None:
        """Record that the pages ``block_ids x [layer_start, layer_end)`` arrived."""
        with self._cond:
            reg.arrived.update((b, layer) for b in block_ids for layer in range(layer_start, layer_end))

    def finish(self, reg: Registration) -> tuple[bool, bool]:
        """On ``done``: take ``reg`` if still live. Returns (taken, complete); when taken
        incomplete, ``reg.ended`` is the failure reason."""
        with self._cond:
            n, m = len(reg.arrived), reg.num_pages
            taken = self._take(reg, "completed" if n == m else f"incomplete transfer: {n} of {m} pages")
            return taken, n == m

    def take(self, reg: Registration, why: str) -> bool:
        """Remove ``reg`` if still live; True if this call removed it (and owns its callback)."""
        with self._cond:
            return self._take(reg, why)

    def take_id(self, request_id: str, why: str) -> Registration | None:
        """Remove and return the registration of ``request_id``, if any."""
        with self._cond:
            reg = self._regs.get(request_id)
            return reg if reg is not None and self._take(reg, why) else None

    def wait_expired(self) -> list[Registration] | None:
        """Block until some registrations pass their deadline; take and return them.
        Returns None once the table is closed."""
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                expired = [r for r in self._regs.values() if r.deadline <= now]
                if expired:
                    for reg in expired:
                        self._take(reg, f"timed out after {reg.timeout_s:g} s waiting for KV pages")
                    return expired
                nxt = min((r.deadline for r in self._regs.values()), default=None)
                self._cond.wait(None if nxt is None else nxt - now)
            return None

    def close(self) -> list[Registration]:
        """Refuse further registrations; take and return every pending one."""
        with self._cond:
            self._closed = True
            regs = list(self._regs.values())
            for reg in regs:
                self._take(reg, "receiver closed")
            self._cond.notify_all()
            return regs

    def _take(self, reg: Registration, why: str) -> bool:
        if self._regs.get(reg.request_id) is not reg:
            return False
        del self._regs[reg.request_id]
        reg.ended = why
        return True
