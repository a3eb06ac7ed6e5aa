"""Every bad input gets a gRPC status naming the problem, and the cluster keeps serving."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest

from pdserve.deploy import client
from pdserve.proto import pdserve_pb2

VOCAB, CONTEXT = 2048, 512


def _status(cluster, request) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        cluster.run(lambda ch: client.complete(ch, request, timeout_s=30))
    return info.value


def _raw_status(cluster, raw: bytes) -> grpc.aio.AioRpcError:
    async def call(channel):
        rpc = channel.unary_stream("/pdserve.v1.Router/Generate",
                                   response_deserializer=pdserve_pb2.GenerateResponse.FromString)
        return [m async for m in rpc(raw, timeout=30)]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        cluster.run(call)
    return info.value


BAD_REQUESTS = {
    "empty text": (pdserve_pb2.GenerateRequest(text=""), "empty prompt"),
    "no prompt": (pdserve_pb2.GenerateRequest(), "empty prompt"),
    "empty token ids": (client.make_request([]), "empty prompt"),
    "token id = vocab": (client.make_request([1, VOCAB]), "outside the vocabulary"),
    "negative token id": (client.make_request([1, -5]), "outside the vocabulary"),
    "huge token id": (client.make_request([1, 2**40]), "outside the vocabulary"),
    "beyond context": (client.make_request([1] * 500, max_tokens=13), "exceeds the model's context"),
    "max_tokens 0": (client.make_request("Hi", max_tokens=0), "max_tokens"),
    "negative max_tokens": (client.make_request("Hi", max_tokens=-3), "max_tokens"),
    "negative temperature": (client.make_request("Hi", temperature=-0.5), "temperature"),
    "NaN temperature": (client.make_request("Hi", temperature=math.nan), "NaN"),
    "top_p 0": (client.make_request("Hi", top_p=0.0), "top_p"),
    "top_p above 1": (client.make_request("Hi", top_p=1.5), "top_p"),
    "NaN top_p": (client.make_request("Hi", top_p=math.nan), "NaN"),
    "negative top_k": (client.make_request("Hi", top_k=-1), "top_k"),
    "stop token outside vocab": (client.make_request("Hi", stop_token_ids=(VOCAB + 1,)), "stop_token_ids"),
    "negative TTFT SLO": (pdserve_pb2.GenerateRequest(text="Hi", ttft_slo_s=-1.0), "ttft_slo_s"),
    "NaN TPOT SLO": (pdserve_pb2.GenerateRequest(text="Hi", tpot_slo_s=math.nan), "tpot_slo_s"),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_request_is_invalid_argument(fresh_cluster, name):
    request, words = BAD_REQUESTS[name]
    err = _status(fresh_cluster, request)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert words in err.details()
    assert fresh_cluster.complete("Hi", max_tokens=3, temperature=0).final is not None  # still serving


@pytest.mark.parametrize("raw, words", [
    (b"\x08\x05", "#1"),                       # field 1 (text, a string) sent as a varint
    (b"\x0a\x02Hi\xf8\x06\x01", "#111"),       # a valid prompt plus an unknown field 111
    (b"\x0a\x02Hi\x1a\x09\x29" + bytes(8), "sampling.#5"),  # max_tokens (int32 varint) sent as fixed64
    (b"\x0a\xff\xff\xff\xff\x0f", "malformed"),  # a string longer than the message
])
def test_malformed_wire_bytes_are_invalid_argument(fresh_cluster, raw, words):
    err = _raw_status(fresh_cluster, raw)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert words in err.details()


def test_client_cancel_mid_stream_frees_blocks(fresh_cluster):
    async def cancel_after_three(channel):
        call = client.pdserve_pb2_grpc.RouterStub(channel).Generate(
            client.make_request("Once upon a time", max_tokens=400, temperature=0, ignore_eos=True))
        got = 0
        async for msg in call:
            got += len(msg.token_ids)
            if got >= 3:
                call.cancel()
                break
        return got

    for _ in range(3):
        assert fresh_cluster.run(cancel_after_three) >= 3
    fresh_cluster.assert_pools_free()
    assert fresh_cluster.complete("Hi", max_tokens=4, temperature=0).final.usage.completion_tokens == 4


def test_client_deadline_mid_stream_frees_blocks(fresh_cluster):
    request = client.make_request("Once upon a time", max_tokens=490, temperature=0, ignore_eos=True)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        fresh_cluster.run(lambda ch: client.complete(ch, request, timeout_s=0.3))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    fresh_cluster.assert_pools_free()


def test_many_cancels_in_flight_leave_pools_free(fresh_cluster):
    async def burst(channel):
        tasks = [asyncio.create_task(client.complete(channel, client.make_request(
            "The dog", max_tokens=300, temperature=0, ignore_eos=True))) for _ in range(8)]
        await asyncio.sleep(0.15)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    fresh_cluster.run(burst)
    fresh_cluster.assert_pools_free()
