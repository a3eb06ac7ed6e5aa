"""Prefix-aware dispatch through the cluster: with two prefill workers, a prompt that
shares a cached prefix goes to the worker that holds it (exact index from KV events)."""

from __future__ import annotations

import time

import torch

from tests.clusters import Cluster


def test_shared_prefixes_follow_their_cache(redis_url, model_dir):
    c = Cluster(model_dir, redis_url, num_prefill=2)
    try:
        gen = torch.Generator().manual_seed(21)
        prefixes = [[1] + torch.randint(3, 2048, (95,), generator=gen).tolist() for _ in range(6)]  # 6 blocks
        for p in prefixes:
            assert c.complete(p + [7, 8], max_tokens=2, temperature=0).final.usage.cached_prompt_tokens == 0
        time.sleep(1.0)  # events reach Redis, the router's index syncs (every 0.25 s)
        hits = [c.complete(p + [9, 10, 11], max_tokens=2, temperature=0).final.usage.cached_prompt_tokens
                for p in prefixes]
        # each follow-up lands where its prefix is cached (a cache-blind router would miss about half)
        assert hits == [96] * 6  # all 6 blocks of the 96-token prefix
        c.assert_pools_free()
    finally:
        c.stop()
