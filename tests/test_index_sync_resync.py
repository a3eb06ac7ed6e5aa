"""IndexSync re-syncs against the real Redis (see tests/test_index_sync.py): a worker's exact entries
rebuilt from its snapshot and the tail of its stream after a trimmed stream, a seq gap or lost last
events; degraded until a covering snapshot exists; events already inside a snapshot replayed leniently."""

from __future__ import annotations

import asyncio
import threading

import pytest
import redis

from pdserve.cluster.kv_events import events_key, read_events
from pdserve.deploy.ray_cluster import delete_cluster_keys
from pdserve.router.index_sync import IndexSync
from pdserve.router.prefix_index import PrefixIndex
from tests.index_sync_helpers import BS, PROMPTS, check, new_namespace, rig, run


@pytest.fixture
def cluster(redis_url):
    """A private namespace; every key in it is deleted afterwards."""
    name = new_namespace()
    yield name
    delete_cluster_keys(redis_url, name)


def test_first_sync_uses_the_snapshot_when_the_stream_is_trimmed(redis_url, cluster):
    async def main():
        async with rig(redis_url, cluster, count=2) as ([w], idx, sync):  # small pages: the walk pages too
            for p in PROMPTS[:4]:
                w.serve(p)
            snap_seq = w.snapshot()
            for p in PROMPTS[4:]:
                w.serve(p)
            w.flush()
            after = w.pub.seq - snap_seq
            assert after >= 2
            sync.set_workers(["p0"])
            await sync.sync_once()
            check(idx, [w])
            assert (sync.stats.resyncs, sync.stats.degraded) == (1, 0)
            # a new router, with the stream's head trimmed away: only the snapshot and what follows remain
            r = redis.Redis.from_url(redis_url)
            assert r.xtrim(events_key(cluster, "p0"), maxlen=after, approximate=False) > 0
            r.close()
            idx2 = PrefixIndex(BS)
            sync2 = IndexSync(redis_url, cluster, idx2)
            sync2.set_workers(["p0"])
            await sync2.sync_once()
            check(idx2, [w])
            assert (sync2.stats.resyncs, sync2.stats.degraded) == (1, 0)
            await sync2.aclose()
    run(main())


def test_gap_resyncs_from_a_covering_snapshot(redis_url, cluster):
    async def main():
        async with rig(redis_url, cluster, num_blocks=8, snapshot_poll_s=0) as ([w], idx, sync):
            sync.set_workers(["p0"])
            for p in PROMPTS[:3]:
                w.serve(p)
            w.flush()
            await sync.sync_once()
            check(idx, [w])
            w.lose(lambda: [w.serve(p) for p in PROMPTS[3:5]])  # evicts and stores: all lost
            w.snapshot()
            w.serve(PROMPTS[5])
            w.flush()
            await sync.sync_once()
            check(idx, [w])
            assert (sync.stats.gaps, sync.stats.resyncs, sync.stats.degraded) == (1, 2, 0)
    run(main())


def test_gap_without_a_snapshot_degrades_until_the_next_one(redis_url, cluster):
    async def main():
        async with rig(redis_url, cluster, num_blocks=8, snapshot_poll_s=0) as ([w], idx, sync):
            sync.set_workers(["p0"])
            w.snapshot()  # too old to help
            for p in PROMPTS[:3]:
                w.serve(p)
            w.lose(lambda: w.serve(PROMPTS[3]))
            w.serve(PROMPTS[0])
            w.serve(PROMPTS[4])
            w.flush()
            await sync.sync_once()
            assert sync.degraded_workers() == {"p0"} and sync.stats.degraded == 1
            check(idx, [w], subset={"p0"})
            assert len(idx.hashes_of("p0")) < len(w.cache.snapshot())  # lost until the next snapshot
            w.serve(PROMPTS[2])
            w.flush()
            await sync.sync_once()
            check(idx, [w], subset={"p0"})
            w.snapshot()
            w.serve(PROMPTS[5])
            w.flush()
            await sync.sync_once()
            check(idx, [w])
            assert sync.degraded_workers() == set() and sync.stats.degraded == 1
    run(main())


def test_lost_last_events_show_in_the_snapshot_seq(redis_url, cluster):
    async def main():
        async with rig(redis_url, cluster, snapshot_poll_s=0, trailing_gap_s=0.2) as ([w], idx, sync):
            sync.set_workers(["p0"])
            w.serve(PROMPTS[0])
            w.flush()
            await sync.sync_once()
            w.lose(lambda: w.serve(PROMPTS[1]))  # nothing after it: no gap visible in the stream
            w.snapshot()
            await sync.sync_once()
            assert idx.hashes_of("p0") != set(w.cache.snapshot())  # not yet: its events may be in flight
            await asyncio.sleep(0.25)
            await sync.sync_once()
            check(idx, [w])
            assert (sync.stats.gaps, sync.stats.degraded) == (1, 0)
    run(main())


def test_events_inside_a_snapshot_are_replayed_leniently(redis_url, cluster):
    """A snapshot that already contains events after its seq: replaying them over it must not
    look like a lost prefix (a stored block under a parent the snapshot no longer has)."""
    async def main():
        async with rig(redis_url, cluster) as ([w], idx, sync):
            gate, entered = threading.Event(), threading.Event()
            real_pipeline = w.pub._redis.pipeline

            def stalled_pipeline(*a, **kw):  # the sender stalls: later events reach Redis late
                entered.set()
                gate.wait(10)
                return real_pipeline(*a, **kw)

            def racing_snapshot():  # stored under PROMPTS[0]'s last block, then all evicted
                w.serve(PROMPTS[0][:-1] + [5] * BS + [99])
                w.cache.clear()
                return w.cache.snapshot()

            try:
                w.serve(PROMPTS[0])
                w.flush()
                w.pub._redis.pipeline = stalled_pipeline
                snap = w.pub.publish_snapshot(racing_snapshot)
                assert entered.wait(5) and snap.hashes == []
                sync.set_workers(["p0"])
                await sync.sync_once()  # the snapshot, and the stream up to its seq
                assert idx.hashes_of("p0") == set()
            finally:
                gate.set()
            w.flush()
            await sync.sync_once()
            check(idx, [w])
            assert (sync.stats.gaps, sync.stats.degraded, sync.stats.resyncs) == (0, 0, 1)
            # applied strictly over the snapshot, the first of them would have been rejected
            scratch = PrefixIndex(BS)
            scratch.load_snapshot("p0", snap.hashes)
            first = read_events(redis_url, cluster, "p0", count=100)[snap.seq]
            assert first.type == "stored" and not scratch.apply("p0", first)
    run(main())
