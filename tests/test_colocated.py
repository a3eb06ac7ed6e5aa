"""The colocated baseline (role `both`): one process prefills (in chunks, mixed with
decodes) and decodes; output stays token-exact; cancels free blocks."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pdserve.deploy import client
from pdserve.proto import pdserve_pb2_grpc
from tests.clusters import colocated_cluster
from tests.conftest import hf_greedy


@pytest.fixture(scope="module")
def colocated(redis_url, model_dir):
    c = colocated_cluster(model_dir, redis_url, max_num_batched_tokens=9)
    yield c
    c.stop()


def test_colocated_output_is_token_exact_and_blocks_come_back(colocated, hf_model):
    gen = torch.Generator().manual_seed(5)
    prompts = [[1] + torch.randint(3, 2048, (n,), generator=gen).tolist() for n in (3, 20, 45, 8)]

    async def all_at_once(channel):
        return await asyncio.gather(*[client.complete(channel, client.make_request(p, max_tokens=15, temperature=0))
                                      for p in prompts])

    for p, got in zip(prompts, colocated.run(all_at_once)):
        assert got.token_ids == hf_greedy(hf_model, p, 15)
    assert [w.role for w in colocated.state().workers] == ["both"]
    colocated.assert_pools_free()


def test_colocated_cancel_frees_blocks(colocated):
    """A client that cancels mid-stream (after its first tokens, long before max_tokens) frees every block."""
    request = client.make_request("Once upon a time", max_tokens=400, temperature=0, ignore_eos=True)

    async def cancel_after_first_tokens(channel):
        call = pdserve_pb2_grpc.RouterStub(channel).Generate(request)
        async for msg in call:
            if msg.token_ids:
                break
        finished = msg.HasField("final")
        call.cancel()
        return finished

    assert colocated.run(cancel_after_first_tokens) is False       # cancelled while the request still ran
    colocated.assert_pools_free()
