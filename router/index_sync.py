"""Keeps a :class:`~router.prefix_index.PrefixIndex` exact from the prefill workers' KV events.

Each live prefill worker publishes its cache changes to a Redis stream and, every
few seconds, a snapshot (``cluster/kv_events.py``, ``docs/kv_events.md``).
:class:`IndexSync` polls all the streams with one non-blocking ``XREAD`` per round
(``redis.asyncio``: it never blocks the router's event loop on Redis) and tracks,
per worker, ``(epoch, last seq, last stream entry id)``:

* next seq of the same epoch: apply it;
* an epoch seen before (a previous run's stale tail): skip;
* a new epoch at seq 1 (the worker restarted, its cache starts empty): drop the
  worker's entries and apply it -- exact, no snapshot needed;
* a seq gap, a new epoch past seq 1, or a ``stored`` event whose parent the index
  does not hold (``PrefixIndex.apply`` returns False): the worker is re-synced;
* lost LAST events show no gap until the worker's next event; the snapshot's seq
  shows them too: a snapshot that stays ahead of the stream for ``trailing_gap_s``
  means a re-sync (the snapshot seqs of all workers are polled in one round trip).

Re-sync: read the snapshot; if it covers the missing events (same epoch, seq at
least the last one missed), walk the stream back (``XREVRANGE``) from its end to the
snapshot's seq, then load the snapshot and replay the newer entries with set
semantics, all at once (no ``await`` in between: lookups never see a half-synced
worker). A snapshot may already contain a few events after its seq, so events
stamped no later than the snapshot are applied non-strictly. Without such a
snapshot the worker is *degraded*: its exact entries are dropped and events are
applied from the current position on (strictly, so the set stays prefix-closed).
That loses what the worker cached before, until its next snapshot (one every
``snapshot_interval_s``, 10 s by default), which the sync polls for and then
re-syncs from. A degraded worker's entries are a subset of its real cache, so its
lookup counts never exceed what it really holds.

Dynamo's KV-aware router consumes the same kind of per-worker event stream; the
snapshot-plus-replay re-sync is the usual log/snapshot recovery.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgpack
import redis
import redis.asyncio as aioredis

from pdserve.cluster.kv_events import KVEvent, decode_event, events_key, snapshot_key
from pdserve.router.prefix_index import PrefixIndex

log = logging.getLogger(__name__)


@dataclass
class _Worker:
    """What the sync knows of one worker's stream."""

    epoch: str | None = None  # None: nothing seen yet
    seq: int = 0  # last seq applied (or skipped as already contained)
    entry_id: str = "0-0"  # read on after this stream entry id
    lenient_until: float = 0.0  # events stamped (Unix s) up to this may be in the loaded snapshot
    retired: list[str] = field(default_factory=list)  # earlier epochs: their entries are ignored
    need: int | None = None  # degraded: a snapshot of `epoch` with seq >= need allows a re-sync
    tried: tuple[str, int] | None = None  # last snapshot (epoch, seq) tried while degraded
    behind: tuple[tuple[str, int], float] | None = None  # (snapshot head ahead of seq, monotonic time first seen)
    pending: int | None = None  # a gap seen in this sync round: re-sync needs a snapshot seq >= this
    synced: bool = False  # had its first sync


