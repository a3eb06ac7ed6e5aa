"""The router's prefix index in process: leading-block counts, events, snapshots, approximate mode."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.cluster.kv_events import CLEARED, REMOVED, STORED, KVEvent
from pdserve.model.block_hash import block_hashes, root_hash
from pdserve.model.kv_cache import BlockPool
from pdserve.prefill_worker.prefix_cache import PrefixCache
from pdserve.router.prefix_index import PrefixIndex

BS = 4


def toks(*labels: int) -> list[int]:
    """A prompt whose block i is ``labels[i]`` repeated (prompts sharing leading labels share blocks)."""
    return [t for lab in labels for t in [lab] * BS]


def store(idx: PrefixIndex, w: str, prompt: list[int], start: int = 0, stop: int | None = None) -> bool:
    """``w`` caches blocks ``start:stop`` of ``prompt`` (it must hold the blocks before ``start``)."""
    hs = idx.hash_prompt(prompt)
    return idx.apply(w, KVEvent(STORED, hs[start:stop], hs[start - 1] if start else idx.root, BS))


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


A = toks(1, 2, 3, 4, 5, 6, 7, 8)
B = toks(1, 2, 3, 4, 5, 9, 9)  # shares A's first 5 blocks
C = toks(1, 2, 7)  # shares 2


def lookups(idx: PrefixIndex, prompt: list[int]) -> dict[str, int]:
    """Every lookup path agrees; returns the counts."""
    hs = idx.hash_prompt(prompt)
    got = idx.lookup_hashes(hs)
    assert idx.lookup(prompt) == got == idx.lookup_linear(hs)
    return got


def test_leading_blocks_per_worker():
    idx = PrefixIndex(BS)
    assert store(idx, "w0", A) and store(idx, "w1", A, 0, 3) and store(idx, "w2", B) and store(idx, "w3", C)
    assert lookups(idx, A) == {"w0": 8, "w1": 3, "w2": 5, "w3": 2}
    assert lookups(idx, B) == {"w0": 5, "w1": 3, "w2": 7, "w3": 2}
    assert lookups(idx, C + [0, 1]) == {"w0": 2, "w1": 2, "w2": 2, "w3": 3}  # partial block ignored
    # the count stops at the prompt's first block a worker lacks, even though it holds later ones of A
    assert lookups(idx, toks(1, 2, 3, 4, 0) + A[5 * BS:]) == {"w0": 4, "w1": 3, "w2": 4, "w3": 2}
    assert lookups(idx, toks(0, 1, 2)) == {} and lookups(idx, []) == {} and lookups(idx, [1, 1]) == {}
    assert idx.num_blocks == len(set(idx.hash_prompt(A)) | set(idx.hash_prompt(B)) | set(idx.hash_prompt(C)))
    assert idx.workers() == ["w0", "w1", "w2", "w3"]
    # another model_id salts every hash: nothing matches
    assert PrefixIndex(BS, model_id="other").lookup(A) == {}
    long = toks(*range(1, 40))  # lookup() hashes in growing chunks: 8, 16, then the last 15 blocks
    store(idx, "w4", long)
    assert lookups(idx, long)["w4"] == 39 and lookups(idx, long[: 20 * BS] + [0] * 80)["w4"] == 20


def test_removed_cleared_and_drop_worker_prune():
    idx = PrefixIndex(BS)
    store(idx, "w0", A), store(idx, "w1", B), store(idx, "w2", C)
    ha, hb = idx.hash_prompt(A), idx.hash_prompt(B)
    n = idx.num_blocks
    idx.apply("w0", KVEvent(REMOVED, ha[:4:-1], None, BS))  # evicts its 3 deepest blocks, leaf first
    assert lookups(idx, A) == {"w0": 5, "w1": 5, "w2": 2} and idx.num_blocks == n - 3  # pruned: nobody has them
    idx.apply("w1", KVEvent(REMOVED, hb[::-1], None, BS))
    assert lookups(idx, B) == {"w0": 5, "w2": 2} and idx.num_blocks == n - 5
    idx.apply("w0", KVEvent(REMOVED, [12345], None, BS))  # a hash it does not hold: no-op
    idx.apply("w0", KVEvent(CLEARED, [], None, BS))
    assert lookups(idx, A) == {"w2": 2} and idx.hashes_of("w0") == set()
    assert idx.num_blocks == 3
    idx.drop_worker("w2")
    idx.drop_worker("nobody")
    assert lookups(idx, C) == {} and idx.num_blocks == 0 and idx.workers() == ["w0", "w1"]
    store(idx, "w9", C)  # reuses the dropped worker's bit
    assert lookups(idx, C) == {"w9": 3} and idx.num_entries() == 3


def test_stored_under_an_unknown_parent_is_rejected_when_strict():
    idx = PrefixIndex(BS)
    hs = idx.hash_prompt(A)
    store(idx, "w0", A, 0, 2)
    assert not store(idx, "w0", A, 3)  # block 2 (the parent) was never stored: the index lost it
    assert idx.hashes_of("w0") == set(hs[:2]) and lookups(idx, A) == {"w0": 2}
    assert not idx.apply("w1", KVEvent(STORED, hs[2:], hs[1], BS))  # another worker's blocks do not count
    assert idx.apply("w0", KVEvent(STORED, hs[3:], hs[2], BS), strict=False)  # replay: set semantics
    assert idx.hashes_of("w0") == set(hs) - {hs[2]}
    assert idx.lookup_linear(hs) == {"w0": 2}  # not prefix-closed: see the next test
    assert store(idx, "w0", A, 2, 3) and lookups(idx, A) == {"w0": 8}


def test_not_prefix_closed_counts_are_a_held_position():
    """Hand-built holes (not reachable with protocol events) give a count at which the worker holds
    the block: a lower bound of what a real, prefix-closed, cache holds."""
    idx = PrefixIndex(BS)
    hs = idx.hash_prompt(A)
    store(idx, "w0", A)
    idx.apply("w0", KVEvent(REMOVED, [hs[2]], None, BS))  # an inner block, its children stay
    assert idx.lookup_linear(hs) == {"w0": 2}
    got = idx.lookup_hashes(hs)["w0"]
    assert got in (2, 8) and hs[got - 1] in idx.hashes_of("w0")


def test_load_snapshot_matches_a_real_cache():
    pool = BlockPool(12)
    cache, idx = PrefixCache(pool, BS), PrefixIndex(BS)
    for p in (A, B, C, toks(5, 5, 5)):
        m = cache.match(p)
        table = m.block_ids + cache.allocate(len(p) // BS - len(m.block_ids))
        cache.insert(p, table)
        cache.release(table)
    store(idx, "w0", toks(7, 7))  # stale state, replaced
    idx.load_snapshot("w0", cache.snapshot())
    assert idx.hashes_of("w0") == set(cache.snapshot())
    for p in (A, B, C, toks(5, 5, 5, 5)):
        assert lookups(idx, p).get("w0", 0) == len(cache.peek(p + [0]).block_ids)
    idx.load_snapshot("w0", [])
    assert idx.num_blocks == 0


def test_approximate_entries_expire():
    clock = Clock()
    idx = PrefixIndex(BS, clock=clock)
    ha, hc = idx.hash_prompt(A), idx.hash_prompt(C)
    idx.record_routing("a0", ha, ttl_s=10)
    clock.t += 5
    idx.record_routing("a0", ha[:3], ttl_s=10)  # the first 3 blocks again: they live 5 s longer
    idx.record_routing("a0", ha[:2], ttl_s=1)  # a shorter TTL does not shorten them
    idx.record_routing("a1", hc, ttl_s=30)
    store(idx, "e0", A, 0, 4)
    assert lookups(idx, A) == {"a0": 8, "a1": 2, "e0": 4}
    clock.t += 5  # 10 s after the first record
    assert lookups(idx, A) == {"a0": 3, "a1": 2, "e0": 4}
    assert idx.hashes_of("a0", approximate=True) == set(ha[:3]) and idx.hashes_of("a0") == set()
    clock.t += 5
    assert lookups(idx, A) == {"a1": 2, "e0": 4} and idx.num_blocks == 4 + 1  # C's 3rd block
    # a worker with both: each source keeps its own entries
    idx.record_routing("e0", ha, ttl_s=1)
    idx.apply("e0", KVEvent(REMOVED, ha[:4][::-1], None, BS))
    assert lookups(idx, A) == {"a1": 2, "e0": 8}
    clock.t += 1
    assert lookups(idx, A) == {"a1": 2} and idx.num_blocks == 3
    idx.drop_worker("a1")
    clock.t += 100
    assert lookups(idx, C) == {} and idx.num_blocks == 0 and idx.num_entries() == 0


def test_a_pending_routing_entry_is_no_parent_for_strict_events():
    """An exact worker's in-flight prompt (recorded on routing) counts in lookups, but a stored event
    under a block only pending still reveals the lost event."""
    clock = Clock()
    idx = PrefixIndex(BS, clock=clock)
    ha = idx.hash_prompt(A)
    store(idx, "e0", C)
    idx.record_routing("e0", ha, ttl_s=10)
    assert lookups(idx, A) == {"e0": 8}
    assert not store(idx, "e0", A, 4, 6)                    # parent (block 3) only pending: rejected
    assert store(idx, "e0", A, 0, 6)
    clock.t += 11
    assert lookups(idx, A) == {"e0": 6}


def test_kv_awareness_records_prompts_in_flight_on_exact_workers(redis_url):
    """Requests sharing a prefix that arrive before the first one's stored events follow it."""
    import asyncio
    import uuid

    from pdserve.cluster.kv_events import KVEventPublisher
    from pdserve.cluster.registry import WorkerInfo
    from pdserve.router.kv_aware import KVAwareness

    cluster = "pending-" + uuid.uuid4().hex[:8]
    kv = KVAwareness(redis_url, cluster, pending_ttl_s=30.0)
    workers = [WorkerInfo(worker_id=w, role="prefill", address="127.0.0.1:1", block_size=BS) for w in ("p0", "p1")]
    kv.update_workers(workers)
    for w in ("p0", "p1"):                                  # both publish events: exact workers
        pub = KVEventPublisher(redis_url, cluster, w)
        pub.publish_cleared(BS)
        pub.close()

    async def go():
        await kv.sync_once()
        assert kv.sync.exact_workers() == {"p0", "p1"}
        assert kv.cached_blocks(A, BS) == {}
        kv.on_routed("p1", A, BS)                           # A's prefill is in flight on p1
        assert kv.cached_blocks(B, BS) == {"p1": 5}         # B shares 5 blocks with it
        await kv.close()

    asyncio.run(go())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["w0", "w1", "w2"]), st.booleans(),
                          st.lists(st.integers(0, 2), min_size=1, max_size=6)), max_size=25),
       st.lists(st.lists(st.integers(0, 2), min_size=0, max_size=7), min_size=1, max_size=6))
