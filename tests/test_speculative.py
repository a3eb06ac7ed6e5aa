"""Speculative decoding: exact target distribution, identical greedy output, acceptance reported."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pdserve.decode_worker.speculative import NgramProposer, Proposal, verify
from pdserve.deploy import client
from pdserve.model.sampling import SamplingParams, draw, request_generator
from tests.clusters import Cluster
from tests.conftest import hf_greedy

P = torch.tensor([0.45, 0.25, 0.15, 0.10, 0.05])
Q = torch.tensor([0.05, 0.10, 0.15, 0.30, 0.40])  # a draft that prefers what the target does not


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("draft_kind", ["sampled", "deterministic"])
def test_first_emitted_token_follows_the_target_distribution(draft_kind):
    """Chi-square goodness of fit (4 dof, p = 0.001 critical value 18.47) over 6,000 trials."""
    logits = P.log()[None].repeat(2, 1)  # target at the draft position and at the bonus position
    counts = torch.zeros(5)
    for seed in range(6000):
        params = SamplingParams(temperature=1.0, seed=seed)
        if draft_kind == "sampled":
            d = draw(Q, request_generator(seed, 0, 99))
            prop = Proposal([d], [Q])
        else:
            prop = Proposal([3])  # n-gram style: always proposes token 3
        counts[verify(logits, prop, params, 0)[0]] += 1
    assert _chi_square(counts, P) < 18.47


def test_greedy_verification_accepts_exactly_the_argmax_run():
    logits = torch.full((4, 6), -1.0)
    for row, best in enumerate([2, 4, 1, 5]):
        logits[row, best] = 1.0
    greedy = SamplingParams(temperature=0)
    assert verify(logits, Proposal([2, 4, 1]), greedy, 0) == [2, 4, 1, 5]  # all accepted + bonus
    assert verify(logits, Proposal([2, 3, 1]), greedy, 0) == [2, 4]        # rejected at the second: corrected
    assert verify(logits[:1], Proposal([]), greedy, 0) == [2]              # no proposal: a plain decode step


def test_ngram_lookup_proposes_what_followed_the_latest_match():
    ngram = NgramProposer(max_n=3)
    assert ngram._lookup([1, 2, 3, 9, 9, 1, 2, 3], 3) == [9, 9, 1]
    assert ngram._lookup([5, 6, 7, 5, 6, 8, 5, 6], 2) == [8, 5]  # most recent occurrence wins
    assert ngram._lookup([1, 2, 3, 4], 3) == []


PROMPTS = ["Once upon a time, there was a little dog", "Tom and Tom and Tom went to the park. Tom and",
           "The cat sat on the mat. The cat sat on the"]


@pytest.fixture(scope="module")
def draft_model_dir(tmp_path_factory):
    from pdserve.deploy.make_model import make_model
    return str(make_model("bench-9m", tmp_path_factory.mktemp("draft"), seed=5, dtype="float32"))


@pytest.mark.parametrize("mode", ["ngram", "self", "draft"])
def test_greedy_output_with_speculation_is_identical(mode, redis_url, model_dir, hf_model, draft_model_dir):
    from pdserve.model.config import ModelConfig
    from pdserve.model.tokenizer import Tokenizer

    tok = Tokenizer(model_dir, ModelConfig.from_hf_dir(model_dir).bos_token_id)
    flags = {"speculative": mode, "spec_k": 3, "spec_draft_layers": 1, "spec_max_batch_size": 8}
    if mode == "draft":
        flags["spec_draft_model"] = draft_model_dir
    c = Cluster(model_dir, redis_url, block_size=4, decode_flags=flags)
    try:
        prompts = [tok.encode(p) for p in PROMPTS]
        expected = [hf_greedy(hf_model, p, 40) for p in prompts]

        async def all_at_once(channel):
            return await asyncio.gather(*[
                client.complete(channel, client.make_request(p, max_tokens=40, temperature=0)) for p in prompts])

        results = c.run(all_at_once)
        for want, got in zip(expected, results):
            assert got.token_ids == want
        spec = [r.final.speculative for r in results]
        assert sum(s.num_draft_tokens for s in spec) > 0
        assert all(0 <= s.acceptance_rate <= 1 for s in spec)
        if mode == "ngram":  # repetitive prompts: lookup must hit sometimes
            assert sum(s.num_accepted_tokens for s in spec) > 0
        sampled = [c.complete(prompts[1], max_tokens=30, temperature=0.8, seed=11).token_ids for _ in range(2)]
        assert sampled[0] == sampled[1] and len(sampled[0]) >= 1  # seeded sampling stays reproducible
        c.assert_pools_free()
    finally:
        c.stop()
