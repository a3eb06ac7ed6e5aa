"""One prefill worker's KV event stream as the router's index sync reads it: where the sync stands in
the stream, and applying the worker's new entries to the prefix index in order.

Per worker the sync tracks ``(epoch, last seq, last stream entry id)``
(:class:`StreamState`); :func:`apply_entries` takes each new entry:

* next seq of the same epoch: apply it;
* an epoch seen before (a previous run's stale tail): skip;
* a new epoch at seq 1 (the worker restarted, its cache starts empty): drop the
  worker's entries and apply it -- exact, no snapshot needed;
* a seq gap, a new epoch past seq 1, or a ``stored`` event whose parent the index
  does not hold (``PrefixIndex.apply`` returns False): stop there; the worker needs
  a re-sync (:mod:`router.snapshot_resync`), which :class:`router.index_sync.IndexSync`
  starts.

With the cluster secret (:class:`StreamAuth`), entries must carry the worker's ``mac``
(:func:`cluster.kv_event_auth.verify_event`). A forged entry (unsigned, wrongly signed,
copied from another worker or cluster) is counted (``SyncStats.forged``), logged once
per worker, and skipped as if it were not in the stream: its seq is not taken. That
keeps the index exact: the index only ever holds what genuine entries and snapshots
say, and a genuine event that the forgery displaced (deleted) shows up as a seq gap
at the next genuine entry, which re-syncs the worker from its signed snapshot. Also
with the secret, a "new" epoch whose first entry is older than the current epoch's
newest by more than ``max_clock_skew_s`` is a replay of an earlier run (a real
restart is newer): it is ignored like a stale tail.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pdserve.cluster.kv_event_auth import ForgedEntry
from pdserve.cluster.kv_events import KVEvent, decode_event
from pdserve.router.prefix_index import PrefixIndex

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamAuth:
    """What a consumer needs to check entries and snapshots: the cluster secret and the cluster name
    (the worker id comes from the stream's key). ``max_clock_skew_s``: see the module docstring."""

    secret: bytes
    cluster: str
    max_clock_skew_s: float = 30.0

    def decode(self, w: str, entry_id: bytes | str, fields: dict) -> KVEvent:
        """:func:`cluster.kv_events.decode_event` of worker ``w``'s entry, checked.

        Raises:
            ForgedEntry: unsigned or wrongly signed.
            ValueError: malformed.
        """
        return decode_event(entry_id, fields, self.secret, self.cluster, w)


def decode_checked(auth: StreamAuth | None, w: str, entry_id: bytes | str, fields: dict) -> KVEvent:
    """Decode worker ``w``'s stream entry, checking its MAC when ``auth`` is given.

    Raises:
        ForgedEntry: with ``auth``, unsigned or wrongly signed.
        ValueError: malformed.
    """
    return decode_event(entry_id, fields) if auth is None else auth.decode(w, entry_id, fields)


def note_forged(stats: SyncStats, st: StreamState | None, w: str, what: str, exc: Exception) -> None:
    """Count a forged entry or snapshot of worker ``w``; log it once per worker (``st``; None: always)."""
    stats.forged += 1
    if st is None or not st.forged_logged:
        if st is not None:
            st.forged_logged = True
        log.warning("refusing a forged KV %s of %s (logged once per worker; counted in SyncStats.forged): %s",
                    what, w, exc)


@dataclass
class StreamState:
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
    last_ts: float = 0.0  # publication time (Unix s) of the newest event known of `epoch`
    forged_logged: bool = False  # a forged entry of this worker was logged already

    def retire(self, epoch: str | None) -> None:
        """Ignore ``epoch``'s entries from now on (an earlier run of the worker)."""
        if epoch is not None and epoch != self.epoch and epoch not in self.retired:
            self.retired = (self.retired + [epoch])[-16:]

    def set_epoch(self, epoch: str | None) -> None:
        """Make ``epoch`` current; the current one, if different, is retired."""
        if epoch != self.epoch:
            old, self.epoch = self.epoch, epoch
            if epoch in self.retired:
                self.retired.remove(epoch)
            self.retire(old)


@dataclass
class SyncStats:
    """Counters of the index sync since start (for metrics)."""

    events: int = 0  # entries applied
    gaps: int = 0  # seq gaps, new epochs past seq 1, rejected stored events
    restarts: int = 0  # new epochs seen from seq 1
    resyncs: int = 0  # exact re-syncs (snapshot + replay, or replay from seq 1), initial syncs included
    degraded: int = 0  # times a worker's entries were dropped for want of a covering snapshot
    stale: int = 0  # entries of retired epochs skipped
    malformed: int = 0  # undecodable entries skipped
    forged: int = 0  # entries and snapshots refused for a missing or wrong MAC (with the cluster secret)
    errors: int = 0  # failed rounds of run() (Redis errors mostly)


def apply_entries(index: PrefixIndex, stats: SyncStats, w: str, st: StreamState, entries: list,
                  auth: StreamAuth | None = None) -> None:
    """Apply worker ``w``'s new stream ``entries`` in order, up to the first one that needs a re-sync
    (then ``st.pending`` is set). With ``auth``, forged entries are skipped (see the module docstring)."""
    for eid, fields in entries:
        eid = eid.decode() if isinstance(eid, bytes) else eid
        try:
            ev = decode_checked(auth, w, eid, fields)
        except ForgedEntry as exc:
            note_forged(stats, st, w, "event", exc)
            st.entry_id = eid  # as if absent: a genuine event it displaced shows as a seq gap
            continue
        except ValueError as exc:
            stats.malformed += 1
            log.warning("skipping KV event of %s: %s", w, exc)
            st.entry_id = eid  # its seq is unknown: the next entry shows the gap
            continue
        if ev.epoch != st.epoch:
            if ev.epoch in st.retired or (auth is not None and st.epoch is not None
                                          and ev.ts < st.last_ts - auth.max_clock_skew_s):
                stats.stale += 1  # a previous run's stale tail, or a replay of an earlier run
                st.retire(ev.epoch)
                st.entry_id = eid
                continue
            if ev.seq != 1:  # a restart whose first events are missing
                _stop_at_gap(stats, st, ev, ev.seq - 1)
                return
            stats.restarts += 1  # a new run, from seq 1: its cache starts empty
            st.set_epoch(ev.epoch)
            index.load_snapshot(w, ())
            st.seq, st.lenient_until, st.need, st.tried, st.last_ts = 0, 0.0, None, None, ev.ts
        elif ev.seq <= st.seq:  # already contained in the loaded snapshot
            st.entry_id = eid
            continue
        elif ev.seq != st.seq + 1:
            _stop_at_gap(stats, st, ev, ev.seq - 1)
            return
        if not index.apply(w, ev, strict=ev.ts > st.lenient_until) and st.need is None:
            _stop_at_gap(stats, st, ev, ev.seq)  # a prefix the index lost: the snapshot must include ev
            return
        st.seq, st.entry_id, st.last_ts = ev.seq, eid, max(st.last_ts, ev.ts)
        stats.events += 1


def _stop_at_gap(stats: SyncStats, st: StreamState, ev: KVEvent, need: int) -> None:
    """Stop before ``ev``: a re-sync needs a snapshot of ``ev.epoch`` with seq >= ``need``."""
    stats.gaps += 1
    if ev.epoch != st.epoch:
        st.set_epoch(ev.epoch)
        st.seq, st.last_ts = 0, ev.ts
    st.pending = need
