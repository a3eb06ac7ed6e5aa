"""KV events in Redis (the real one): order, epochs, gaps, snapshots and re-sync."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import redis

from pdserve.cluster.kv_events import KVEvent, KVEventPublisher, events_key, read_events, read_snapshot, snapshot_key
from pdserve.deploy.ray_cluster import delete_cluster_keys
from pdserve.model.block_hash import block_hashes, root_hash
from pdserve.model.kv_cache import BlockPool
from pdserve.prefill_worker.prefix_cache import PrefixCache

BS = 4


@pytest.fixture
def cluster(redis_url):
    """A private namespace; every key in it is deleted afterwards."""
    name = "kvev-" + uuid.uuid4().hex[:8]
    yield name
    delete_cluster_keys(redis_url, name)


def serve(cache: PrefixCache, prompt: list[int]) -> list[int]:
    m = cache.match(prompt)
    table = m.block_ids + cache.allocate(-(-len(prompt) // BS) - len(m.block_ids))
    cache.insert(prompt, table)
    return table


def apply(state: set[int], events: list[KVEvent]) -> set[int]:
    """A consumer's view: stored = add, removed = discard, cleared = empty."""
    for e in events:
        if e.type == "stored":
            state |= set(e.hashes)
        elif e.type == "removed":
            state -= set(e.hashes)
        else:
            state = set()
    return state


def test_stored_and_removed_in_order(redis_url, cluster):
    pub = KVEventPublisher(redis_url, cluster, "p0")
    try:
        pool = BlockPool(4)
        cache = PrefixCache(pool, BS, on_event=pub.publish)
        a, b = list(range(9)), [5] * 13
        cache.release(serve(cache, a))  # stored a's 2 blocks
        cache.release(serve(cache, b))  # needs 4 blocks: evicts a's 2 (tail first), stores b's 3
        assert pub.flush(5)
        events = read_events(redis_url, cluster, "p0")
    finally:
        pub.close()
    assert [(e.type, e.seq) for e in events] == [("stored", 1), ("removed", 2), ("stored", 3)]
    ha, hb = block_hashes(a, BS), block_hashes(b, BS)
    assert events[0].hashes == ha and events[0].parent == root_hash() and events[0].block_size == BS
    assert events[1].hashes == ha[::-1] and events[1].parent is None
    assert events[2].hashes == hb and all(0 <= h < 2**64 for h in hb)
    assert {e.epoch for e in events} == {pub.epoch} and all(abs(e.ts - time.time()) < 30 for e in events)
    assert apply(set(), events) == set(cache.snapshot())
    # reading on from an entry id
    assert [e.seq for e in read_events(redis_url, cluster, "p0", after_id=events[0].entry_id)] == [2, 3]
    assert [e.seq for e in read_events(redis_url, cluster, "p0", count=1)] == [1]


def test_new_publisher_new_epoch_seq_restarts(redis_url, cluster):
    epochs = []
    for _ in range(2):
        pub = KVEventPublisher(redis_url, cluster, "p0")
        pub.publish_cleared(BS)
        pub.publish(KVEvent("stored", [1, 2**64 - 1], root_hash(), BS))
        pub.close()
        epochs.append(pub.epoch)
    events = read_events(redis_url, cluster, "p0")
    assert [(e.epoch, e.seq, e.type) for e in events] == [
        (epochs[0], 1, "cleared"), (epochs[0], 2, "stored"), (epochs[1], 1, "cleared"), (epochs[1], 2, "stored")]
    assert epochs[0] != epochs[1] and events[1].hashes == [1, 2**64 - 1] and events[0].hashes == []


