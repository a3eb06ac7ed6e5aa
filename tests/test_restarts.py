"""Restarts of the shared parts: Redis (the router serves from its last known registry, the workers
re-register) and the router (clients get UNAVAILABLE, workers free the orphaned requests' blocks,
a new router on the same address serves the next request). Redis here is a private one."""

from __future__ import annotations

import asyncio
import time

import grpc
import msgpack
import pytest
import redis

from pdserve.cluster.kv_events import events_key, snapshot_key
from pdserve.deploy import client
from tests.clusters import Cluster, PrivateRedis

PROMPT = "Lily and Ben went to the park. They saw a big"


@pytest.fixture(scope="module")
def private(model_dir):
    r = PrivateRedis()
    c = Cluster(model_dir, r.url, num_prefill=1, num_decode=1)
    yield r, c
    c.stop()
    r.stop()


def _registry(url: str, cluster: str) -> dict[str, dict]:
    """Worker id -> registry entry, read straight from Redis (no router involved)."""
    r = redis.Redis.from_url(url, socket_timeout=2)
    try:
        keys = r.keys(f"pdserve:{cluster}:worker:*")
        return {e["worker_id"]: e for e in (msgpack.unpackb(v) for v in r.mget(keys) if v)} if keys else {}
    finally:
        r.close()


