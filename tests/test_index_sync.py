"""IndexSync against the real Redis, with the prefill worker's real PrefixCache and KVEventPublisher:
the synced index equals an oracle built from each cache's snapshot()."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.cluster.kv_events import KVEventPublisher, events_key, read_events
from pdserve.cluster.registry import RegistryReader, WorkerInfo, WorkerLease
from pdserve.model.block_hash import block_hashes
from pdserve.model.kv_cache import BlockPool, NoFreeBlocks
from pdserve.prefill_worker.prefix_cache import PrefixCache
from pdserve.router.index_sync import IndexSync
from pdserve.router.prefix_index import PrefixIndex

BS = 4
DOWN = "redis://127.0.0.1:1/0"  # nothing listens: publishing fails at once, events are dropped


def toks(*labels: int) -> list[int]:
    return [t for lab in labels for t in [lab] * BS] + [99]  # + a partial block: every full block is matchable


def drop_keys(url: str, name: str) -> None:
    r = redis.Redis.from_url(url)
    keys = r.keys(f"pdserve:{name}:*")
    if keys:
        r.delete(*keys)
    r.close()


@pytest.fixture
def cluster(redis_url):
    """A private namespace; every key in it is deleted afterwards."""
    name = "idxsync-" + uuid.uuid4().hex[:8]
    yield name
    drop_keys(redis_url, name)


class Worker:
    """A prefill worker's prefix cache publishing its events, as in prefill_worker/."""

    def __init__(self, url: str, cluster: str, wid: str, num_blocks: int = 10) -> None:
        self.url, self.cluster, self.wid, self.num_blocks = url, cluster, wid, num_blocks
        self.pub: KVEventPublisher | None = None
        self.lost_tail = False  # its last events were lost: nothing shows the gap to a consumer yet
        self.restart()

    def restart(self, lose_first: bool = False) -> None:
        """A new run: new epoch, empty cache, a ``cleared`` event first (as PrefillWorker does)."""
        if self.pub is not None:
            self.pub.close()
        self.pub = KVEventPublisher(self.url, self.cluster, self.wid, retry_s=0.01)
        self.cache = PrefixCache(BlockPool(self.num_blocks), BS, on_event=self.pub.publish)
        if lose_first:
            self.lose(lambda: self.pub.publish_cleared(BS))
        else:
            self.pub.publish_cleared(BS)
            self.lost_tail = False

    def serve(self, prompt: list[int]) -> None:
        seq = self.pub.seq
        m = self.cache.match(prompt)
        try:
            table = m.block_ids + self.cache.allocate(-(-len(prompt) // BS) - len(m.block_ids))
        except NoFreeBlocks:
            self.cache.release(m.block_ids)
            return
        self.cache.insert(prompt, table)
        self.cache.release(table)
        self.lost_tail &= self.pub.seq == seq

    def lose(self, fn) -> None:
        """Run ``fn`` while Redis is unreachable for the publisher: its events are dropped, seqs used up."""
        assert self.pub.flush(5)
        good, self.pub._redis = self.pub._redis, redis.Redis.from_url(DOWN, socket_connect_timeout=0.5)
        seq = self.pub.seq
        try:
            fn()
            assert self.pub.flush(5)
            self.lost_tail |= self.pub.seq > seq
        finally:
            self.pub._redis.close()
            self.pub._redis = good

    def snapshot(self) -> int:
        """Publish a snapshot; returns its seq."""
        self.lost_tail = False  # the snapshot's seq shows the gap
        return self.pub.publish_snapshot(self.cache.snapshot).seq

    def flush(self) -> None:
        assert self.pub.flush(5)

    def close(self) -> None:
        self.pub.close()


PROMPTS = [toks(1, 2, 3), toks(1, 2, 4, 5), toks(1, 6), toks(7, 7, 7, 7), toks(1, 2, 3, 8, 8), toks(9, 1)]


def check(idx: PrefixIndex, workers: list[Worker], subset: set[str] = frozenset()) -> None:
    """The index equals each cache's snapshot (a subset for ``subset`` workers), and so do lookups."""
    for w in workers:
        truth = set(w.cache.snapshot())
        got = idx.hashes_of(w.wid)
        assert got <= truth if w.wid in subset else got == truth, w.wid
    for p in PROMPTS:
        hs = block_hashes(p, BS)
        got = idx.lookup_hashes(hs)
        for w in workers:
            n = len(w.cache.peek(p).block_ids)
            assert got.get(w.wid, 0) <= n if w.wid in subset else got.get(w.wid, 0) == n, (w.wid, p)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


@contextlib.asynccontextmanager
async def rig(url: str, cluster: str, n: int = 1, num_blocks: int = 10, **sync_kw):
    """``n`` workers p0.. publishing to ``cluster``, an index and its sync (not yet told of them)."""
    ws = [Worker(url, cluster, f"p{i}", num_blocks) for i in range(n)]
    idx = PrefixIndex(BS)
    sync = IndexSync(url, cluster, idx, **sync_kw)
    try:
        yield ws, idx, sync
    finally:
        await sync.aclose()
        for w in ws:
            w.close()


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
        drop_keys(redis_url, name)
