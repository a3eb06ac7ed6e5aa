"""SLO admission through the router: what cannot meet its SLOs is refused with
RESOURCE_EXHAUSTED and a reason, what can is served, and attainment is counted in Redis."""

from __future__ import annotations

import time

import grpc
import pytest

from pdserve.deploy import client
from pdserve.proto import pdserve_pb2
from tests.clusters import Cluster


@pytest.fixture(scope="module")
def gated(redis_url, model_dir):
    c = Cluster(model_dir, redis_url, decode_flags={"num_blocks": 16},       # 15 usable: 240 token positions
                router_flags={"admission": "true", "default_ttft_slo_s": 5.0, "default_tpot_slo_s": 1.0})
    yield c
    c.stop()


def _request(ttft=None, tpot=None) -> pdserve_pb2.GenerateRequest:
    req = client.make_request("Once upon a time, there was a little dog", max_tokens=8, temperature=0)
    if ttft is not None:
        req.ttft_slo_s = ttft
    if tpot is not None:
        req.tpot_slo_s = tpot
    return req


def test_feasible_requests_are_served_and_counted(gated):
    for _ in range(3):
        done = gated.run(lambda ch: client.complete(ch, _request(), timeout_s=30))
        assert done.final.usage.completion_tokens == 8
    slo = gated.slo_when(lambda s: s.finished >= 3)
    assert slo.met_both >= 3 and slo.attainment_both > 0


@pytest.mark.parametrize("ttft, tpot, reason", [(1e-7, None, "ttft"), (None, 1e-7, "tpot")])
def test_infeasible_slos_are_refused_with_a_reason(gated, ttft, tpot, reason):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        gated.run(lambda ch: client.complete(ch, _request(ttft, tpot), timeout_s=30))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "not admitted" in info.value.details() and reason in info.value.details()
    assert gated.state().slo.rejected >= 1
    gated.assert_pools_free()
    assert gated.run(lambda ch: client.complete(ch, _request(), timeout_s=30)).final is not None


def test_a_request_no_kv_pool_could_hold_is_refused_at_once_not_queued(gated):
    req = client.make_request("Once upon a time, there was a little dog", max_tokens=300, temperature=0)
    req.queue_timeout_s = 30.0
    start = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        gated.run(lambda ch: client.complete(ch, req, timeout_s=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "KV pool" in info.value.details()
    assert time.monotonic() - start < 10          # not after waiting out its queue timeout
    gated.assert_pools_free()


def test_a_dead_decode_worker_admission_reserved_is_retried_around(redis_url, model_dir):
    """Admission reserves one decode worker; if it died (its lease not yet lapsed), the request is
    dispatched again without it instead of failing, and the reservation is released."""
    c = Cluster(model_dir, redis_url, num_decode=2, router_flags={"admission": "true", "default_ttft_slo_s": 5.0,
                                                                  "default_tpot_slo_s": 1.0})
    try:
        c.wait_workers({"p0", "d0", "d1"})
        c.kill("d0")  # idle workers tie, so d0 (first by id) is the one admission picks next
        done = c.run(lambda ch: client.complete(ch, _request(), timeout_s=30))
        assert done.final.usage.completion_tokens == 8 and done.final.num_retries >= 1
        c.wait_workers({"p0", "d1"})
        c.assert_pools_free()
    finally:
        c.stop()