def _wait(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_redis_restart_router_serves_on_and_workers_reregister(private):
    r, c = private
    reference = c.complete(PROMPT, max_tokens=24, temperature=0)
    assert set(_registry(r.url, c.cluster)) == {"d0", "p0"}
    r.kill()
    for i in range(3):  # the router keeps serving from the registry it read last
        started = time.monotonic()
        assert c.complete(PROMPT, max_tokens=24, temperature=0).token_ids == reference.token_ids, i
        assert time.monotonic() - started < 5
    assert {w.worker_id for w in c.state().workers} == {"d0", "p0"}
    r.start()  # empty: no lease, no event stream, no snapshot
    _wait(lambda: set(_registry(r.url, c.cluster)) == {"d0", "p0"}, 10, "the workers to re-register")
    # the prefill worker republishes its prefix-cache snapshot at once, so routers re-sync exactly
    _wait(lambda: redis.Redis.from_url(r.url).exists(snapshot_key(c.cluster, "p0")), 10, "a fresh KV snapshot")
    _wait(lambda: all(w.lease_age_s < 1.0 for w in c.state().workers), 10, "the router to read the new registry")
    other = c.complete(list(range(1, 60)), max_tokens=8, temperature=0)  # a new 3-block prefix: `stored` events
    assert len(other.token_ids) == 8
    _wait(lambda: redis.Redis.from_url(r.url).xlen(events_key(c.cluster, "p0")) > 0, 5, "KV events to flow again")
    assert c.complete(PROMPT, max_tokens=24, temperature=0).token_ids == reference.token_ids
    c.assert_pools_free()


def test_router_killed_mid_stream_clients_get_unavailable_workers_free_blocks(private):
    r, c = private
    reference = c.complete(PROMPT, max_tokens=16, temperature=0)

    async def go():
        async with grpc.aio.insecure_channel(c.address) as channel:
            streamed = [0, 0, 0]

            async def one(i):
                request = client.make_request(PROMPT, max_tokens=400, ignore_eos=True, temperature=0)
                async for msg in client.stream(channel, request, timeout_s=60):
                    streamed[i] += len(msg.token_ids)

            tasks = [asyncio.create_task(one(i)) for i in range(3)]
            deadline = time.monotonic() + 20
            def held() -> bool:  # streaming, and the decode worker's heartbeat shows the requests' blocks
                d0 = _registry(r.url, c.cluster)["d0"]
                return min(streamed) >= 3 and d0["num_free_blocks"] < d0["num_total_blocks"]

            while not held():
                assert time.monotonic() < deadline and not any(t.done() for t in tasks), streamed
                await asyncio.sleep(0.02)
            killed = time.monotonic()
            c.kill("router")
            outcomes = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
            ended_s = time.monotonic() - killed
            # the decode worker notices the dead router (gRPC cancellation) and frees every block
            _wait(lambda: all(e["num_free_blocks"] == e["num_total_blocks"]
                              for e in _registry(r.url, c.cluster).values()), 6, "the workers to free the blocks")
            c.restart_router()
            await asyncio.wait_for(channel.channel_ready(), 10)  # the same channel reconnects
            after = await client.complete(channel, client.make_request(PROMPT, max_tokens=16, temperature=0), 30)
            return outcomes, ended_s, after

    outcomes, ended_s, after = asyncio.run(go())
    assert all(isinstance(o, grpc.aio.AioRpcError) and o.code() == grpc.StatusCode.UNAVAILABLE for o in outcomes)
    assert ended_s < 5
    assert after.token_ids == reference.token_ids
    c.assert_pools_free()


def test_index_sync_is_exact_again_after_a_redis_restart():
    """The router's KV-event index across a Redis restart: events published while Redis is down are lost
    (a seq gap); the snapshot the worker republishes when Redis lost it re-syncs the index exactly."""
    from pdserve.router.index_sync import IndexSync
    from pdserve.router.prefix_index import PrefixIndex
    from tests.index_sync_helpers import BS, PROMPTS, Worker, check

    r = PrivateRedis()

    async def main():
        w = Worker(r.url, "restart", "p0", num_blocks=8)
        idx = PrefixIndex(BS)
        sync = IndexSync(r.url, "restart", idx, snapshot_poll_s=0)
        try:
            sync.set_workers(["p0"])
            for p in PROMPTS[:3]:
                w.serve(p)
            w.flush()
            await sync.sync_once()
            check(idx, [w])
            r.kill()
            for p in PROMPTS[3:5]:  # evictions and new blocks, their events dropped
                w.serve(p)
            w.flush()
            with pytest.raises((redis.RedisError, OSError)):
                await sync.sync_once()  # KVAwareness.sync_once logs this and keeps the index as it was
            r.start()
            assert w.pub.snapshot_missing()  # what PrefillWorker.on_heartbeat checks ...
            w.snapshot()                      # ... and does
            w.serve(PROMPTS[5])
            w.flush()
            await sync.sync_once()
            check(idx, [w])
            assert sync.degraded_workers() == set() and sync.stats.gaps >= 1
        finally:
            await sync.aclose()
            w.close()

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        r.stop()


def test_registry_memory_bridges_a_redis_restart_but_not_a_released_lease():
    """The router's view across a Redis restart (router/server.py's _refresh) and a drain."""
    from pdserve.cluster.registry import WorkerInfo
    from pdserve.router.recovery import RegistryMemory

    def w(wid: str, beat: float) -> WorkerInfo:
        return WorkerInfo(worker_id=wid, role="decode", address="x", heartbeat_at=beat)

    mem = RegistryMemory(grace_s=2.0)
    view = mem.merge([], [w("d0", 0.0), w("d1", 0.0)], 0.0)
    # d1 released its lease (drain) while d0 is listed: gone at once, routers stop choosing it
    assert [x.worker_id for x in mem.merge(view, [w("d0", 0.5)], 1.0)] == ["d0"]
    # Redis restarted between two polls and came back empty: the last view is kept for grace_s ...
    assert [x.worker_id for x in mem.merge(view, [], 2.0)] == ["d0", "d1"]
    assert [x.worker_id for x in mem.merge(view, [w("d1", 2.2)], 2.5)] == ["d0", "d1"]
    # ... and no longer: a worker that did not re-register within it is gone
    assert [x.worker_id for x in mem.merge(view, [w("d1", 3.9)], 4.1)] == ["d1"]
    # Redis down for 10 s (every read failed), back empty: kept for grace_s after the first good read
    mem.read_failed()
    assert [x.worker_id for x in mem.merge(view, [], 14.0)] == ["d0", "d1"]
    assert [x.worker_id for x in mem.merge(view, [w("d0", 15.0)], 15.5)] == ["d0", "d1"]
    assert [x.worker_id for x in mem.merge(view, [w("d0", 16.0)], 16.1)] == ["d0"]
