"""Per-pair NCCL communicators of the KV transport, created lazily and torn down on failure.

Each prefill/decode pair shares one 2-rank communicator (sender rank 0, receiver rank 1), so
workers join and leave without a global world size. A pair's NCCL calls are serialized by
:attr:`PairComm.lock`: the sender holds it from a pages header to the end of its ncclSend, the
receiver from its clear-to-send to the end of its ncclRecv, so the sends and receives of
concurrent requests between one pair are posted in the same order on both ends (NCCL matches
point-to-point operations between two ranks in issue order).

Device memory layout (same as the TCP transport's :class:`kvtransfer.tcp.pages.PageMemory`)::

    kv_cache[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]   (contiguous, CUDA)
    page(b, l0, l1) = bytes [(b * num_layers + l0) * layer_nbytes, (b * num_layers + l1) * layer_nbytes)
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from pdserve.kvtransfer.nccl.library import NcclError, NcclLibrary
from pdserve.model.kv_cache import KVCacheSpec


def check_cuda_cache(kv_cache: torch.Tensor, spec: KVCacheSpec) -> None:
    """The NCCL transport moves pages between CUDA caches only.

    Raises:
        ValueError: shape or dtype differ from ``spec``, the tensor is not contiguous, or not on a CUDA device.
    """
    if tuple(kv_cache.shape) != spec.shape or kv_cache.dtype != spec.dtype:
        raise ValueError(f"kv_cache is {tuple(kv_cache.shape)} {kv_cache.dtype}, spec wants {spec.shape} {spec.dtype}")
    if kv_cache.device.type != "cuda" or not kv_cache.is_contiguous():
        raise ValueError(f"the NCCL KV transport needs a contiguous CUDA kv_cache (device {kv_cache.device}, "
                         f"contiguous={kv_cache.is_contiguous()}); use the TCP transport for CPU caches")


@dataclass(frozen=True)
class DevicePages:
    """Device addresses of the pages of one CUDA KV cache (``kv_cache`` keeps the memory alive)."""

    kv_cache: torch.Tensor
    spec: KVCacheSpec

    def buffers(self, block_ids: Sequence[int], layer_start: int, layer_end: int) -> list[tuple[int, int]]:
        """``(device pointer, nbytes)`` of ``kv_cache[b, layer_start:layer_end]`` for each block, in order.
        Bounds are the caller's to check."""
        layer_nbytes = self.spec.page_nbytes(1)
        base, n = self.kv_cache.data_ptr(), (layer_end - layer_start) * layer_nbytes
        return [(base + (b * self.spec.num_layers + layer_start) * layer_nbytes, n) for b in block_ids]


@dataclass(eq=False)
class PairComm:
    """One side of a pair's communicator: handle, rank, CUDA stream, and the lock serializing its calls.

    ``peer_id`` names the other end for :meth:`CommCache.evict_peers_except` ("": unknown): a receiver
    records the sender's id (its hello's ``sender_id``), a sender the receiver's address.
    ``seen_live`` is set once ``peer_id`` appeared in a live set given to that method.
    """

    lib: NcclLibrary
    comm_id: str
    handle: int
    rank: int
    device: torch.device
    stream: torch.cuda.Stream
    lock: threading.Lock = field(default_factory=threading.Lock)
    broken: str | None = None
    peer_id: str = ""
    seen_live: bool = False
    _state_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def peer(self) -> int:
        """The other rank."""
        return 1 - self.rank

    def move(self, buffers: list[tuple[int, int]], send: bool, timeout_s: float,
             before_post: Callable[[], None] | None = None) -> None:
        """ncclSend (``send``) or ncclRecv every ``(pointer, nbytes)`` buffer to/from the peer and wait for
        completion, all within ``timeout_s``. The caller holds :attr:`lock`.

        ``before_post`` runs first (the receiver sends its clear-to-send there): the peer's matching
        call may only be issued once this side is committed, yet this side's enqueue must not wait for
        the peer, because the first operation between two ranks sets up their connection and that
        needs both ends inside NCCL at once. A send also waits for work already queued on the device's
        current stream (the prefill that wrote the pages). Non-blocking communicators may return from
        ``ncclGroupEnd`` before the operations reach the stream, so the completion event is recorded
        only once ``ncclCommGetAsyncError`` reports the enqueue done.

        Raises:
            NcclError: the communicator is broken, an NCCL call failed, or ``timeout_s`` passed first;
                the communicator is then aborted (its operations may never match) and later calls fail.
            Exception: whatever ``before_post`` raised (nothing was posted; the communicator stays usable).
        """
        call = "ncclSend" if send else "ncclRecv"
        if self.broken is not None:
            raise NcclError(call, 3, f"communicator {self.comm_id} is broken: {self.broken}")
        deadline = time.monotonic() + timeout_s
        if before_post is not None:
            before_post()
        try:
            with torch.cuda.device(self.device):
                if send:
                    self.stream.wait_stream(torch.cuda.current_stream(self.device))
                self.lib.send_recv_group(self.handle, self.stream.cuda_stream, self.peer, buffers, send)
                self.lib.wait_ready(self.handle, deadline, call)  # enqueued
                done = torch.cuda.Event()
                done.record(self.stream)
                self.lib.wait_ready(self.handle, deadline, call, done.query)  # completed
        except BaseException as e:
            self.abort(str(e) if isinstance(e, NcclError) else f"{type(e).__name__}: {e}")
            raise

    def abort(self, why: str) -> None:
        """Abort the communicator (idempotent; any thread, also while another is inside :meth:`move`:
        ncclCommAbort unblocks its pending operations). Later :meth:`move` calls fail with ``why``."""
        with self._state_lock:
            if self.broken is None:
                self.broken = why
                self.lib.comm_abort(self.handle)

    def destroy(self) -> None:
        """Free a healthy communicator once in-flight work is done (takes :attr:`lock`); idempotent."""
        with self.lock, self._state_lock:
            if self.broken is None:
                self.broken = "closed"
                self.lib.comm_destroy(self.handle)


