"""The worker registry in Redis: leases that workers renew, and that the router reads.

Each worker owns one key whose time-to-live is its lease::

    pdserve:{cluster}:worker:{worker_id}  ->  msgpack(WorkerInfo)   PX lease_ms

A worker that stops heartbeating disappears when its key expires, and with it
from every router's view: a worker whose lease lapsed receives no new request.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace

import msgpack
import redis
import redis.asyncio as aioredis


@dataclass(frozen=True)
class WorkerInfo:
    """One worker as registered.

    Attributes:
        worker_id: unique within the cluster.
        role: ``"prefill"`` or ``"decode"``.
        address: gRPC ``host:port``.
        kv_address: KV receiver ``host:port`` (decode workers; empty otherwise).
        num_total_blocks / num_free_blocks: KV block pool size and free blocks.
        num_running: requests decoding (decode) or being prefilled (prefill).
        num_waiting: requests waiting (for KV pages on decode, in the queue on prefill).
        num_queued_tokens: prompt tokens queued for prefill.
        block_size: tokens per KV block.
        prefill_s_per_block: the prefill worker's measured seconds per computed block (0: not yet).
        step_batch / step_context_tokens / step_seconds: the decode worker's last plain decode
            step (batch size, context tokens summed over the batch, seconds), for step-time models.
        heartbeat_at: Unix time (seconds) of the last renewal.
    """

    worker_id: str
    role: str
    address: str
    kv_address: str = ""
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


def _key(cluster: str, worker_id: str) -> str:
    return f"pdserve:{cluster}:worker:{worker_id}"


class WorkerLease:
    """Worker side: registers and renews one worker's lease (synchronous client)."""

    def __init__(self, redis_url: str, cluster: str, lease_s: float) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        self._redis = redis.Redis.from_url(redis_url, socket_timeout=2.0)
        self._cluster, self._lease_ms = cluster, int(lease_s * 1000)

    def renew(self, info: WorkerInfo) -> None:
        """Write ``info`` (stamped with the current time) with a fresh lease.

        Raises:
            redis.RedisError: Redis is unreachable.
        """
        info = replace(info, heartbeat_at=time.time())
        self._redis.set(_key(self._cluster, info.worker_id), msgpack.packb(asdict(info)), px=self._lease_ms)

    def release(self, worker_id: str) -> None:
        """Drop the lease at once (clean shutdown)."""
        self._redis.delete(_key(self._cluster, worker_id))

    def close(self) -> None:
        self._redis.close()


class RegistryReader:
    """Router side: lists the workers whose lease is live (asyncio client)."""

    def __init__(self, redis_url: str, cluster: str) -> None:
        self._redis = aioredis.Redis.from_url(redis_url, socket_timeout=2.0)
        self._pattern = _key(cluster, "*")

    async def list_workers(self) -> list[WorkerInfo]:
        """Every registered worker, sorted by id. Malformed entries are skipped.

        Raises:
            redis.RedisError: Redis is unreachable.
        """
        keys = [k async for k in self._redis.scan_iter(match=self._pattern, count=500)]
        values = await self._redis.mget(keys) if keys else []
        workers = []
        for raw in values:
            if raw is None:  # expired between SCAN and MGET
                continue
            try:
                workers.append(WorkerInfo(**msgpack.unpackb(raw)))
            except (TypeError, ValueError, msgpack.UnpackException):
                continue
        return sorted(workers, key=lambda w: w.worker_id)

    async def close(self) -> None:
        await self._redis.aclose()
