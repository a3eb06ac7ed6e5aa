"""The worker registry in Redis: leases that workers renew, and that the router reads.

Each worker owns one key whose time-to-live is its lease::

    pdserve:{cluster}:worker:{worker_id}  ->  msgpack(WorkerInfo)                  PX lease_ms
                                              msgpack({"info": msgpack(WorkerInfo),  (with a cluster secret)
                                                       "mac": HMAC-SHA256(K, label|cluster|worker_id|info)})

A worker that stops heartbeating disappears when its key expires, and with it
from every router's view: a worker whose lease lapsed receives no new request.

With a cluster secret (:mod:`cluster.secret`) the entry is signed, and a reader that
has the secret lists only entries whose MAC checks out for that cluster and worker id:
a process without the secret cannot register as a worker (and so never receives a
request or a decode worker's KV address). A reader without a secret accepts both forms
unchecked. The MAC binds the entry's bytes, heartbeat time and lease included, but not
the key's TTL, so a reader with a secret also checks the time: an entry whose
``heartbeat_at`` is more than its ``lease_s`` plus ``max_clock_skew_s`` (30 s) in the
past (or more than ``max_clock_skew_s`` in the future) is ignored. Whoever can write to
Redis can thus replay a captured signed entry only within that window after its
heartbeat; Redis itself should still require a password (see tests/test_redis_auth_tls.py
and docs/operations.md).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from dataclasses import asdict, dataclass, replace
from urllib.parse import urlsplit, urlunsplit

import msgpack
import redis
import redis.asyncio as aioredis

from pdserve.cluster.secret import check_secret

log = logging.getLogger(__name__)

_MAC_LABEL = b"pdserve-registry/1"


@dataclass(frozen=True)
class WorkerInfo:
    """One worker as registered.

    Attributes:
        worker_id: unique within the cluster.
        role: ``"prefill"`` or ``"decode"``.
        address: gRPC ``host:port``.
        kv_address: KV receiver address (decode workers; empty otherwise): ``host:port`` for TCP,
            ``nccl://host:port`` for NCCL (see :mod:`kvtransfer.select`).
        kv_backends: KV transports the worker takes part in: a prefill worker's senders (``("tcp",)`` for a
            CPU cache, ``("nccl", "tcp")`` for a CUDA cache where NCCL loads), a decode worker's receiver
            (the one its ``kv_address`` names); the router pairs a prefill and a decode worker only when
            they share one (:mod:`kvtransfer.select`). Empty: read as ``("tcp",)``.
        num_total_blocks / num_free_blocks: KV block pool size and free blocks.
        num_running: requests decoding (decode) or being prefilled (prefill).
        num_waiting: requests waiting (for KV pages, or preempted for blocks, on decode; in the queue on
            prefill).
        num_queued_tokens: prompt tokens queued for prefill.
        block_size: tokens per KV block.
        prefill_s_per_block: the prefill worker's measured seconds per computed block (0: not yet).
        step_batch / step_context_tokens / step_seconds: the decode worker's last plain decode
            step (batch size, context tokens summed over the batch, seconds), for step-time models.
        heartbeat_at: Unix time (seconds) of the last renewal.
        lease_s: the lease the renewal took (seconds; stamped by :meth:`WorkerLease.renew`): a signed
            entry older than ``heartbeat_at + lease_s`` plus the readers' clock-skew bound is stale.
        metrics_address: ``host:port`` of the worker's Prometheus metrics (``GET /metrics``; empty: none).
        warmup_s: seconds the worker's start-up warm-up took before it first registered (0: it started
            without one, or wrote the entry before the field existed).
        pool_version: the decode worker's ``BlockPool.snapshot`` version read with ``num_free_blocks`` (0: not
            given); its request streams report the pool too, and a router keeps the report of the highest
            version, so blocks a request freed count as free before the next heartbeat.
    """

    worker_id: str
    role: str
    address: str
    kv_address: str = ""
    kv_backends: tuple[str, ...] = ()
    num_total_blocks: int = 0
    num_free_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_queued_tokens: int = 0
    block_size: int = 16
    prefill_s_per_block: float = 0.0
    step_batch: int = 0
    step_context_tokens: int = 0
    step_seconds: float = 0.0
    heartbeat_at: float = 0.0
    lease_s: float = 0.0
    metrics_address: str = ""
    warmup_s: float = 0.0
    pool_version: int = 0


DEFAULT_MAX_CLOCK_SKEW_S = 30.0
"""How far readers allow the workers' clocks to be from theirs (seconds) when checking an entry's age."""


def _key(cluster: str, worker_id: str) -> str:
    return f"pdserve:{cluster}:worker:{worker_id}"


def entry_mac(secret: bytes, cluster: str, worker_id: str, info_bytes: bytes) -> bytes:
    """``HMAC-SHA256(secret, label | cluster | worker_id | info_bytes)``: the signature of one registry entry."""
    msg = b"\0".join((_MAC_LABEL, cluster.encode(), worker_id.encode(), info_bytes))
    return hmac.new(secret, msg, hashlib.sha256).digest()


def _signed(raw: bytes) -> bool:
    """Whether a stored registry value is a signed envelope (:func:`encode_entry` with a secret)."""
    try:
        outer = msgpack.unpackb(raw)
    except Exception:  # msgpack raises several unrelated types on garbage
        return False
    return isinstance(outer, dict) and set(outer) == {"info", "mac"}


def encode_entry(info: WorkerInfo, cluster: str, secret: bytes | None) -> bytes:
    """The stored value of ``info``: plain msgpack without a secret, a signed envelope with one."""
    info_bytes = msgpack.packb(asdict(info))
    if secret is None:
        return info_bytes
    return msgpack.packb({"info": info_bytes, "mac": entry_mac(secret, cluster, info.worker_id, info_bytes)})


def decode_entry(raw: bytes, cluster: str, worker_id: str, secret: bytes | None) -> WorkerInfo:
    """Parse (and with ``secret``, authenticate) the value stored under ``worker_id``'s key.

    Raises:
        ValueError: malformed entry; with a secret, also an unsigned entry, a wrong MAC, or an
            entry whose ``worker_id`` differs from its key's. The message says which.
    """
    try:
        outer = msgpack.unpackb(raw)
    except Exception:  # msgpack raises several unrelated types on garbage
        raise ValueError("not msgpack") from None
    signed = isinstance(outer, dict) and set(outer) == {"info", "mac"}
    if secret is not None:
        if not signed:
            raise ValueError("unsigned entry (written without the cluster secret)")
        if not (isinstance(outer["info"], bytes) and isinstance(outer["mac"], bytes)
                and hmac.compare_digest(outer["mac"], entry_mac(secret, cluster, worker_id, outer["info"]))):
            raise ValueError("wrong MAC (written without the cluster secret, or for another worker or cluster)")
    fields = outer
    if signed:
        try:
            fields = msgpack.unpackb(outer["info"])
        except Exception:
            raise ValueError("signed entry holds no msgpack") from None
    if not isinstance(fields, dict):
        raise ValueError("entry is not a map")
    try:
        info = WorkerInfo(**fields)
        info = replace(info, kv_backends=tuple(info.kv_backends))  # msgpack hands tuples back as lists
    except TypeError as e:
        raise ValueError(f"not a WorkerInfo: {e}") from None
    if secret is not None and info.worker_id != worker_id:
        raise ValueError(f"entry names worker {info.worker_id!r}")
    return info


def check_fresh(info: WorkerInfo, now: float, max_clock_skew_s: float = DEFAULT_MAX_CLOCK_SKEW_S) -> None:
    """Refuse an entry outside its lease: ``heartbeat_at`` more than ``lease_s + max_clock_skew_s``
    seconds before ``now`` (Unix time), or more than ``max_clock_skew_s`` after it.

    Raises:
        ValueError: the entry is stale (a replayed or leftover entry) or dated in the future (a clock
            that is off); the message says by how much.
    """
    age = now - info.heartbeat_at
    if age > max(info.lease_s, 0.0) + max_clock_skew_s:
        raise ValueError(f"stale entry: last heartbeat {age:.1f} s ago, beyond its {info.lease_s:g} s lease "
                         f"+ {max_clock_skew_s:g} s allowed clock skew (replayed, or written without a TTL?)")
    if -age > max_clock_skew_s:
        raise ValueError(f"entry dated {-age:.1f} s in the future (beyond the {max_clock_skew_s:g} s allowed "
                         "clock skew: is the worker's clock off?)")


class _EntryParser:
    """Parses the values read from the registry keys, checking them as the readers must; logs each
    refused worker id once (bounded)."""

    def __init__(self, cluster: str, secret: bytes | None, max_clock_skew_s: float) -> None:
        if not max_clock_skew_s >= 0:
            raise ValueError(f"max_clock_skew_s must be >= 0, got {max_clock_skew_s}")
        self.cluster, self.secret, self.max_clock_skew_s = cluster, secret, max_clock_skew_s
        self.prefix = _key(cluster, "")
        self._warned: set[str] = set()  # worker ids whose bad entry was already logged
        self.signed_unchecked = False  # a signed entry was read without the secret to check it (last parse)

    def parse(self, keys: list, values: list) -> list[WorkerInfo]:
        now = time.time()
        workers = []
        self.signed_unchecked = False
        for key, raw in zip(keys, values):
            if raw is None:  # expired between SCAN and MGET
                continue
            worker_id = (key.decode(errors="replace") if isinstance(key, bytes) else key)[len(self.prefix):]
            try:
                info = decode_entry(raw, self.cluster, worker_id, self.secret)
                if self.secret is not None:
                    check_fresh(info, now, self.max_clock_skew_s)
                elif not self.signed_unchecked:
                    self.signed_unchecked = _signed(raw)
                workers.append(info)
            except ValueError as e:
                if worker_id not in self._warned:
                    if len(self._warned) >= 4096:  # bounded even if someone writes endless forged ids
                        self._warned.clear()
                    self._warned.add(worker_id)
                    log.warning("registry: ignoring the entry of worker %r in cluster %r: %s",
                                worker_id, self.cluster, e)
        return sorted(workers, key=lambda w: w.worker_id)


class WorkerLease:
    """Worker side: registers and renews one worker's lease (synchronous client).

    Args:
        redis_url: the registry (``redis://`` or ``rediss://``, with password if Redis requires one).
        cluster: registry namespace.
        lease_s: lease length in seconds.
        secret: cluster secret that signs the entry; None: the entry is unsigned.
    Raises:
        ValueError: ``lease_s <= 0``; unusable secret.
    """

    def __init__(self, redis_url: str, cluster: str, lease_s: float, secret: bytes | None = None) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        self._secret = check_secret(secret, "the registry secret")
        self._redis = redis.Redis.from_url(redis_url, socket_timeout=2.0)
        self._cluster, self._lease_ms, self._lease_s = cluster, int(lease_s * 1000), lease_s
        self._parser = _EntryParser(cluster, self._secret, DEFAULT_MAX_CLOCK_SKEW_S)

    def renew(self, info: WorkerInfo) -> None:
        """Write ``info`` (stamped with the current time and the lease, signed if there is a secret) with a
        fresh lease.

        Raises:
            redis.RedisError: Redis is unreachable (``redis.AuthenticationError``: wrong password).
        """
        info = replace(info, heartbeat_at=time.time(), lease_s=self._lease_s)
        value = encode_entry(info, self._cluster, self._secret)
        self._redis.set(_key(self._cluster, info.worker_id), value, px=self._lease_ms)

    def release(self, worker_id: str) -> None:
        """Drop the lease at once (clean shutdown)."""
        self._redis.delete(_key(self._cluster, worker_id))

    def list_workers(self) -> list[WorkerInfo]:
        """Every registered worker, checked as :meth:`RegistryReader.list_workers` checks them (synchronous).

        Raises:
            redis.RedisError: Redis is unreachable.
        """
        keys = list(self._redis.scan_iter(match=self._parser.prefix + "*", count=500))
        return self._parser.parse(keys, self._redis.mget(keys) if keys else [])

    def close(self) -> None:
        """Close the Redis client."""
        self._redis.close()


class RegistryReader:
    """Router side: lists the workers whose lease is live (asyncio client).

    Args:
        redis_url: the registry.
        cluster: registry namespace.
        secret: cluster secret entries must be signed with; None: no check.
        max_clock_skew_s: with a secret, how far (seconds) a worker's clock may be from this one's: a
            signed entry is listed only until ``heartbeat_at + lease_s + max_clock_skew_s`` (and not if
            dated more than this in the future), whatever its key's TTL says (:func:`check_fresh`).
    Raises:
        ValueError: unusable secret; ``max_clock_skew_s < 0``.
    """

    def __init__(self, redis_url: str, cluster: str, secret: bytes | None = None,
                 max_clock_skew_s: float = DEFAULT_MAX_CLOCK_SKEW_S) -> None:
        self._secret = check_secret(secret, "the registry secret")
        self._redis = aioredis.Redis.from_url(redis_url, socket_timeout=2.0)
        self._cluster = cluster
        self._parser = _EntryParser(cluster, self._secret, max_clock_skew_s)

    async def list_workers(self) -> list[WorkerInfo]:
        """Every registered worker, sorted by id. Malformed entries, and with a secret unsigned, wrongly
        signed or stale ones (outside their lease plus the clock-skew bound), are skipped (logged once
        per worker id).

        Raises:
            redis.RedisError: Redis is unreachable (``redis.AuthenticationError``: wrong password).
        """
        keys = [k async for k in self._redis.scan_iter(match=self._parser.prefix + "*", count=500)]
        values = await self._redis.mget(keys) if keys else []
        return self._parser.parse(keys, values)

    @property
    def signed_unchecked(self) -> bool:
        """Whether the last :meth:`list_workers` read signed entries this reader, without the secret, could
        not check: their workers demand the cluster secret's token on every call."""
        return self._parser.signed_unchecked

    async def close(self) -> None:
        """Close the Redis client."""
        await self._redis.aclose()


def redact_url(url: str) -> str:
    """``url`` with its password (``redis://user:PASSWORD@host``) replaced by ``***``, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:" if parts.username else ":"
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{user}***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
