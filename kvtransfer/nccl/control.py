"""Control channel of the NCCL KV transport: the frames of :mod:`kvtransfer.wire.frames` plus four of its own.

Same wire shape (``u32 big-endian header length | msgpack map``); pages frames carry no payload
here, the bytes go over NCCL once the receiver has posted its receives. One control connection
per request; one NCCL communicator (2 ranks: sender 0, receiver 1) per prefill/decode pair,
created on the first request between them and cached on both sides::

    sender (rank 0)                                          receiver (rank 1)
    nccl_hello{request_id, comm_id, sender_id, nccl_version, unique_id}  ──►
        unique_id: 128 bytes when the sender has no communicator to this receiver yet, else empty
                 ◄──  nccl_welcome{request_id, ok, init, need_unique_id, error}
        init:  both call ncclCommInitRank(2, unique_id, rank) now (then cached under comm_id)
        need_unique_id: the receiver does not know comm_id (restarted?): send a new hello with an id
    pages{request_id, layer_start, layer_end, block_ids, dtype, shape, nbytes}  ──►  (no payload)
                 ◄──  nccl_cts{request_id}  (pages accepted; ncclRecv is posted next) | ack{ok=False, error}, close
    ncclSend x len(block_ids)  ═══NCCL═══►  ncclRecv into kv_cache[dst, layers]   (one group each side)
    done / abort / ack as in the TCP transport
    nccl_bye{comm_id}  ──►  (on its own connection when a sender closes: free the pair's communicator)
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.kvtransfer.backends import SCHEMES
from pdserve.kvtransfer.wire.control import ControlCodec

SCHEME = SCHEMES["nccl"]  # prefix of an NCCL receiver's address: "nccl://host:port" (a bare "host:port" is TCP)


@dataclass(frozen=True)
class Hello:
    """First frame of a control connection. ``unique_id`` is empty or 128 bytes."""

    request_id: str
    comm_id: str
    sender_id: str
    nccl_version: int
    unique_id: bytes


@dataclass(frozen=True)
class Welcome:
    """The receiver's answer to a hello; ``ok=False`` with ``error`` refuses the request (connection closes)."""

    request_id: str
    ok: bool
    init: bool
    need_unique_id: bool
    error: str


@dataclass(frozen=True)
class ClearToSend:
    """The receiver posted receives for the pages frame just announced: the sender may ncclSend."""

    request_id: str


@dataclass(frozen=True)
class Bye:
    """The sender drops its communicator ``comm_id``; the receiver frees its end."""

    comm_id: str


ControlFrame = Hello | Welcome | ClearToSend | Bye
_CODEC = ControlCodec({
    "nccl_hello": (Hello, {"request_id": str, "comm_id": str, "sender_id": str, "nccl_version": int,
                           "unique_id": bytes}),
    "nccl_welcome": (Welcome, {"request_id": str, "ok": bool, "init": bool, "need_unique_id": bool, "error": str}),
    "nccl_cts": (ClearToSend, {"request_id": str}),
    "nccl_bye": (Bye, {"comm_id": str}),
})


encode_control = _CODEC.encode
"""Length prefix + msgpack header of one control frame (:meth:`~kvtransfer.wire.control.ControlCodec.encode`)."""
read_any = _CODEC.read_any
"""One frame header: a control frame of this module or a frame of :mod:`kvtransfer.wire.frames`
(:meth:`~kvtransfer.wire.control.ControlCodec.read_any`, which says what it raises)."""
expect = _CODEC.expect
"""``frame`` if it is a given class (:meth:`~kvtransfer.wire.control.ControlCodec.expect`)."""
