"""Decode pools as the request streams report them (router/pool_reports.py): the report of the highest
version wins over the registry's heartbeat and over older reports, and is forgotten once the registry caught
up or its worker left; through a live cluster whose decode pool holds one request at a time, a request sent
on the last one's ``final`` finds the blocks free while the registry still shows them taken, and requests sent
together wait their turn for the blocks (``--queue-timeout``) instead of being refused."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from pdserve.cluster.registry import WorkerInfo
from pdserve.deploy import client
from pdserve.deploy.processes import spawn_role
from pdserve.model.kv_cache import BlockPool
from pdserve.proto import pdserve_pb2_grpc
from pdserve.router.config import RouterConfig
from pdserve.router.pool_reports import PoolReports
from tests.clusters import Cluster

pytestmark = pytest.mark.timeout(120)


def test_the_newest_report_wins_and_is_forgotten_once_the_registry_caught_up():
    d0, d1 = WorkerInfo("d0", "decode", "a:1", num_free_blocks=3, pool_version=10), WorkerInfo("d1", "decode", "a:2")
    reports = PoolReports()
    workers = reports.report([d0, d1], "d0", 12, 8)
    assert workers[0].num_free_blocks == 8 and workers[0].pool_version == 12 and workers[1] is d1
    assert reports.report(workers, "d0", 11, 1) is workers             # older than what is known: ignored
    assert reports.report(workers, "d0", 0, 1) is workers              # a worker that does not report
    assert reports.report(workers, "gone", 99, 1) is workers and len(reports) == 1   # not listed
    stale = reports.apply([d0, d1])                                     # a registry read older than the report
    assert stale[0].num_free_blocks == 8 and stale[0].pool_version == 12 and len(reports) == 1
    fresh = WorkerInfo("d0", "decode", "a:1", num_free_blocks=5, pool_version=13)
    assert reports.apply([fresh, d1]) == [fresh, d1] and len(reports) == 0   # the registry caught up
    reports.report([d0, d1], "d0", 12, 8)
    assert reports.apply([d1]) == [d1] and len(reports) == 0            # d0 left the registry


def test_a_report_older_than_its_workers_lease_is_dropped():
    """A report bridges the gap to the worker's next heartbeat: kept past the worker's lease (here 2 s) it is
    dropped, so a report of a worker's earlier incarnation with a higher version rules the view a lease at most."""
    now = [100.0]
    reports = PoolReports(clock=lambda: now[0])
    d0 = WorkerInfo("d0", "decode", "a:1", num_free_blocks=3, pool_version=10, lease_s=2.0)
    assert reports.report([d0], "d0", 50, 0)[0].num_free_blocks == 0
    now[0] += 1.9
    assert reports.apply([d0])[0].num_free_blocks == 0 and len(reports) == 1   # within the lease: kept
    assert reports.report([d0], "d0", 11, 7) == [d0]                            # older than the kept report
    now[0] += 0.2
    assert reports.apply([d0]) == [d0] and len(reports) == 0                    # past it: the registry's
    assert reports.report([d0], "d0", 11, 7)[0].num_free_blocks == 7            # and newer reports count again


def test_the_pool_version_moves_on_every_change_and_starts_above_an_earlier_pools():
    pool = BlockPool(4)
    v0, free = pool.snapshot()
    assert free == 4
    ids = pool.allocate(3)
    assert pool.snapshot() == (v0 + 1, 1)
    pool.allocate(0)                                                    # nothing taken: nothing changed
    pool.free(ids)
    assert pool.snapshot() == (v0 + 2, 4)
    assert BlockPool(4).snapshot()[0] > v0 + 2                          # a restarted worker's pool


def test_the_queue_timeout_is_a_finite_non_negative_number_of_seconds(model_dir):
    assert RouterConfig(model_dir=model_dir).default_queue_timeout_s == 0.0       # refused at once by default
    assert RouterConfig(model_dir=model_dir, default_queue_timeout_s=0.5).default_queue_timeout_s == 0.5
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="default_queue_timeout_s"):
            RouterConfig(model_dir=model_dir, default_queue_timeout_s=bad)


@pytest.fixture(scope="module")
def one_at_a_time(redis_url, model_dir):
    """A decode pool of 8 blocks of 16 tokens: one request of a 70-token prompt at a time (5 blocks to start);
    its periodic heartbeat only every 30 s (``lease_s`` 120), so that the registry alone would show none of a
    request's blocks taken or freed while the test runs it. The router queues requests for KV room up to 60 s."""
    c = Cluster(model_dir, redis_url, decode_flags={"num_blocks": 8, "lease_s": 120.0},
                router_flags={"default_queue_timeout_s": 60.0})
    yield c
    c.stop()


