"""A client that stops reading for longer than the router's ``stream_idle_timeout_s`` (T) while its answer
streams: the router's sends block on the client's full flow-control window, so it does not read the
decode worker's stream meanwhile. That pause is the client's, not the worker's: the stream completes on
its first decode worker, with no migration and no error. (The stall rule once counted the pause: the
relay resumed past T and failed a healthy worker at once, migrating the request, or failing it with
``max_attempts`` 1.)
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.deploy import client
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from tests.clusters import Cluster

pytestmark = pytest.mark.timeout(120)

IDLE_S = 1.0          # the router's stream_idle_timeout_s
PAUSE_S = 3 * IDLE_S  # the client's pause after its first message
MAX_TOKENS = 480      # with 20 log-probabilities a token, far more than the client's window holds


@pytest.fixture
def cluster(model_dir, redis_url):
    c = Cluster(model_dir, redis_url, router_flags={"stream_idle_timeout_s": IDLE_S, "max_attempts": 1})
    yield c
    c.stop()


def test_a_client_that_pauses_reading_does_not_make_its_worker_stalled(cluster):
    request = client.make_request("Once upon a time", max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    request.sampling.logprobs = 20

    async def go():
        # no BDP probing: the window stays at its initial 64 KiB, so the router's sends block while we pause
        async with grpc.aio.insecure_channel(cluster.address, options=[("grpc.http2.bdp_probe", 0)]) as ch:
            call = pdserve_pb2_grpc.RouterStub(ch).Generate(request, timeout=60)
            messages = [await call.read()]
            await asyncio.sleep(PAUSE_S)
            while (msg := await call.read()) is not grpc.aio.EOF:
                messages.append(msg)
            return messages

    messages = asyncio.run(go())
    final = messages[-1].final
    assert sum(len(m.token_ids) for m in messages) == MAX_TOKENS
    assert final.finish_reason == pdserve_pb2.FINISH_REASON_LENGTH and final.num_migrations == 0, final
    cluster.assert_pools_free()
