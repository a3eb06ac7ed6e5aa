"""Signed KV events and snapshots (cluster/kv_events.py) and the router's index refusing forged ones
(router/worker_stream.py, router/snapshot_resync.py, router/index_sync.py), against the real Redis with
the prefill worker's real PrefixCache and KVEventPublisher; the index must stay equal to the caches."""

from __future__ import annotations

import asyncio
import logging

import msgpack
import pytest
import redis

from pdserve.cluster.kv_event_auth import ForgedEntry, event_mac
from pdserve.cluster.kv_events import KVEventPublisher, events_key, read_events, read_snapshot, snapshot_key
from pdserve.deploy.ray_cluster import delete_cluster_keys
from pdserve.model.block_hash import block_hashes
from pdserve.model.kv_cache import BlockPool
from pdserve.prefill_worker.prefix_cache import PrefixCache
from pdserve.router.index_sync import IndexSync
from pdserve.router.prefix_index import PrefixIndex
from tests.index_sync_helpers import BS, PROMPTS, Worker, check, new_namespace, run, toks

SECRET = b"0123456789abcdef0123456789abcdef"
OTHER_SECRET = b"fedcba9876543210fedcba9876543210"


@pytest.fixture
def cluster(redis_url):
    name = new_namespace()
    yield name
    delete_cluster_keys(redis_url, name)


class SignedWorker(Worker):
    """tests.index_sync_helpers.Worker whose publisher signs with ``secret``."""

    def __init__(self, url: str, cluster: str, wid: str, secret: bytes, num_blocks: int = 10) -> None:
        self.secret = secret
        super().__init__(url, cluster, wid, num_blocks)

    def restart(self, lose_first: bool = False) -> None:
        if self.pub is not None:
            self.pub.close()
        self.pub = KVEventPublisher(self.url, self.cluster, self.wid, retry_s=0.01, secret=self.secret)
        self.cache = PrefixCache(BlockPool(self.num_blocks), BS, on_event=self.pub.publish)
        self.pub.publish_cleared(BS)
        self.lost_tail = False


def forged_stored(seq: int, epoch: str, hashes: list[int], parent: int, mac: bytes | None) -> dict:
    """A ``stored`` stream entry as an attacker with Redis write access would XADD it."""
    fields = {"seq": seq, "epoch": epoch, "type": "stored", "hashes": msgpack.packb(hashes), "parent": parent,
              "block_size": BS, "ts": "1e12"}
    if mac is not None:
        fields["mac"] = mac
    return fields


def test_signed_stream_and_snapshot_round_trip_and_bind_worker_and_cluster(redis_url, cluster):
    w = SignedWorker(redis_url, cluster, "p0", SECRET)
    r = redis.Redis.from_url(redis_url)
    try:
        w.serve(toks(1, 2))
        w.flush()
        snap = w.pub.publish_snapshot(w.cache.snapshot)
        events = read_events(redis_url, cluster, "p0", secret=SECRET)
        assert [e.type for e in events] == ["cleared", "stored"]
        assert read_snapshot(redis_url, cluster, "p0", secret=SECRET).hashes == snap.hashes
        with pytest.raises(ForgedEntry, match="wrong MAC"):  # another cluster secret
            read_events(redis_url, cluster, "p0", secret=OTHER_SECRET)
        # the same bytes under another worker's (or cluster's) keys do not verify there
        for eid, fields in r.xrange(events_key(cluster, "p0")):
            r.xadd(events_key(cluster, "p1"), fields)
        r.hset(snapshot_key(cluster, "p1"), mapping=r.hgetall(snapshot_key(cluster, "p0")))
        with pytest.raises(ForgedEntry, match="wrong MAC"):
            read_events(redis_url, cluster, "p1", secret=SECRET)
        with pytest.raises(ForgedEntry, match="wrong MAC"):
            read_snapshot(redis_url, cluster, "p1", secret=SECRET)
        # altered hashes behind an intact head: refused on the digest
        r.hset(snapshot_key(cluster, "p0"), "hashes", msgpack.packb([1, 2, 3]))
        with pytest.raises(ForgedEntry, match="digest"):
            read_snapshot(redis_url, cluster, "p0", secret=SECRET)
        # without a secret on the reading side nothing is checked (local development)
        assert len(read_events(redis_url, cluster, "p1")) == 2
    finally:
        w.close()
        r.close()


