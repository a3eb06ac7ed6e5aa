"""One client must not be able to poison SLO admission (against the real Redis).

A client SLO of 1e300 used to make the decode reservation's TTL overflow PEXPIRE inside the admission
script after the reservation was written: Redis does not roll back, so the reservation stayed forever,
and the Redis error escaped to the client as UNKNOWN with its internals. Now client SLOs are clamped into
the operator's ranges, the reservation's lifetime is capped, the script checks every argument before it
writes anything, whatever a failed script wrote is deleted, and a Redis error is UNAVAILABLE with a
message naming no key, URL or script.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid

import grpc
import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from pdserve.deploy import client
from pdserve.deploy.ray_cluster import delete_cluster_keys
from pdserve.proto import pdserve_pb2
from pdserve.router.admission import MAX_DECODE_TTL_S, Admission, TpotParams
from pdserve.router.admit import ADMISSION_UNAVAILABLE
from pdserve.router.choose import Reservation
from pdserve.router.config import RouterConfig
from pdserve.router.slo import Slo
from tests.clusters import Cluster

pytestmark = pytest.mark.timeout(240)

ROUTER_FLAGS = {"admission": "true", "default_ttft_slo_s": 5.0, "default_tpot_slo_s": 1.0, "registry_grace_s": 60.0}
INTERNALS = ("pdserve:", "adm:", "redis", "Redis", "script", "Lua", "WRONGTYPE", "Error", "127.0.0.1", "refused",
             "user_script", "f_")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


@pytest.fixture
def namespace(redis_url):
    """A private registry namespace; every key in it is deleted afterwards."""
    name = "poison-" + uuid.uuid4().hex[:8]
    yield name
    delete_cluster_keys(redis_url, name)


def _adm_keys(redis_url: str, cluster: str) -> dict[str, dict]:
    r = redis.Redis.from_url(redis_url)
    try:
        return {k.decode(): r.hgetall(k) for k in r.scan_iter(match=f"pdserve:{cluster}:adm:*", count=500)}
    finally:
        r.close()


# -- the admission script and Admission, against the real Redis ----------------------------------------

def test_a_huge_tpot_slo_leaves_no_reservation_behind_and_later_requests_are_admitted(redis_url, namespace):
    """The finding's probe at the admission layer: the TTL the router derived from tpot_slo_s=1e300
    (ttft + 2 * max_tokens * tpot + 5) is capped; released, nothing stays; the next request is admitted."""
    async def body():
        adm = Admission(redis_url, namespace)
        try:
            tpot = 1e300
            d = await adm.try_admit("poison", "p0", 0.01, 1.0, "d0", TpotParams(0.02, 0.0, 0.0, 40), tpot,
                                    decode_ttl_s=1.0 + 2 * 16 * tpot + 5)
            assert d.admitted
            r = aioredis.Redis.from_url(redis_url)
            try:
                ttl_ms = await r.pttl(adm.decode_key("d0"))
            finally:
                await r.aclose()
            assert 0 < ttl_ms <= MAX_DECODE_TTL_S * 1000
            await adm.release_prefill("poison", "p0")
            await adm.release_decode("poison", "d0")
            assert _adm_keys(redis_url, namespace) == {}
            for i in range(3):
                ok = await adm.try_admit(f"normal-{i}", "p0", 0.01, 1.0, "d0", TpotParams(0.02, 0.0, 0.0, 40), 0.1)
                assert ok.admitted, ok
        finally:
            await adm.aclose()
    run(body())


BAD_ARGS = {  # ARGV index (1-based, as in ADMIT_LUA) -> values the script must refuse before any write
    2: ["nan", "inf", "-1", "1e400"],          # prefill_s
    3: ["0", "-0.5", "inf", "nan"],             # ttft_slo_s
    4: ["-1", "inf"], 5: ["nan"], 6: ["-inf"],  # a, b, c
    7: ["1.5", "-3", "inf"],                    # context tokens
    8: ["0", "nan", "-inf"],                    # tpot_slo_s
    9: ["0", "1.5", "1e303", "inf", "-5"],      # prefill TTL ms
    10: ["1e303", "86400001", "nan", "0"],      # decode TTL ms: 1e303 is what tpot_slo_s=1e300 used to give
    11: ["nan", "-1"],                          # tpot retry hint
}


@pytest.mark.parametrize("index, value", [(i, v) for i, vs in BAD_ARGS.items() for v in vs])
def test_the_script_refuses_a_bad_argument_and_writes_nothing(redis_url, namespace, index, value):
    async def body():
        adm = Admission(redis_url, namespace)
        try:
            for rid, ttl in (("live", 60.0), ("stale", 0.001)):  # stale: expired in a live key, purgeable
                await adm.try_admit(rid, "p0", 0.01, 1.0, "d0", TpotParams(0.0, 0.0, 0.0, 1), 1.0, decode_ttl_s=ttl)
            await asyncio.sleep(0.05)
            before = _adm_keys(redis_url, namespace)
            args = ["poison", "0.01", "1.0", "0.02", "0.0", "0.0", "40", "0.1", "30000", "60000", "0.5"]
            args[index - 1] = value
            reply = await adm._admit(keys=[adm.prefill_key("p0"), adm.decode_key("d0")], args=args)
            assert [x.decode() if isinstance(x, bytes) else x for x in reply][:2] == [0, "invalid_argument"]
            assert _adm_keys(redis_url, namespace) == before  # nothing written, not even a purge
        finally:
            await adm.aclose()
    run(body())


@pytest.mark.parametrize("kw", [dict(tpot_slo_s=math.inf), dict(ttft_slo_s=math.nan), dict(decode_ttl_s=math.inf),
                                dict(decode_ttl_s=math.nan), dict(decode_ttl_s=-1.0), dict(prefill_seconds=math.inf)])
def test_try_admit_refuses_non_finite_arguments_before_calling_redis(redis_url, namespace, kw):
    async def body():
        adm = Admission(redis_url, namespace)
        try:
            args = dict(attempt_id="x", prefill_worker="p0", prefill_seconds=0.01, ttft_slo_s=1.0, decode_worker="d0",
                        tpot_params=TpotParams(0.02, 0.0, 0.0, 4), tpot_slo_s=0.1) | kw
            with pytest.raises(ValueError):
                await adm.try_admit(**args)
            assert _adm_keys(redis_url, namespace) == {}
        finally:
            await adm.aclose()
    run(body())


def test_a_script_failing_midway_leaves_no_entry_of_its_request(redis_url, namespace):
    """A Redis error inside the script after a write (here: a decode key of the wrong type, as any Redis
    writer can make it) propagates as a RedisError, and the request's prefill entry is deleted."""
    async def body():
        adm = Admission(redis_url, namespace)
        r = aioredis.Redis.from_url(redis_url)
        try:
            await r.set(adm.decode_key("d0"), "not a hash")
            with pytest.raises(RedisError):
                await adm.try_admit("r1", "p0", 0.01, 1.0, "d0", TpotParams(0.02, 0.0, 0.0, 4), 0.1)
            assert not await r.hexists(adm.prefill_key("p0"), "r1")
        finally:
            await r.aclose()
            await adm.aclose()
    run(body())


