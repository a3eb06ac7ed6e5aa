"""Requests waiting for KV room on the decode workers, served in order: first come, first served within a rank.

A request that finds no decode worker with room for its blocks (and has a ``queue_timeout_s``) joins the line
and holds no block while it waits. Only the request at the head of the line tries again, once each time the
router's view of the pools moves (a stream's pool report, a registry read: :meth:`RoomQueue.changed`) and once
whenever it becomes the head; a request arriving while others wait takes its place without trying, unless it
ranks ahead of all of them. So a large prompt waiting for room is not overtaken by smaller ones arriving after
it, as vLLM's first-come-first-served scheduler does not schedule past a waiting request that does not fit. The
rank is the caller's: the router puts a request retried after a worker failure first (its client is already
streaming, as vLLM puts preempted requests back at the front) and then orders by ``priority`` (lower first,
``--scheduling-policy priority``; all 0 otherwise). Until 2026-11-30 every change woke every waiting request
and whichever tried first took the room.

A request whose deadline comes while others are still ahead of it makes one try out of turn before it is
refused, so that its error is its own; a request with no ``queue_timeout_s`` (the router's default) therefore
tries once at arrival, as before the line, and may take room the head waits for. One line per router:
requests queued at another router replica are not ordered with these.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class _Ticket:
    """A place in the line: its sort key, its wake-up, and the view's epoch read before its last try (None: it
    may try at once)."""

    __slots__ = ("key", "wake", "tried")

    def __init__(self, key: tuple, tried: int | None) -> None:
        self.key, self.wake, self.tried = key, asyncio.Event(), tried


class RoomQueue:
    """The router's line of requests waiting for decode KV room (module docstring).

    ``poll_s``: also retry the head this often without a change (None: only on changes; a view that is never
    told of changes, as in unit tests of the dispatch, polls)."""

    def __init__(self, poll_s: float | None = None) -> None:
        self.poll_s = poll_s
        self._line: list[_Ticket] = []        # sorted by key: (rank..., arrival)
        self._epoch = 0                       # counts the moves of the view of the pools
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        """Requests waiting now."""
        return len(self._line)

    def changed(self) -> None:
        """The view of the pools moved (a report, a registry read): the head of the line tries again."""
        self._epoch += 1
        if self._line:
            self._line[0].wake.set()

    async def serve(self, attempt: Callable[[], Awaitable[T]], no_room: Callable[[BaseException], bool],
                    deadline: float, rank: tuple = ()) -> T:
        """``await attempt()`` in this request's turn: at once where nobody waits (or all who wait rank after
        ``rank``), else once at the head of the line; again at the head after each move of the view while it
        fails with an exception ``no_room`` accepts, until ``deadline`` (``time.monotonic()`` seconds). Returns
        its result. ``rank``: requests of a smaller rank go first, equal ranks in arrival order.

        Raises:
            the last no-room exception of ``attempt`` once ``deadline`` has passed (a request still behind others
            then makes one last try out of turn, so that its error is the attempt's own); any other exception of
            ``attempt`` at once. A cancelled request leaves the line.
        """
        key = (*rank, next(self._arrivals))
        tried = None
        if not self._line or key < self._line[0].key:       # nobody waiting ahead of it: try at once
            tried = self._epoch
            try:
                return await attempt()
            except BaseException as exc:
                if not no_room(exc) or time.monotonic() >= deadline:
                    raise
        ticket = _Ticket(key, tried)
        at = bisect.bisect([t.key for t in self._line], key)
        self._line.insert(at, ticket)                       # a head it displaces tries again when this one leaves
        try:
            return await self._wait_and_try(ticket, attempt, no_room, deadline)
        finally:
            head = self._line[0] is ticket
            self._line.remove(ticket)
            if head and self._line:
                self._line[0].tried = None                  # the next request may try at once
                self._line[0].wake.set()

    async def _wait_and_try(self, ticket: _Ticket, attempt: Callable[[], Awaitable[T]],
                            no_room: Callable[[BaseException], bool], deadline: float) -> T:
        while True:
            left = deadline - time.monotonic()
            head = self._line[0] is ticket
            if head and (ticket.tried != self._epoch or left <= 0):
                ticket.tried = self._epoch                  # read before the try: a move during it is not missed
                try:
                    return await attempt()
                except BaseException as exc:
                    if not no_room(exc) or time.monotonic() >= deadline:
                        raise
                continue
            if left <= 0:                                   # still behind others at its deadline
                return await attempt()
            ticket.wake.clear()
            wait = left if self.poll_s is None or not head else min(left, self.poll_s)
            try:
                await asyncio.wait_for(ticket.wake.wait(), wait)
            except asyncio.TimeoutError:
                if head and self.poll_s is not None:
                    ticket.tried = None
