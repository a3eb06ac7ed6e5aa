"""Which KV transport a prefill/decode pair uses, and factories that build the right sender and receiver.

Rule: NCCL when both ends hold their KV cache in CUDA memory and the NCCL library loads on both;
TCP when both caches are in CPU memory. Each worker advertises the backends its cache can use
(:func:`local_backends`: a CPU cache -> ``("tcp",)``, a CUDA cache -> ``("nccl",)`` when
``libnccl.so.2`` loads), and :func:`choose_backend` takes the first of :data:`BACKEND_PREFERENCE`
both sides list. The receiver's address names its backend (``nccl://host:port``; a bare
``host:port`` is TCP), so the sender built by :func:`make_sender` picks the transport per request
from the address it is handed, with no extra field on the wire::

    decode D: make_receiver(cache)  -> receiver.address "nccl://10.0.0.7:9000" | "10.0.0.7:9000"
              registry entry: kv_address + kv_backends (what the router matches against P's)
    prefill P: make_sender(cache).open(request_id, that address) -> the matching backend's channel
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from pdserve.kvtransfer.base import KVChannel, KVReceiver, KVSender, TransferError
from pdserve.kvtransfer.nccl.control import SCHEME as NCCL_SCHEME
from pdserve.kvtransfer.wire.listener import DEFAULT_MAX_CONNECTIONS
from pdserve.model.kv_cache import KVCacheSpec

BACKEND_PREFERENCE = ("nccl", "tcp")
"""Known backends, best first."""


def backend_of_address(address: str) -> str:
    """The backend a receiver address names: ``"nccl"`` for ``nccl://host:port``, ``"tcp"`` for ``host:port``.

    Raises:
        ValueError: an unknown ``scheme://`` prefix.
    """
    if address.startswith(NCCL_SCHEME):
        return "nccl"
    if "://" in address:
        raise ValueError(f"unknown KV transport in address {address!r} (known: 'nccl://host:port', 'host:port')")
    return "tcp"


def nccl_status(library_path: str | None = None) -> str | None:
    """None when the NCCL library loads (see :mod:`kvtransfer.nccl.library`), else why it does not."""
    from pdserve.kvtransfer.nccl.library import NcclUnavailable, load_library

    try:
        load_library(library_path)
    except NcclUnavailable as e:
        return str(e)
    return None


def local_backends(kv_cache: torch.Tensor, nccl_library_path: str | None = None) -> tuple[str, ...]:
    """Backends that can move pages in and out of ``kv_cache``: ``("tcp",)`` for a CPU tensor, ``("nccl",)``
    for a CUDA tensor when NCCL loads, ``()`` otherwise (see :func:`explain_no_backend`)."""
    if kv_cache.device.type == "cpu":
        return ("tcp",)
    if kv_cache.device.type == "cuda" and nccl_status(nccl_library_path) is None:
        return ("nccl",)
    return ()


def explain_no_backend(kv_cache: torch.Tensor, nccl_library_path: str | None = None) -> str:
    """Why :func:`local_backends` is empty for ``kv_cache``."""
    if kv_cache.device.type == "cuda":
        return (f"a CUDA KV cache ({kv_cache.device}) moves over NCCL only, and NCCL is unavailable: "
                f"{nccl_status(nccl_library_path)}")
    return f"no KV transport handles a {kv_cache.device.type} KV cache (TCP needs CPU memory, NCCL CUDA memory)"


def choose_backend(sender_backends: Sequence[str], receiver_backends: Sequence[str]) -> str:
    """The first backend of :data:`BACKEND_PREFERENCE` that both ends list. Pure; no I/O.

    Raises:
        ValueError: an unknown backend name, or none in common (e.g. a CUDA prefill worker and a CPU
            decode worker: TCP reads and writes CPU memory only).
    """
    unknown = sorted((set(sender_backends) | set(receiver_backends)) - set(BACKEND_PREFERENCE))
    if unknown:
        raise ValueError(f"unknown KV transport backends {unknown} (known: {list(BACKEND_PREFERENCE)})")
    for backend in BACKEND_PREFERENCE:
        if backend in sender_backends and backend in receiver_backends:
            return backend
    raise ValueError(f"no common KV transport: the sender offers {list(sender_backends)}, the receiver "
                     f"accepts {list(receiver_backends)} (NCCL needs CUDA caches and libnccl on both ends, "
                     "TCP CPU caches on both)")


def _only_backend(kv_cache: torch.Tensor, nccl_library_path: str | None) -> str:
    backends = local_backends(kv_cache, nccl_library_path)
    if not backends:
        raise RuntimeError(explain_no_backend(kv_cache, nccl_library_path))
    return backends[0]


def make_receiver(kv_cache: torch.Tensor, spec: KVCacheSpec, host: str = "127.0.0.1", port: int = 0,
                  io_timeout_s: float = 10.0, nccl_library_path: str | None = None,
                  secret: bytes | None = None, max_connections: int = DEFAULT_MAX_CONNECTIONS) -> KVReceiver:
    """The receiver for ``kv_cache``'s memory: :class:`~kvtransfer.nccl.NcclKVReceiver` for a CUDA cache,
    :class:`~kvtransfer.tcp.TcpKVReceiver` for a CPU cache. Its ``address`` names the backend; its
    ``alive`` says whether it still accepts transfers, its ``stats`` counts refused and dropped connections.

    Args:
        max_connections: connections served at once (:mod:`kvtransfer.wire.listener`).
    Raises:
        RuntimeError: no backend handles this cache (message from :func:`explain_no_backend`).
        ValueError: ``kv_cache`` does not match ``spec``; ``secret`` (the cluster secret senders must
            prove; None: no authentication) is shorter than 16 bytes; ``max_connections < 1``.
        OSError: the address cannot be bound.
    """
    if _only_backend(kv_cache, nccl_library_path) == "nccl":
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
                secret: bytes | None = None, sender_id: str | None = None) -> SelectingKVSender:
    """The sender for ``kv_cache``'s memory (NCCL for a CUDA cache, TCP for a CPU cache), wrapped so that
    opening a channel to a receiver of another backend fails with a clear :class:`TransferError`.
    ``sender_id`` (the worker id) names this sender to NCCL receivers, which then drop its communicators
    once it leaves the registry; None: a random id.

    Raises:
        RuntimeError: no backend handles this cache (message from :func:`explain_no_backend`).
        ValueError: ``kv_cache`` does not match ``spec``; ``secret`` (the cluster secret receivers must
            prove; None: no authentication) is shorter than 16 bytes.
    """
    if _only_backend(kv_cache, nccl_library_path) == "nccl":
        from pdserve.kvtransfer.nccl import NcclKVSender, load_library

        sender: KVSender = NcclKVSender(kv_cache, spec, connect_timeout_s, io_timeout_s,
                                        library=load_library(nccl_library_path), secret=secret,
                                        sender_id=sender_id)
        return SelectingKVSender({"nccl": sender})
    from pdserve.kvtransfer.tcp import TcpKVSender

    return SelectingKVSender({"tcp": TcpKVSender(kv_cache, spec, connect_timeout_s, io_timeout_s, secret=secret)})
