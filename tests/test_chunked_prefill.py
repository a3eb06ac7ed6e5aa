"""Chunked prefill with KV pages streamed per chunk: token-exact with unchunked prefill."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pdserve.deploy import client
from pdserve.model.config import ModelConfig
from pdserve.model.tokenizer import Tokenizer
from tests.clusters import Cluster
from tests.conftest import hf_greedy


@pytest.fixture(scope="module")
def chunked_cluster(redis_url, model_dir):
    """A 7-token budget per step and 4-token blocks: chunks end mid-block and several prompts share steps."""
    c = Cluster(model_dir, redis_url, block_size=4, prefill_flags={"max_num_batched_tokens": 7})
    yield c
    c.stop()


def test_chunked_greedy_matches_transformers_under_concurrency(chunked_cluster, hf_model, model_dir):
    tok = Tokenizer(model_dir, ModelConfig.from_hf_dir(model_dir).bos_token_id)
    gen = torch.Generator().manual_seed(3)
    prompts = [tok.encode("Once upon a time, there was a little dog")]
    prompts += [[1] + torch.randint(3, 2048, (n,), generator=gen).tolist() for n in (2, 6, 7, 8, 29, 60)]
    expected = [hf_greedy(hf_model, p, 20) for p in prompts]

    async def all_at_once(channel):
        return await asyncio.gather(*[client.complete(channel, client.make_request(p, max_tokens=20, temperature=0))
                                      for p in prompts])

    for prompt, want, got in zip(prompts, expected, chunked_cluster.run(all_at_once)):
        assert got.token_ids == want, f"prompt of {len(prompt)} tokens"
    chunked_cluster.assert_pools_free()


def test_chunked_prefill_reports_transfer_timings(chunked_cluster):
    """The prefill RPC's timings are consistent: the unhidden tail never exceeds the transfer itself."""
    import grpc

    from pdserve.model.sampling import SamplingParams
    from pdserve.proto import worker_pb2, worker_pb2_grpc
    from pdserve.proto.convert import sampling_to_wire

    state = chunked_cluster.state()
    prefill = next(w for w in state.workers if w.role == "prefill")
    decode = next(w for w in state.workers if w.role == "decode")
    prompt = list(range(3, 103))

    async def go():
        async with grpc.aio.insecure_channel(decode.address) as dch, grpc.aio.insecure_channel(prefill.address) as pch:
            sampling = sampling_to_wire(SamplingParams(temperature=0, max_tokens=2))
            stream = worker_pb2_grpc.DecodeWorkerStub(dch).Generate(worker_pb2.DecodeRequest(
                request_id="timing-test", prompt_token_ids=prompt, sampling=sampling, kv_timeout_s=20))
            allocated = (await stream.read()).allocated
            answer = await worker_pb2_grpc.PrefillWorkerStub(pch).Prefill(worker_pb2.PrefillRequest(
                request_id="timing-test", token_ids=prompt, sampling=sampling,
                dst_kv_address=allocated.kv_address, dst_block_ids=allocated.block_ids), timeout=30)
            events = [ev async for ev in _rest(stream)]
            return answer, events

    answer, events = asyncio.run(go())
    assert 0 < answer.transfer_tail_s <= answer.transfer_s
    # 25 blocks x 2 layers x (K, V) x 4 tokens x 4 KV heads x head_dim 16 x 4 bytes
    assert answer.num_kv_bytes == 25 * 2 * 2 * 4 * 4 * 16 * 4
    assert events[-1].WhichOneof("event") == "finished"
    chunked_cluster.assert_pools_free()


async def _rest(stream):
    import grpc
    while (ev := await stream.read()) is not grpc.aio.EOF:
        yield ev
