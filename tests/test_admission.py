"""SLO admission against the real Redis: TTFT budget, the TPOT rule for admitted requests,
expiry of a crashed router's reservations, no over-admission across router replicas, and
attainment counters."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

from pdserve.deploy.ray_cluster import delete_cluster_keys
from pdserve.router.admission import Admission, TpotParams

LOOSE = TpotParams(0.0, 0.0, 0.0, 0)  # decode side never binds


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


@pytest.fixture
def cluster(redis_url):
    """A private namespace; every key in it is deleted afterwards."""
    name = "adm-" + uuid.uuid4().hex[:8]
    yield name
    delete_cluster_keys(redis_url, name)


def test_ttft_budget_release_and_infeasible(redis_url, cluster):
    async def body():
        adm = Admission(redis_url, cluster)
        try:
            admit = lambda rid, s=0.25: adm.try_admit(rid, "p0", s, 1.0, "d0", LOOSE, 1.0)  # noqa: E731
            got = [await admit(f"r{i}") for i in range(4)]  # 0.25 + ... = 1.0: exactly four fit
            assert all(d.admitted and d.reason == "admitted" and d.retry_after_s == 0 for d in got)
            assert [d.predicted_ttft_s for d in got] == [0.25, 0.5, 0.75, 1.0]
            no = await admit("r4", 0.5)
            assert not no.admitted and no.reason == "ttft_slo" and no.predicted_ttft_s == 1.5
            assert no.retry_after_s == pytest.approx(0.5)  # the excess queued work must drain first
            assert (await adm.load("p0", "d0"))["prefill_reserved_s"] == 1.0  # the rejection reserved nothing
            assert (await admit("r0")).predicted_ttft_s == 1.0  # retried admission: not counted twice
            await adm.release_prefill("r0", "p0")
            await adm.release_prefill("r0", "p0")  # idempotent
            assert (await admit("r5")).admitted
            inf = await admit("big", 1.5)
            assert (inf.admitted, inf.reason, inf.retry_after_s) == (False, "ttft_infeasible", None)
            load = await adm.load("p0", "d0")
            assert load["prefill_reserved_s"] == 1.0 and load["decode_requests"] == 5  # r0 still decodes
            await adm.release_decode("r0", "d0")
            await adm.release_decode("r0", "d0")
            assert (await adm.load("p0", "d0"))["decode_requests"] == 4
        finally:
            await adm.aclose()
    run(body())


def test_expired_reservations_lapse(redis_url, cluster):
    async def body():
        adm = Admission(redis_url, cluster, reservation_ttl_s=0.2, decode_ttl_s=0.2)
        try:
            for i in range(2):
                assert (await adm.try_admit(f"r{i}", "p0", 0.5, 1.0, "d0", LOOSE, 1.0)).admitted
            assert not (await adm.try_admit("late", "p0", 0.5, 1.0, "d0", LOOSE, 1.0)).admitted
            r = aioredis.Redis.from_url(redis_url)
            assert 0 < await r.pttl(adm.prefill_key("p0")) <= 200 and 0 < await r.pttl(adm.decode_key("d0")) <= 200
            await asyncio.sleep(0.25)  # the router "crashed": nobody released
            d = await adm.try_admit("late", "p0", 0.5, 1.0, "d0", LOOSE, 1.0, decode_ttl_s=5.0)
            assert d.admitted and d.predicted_ttft_s == 0.5
            assert await r.hkeys(adm.prefill_key("p0")) == [b"late"] == await r.hkeys(adm.decode_key("d0"))
            assert 4000 < await r.pttl(adm.decode_key("d0")) <= 5000  # the key outlives its latest entry
            await r.aclose()
        finally:
            await adm.aclose()
    run(body())


def test_tpot_rule_protects_admitted_requests(redis_url, cluster):
    async def body():
        adm = Admission(redis_url, cluster, tpot_retry_s=0.3)
        model = TpotParams(0.0, 0.0625, 0.0, 100)  # tpot = n/16 s with n requests in the batch
        try:
            admit = lambda rid, slo: adm.try_admit(rid, "p0", 0.0, 1.0, "d0", model, slo)  # noqa: E731
            assert (await admit("tight", 0.125)).admitted  # n=1: 0.0625; tolerates n <= 2
            assert (await admit("loose1", 1.0)).predicted_tpot_s == 0.125
            no = await admit("loose2", 1.0)  # n=3: 0.1875 <= its own 1.0, but > tight's 0.125
            assert (no.admitted, no.reason, no.predicted_tpot_s, no.retry_after_s) == (
                False, "tpot_slo_admitted", 0.1875, 0.3)
            own = await admit("tight2", 0.15)
            assert (own.admitted, own.reason) == (False, "tpot_slo")
            await adm.release_decode("tight", "d0")
            assert (await admit("loose2", 1.0)).predicted_tpot_s == 0.125  # tight left: n=2 now
            alone = await adm.try_admit("x", "p1", 0.0, 1.0, "d1", model, 0.05)
            assert (alone.admitted, alone.reason, alone.retry_after_s) == (False, "tpot_infeasible", None)
            # context term: c = 1e-6 s/token, SLO 10 ms -> 10000 tokens in the batch
            ctx = lambda rid, n: adm.try_admit(rid, "p0", 0.0, 1.0, "d2", (0.0, 0.0, 1e-6, n), 0.01)  # noqa: E731
            assert (await ctx("c1", 6000)).admitted
            assert not (await ctx("c2", 5000)).admitted
            assert (await ctx("c3", 4000)).admitted
            assert (await adm.load("p0", "d2"))["decode_context_tokens"] == 10000
        finally:
            await adm.aclose()
    run(body())


@pytest.mark.parametrize("binding", ["ttft", "tpot"])
def test_no_over_admission_across_router_replicas(redis_url, cluster, binding):
    # a budget that fits exactly K = 8 requests, by the prefill queue or by the decode batch
    prefill_s, tpot = (0.125, LOOSE) if binding == "ttft" else (0.0, TpotParams(0.0, 0.0625, 0.0, 0))

    async def attempts(routers: list[Admission], ns: str) -> int:
        ds = await asyncio.gather(*(routers[i % len(routers)].try_admit(
            f"{ns}-{i}", "p0", prefill_s, 1.0, "d0", tpot, 0.5) for i in range(200)))
        return sum(d.admitted for d in ds)

    async def body():
        made = []

        def replica(ns: str) -> Admission:  # its own client and connection pool: a separate router
            pool = aioredis.BlockingConnectionPool.from_url(redis_url, max_connections=8, timeout=5)
            made.append(aioredis.Redis(connection_pool=pool))
            return Admission(made[-1], f"{cluster}:{ns}")
        try:
            two = await attempts([replica("two"), replica("two")], "two")
            one = await attempts([replica("one")], "one")
            assert two == one == 8
        finally:
            for r in made:
                await r.aclose()
    run(body())


def test_attainment_counters_and_window(redis_url, cluster):
    async def body():
        adm = Admission(redis_url, cluster)
        try:
            assert (await adm.attainment(60, now=1000.0))["attainment_both"] is None
            t = 1005.0
            await adm.record_outcome(0.1, 0.01, 0.5, 0.05, now=t)   # both met
            await adm.record_outcome(0.1, 0.09, 0.5, 0.05, now=t)   # TTFT only
            await adm.record_outcome(0.9, 0.01, 0.5, 0.05, now=t - 20)  # TPOT only, two buckets back
            await adm.record_outcome(None, None, 0.5, 0.05, now=t)  # failed before its first token
            await adm.record_rejection(now=t)
            await adm.record_outcome(0.1, 0.01, 0.5, 0.05, now=t - 300)  # outside a 60-s window
            a = await adm.attainment(60, now=t + 1)
            assert (a["finished"], a["met_ttft"], a["met_tpot"], a["met_both"], a["rejected"]) == (4, 2, 2, 1, 1)
            assert (a["attainment_ttft"], a["attainment_tpot"], a["attainment_both"]) == (0.5, 0.5, 0.25)
            assert a["attainment_offered"] == pytest.approx(0.2) and a["window_s"] == 60
            assert (await adm.attainment(10, now=t + 1))["finished"] == 3  # current bucket only
            assert (await adm.attainment(400, now=t + 1))["finished"] == 5
            r = aioredis.Redis.from_url(redis_url)
            assert 3500 < await r.ttl(adm.slo_key(1000)) <= 3600
            await r.aclose()
        finally:
            await adm.aclose()
    run(body())
