"""Discovery through Redis leases, health/reflection, and failures that must free KV blocks."""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.deploy import client
from pdserve.deploy.processes import spawn_role
from pdserve.model.sampling import SamplingParams
from pdserve.proto import worker_pb2, worker_pb2_grpc
from pdserve.proto.convert import sampling_to_wire
from tests.clusters import Cluster


def test_cluster_state_lists_workers_from_redis(fresh_cluster, redis_url):
    state = fresh_cluster.state()
    roles = sorted((w.role, w.worker_id) for w in state.workers)
    assert roles == [("decode", "d0"), ("prefill", "p0")]
    decode = next(w for w in state.workers if w.role == "decode")
    # 512 blocks less the one the decode worker's graph runner keeps for padded rows
    assert decode.kv_address and decode.num_total_blocks == 511 and decode.block_size == 16
    assert all(w.lease_age_s < 2.0 for w in state.workers)
    fresh_cluster.complete(list(range(1, 60)), max_tokens=2, temperature=0)
    time.sleep(1.0)  # the next heartbeat carries the prefill worker's measured throughput
    prefill = next(w for w in fresh_cluster.state().workers if w.role == "prefill")
    assert 0 < prefill.prefill_s_per_block < 1.0
    keys = redis.Redis.from_url(redis_url).keys(f"pdserve:{fresh_cluster.cluster}:worker:*")
    assert len(keys) == 2


def test_slo_outcomes_are_counted_without_admission(fresh_cluster):
    """The router counts every finished request's SLO outcome in Redis (admission off), so
    ``GetClusterState`` and the autoscaling planner see attainment."""
    before = fresh_cluster.state().slo.finished
    fresh_cluster.complete("Once upon a time", max_tokens=4, temperature=0)
    slo = fresh_cluster.slo_when(lambda s: s.finished >= before + 1)
    assert slo.finished == before + 1 and slo.met_ttft <= slo.finished and slo.rejected == 0


def test_health_and_reflection(fresh_cluster):
    async def probe(channel):
        health = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="pdserve.v1.Router"))
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        ask = iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        replies = [r async for r in stub.ServerReflectionInfo(ask)]
        return health.status, [s.name for s in replies[0].list_services_response.service]

    status, services = fresh_cluster.run(probe)
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert "pdserve.v1.Router" in services and "grpc.health.v1.Health" in services


def test_no_worker_is_unavailable_not_a_hang(redis_url, model_dir):
    router = spawn_role("router", dict(model_dir=model_dir, cluster="empty-" + uuid.uuid4().hex[:8],
                                       redis_url=redis_url))
    try:
        async def call():
            async with grpc.aio.insecure_channel(router.address) as channel:
                return await client.complete(channel, client.make_request("Hi"), timeout_s=10)
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            asyncio.run(call())
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no prefill worker" in info.value.details()
        assert time.monotonic() - started < 5
    finally:
        router.stop()


def _decode_call(address: str, request_id: str, prompt: list[int], kv_timeout_s: float):
    async def go():
        async with grpc.aio.insecure_channel(address) as channel:
            call = worker_pb2_grpc.DecodeWorkerStub(channel).Generate(worker_pb2.DecodeRequest(
                request_id=request_id, prompt_token_ids=prompt, kv_timeout_s=kv_timeout_s,
                sampling=sampling_to_wire(SamplingParams(temperature=0, max_tokens=8))))
            events = []
            try:
                async for ev in call:
                    events.append(ev)
            except grpc.aio.AioRpcError as exc:
                return events, exc
            return events, None
    return asyncio.run(go())


def test_decode_worker_frees_blocks_when_kv_never_arrives(fresh_cluster):
    decode = next(w for w in fresh_cluster.state().workers if w.role == "decode")
    started = time.monotonic()
    events, err = _decode_call(decode.address, "orphan-" + uuid.uuid4().hex, list(range(1, 40)), 0.5)
    assert events[0].WhichOneof("event") == "allocated" and len(events[0].allocated.block_ids) == 3
    assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE
    assert "timed out" in err.details()
    assert time.monotonic() - started < 5
    fresh_cluster.assert_pools_free()


def test_prefill_worker_frees_blocks_when_decode_is_unreachable(fresh_cluster):
    prefill = next(w for w in fresh_cluster.state().workers if w.role == "prefill")

    async def go():
        async with grpc.aio.insecure_channel(prefill.address) as channel:
            return await worker_pb2_grpc.PrefillWorkerStub(channel).Prefill(worker_pb2.PrefillRequest(
                request_id=uuid.uuid4().hex, token_ids=list(range(1, 20)), dst_kv_address="127.0.0.1:1",
                dst_block_ids=[0, 1], sampling=sampling_to_wire(SamplingParams(temperature=0))), timeout=20)

    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(go())
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "127.0.0.1:1" in info.value.details()
    fresh_cluster.assert_pools_free()


def test_duplicate_request_id_on_decode_worker_is_refused(fresh_cluster):
    decode = next(w for w in fresh_cluster.state().workers if w.role == "decode")
    rid = "dup-" + uuid.uuid4().hex

    async def go():
        async with grpc.aio.insecure_channel(decode.address) as channel:
            stub = worker_pb2_grpc.DecodeWorkerStub(channel)
            req = worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=[1, 2, 3], kv_timeout_s=2,
                                           sampling=sampling_to_wire(SamplingParams(temperature=0)))
            first = stub.Generate(req)
            await first.read()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Generate(req).read()
            first.cancel()
            return info.value

    err = asyncio.run(go())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "already in use" in err.details()
    fresh_cluster.assert_pools_free()


def test_worker_whose_lease_lapses_gets_no_more_requests(redis_url, model_dir):
    """kill -9 one of two decode workers: once its lease lapses the router stops choosing it."""
    c = Cluster(model_dir, redis_url, num_decode=2)
    try:
        assert len([w for w in c.state().workers if w.role == "decode"]) == 2
        victim = next(p for p in c.workers if p.name == "d0")
        victim.proc.kill()
        victim.proc.wait()
        deadline = time.monotonic() + 6
        while any(w.worker_id == "d0" for w in c.state().workers):
            assert time.monotonic() < deadline, "lease did not lapse"
            time.sleep(0.2)
        for _ in range(4):
            assert c.complete("Once upon a time", max_tokens=5, temperature=0).final.usage.completion_tokens == 5
        c.assert_pools_free()
    finally:
        c.stop()
