"""The prefix cache through the cluster: shared prefixes are not recomputed, output stays
token-exact, events reach Redis, and cached blocks count as free (evictable)."""

from __future__ import annotations

import torch

from pdserve.cluster.kv_events import read_events
from tests.conftest import hf_greedy


def test_shared_prefix_is_served_from_the_cache(fresh_cluster, hf_model, redis_url):
    gen = torch.Generator().manual_seed(11)
    shared = [1] + torch.randint(3, 2048, (99,), generator=gen).tolist()   # 100 tokens = 6 full blocks of 16
    first = shared + [50, 60, 70]
    second = shared + [400, 500]
    a = fresh_cluster.complete(first, max_tokens=12, temperature=0)
    b = fresh_cluster.complete(second, max_tokens=12, temperature=0)
    assert a.token_ids == hf_greedy(hf_model, first, 12)
    assert b.token_ids == hf_greedy(hf_model, second, 12)
    assert b.final.usage.cached_prompt_tokens == 96                       # 6 blocks x 16 tokens
    again = fresh_cluster.complete(first, max_tokens=12, temperature=0)   # whole prompt cached but the last block
    assert again.token_ids == a.token_ids and again.final.usage.cached_prompt_tokens == 96
    events = read_events(redis_url, fresh_cluster.cluster, "p0")
    stored = [h for e in events if e.type == "stored" for h in e.hashes]
    assert len(stored) >= 6 and [e.seq for e in events] == sorted(e.seq for e in events)
    fresh_cluster.assert_pools_free()  # cached blocks are evictable, so they count as free


def test_a_cache_salt_reuses_only_its_own_prefixes(fresh_cluster, hf_model, redis_url):
    """vLLM's ``cache_salt``: a prompt cached under one salt is reused by that salt alone, never by another
    salt or an unsalted request, whose blocks alone reach the router's index as events; output token-exact."""
    from pdserve.model.block_hash import block_hashes

    gen = torch.Generator().manual_seed(12)
    shared = [1] + torch.randint(3, 2048, (99,), generator=gen).tolist()    # 6 full blocks of 16
    asks = [("tenant-a", [50]), ("tenant-a", [60]), ("tenant-b", [70]), ("", [80]), ("", [90])]
    seen = {e.seq for e in read_events(redis_url, fresh_cluster.cluster, "p0")}   # the session cluster's so far
    cached = []
    for salt, tail in asks:
        got = fresh_cluster.complete(shared + tail, max_tokens=6, temperature=0, cache_salt=salt)
        assert got.token_ids == hf_greedy(hf_model, shared + tail, 6), (salt, tail)
        cached.append(got.final.usage.cached_prompt_tokens)
    assert cached == [0, 96, 0, 0, 96]
    events = [e for e in read_events(redis_url, fresh_cluster.cluster, "p0") if e.seq not in seen]
    stored = [h for e in events if e.type == "stored" for h in e.hashes]
    assert stored == block_hashes(shared + [80], 16)                        # the unsalted request's, alone
    fresh_cluster.assert_pools_free()
