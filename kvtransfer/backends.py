"""The KV transports by name: which ones exist, in which order a pair prefers them, and how a receiver's
address names its transport. Pure and without torch, for the router (which matches workers' transports) as
much as for :mod:`kvtransfer.select` (which builds the senders and receivers).
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.cluster.args import KV_TRANSPORTS

BACKEND_PREFERENCE = tuple(t for t in KV_TRANSPORTS if t != "auto")
"""Known backends, best first (``nccl``, ``cuda-ipc``, ``tcp``): the ``--kv-transport`` names but ``auto``."""
AUTO_RECEIVERS = ("nccl", "tcp")
"""Backends a receiver under ``--kv-transport auto`` listens on: CUDA IPC only when asked, since it reaches
senders on the receiver's own machine alone (workers sharing a GPU); NCCL and TCP reach any node."""
SCHEMES = {"nccl": "nccl://", "cuda-ipc": "cuda-ipc://"}
"""Address prefix of each backend but TCP (a bare ``host:port``)."""


def backend_of_address(address: str) -> str:
    """The backend a receiver address names: ``"nccl"`` for ``nccl://host:port``, ``"cuda-ipc"`` for
    ``cuda-ipc://host:port``, ``"tcp"`` for ``host:port``.

    Raises:
        ValueError: an unknown ``scheme://`` prefix.
    """
    for backend, scheme in SCHEMES.items():
        if address.startswith(scheme):
            return backend
    if "://" in address:
        raise ValueError(f"unknown KV transport in address {address!r} (known: 'nccl://host:port', "
                         "'cuda-ipc://host:port', 'host:port')")
    return "tcp"


def host_port(address: str) -> str:
    """``host:port`` of a receiver address, its backend's scheme removed.

    Raises:
        ValueError: an unknown ``scheme://`` prefix.
    """
    return address.removeprefix(SCHEMES.get(backend_of_address(address), ""))


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
                     f"accepts {list(receiver_backends)} (NCCL needs CUDA caches and libnccl on both ends; "
                     "TCP takes any cache unless --kv-transport nccl excludes it)")