def test_random_prefix_closed_states_match_a_brute_force_oracle(ops, queries):
    """Random stores and leaf removals; every lookup equals the first-missing-block count per worker."""
    idx = PrefixIndex(BS)
    held: dict[str, set[int]] = {"w0": set(), "w1": set(), "w2": set()}
    parent: dict[int, int] = {}
    for w, add, labels in ops:
        hs = block_hashes(toks(*labels), BS)
        if add:  # cache the chain beyond what w holds already
            k = next((i for i, h in enumerate(hs) if h not in held[w]), len(hs))
            if k < len(hs):
                assert idx.apply(w, KVEvent(STORED, hs[k:], hs[k - 1] if k else root_hash(), BS))
                held[w].update(hs[k:])
            parent.update(zip(hs, [root_hash(), *hs[:-1]]))
        else:  # evict w's leaves on this chain, deepest first, as a cache does
            leaves = [h for h in reversed(hs) if h in held[w] and not any(parent.get(c) == h for c in held[w])]
            gone = []
            for h in leaves:
                if not any(parent.get(c) == h for c in held[w] - set(gone)):
                    gone.append(h)
            idx.apply(w, KVEvent(REMOVED, gone, None, BS))
            held[w] -= set(gone)
    for w in held:
        assert idx.hashes_of(w) == held[w]
    for q in queries:
        hs = block_hashes(toks(*q), BS)
        want = {}
        for w, s in held.items():
            n = next((i for i, h in enumerate(hs) if h not in s), len(hs))
            if n:
                want[w] = n
        assert idx.lookup_hashes(hs) == want == idx.lookup_linear(hs) == idx.lookup(toks(*q) + [5])
