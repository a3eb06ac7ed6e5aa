"""Sharing a CUDA KV cache with another process and copying pages out of a mapped one.

The prefill side exports its cache once (:func:`export_cache`: ``torch.UntypedStorage._share_cuda_``,
the call behind ``torch.multiprocessing``'s CUDA tensors); a decode side maps it once per sender
(:func:`open_peer_cache`: ``_new_shared_cuda``, i.e. ``cudaIpcOpenMemHandle``) and keeps the mapping in
:class:`PeerCaches` until the sender leaves the registry or another cache replaces it. Every field a
peer sends is checked (:func:`check_share`) before anything is mapped: its layout must be the
receiver's, the storage must hold the blocks it claims, and torch's reference-counter name must be one
torch makes (``/torch_...``), since dropping a mapping decrements a counter in that shared file.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from pdserve.kvtransfer.cudaipc.control import CacheShare
from pdserve.kvtransfer.wire.frames import dtype_name
from pdserve.model.kv_cache import KVCacheSpec

REF_COUNTER_SLOTS = 10_000
"""Slots of one torch IPC reference-counter file (torch's ``CUDA_IPC_REF_COUNTER_FILE_SIZE``)."""
MAX_HANDLE_BYTES = 4096
MAX_PEERS = 64
"""Senders' caches a receiver keeps mapped at most; beyond it the least recently used is dropped."""
_REF_COUNTER = re.compile(rb"/torch_[0-9A-Za-z_]{1,96}")
_EXPORTED: dict[tuple[bytes, int], weakref.ref] = {}
"""Caches this process exported, by (handle, offset): CUDA cannot open a process's own IPC handle, so a
receiver in the sender's process (two workers in one process, the tests) reads the tensor itself."""


class PeerCacheError(RuntimeError):
    """A sender's cache cannot be mapped: a share that does not fit this cache, a GPU this process does
    not see, or the driver's refusal. The message says which."""


def device_uuid(device: torch.device) -> str:
    """The UUID of the CUDA ``device`` (the same in every process, whatever its device index there)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def export_cache(kv_cache: torch.Tensor) -> CacheShare:
    """What another process needs to map ``kv_cache``, a contiguous CUDA tensor
    ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``. Call once per cache: each call
    adds a reference torch counts for the receivers.

    Raises:
        ValueError: not a contiguous CUDA tensor.
        RuntimeError: torch cannot share its memory (e.g. an allocator configured with expandable
            segments on a torch that cannot share them).
    """
    if kv_cache.device.type != "cuda" or not kv_cache.is_contiguous():
        raise ValueError(f"CUDA IPC shares a contiguous CUDA KV cache, got one on {kv_cache.device} "
                         f"(contiguous={kv_cache.is_contiguous()})")
    _, handle, nbytes, offset, ref, ref_offset, event, event_sync = kv_cache.untyped_storage()._share_cuda_()
    _EXPORTED[(bytes(handle), int(offset))] = weakref.ref(kv_cache)
    return CacheShare(device_uuid(kv_cache.device), bytes(handle), int(nbytes), int(offset), bytes(ref),
                      int(ref_offset), bytes(event or b""), bool(event_sync), kv_cache.storage_offset(),
                      kv_cache.shape[0], dtype_name(kv_cache.dtype), list(kv_cache.shape[1:]))


def check_share(share: CacheShare, spec: KVCacheSpec) -> None:
    """Check a peer's :class:`CacheShare` against this receiver's cache layout ``spec``; maps nothing.

    Raises:
        PeerCacheError: another dtype or page layout, no blocks, a storage too small for the blocks it
            claims, a malformed handle, reference counter or event.
    """
    if share.dtype != dtype_name(spec.dtype) or share.page_shape != list(spec.shape[1:]):
        raise PeerCacheError(f"the sender's KV cache is {share.dtype} pages of {share.page_shape}; this one is "
                             f"{dtype_name(spec.dtype)} pages of {list(spec.shape[1:])}")
    block_elems = spec.page_nbytes(spec.num_layers) // spec.dtype.itemsize
    need = (share.tensor_offset + share.num_blocks * block_elems) * spec.dtype.itemsize
    if share.num_blocks < 1 or share.tensor_offset < 0 or share.storage_offset < 0 or share.storage_nbytes < need:
        raise PeerCacheError(f"the sender's share does not hold its {share.num_blocks} blocks: {need} bytes from "
                             f"element {share.tensor_offset} in a storage of {share.storage_nbytes} bytes")
    if not 0 < len(share.handle) <= MAX_HANDLE_BYTES:
        raise PeerCacheError(f"a CUDA IPC handle of {len(share.handle)} bytes")
    if not _REF_COUNTER.fullmatch(share.ref_counter) or not 0 <= share.ref_counter_offset < REF_COUNTER_SLOTS:
        raise PeerCacheError(f"torch's reference counter {share.ref_counter[:100]!r}[{share.ref_counter_offset}] "
                             "is not one torch makes")
    if len(share.event_handle) > MAX_HANDLE_BYTES or (share.event_sync and not share.event_handle):
        raise PeerCacheError(f"an IPC event of {len(share.event_handle)} bytes (sync={share.event_sync})")


def local_device_index(uuid: str) -> int | None:
    """Index of the visible CUDA device with ``uuid``, or None (no such GPU visible, or no CUDA)."""
    if not torch.cuda.is_available():
        return None
    return next((i for i in range(torch.cuda.device_count()) if device_uuid(torch.device("cuda", i)) == uuid), None)


def open_peer_cache(share: CacheShare, spec: KVCacheSpec) -> torch.Tensor:
    """Map a sender's cache into this process: ``[share.num_blocks, *spec.shape[1:]]`` of ``spec.dtype``
    on the sender's GPU (as this process numbers it). The mapping lives as long as the tensor.

    Raises:
        PeerCacheError: :func:`check_share` refuses it, the sender's GPU is not visible here (another
            node, or ``CUDA_VISIBLE_DEVICES`` hides it), or the driver cannot open the handle.
    """
    check_share(share, spec)
    own = _EXPORTED.get((share.handle, share.storage_offset))
    if own is not None and (cache := own()) is not None and device_uuid(cache.device) == share.device_uuid:
        return cache  # exported by this very process (see _EXPORTED)
    index = local_device_index(share.device_uuid)
    if index is None:
        raise PeerCacheError(f"the sender's GPU {share.device_uuid} is not visible to this process: CUDA IPC joins "
                             "workers whose GPUs one process can see (use the nccl or tcp KV transport)")
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            index, share.handle, share.storage_nbytes, share.storage_offset, share.ref_counter,
            share.ref_counter_offset, share.event_handle, share.event_sync)
    except (RuntimeError, TypeError) as e:  # torch.AcceleratorError is a RuntimeError
        raise PeerCacheError(f"cannot map the sender's KV cache: {e}") from None
    shape = (share.num_blocks, *spec.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    return torch.empty(0, dtype=spec.dtype, device=torch.device("cuda", index)).set_(
        storage, share.tensor_offset, shape, stride)


def copy_pages(src_cache: torch.Tensor, dst_cache: torch.Tensor, src_ids: Sequence[int], dst_ids: Sequence[int],
               layer_start: int, layer_end: int) -> None:
    """``dst_cache[dst_ids[i], l0:l1] = src_cache[src_ids[i], l0:l1]`` for every i, finished on return (a
    CUDA copy is synchronized, so the pages are in place and the source may be reused). Bounds are the
    caller's to check. One gather and one scatter of the pages' bytes (any dtype, float8 included), across
    devices through ``Tensor.to``."""
    src_cache, dst_cache = src_cache.view(torch.uint8), dst_cache.view(torch.uint8)
    src_idx = torch.tensor(list(src_ids), dtype=torch.long).to(src_cache.device)
    pages = src_cache[:, layer_start:layer_end].index_select(0, src_idx).to(dst_cache.device)
    dst_idx = torch.tensor(list(dst_ids), dtype=torch.long).to(dst_cache.device)
    dst_cache[:, layer_start:layer_end].index_copy_(0, dst_idx, pages)
    for device in {src_cache.device, dst_cache.device}:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()


@dataclass
class _Peer:
    key: tuple[bytes, int]
    cache: torch.Tensor
    seen_live: bool = False


class PeerCaches:
    """The senders' caches a receiver has mapped, by sender id (module doc). Thread-safe.

    Args:
        spec: the receiver's cache layout (a share must match it but for the number of blocks).
        open_peer: maps a checked share (:func:`open_peer_cache`).
        max_peers: mappings kept at most (least recently used dropped first).
    """

    def __init__(self, spec: KVCacheSpec,
                 open_peer: Callable[[CacheShare, KVCacheSpec], torch.Tensor] = open_peer_cache,
                 max_peers: int = MAX_PEERS) -> None:
        self._spec = spec
        self._open = open_peer
        self._max = max_peers
        self._peers: dict[str, _Peer] = {}  # in use order, least recent first
        self._lock = threading.Lock()
        self._open_lock = threading.Lock()  # one mapping at a time: two requests of a new sender map it once

    def get(self, sender_id: str, share: CacheShare) -> torch.Tensor:
        """The cache of ``sender_id`` (a sender with no id is known by its handle), mapped now if it is
        new or ``share`` names another allocation (a restarted sender: the old mapping is dropped).

        Raises:
            PeerCacheError: see :func:`open_peer_cache`.
        """
        key, name = (share.handle, share.storage_offset), sender_id or share.handle.hex()
        with self._open_lock:
            with self._lock:
                peer = self._peers.pop(name, None)
                if peer is not None and peer.key == key:
                    self._peers[name] = peer
                    return peer.cache
            cache = self._open(share, self._spec)
            if tuple(cache.shape) != (share.num_blocks, *self._spec.shape[1:]) or cache.dtype != self._spec.dtype:
                raise PeerCacheError(f"the mapped cache is {tuple(cache.shape)} {cache.dtype}")
            with self._lock:
                self._peers[name] = _Peer(key, cache, seen_live=peer.seen_live if peer else False)
                while len(self._peers) > self._max:
                    self._peers.pop(next(iter(self._peers)))
            return cache

    def names(self) -> list[str]:
        """Senders with a mapped cache, least recently used first."""
        with self._lock:
            return list(self._peers)

    def evict_peers_except(self, live_ids: Iterable[str]) -> list[str]:
        """Drop the mappings of senders that left: listed live in an earlier call, absent from
        ``live_ids`` now (a sender never listed is kept: it cannot be told from an unknown one). A copy
        in flight keeps its own reference; the memory is unmapped when that ends. Returns the dropped names."""
        live = set(live_ids)
        with self._lock:
            gone = []
            for name, peer in self._peers.items():
                if name in live:
                    peer.seen_live = True
                elif peer.seen_live:
                    gone.append(name)
            for name in gone:
                del self._peers[name]
        return gone

    def clear(self) -> None:
        """Drop every mapping."""
        with self._lock:
            self._peers.clear()
