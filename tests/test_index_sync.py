"""IndexSync against the real Redis, with the prefill worker's real PrefixCache and KVEventPublisher:
the synced index equals an oracle built from each cache's snapshot(). Here: the live stream (events in
order, restarts and stale tails), following the live workers, and random histories; re-syncs from
snapshots are in tests/test_index_sync_resync.py."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.cluster.registry import RegistryReader, WorkerInfo, WorkerLease
from pdserve.deploy.ray_cluster import delete_cluster_keys
from tests.index_sync_helpers import BS, PROMPTS, check, new_namespace, rig, run, toks


@pytest.fixture
def cluster(redis_url):
    """A private namespace; every key in it is deleted afterwards."""
    name = new_namespace()
    yield name
    delete_cluster_keys(redis_url, name)


def test_events_flow_into_an_exact_index(redis_url, cluster):
    async def main():
        async with rig(redis_url, cluster, n=2, num_blocks=8) as (ws, idx, sync):
            sync.set_workers(["p0", "p1"])
            await sync.sync_once()
            for i, p in enumerate(PROMPTS * 2):  # 8 blocks each: evictions on the way
                ws[i % 2].serve(p)
                if i % 3 == 2:
                    for w in ws:
                        w.flush()
                    assert await sync.sync_once() > 0
                    check(idx, ws)
            for w in ws:
                w.flush()
            await sync.sync_once()
            check(idx, ws)
            assert idx.lookup(PROMPTS[0]) and sync.exact_workers() == {"p0", "p1"}
            s = sync.stats
            assert (s.gaps, s.degraded, s.malformed, s.resyncs) == (0, 0, 0, 2) and s.events > 10
    run(main())


def test_restart_new_epoch_and_stale_tail(redis_url, cluster):
    async def main():
        async with rig(redis_url, cluster) as ([w], idx, sync):
            sync.set_workers(["p0"])
            for p in PROMPTS[:3]:
                w.serve(p)
            w.flush()
            await sync.sync_once()
            check(idx, [w])
            old, w.pub = w.pub, None  # the old run lingers, still publishing
            try:
                w.restart()
                w.serve(PROMPTS[3])
                w.flush()
                await sync.sync_once()
                check(idx, [w])
                old.publish_cleared(BS)  # a stale tail after the new run's entries
                assert old.flush(5)
            finally:
                old.close()
            w.serve(PROMPTS[4])
            w.flush()
            await sync.sync_once()
            check(idx, [w])
            s = sync.stats
            assert (s.resyncs, s.restarts, s.stale, s.gaps, s.degraded) == (1, 1, 1, 0, 0)
            # a restart whose first event is lost: a gap in a new epoch, no snapshot of it yet
            w.restart(lose_first=True)
            w.serve(PROMPTS[5])
            w.flush()
            await sync.sync_once()
            check(idx, [w], subset={"p0"})
            assert sync.degraded_workers() == {"p0"} and (s.gaps, s.degraded) == (1, 1)
            w.snapshot()
            sync.snapshot_poll_s = 0
            await sync.sync_once()
            check(idx, [w])
            assert sync.degraded_workers() == set()
    run(main())


def test_set_workers_drops_a_worker_at_once(redis_url, cluster):
    async def main():
        async with rig(redis_url, cluster, n=2) as (ws, idx, sync):
            sync.set_workers(["p0", "p1"])
            for w in ws:
                w.serve(PROMPTS[0])
                w.flush()
            await sync.sync_once()
            assert idx.lookup(PROMPTS[0]) == {"p0": 3, "p1": 3}
            sync.set_workers(["p0"])  # p1's lease lapsed
            assert idx.lookup(PROMPTS[0]) == {"p0": 3} and idx.workers() == ["p0"]
            ws[1].serve(PROMPTS[1])
            ws[1].flush()
            await sync.sync_once()
            assert "p1" not in idx.workers() and sync.exact_workers() == {"p0"}
            sync.set_workers(["p0", "p1"])  # back: a full first sync
            await sync.sync_once()
            check(idx, ws)
            sync.set_workers([])
            assert idx.num_blocks == 0 and await sync.sync_once() == 0
    run(main())


def test_run_follows_the_registry(redis_url, cluster):
    async def main():
        lease = WorkerLease(redis_url, cluster, lease_s=5.0)
        reader = RegistryReader(redis_url, cluster)
        async with rig(redis_url, cluster) as ([w], idx, sync):
            lease.renew(WorkerInfo("p0", "prefill", "127.0.0.1:1"))
            lease.renew(WorkerInfo("d0", "decode", "127.0.0.1:2"))
            task = asyncio.create_task(sync.run(interval_s=0.01, registry=reader, registry_interval_s=0.05))
            try:
                w.serve(PROMPTS[1])
                w.flush()
                for _ in range(200):
                    await asyncio.sleep(0.01)
                    if idx.lookup(PROMPTS[1]):
                        break
                assert idx.lookup(PROMPTS[1]) == {"p0": 4} and sync.exact_workers() == {"p0"}
                lease.release("p0")  # as when its lease lapses
                for _ in range(200):
                    await asyncio.sleep(0.01)
                    if not idx.workers():
                        break
                assert idx.lookup(PROMPTS[1]) == {} and idx.workers() == [] and sync.stats.errors == 0
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await reader.close()
                lease.close()
    run(main())


OPS = st.lists(st.one_of(
    st.tuples(st.just("serve"), st.integers(0, 2), st.lists(st.integers(1, 3), min_size=1, max_size=4)),
    st.tuples(st.just("lose"), st.integers(0, 2), st.lists(st.integers(1, 3), min_size=1, max_size=4)),
    st.tuples(st.just("clear"), st.integers(0, 2), st.just([])),
    st.tuples(st.just("snapshot"), st.integers(0, 2), st.just([])),
    st.tuples(st.just("restart"), st.integers(0, 2), st.just([])),
    st.tuples(st.just("sync"), st.just(0), st.just([]))), max_size=30)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, num_workers=st.integers(2, 3))
def test_random_histories_keep_the_index_equal_to_the_caches(redis_url, ops, num_workers):
    """Random inserts, evictions, clears, lost events, snapshots and restarts on 2-3 caches:
    after each sync, a healthy worker's entries equal its cache and a degraded one's are a subset
    (unless its last events were lost: no consumer can see that before its next event or snapshot);
    after a final snapshot from each, all are exact."""
    name = "idxsync-" + uuid.uuid4().hex[:8]

    async def main():
        async with rig(redis_url, name, n=num_workers, num_blocks=6, snapshot_poll_s=0,
                       trailing_gap_s=0) as (ws, idx, sync):
            sync.set_workers([w.wid for w in ws])
            for op, i, labels in ops:
                w = ws[i % num_workers]
                if op == "serve":
                    w.serve(toks(*labels))
                elif op == "lose":
                    w.lose(lambda: w.serve(toks(*labels)))
                elif op == "clear":
                    seq = w.pub.seq
                    w.cache.clear()
                    w.lost_tail &= w.pub.seq == seq
                elif op == "snapshot":
                    w.snapshot()
                elif op == "restart":
                    w.restart()
                else:
                    for x in ws:
                        x.flush()
                    await sync.sync_once()
                    check(idx, [x for x in ws if not x.lost_tail], subset=sync.degraded_workers())
            for w in ws:
                w.snapshot()
                w.flush()
            await sync.sync_once()
            check(idx, ws)
            assert not sync.degraded_workers() and sync.stats.malformed == 0
    try:
        run(main())
    finally:
        delete_cluster_keys(redis_url, name)
