"""The prefill worker's prefix cache: exact block accounting, matching rules, LRU eviction, events."""

from __future__ import annotations

import random
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.model.block_hash import block_hashes, root_hash, salted_root
from pdserve.model.kv_cache import BlockPool, NoFreeBlocks
from pdserve.prefill_worker.prefix_cache import PrefixCache

BS = 4


def make(num_blocks: int = 10, bs: int = BS):
    events = []
    pool = BlockPool(num_blocks)
    return pool, PrefixCache(pool, bs, on_event=events.append), events


def run(cache: PrefixCache, prompt: list[int], bs: int = BS, salt: str = "") -> list[int]:
    """A request's life up to its prefill: match, allocate the rest, insert. Returns its block table."""
    m = cache.match(prompt, salt)
    try:
        table = m.block_ids + cache.allocate(-(-len(prompt) // bs) - len(m.block_ids))
    except NoFreeBlocks:
        cache.release(m.block_ids)
        raise
    cache.insert(prompt, table, salt)
    return table


def test_match_insert_release_accounting_is_exact():
    pool, cache, events = make()
    a = list(range(10))  # 2 full blocks + 2 tokens
    assert cache.match(a).block_ids == [] and cache.match(a).num_cached_tokens == 0
    table = cache.allocate(3)
    assert (pool.num_free, cache.num_owned, cache.num_cached) == (7, 3, 0)
    cache.insert(a, table)
    assert (cache.num_cached, cache.num_evictable, cache.num_owned, pool.num_free) == (2, 0, 1, 7)
    assert [(e.type, e.hashes, e.parent, e.block_size) for e in events] == [
        ("stored", block_hashes(a, BS), root_hash(), BS)]
    cache.release(table)
    assert (cache.num_cached, cache.num_evictable, cache.num_owned, pool.num_free) == (2, 2, 0, 8)
    assert pool.num_free + cache.num_evictable == pool.num_blocks and cache.num_available == 10
    cache.check_invariants()

    b = a[:8] + [99, 98, 97]  # shares both full blocks
    m = cache.match(b)
    assert m.block_ids == table[:2] and m.num_cached_tokens == 8 and cache.num_evictable == 0
    assert cache.peek(b) == m and cache.num_evictable == 0  # peek locks nothing
    table_b = m.block_ids + cache.allocate(1)
    cache.insert(b, table_b)  # no new full block: no event
    assert len(events) == 1
    cache.release(table_b)
    assert (cache.num_evictable, pool.num_free) == (2, 8)
    cache.check_invariants()


def test_never_the_whole_prompt():
    pool, cache, _ = make()
    cache.release(run(cache, list(range(12))))  # 3 full blocks cached
    assert len(cache.match(list(range(12))).block_ids) == 2  # last token must be computed
    assert len(cache.match(list(range(9))).block_ids) == 2
    assert len(cache.match(list(range(8))).block_ids) == 1
    assert cache.peek(list(range(4))).block_ids == [] and cache.peek([]).block_ids == []
    assert cache.max_match_blocks(13) == 3 and cache.max_match_blocks(0) == 0


def test_lru_eviction_of_unreferenced_leaves():
    pool, cache, events = make(num_blocks=6)
    x, y, z = [1] * 5, [2] * 5, [3] * 5  # one full block + 1 token each
    tables = [run(cache, p) for p in (x, y, z)]
    for t in tables:
        cache.release(t)
    assert (pool.num_free, cache.num_evictable) == (3, 3)
    cache.release(cache.match(x).block_ids)  # x used again: now the most recent
    events.clear()
    got = cache.allocate(5)
    assert [e.type for e in events] == ["removed"] and events[0].hashes == [block_hashes(y, BS)[0],
                                                                           block_hashes(z, BS)[0]]
    assert cache.peek(x).block_ids == tables[0][:1] and tables[0][0] not in got
    cache.release(got)
    cache.check_invariants()


def test_whole_unreferenced_branch_goes_leaf_first():
    pool, cache, events = make(num_blocks=5)
    chain = list(range(17))  # 4 full blocks + 1 token
    cache.release(run(cache, chain))
    assert (pool.num_free, cache.num_evictable) == (1, 4)
    events.clear()
    got = cache.allocate(2)  # one eviction: the tail block
    assert events[0].hashes == block_hashes(chain, BS)[3:]
    assert len(cache.peek(chain).block_ids) == 3
    cache.release(got)
    events.clear()
    got = cache.allocate(5)  # the rest, deepest first
    assert events[0].hashes == block_hashes(chain, BS)[2::-1] and cache.num_cached == 0
    cache.release(got)
    cache.check_invariants()


def test_referenced_blocks_are_never_evicted():
    pool, cache, events = make(num_blocks=6)
    held = run(cache, list(range(12)))  # 3 blocks cached and held
    cache.release(run(cache, [7] * 8))  # 2 evictable
    assert cache.num_available == 1 + 2
    n_events = len(events)
    with pytest.raises(NoFreeBlocks):
        cache.allocate(4)
    assert (cache.num_cached, cache.num_evictable, pool.num_free, len(events)) == (5, 2, 1, n_events)
    got = cache.allocate(3)
    assert not set(got) & set(held) and cache.num_cached == 3
    assert cache.peek(list(range(12))).block_ids == held[:2]
    cache.release(got)
    cache.release(held)
    cache.check_invariants()


def test_concurrent_duplicate_computation_keeps_the_cached_copy():
    pool, cache, events = make()
    p = list(range(9))
    ta = cache.match(p).block_ids + cache.allocate(3)
    tb = cache.match(p).block_ids + cache.allocate(3)  # both miss: both compute the prefix
    cache.insert(p, ta)
    cache.insert(p, tb)  # loses: tb's full blocks stay its own, it holds ta's copies
    assert [e.type for e in events] == ["stored"] and cache.num_cached == 2 and cache.num_owned == 4
    cache.insert(p, tb)  # idempotent
    cache.check_invariants()
    cache.release(ta)
    assert cache.num_evictable == 0  # still referenced by b
    cache.release(tb)
    assert (cache.num_evictable, pool.num_free, cache.num_owned) == (2, 8, 0)
    assert cache.peek(p).block_ids == ta[:2]
    cache.check_invariants()


def test_bad_release_and_insert_change_nothing():
    pool, cache, _ = make()
    table = run(cache, list(range(9)))
    cache.release(table)
    state = (pool.num_free, cache.num_evictable, cache.num_cached, cache.num_owned)
    for bad in (table, [table[2]], [9], [table[0]]):
        with pytest.raises(ValueError):
            cache.release(bad)
    t2 = cache.allocate(2)
    with pytest.raises(ValueError):
        cache.release([t2[0], t2[0]])
    with pytest.raises(ValueError):
        cache.insert(list(range(50, 58)), [t2[0], 9])  # 9 is not the caller's
    with pytest.raises(ValueError):
        cache.insert(list(range(50, 58)), [t2[0]])  # too short
    cache.release(t2)
    assert (pool.num_free, cache.num_evictable, cache.num_cached, cache.num_owned) == state
    cache.check_invariants()


def test_clear_and_snapshot():
    pool, cache, events = make(num_blocks=12)
    a, b = list(range(12)), list(range(8)) + [50] * 5
    cache.release(run(cache, a))
    held = run(cache, b)  # shares a's first 2 blocks, adds one
    snap = cache.snapshot()
    ha, hb = block_hashes(a, BS), block_hashes(b, BS)
    assert sorted(snap) == sorted(set(ha) | set(hb))
    parents = {h: p for chain in (ha, hb) for p, h in zip([root_hash(), *chain], chain)}
    assert all(snap.index(parents[h]) < snap.index(h) for h in snap if parents[h] != root_hash())
    events.clear()
    assert cache.clear() == 1  # only a's tail is unreferenced
    assert events[0].type == "removed" and events[0].hashes == [ha[2]]
    cache.release(held)
    assert cache.clear() == 3 and cache.num_cached == 0 and pool.num_free == 12
    cache.check_invariants()


PROMPTS = st.lists(st.integers(0, 1), min_size=1, max_size=11)  # 2 symbols: prefixes collide a lot
SALTS = st.sampled_from(["", "", "a", "b"])      # cache_salt: "" none
OPS = st.lists(st.one_of(st.tuples(st.just("new"), PROMPTS, st.booleans(), SALTS),  # bool: insert at once
                         st.tuples(st.just("insert"), st.integers(0, 7)),
                         st.tuples(st.just("release"), st.integers(0, 7)), st.tuples(st.just("clear"))),
               min_size=4, max_size=40)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, num_blocks=st.integers(3, 10))
def test_random_operations_keep_the_invariants(ops, num_blocks):
    """Any mix of requests with and without ``cache_salt``: exact block accounting, reused KV always the right
    KV of the same salt, and the events (the router's view) describing exactly the unsalted tree."""
    bs = 2
    pool = BlockPool(num_blocks)
    mirror: set[int] = set()  # the cache as its events describe it

    def on_event(e):
        assert e.block_size == bs
        if e.type == "stored":
            assert e.parent == root_hash() or e.parent in mirror
            assert not mirror & set(e.hashes)
            mirror.update(e.hashes)
        else:
            assert set(e.hashes) <= mirror
            mirror.difference_update(e.hashes)

    cache = PrefixCache(pool, bs, on_event=on_event)
    content: dict[int, int] = {}  # block id -> hash of the KV it holds (what a prefill wrote)
    live: list[tuple[list[int], list[int], str]] = []
    for op in ops:
        if op[0] == "new":
            prompt, salt = op[1], op[3]
            m = cache.match(prompt, salt)
            assert len(m.block_ids) <= (len(prompt) - 1) // bs and m.num_cached_tokens == len(m.block_ids) * bs
            hs = block_hashes(prompt, bs, salted_root(root_hash(), salt))
            # reused KV is the right KV, and cached under the same salt (the salt's root is in every hash)
            assert [content[b] for b in m.block_ids] == hs[:len(m.block_ids)]
            need = -(-len(prompt) // bs) - len(m.block_ids)
            available = cache.num_available
            try:
                table = m.block_ids + cache.allocate(need)
            except NoFreeBlocks:
                assert need > available
                cache.release(m.block_ids)
            else:
                for i in range(len(m.block_ids), len(hs)):  # the prefill writes the blocks it computes
                    content[table[i]] = hs[i]
                live.append((prompt, table, salt))
                if op[2]:
                    cache.insert(prompt, table, salt)
        elif op[0] == "insert" and live:
            cache.insert(*live[op[1] % len(live)])
        elif op[0] == "release" and live:
            _, table, _ = live.pop(op[1] % len(live))
            cache.release(table)
            if set(table) & set(pool._free):  # released twice: refused, nothing changes
                before = (pool.num_free, cache.num_evictable, cache.num_cached)
                with pytest.raises(ValueError):
                    cache.release(table)
                assert (pool.num_free, cache.num_evictable, cache.num_cached) == before
        elif op[0] == "clear":
            cache.clear()
        cache.check_invariants()
        assert mirror == set(cache.snapshot())
        assert cache.num_available == pool.num_free + cache.num_evictable
    for _, table, _ in live:
        cache.release(table)
    cache.check_invariants()
    assert pool.num_free + cache.num_evictable == pool.num_blocks and cache.num_owned == 0
    cache.clear()
    assert pool.num_free == pool.num_blocks and not mirror


def test_a_salted_prompt_matches_only_its_own_salt():
    pool, cache, events = make()
    a = list(range(10))
    tables = {salt: run(cache, a, salt=salt) for salt in ("", "tenant-1", "tenant-2")}
    assert len(set(map(tuple, tables.values()))) == 3                   # three copies: nothing shared
    assert len(events) == 1 and events[0].parent == root_hash()          # only the unsalted one is published
    for salt, table in tables.items():
        assert cache.match(a, salt).block_ids == table[:2]
        cache.release(table[:2])
    assert cache.match(a, "tenant-3").block_ids == [] and cache.snapshot() == block_hashes(a, BS)
    for table in tables.values():
        cache.release(table)
    assert cache.clear() == 6 and pool.num_free == pool.num_blocks and [e.type for e in events] == ["stored", "removed"]
    assert len(events[1].hashes) == 2 and not cache._salted               # the salted trees went without events
    cache.check_invariants()


def test_two_threads_share_the_cache():
    pool, cache, _ = make(num_blocks=16, bs=2)
    errors = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(300):
                prompt = [rng.randrange(2) for _ in range(rng.randrange(1, 9))]
                try:
                    table = run(cache, prompt, bs=2)
                except NoFreeBlocks:
                    continue
                cache.release(table)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    cache.check_invariants()
    assert pool.num_free + cache.num_evictable == pool.num_blocks