# -- the router's pieces -------------------------------------------------------------------------------

def test_client_slos_are_clamped_into_the_operator_ranges():
    cfg = RouterConfig(model_dir="unused")
    for ttft, tpot in [(1e300, 1e300), (math.inf, math.inf), (5e-324, 5e-324), (math.nan, math.nan), (0.5, 0.05)]:
        slo = Slo(ttft, tpot).clamped(cfg.min_slo_s, cfg.max_ttft_slo_s, cfg.max_tpot_slo_s)
        assert cfg.min_slo_s <= slo.ttft_s <= cfg.max_ttft_slo_s and cfg.min_slo_s <= slo.tpot_s <= cfg.max_tpot_slo_s
    assert Slo(0.5, 0.05).clamped(cfg.min_slo_s, cfg.max_ttft_slo_s, cfg.max_tpot_slo_s) == Slo(0.5, 0.05)
    with pytest.raises(ValueError, match="default_tpot_slo_s"):
        RouterConfig(model_dir="unused", max_tpot_slo_s=0.05)  # the default 0.1 would lie outside
    with pytest.raises(ValueError, match="min_slo_s"):
        RouterConfig(model_dir="unused", min_slo_s=math.nan)


def test_releasing_a_reservation_never_raises_when_redis_fails():
    class Broken:
        async def release_prefill(self, *args):
            raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused.")

        release_decode = release_prefill

    res = Reservation(Broken(), "a1", "p0", "d0")
    run(res.release())
    assert not res.prefill_held


