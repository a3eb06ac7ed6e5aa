"""Every family through the full disaggregated path, token-exact against ``transformers``.

One cluster per family (module-scoped, so pytest runs each family's tests together): a prefill
worker with an 8-token step budget (prompts longer than that are prefilled in chunks, pages
streamed per chunk) and the prefix cache, and a decode worker over 5-token blocks with n-gram
speculation for batches of up to 8 (larger batches take plain decode steps: the 16-request test
runs both kinds). Plain decode steps of one request through a cluster are covered for every family
by tests/test_families_quant.py (INT4 decode worker) and tests/test_checkpoint.py (Qwen2).
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass

import pytest
import torch

from pdserve.decode_worker.speculative import NgramProposer
from pdserve.deploy import client
from pdserve.proto import pdserve_pb2
from tests.clusters import Cluster
from tests.conftest import hf_greedy
from tests.family_checkpoints import FAMILIES, hf_model, random_prompt, write_checkpoint


@dataclass
class FamilyCluster:
    family: str
    model_dir: str
    hf: object
    cluster: Cluster


def _ngram_flags() -> dict:
    """N-gram speculation for batches of up to 8, drafting whenever the proposer finds a match (a
    worker that decides per request whether drafting pays would rarely draft for these random models)."""
    from pdserve.decode_worker.config import DecodeWorkerConfig

    flags = {"speculative": "ngram", "spec_k": 3, "spec_max_batch_size": 8}
    if "spec_adaptive" in {f.name for f in dataclasses.fields(DecodeWorkerConfig)}:
        flags["spec_adaptive"] = "false"
    return flags


@pytest.fixture(scope="module", params=FAMILIES)
def fc(request, redis_url, tmp_path_factory):
    family = request.param
    path = write_checkpoint(family, tmp_path_factory.mktemp(f"cluster-{family}"), seed=21)
    c = Cluster(path, redis_url, block_size=5, prefill_flags={"max_num_batched_tokens": 8},
                decode_flags=_ngram_flags())
    try:
        yield FamilyCluster(family, path, hf_model(path), c)
    finally:
        c.stop()


@pytest.fixture
def family(fc):
    """The family's cluster, with a leak check after the test."""
    yield fc
    fc.cluster.assert_pools_free()


def test_greedy_matches_transformers_through_chunked_prefill(family):
    """Prompt lengths around the 5-token block and the 8-token chunk (1 .. 37: up to 5 chunks)."""
    for n in (1, 4, 5, 8, 9, 11, 37):
        ids = random_prompt(n, seed=n)
        expected = hf_greedy(family.hf, ids, 24)
        done = family.cluster.complete(ids, max_tokens=24, temperature=0.0)
        assert done.token_ids == expected, f"{family.family}: prompt of {n} tokens"
        assert done.final.usage.prompt_tokens == n
        reason = pdserve_pb2.FINISH_REASON_STOP if expected[-1] == 2 else pdserve_pb2.FINISH_REASON_LENGTH
        assert done.final.finish_reason == reason


def test_prefix_cache_serves_the_second_request(family):
    shared = random_prompt(23, seed=100)                   # 4 full blocks of 5, then 3 tokens
    first, second = shared + [50, 60, 70], shared + [400, 500]
    a = family.cluster.complete(first, max_tokens=12, temperature=0)
    b = family.cluster.complete(second, max_tokens=12, temperature=0)
    assert a.token_ids == hf_greedy(family.hf, first, 12)
    assert b.token_ids == hf_greedy(family.hf, second, 12)
    assert b.final.usage.cached_prompt_tokens == 20


def _ngram_hits(prompt: list[int], output: list[int]) -> int:
    """Decode positions at which the n-gram proposer's first proposal is the greedy token (until the
    first hit, a speculating worker steps one token at a time, so it reaches that position; nothing
    is proposed for the last token)."""
    ngram = NgramProposer()
    return sum(ngram._lookup(prompt + output[:i], 1) == [output[i]] for i in range(1, len(output) - 1))


def test_ngram_speculation_is_token_exact(family):
    """Prompts whose greedy continuation repeats earlier n-grams (found among repetitive and random
    candidates with transformers), at once: transformers' output, with n-gram proposals accepted."""
    candidates = [[11, 12, 13, 14] * 4, [300, 301, 302] * 5, [7, 8] * 6]
    candidates += [random_prompt(6, seed=s) * r for s in range(12) for r in (1, 3)]
    chosen = []
    for prompt in candidates:
        out = hf_greedy(family.hf, prompt, 48)
        if len(out) == 48 and _ngram_hits(prompt, out):
            chosen.append((prompt, out))
        if len(chosen) == 3:
            break
    assert chosen, "no candidate prompt gives the n-gram proposer a hit"

    async def all_at_once(channel):
        return await asyncio.gather(*[client.complete(channel, client.make_request(p, max_tokens=48, temperature=0))
                                      for p, _ in chosen])

    results = family.cluster.run(all_at_once)
    assert [r.token_ids for r in results] == [out for _, out in chosen]
    spec = [r.final.speculative for r in results]
    assert sum(s.num_draft_tokens for s in spec) > 0 and sum(s.num_accepted_tokens for s in spec) > 0, spec


def test_concurrent_requests_match_their_single_runs(family):
    """16 requests of mixed prompt and output lengths at once (plain decode steps while more than 8
    run, speculative ones below; chunked prefills sharing steps) each equal their own single run."""
    gen = torch.Generator().manual_seed(5)
    cases = [(random_prompt(int(torch.randint(1, 40, (1,), generator=gen)), seed=200 + i),
              int(torch.randint(1, 30, (1,), generator=gen))) for i in range(16)]
    singles = [family.cluster.complete(ids, max_tokens=m, temperature=0.0, ignore_eos=True).token_ids
               for ids, m in cases]

    async def all_at_once(channel):
        return await asyncio.gather(*[
            client.complete(channel, client.make_request(ids, max_tokens=m, temperature=0.0, ignore_eos=True))
            for ids, m in cases])

    together = family.cluster.run(all_at_once)
    for (ids, m), single, batched in zip(cases, singles, together):
        assert len(batched.token_ids) == m
        assert batched.token_ids == single, f"{family.family}: prompt of {len(ids)} tokens diverged"
        want = hf_greedy(family.hf, ids, m)                 # stops at EOS, which the requests ignore
        assert single[:len(want)] == want
