"""KV cache events of a prefill worker, published to a Redis stream for the router.

Keys (schema and consumer protocol in ``docs/kv_events.md``)::

    pdserve:{cluster}:kv_events:{worker_id}    stream: one entry per event (XADD, approx. MAXLEN)
    pdserve:{cluster}:kv_snapshot:{worker_id}  hash:   every cached block hash at some seq

Publishing never blocks the caller on Redis: :meth:`KVEventPublisher.publish` stamps
the event with the next ``seq`` and puts it on a bounded queue that a background
thread drains with pipelined XADDs. When the queue is full, or Redis fails, events
are dropped, but their seq numbers are used up all the same: a consumer sees a gap
in ``seq`` and re-syncs from the snapshot. A new publisher (a worker restart) has a
new random ``epoch`` and starts again at seq 1.

With the cluster secret every stream entry and snapshot carries an HMAC-SHA256 (``mac``)
over its fields, the cluster and the worker id: a consumer with the secret refuses what a
process without it wrote, or what was copied from another worker's or cluster's keys
(:mod:`cluster.kv_event_auth`).
"""

from __future__ import annotations

import hashlib
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import msgpack
import redis

from pdserve.cluster.kv_event_auth import event_mac, snapshot_mac, verify_event, verify_snapshot
from pdserve.cluster.secret import check_secret

log = logging.getLogger(__name__)

STORED, REMOVED, CLEARED = "stored", "removed", "cleared"
EVENT_TYPES = (STORED, REMOVED, CLEARED)

@dataclass(frozen=True)
class KVEvent:
    """A change to a worker's set of cached blocks.

    Attributes:
        type: ``"stored"`` (blocks became cached), ``"removed"`` (blocks left the cache)
            or ``"cleared"`` (the worker's cache is empty: drop everything of this worker).
        hashes: chained block hashes (uint64, :mod:`model.block_hash`); for ``stored``
            one chain in order, block ``i+1``'s parent being block ``i``.
        parent: for ``stored``, the hash of the block before ``hashes[0]`` (the root
            sentinel :func:`model.block_hash.root_hash` for a sequence's first block);
            ``None`` otherwise.
        block_size: tokens per block.
        seq: per-publisher sequence number (1, 2, ...), 0 until published.
        epoch: the publisher's random id, "" until published.
        ts: Unix time (seconds) of publication, 0 until published.
        entry_id: the Redis stream entry id, set by :func:`read_events` only.
    """

    type: str
    hashes: list[int]
    parent: int | None = None
    block_size: int = 0
    seq: int = 0
    epoch: str = ""
    ts: float = 0.0
    entry_id: str = ""

    def __post_init__(self) -> None:
        if self.type not in EVENT_TYPES:
            raise ValueError(f"KVEvent.type must be one of {EVENT_TYPES}, got {self.type!r}")


@dataclass(frozen=True)
class KVSnapshot:
    """A worker's cached block hashes as of event ``seq`` of publisher ``epoch``."""

    epoch: str
    seq: int
    hashes: list[int] = field(default_factory=list)


def events_key(cluster: str, worker_id: str) -> str:
    return f"pdserve:{cluster}:kv_events:{worker_id}"


def snapshot_key(cluster: str, worker_id: str) -> str:
    return f"pdserve:{cluster}:kv_snapshot:{worker_id}"


def _client(redis_or_url: str | redis.Redis) -> redis.Redis:
    if isinstance(redis_or_url, redis.Redis):
        return redis_or_url
    return redis.Redis.from_url(redis_or_url, socket_timeout=2.0, socket_connect_timeout=2.0)