def test_index_refuses_forged_stored_events_and_stays_exact(redis_url, cluster, caplog):
    """Forged entries (unsigned, wrongly signed, copied from another worker) are counted, logged once
    and skipped: the index never holds their blocks, and the genuine entry with the same seq that
    follows applies normally."""

    async def main():
        ws = [SignedWorker(redis_url, cluster, wid, SECRET) for wid in ("p0", "p1")]
        idx = PrefixIndex(BS)
        sync = IndexSync(redis_url, cluster, idx, secret=SECRET)
        r = redis.Redis.from_url(redis_url)
        try:
            sync.set_workers(["p0", "p1"])
            for w, p in zip(ws, PROMPTS):
                w.serve(p)
                w.flush()
            await sync.sync_once()
            check(idx, ws)
            p0 = ws[0]
            seq, epoch = p0.pub.seq + 1, p0.pub.epoch
            evil = block_hashes(toks(42, 43), BS)  # a prompt p0 never computed: the attacker wants it routed there
            parent = block_hashes(PROMPTS[0], BS)[0]  # extends a prefix the index holds for p0: strict-apply OK
            copied = forged_stored(seq, epoch, evil, parent, None)
            copied["mac"] = event_mac(SECRET, cluster, "p1", copied)  # a valid MAC, for p1's stream
            for fields in (forged_stored(seq, epoch, evil, parent, None),
                           forged_stored(seq, epoch, evil, parent, b"\0" * 32),
                           forged_stored(seq, epoch, evil, parent, event_mac(OTHER_SECRET, cluster, "p0",
                                                                             forged_stored(seq, epoch, evil, parent,
                                                                                           None))),
                           copied):
                r.xadd(events_key(cluster, "p0"), fields)
            with caplog.at_level(logging.WARNING, logger="pdserve.router.worker_stream"):
                await sync.sync_once()
                assert sync.stats.forged == 4
                assert not set(evil) & idx.hashes_of("p0")
                check(idx, ws)
                p0.serve(PROMPTS[2])  # the genuine event with that seq, and more
                p0.flush()
                await sync.sync_once()
            check(idx, ws)
            assert not idx.lookup_hashes(evil)
            s = sync.stats
            assert (s.forged, s.gaps, s.degraded, s.malformed) == (4, 0, 0, 0), s
            assert [rec.getMessage().startswith("refusing a forged KV event of p0") for rec in caplog.records] \
                == [True]  # logged once for the worker, not once per entry
        finally:
            await sync.aclose()
            r.close()
            for w in ws:
                w.close()

    run(main())


def test_a_forgery_that_displaces_a_genuine_event_leaves_a_gap_resynced_from_the_signed_snapshot(redis_url, cluster):
    async def main():
        w = SignedWorker(redis_url, cluster, "p0", SECRET)
        idx = PrefixIndex(BS)
        sync = IndexSync(redis_url, cluster, idx, secret=SECRET)
        r = redis.Redis.from_url(redis_url)
        try:
            sync.set_workers(["p0"])
            w.serve(PROMPTS[0])
            w.flush()
            await sync.sync_once()
            check(idx, [w])
            w.serve(PROMPTS[1])  # the genuine entry the attacker deletes and replaces
            w.flush()
            last_id, last = r.xrevrange(events_key(cluster, "p0"), count=1)[0]
            r.xdel(events_key(cluster, "p0"), last_id)
            evil = block_hashes(toks(42), BS)
            r.xadd(events_key(cluster, "p0"), forged_stored(int(last[b"seq"]), w.pub.epoch, evil,
                                                            idx.root, b"\1" * 32))
            w.serve(PROMPTS[2])
            w.flush()
            w.snapshot()  # the worker's periodic signed snapshot covers the gap
            await sync.sync_once()
            check(idx, [w])
            assert not set(evil) & idx.hashes_of("p0")
            assert sync.stats.forged == 1 and sync.stats.gaps >= 1 and sync.stats.resyncs >= 2
            # a forged snapshot never replaces the index's state: counted, treated as missing
            r.hset(snapshot_key(cluster, "p0"), mapping={"epoch": w.pub.epoch, "seq": 10**6,
                                                         "hashes": msgpack.packb(evil), "ts": "1e12"})
            sync.snapshot_poll_s = 0.0
            await sync.sync_once()
            check(idx, [w])
            assert sync.stats.forged >= 2 and not set(evil) & idx.hashes_of("p0")
        finally:
            await sync.aclose()
            r.close()
            w.close()

    run(main())