class CommCache:
    """Thread-safe map key -> :class:`PairComm` (senders key by receiver address, receivers by comm id).

    Args:
        lib: the loaded NCCL library.
        device: the CUDA device of the local KV cache; communicators are created on it.
        init_timeout_s: seconds a communicator init may wait for its peer.
    """

    def __init__(self, lib: NcclLibrary, device: torch.device, init_timeout_s: float) -> None:
        self._lib, self._device, self._init_timeout_s = lib, device, init_timeout_s
        self._comms: dict[str, PairComm] = {}
        self._creating: dict[str, threading.Event] = {}  # keys whose init is running
        self._lock = threading.Lock()
        self._key_locks: dict[str, threading.Lock] = {}

    def key_lock(self, key: str) -> threading.Lock:
        """A lock per key, for callers that must create a key's communicator at most once at a time."""
        with self._lock:
            return self._key_locks.setdefault(key, threading.Lock())

    def get(self, key: str) -> PairComm | None:
        """The healthy communicator under ``key``; a broken one is dropped and None returned. If an init
        for ``key`` is running (the peer's next request can overtake it), waits for it first."""
        with self._lock:
            creating = self._creating.get(key)
        if creating is not None:
            creating.wait(self._init_timeout_s)
        with self._lock:
            pc = self._comms.get(key)
            if pc is not None and pc.broken is not None:
                del self._comms[key]
                return None
            return pc

    def create(self, key: str, comm_id: str, unique_id: bytes, rank: int, peer_id: str = "") -> PairComm:
        """Join communicator ``unique_id`` as ``rank`` (blocks until the peer joins or the init timeout)
        and cache it under ``key``, replacing (and aborting) any previous one. With a ``peer_id``, other
        communicators of that peer are aborted and forgotten too: each end keeps one communicator per
        pair, so a peer that made a new one has dropped (or lost, restarting) its older ones.

        Raises:
            NcclError: init failed or timed out.
        """
        with self._lock:
            self._creating[key] = creating = threading.Event()
        try:
            # On a CPU device there is no device to select: NCCL itself reports the missing CUDA driver.
            with torch.cuda.device(self._device) if self._device.type == "cuda" else contextlib.nullcontext():
                handle = self._lib.comm_init_rank(2, unique_id, rank, self._init_timeout_s)
                pc = PairComm(self._lib, comm_id, handle, rank, self._device, torch.cuda.Stream(self._device),
                              peer_id=peer_id)
            self._swap(key, pc)
            return pc
        finally:
            with self._lock:
                if self._creating.get(key) is creating:
                    del self._creating[key]
            creating.set()

    def evict(self, key: str, why: str, match: Callable[[PairComm], bool] = lambda pc: True) -> None:
        """Abort and forget the communicator under ``key`` (if ``match`` accepts it)."""
        with self._lock:
            pc = self._comms.get(key)
            if pc is None or not match(pc):
                return
            del self._comms[key]
        pc.abort(why)

    def keys(self) -> list[str]:
        """Keys with a cached communicator."""
        with self._lock:
            return list(self._comms)

    def peer_ids(self) -> set[str]:
        """The known peers (non-empty ``peer_id``) of the cached communicators."""
        with self._lock:
            return {pc.peer_id for pc in self._comms.values() if pc.peer_id}

    def evict_peers_except(self, live_peers: Iterable[str], why: str = "the peer left the registry") -> list[str]:
        """Abort and forget the communicators whose peer left: those whose ``peer_id`` was in an earlier
        ``live_peers`` (so it names something the caller can list, e.g. a registered worker) and is
        not in this one. A communicator whose peer was never listed is kept: its peer cannot be told
        apart from an unknown one. A peer that reappears gets a new communicator on its next request
        (the handshake re-creates one when either end lost its side).

        Args:
            live_peers: the peers alive now (a receiver: the registry's worker ids; a sender: the
                decode workers' KV addresses without scheme).
            why: the abort reason (logged by NCCL users, shown to an in-flight transfer's failure).
        Returns:
            The keys evicted.
        """
        live = set(live_peers)
        with self._lock:
            gone = []
            for key, pc in self._comms.items():
                if pc.peer_id in live:
                    pc.seen_live = True
                elif pc.seen_live and pc.peer_id:
                    gone.append((key, pc))
            for key, _ in gone:
                del self._comms[key]
        for _, pc in gone:
            pc.abort(why)
        return [key for key, _ in gone]

    def close(self) -> None:
        """Destroy every cached communicator (after waiting for its in-flight call)."""
        with self._lock:
            comms, self._comms = list(self._comms.values()), {}
        for pc in comms:
            pc.destroy()

    def _swap(self, key: str, pc: PairComm) -> None:
        with self._lock:
            old = [self._comms.pop(k) for k, c in list(self._comms.items())
                   if k == key or (pc.peer_id and c.peer_id == pc.peer_id)]
            self._comms[key] = pc
        for c in old:
            c.abort("replaced by a new communicator")
