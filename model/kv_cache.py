"""Paged KV cache: the block layout shared by both workers, and the block pool.

One tensor holds every block of every layer, block-major so that a block's KV
for a range of layers is one contiguous run of bytes (one KV page on the wire)::

    kv_cache[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
              │           │          │   └─ token offset inside the block
              │           │          └─ 0 = K, 1 = V
              │           └─ layer
              └─ block id  (a request's block table lists these in order)

    slot = block_id * block_size + offset   (slot mapping: token position -> slot)

Layout follows the paged KV cache of vLLM (Kwon et al., "Efficient Memory
Management for Large Language Model Serving with PagedAttention", SOSP 2023),
with the block axis outermost so that transfers need no gather.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import torch

from pdserve.model.hugepages import empty_huge


def available_memory_bytes() -> int | None:
    """Bytes of memory this process can still take: ``MemAvailable`` of ``/proc/meminfo``, or less where a
    cgroup v2 limit (``memory.max`` less ``memory.current`` of ``/sys/fs/cgroup``) leaves less; None where
    neither can be read (not Linux)."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except OSError:
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f, open("/sys/fs/cgroup/memory.current") as g:
            limit = f.read().strip()
            if limit != "max":
                found.append(max(int(limit) - int(g.read().strip()), 0))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


class NoFreeBlocks(RuntimeError):
    """Raised by :meth:`BlockPool.allocate` when the pool cannot satisfy a request."""


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape and dtype of a paged KV cache.

    Attributes:
        num_blocks: blocks in the pool.
        num_layers: decoder layers (every block holds KV for all of them).
        block_size: token positions per block.
        num_kv_heads: key/value heads per layer.
        head_dim: features per head.
        dtype: element type of K and V.
    """

    num_blocks: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("num_blocks", "num_layers", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVCacheSpec.{name} must be positive, got {getattr(self, name)}")

    @classmethod
    def for_model(cls, model_cfg, num_blocks: int, block_size: int, dtype: torch.dtype) -> "KVCacheSpec":
        """The cache of a :class:`model.config.ModelConfig` with ``num_blocks`` blocks of ``block_size`` tokens."""
        return cls(num_blocks, model_cfg.num_layers, block_size, model_cfg.num_kv_heads, model_cfg.head_dim, dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the whole cache tensor."""
        return (self.num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def page_shape(self, num_layers: int) -> tuple[int, ...]:
        """Shape of one block's KV for ``num_layers`` consecutive layers (one KV page)."""
        return (num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def page_nbytes(self, num_layers: int) -> int:
        """Bytes of one KV page covering ``num_layers`` layers."""
        n = 1
        for d in self.page_shape(num_layers):
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block (all layers)."""
        return self.page_nbytes(self.num_layers)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole cache."""
        return self.num_blocks * self.block_nbytes

    def check_fits(self, who: str, available: int | None = None, beside: int = 0) -> None:
        """Refuse, before anything is loaded, a cache larger than the memory left (``available`` bytes, by
        default :func:`available_memory_bytes`) once ``beside`` bytes (the weights that load next to it)
        are taken: it would fail in the middle of allocating, or be killed, after the model had loaded.
        Nothing is checked where the memory cannot be read.

        Raises:
            MemoryError: naming ``who``, the blocks, the bytes each and in all, the bytes beside, and the
                memory available.
        """
        available = available_memory_bytes() if available is None else available
        if available is not None and self.nbytes + beside > available:
            weights = f" beside {beside / 2**30:.1f} GiB of weights" if beside else ""
            raise MemoryError(f"{who}: a KV cache of {self.num_blocks} blocks x {self.block_nbytes} bytes "
                              f"({self.nbytes / 2**30:.1f} GiB){weights} does not fit the {available / 2**30:.1f} "
                              f"GiB of memory available here; lower --num-blocks")

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` token positions."""
        return -(-num_tokens // self.block_size)

    def allocate(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """A zeroed cache tensor of :attr:`shape` (``dtype``) on ``device``; on the CPU in huge
        pages (:mod:`model.hugepages`), since attention streams it like the weights."""
        if torch.device(device).type != "cpu":
            return torch.zeros(self.shape, dtype=self.dtype, device=device)
        return empty_huge(math.prod(self.shape), self.dtype).zero_().view(self.shape)


class BlockPool:
    """A fixed pool of KV block ids with exact accounting; thread-safe.

    Blocks are handed out lowest-id-first from a free list. Freeing a block that
    is not allocated (double free, foreign id) raises ``ValueError`` and changes
    nothing, so accounting errors surface where they happen. Every allocation and
    free moves a version number on (:meth:`snapshot`), which starts at the pool's
    creation time in nanoseconds, so a pool made later (a restarted worker) counts on
    from above any earlier pool's versions.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() yields the lowest id
        self._allocated: set[int] = set()
        self._lock = threading.Lock()
        self._version = time.time_ns()

    def snapshot(self) -> tuple[int, int]:
        """``(version, free blocks)`` read together: what a worker reports of its pool, so that a reader can
        keep the newest of several reports that reach it by different paths (the registry's heartbeat, a
        request's own stream)."""
        with self._lock:
            return self._version, len(self._free)

    @property
    def num_free(self) -> int:
        """Blocks currently free."""
        with self._lock:
            return len(self._free)

    @property
    def num_allocated(self) -> int:
        """Blocks currently handed out."""
        with self._lock:
            return len(self._allocated)

    def allocate(self, num: int) -> list[int]:
        """Take ``num`` free blocks.

        Returns:
            The block ids, in the order they should appear in the block table.
        Raises:
            ValueError: ``num`` is negative.
            NoFreeBlocks: fewer than ``num`` blocks are free (nothing is taken).
        """
        if num < 0:
            raise ValueError(f"cannot allocate {num} blocks")
        with self._lock:
            if num > len(self._free):
                raise NoFreeBlocks(f"need {num} KV blocks, {len(self._free)} of {self.num_blocks} free")
            ids = [self._free.pop() for _ in range(num)]
            self._allocated.update(ids)
            self._version += bool(ids)
            return ids

    def free(self, block_ids: list[int]) -> None:
        """Return blocks to the pool.

        Raises:
            ValueError: a block id is not currently allocated or repeats (nothing is freed).
        """
        with self._lock:
            bad = [b for b in block_ids if b not in self._allocated]
            if bad or len(set(block_ids)) != len(block_ids):
                raise ValueError(f"freeing blocks that are not allocated (or repeated): {bad or block_ids}")
            self._allocated.difference_update(block_ids)
            self._free.extend(sorted(block_ids, reverse=True))
            self._free.sort(reverse=True)
            self._version += bool(block_ids)