def test_overflow_drops_events_but_the_gap_is_visible(redis_url, cluster):
    pub = KVEventPublisher(redis_url, cluster, "p0", queue_size=2)
    entered, gate = threading.Event(), threading.Event()
    real_pipeline = pub._redis.pipeline

    def slow_pipeline(*a, **kw):  # the sender stalls on its first batch, as on a slow Redis
        entered.set()
        gate.wait(10)
        return real_pipeline(*a, **kw)

    pub._redis.pipeline = slow_pipeline
    try:
        ev = KVEvent("removed", [7], None, BS)
        pub.publish(ev)
        assert entered.wait(5)
        started = time.monotonic()
        seqs = [pub.publish(ev) for _ in range(4)]  # 2 fit the queue, 2 are dropped
        assert time.monotonic() - started < 0.5  # never blocks the caller
        assert seqs == [2, 3, 4, 5] and pub.num_dropped == 2
        gate.set()
        assert pub.flush(5) and pub.num_published == 3
        pub.publish(ev)
        assert pub.flush(5) and pub.num_published == 4
    finally:
        gate.set()
        pub.close()
    assert [e.seq for e in read_events(redis_url, cluster, "p0")] == [1, 2, 3, 6]


def test_unreachable_redis_drops_without_blocking(cluster):
    pub = KVEventPublisher("redis://127.0.0.1:1/0", cluster, "p0", retry_s=0.05)
    try:
        started = time.monotonic()
        seqs = [pub.publish(KVEvent("stored", [i], root_hash(), BS)) for i in range(1000)]
        assert time.monotonic() - started < 1.0
        assert seqs == list(range(1, 1001))
        assert pub.flush(10) and pub.num_dropped == 1000 and pub.num_published == 0
        with pytest.raises(redis.RedisError):
            pub.publish_snapshot([1])
    finally:
        pub.close()


def test_snapshot_round_trip_and_resync(redis_url, cluster):
    pub = KVEventPublisher(redis_url, cluster, "p0")
    try:
        pool = BlockPool(8)
        cache = PrefixCache(pool, BS, on_event=pub.publish)
        held = serve(cache, list(range(13)))
        for p in ([1] * 9, [2] * 9, [3] * 9):
            cache.release(serve(cache, p))

        def racing_snapshot():  # an eviction lands between the seq read and the snapshot
            cache.release(cache.allocate(3))
            return cache.snapshot()

        snap = pub.publish_snapshot(racing_snapshot)
        assert snap.seq == pub.seq - 1
        cache.release(held)
        cache.release(serve(cache, [4] * 17))
        cache.clear()
        cache.release(serve(cache, [5] * 9))
        assert pub.flush(5)
        got = read_snapshot(redis_url, cluster, "p0")
        assert got == snap and got.epoch == pub.epoch
        r = redis.Redis.from_url(redis_url)
        assert set(r.hgetall(snapshot_key(cluster, "p0"))) == {b"epoch", b"seq", b"hashes", b"ts"}
        r.close()
        # a consumer re-syncs: the snapshot, then the stream's events after its seq
        events = read_events(redis_url, cluster, "p0", count=10_000)
        tail = [e for e in events if e.seq > got.seq]
        assert [e.seq for e in tail] == list(range(got.seq + 1, pub.seq + 1))
        assert apply(set(got.hashes), tail) == set(cache.snapshot()) == apply(set(), events)
        pub.publish_snapshot(cache.snapshot)
        assert read_snapshot(redis_url, cluster, "p0").hashes == cache.snapshot()
    finally:
        pub.close()
    assert read_snapshot(redis_url, cluster, "nobody") is None


def test_stream_is_trimmed(redis_url, cluster):
    pub = KVEventPublisher(redis_url, cluster, "p0", maxlen=10)
    try:
        for i in range(600):
            pub.publish(KVEvent("removed", [i], None, BS))
            if i % 100 == 99:
                pub.flush(5)
        assert pub.flush(5)
    finally:
        pub.close()
    r = redis.Redis.from_url(redis_url)
    assert r.xlen(events_key(cluster, "p0")) < 300  # approximate MAXLEN: whole stream nodes go
    r.close()
