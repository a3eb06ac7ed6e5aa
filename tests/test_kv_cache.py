"""Block pool accounting and attention metadata."""

from __future__ import annotations

import threading

import pytest
import torch

from pdserve.kernels.paged_attention import build_attention_metadata
from pdserve.model.hugepages import HUGE_PAGE, huge_page_bytes, huge_page_eligible, huge_pages_available
from pdserve.model.kv_cache import BlockPool, KVCacheSpec, NoFreeBlocks


def test_allocate_and_free_account_exactly():
    pool = BlockPool(10)
    a = pool.allocate(4)
    b = pool.allocate(6)
    assert sorted(a + b) == list(range(10)) and pool.num_free == 0
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)
    pool.free(a)
    assert pool.num_free == 4 and pool.num_allocated == 6
    pool.free(b)
    assert pool.num_free == 10 and pool.num_allocated == 0


def test_failed_allocation_takes_nothing():
    pool = BlockPool(5)
    pool.allocate(3)
    with pytest.raises(NoFreeBlocks, match="need 3 KV blocks, 2 of 5 free"):
        pool.allocate(3)
    assert pool.num_free == 2


@pytest.mark.parametrize("bad", [[0, 0], [7], [99], [-1]])
def test_double_or_foreign_free_raises_and_frees_nothing(bad):
    pool = BlockPool(8)
    pool.allocate(2)  # ids 0 and 1
    with pytest.raises(ValueError):
        pool.free(bad if bad != [0, 0] else [0, 0])
    assert pool.num_allocated == 2


def test_concurrent_allocations_never_hand_out_a_block_twice():
    pool, taken, lock = BlockPool(1000), [], threading.Lock()

    def grab():
        for _ in range(50):
            ids = pool.allocate(2)
            with lock:
                taken.extend(ids)
    threads = [threading.Thread(target=grab) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(taken) == len(set(taken)) == 1000 and pool.num_free == 0


def test_spec_sizes():
    spec = KVCacheSpec(num_blocks=3, num_layers=2, block_size=5, num_kv_heads=1, head_dim=24, dtype=torch.bfloat16)
    assert spec.shape == (3, 2, 2, 5, 1, 24)
    assert spec.page_nbytes(1) == 2 * 5 * 24 * 2 and spec.block_nbytes == 2 * spec.page_nbytes(1)
    assert [spec.num_blocks_for(n) for n in (1, 5, 6, 10, 11)] == [1, 1, 2, 2, 3]
    cache = spec.allocate()
    assert cache[1, 0:2].is_contiguous()  # one block's pages for a layer range are one run of bytes
    with pytest.raises(ValueError):
        KVCacheSpec(0, 1, 1, 1, 1)


def test_a_fresh_prefill_builds_no_gather_indices_or_mask():
    """One prompt with no earlier context attends causally to its own K/V (SDPA's is_causal, or the
    CPU prefill kernel over the block table): the [max_q, max_ctx] mask and gather indices are not
    built (at 2,048 tokens the mask alone took 6 ms of host time per step on a GPU host)."""
    meta = build_attention_metadata([7], [7], [[3, 1]], block_size=4)
    assert meta.fresh_prefill and meta.attn_mask.numel() == meta.ctx_block.numel() == meta.ctx_offset.numel() == 0
    assert meta.slot_mapping.tolist() == [12, 13, 14, 15, 4, 5, 6]
    chunk = build_attention_metadata([3], [7], [[3, 1]], block_size=4)      # a later chunk gathers
    assert not chunk.fresh_prefill and chunk.ctx_block[0].tolist() == [3, 3, 3, 3, 1, 1, 1]


def test_slot_mapping_and_mask():
    meta = build_attention_metadata([3, 1], [3, 6], [[4], [2, 9]], block_size=4)
    assert meta.positions.tolist() == [0, 1, 2, 5]
    assert meta.slot_mapping.tolist() == [16, 17, 18, 9 * 4 + 1]
    assert meta.ctx_block[1].tolist() == [2, 2, 2, 2, 9, 9]
    # sequence 0: causal over its 3 tokens; sequence 1: its one query sees all 6 positions
    assert meta.attn_mask[0, 0, :, :3].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert meta.attn_mask[1, 0, 0].tolist() == [True] * 6
    with pytest.raises(ValueError, match="cannot hold"):
        build_attention_metadata([1], [9], [[0, 1]], block_size=4)


def test_a_cpu_cache_is_zeroed_and_lives_in_huge_pages():
    """The decode worker's KV pages (ModelRunner allocates through the spec) are streamed by attention
    every step, as the weights are: 2 MiB pages where the kernel grants them."""
    spec = KVCacheSpec(num_blocks=64, num_layers=4, block_size=16, num_kv_heads=4, head_dim=64, dtype=torch.bfloat16)
    cache = spec.allocate()
    assert cache.shape == spec.shape and cache.dtype == torch.bfloat16 and cache.is_contiguous()
    assert cache.nbytes == 2 * HUGE_PAGE and not cache.any()
    if not huge_pages_available():
        pytest.skip("no transparent huge pages on this machine")
    assert huge_page_eligible(cache)                  # advised, in a private mapping of its own
    if huge_page_bytes(cache) < HUGE_PAGE:            # the kernel's grant depends on free contiguous memory
        pytest.skip("the kernel granted no huge page at this moment (memory fragmented)")
