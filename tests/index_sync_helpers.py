"""Helpers of the IndexSync tests (tests/test_index_sync*.py, tests/test_restarts.py): prefill workers'
real PrefixCache and KVEventPublisher against the real Redis, and the oracle check of the synced index."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import redis

from pdserve.cluster.kv_events import KVEventPublisher
from pdserve.model.block_hash import block_hashes
from pdserve.model.kv_cache import BlockPool, NoFreeBlocks
from pdserve.prefill_worker.prefix_cache import PrefixCache
from pdserve.router.index_sync import IndexSync
from pdserve.router.prefix_index import PrefixIndex

BS = 4
DOWN = "redis://127.0.0.1:1/0"  # nothing listens: publishing fails at once, events are dropped


def toks(*labels: int) -> list[int]:
    return [t for lab in labels for t in [lab] * BS] + [99]  # + a partial block: every full block is matchable


def new_namespace() -> str:
    """A fresh registry namespace for one test (delete its keys with :func:`delete_cluster_keys`)."""
    return "idxsync-" + uuid.uuid4().hex[:8]


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
