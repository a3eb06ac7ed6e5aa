"""The router's line of requests waiting for KV room (router.room_queue): first come, first served within a rank,
a try at the head per move of the view, deadlines, errors and cancellation leaving the line."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.router.room_queue import RoomQueue


class Full(Exception):
    """No room (the line tries again)."""


class Pool:
    """Free blocks; a try takes ``need`` of them or raises Full, and is logged."""

    def __init__(self, free: int) -> None:
        self.free, self.served, self.tries = free, [], []

    def attempt(self, name: str, need: int):
        async def run() -> str:
            self.tries.append(name)
            await asyncio.sleep(0)           # a try awaits (an RPC), as the router's do
            if self.free < need:
                raise Full(f"{name} needs {need}, {self.free} free")
            self.free -= need
            self.served.append(name)
            return name
        return run


def no_room(exc: BaseException) -> bool:
    return isinstance(exc, Full)


async def until(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0)


async def join(q: RoomQueue, attempt, deadline: float, rank: tuple = ()):
    """A request's task, once it stands in the line (one more in it than before)."""
    before = len(q)
    task = asyncio.create_task(q.serve(attempt, no_room, deadline, rank))
    await until(lambda: len(q) == before + 1)
    return task


def test_served_in_arrival_order_and_not_overtaken():
    async def main():
        q, pool = RoomQueue(), Pool(free=0)
        far = time.monotonic() + 30
        big = await join(q, pool.attempt("big", 3), far)
        smalls = [await join(q, pool.attempt(f"small{i}", 1), far) for i in range(2)]
        assert pool.tries == ["big"]                 # arrivals behind a waiting request join without trying
        pool.free = 1                                # room for a small one, not for the head
        q.changed()
        await until(lambda: pool.tries.count("big") == 2)
        await asyncio.sleep(0.05)
        assert pool.served == [] and len(q) == 3     # the smaller ones do not overtake it
        pool.free = 3
        q.changed()
        assert await asyncio.wait_for(big, 5) == "big"
        pool.free = 2
        q.changed()
        assert await asyncio.wait_for(asyncio.gather(*smalls), 5) == ["small0", "small1"]
        assert pool.served == ["big", "small0", "small1"] and len(q) == 0
    asyncio.run(main())


def test_nobody_waiting_tries_at_once_and_zero_timeout_refuses_at_once():
    async def main():
        q, pool = RoomQueue(), Pool(free=1)
        assert await q.serve(pool.attempt("a", 1), no_room, time.monotonic()) == "a"
        with pytest.raises(Full, match="b needs 1, 0 free"):
            await q.serve(pool.attempt("b", 1), no_room, time.monotonic())
        assert pool.tries == ["a", "b"] and len(q) == 0
    asyncio.run(main())


def test_deadline_raises_the_attempts_error_and_the_next_goes_on():
    async def main():
        q, pool = RoomQueue(), Pool(free=0)
        first = await join(q, pool.attempt("first", 2), time.monotonic() + 0.2)
        second = await join(q, pool.attempt("second", 1), time.monotonic() + 30)
        pool.free = 1                                # enough for the second only
        with pytest.raises(Full, match="first needs 2"):
            await first
        assert await asyncio.wait_for(second, 5) == "second"   # the head left: the next tried without a change
        assert len(q) == 0
    asyncio.run(main())


def test_other_errors_propagate_at_once_and_cancelled_requests_leave_the_line():
    async def main():
        q, pool = RoomQueue(), Pool(free=0)
        far = time.monotonic() + 30
        head = await join(q, pool.attempt("head", 1), far)

        async def broken() -> str:
            raise ValueError("refused for another reason")
        bad = await join(q, broken, far)
        waiting = await join(q, pool.attempt("waiting", 1), far)
        head.cancel()
        with pytest.raises(asyncio.CancelledError):
            await head
        with pytest.raises(ValueError, match="another reason"):   # its turn came: raised, not retried
            await bad
        await until(lambda: pool.tries.count("waiting") == 1)
        assert len(q) == 1
        pool.free = 1
        q.changed()
        assert await asyncio.wait_for(waiting, 5) == "waiting" and len(q) == 0
    asyncio.run(main())


def test_a_move_during_a_try_is_not_missed():
    async def main():
        q = RoomQueue()
        tries = []

        async def attempt() -> str:
            tries.append(len(tries))
            if len(tries) == 2:
                q.changed()                          # the view moves while the try awaits its answer
            await asyncio.sleep(0)
            if len(tries) < 3:
                raise Full("not yet")
            return "served"
        task = await join(q, attempt, time.monotonic() + 30)
        q.changed()                                  # wakes the second try, which sees a move during itself
        assert await asyncio.wait_for(task, 5) == "served" and tries == [0, 1, 2]   # not at the deadline
    asyncio.run(main())


def test_a_view_never_told_of_changes_polls():
    async def main():
        q, pool = RoomQueue(poll_s=0.01), Pool(free=0)
        task = await join(q, pool.attempt("a", 1), time.monotonic() + 30)
        pool.free = 1                                # no changed(): the head's poll finds it
        assert await asyncio.wait_for(task, 5) == "a"
    asyncio.run(main())


def test_a_smaller_rank_goes_first_equal_ranks_in_arrival_order():
    async def main():
        q, pool = RoomQueue(), Pool(free=0)
        far = time.monotonic() + 30
        tasks = [await join(q, pool.attempt(name, 1), far, rank) for name, rank in
                 (("low0", (1, 5)), ("low1", (1, 5)), ("high", (1, 0)), ("retry", (0, 9)))]
        # the retry ranked ahead of everyone: it tried at once on arrival (and failed); the others waited
        assert pool.tries == ["low0", "high", "retry"]
        for _ in range(4):
            pool.free += 1
            q.changed()
            await until(lambda: len(pool.served) == 4 - len(q))
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        assert pool.served == ["retry", "high", "low0", "low1"]
    asyncio.run(main())
