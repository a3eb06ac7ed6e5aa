"""Zero-copy byte views of KV pages inside a paged KV cache tensor."""

from __future__ import annotations

import torch

from pdserve.model.kv_cache import KVCacheSpec


class PageMemory:
    """Byte-level access to the pages of one KV cache tensor, sharing its memory.

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
        if tuple(kv_cache.shape) != spec.shape or kv_cache.dtype != spec.dtype:
            raise ValueError(f"kv_cache is {tuple(kv_cache.shape)} {kv_cache.dtype}, "
                             f"spec wants {spec.shape} {spec.dtype}")
        if kv_cache.device.type != "cpu" or not kv_cache.is_contiguous():
            raise ValueError(f"kv_cache must be a contiguous CPU tensor (device {kv_cache.device}, "
                             f"contiguous={kv_cache.is_contiguous()})")
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