# -- through a router with admission -------------------------------------------------------------------

@pytest.fixture(scope="module")
def gated(redis_url, model_dir):
    c = Cluster(model_dir, redis_url, router_flags=ROUTER_FLAGS)
    yield c
    c.stop()


def _request(**slos) -> pdserve_pb2.GenerateRequest:
    req = client.make_request("Once upon a time, there was a little dog", max_tokens=6, temperature=0)
    for name, value in slos.items():
        setattr(req, name, value)
    return req


def _call(cluster: Cluster, req) -> tuple[str, str]:
    try:
        done = cluster.run(lambda ch: client.complete(ch, req, timeout_s=30))
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, exc.details() or ""
    assert done.final.usage.completion_tokens == 6
    return "OK", ""


def _no_reservations_left(cluster: Cluster, timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (left := _adm_keys(cluster.redis_url, cluster.cluster)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left == {}, left


def _inflight(cluster: Cluster) -> dict[str, int]:
    return {w.worker_id: w.num_router_inflight for w in cluster.state().workers}


def test_extreme_client_slos_are_served_and_leave_no_reservation(gated):
    finished = gated.state().slo.finished
    for slos in ({"tpot_slo_s": 1e300}, {"ttft_slo_s": 1e300, "tpot_slo_s": 1e300}, {"tpot_slo_s": 1.7e308},
                 {"ttft_slo_s": 5e-324}):
        code, details = _call(gated, _request(**slos))
        if slos.get("ttft_slo_s", 1) < 1:  # raised to min_slo_s: most likely infeasible, refused
            assert code in ("OK", "RESOURCE_EXHAUSTED"), (slos, code, details)
        else:
            assert code == "OK", (slos, code, details)
        _no_reservations_left(gated)
    for slos in ({"tpot_slo_s": math.inf}, {"tpot_slo_s": math.nan}, {"ttft_slo_s": -math.inf}):
        code, details = _call(gated, _request(**slos))
        assert code == "INVALID_ARGUMENT", (slos, code, details)
        _no_reservations_left(gated)
    for _ in range(3):  # later normal requests are admitted
        assert _call(gated, _request()) == ("OK", "")
    _no_reservations_left(gated)
    gated.slo_when(lambda s: s.finished >= finished + 6)  # the clamped ones counted too
    gated.assert_pools_free()


def test_a_redis_error_during_admission_is_unavailable_without_internals(gated):
    """A script error (the decode worker's reservation key made a string) ends the request UNAVAILABLE with a
    message naming no key, URL or script; nothing stays reserved or counted in flight; then it serves again."""
    r = redis.Redis.from_url(gated.redis_url)
    key = f"pdserve:{gated.cluster}:adm:decode:d0"
    try:
        r.set(key, "not a hash")
        code, details = _call(gated, _request())
        assert code == "UNAVAILABLE" and details == ADMISSION_UNAVAILABLE, (code, details)
        assert not any(word in details for word in INTERNALS), details
        assert set(_inflight(gated).values()) == {0}
        assert r.get(key) == b"not a hash" and not r.hlen(f"pdserve:{gated.cluster}:adm:prefill:p0")
    finally:
        r.delete(key)
        r.close()
    assert _call(gated, _request()) == ("OK", "")
    _no_reservations_left(gated)
    gated.assert_pools_free()


def test_redis_going_away_during_admission_is_unavailable_without_internals(model_dir, private_redis):
    """With its Redis gone the router still knows the workers (its last registry read), but cannot admit:
    UNAVAILABLE without internals, no in-flight count left; once Redis is back, requests are served."""
    c = Cluster(model_dir, private_redis.url, router_flags=ROUTER_FLAGS)
    try:
        assert _call(c, _request()) == ("OK", "")
        private_redis.kill()
        for _ in range(3):
            code, details = _call(c, _request())
            assert code == "UNAVAILABLE" and details == ADMISSION_UNAVAILABLE, (code, details)
            assert not any(word in details for word in INTERNALS + (str(private_redis.port),)), details
        assert set(_inflight(c).values()) == {0}
        private_redis.start()
        deadline = time.monotonic() + 20
        while (got := _call(c, _request()))[0] != "OK" and time.monotonic() < deadline:
            time.sleep(0.2)  # workers re-register within lease_s / 4
        assert got == ("OK", ""), got
        _no_reservations_left(c)
        c.assert_pools_free()
    finally:
        c.stop()
