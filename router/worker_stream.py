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
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pdserve.cluster.kv_events import KVEvent, decode_event
from pdserve.router.prefix_index import PrefixIndex

log = logging.getLogger(__name__)


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
    errors: int = 0  # failed rounds of run() (Redis errors mostly)


def apply_entries(index: PrefixIndex, stats: SyncStats, w: str, st: StreamState, entries: list) -> None:
    """Apply worker ``w``'s new stream ``entries`` in order, up to the first one that needs a re-sync
    (then ``st.pending`` is set)."""
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
                _stop_at_gap(stats, st, ev, ev.seq - 1)
                return
            stats.restarts += 1  # a new run, from seq 1: its cache starts empty
            st.set_epoch(ev.epoch)
            index.load_snapshot(w, ())
            st.seq, st.lenient_until, st.need, st.tried = 0, 0.0, None, None
        elif ev.seq <= st.seq:  # already contained in the loaded snapshot
            st.entry_id = eid
            continue
        elif ev.seq != st.seq + 1:
            _stop_at_gap(stats, st, ev, ev.seq - 1)
            return
        if not index.apply(w, ev, strict=ev.ts > st.lenient_until) and st.need is None:
            _stop_at_gap(stats, st, ev, ev.seq)  # a prefix the index lost: the snapshot must include ev
            return
        st.seq, st.entry_id = ev.seq, eid
        stats.events += 1


def _stop_at_gap(stats: SyncStats, st: StreamState, ev: KVEvent, need: int) -> None:
    """Stop before ``ev``: a re-sync needs a snapshot of ``ev.epoch`` with seq >= ``need``."""
    stats.gaps += 1
    if ev.epoch != st.epoch:
        st.set_epoch(ev.epoch)
        st.seq = 0
    st.pending = need