@dataclass
class SyncStats:
    """Counters since start (for metrics)."""

    events: int = 0  # entries applied
    gaps: int = 0  # seq gaps, new epochs past seq 1, rejected stored events
    restarts: int = 0  # new epochs seen from seq 1
    resyncs: int = 0  # exact re-syncs (snapshot + replay, or replay from seq 1), initial syncs included
    degraded: int = 0  # times a worker's entries were dropped for want of a covering snapshot
    stale: int = 0  # entries of retired epochs skipped
    malformed: int = 0  # undecodable entries skipped
    errors: int = 0  # failed rounds of run() (Redis errors mostly)


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

    Call :meth:`set_workers` with the live prefill workers whenever the registry is
    read, and :meth:`sync_once` periodically (or run :meth:`run` as a task); concurrent
    :meth:`sync_once` calls are serialised by a lock. Use it from the index's event loop.
    """

    def __init__(self, redis_or_url: str | aioredis.Redis, cluster: str, index: PrefixIndex, count: int = 128,
                 max_rounds: int = 8, snapshot_poll_s: float = 1.0, trailing_gap_s: float = 2.0,
                 max_replay: int = 50_000) -> None:
        self._own = not isinstance(redis_or_url, aioredis.Redis)
        self._redis = (aioredis.Redis.from_url(redis_or_url, socket_timeout=2.0, socket_connect_timeout=2.0)
                       if self._own else redis_or_url)
        self.cluster, self.index, self.count, self.max_rounds = cluster, index, count, max_rounds
        self.snapshot_poll_s, self.trailing_gap_s, self.max_replay = snapshot_poll_s, trailing_gap_s, max_replay
        self._heads_at = float("-inf")
        self.stats = SyncStats()
        self._workers: dict[str, _Worker] = {}
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
            self._workers[w] = _Worker()

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
                        self._consume(w, st, entries)
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

    # ---- the live path -----------------------------------------------------------------------------
    def _consume(self, w: str, st: _Worker, entries: list) -> None:
        """Apply a worker's new entries in order, up to the first one that needs a re-sync."""
        index, stats = self.index, self.stats
        for eid, fields in entries:
            eid = eid.decode() if isinstance(eid, bytes) else eid
            try:
                ev = decode_event(eid, fields)
            except ValueError as exc:
                stats.malformed += 1
                log.warning("skipping KV event of %s: %s", w, exc)
                st.entry_id = eid  # its seq is unknown: the next entry shows the gap
                continue
            if ev.epoch != st.epoch:
                if ev.epoch in st.retired:  # a previous run's stale tail
                    stats.stale += 1
                    st.entry_id = eid
                    continue
                if ev.seq != 1:  # a restart whose first events are missing
                    self._gap(st, ev, ev.seq - 1)
                    return
                stats.restarts += 1  # a new run, from seq 1: its cache starts empty
                _set_epoch(st, ev.epoch)
                index.load_snapshot(w, ())
                st.seq, st.lenient_until, st.need, st.tried = 0, 0.0, None, None
            elif ev.seq <= st.seq:  # already contained in the loaded snapshot
                st.entry_id = eid
                continue
            elif ev.seq != st.seq + 1:
                self._gap(st, ev, ev.seq - 1)
                return
            if not index.apply(w, ev, strict=ev.ts > st.lenient_until) and st.need is None:
                self._gap(st, ev, ev.seq)  # a prefix the index lost: the snapshot must include ev
                return
            st.seq, st.entry_id = ev.seq, eid
            stats.events += 1

    def _gap(self, st: _Worker, ev: KVEvent, need: int) -> None:
        """Stop before ``ev``: a re-sync needs a snapshot of ``ev.epoch`` with seq >= ``need``."""
        self.stats.gaps += 1
        if ev.epoch != st.epoch:
            _set_epoch(st, ev.epoch)
            st.seq = 0
        st.pending = need

    async def _on_gap(self, w: str, st: _Worker) -> None:
        """Re-sync if the snapshot covers the gap; else degrade and read on from the gap."""
        need, st.pending = st.pending, None
        head = await self._snapshot_head(w)
        if self._workers.get(w) is not st:
            return
        if head is not None and head[0] == st.epoch and head[1] >= need:
            await self._resync(w, st)
            return
        self._degrade(w, st, need)
        st.seq = max(st.seq, need)  # st.entry_id is still just before the gap: read on from there

    def _degrade(self, w: str, st: _Worker, need: int) -> None:
        if st.need is None:
            self.stats.degraded += 1
            log.warning("KV index of %s degraded until a snapshot covers seq %d", w, need)
        self.index.load_snapshot(w, ())
        st.need, st.lenient_until = need, 0.0

    async def _check_heads(self) -> None:
        """Poll every worker's snapshot seq (one pipelined round trip): re-sync a degraded worker
        whose snapshot now covers its gap, and a healthy one whose snapshot stays ahead of the
        stream for ``trailing_gap_s`` (its last events were lost: no later entry shows the gap)."""
        self._heads_at = now = time.monotonic()
        workers = list(self._workers.items())
        async with self._redis.pipeline(transaction=False) as pipe:
            for w, _ in workers:
                pipe.hmget(snapshot_key(self.cluster, w), ["epoch", "seq"])
            replies = await pipe.execute()
        for (w, st), (epoch, seq) in zip(workers, replies):
            if epoch is None or seq is None or self._workers.get(w) is not st:
                continue
            head = (epoch.decode(), int(seq))
            if head[0] != st.epoch:
                st.behind = None
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

    # ---- re-sync -------------------------------------------------------------------------------------
    async def _snapshot_head(self, w: str) -> tuple[str, int] | None:
        epoch, seq = await self._redis.hmget(snapshot_key(self.cluster, w), ["epoch", "seq"])
        return None if epoch is None or seq is None else (epoch.decode(), int(seq))

    async def _read_snapshot(self, w: str) -> tuple[str, int, list[int], float] | None:
        """(epoch, seq, hashes, ts) of the worker's snapshot, or None."""
        raw = await self._redis.hgetall(snapshot_key(self.cluster, w))
        if not raw:
            return None
        try:
            return (raw[b"epoch"].decode(), int(raw[b"seq"]), list(msgpack.unpackb(raw[b"hashes"])),
                    float(raw[b"ts"]))
        except (KeyError, TypeError, ValueError, msgpack.UnpackException) as exc:
            self.stats.malformed += 1
            log.warning("ignoring malformed KV snapshot of %s: %s", w, exc)
            return None

    async def _walk_back(self, w: str, snap: tuple | None) -> tuple[list[KVEvent], KVEvent | None, str | None, str]:
        """The newest epoch's entries past the re-sync base, oldest first.

        Returns:
            (tail, newest entry, the epoch before the newest if reached, base) with base
            ``"snapshot"`` (stopped at the snapshot's seq), ``"empty"`` (reached seq 1)
            or ``""`` (neither: the stream does not reach back to a base).
        """
        key, cursor, tail = events_key(self.cluster, w), "+", []
        newest, base, older = None, "", None
        while not base and older is None and len(tail) <= self.max_replay:
            page = await self._redis.xrevrange(key, max=cursor, min="-", count=max(self.count, 100))
            if not page:
                break
            for eid, fields in page:
                cursor = "(" + (eid.decode() if isinstance(eid, bytes) else eid)
                try:
                    ev = decode_event(eid, fields)
                except ValueError:
                    self.stats.malformed += 1
                    continue
                newest = newest or ev
                if ev.epoch != newest.epoch:
                    older = ev.epoch
                    break
                if snap is not None and ev.epoch == snap[0] and ev.seq <= snap[1]:
                    base = "snapshot"
                    break
                tail.append(ev)
                if ev.seq == 1:
                    base = "empty"
                    break
        tail.reverse()
        if not base and snap is not None and tail and tail[0].epoch == snap[0] and tail[0].seq == snap[1] + 1:
            base = "snapshot"  # the stream starts (or the epoch changes) right after the snapshot
        return tail, newest, older, base

    async def _resync(self, w: str, st: _Worker) -> None:
        """Rebuild ``w``'s exact entries from its snapshot and stream (see the module docstring).
        Reads first, then commits without awaiting: lookups see the old state or the new one."""
        snap = await self._read_snapshot(w)
        tail, newest, older, base = await self._walk_back(w, snap)
        if self._workers.get(w) is not st:
            return  # dropped meanwhile
        st.synced, st.pending = True, None
        if newest is None or (snap is not None and snap[0] != newest.epoch and snap[3] > newest.ts):
            # an empty stream, or a snapshot of a newer run than the stream shows yet
            tail, base = [], ("snapshot" if snap is not None else "empty")
            if newest is not None:
                older = newest.epoch
        seqs = [ev.seq for ev in tail]
        first = snap[1] + 1 if base == "snapshot" else 1
        if not base or seqs != list(range(first, first + len(seqs))):
            i = len(seqs) - 1  # the contiguous run that ends at the newest entry starts at i
            while i > 0 and seqs[i - 1] == seqs[i] - 1:
                i -= 1
            _set_epoch(st, newest.epoch)
            _retire(st, older)
            st.seq, st.entry_id = newest.seq, newest.entry_id  # read on from the current position
            self._degrade(w, st, seqs[i] - 1 if seqs else newest.seq)
            return
        self.index.load_snapshot(w, snap[2] if base == "snapshot" else ())
        for ev in tail:
            self.index.apply(w, ev, strict=False)
        self.stats.resyncs += 1
        self.stats.events += len(tail)
        if base == "snapshot":
            _set_epoch(st, snap[0])
            st.seq, st.lenient_until = max([snap[1], *seqs]), snap[3]
        else:
            _set_epoch(st, newest.epoch if newest is not None else None)
            st.seq, st.lenient_until = (seqs[-1] if seqs else 0), 0.0
        _retire(st, older)
        st.entry_id = newest.entry_id if newest is not None else "0-0"
        st.need = st.tried = st.behind = None


def _retire(st: _Worker, epoch: str | None) -> None:
    """Ignore ``epoch``'s entries from now on (an earlier run of the worker)."""
    if epoch is not None and epoch != st.epoch and epoch not in st.retired:
        st.retired = (st.retired + [epoch])[-16:]


def _set_epoch(st: _Worker, epoch: str | None) -> None:
    """Make ``epoch`` current; the current one, if different, is retired."""
    if epoch != st.epoch:
        old, st.epoch = st.epoch, epoch
        if epoch in st.retired:
            st.retired.remove(epoch)
        _retire(st, old)
