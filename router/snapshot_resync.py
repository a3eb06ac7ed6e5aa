"""Re-syncing one prefill worker's entries of the router's prefix index from its KV snapshot and the
tail of its event stream, and the degraded state a worker is in while no snapshot can do that.

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

The reads (:func:`read_snapshot`, :func:`walk_back`) await Redis and change nothing;
:func:`commit_resync` then changes the index and the worker's :class:`StreamState`
without awaiting. :class:`router.index_sync.IndexSync` runs them in that order and
checks in between that the worker was not dropped meanwhile. The snapshot-plus-replay
re-sync is the usual log/snapshot recovery.

With the cluster secret (a :class:`router.worker_stream.StreamAuth`), a snapshot whose
``mac`` or digest does not check out counts as missing (``SyncStats.forged``), and the
walk back skips forged entries like :func:`router.worker_stream.apply_entries` does (a
genuine entry they displaced leaves a seq hole, so the re-sync degrades instead of
loading a wrong set).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import msgpack
import redis.asyncio as aioredis

from pdserve.cluster.kv_event_auth import SNAPSHOT_HEAD_FIELDS, ForgedEntry, verify_snapshot, verify_snapshot_head
from pdserve.cluster.kv_events import KVEvent, events_key, snapshot_key
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.worker_stream import StreamAuth, StreamState, SyncStats, decode_checked, note_forged

log = logging.getLogger(__name__)


class Snapshot(NamedTuple):
    """A worker's published KV snapshot (``docs/kv_events.md``)."""

    epoch: str
    seq: int  # includes every event of `epoch` with seq <= this one
    hashes: list[int]  # every cached block, parents before children
    ts: float  # Unix time it was taken


class StreamTail(NamedTuple):
    """What :func:`walk_back` found at the end of a worker's stream."""

    events: list[KVEvent]  # the newest epoch's entries past the base, oldest first
    newest: KVEvent | None  # the stream's last entry
    older: str | None  # the epoch before the newest, if the walk reached it
    base: str  # "snapshot" (stopped at the snapshot's seq), "empty" (reached seq 1) or "" (neither)


def head_of(fields: list, w: str, stats: SyncStats, auth: StreamAuth | None,
            st: StreamState | None = None) -> tuple[str, int] | None:
    """(epoch, seq) from the values of an ``HMGET`` of :func:`head_fields` of worker ``w``'s snapshot key,
    or None: no snapshot, malformed, or (with ``auth``) forged (counted)."""
    values = dict(zip(head_fields(auth), fields))
    epoch, seq = values.get("epoch"), values.get("seq")
    if epoch is None or seq is None:
        return None
    if auth is not None:
        try:
            verify_snapshot_head(values, auth.secret, auth.cluster, w)
        except ForgedEntry as exc:
            note_forged(stats, st, w, "snapshot", exc)
            return None
    try:
        return epoch.decode(), int(seq)
    except (UnicodeDecodeError, ValueError):
        stats.malformed += 1
        return None


def head_fields(auth: StreamAuth | None) -> list[str]:
    """Snapshot fields to read for its head: epoch and seq, plus what checks them with the secret."""
    return list(SNAPSHOT_HEAD_FIELDS) if auth is not None else ["epoch", "seq"]


async def read_snapshot_head(redis: aioredis.Redis, cluster: str, w: str, stats: SyncStats | None = None,
                             auth: StreamAuth | None = None, st: StreamState | None = None) -> tuple[str, int] | None:
    """(epoch, seq) of worker ``w``'s snapshot, or None (none, malformed, or with ``auth`` forged)."""
    fields = await redis.hmget(snapshot_key(cluster, w), head_fields(auth))
    return head_of(fields, w, stats if stats is not None else SyncStats(), auth, st)


async def read_snapshot(redis: aioredis.Redis, cluster: str, w: str, stats: SyncStats,
                        auth: StreamAuth | None = None, st: StreamState | None = None) -> Snapshot | None:
    """Worker ``w``'s snapshot, or None (none published, malformed, or with ``auth`` forged: counted)."""
    raw = await redis.hgetall(snapshot_key(cluster, w))
    if not raw:
        return None
    if auth is not None:
        try:
            verify_snapshot(raw, auth.secret, auth.cluster, w)
        except ForgedEntry as exc:
            note_forged(stats, st, w, "snapshot", exc)
            return None
    try:
        return Snapshot(raw[b"epoch"].decode(), int(raw[b"seq"]), list(msgpack.unpackb(raw[b"hashes"])),
                        float(raw[b"ts"]))
    except (KeyError, TypeError, ValueError, msgpack.UnpackException) as exc:
        stats.malformed += 1
        log.warning("ignoring malformed KV snapshot of %s: %s", w, exc)
        return None