def test_a_replayed_earlier_run_is_ignored(redis_url, cluster):
    """A Redis writer re-appends a captured earlier run (older epoch, genuine MACs) after the current
    one: the index does not take it for a restart. A real restart (newer) is followed as before."""

    async def main():
        w = SignedWorker(redis_url, cluster, "p0", SECRET)
        idx = PrefixIndex(BS)
        sync = IndexSync(redis_url, cluster, idx, secret=SECRET, max_clock_skew_s=0.0)
        r = redis.Redis.from_url(redis_url)
        try:
            sync.set_workers(["p0"])
            w.serve(PROMPTS[0])
            w.flush()
            old_run = r.xrange(events_key(cluster, "p0"))
            w.restart()  # a genuine restart: a new epoch from seq 1, newer
            w.serve(PROMPTS[3])
            w.flush()
            await sync.sync_once()
            check(idx, [w])
            for _, fields in old_run:  # the captured earlier run, replayed
                r.xadd(events_key(cluster, "p0"), fields)
            w.serve(PROMPTS[5])
            w.flush()
            await sync.sync_once()
            check(idx, [w])
            assert sync.stats.stale >= 1 and sync.stats.forged == 0
            w.restart()
            w.serve(PROMPTS[1])
            w.flush()
            await sync.sync_once()
            check(idx, [w])
        finally:
            await sync.aclose()
            r.close()
            w.close()

    run(main())


def test_unsigned_publisher_is_not_trusted_by_a_router_with_the_secret(redis_url, cluster):
    """A prefill worker without the cluster secret (misconfigured, or an impostor writing its stream):
    the router's index takes none of its events."""

    async def main():
        w = Worker(redis_url, cluster, "p0")  # unsigned
        idx = PrefixIndex(BS)
        sync = IndexSync(redis_url, cluster, idx, secret=SECRET)
        try:
            sync.set_workers(["p0"])
            for p in PROMPTS[:3]:
                w.serve(p)
            w.flush()
            w.snapshot()
            await sync.sync_once()
            assert idx.hashes_of("p0") == set() and sync.stats.forged >= 4
        finally:
            await sync.aclose()
            w.close()

    run(main())


def test_a_replay_inside_the_clock_skew_bound_heals_at_the_next_signed_snapshot(redis_url, cluster):
    """Replayed less than ``max_clock_skew_s`` after the run it copies, an earlier run passes for a
    restart; the worker's next signed snapshot, newer by more than the bound, re-syncs it."""

    async def main():
        w = SignedWorker(redis_url, cluster, "p0", SECRET)
        idx = PrefixIndex(BS)
        sync = IndexSync(redis_url, cluster, idx, secret=SECRET, max_clock_skew_s=1.0, snapshot_poll_s=0.0)
        r = redis.Redis.from_url(redis_url)
        try:
            sync.set_workers(["p0"])
            w.serve(PROMPTS[0])
            w.flush()
            old_run = r.xrange(events_key(cluster, "p0"))
            w.restart()
            w.serve(PROMPTS[3])
            w.flush()
            await sync.sync_once()
            check(idx, [w])
            for _, fields in old_run:
                r.xadd(events_key(cluster, "p0"), fields)
            await sync.sync_once()
            assert idx.hashes_of("p0") != set(w.cache.snapshot())  # taken for a restart: wrong for now
            await asyncio.sleep(1.2)
            w.serve(PROMPTS[5])
            w.flush()
            w.snapshot()
            await sync.sync_once()
            check(idx, [w])
            w.serve(PROMPTS[1])  # and it follows the genuine run again
            w.flush()
            await sync.sync_once()
            check(idx, [w])
        finally:
            await sync.aclose()
            r.close()
            w.close()

    run(main())
