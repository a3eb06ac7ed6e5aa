"""The router's prefix index: which prefill worker holds which cached KV blocks.

Blocks are named by their chained hash (:mod:`model.block_hash`, the same code the
workers use), and a chained hash names the whole prefix up to the end of its block.
The radix tree of the workers' caches therefore flattens into one dict::

    hash -> bitmask of the workers that hold that block (bit i = worker i)

where a node's key already encodes its path from the root: there are no child
pointers to follow, because a lookup walks the PROMPT's own hash chain ``h_0, h_1,
...`` and asks the dict at each depth. Empty nodes are deleted (pruned) at once.

Prefix-closed invariant: a worker's cache is a tree (a block's parent is stored
before it and removed after it, ``docs/kv_events.md``), so "w holds h_i" implies "w
holds h_0..h_{i-1}". The index keeps every worker's set prefix-closed too (a
``stored`` event whose parent the worker does not hold is rejected, see
:meth:`PrefixIndex.apply`). Then along a prompt's chain each worker's bit is set
on a leading run and clear after it, and :meth:`PrefixIndex.lookup_hashes` finds
the per-worker boundaries by bisection: ``O(k log n)`` dict probes for ``k``
distinct depths among the workers, instead of ``n`` probes for a linear walk
(probes are cache misses, ~0.1-0.5 us each in CPython).

Two sources of entries, in one table:
  * exact: from the workers' KV events and snapshots (:meth:`apply`,
    :meth:`load_snapshot`), kept in sync by :class:`router.index_sync.IndexSync`;
  * approximate: for workers that publish no events, the router records where it
    sent each prompt (:meth:`record_routing`) and the entries expire after a TTL,
    as SGLang's cache-aware router does with its approximate radix tree; for the
    others, the same records with a short TTL stand for blocks still being computed.

Sources: SGLang's cache-aware router (approximate per-worker radix trees), NVIDIA
Dynamo's KV-aware router and its KV events (stored/removed block hashes per
worker), vLLM's hash-chained prefix caching and llm-d's prefix-aware scorer.

Not thread-safe: use it from one thread (the router's event loop).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterable, Sequence

from pdserve.cluster.kv_events import CLEARED, REMOVED, STORED, KVEvent
from pdserve.model.block_hash import block_hashes, root_hash


class PrefixIndex:
    """Which worker holds which block, by chained block hash.

    Args:
        block_size: tokens per block, for :meth:`lookup` / :meth:`hash_prompt` (the workers' block size).
        model_id: the hash salt the workers use (:func:`model.block_hash.root_hash`).
        clock: monotonic clock in seconds for approximate entries' expiry (inject one in tests).
    """

    def __init__(self, block_size: int = 16, model_id: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size, self.model_id, self.clock = block_size, model_id, clock
        self.root = root_hash(model_id)
        self._table: dict[int, int] = {}  # hash -> mask of workers holding it (exact or approximate)
        self._bit: dict[str, int] = {}  # worker -> its bit (a power of two)
        self._name: dict[int, str] = {}  # bit -> worker
        self._exact: dict[str, set[int]] = {}  # worker -> hashes from events / snapshots
        self._approx: dict[str, dict[int, float]] = {}  # worker -> hash -> expiry (clock seconds)
        self._expiry: list[tuple[float, int, str, tuple[int, ...]]] = []  # heap: (expiry, n, worker, hashes)
        self._n = itertools.count()

    # ---- introspection ------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Distinct block hashes held by at least one worker."""
        return len(self._table)

    def workers(self) -> list[str]:
        """Workers the index knows (possibly holding nothing), sorted."""
        return sorted(self._bit)

    def hashes_of(self, worker_id: str, approximate: bool = False) -> set[int]:
        """A copy of the hashes ``worker_id`` holds: exact ones, plus unexpired approximate ones if asked."""
        out = set(self._exact.get(worker_id, ()))
        if approximate:
            self._expire_due()
            out.update(self._approx.get(worker_id, ()))
        return out

    def num_entries(self) -> int:
        """(worker, block) pairs held, exact plus approximate (memory, all in: ~110 bytes per pair)."""
        return sum(map(len, self._exact.values())) + sum(map(len, self._approx.values()))

    # ---- exact entries: KV events and snapshots --------------------------------------------------
    def apply(self, worker_id: str, event: KVEvent, strict: bool = True) -> bool:
        """Apply one of ``worker_id``'s KV events (set semantics: replaying one is harmless).

        ``stored`` adds the worker to each hash; ``removed`` takes it off (a hash no
        worker holds any more is deleted); ``cleared`` drops all its exact entries.

        Args:
            strict: reject a ``stored`` event whose ``parent`` the worker does not hold
                (and that is not the root): such an event extends a prefix the index
                lost, and adding it would break the prefix-closed invariant. Pass
                ``False`` when replaying events over a snapshot that may already contain
                later events (the end state of such a replay is exact, hence closed).
        Returns:
            ``False`` iff a ``stored`` event was rejected: the index lost part of this
            worker's state; the caller should re-sync it (``IndexSync`` does).
        """
        t = event.type
        if t == STORED:
            bit = self._bit.get(worker_id) or self._add_worker(worker_id)
            table = self._table
            held = self._exact[worker_id]
            if strict and event.parent != self.root and event.parent not in held:
                return False                                     # (a pending routing entry is no parent)
            held.update(event.hashes)
            get = table.get
            for h in event.hashes:
                table[h] = get(h, 0) | bit
        elif t == REMOVED:
            held = self._exact.get(worker_id)
            if held:
                approx = self._approx.get(worker_id, {})
                bit = self._bit[worker_id]
                for h in event.hashes:
                    if h in held:
                        held.discard(h)
                        if h not in approx:
                            self._clear_bit(h, bit)
        elif t == CLEARED:
            self.load_snapshot(worker_id, ())
        return True

    def load_snapshot(self, worker_id: str, hashes: Iterable[int]) -> None:
        """Replace ``worker_id``'s exact entries by ``hashes`` (approximate ones stay).

        A snapshot (``KVEventPublisher.publish_snapshot``) holds hashes only, in
        parent-before-child order, with no parent links and no depths, so its tree
        shape cannot be rebuilt; none is needed: a chained hash names its whole
        prefix, and membership ("w holds h") is all a lookup along the prompt's own
        chain asks. A snapshot of a real cache is prefix-closed. Cost: O(changes)
        set operations plus one pass over ``hashes``.
        """
        bit = self._bit.get(worker_id) or self._add_worker(worker_id)
        new = set(hashes)
        old = self._exact[worker_id]
        approx = self._approx.get(worker_id, {})
        for h in old - new:
            if h not in approx:
                self._clear_bit(h, bit)
        table, get = self._table, self._table.get
        for h in new - old:
            table[h] = get(h, 0) | bit
        self._exact[worker_id] = new

    def drop_worker(self, worker_id: str) -> None:
        """Forget ``worker_id`` at once, exact and approximate entries (its lease lapsed). O(its entries)."""
        bit = self._bit.pop(worker_id, 0)
        if not bit:
            return
        for h in self._exact.pop(worker_id, set()) | set(self._approx.pop(worker_id, {})):
            self._clear_bit(h, bit)
        del self._name[bit]

    # ---- approximate entries -----------------------------------------------------------------------
    def record_routing(self, worker_id: str, hashes: Sequence[int], ttl_s: float) -> None:
        """Record that the router sent a prompt with block hashes ``hashes`` to ``worker_id``.

        For workers that publish no KV events: the worker will probably hold these
        blocks for a while, so they count in lookups for ``ttl_s`` seconds (a block
        recorded again keeps its latest expiry). ``hashes`` must be the prompt's chain
        from its first block (as :meth:`hash_prompt` returns), which keeps the
        worker's set prefix-closed. Expired entries go lazily, on the next lookup.
        """
        if ttl_s <= 0 or not hashes:
            return
        bit = self._bit.get(worker_id) or self._add_worker(worker_id)
        expiry = self.clock() + ttl_s
        approx = self._approx.setdefault(worker_id, {})
        table, get = self._table, self._table.get
        for h in hashes:
            if approx.get(h, -1.0) < expiry:
                approx[h] = expiry
            table[h] = get(h, 0) | bit
        heapq.heappush(self._expiry, (expiry, next(self._n), worker_id, tuple(hashes)))

    def _expire_due(self) -> None:
        heap = self._expiry
        if not heap or heap[0][0] > (now := self.clock()):
            return
        while heap and heap[0][0] <= now:
            _, _, worker_id, hashes = heapq.heappop(heap)
            approx = self._approx.get(worker_id)
            if not approx:
                continue  # dropped since
            bit, held = self._bit[worker_id], self._exact.get(worker_id, ())
            for h in hashes:
                e = approx.get(h)
                if e is not None and e <= now:  # not refreshed since
                    del approx[h]
                    if h not in held:
                        self._clear_bit(h, bit)

    # ---- lookups -------------------------------------------------------------------------------------
    def hash_prompt(self, token_ids: Sequence[int]) -> list[int]:
        """The chained hashes of the full blocks of ``token_ids`` (the workers' scheme).

        Costs ~0.5-1 us per block (blake2b per block plus packing the tokens); hash a
        prompt once and pass the list to :meth:`lookup_hashes` and :meth:`record_routing`.
        """
        return block_hashes(token_ids, self.block_size, self.root)

    def lookup(self, token_ids: Sequence[int]) -> dict[str, int]:
        """:meth:`lookup_hashes` of a prompt given as tokens, hashing only as far as workers hold it.

        Hashes in chunks of 8, 16, 32, ... blocks and stops after a chunk whose last block
        no worker holds (by the prefix-closed invariant none holds anything deeper), so a
        miss costs 8 blocks of hashing, not the whole prompt. Use :meth:`hash_prompt` plus
        :meth:`lookup_hashes` when all the hashes are needed anyway (:meth:`record_routing`).
        """
        n, bs, get = len(token_ids) // self.block_size, self.block_size, self._table.get
        hashes: list[int] = []
        parent, step = self.root, 8
        while len(hashes) < n:
            start = len(hashes) * bs
            chunk = block_hashes(token_ids[start:start + min(step, n - len(hashes)) * bs], bs, parent)
            hashes += chunk
            parent, step = chunk[-1], step * 2
            if not get(parent, 0):
                break
        return self.lookup_hashes(hashes)

    def lookup_hashes(self, hashes: Sequence[int]) -> dict[str, int]:
        """For each worker, how many LEADING blocks of the prompt it holds.

        Args:
            hashes: the prompt's chained block hashes, from its first block on.
        Returns:
            ``{worker_id: n}`` with ``n >= 1`` the number of leading blocks the worker
            holds: its count stops at its first missing block. Workers holding none
            are left out (read it with ``.get(w, 0)``).

        Exact for prefix-closed sets, which is every state the index reaches through
        its API used as documented. In a set that is not (only by hand-building one,
        e.g. removing a block whose children stay), the count is some position at
        which the worker holds the block, so still a lower bound of what a real,
        prefix-closed, cache holds. Cost: 1 probe when no worker holds the first
        block, 2 when every worker holding it holds the whole prompt, ~log2(n) per
        distinct depth otherwise.
        """
        if self._expiry:
            self._expire_due()
        n = len(hashes)
        if not n:
            return {}
        get, names, out = self._table.get, self._name, {}
        alive = get(hashes[0], 0)  # workers holding blocks 0..lo
        lo = 0
        while alive:
            if get(hashes[n - 1], 0) & alive == alive:
                break
            hi = n - 1  # some worker in `alive` lacks block hi
            while hi - lo > 1:
                mid = (lo + hi) >> 1
                if get(hashes[mid], 0) & alive == alive:
                    lo = mid
                else:
                    hi = mid
            held = get(hashes[hi], 0) & alive
            lost = alive ^ held  # these hold blocks 0..hi-1 and not block hi
            while lost:
                b = lost & -lost
                out[names[b]] = hi
                lost ^= b
            alive, lo = held, hi
        while alive:
            b = alive & -alive
            out[names[b]] = n
            alive ^= b
        return out

    def lookup_linear(self, hashes: Sequence[int]) -> dict[str, int]:
        """:meth:`lookup_hashes` by a linear walk (each count stops at the worker's first
        missing block whatever the set's shape). A reference for tests and the benchmark."""
        if self._expiry:
            self._expire_due()
        get, names, out = self._table.get, self._name, {}
        alive, i = (get(hashes[0], 0) if hashes else 0), 0
        for i, h in enumerate(hashes):
            m = get(h, 0)
            if m & alive != alive:
                lost = alive & ~m
                while lost:
                    b = lost & -lost
                    out[names[b]] = i
                    lost ^= b
                alive &= m
                if not alive:
                    return out
        while alive:
            b = alive & -alive
            out[names[b]] = i + 1
            alive ^= b
        return out

    # ---- internals -------------------------------------------------------------------------------------
    def _add_worker(self, worker_id: str) -> int:
        used = set(self._name)
        bit = next(1 << i for i in itertools.count() if 1 << i not in used)
        self._bit[worker_id], self._name[bit] = bit, worker_id
        self._exact[worker_id] = set()
        return bit

    def _clear_bit(self, h: int, bit: int) -> None:
        m = self._table.get(h, 0) & ~bit
        if m:
            self._table[h] = m
        else:
            self._table.pop(h, None)  # prune: no worker holds this block
