"""How the prefill engine gets and returns KV blocks.

:class:`BlockSource` is the contract; :class:`PlainBlocks` serves it from a bare
:class:`~model.kv_cache.BlockPool` (no reuse across requests), and the prefix
cache (:mod:`prefill_worker.prefix_cache`) serves it with reuse.
"""

from __future__ import annotations

from typing import Protocol

from pdserve.model.kv_cache import BlockPool
from pdserve.prefill_worker.prefix_cache import PrefixMatch


class BlockSource(Protocol):
    def match(self, token_ids: list[int], salt: str = "") -> PrefixMatch: ...
    def allocate(self, num_blocks: int) -> list[int]: ...
    def insert(self, token_ids: list[int], block_ids: list[int], salt: str = "") -> None: ...
    def release(self, block_ids: list[int]) -> None: ...
    @property
    def num_available(self) -> int: ...


class PlainBlocks:
    """No prefix reuse: match finds nothing, release frees."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool

    def match(self, token_ids: list[int], salt: str = "") -> PrefixMatch:
        return PrefixMatch([], 0)

    def allocate(self, num_blocks: int) -> list[int]:
        return self.pool.allocate(num_blocks)

    def insert(self, token_ids: list[int], block_ids: list[int], salt: str = "") -> None:
        pass

    def release(self, block_ids: list[int]) -> None:
        self.pool.free(block_ids)

    @property
    def num_available(self) -> int:
        return self.pool.num_free