async def walk_back(redis: aioredis.Redis, cluster: str, w: str, snap: Snapshot | None, count: int,
                    max_replay: int, stats: SyncStats, auth: StreamAuth | None = None,
                    st: StreamState | None = None) -> StreamTail:
    """Read worker ``w``'s stream backwards from its end (pages of ``max(count, 100)`` entries) to the
    re-sync base: the snapshot's seq or seq 1, whichever comes first; give up past ``max_replay``
    entries or at an earlier epoch. With ``auth``, forged entries are skipped (counted)."""
    key, cursor, tail = events_key(cluster, w), "+", []
    newest, base, older = None, "", None
    while not base and older is None and len(tail) <= max_replay:
        page = await redis.xrevrange(key, max=cursor, min="-", count=max(count, 100))
        if not page:
            break
        for eid, fields in page:
            cursor = "(" + (eid.decode() if isinstance(eid, bytes) else eid)
            try:
                ev = decode_checked(auth, w, eid, fields)
            except ForgedEntry as exc:
                note_forged(stats, st, w, "event", exc)
                continue
            except ValueError:
                stats.malformed += 1
                continue
            newest = newest or ev
            if ev.epoch != newest.epoch:
                older = ev.epoch
                break
            if snap is not None and ev.epoch == snap.epoch and ev.seq <= snap.seq:
                base = "snapshot"
                break
            tail.append(ev)
            if ev.seq == 1:
                base = "empty"
                break
    tail.reverse()
    if not base and snap is not None and tail and tail[0].epoch == snap.epoch and tail[0].seq == snap.seq + 1:
        base = "snapshot"  # the stream starts (or the epoch changes) right after the snapshot
    return StreamTail(tail, newest, older, base)


def commit_resync(index: PrefixIndex, stats: SyncStats, w: str, st: StreamState, snap: Snapshot | None,
                  walked: StreamTail) -> None:
    """Rebuild ``w``'s exact entries from what :func:`read_snapshot` and :func:`walk_back` read (see the
    module docstring), or degrade it when they do not reach a base. Does not await: lookups see the
    old state or the new one."""
    tail, newest, older, base = walked
    st.synced, st.pending = True, None
    if newest is None or (snap is not None and snap.epoch != newest.epoch and snap.ts > newest.ts):
        # an empty stream, or a snapshot of a newer run than the stream shows yet
        tail, base = [], ("snapshot" if snap is not None else "empty")
        if newest is not None:
            older = newest.epoch
    seqs = [ev.seq for ev in tail]
    first = snap.seq + 1 if base == "snapshot" else 1
    if not base or seqs != list(range(first, first + len(seqs))):
        i = len(seqs) - 1  # the contiguous run that ends at the newest entry starts at i
        while i > 0 and seqs[i - 1] == seqs[i] - 1:
            i -= 1
        st.set_epoch(newest.epoch)
        st.retire(older)
        st.seq, st.entry_id = newest.seq, newest.entry_id  # read on from the current position
        st.last_ts = newest.ts
        degrade(index, stats, w, st, seqs[i] - 1 if seqs else newest.seq)
        return
    index.load_snapshot(w, snap.hashes if base == "snapshot" else ())
    for ev in tail:
        index.apply(w, ev, strict=False)
    stats.resyncs += 1
    stats.events += len(tail)
    if base == "snapshot":
        st.set_epoch(snap.epoch)
        st.seq, st.lenient_until = max([snap.seq, *seqs]), snap.ts
    else:
        st.set_epoch(newest.epoch if newest is not None else None)
        st.seq, st.lenient_until = (seqs[-1] if seqs else 0), 0.0
    st.retire(older)
    st.entry_id = newest.entry_id if newest is not None else "0-0"
    st.last_ts = max([ev.ts for ev in tail] + [snap.ts if base == "snapshot" else 0.0])
    st.need = st.tried = st.behind = None


def degrade(index: PrefixIndex, stats: SyncStats, w: str, st: StreamState, need: int) -> None:
    """Drop ``w``'s entries until a snapshot of its epoch with seq >= ``need`` allows a re-sync."""
    if st.need is None:
        stats.degraded += 1
        log.warning("KV index of %s degraded until a snapshot covers seq %d", w, need)
    index.load_snapshot(w, ())
    st.need, st.lenient_until = need, 0.0
