"""The router's knowledge of which prefill worker holds which prompt prefix.

Exact for workers that publish KV events (kept in sync from their Redis streams by
:class:`~router.index_sync.IndexSync`), approximate for the others (the router
records where it sent each prompt, for ``approx_ttl_s`` seconds). A prompt sent to an
exact worker is also recorded, for ``pending_ttl_s``: its blocks are being computed and
no ``stored`` event can name them yet, and a burst of requests sharing a prefix (the
Mooncake trace's pattern) should follow the first one to its worker, whose prefix cache
then computes the shared blocks once. The price: a block evicted (``removed``) within
``pending_ttl_s`` of its prompt's dispatch still counts as held until the record expires.
"""

from __future__ import annotations

import logging
import time

from pdserve.cluster.registry import WorkerInfo
from pdserve.router.index_sync import IndexSync
from pdserve.router.prefix_index import PrefixIndex

log = logging.getLogger(__name__)

WARN_EVERY_S = 10.0  # while Redis is away, one warning per this many seconds


class KVAwareness:
    """Prefix lookups for dispatch; created with the first prefill worker's block size. ``secret``: the
    cluster secret the workers sign their KV events and snapshots with (None: unchecked)."""

    def __init__(self, redis_url: str, cluster: str, approx_ttl_s: float = 120.0, pending_ttl_s: float = 10.0,
                 secret: bytes | None = None) -> None:
        self._redis_url, self._cluster, self._ttl, self._pending_ttl = redis_url, cluster, approx_ttl_s, pending_ttl_s
        self._secret = secret
        self.index: PrefixIndex | None = None
        self.sync: IndexSync | None = None
        self._warned_at = float("-inf")

    def update_workers(self, workers: list[WorkerInfo]) -> None:
        """Follow the registry: workers whose lease lapsed leave the index at once."""
        prefill = [w for w in workers if w.role == "prefill"]
        if self.index is None and prefill:
            self.index = PrefixIndex(block_size=prefill[0].block_size)
            self.sync = IndexSync(self._redis_url, self._cluster, self.index, secret=self._secret)
        if self.sync is not None:
            self.sync.set_workers(w.worker_id for w in prefill)

    async def sync_once(self) -> None:
        """Apply the workers' new KV events (never raises: the index degrades instead)."""
        if self.sync is not None:
            try:
                await self.sync.sync_once()
            except Exception as exc:  # Redis away: say so once every WARN_EVERY_S, not every poll
                now = time.monotonic()
                if now - self._warned_at >= WARN_EVERY_S:
                    self._warned_at = now
                    log.warning("KV event sync failed (the index keeps its last state): %s", exc)

    def cached_blocks(self, token_ids: list[int], block_size: int) -> dict[str, int]:
        """Leading prompt blocks each prefill worker holds (capped: the last token is always computed)."""
        if self.index is None or block_size != self.index.block_size:
            return {}
        cap = (len(token_ids) - 1) // block_size
        return {w: min(n, cap) for w, n in self.index.lookup_hashes(self.index.hash_prompt(token_ids)).items()}

    def on_routed(self, worker_id: str, token_ids: list[int], block_size: int) -> None:
        """Remember where a prompt went: for ``approx_ttl_s`` if the worker publishes no events,
        else for ``pending_ttl_s`` (until its ``stored`` events have had time to arrive)."""
        if self.index is None or self.sync is None or block_size != self.index.block_size:
            return
        ttl = self._pending_ttl if worker_id in self.sync.exact_workers() else self._ttl
        self.index.record_routing(worker_id, self.index.hash_prompt(token_ids), ttl)

    def forget(self, worker_id: str) -> None:
        """Drop ``worker_id`` (not listed in the registry any more) from the index, where a prompt
        routed to it just before it left may have put it back after :meth:`update_workers` dropped it."""
        if self.index is not None:
            self.index.drop_worker(worker_id)

    async def close(self) -> None:
        if self.sync is not None:
            await self.sync.aclose()
