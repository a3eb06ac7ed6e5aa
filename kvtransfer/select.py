"""Which KV transport a prefill/decode pair uses, and factories that build the right sender and receiver.

Rule: NCCL when both ends hold their KV cache in CUDA memory and the NCCL library loads on both;
TCP otherwise (a CUDA cache's pages through host staging buffers, :mod:`kvtransfer.tcp.pages`). Each
worker advertises the backends its cache can use (:func:`local_backends`: a CPU cache -> ``("tcp",)``, a
CUDA cache -> ``("nccl", "tcp")`` when ``libnccl.so.2`` loads, else ``("tcp",)``), narrowed by its
``--kv-transport`` (``tcp`` for two workers sharing one GPU, which NCCL cannot join), and
:func:`~kvtransfer.backends.choose_backend` takes the first of
:data:`~kvtransfer.backends.BACKEND_PREFERENCE` both sides list. A receiver listens on its first backend; a
sender offers all of its own. The receiver's address names its
backend (``nccl://host:port``; a bare ``host:port`` is TCP), so the sender built by
:func:`make_sender` picks the transport per request from the address it is handed, with no extra
field on the wire::

    decode D: make_receiver(cache)  -> receiver.address "nccl://10.0.0.7:9000" | "10.0.0.7:9000"
              registry entry: kv_address + kv_backends (what the router matches against P's)
    prefill P: make_sender(cache).open(request_id, that address) -> the matching backend's channel
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pdserve.cluster.args import KV_TRANSPORTS
from pdserve.kvtransfer.backends import (
    AUTO_RECEIVERS,
    BACKEND_PREFERENCE,
    backend_of_address,
    choose_backend,
)
from pdserve.kvtransfer.base import KVChannel, KVReceiver, KVSender, TransferError
from pdserve.kvtransfer.wire.listener import DEFAULT_MAX_CONNECTIONS
from pdserve.model.kv_cache import KVCacheSpec


def nccl_status(library_path: str | None = None) -> str | None:
    """None when the NCCL library loads (see :mod:`kvtransfer.nccl.library`), else why it does not."""
    from pdserve.kvtransfer.nccl.library import NcclUnavailable, load_library

    try:
        load_library(library_path)
    except NcclUnavailable as e:
        return str(e)
    return None


def local_backends(kv_cache: torch.Tensor, nccl_library_path: str | None = None,
                   transport: str = "auto") -> tuple[str, ...]:
    """Backends that can move pages in and out of ``kv_cache``, best first, among those ``transport``
    (``auto``, ``nccl``, ``cuda-ipc`` or ``tcp``) allows: TCP for a CPU or CUDA cache (a CUDA cache's pages
    staged through host memory), for a CUDA cache NCCL first when NCCL loads, and CUDA IPC; ``()`` when none
    is left (see :func:`explain_no_backend`).

    Raises:
        ValueError: an unknown ``transport``.
    """
    if transport not in KV_TRANSPORTS:
        raise ValueError(f"kv transport must be one of {KV_TRANSPORTS}, got {transport!r}")
    if kv_cache.device.type not in ("cpu", "cuda"):
        return ()
    found = ["tcp"]
    if kv_cache.device.type == "cuda":
        found.insert(0, "cuda-ipc")
        if transport in ("auto", "nccl") and nccl_status(nccl_library_path) is None:
            found.insert(0, "nccl")
    return tuple(b for b in found if transport in ("auto", b))


def explain_no_backend(kv_cache: torch.Tensor, nccl_library_path: str | None = None, transport: str = "auto") -> str:
    """Why :func:`local_backends` is empty for ``kv_cache`` and ``transport``."""
    if kv_cache.device.type not in ("cpu", "cuda"):
        return f"no KV transport handles a {kv_cache.device.type} KV cache (TCP and NCCL need CPU or CUDA memory)"
    if kv_cache.device.type != "cuda":
        what = "CUDA IPC shares" if transport == "cuda-ipc" else "NCCL moves"
        return (f"--kv-transport {transport}: {what} CUDA memory only, and this KV cache is on "
                f"{kv_cache.device}; use tcp or auto")
    return f"--kv-transport {transport}: NCCL is unavailable: {nccl_status(nccl_library_path)}; use tcp or auto"


def _backends(kv_cache: torch.Tensor, nccl_library_path: str | None, transport: str) -> tuple[str, ...]:
    backends = local_backends(kv_cache, nccl_library_path, transport)
    if not backends:
        raise RuntimeError(explain_no_backend(kv_cache, nccl_library_path, transport))
    return backends


def receiver_backend(kv_cache: torch.Tensor, nccl_library_path: str | None = None, transport: str = "auto") -> str:
    """The backend a receiver of ``kv_cache`` listens on: ``transport`` when it names one this cache can
    use, else (``auto``) the first of :func:`local_backends` in :data:`AUTO_RECEIVERS`.

    Raises:
        RuntimeError: no backend handles this cache (message from :func:`explain_no_backend`).
        ValueError: an unknown ``transport``.
    """
    backends = _backends(kv_cache, nccl_library_path, transport)
    return next(b for b in backends if transport != "auto" or b in AUTO_RECEIVERS)


def make_receiver(kv_cache: torch.Tensor, spec: KVCacheSpec, host: str = "127.0.0.1", port: int = 0,
                  io_timeout_s: float = 10.0, nccl_library_path: str | None = None,
                  secret: bytes | None = None, max_connections: int = DEFAULT_MAX_CONNECTIONS,
                  transport: str = "auto") -> KVReceiver:
    """The receiver of the first backend :func:`local_backends` gives for ``kv_cache`` and ``transport``:
    :class:`~kvtransfer.nccl.NcclKVReceiver` (a CUDA cache, NCCL loads) or :class:`~kvtransfer.tcp.TcpKVReceiver`.
    Its ``address`` names the backend; its ``alive`` says whether it still accepts transfers, its
    ``stats`` counts refused and dropped connections.

    Args:
        max_connections: connections served at once (:mod:`kvtransfer.wire.listener`).
        transport: ``auto``, ``nccl`` or ``tcp`` (a worker's ``--kv-transport``).
    Raises:
        RuntimeError: no backend handles this cache (message from :func:`explain_no_backend`).
        ValueError: ``kv_cache`` does not match ``spec``; ``secret`` (the cluster secret senders must
            prove; None: no authentication) is shorter than 16 bytes; ``max_connections < 1``; unknown transport.
        OSError: the address cannot be bound.
    """
    backend = receiver_backend(kv_cache, nccl_library_path, transport)
    if backend == "cuda-ipc":
        from pdserve.kvtransfer.cudaipc import CudaIpcKVReceiver

        return CudaIpcKVReceiver(kv_cache, spec, host, port, io_timeout_s, secret=secret,
                                 max_connections=max_connections)
    if backend == "nccl":
        from pdserve.kvtransfer.nccl import NcclKVReceiver, load_library

        return NcclKVReceiver(kv_cache, spec, host, port, io_timeout_s, library=load_library(nccl_library_path),
                              secret=secret, max_connections=max_connections)
    from pdserve.kvtransfer.tcp import TcpKVReceiver

    return TcpKVReceiver(kv_cache, spec, host=host, port=port, io_timeout_s=io_timeout_s, secret=secret,
                         max_connections=max_connections)


class SelectingKVSender(KVSender):
    """A :class:`KVSender` over one sender per local backend; :meth:`open` picks by the receiver's address.

    Args:
        senders: backend name -> sender (at least one).
    """

    def __init__(self, senders: dict[str, KVSender]) -> None:
        if not senders:
            raise ValueError("SelectingKVSender needs at least one backend")
        self.senders = dict(senders)

    @property
    def backends(self) -> tuple[str, ...]:
        """Backends this sender offers, best first."""
        return tuple(b for b in BACKEND_PREFERENCE if b in self.senders)

    def open(self, request_id: str, dst_address: str) -> KVChannel:
        """Open a channel with the backend ``dst_address`` names (:func:`backend_of_address`).

        Raises:
            TransferError: the receiver's backend is not among this sender's, or the backend's ``open`` failed.
            ValueError: malformed address.
        """
        backend = backend_of_address(dst_address)
        try:
            choose_backend(self.backends, (backend,))
        except ValueError as e:
            raise TransferError(f"KV transfer of request {request_id!r} to {dst_address}: {e}") from None
        return self.senders[backend].open(request_id, dst_address)

    @property
    def keeps_peer_state(self) -> bool:
        """Whether some backend caches state per receiver (NCCL communicators)."""
        return any(getattr(sender, "keeps_peer_state", False) for sender in self.senders.values())

    def evict_peers_except(self, live_addresses: Iterable[str]) -> list[str]:
        """Let every backend drop its state of receivers that left the registry (``live_addresses``: the
        live decode workers' KV addresses); see :meth:`kvtransfer.nccl.NcclKVSender.evict_peers_except`.
        Returns what was dropped."""
        live = list(live_addresses)
        return [key for sender in self.senders.values() if hasattr(sender, "evict_peers_except")
                for key in sender.evict_peers_except(live)]

    def close(self) -> None:
        """Close every backend's sender. Idempotent."""
        for sender in self.senders.values():
            sender.close()


def make_sender(kv_cache: torch.Tensor, spec: KVCacheSpec, connect_timeout_s: float = 5.0,
                io_timeout_s: float = 10.0, nccl_library_path: str | None = None,
                secret: bytes | None = None, sender_id: str | None = None,
                transport: str = "auto") -> SelectingKVSender:
    """A sender of every backend :func:`local_backends` gives for ``kv_cache`` and ``transport`` (a CUDA
    cache: NCCL, CUDA IPC and TCP; a CPU cache: TCP), picking per receiver address; opening a channel to a
    receiver of another backend fails with a clear :class:`TransferError`. ``sender_id`` (the worker id)
    names this sender to NCCL and CUDA IPC receivers, which then drop its communicators or mapped cache once
    it leaves the registry; None: a random id.

    Raises:
        RuntimeError: no backend handles this cache (message from :func:`explain_no_backend`).
        ValueError: ``kv_cache`` does not match ``spec``; ``secret`` (the cluster secret receivers must
            prove; None: no authentication) is shorter than 16 bytes; unknown transport.
    """
    senders: dict[str, KVSender] = {}
    for backend in _backends(kv_cache, nccl_library_path, transport):
        if backend == "nccl":
            from pdserve.kvtransfer.nccl import NcclKVSender, load_library

            senders["nccl"] = NcclKVSender(kv_cache, spec, connect_timeout_s, io_timeout_s,
                                           library=load_library(nccl_library_path), secret=secret,
                                           sender_id=sender_id)
        elif backend == "cuda-ipc":
            from pdserve.kvtransfer.cudaipc import CudaIpcKVSender

            senders["cuda-ipc"] = CudaIpcKVSender(kv_cache, spec, connect_timeout_s, io_timeout_s, secret=secret,
                                                  sender_id=sender_id)
        else:
            from pdserve.kvtransfer.tcp import TcpKVSender

            senders["tcp"] = TcpKVSender(kv_cache, spec, connect_timeout_s, io_timeout_s, secret=secret)
    return SelectingKVSender(senders)
