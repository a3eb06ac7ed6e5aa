"""Token-exact greedy output through the full disaggregated path, against ``transformers``."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pdserve.deploy import client
from pdserve.model.tokenizer import Tokenizer
from pdserve.proto import pdserve_pb2
from tests.clusters import Cluster
from tests.conftest import hf_greedy

PROMPTS = [
    "Once upon a time, there was a little dog",
    "Lily and Ben went to the park.",
    "The cat was sad because",
    "One day, a big bear found a honey pot in the woods. He",
    "Tim",
]


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from pdserve.model.config import ModelConfig
    return Tokenizer(model_dir, ModelConfig.from_hf_dir(model_dir).bos_token_id)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_matches_transformers(fresh_cluster, hf_model, tokenizer, prompt):
    ids = tokenizer.encode(prompt)
    expected = hf_greedy(hf_model, ids, 48)
    done = fresh_cluster.complete(prompt, max_tokens=48, temperature=0.0)
    assert done.token_ids == expected
    assert done.text == tokenizer.decode(expected)  # streamed deltas add up to the full text
    assert done.final.usage.prompt_tokens == len(ids)
    assert done.final.usage.completion_tokens == len(expected)
    reason = pdserve_pb2.FINISH_REASON_STOP if expected[-1] == 2 else pdserve_pb2.FINISH_REASON_LENGTH
    assert done.final.finish_reason == reason


def test_greedy_runs_to_eos_like_transformers(fresh_cluster, hf_model, tokenizer):
    """A long budget: the model stops itself at EOS, and so must the cluster."""
    ids = tokenizer.encode("Once upon a time, there was a little girl named Lily. She")
    expected = hf_greedy(hf_model, ids, 400)
    done = fresh_cluster.complete(ids, max_tokens=400, temperature=0.0)
    assert done.token_ids == expected
    if expected[-1] == 2:
        assert done.final.finish_reason == pdserve_pb2.FINISH_REASON_STOP


def test_awkward_checkpoint_matches_transformers(redis_url, awkward_model_dir):
    """head_dim 24, 1 KV head, hidden 72, vocab 1000, untied head: token-exact too."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(awkward_model_dir, dtype=torch.float32).eval()
    c = Cluster(awkward_model_dir, redis_url, block_size=5)
    try:
        gen = torch.Generator().manual_seed(1)
        for n in (1, 4, 5, 11, 37):  # prompt lengths around the 5-token block boundary
            ids = torch.randint(3, 1000, (n,), generator=gen).tolist()
            expected = hf_greedy(hf, ids, 30)
            done = c.complete(ids, max_tokens=30, temperature=0.0)
            assert done.token_ids == expected, f"prompt length {n}"
        c.assert_pools_free()
    finally:
        c.stop()


def test_concurrent_requests_match_their_single_runs(fresh_cluster, tokenizer):
    """16 requests of mixed prompt and output lengths at once: each equals its own
    single-request greedy output (continuous batching must not change results)."""
    gen = torch.Generator().manual_seed(7)
    cases = []
    for i in range(16):
        prompt = tokenizer.encode(PROMPTS[i % len(PROMPTS)])
        extra = torch.randint(3, 2048, (int(torch.randint(0, 40, (1,), generator=gen)),), generator=gen).tolist()
        cases.append((prompt + extra, int(torch.randint(1, 60, (1,), generator=gen))))
    singles = [fresh_cluster.complete(ids, max_tokens=m, temperature=0.0, ignore_eos=True).token_ids
               for ids, m in cases]

    async def all_at_once(channel):
        return await asyncio.gather(*[
            client.complete(channel, client.make_request(ids, max_tokens=m, temperature=0.0, ignore_eos=True))
            for ids, m in cases])

    together = fresh_cluster.run(all_at_once)
    for (ids, m), single, batched in zip(cases, singles, together):
        assert len(batched.token_ids) == m
        assert batched.token_ids == single, f"prompt of {len(ids)} tokens diverged"
