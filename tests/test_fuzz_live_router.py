"""The request-validation fuzzers' smaller set through a live router (real processes): bad requests end
with INVALID_ARGUMENT carrying the in-process validation's message, good ones stream to ``final``, and
afterwards the cluster still serves and every KV pool is free."""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.deploy import client
from pdserve.proto import pdserve_pb2
from tests.fuzz_requests import requests, run, valid_requests, wire_records

pytestmark = pytest.mark.timeout(240)


async def _call(channel, raw: bytes) -> tuple[str, str, int]:
    rpc = channel.unary_stream("/pdserve.v1.Router/Generate",
                               response_deserializer=pdserve_pb2.GenerateResponse.FromString)
    try:
        msgs = [m async for m in rpc(raw, timeout=30)]
    except grpc.aio.AioRpcError as e:
        return e.code().name, e.details() or "", 0
    finals = [m.final for m in msgs if m.HasField("final")]
    return "OK", "", len(finals)


LIVE: Counter = Counter()


@settings(max_examples=40, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(raw=st.binary(max_size=60) | requests().map(lambda r: _short(r).SerializeToString())
       | valid_requests().map(lambda r: r.SerializeToString())
       | st.tuples(requests(), st.lists(wire_records(), min_size=1, max_size=2)).map(
           lambda t: _short(t[0]).SerializeToString() + b"".join(t[1])))
def test_live_router_answers_invalid_argument_or_serves(cluster, raw):
    local = run(raw)
    code, details, finals = cluster.run(lambda ch: _call(ch, raw))
    if isinstance(local, ValueError):
        assert code == "INVALID_ARGUMENT", (code, details, str(local))
        assert details == str(local)
    else:
        assert (code, finals) == ("OK", 1), (code, details)
    LIVE[code] += 1


def _short(req: pdserve_pb2.GenerateRequest) -> pdserve_pb2.GenerateRequest:
    """Keep generated requests cheap to serve live: at most 8 output tokens."""
    if req.sampling.HasField("max_tokens") and req.sampling.max_tokens > 8:
        req.sampling.max_tokens = 8
    return req


def test_live_malformed_cluster_state_request_is_invalid_argument(cluster):
    async def call(channel):
        rpc = channel.unary_unary("/pdserve.v1.Router/GetClusterState", request_serializer=lambda b: b,
                                  response_deserializer=pdserve_pb2.ClusterState.FromString)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await rpc(b"\xff", timeout=30)
        return info.value
    error = cluster.run(call)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed GetClusterStateRequest" in error.details()
    assert cluster.state().workers                                    # and the next call is answered


def test_live_duplicate_request_ids_both_served_then_pools_free(cluster):
    """Two concurrent requests claiming one client request id are independent (the router runs
    each under its own internal id); afterwards the cluster serves and every KV pool is free."""
    req = client.make_request("Once upon a time", max_tokens=6, temperature=0)
    req.request_id = "same-id"

    async def both(channel):
        return await asyncio.gather(*(client.complete(channel, req, timeout_s=30) for _ in range(2)))

    a, b = cluster.run(both)
    assert a.final.request_id == b.final.request_id == "same-id"
    assert a.token_ids == b.token_ids and len(a.token_ids) == 6
    print(f"\nlive router statuses over the generated set: {dict(LIVE)}")
    assert cluster.complete("Hi", max_tokens=3, temperature=0).final.usage.completion_tokens == 3
    cluster.assert_pools_free()
