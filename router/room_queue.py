"""Requests waiting for KV room on the decode workers, served first come, first served.

A request that finds no decode worker with room for its blocks (and has a ``queue_timeout_s``) joins the line
and holds no block while it waits. Only the request at the head of the line tries again, once each time the
router's view of the pools moves (a stream's pool report, a registry read: :meth:`RoomQueue.changed`) and once
whenever it becomes the head; a request arriving while others wait joins the end without trying. So a large
prompt waiting for room is not overtaken by smaller ones arriving after it, as vLLM's first-come-first-served
scheduler does not schedule past a waiting request that does not fit. Until 2026-11-30 every change woke every
waiting request and whichever tried first took the room.

One line per router: requests queued at another router replica are not ordered with these.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class _Ticket:
    """A place in the line; ``tried`` is the view's epoch read before this request's last try (None: may try)."""

    __slots__ = ("tried",)

    def __init__(self) -> None:
        self.tried: int | None = None


class RoomQueue:
    """The router's line of requests waiting for decode KV room (module docstring).

    ``poll_s``: also retry the head this often without a change (None: only on changes; a view that is never
    told of changes, as in unit tests of the dispatch, polls)."""

    def __init__(self, poll_s: float | None = None) -> None:
        self.poll_s = poll_s
        self._line: deque[_Ticket] = deque()
        self._epoch = 0                       # counts the moves of the view of the pools
        self._wake = asyncio.Event()          # set (and replaced) at each move and each change of the head

    def __len__(self) -> int:
        """Requests waiting now."""
        return len(self._line)

    def changed(self) -> None:
        """The view of the pools moved (a report, a registry read): the head of the line tries again."""
        self._epoch += 1
        self._notify()

    async def serve(self, attempt: Callable[[], Awaitable[T]], no_room: Callable[[BaseException], bool],
                    deadline: float) -> T:
        """``await attempt()`` in this request's turn: at once where nobody waits, else once at the head of the
        line; again at the head after each move of the view while it fails with an exception ``no_room`` accepts,
        until ``deadline`` (``time.monotonic()`` seconds). Returns its result.

        Raises:
            the last no-room exception of ``attempt`` once ``deadline`` has passed (a request that reached the
            deadline before its first try makes one, so its error is the attempt's own); any other exception of
            ``attempt`` at once. A cancelled request leaves the line.
        """
        if not self._line:                                  # nobody waiting: try at once
            since = self._epoch
            try:
                return await attempt()
            except BaseException as exc:
                if not no_room(exc) or time.monotonic() >= deadline:
                    raise
            ticket = _Ticket()
            ticket.tried = since
        else:
            ticket = _Ticket()
        self._line.append(ticket)
        try:
            return await self._wait_and_try(ticket, attempt, no_room, deadline)
        finally:
            head = self._line[0] is ticket
            self._line.remove(ticket)
            if head and self._line:
                self._line[0].tried = None                  # the next request may try at once
                self._notify()

    async def _wait_and_try(self, ticket: _Ticket, attempt: Callable[[], Awaitable[T]],
                            no_room: Callable[[BaseException], bool], deadline: float) -> T:
        while True:
            left = deadline - time.monotonic()
            if self._line[0] is ticket and (ticket.tried != self._epoch or left <= 0):
                ticket.tried = self._epoch
                try:
                    return await attempt()
                except BaseException as exc:
                    if not no_room(exc) or time.monotonic() >= deadline:
                        raise
                continue
            if left <= 0:                                   # not the head by the deadline: one last try
                return await attempt()
            wake = self._wake
            try:
                await asyncio.wait_for(wake.wait(), left if self.poll_s is None else min(left, self.poll_s))
            except asyncio.TimeoutError:
                if self.poll_s is not None and self._line[0] is ticket:
                    ticket.tried = None

    def _notify(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()
