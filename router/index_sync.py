"""Keeps a :class:`~router.prefix_index.PrefixIndex` exact from the prefill workers' KV events.

Each live prefill worker publishes its cache changes to a Redis stream and, every
few seconds, a snapshot (``cluster/kv_events.py``, ``docs/kv_events.md``).
:class:`IndexSync` polls all the streams with one non-blocking ``XREAD`` per round
(``redis.asyncio``: it never blocks the router's event loop on Redis) and hands each
worker's new entries to :func:`router.worker_stream.apply_entries`, which applies
them in order and stops at a gap (a lost seq, a new epoch past seq 1, a ``stored``
event whose parent the index does not hold). A worker stopped at a gap is re-synced
from its snapshot if the snapshot covers the gap, else degraded until one does
(:mod:`router.snapshot_resync`).

Lost LAST events show no gap until the worker's next event; the snapshot's seq
shows them too: a snapshot that stays ahead of the stream for ``trailing_gap_s``
means a re-sync (the snapshot seqs of all workers are polled in one round trip).

With the cluster secret, every entry and snapshot (head included) must carry the
worker's MAC: forged ones are counted in ``stats.forged`` and treated as absent
(:mod:`router.worker_stream` says why that keeps the index exact).

Dynamo's KV-aware router consumes the same kind of per-worker event stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

import redis
import redis.asyncio as aioredis

from pdserve.cluster.kv_events import events_key, snapshot_key
from pdserve.cluster.secret import check_secret
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.snapshot_resync import (
    commit_resync,
    degrade,
    head_fields,
    head_of,
    read_snapshot,
    read_snapshot_head,
    walk_back,
)
from pdserve.router.worker_stream import StreamAuth, StreamState, SyncStats, apply_entries

log = logging.getLogger(__name__)


class IndexSync:
    """Consumes the prefill workers' KV event streams into ``index``.

    Args:
        redis_or_url: a ``redis.asyncio.Redis`` (not closed by :meth:`aclose`) or a URL.
        cluster: the registry namespace.
        index: the index to keep exact.
        count: stream entries read per worker per round; bounds the event-loop time one
            round takes: ~100 us per entry with redis-py's pure-Python reply parser (about
            80% of it; hiredis cuts that), ~20 us to decode the event and apply it.
        max_rounds: rounds per :meth:`sync_once` while some stream has more to read.
        snapshot_poll_s: seconds between polls of the workers' snapshot seqs (one pipelined
            HMGET for all): how soon a degraded worker recovers once a snapshot covers its gap.
        trailing_gap_s: a worker whose snapshot stays ahead of every entry read for this long
            lost its last events (nothing after them shows the gap): it is re-synced.
        max_replay: stream entries a re-sync walks back at most before giving up (degraded).
        secret: the cluster secret the workers sign their entries and snapshots with; None: no check.
        max_clock_skew_s: with a secret, a new epoch whose first entry is older than the current epoch's
            newest by more than this (seconds) is a replay of an earlier run, ignored.

    Raises:
        ValueError: unusable secret.

    Call :meth:`set_workers` with the live prefill workers whenever the registry is
    read, and :meth:`sync_once` periodically (or run :meth:`run` as a task); concurrent
    :meth:`sync_once` calls are serialised by a lock. Use it from the index's event loop.
    """

    def __init__(self, redis_or_url: str | aioredis.Redis, cluster: str, index: PrefixIndex, count: int = 128,
                 max_rounds: int = 8, snapshot_poll_s: float = 1.0, trailing_gap_s: float = 2.0,
                 max_replay: int = 50_000, secret: bytes | None = None, max_clock_skew_s: float = 30.0) -> None:
        secret = check_secret(secret, "the KV events secret")
        self._auth = StreamAuth(secret, cluster, max_clock_skew_s) if secret is not None else None
        self._own = not isinstance(redis_or_url, aioredis.Redis)
        self._redis = (aioredis.Redis.from_url(redis_or_url, socket_timeout=2.0, socket_connect_timeout=2.0)
                       if self._own else redis_or_url)
        self.cluster, self.index, self.count, self.max_rounds = cluster, index, count, max_rounds
        self.snapshot_poll_s, self.trailing_gap_s, self.max_replay = snapshot_poll_s, trailing_gap_s, max_replay
        self._heads_at = float("-inf")
        self.stats = SyncStats()
        self._workers: dict[str, StreamState] = {}
        self._lock = asyncio.Lock()

    # ---- membership -----------------------------------------------------------------------------
    def set_workers(self, worker_ids: Iterable[str]) -> None:
        """The live prefill workers: others are dropped from the index at once; new ones
        get their first sync at the next :meth:`sync_once`."""
        live = set(worker_ids)
        for w in [w for w in self._workers if w not in live]:
            del self._workers[w]
            self.index.drop_worker(w)
        for w in live - set(self._workers):
            self._workers[w] = StreamState()

    def exact_workers(self) -> set[str]:
        """Workers whose stream has shown events (the others need ``record_routing`` to be indexed)."""
        return {w for w, st in self._workers.items() if st.epoch is not None}

    def degraded_workers(self) -> set[str]:
        """Workers whose entries are a subset of their cache, waiting for a snapshot."""
        return {w for w, st in self._workers.items() if st.need is not None}

    # ---- polling ---------------------------------------------------------------------------------
    async def sync_once(self) -> int:
        """Read and apply what is new in every worker's stream; re-sync where needed.

        Cost: one XREAD round trip per round for all workers plus ~100 us of event-loop
        time per entry (see ``count``); every ``snapshot_poll_s`` one pipelined HMGET; a
        re-sync adds an HGETALL of the snapshot (~1 MB per 100k blocks, some 10-50 ms to
        decode and load) and an XREVRANGE walk back to it.

        Returns:
            Stream entries applied (re-sync replays included).
        Raises:
            redis.RedisError: Redis failed; the state stays consistent: call again.
        """
        async with self._lock:
            before = self.stats.events
            for w, st in list(self._workers.items()):
                if not st.synced:
                    await self._resync(w, st)
            prefix = len(events_key(self.cluster, ""))
            for _ in range(self.max_rounds):
                polled = dict(self._workers)
                if not polled:
                    break
                reply = await self._redis.xread({events_key(self.cluster, w): st.entry_id
                                                 for w, st in polled.items()}, count=self.count)
                more = False
                for key, entries in reply:
                    w = (key.decode() if isinstance(key, bytes) else key)[prefix:]
                    st = polled.get(w)
                    if st is not None and self._workers.get(w) is st:  # not dropped during the await
                        apply_entries(self.index, self.stats, w, st, entries, self._auth)
                        more |= len(entries) >= self.count
                for w, st in polled.items():
                    if st.pending is not None and self._workers.get(w) is st:
                        await self._on_gap(w, st)
                        more = True
                if not more:
                    break
                await asyncio.sleep(0)  # let lookups run between rounds
            if time.monotonic() - self._heads_at >= self.snapshot_poll_s:
                await self._check_heads()
            return self.stats.events - before

    async def run(self, interval_s: float = 0.05, registry=None, registry_interval_s: float = 1.0) -> None:
        """Call :meth:`sync_once` every ``interval_s`` seconds until cancelled; Redis errors are
        logged and retried. With ``registry`` (a ``cluster.registry.RegistryReader``), also
        refresh the live prefill workers every ``registry_interval_s`` seconds."""
        listed = float("-inf")
        while True:
            try:
                if registry is not None and time.monotonic() - listed >= registry_interval_s:
                    self.set_workers(w.worker_id for w in await registry.list_workers() if w.role == "prefill")
                    listed = time.monotonic()
                await self.sync_once()
            except (redis.RedisError, OSError) as exc:
                self.stats.errors += 1
                log.warning("KV index sync failed (retrying): %s", exc)
            except Exception:  # a bug must not stop the index from syncing for good
                self.stats.errors += 1
                log.exception("KV index sync failed (retrying)")
            await asyncio.sleep(interval_s)

    async def aclose(self) -> None:
        """Close the Redis client if this object created it."""
        if self._own:
            await self._redis.aclose()

    # ---- gaps and re-syncs -----------------------------------------------------------------------
    async def _on_gap(self, w: str, st: StreamState) -> None:
        """Re-sync if the snapshot covers the gap; else degrade and read on from the gap."""
        need, st.pending = st.pending, None
        head = await read_snapshot_head(self._redis, self.cluster, w, self.stats, self._auth, st)
        if self._workers.get(w) is not st:
            return
        if head is not None and head[0] == st.epoch and head[1] >= need:
            await self._resync(w, st)
            return
        degrade(self.index, self.stats, w, st, need)
        st.seq = max(st.seq, need)  # st.entry_id is still just before the gap: read on from there

    async def _check_heads(self) -> None:
        """Poll every worker's snapshot seq (one pipelined round trip): re-sync a degraded worker
        whose snapshot now covers its gap, and a healthy one whose snapshot stays ahead of the
        stream for ``trailing_gap_s`` (its last events were lost: no later entry shows the gap).
        With the secret, also one whose signed snapshot is of another epoch and newer, by more than
        ``max_clock_skew_s``, than anything of the epoch it follows: that epoch was a replayed run."""
        self._heads_at = now = time.monotonic()
        workers = list(self._workers.items())
        async with self._redis.pipeline(transaction=False) as pipe:
            for w, _ in workers:
                pipe.hmget(snapshot_key(self.cluster, w), head_fields(self._auth))
            replies = await pipe.execute()
        for (w, st), fields in zip(workers, replies):
            if self._workers.get(w) is not st:
                continue
            head = head_of(fields, w, self.stats, self._auth, st)
            if head is None:
                continue
            if head[0] != st.epoch:
                st.behind = None
                if self._auth is not None and float(fields[2]) > st.last_ts + self._auth.max_clock_skew_s:
                    self.stats.gaps += 1  # following a replayed run: the signed snapshot is of a newer one
                    await self._resync(w, st)
            elif st.need is not None:
                if head[1] >= st.need and head != st.tried:
                    st.tried = head
                    await self._resync(w, st)
            elif head[1] <= st.seq:
                st.behind = None
            elif st.behind is None or st.behind[0] != head:
                st.behind = (head, now)
                if self.trailing_gap_s <= 0:
                    self.stats.gaps += 1
                    await self._resync(w, st)
            elif now - st.behind[1] >= self.trailing_gap_s:
                self.stats.gaps += 1
                await self._resync(w, st)

    async def _resync(self, w: str, st: StreamState) -> None:
        """Rebuild ``w``'s exact entries from its snapshot and stream (:mod:`router.snapshot_resync`).
        Reads first, then commits without awaiting: lookups see the old state or the new one."""
        snap = await read_snapshot(self._redis, self.cluster, w, self.stats, self._auth, st)
        walked = await walk_back(self._redis, self.cluster, w, snap, self.count, self.max_replay, self.stats,
                                 self._auth, st)
        if self._workers.get(w) is not st:
            return  # dropped meanwhile
        commit_resync(self.index, self.stats, w, st, snap, walked)
