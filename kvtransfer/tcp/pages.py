"""Byte views of KV pages inside a paged KV cache tensor, for the TCP transport's sockets.

A CPU cache is read and written in place (:class:`PageMemory`, zero-copy). A cache in device memory
(a CUDA GPU) cannot be handed to a socket: :class:`StagedPageMemory` moves its pages through a host
staging buffer, a group of pages per copy (as Dynamo's NIXL and vLLM's connectors fall back to host
buffers where no device-to-device path joins two workers, e.g. a prefill and a decode worker sharing one
GPU, which NCCL cannot join). :func:`page_memory` picks by the cache's device.

Both offer the same two generators, which the sender and the receiver drive one view at a time::

    sender:   for view in pages.read(blocks, l0, l1):  sock.sendall(view)
    receiver: for view in pages.write(blocks, l0, l1): recv_exact_into(sock, view, deadline)

A view stays valid until the generator is advanced; the receiver's pages are in the cache once its
generator is exhausted (a staged group is copied to the device when its last page has arrived).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from pdserve.model.kv_cache import KVCacheSpec

STAGE_BYTES = 16 << 20
"""Bytes a staged copy moves at most (at least one page): bounds each pooled host buffer."""


def check_cache(kv_cache: torch.Tensor, spec: KVCacheSpec) -> None:
    """Raise ValueError unless ``kv_cache`` has ``spec``'s shape and dtype and is contiguous (any device)."""
    if tuple(kv_cache.shape) != spec.shape or kv_cache.dtype != spec.dtype:
        raise ValueError(f"kv_cache is {tuple(kv_cache.shape)} {kv_cache.dtype}, "
                         f"spec wants {spec.shape} {spec.dtype}")
    if not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache must be contiguous (device {kv_cache.device})")


class PageMemory:
    """Byte-level access to the pages of one CPU KV cache tensor, sharing its memory.

    The cache is ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``,
    block-major, so ``kv_cache[b, l0:l1]`` is one contiguous run of
    ``spec.page_nbytes(l1 - l0)`` bytes starting at byte
    ``(b * num_layers + l0) * spec.page_nbytes(1)``.

    Args:
        kv_cache: contiguous CPU tensor of ``spec.shape`` and ``spec.dtype`` (any dtype,
            bfloat16 included: it is reinterpreted as uint8 inside torch).
        spec: the cache layout.
    Raises:
        ValueError: shape, dtype, device or contiguity does not match.
    """

    def __init__(self, kv_cache: torch.Tensor, spec: KVCacheSpec) -> None:
        check_cache(kv_cache, spec)
        if kv_cache.device.type != "cpu":
            raise ValueError(f"PageMemory needs a CPU tensor (device {kv_cache.device}): see StagedPageMemory")
        self.spec = spec
        self._layer_nbytes = spec.page_nbytes(1)
        # One flat uint8 view; the numpy array keeps the tensor's storage alive.
        self._bytes = memoryview(kv_cache.detach().reshape(-1).view(torch.uint8).numpy())

    def page(self, block_id: int, layer_start: int, layer_end: int) -> memoryview:
        """Writable 1-D byte view of ``kv_cache[block_id, layer_start:layer_end]`` (no copy).

        Bounds are the caller's to check (ids within ``[0, num_blocks)``,
        ``0 <= layer_start < layer_end <= num_layers``).
        """
        start = (block_id * self.spec.num_layers + layer_start) * self._layer_nbytes
        return self._bytes[start:start + (layer_end - layer_start) * self._layer_nbytes]

    def read(self, block_ids: Sequence[int], layer_start: int, layer_end: int) -> Iterator[memoryview]:
        """The pages of ``block_ids`` (layers ``[layer_start, layer_end)``) in order, as bytes to send."""
        for block in block_ids:
            yield self.page(block, layer_start, layer_end)

    def write(self, block_ids: Sequence[int], layer_start: int, layer_end: int) -> Iterator[memoryview]:
        """One writable view per page of ``block_ids``, in order, to receive into: the cache itself."""
        return self.read(block_ids, layer_start, layer_end)