def test_the_routers_view_follows_each_requests_blocks_between_heartbeats(one_at_a_time):
    """While a request streams, the router's view of its decode worker shows its blocks taken (the allocation's
    report); once its ``final`` is out, free again (the end's report), so the next request, sent at once and
    needing more blocks than the pool has left while the first holds them, is served."""
    c = one_at_a_time
    prompt = [5 + i % 40 for i in range(70)]

    def d0(state):
        (w,) = [w for w in state.workers if w.worker_id == "d0"]
        return w.num_free_blocks, w.num_total_blocks

    async def go(channel):
        views = []
        for _ in range(3):
            request = client.make_request(prompt, max_tokens=24, temperature=0.0, ignore_eos=True)
            async for msg in client.stream(channel, request, timeout_s=60):
                if len(views) % 2 == 0:             # the request's first message: it holds its blocks
                    views.append(d0(await client.cluster_state(channel)))
                if msg.HasField("final"):
                    views.append(d0(await client.cluster_state(channel)))
        return views

    views = c.run(go)
    assert all(free < total for free, total in views[0::2]), views
    assert all(free == total for free, total in views[1::2]), views
    c.assert_pools_free()


def test_a_cancelled_requests_blocks_show_free_before_the_next_heartbeat(one_at_a_time):
    """A request its client cancels mid-stream ends without the end's report (its stream is gone); the decode
    worker renews its registry entry as soon as the aborted request's blocks are freed (``Heartbeat.nudge``),
    so the router's view shows them free within a few registry reads (3 s allowed), not at the next periodic
    heartbeat (every 30 s: without the renewal this fails 9 times in 10), and a request sent then with no queue
    timeout is served."""
    c = one_at_a_time
    holder = client.make_request([5, 6, 7, 8], max_tokens=100, temperature=0.0, ignore_eos=True)   # near the pool
    after = client.make_request([7 + i % 40 for i in range(70)], max_tokens=8, temperature=0.0)
    after.queue_timeout_s = 1e-9                           # the router's 60 s default would hide a stale view

    def d0_free(state):
        (w,) = [w for w in state.workers if w.worker_id == "d0"]
        return w.num_free_blocks, w.num_total_blocks

    async def go(channel):
        call = pdserve_pb2_grpc.RouterStub(channel).Generate(holder, timeout=60)
        await call.read()                                  # the holder has its blocks
        held = d0_free(await client.cluster_state(channel))
        call.cancel()
        cancelled = time.monotonic()
        while (free := d0_free(await client.cluster_state(channel)))[0] != free[1]:
            assert time.monotonic() - cancelled < 3.0, f"d0's blocks still shown taken: {free}"
            await asyncio.sleep(0.05)
        return held, await client.complete(channel, after, timeout_s=60)

    held, done = c.run(go)
    assert held[0] < held[1]
    assert done.final.usage.completion_tokens > 0
    c.assert_pools_free()


def test_requests_sent_together_wait_for_the_blocks_instead_of_being_refused(one_at_a_time):
    """Four requests at once on a pool that holds one: with a queue timeout each waits (holding no block) until
    the one before it ends, and all four are served, the same greedy answer each."""
    c = one_at_a_time
    prompt = [5 + i % 40 for i in range(70)]

    async def burst(channel):
        request = client.make_request(prompt, max_tokens=24, temperature=0.0, ignore_eos=True)
        return await asyncio.gather(*(client.complete(channel, request, timeout_s=60) for _ in range(4)))

    done = c.run(burst)
    assert [d.final.usage.completion_tokens for d in done] == [24] * 4
    assert all(d.token_ids == done[0].token_ids for d in done)
    c.assert_pools_free()


def test_a_requests_own_queue_timeout_bounds_its_wait(one_at_a_time):
    """While a request holds the pool, one sent with its own ``queue_timeout_s`` of 1 ms (the router's default
    being 60 s) is refused with RESOURCE_EXHAUSTED once that passes, naming the blocks it waited for; the
    first is served whole."""
    c = one_at_a_time
    holder = client.make_request([5 + i % 40 for i in range(70)], max_tokens=40, temperature=0.0, ignore_eos=True)
    late = client.make_request([7 + i % 40 for i in range(70)], max_tokens=8, temperature=0.0)
    late.queue_timeout_s = 0.001

    async def go(channel):
        stream = client.stream(channel, holder, timeout_s=60)
        first = await anext(stream)                        # the holder has its blocks: 39 tokens still to come
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.complete(channel, late, timeout_s=60)
        rest = [msg async for msg in stream]
        return info.value, [first, *rest]

    error, msgs = c.run(go)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "free KV blocks" in error.details(), error
    assert msgs[-1].final.usage.completion_tokens == 40
    c.assert_pools_free()


def test_with_admission_requests_wait_for_the_blocks_too(one_at_a_time):
    """A second router on the same workers with SLO admission and a queue timeout: requests sent together
    wait for the one pool's blocks (before, one that found no room was refused UNAVAILABLE, "no decode worker
    is available", whatever its queue timeout) and are all served."""
    c = one_at_a_time
    router = spawn_role("router", dict(model_dir=c.model, cluster=c.cluster, redis_url=c.redis_url,
                                       admission=True, default_queue_timeout_s=60.0, kv_timeout_s=10.0),
                        "router-admission")
    prompt = [5 + i % 40 for i in range(70)]

    async def burst():
        async with grpc.aio.insecure_channel(router.address) as channel:
            request = client.make_request(prompt, max_tokens=24, temperature=0.0, ignore_eos=True)
            return await asyncio.gather(*(client.complete(channel, request, timeout_s=60) for _ in range(3)))

    try:
        done = asyncio.run(burst())
    finally:
        router.stop()
    assert [d.final.usage.completion_tokens for d in done] == [24] * 3
    c.assert_pools_free()