class KVEventPublisher:
    """Publishes one worker's :class:`KVEvent` s to its Redis stream; thread-safe.

    Args:
        redis_url: the cluster's Redis.
        cluster / worker_id: key namespace (see the module docstring).
        maxlen: approximate stream length kept (entries; XADD ``MAXLEN ~``).
        queue_size: events buffered while the sender catches up; beyond it they are dropped.
        retry_s: seconds the sender waits after a Redis error before sending again.
        secret: the cluster secret that signs every entry and snapshot (``mac``); None: unsigned.
    Raises:
        ValueError: ``maxlen`` or ``queue_size`` not positive; unusable secret.

    Usable directly as the prefix cache's ``on_event`` callback (``publisher.publish``
    or the publisher itself). Starts its sender thread at construction; :meth:`close`
    stops it.
    """

    def __init__(self, redis_url: str, cluster: str, worker_id: str, maxlen: int = 100_000,
                 queue_size: int = 10_000, retry_s: float = 0.5, secret: bytes | None = None) -> None:
        if maxlen <= 0 or queue_size <= 0:
            raise ValueError(f"maxlen and queue_size must be positive, got {maxlen}, {queue_size}")
        self._secret = check_secret(secret, "the KV events secret")
        self.cluster, self.worker_id, self.maxlen = cluster, worker_id, maxlen
        self.epoch = secrets.token_hex(8)
        self._key, self._snap_key = events_key(cluster, worker_id), snapshot_key(cluster, worker_id)
        self._redis = redis.Redis.from_url(redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self._queue: queue.Queue[KVEvent | None] = queue.Queue(maxsize=queue_size)
        self._retry_s = retry_s
        self._cond = threading.Condition()
        self._seq = 0  # last seq handed out
        self._settled = 0  # events sent or dropped
        self.num_published = 0
        self.num_dropped = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{worker_id}", daemon=True)
        self._thread.start()

    @property
    def seq(self) -> int:
        """The seq of the last event handed to :meth:`publish` (0 before the first)."""
        with self._cond:
            return self._seq

    def publish(self, event: KVEvent) -> int:
        """Stamp ``event`` with the next seq, ``epoch`` and ``ts`` and queue it; never blocks on Redis.

        Returns:
            The event's seq. It is used up even when the event is dropped (queue full,
            publisher closed, Redis down), so consumers see the gap.
        """
        with self._cond:
            self._seq += 1
            stamped = replace(event, seq=self._seq, epoch=self.epoch, ts=time.time())
            try:
                if self._closed:
                    raise queue.Full
                self._queue.put_nowait(stamped)  # under the lock: queue order == seq order
            except queue.Full:
                self._drop(1)
            return stamped.seq

    __call__ = publish

    def publish_cleared(self, block_size: int = 0) -> int:
        """Publish a ``cleared`` event (the worker's cache is empty, e.g. at start). Returns its seq."""
        return self.publish(KVEvent(CLEARED, [], None, block_size))

    def publish_snapshot(self, hashes: Sequence[int] | Callable[[], Sequence[int]]) -> KVSnapshot:
        """Write the snapshot key now (synchronously, one HSET): ``epoch``, ``seq`` and ``hashes``.

        Pass a callable (e.g. ``prefix_cache.snapshot``) for an exact snapshot: ``seq`` is
        read first, then the callable runs, so the snapshot already contains every event
        up to ``seq`` and perhaps a few after it; a consumer that replays the events
        after ``seq`` with set semantics (stored = add, removed = discard) ends exact.
        A plain list is stamped with the current seq: exact only if no event was
        published since it was taken.

        Raises:
            redis.RedisError: Redis is unreachable (nothing is written).
        """
        seq = self.seq
        hs = [int(h) for h in (hashes() if callable(hashes) else hashes)]
        packed = msgpack.packb(hs)
        mapping: dict[str, bytes | str | int] = {"epoch": self.epoch, "seq": seq, "hashes": packed,
                                                 "ts": repr(time.time())}
        if self._secret is not None:
            mapping["digest"] = hashlib.sha256(packed).hexdigest()
            mapping["mac"] = snapshot_mac(self._secret, self.cluster, self.worker_id, mapping)
        self._redis.hset(self._snap_key, mapping=mapping)
        return KVSnapshot(self.epoch, seq, hs)

    def snapshot_missing(self) -> bool:
        """True when Redis holds no snapshot of this worker (e.g. Redis restarted empty).

        Raises:
            redis.RedisError: Redis is unreachable.
        """
        return not self._redis.exists(self._snap_key)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every event published so far is sent or dropped. Returns False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._settled < self._seq:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (up to ``timeout_s``), stop the sender thread; later events are dropped."""
        self.flush(timeout_s)
        with self._cond:
            self._closed = True
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        self._redis.close()

    # ---- sender thread ------------------------------------------------------------------
    def _drop(self, n: int) -> None:
        """Count ``n`` events as dropped (caller holds ``_cond``)."""
        if self.num_dropped == 0 or n > 0 and (self.num_dropped + n) // 1000 > self.num_dropped // 1000:
            log.warning("KV events dropped (%d so far): consumers of %s will re-sync", self.num_dropped + n, self._key)
        self.num_dropped += n
        self._settled += n
        self._cond.notify_all()

    def _run(self) -> None:
        stop = False
        while not stop:
            batch = [self._queue.get()]
            while len(batch) < 256:  # drain what is there into one pipeline
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if None in batch:
                stop = True
                batch = batch[: batch.index(None)]
            if not batch:
                continue
            try:
                pipe = self._redis.pipeline(transaction=False)
                for ev in batch:
                    pipe.xadd(self._key, self._encode(ev), maxlen=self.maxlen, approximate=True)
                pipe.execute()
                ok = True
            except Exception as exc:  # RedisError, or anything: drop this batch, keep the thread
                log.warning("publishing %d KV events to %s failed: %s", len(batch), self._key, exc)
                ok = False
            with self._cond:
                if ok:
                    self.num_published += len(batch)
                    self._settled += len(batch)
                    self._cond.notify_all()
                else:
                    self._drop(len(batch))
            if not ok and not stop:
                time.sleep(self._retry_s)  # meanwhile the queue fills and overflows: more drops, one gap

    def _encode(self, ev: KVEvent) -> dict[str, bytes | str | int]:
        fields: dict[str, bytes | str | int] = {
            "seq": ev.seq, "epoch": ev.epoch, "type": ev.type, "hashes": msgpack.packb(list(ev.hashes)),
            "block_size": ev.block_size, "ts": repr(ev.ts)}
        if ev.type == STORED and ev.parent is not None:
            fields["parent"] = ev.parent
        if self._secret is not None:
            fields["mac"] = event_mac(self._secret, self.cluster, self.worker_id, fields)
        return fields


def decode_event(entry_id: bytes | str, fields: dict[bytes, bytes], secret: bytes | None = None,
                 cluster: str = "", worker_id: str = "") -> KVEvent:
    """One stream entry (as redis-py returns it) as a :class:`KVEvent`; with ``secret``, only if its
    ``mac`` is right for ``cluster`` and ``worker_id`` (the stream's owner).

    Raises:
        ForgedEntry: with ``secret``, the entry is unsigned or wrongly signed.
        ValueError: a field is missing or malformed.
    """
    if secret is not None:
        verify_event(fields, secret, cluster, worker_id)
    try:
        parent = fields.get(b"parent")
        return KVEvent(type=fields[b"type"].decode(), hashes=list(msgpack.unpackb(fields[b"hashes"])),
                       parent=int(parent) if parent is not None else None, block_size=int(fields[b"block_size"]),
                       seq=int(fields[b"seq"]), epoch=fields[b"epoch"].decode(), ts=float(fields[b"ts"]),
                       entry_id=entry_id.decode() if isinstance(entry_id, bytes) else entry_id)
    except (KeyError, TypeError, ValueError, msgpack.UnpackException) as exc:
        raise ValueError(f"malformed KV event entry {entry_id!r}: {exc}") from exc


def read_events(redis_url: str | redis.Redis, cluster: str, worker_id: str, after_id: str = "0-0",
                count: int = 1000, block_ms: int | None = None, secret: bytes | None = None) -> list[KVEvent]:
    """Up to ``count`` events of a worker's stream with entry ids after ``after_id``, oldest first.

    Continue with ``after_id=events[-1].entry_id``. ``block_ms`` waits that long for
    new entries when there are none (``None``: do not wait). With ``secret``, every entry must be signed.

    Raises:
        redis.RedisError: Redis is unreachable.
        ForgedEntry: with ``secret``, an unsigned or wrongly signed entry.
        ValueError: a malformed entry.
    """
    r = _client(redis_url)
    try:
        reply = r.xread({events_key(cluster, worker_id): after_id}, count=count, block=block_ms)
    finally:
        if r is not redis_url:
            r.close()
    return [decode_event(eid, fields, secret, cluster, worker_id) for _, entries in reply for eid, fields in entries]


def read_snapshot(redis_url: str | redis.Redis, cluster: str, worker_id: str,
                  secret: bytes | None = None) -> KVSnapshot | None:
    """A worker's last published snapshot, or ``None`` if it has none. With ``secret``, it must be signed.

    Raises:
        redis.RedisError: Redis is unreachable.
        ForgedEntry: with ``secret``, an unsigned, wrongly signed or altered snapshot.
        ValueError: a malformed snapshot.
    """
    r = _client(redis_url)
    try:
        raw = r.hgetall(snapshot_key(cluster, worker_id))
    finally:
        if r is not redis_url:
            r.close()
    if not raw:
        return None
    if secret is not None:
        verify_snapshot(raw, secret, cluster, worker_id)
    try:
        return KVSnapshot(raw[b"epoch"].decode(), int(raw[b"seq"]), list(msgpack.unpackb(raw[b"hashes"])))
    except (KeyError, TypeError, ValueError, msgpack.UnpackException) as exc:
        raise ValueError(f"malformed KV snapshot of {worker_id!r}: {exc}") from exc
