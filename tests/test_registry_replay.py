"""A captured signed registry entry replayed into Redis (without a TTL) is listed only within its lease
plus the clock-skew bound (cluster/registry.py), against the real Redis."""

from __future__ import annotations

import asyncio
import time
import uuid

import msgpack
import pytest
import redis

from pdserve.cluster.registry import (
    DEFAULT_MAX_CLOCK_SKEW_S,
    RegistryReader,
    WorkerInfo,
    WorkerLease,
    check_fresh,
    encode_entry,
)

SECRET = b"0123456789abcdef0123456789abcdef"


@pytest.fixture
def cluster(redis_url):
    name = "replay-" + uuid.uuid4().hex[:8]
    yield name
    r = redis.Redis.from_url(redis_url)
    for key in r.scan_iter(f"pdserve:{name}:*"):
        r.delete(key)
    r.close()


def listed(redis_url: str, cluster: str, secret: bytes | None = SECRET, **kw) -> list[str]:
    async def read():
        reader = RegistryReader(redis_url, cluster, secret=secret, **kw)
        try:
            return [w.worker_id for w in await reader.list_workers()]
        finally:
            await reader.close()

    return asyncio.run(read())


def test_captured_entry_replayed_without_ttl_stops_being_routable(redis_url, cluster, caplog):
    r = redis.Redis.from_url(redis_url)
    lease = WorkerLease(redis_url, cluster, 1.0, secret=SECRET)
    try:
        lease.renew(WorkerInfo("d0", "decode", "127.0.0.1:1", kv_address="127.0.0.1:2"))
        key = f"pdserve:{cluster}:worker:d0"
        captured = r.get(key)
        inner = msgpack.unpackb(msgpack.unpackb(captured)["info"])
        assert inner["lease_s"] == 1.0 and inner["heartbeat_at"] > 0  # the lease is signed with the entry
        lease.release("d0")  # the worker left (or died) ...
        r.set(key, captured)  # ... and someone with Redis write access puts the entry back, without a TTL
        assert r.ttl(key) == -1
        assert listed(redis_url, cluster, max_clock_skew_s=0.5) == ["d0"]  # inside lease + skew: still listed
        time.sleep(1.0 + 0.5 + 0.2)
        with caplog.at_level("WARNING", logger="pdserve.cluster.registry"):
            assert listed(redis_url, cluster, max_clock_skew_s=0.5) == []
        assert "stale entry" in caplog.text
        assert listed(redis_url, cluster, secret=None) == ["d0"]  # without a secret nothing is checked
    finally:
        lease.close()
        r.close()


def test_default_bound_is_lease_plus_30_s_and_future_entries_are_refused(redis_url, cluster):
    """Entries signed with the secret (so the attacker captured them) at various heartbeat times."""
    r = redis.Redis.from_url(redis_url)
    now = time.time()
    ages = {"fresh": 1.0, "edge": 3.0 + DEFAULT_MAX_CLOCK_SKEW_S - 2, "old": 3.0 + DEFAULT_MAX_CLOCK_SKEW_S + 2,
            "hour": 3600.0, "future": -(DEFAULT_MAX_CLOCK_SKEW_S + 5)}
    try:
        for wid, age in ages.items():
            info = WorkerInfo(wid, "decode", "127.0.0.1:1", heartbeat_at=now - age, lease_s=3.0)
            r.set(f"pdserve:{cluster}:worker:{wid}", encode_entry(info, cluster, SECRET))
        assert listed(redis_url, cluster) == ["edge", "fresh"]
        assert listed(redis_url, cluster, max_clock_skew_s=4000.0) == sorted(ages)  # configurable
        with pytest.raises(ValueError, match="stale entry"):
            check_fresh(WorkerInfo("x", "decode", "a:1", heartbeat_at=now - 40, lease_s=3.0), now)
        with pytest.raises(ValueError, match="in the future"):
            check_fresh(WorkerInfo("x", "decode", "a:1", heartbeat_at=now + 40, lease_s=3.0), now)
        check_fresh(WorkerInfo("x", "decode", "a:1", heartbeat_at=now - 32, lease_s=3.0), now)
        with pytest.raises(ValueError, match="max_clock_skew_s"):
            RegistryReader(redis_url, cluster, secret=SECRET, max_clock_skew_s=-1.0)
    finally:
        r.close()


def test_renewing_worker_stays_listed(redis_url, cluster):
    """The bound is against replays, not live workers: a worker renewing every lease_s / 4 stays."""
    lease = WorkerLease(redis_url, cluster, 0.4, secret=SECRET)
    try:
        for _ in range(6):
            lease.renew(WorkerInfo("d0", "decode", "127.0.0.1:1"))
            assert listed(redis_url, cluster, max_clock_skew_s=0.0) == ["d0"]
            time.sleep(0.1)
        assert [w.lease_s for w in lease.list_workers()] == [0.4]
    finally:
        lease.close()
