"""``pdserve status``: the pools of a running cluster as the Redis registry shows them (without
``--cluster``: the running clusters, from the launch records ``pdserve up`` writes).

Reads the worker leases directly (no router or Ray needed), and the SLO attainment counters
the routers keep in Redis::

    cluster 1a2b3c4d: prefill 2 workers, decode 2 workers; SLO attainment 0.97 (1234 finished, 60 s)
    POOL     WORKER     ADDRESS           RUNNING  WAITING  FREE KV BLOCKS  LEASE AGE  METRICS
    prefill  prefill-1  10.0.0.5:40111          1        0  1998/2048       0.4 s      10.0.0.5:40112
"""

from __future__ import annotations

import asyncio
import time

from pdserve.cluster.registry import RegistryReader, WorkerInfo
from pdserve.cluster.secret import cluster_secret

POOL_ORDER = {"prefill": 0, "decode": 1, "both": 2}
COLUMNS = ("POOL", "WORKER", "ADDRESS", "RUNNING", "WAITING", "FREE KV BLOCKS", "LEASE AGE", "METRICS")


async def read_status(redis_url: str, cluster: str, window_s: float = 60.0) -> tuple[list[WorkerInfo], dict]:
    """The registered workers of ``cluster`` and its attainment counters over ``window_s`` seconds.

    Raises:
        redis.RedisError: Redis is unreachable.
    """
    from pdserve.router.admission import Admission

    reader, admission = RegistryReader(redis_url, cluster, secret=cluster_secret()), Admission(redis_url, cluster)
    try:
        return await reader.list_workers(), await admission.attainment(window_s)
    finally:
        await reader.close()
        await admission.aclose()


def format_status(cluster: str, workers: list[WorkerInfo], now: float, attainment: dict | None = None) -> str:
    """A plain-text table: one summary line per cluster, one row per worker grouped by pool.
    Lease age is ``now - heartbeat_at`` (seconds, Unix time); METRICS is the worker's Prometheus
    ``host:port`` (``GET /metrics``; ``-`` when it advertises none)."""
    pools: dict[str, list[WorkerInfo]] = {}
    for w in sorted(workers, key=lambda w: (POOL_ORDER.get(w.role, 9), w.worker_id)):
        pools.setdefault(w.role, []).append(w)
    summary = ", ".join(f"{role} {len(ws)} worker{'s' if len(ws) != 1 else ''}" for role, ws in pools.items())
    head = f"cluster {cluster}: {summary or 'no workers registered'}"
    if attainment and attainment.get("finished"):
        head += (f"; SLO attainment {attainment['attainment_both']:.2f} ({attainment['finished']} finished, "
                 f"{attainment['rejected']} rejected, {attainment['window_s']} s)")
    rows = [COLUMNS] + [
        (w.role, w.worker_id, w.address, str(w.num_running), str(w.num_waiting),
         f"{w.num_free_blocks}/{w.num_total_blocks}", f"{max(0.0, now - w.heartbeat_at):.1f} s",
         w.metrics_address or "-")
        for ws in pools.values() for w in ws]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    numeric = {3, 4}
    lines = ["  ".join(c.rjust(widths[i]) if i in numeric else c.ljust(widths[i]) for i, c in enumerate(r)).rstrip()
             for r in rows]
    return "\n".join([head, *lines])


def format_clusters(launches: dict[str, dict[str, str]], num_workers: dict[str, int]) -> str:
    """One row per running cluster (its launch record, :func:`deploy.ray_cluster.read_launches`) with its
    router and HTTP addresses, Ray address, and how many workers hold a live lease."""
    if not launches:
        return "no pdserve clusters running"
    cols = ("CLUSTER", "ROUTER", "HTTP", "RAY", "DETACHED", "WORKERS")
    rows = [cols] + [(c, r.get("router") or "-", r.get("http") or "-", r.get("ray_address") or "-",
                      "yes" if r.get("detached") == "1" else "no", str(num_workers.get(c, 0)))
                     for c, r in sorted(launches.items())]
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    return "\n".join("  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in rows)


def clusters_text(redis_url: str) -> str:
    """Every running cluster (see :func:`format_clusters`).

    Raises:
        redis.RedisError: Redis is unreachable.
    """
    from pdserve.deploy.ray_cluster import read_launches

    launches = read_launches(redis_url)

    async def count() -> dict[str, int]:
        return {c: len((await read_status(redis_url, c))[0]) for c in launches}

    return format_clusters(launches, asyncio.run(count()) if launches else {})


def status_text(redis_url: str, cluster: str) -> str:
    """Read the registry and format it (see :func:`format_status`)."""
    workers, attainment = asyncio.run(read_status(redis_url, cluster))
    return format_status(cluster, workers, time.time(), attainment)
