"""The prefix-cache oracle (bench/prefix_oracle.py) is an upper bound: exact hit counts on
hand-made prompts, and no router over real prefill-worker caches (any policy, any capacity)
ever beats it; with one unbounded worker it is reached exactly."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from pdserve.bench.prefix_oracle import BlockTrie, oracle_check, oracle_hits, send_order
from pdserve.model.kv_cache import BlockPool
from pdserve.prefill_worker.prefix_cache import PrefixCache

ROOT = Path(__file__).resolve().parent.parent


def test_exact_hits_on_hand_made_prompts():
    a = list(range(1, 11))  # 10 tokens: leaves 2 full blocks of 4
    prompts = [
        a,                      # nothing cached yet
        a[:8] + [99],           # 9 tokens: may reuse (9 - 1) // 4 = 2 blocks
        a[:8],                  # 8 tokens: its last token is computed, so 1 block
        a[:7] + [0, 0, 0],      # differs inside block 2
        a[4:8] + a[:4] + [5],   # block 2's tokens first: a block is keyed by its whole prefix
        [1],                    # a 1-token prompt reuses nothing
        a[:8] + [99, 98, 97, 96, 95],  # block 3 = [99, 98, 97, 96] was never a full block before
        a[:8] + [99, 98, 97, 96, 94],  # ... but now it is
    ]
    assert oracle_hits(prompts, 4) == [0, 8, 4, 4, 0, 0, 8, 12]
    assert oracle_hits(list(reversed(prompts)), 4) == [0, 12, 0, 0, 4, 4, 8, 8]  # order matters
    assert oracle_hits(prompts, 1) == [0, 8, 7, 7, 0, 0, 9, 12]


def test_sharing_that_ends_inside_a_trace_hash_block_counts():
    """A trace prompt cut inside a shared 8-token hash block still shares the cut block's first
    tokens: the oracle counts them in the workers' 4-token blocks, as the workers do (an oracle
    in whole hash blocks counted 8 here, fewer than a real worker finds)."""
    h1, h2 = list(range(100, 108)), list(range(200, 208))
    first = [1] + h1 + h2            # 17 tokens
    second = [1] + h1 + h2[:5] + [7, 7]  # 16 tokens, cut inside h2
    assert oracle_hits([first, second], 4) == [0, 12]


def test_trie_counts_blocks_once():
    trie = BlockTrie(2)
    trie.insert([1, 2, 3, 4, 5])
    trie.insert([1, 2, 3, 4])
    trie.insert([1, 2, 9, 9])
    assert trie.num_blocks == 3
    assert trie.match_blocks([1, 2, 3, 4, 0]) == 2 and trie.match_blocks([1, 2, 3, 4]) == 1
    with pytest.raises(ValueError):
        BlockTrie(0)


def test_send_order_sorts_by_arrival_plus_delay_then_index():
    recs = [{"index": 0, "arrival_s": 0.0, "send_delay_s": 0.5}, {"index": 1, "arrival_s": 0.1, "send_delay_s": 0.0},
            {"index": 2, "arrival_s": 0.1, "send_delay_s": None}, {"index": 3, "arrival_s": 0.05}]
    assert send_order(recs) == [3, 1, 2, 0]


def workload(rng: random.Random, n: int) -> list[list[int]]:
    """Prompts of 1..60 tokens sharing prefixes: a few system prompts, earlier prompts
    extended or cut (at any token, not only at block edges), and fresh text."""
    systems = [[rng.randrange(50) for _ in range(rng.randint(3, 30))] for _ in range(3)]
    out: list[list[int]] = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.4 and out:
            base = rng.choice(out)
            p = base[:rng.randint(1, len(base))] + [rng.randrange(50) for _ in range(rng.randint(0, 20))]
        elif kind < 0.8:
            p = list(rng.choice(systems)) + [rng.randrange(50) for _ in range(rng.randint(0, 25))]
        else:
            p = [rng.randrange(50) for _ in range(rng.randint(1, 40))]
        out.append(p[:60])
    return out


POLICIES = {
    "round_robin": lambda i, caches, p, rng: i % len(caches),
    "random": lambda i, caches, p, rng: rng.randrange(len(caches)),
    "longest_prefix": lambda i, caches, p, rng: max(range(len(caches)),
                                                   key=lambda w: (caches[w].peek(p).num_cached_tokens, -w)),
    "one_worker": lambda i, caches, p, rng: 0,
}


def simulate(prompts: list[list[int]], block_size: int, workers: int, num_blocks: int, policy, seed: int) -> list[int]:
    """Cached tokens per prompt when a router sends each prompt, in order, to one of ``workers``
    real :class:`PrefixCache` s of ``num_blocks`` blocks, cycling blocks as the prefill engine does
    (match, allocate the rest, insert the prompt's full blocks, release)."""
    caches = [PrefixCache(BlockPool(num_blocks), block_size) for _ in range(workers)]
    rng, hits = random.Random(seed), []
    for i, p in enumerate(prompts):
        cache = caches[policy(i, caches, p, rng)]
        match = cache.match(p)
        table = match.block_ids + cache.allocate(-(-len(p) // block_size) - len(match.block_ids))
        cache.insert(p, table)
        cache.release(table)
        hits.append(match.num_cached_tokens)
    return hits


# (block size, workers, blocks per worker): small pools evict, large ones never do
SHAPES = [(4, 2, 16), (4, 3, 1000), (1, 2, 64), (16, 2, 8), (4, 1, 20), (8, 4, 1000)]


@pytest.mark.parametrize("seed, block_size, workers, num_blocks",
                         [(seed, *shape) for seed, shape in zip(range(12), itertools.cycle(SHAPES))])
def test_no_policy_beats_the_oracle(seed, block_size, workers, num_blocks):
    prompts = workload(random.Random(seed), 120)
    oracle = oracle_hits(prompts, block_size)
    for name, policy in POLICIES.items():
        hits = simulate(prompts, block_size, workers, num_blocks, policy, seed)
        assert all(h <= o for h, o in zip(hits, oracle)), name
        assert sum(hits) <= sum(oracle), name
    assert sum(oracle) > 0  # the workload shares prefixes: the bound is not vacuous


def test_one_unbounded_worker_reaches_the_oracle_exactly():
    for seed, bs in ((0, 4), (1, 1), (2, 16)):
        prompts = workload(random.Random(seed), 150)
        assert simulate(prompts, bs, 1, 10_000, POLICIES["one_worker"], seed) == oracle_hits(prompts, bs)


SAVED = ROOT / "docs" / "results" / "prefix_routing" / "prefix-aware" / "results.json"


@pytest.mark.skipif(not SAVED.exists() or not Path("/work/shared/traces/mooncake_synthetic_trace.jsonl").exists(),
                    reason="needs the saved prefix-routing run and the shared Mooncake trace")
def test_saved_prefix_routing_run_is_within_the_oracle():
    """The prompts of a real run, rebuilt from its results.json (bench-9m uses the embedded
    model's tokenizer): every request's measured hit is at most the oracle's."""
    results = json.loads(SAVED.read_text())
    results["parameters"]["model"] = str(ROOT / "assets" / "models" / "tinystories-656k")
    check = oracle_check(results)
    assert check["block_size"] == 16
    assert check["requests_over_oracle"] == 0 and check["within_oracle"]
    assert check["measured_tokens"] > 0.9 * check["oracle_tokens"]  # the prefix-aware router got close to it