class StagedPageMemory:
    """The pages of a KV cache in device memory (or, for tests, any cache), moved through a host
    staging buffer: up to :data:`STAGE_BYTES` of pages per copy, a buffer per transfer in progress taken
    from a pool that keeps them (pinned for a CUDA cache, so the copies run at the bus's rate; pinning is
    slow, and the receiver serves each connection on a new thread, so buffers outlive threads). Copies run
    on the device's current stream, so a read follows the steps that wrote the pages, and a write is
    complete (synchronized) before the generator ends, so the engine's next step sees it.

    Args:
        kv_cache: contiguous tensor of ``spec.shape`` and ``spec.dtype`` on any device.
        spec: the cache layout.
        stage_bytes: bytes per staged copy at most (at least one page is staged).
    Raises:
        ValueError: shape, dtype or contiguity does not match.
    """

    def __init__(self, kv_cache: torch.Tensor, spec: KVCacheSpec, stage_bytes: int = STAGE_BYTES) -> None:
        check_cache(kv_cache, spec)
        self.spec, self._cache, self._stage_bytes = spec, kv_cache, stage_bytes
        self._pool: list[torch.Tensor] = []   # idle staging buffers (as many as transfers ran at once)
        self._lock = threading.Lock()

    def _group(self, layers: int) -> int:
        return max(1, self._stage_bytes // self.spec.page_nbytes(layers))

    @contextmanager
    def _buffer(self, layers: int) -> Iterator[torch.Tensor]:
        """A staging buffer for groups of ``layers``-layer pages, taken from the pool and given back."""
        nbytes = self._group(layers) * self.spec.page_nbytes(layers)
        with self._lock:
            buf = self._pool.pop() if self._pool else None
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, self._stage_bytes), dtype=torch.uint8,
                              pin_memory=self._cache.device.type == "cuda")
        try:
            yield buf
        finally:
            with self._lock:
                self._pool.append(buf)

    def _staging(self, buf: torch.Tensor, num_pages: int, layers: int) -> tuple[torch.Tensor, memoryview]:
        """``buf`` as ``[num_pages, *page_shape]`` of the cache's dtype, and its bytes."""
        flat = buf[:num_pages * self.spec.page_nbytes(layers)]
        return flat.view(self.spec.dtype).view(num_pages, *self.spec.page_shape(layers)), memoryview(flat.numpy())

    def read(self, block_ids: Sequence[int], layer_start: int, layer_end: int) -> Iterator[memoryview]:
        """The pages of ``block_ids`` (layers ``[layer_start, layer_end)``) in order, a staged group per view."""
        layers, group = layer_end - layer_start, self._group(layer_end - layer_start)
        with self._buffer(layers) as buf:
            for i in range(0, len(block_ids), group):
                part = block_ids[i:i + group]
                index = torch.tensor(part, dtype=torch.long, device=self._cache.device)
                staged, view = self._staging(buf, len(part), layers)
                staged.copy_(self._cache[:, layer_start:layer_end].index_select(0, index))  # waits for the device
                yield view

    def write(self, block_ids: Sequence[int], layer_start: int, layer_end: int) -> Iterator[memoryview]:
        """One writable view per page of ``block_ids``, in order, into the staging buffer; each group goes
        into the cache once its last page has been received, the last one before the generator ends."""
        layers, group = layer_end - layer_start, self._group(layer_end - layer_start)
        page_nbytes = self.spec.page_nbytes(layers)
        with self._buffer(layers) as buf:
            for i in range(0, len(block_ids), group):
                part = block_ids[i:i + group]
                staged, view = self._staging(buf, len(part), layers)
                for j in range(len(part)):
                    yield view[j * page_nbytes:(j + 1) * page_nbytes]
                index = torch.tensor(part, dtype=torch.long, device=self._cache.device)
                self._cache[:, layer_start:layer_end].index_copy_(0, index, staged.to(self._cache.device))
                if self._cache.device.type == "cuda":
                    torch.cuda.current_stream(self._cache.device).synchronize()


def page_memory(kv_cache: torch.Tensor, spec: KVCacheSpec) -> PageMemory | StagedPageMemory:
    """:class:`PageMemory` for a CPU cache (zero-copy), :class:`StagedPageMemory` for any other device.

    Raises:
        ValueError: as the chosen class.
    """
    if kv_cache.device.type == "cpu":
        return PageMemory(kv_cache, spec)
    return StagedPageMemory(kv_cache, spec)
