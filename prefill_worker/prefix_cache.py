"""The prefill worker's prefix cache: a radix tree of full KV blocks keyed by chained hashes.

A prompt whose first blocks were prefilled before (a shared system prompt, a
multi-turn conversation) reuses their KV instead of recomputing it. Each tree node
is one full block; its key is the block's chained hash (:mod:`model.block_hash`), so
a node's path from the root spells the whole prefix it caches::

    root ─ h0 ─ h1 ─ h2        (prompt A: blocks b3 b7 b9)
            └── h1'            (prompt B: same first block, then differs)

Block ownership: every block id of the pool is, at any time, exactly one of
  * free in the pool;
  * owned by a request and not cached (from :meth:`PrefixCache.allocate`, before
    :meth:`insert`, or a duplicate that lost to an already cached copy);
  * cached in the tree: referenced (``ref > 0``, in use by requests) or unreferenced
    (evictable, least-recently-used leaves first).
A request that holds a node holds all its ancestors too, so an unreferenced node
has only unreferenced descendants and :attr:`num_evictable` blocks can really all
be evicted.

A request with a ``cache_salt`` (vLLM's, one per tenant that must not share cached prefixes) walks a
tree of its own, rooted at :func:`model.block_hash.salted_root`: it matches only blocks cached under the
same salt. Those trees stay on the worker: their blocks raise no KV events (the router's index, which
routes on shared prefixes, never hears of them, nor sees them in :meth:`PrefixCache.snapshot`).

Design: SGLang's RadixAttention (Zheng et al., "SGLang: Efficient Execution of
Structured Language Model Programs", 2024) for the tree with reference counts and
LRU leaf eviction, and vLLM's automatic prefix caching for the hash-chained,
block-granular keys.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.cluster.kv_events import REMOVED, STORED, KVEvent
from pdserve.model.block_hash import block_hashes, root_hash, salted_root
from pdserve.model.kv_cache import BlockPool, NoFreeBlocks


@dataclass(frozen=True)
class PrefixMatch:
    """A cached prefix: its block ids (in block-table order) and the tokens they hold."""

    block_ids: list[int]
    num_cached_tokens: int


class _Node:
    __slots__ = ("hash", "block_id", "parent", "children", "ref", "last_access", "depth", "alive", "salted")

    def __init__(self, h: int, block_id: int, parent: _Node | None, tick: int, salted: bool = False) -> None:
        self.hash, self.block_id, self.parent = h, block_id, parent
        self.children: dict[int, _Node] = {}
        self.ref = 0
        self.last_access = tick  # logical clock of the cache: orders LRU exactly, no ties across calls
        self.depth = parent.depth + 1 if parent is not None else 0
        self.alive = True
        self.salted = parent.salted if parent is not None else salted   # under a cache_salt's root: no events


class PrefixCache:
    """Prefix cache over a :class:`BlockPool`; all methods are thread-safe (one re-entrant lock).

    Args:
        pool: the worker's block pool. Once the cache exists, take and return blocks
            only through it (:meth:`allocate` / :meth:`release`), never the pool directly.
        block_size: tokens per block.
        on_event: called with a ``stored`` / ``removed`` :class:`KVEvent` for every change
            to the set of cached blocks, in order, under the cache's lock: it must be
            quick and must not block (e.g. :meth:`KVEventPublisher.publish`).
        model_id: hash salt (:func:`model.block_hash.root_hash`); the router must use the same.
    """

    def __init__(self, pool: BlockPool, block_size: int, on_event: Callable[[KVEvent], None] | None = None,
                 model_id: str = "") -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.pool, self.block_size, self.model_id = pool, block_size, model_id
        self._on_event = on_event
        self._root_hash = root_hash(model_id)
        self._root = _Node(self._root_hash, -1, None, 0)
        self._salted: dict[int, _Node] = {}   # cache_salt roots by hash, while they hold blocks
        self._by_hash: dict[int, _Node] = {}
        self._by_block: dict[int, _Node] = {}
        self._owned: set[int] = set()  # handed out by allocate(), not in the tree
        self._aliases: dict[int, _Node] = {}  # owned duplicate block -> the cached node it holds a ref on
        self._num_unref = 0
        self._tick = itertools.count(1)
        self._heap: list[tuple[int, int, int, _Node]] = []  # (last_access, -depth, n, node): evictable leaves
        self._heap_n = itertools.count()
        self._lock = threading.RLock()

    # ---- accounting ---------------------------------------------------------------------
    @property
    def num_cached(self) -> int:
        """Blocks in the tree (referenced or not)."""
        with self._lock:
            return len(self._by_hash)

    @property
    def num_evictable(self) -> int:
        """Cached blocks no request references (each can be evicted)."""
        with self._lock:
            return self._num_unref

    @property
    def num_available(self) -> int:
        """Blocks :meth:`allocate` can hand out now: free in the pool plus evictable."""
        with self._lock:
            return self.pool.num_free + self._num_unref

    @property
    def num_owned(self) -> int:
        """Blocks held by requests outside the tree (allocated, not cached)."""
        with self._lock:
            return len(self._owned)

    # ---- lookup ---------------------------------------------------------------------------
    def max_match_blocks(self, num_tokens: int) -> int:
        """Blocks a prompt of ``num_tokens`` may reuse at most: its last token is always computed."""
        return max(0, (num_tokens - 1) // self.block_size)

    def peek(self, token_ids: Sequence[int], salt: str = "") -> PrefixMatch:
        """The prefix :meth:`match` would return, without locking or touching anything."""
        with self._lock:
            nodes = self._walk(token_ids, salt)
            return PrefixMatch([n.block_id for n in nodes], len(nodes) * self.block_size)

    def match(self, token_ids: Sequence[int], salt: str = "") -> PrefixMatch:
        """The longest cached block-aligned prefix of ``token_ids`` (at most :meth:`max_match_blocks`), among
        the blocks cached under ``salt`` (a request's ``cache_salt``; "": none).

        Locks the matched blocks (ref += 1, marked recently used): the caller now holds
        them and must :meth:`release` them, as part of its block table, when done.
        """
        with self._lock:
            nodes = self._walk(token_ids, salt)
            tick = next(self._tick)
            for n in nodes:
                if n.ref == 0:
                    self._num_unref -= 1
                n.ref += 1
                n.last_access = tick
            return PrefixMatch([n.block_id for n in nodes], len(nodes) * self.block_size)

    def _root_of(self, salt: str) -> tuple[int, _Node | None]:
        """The root hash of ``salt``'s tree and its node (None: nothing is cached under that salt)."""
        if not salt:
            return self._root_hash, self._root
        h = salted_root(self._root_hash, salt)
        return h, self._salted.get(h)

    def _walk(self, token_ids: Sequence[int], salt: str = "") -> list[_Node]:
        limit = self.max_match_blocks(len(token_ids))
        root_h, node = self._root_of(salt)
        nodes: list[_Node] = []
        if node is None:
            return nodes
        for h in block_hashes(token_ids[: limit * self.block_size], self.block_size, root_h):
            node = node.children.get(h)
            if node is None:
                break
            nodes.append(node)
        return nodes

    # ---- allocation -------------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks for a request, evicting LRU unreferenced leaves if the pool is short.

        The caller owns the blocks until it :meth:`release` s them (or :meth:`insert` caches them).

        Raises:
            ValueError: ``num_blocks`` is negative.
            NoFreeBlocks: fewer than ``num_blocks`` are :attr:`num_available` (nothing is evicted or taken).
        """
        if num_blocks < 0:
            raise ValueError(f"cannot allocate {num_blocks} blocks")
        with self._lock:
            short = num_blocks - self.pool.num_free
            if short > self._num_unref:
                raise NoFreeBlocks(f"need {num_blocks} KV blocks, {self.pool.num_free} free and "
                                   f"{self._num_unref} evictable of {self.pool.num_blocks}")
            if short > 0:
                self._evict(short)
            ids = self.pool.allocate(num_blocks)
            self._owned.update(ids)
            return ids

    def _evict(self, num: int) -> None:
        """Evict ``num`` unreferenced blocks, LRU leaf first; one ``removed`` event. Caller holds the lock."""
        evicted: list[_Node] = []
        while len(evicted) < num:
            tick, _, _, node = heapq.heappop(self._heap)  # IndexError = broken invariant
            if not self._evictable_leaf(node) or node.last_access != tick:
                continue  # stale entry
            self._unlink(node)
            evicted.append(node)
        self.pool.free([n.block_id for n in evicted])
        self._emit(KVEvent(REMOVED, [n.hash for n in evicted if not n.salted], None, self.block_size))

    def _evictable_leaf(self, node: _Node) -> bool:
        return node.alive and node.ref == 0 and not node.children and node.parent is not None

    def _push(self, node: _Node) -> None:
        if self._evictable_leaf(node):
            heapq.heappush(self._heap, (node.last_access, -node.depth, next(self._heap_n), node))
            if len(self._heap) > 2 * len(self._by_hash) + 64:  # drop stale entries
                self._heap = [e for e in self._heap if self._evictable_leaf(e[3]) and e[3].last_access == e[0]]
                heapq.heapify(self._heap)

    def _unlink(self, node: _Node) -> None:
        """Remove an unreferenced leaf from the tree (its block is not freed here)."""
        parent = node.parent
        del parent.children[node.hash]
        if parent.parent is None and parent is not self._root and not parent.children:
            del self._salted[parent.hash]       # a cache_salt's tree emptied
        del self._by_hash[node.hash]
        del self._by_block[node.block_id]
        node.alive = False
        self._num_unref -= 1
        self._push(parent)

    # ---- insert / release ------------------------------------------------------------------------
    def insert(self, token_ids: Sequence[int], block_ids: Sequence[int], salt: str = "") -> None:
        """Cache the full blocks of a prefilled request; the request keeps holding all of them.

        Args:
            token_ids: the request's tokens whose KV is in its blocks (the prompt).
            block_ids: its whole block table: blocks from :meth:`match`, then from :meth:`allocate`.
            salt: the request's ``cache_salt`` (its blocks go in that salt's tree, with no events; "": none).
        Block ``i`` (for ``i < len(token_ids) // block_size``) is either already the cached
        block of its hash (matched), or an owned block that becomes cached (ref 1, one
        ``stored`` event for all of them), or an owned duplicate of a block already cached
        under another id: the cached copy wins and gains the request's reference; the
        duplicate stays the request's, freed by :meth:`release`. Calling it again is a no-op.

        Raises:
            ValueError: ``block_ids`` too short or repeating, or a block neither owned nor the
                cached block of that hash (nothing changes).
        """
        n = len(token_ids) // self.block_size
        if len(block_ids) < n or len(set(block_ids)) != len(block_ids):
            raise ValueError(f"block table of {len(block_ids)} blocks (or repeating) for {n} full blocks")
        root_h = salted_root(self._root_hash, salt)
        hashes = block_hashes(token_ids[: n * self.block_size], self.block_size, root_h)
        with self._lock:
            plan: list[tuple[str, int, int]] = []  # (action, position, block id)
            for i, (h, b) in enumerate(zip(hashes, block_ids)):
                node = self._by_hash.get(h)
                if node is not None and node.block_id == b:
                    continue  # matched (or inserted before)
                if b not in self._owned:
                    raise ValueError(f"block {b} (position {i}) is neither owned by a request nor cached as it")
                if node is not None:
                    if b in self._aliases and self._aliases[b] is not node:
                        raise ValueError(f"block {b} (position {i}) is a duplicate of another block")
                    if b not in self._aliases:
                        plan.append(("alias", i, b))
                elif b in self._aliases:
                    raise ValueError(f"block {b} (position {i}) is a duplicate of another block")
                else:
                    plan.append(("new", i, b))
            tick = next(self._tick)
            stored: list[int] = []
            parent_of_first = None
            for action, i, b in plan:
                h = hashes[i]
                if action == "alias":
                    node = self._by_hash[h]
                    if node.ref == 0:
                        self._num_unref -= 1
                    node.ref += 1
                    node.last_access = tick
                    self._aliases[b] = node
                    continue
                parent = self._by_hash[hashes[i - 1]] if i > 0 else self._salt_root(salt, root_h)
                node = _Node(h, b, parent, tick)
                node.ref = 1
                parent.children[h] = node
                self._by_hash[h] = self._by_block[b] = node
                self._owned.discard(b)
                if not stored:
                    parent_of_first = parent.hash
                stored.append(h)
            if stored and not salt:
                self._emit(KVEvent(STORED, stored, parent_of_first, self.block_size))

    def _salt_root(self, salt: str, root_h: int) -> _Node:
        """The root node of ``salt``'s tree (the model's for ""), made when its first block is cached."""
        if not salt:
            return self._root
        if root_h not in self._salted:
            self._salted[root_h] = _Node(root_h, -1, None, 0, salted=True)
        return self._salted[root_h]

    def release(self, block_ids: Sequence[int]) -> None:
        """A request is done with its block table: cached blocks lose its reference (and stay
        cached, evictable when unreferenced); its own blocks go back to the pool.

        Raises:
            ValueError: a block the caller does not hold (released twice, foreign, repeated);
                nothing changes then.
        """
        with self._lock:
            bad = [b for b in block_ids if b not in self._owned and
                   (b not in self._by_block or self._by_block[b].ref == 0)]
            if bad or len(set(block_ids)) != len(block_ids):
                raise ValueError(f"releasing blocks not held (released twice, foreign or repeated): "
                                 f"{bad or list(block_ids)}")
            tick = next(self._tick)
            to_free = []
            for b in block_ids:
                if b in self._owned:
                    self._owned.discard(b)
                    to_free.append(b)
                    node = self._aliases.pop(b, None)
                    if node is None:
                        continue
                else:
                    node = self._by_block[b]
                node.ref -= 1
                node.last_access = tick
                if node.ref == 0:
                    self._num_unref += 1
                    self._push(node)
            if to_free:
                self.pool.free(to_free)

    # ---- maintenance ---------------------------------------------------------------------------
    def clear(self) -> int:
        """Evict every unreferenced block (one ``removed`` event). Returns how many were evicted."""
        with self._lock:
            n = self._num_unref
            if n:
                self._evict(n)
            return n

    def snapshot(self) -> list[int]:
        """Every cached block hash, each parent before its children (depth-first)."""
        with self._lock:
            out, stack = [], list(reversed(self._root.children.values()))
            while stack:
                node = stack.pop()
                out.append(node.hash)
                stack.extend(reversed(node.children.values()))
            return out

    def check_invariants(self) -> None:
        """Verify the accounting (O(blocks); for tests and debugging).

        Raises:
            AssertionError: with what is broken.
        """
        with self._lock:
            nodes = list(self._by_hash.values())
            assert len(self._by_block) == len(nodes), "block index out of sync"
            for n in nodes:
                assert n.alive and self._by_block[n.block_id] is n, f"node of block {n.block_id} not indexed"
                assert n.parent.children.get(n.hash) is n, f"node {n.hash:#x} not under its parent"
                root = n.parent.parent is None
                assert not root or n.parent is self._root or self._salted.get(n.parent.hash) is n.parent, \
                    "a root that is neither the model's nor a cache_salt's"
                assert root or n.parent.alive, "dangling parent"
                assert 0 <= n.ref and (root or n.ref <= n.parent.ref), \
                    f"block {n.block_id} has more references than its parent"
            assert self._num_unref == sum(n.ref == 0 for n in nodes), "num_evictable out of sync"
            assert set(self._aliases) <= self._owned, "alias of a block not owned"
            assert all(a.alive for a in self._aliases.values()), "alias of an evicted block"
            held = self._owned | set(self._by_block)
            assert len(self._owned) + len(self._by_block) == len(held), "block both owned and cached"
            free = set(self.pool._free)
            assert not (free & held), f"blocks both free and held: {sorted(free & held)}"
            assert len(free) + len(held) == self.pool.num_blocks, "blocks leaked"

    def _emit(self, event: KVEvent) -> None:
        if self._on_event is not None and event.hashes:
            self._on_event(event)
