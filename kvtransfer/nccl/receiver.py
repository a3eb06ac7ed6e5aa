"""Decode side of the NCCL KV transport: a TCP control listener; pages arrive by ncclRecv into the CUDA KV cache."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from pdserve.cluster.secret import check_secret
from pdserve.kvtransfer.nccl.comms import CommCache, DevicePages, PairComm, check_cuda_cache
from pdserve.kvtransfer.nccl.control import SCHEME, Bye, ClearToSend, Hello, Welcome, encode_control, expect, read_any
from pdserve.kvtransfer.nccl.handshake import negotiate_receiver
from pdserve.kvtransfer.nccl.library import NcclError, NcclLibrary, load_library
from pdserve.kvtransfer.wire.conn import Conn
from pdserve.kvtransfer.wire.frames import Abort, Ack, Done, FrameError, Pages, PeerClosed, encode
from pdserve.kvtransfer.wire.listener import DEFAULT_MAX_CONNECTIONS, ListeningReceiver
from pdserve.kvtransfer.wire.pending import PendingTransfers
from pdserve.model.kv_cache import KVCacheSpec


@dataclass(eq=False)
class NcclConn(Conn):
    """A control connection, plus the pair's communicator once the hello is answered."""

    comm: PairComm | None = None


class NcclKVReceiver(ListeningReceiver):
    """Accepts control connections on ``host:port``; KV pages arrive over NCCL straight into ``kv_cache``.

    Same contract and threads as :class:`kvtransfer.tcp.TcpKVReceiver` (accept loop, one handler per
    control connection, a deadline reaper; callbacks run without internal locks held), and the same
    table of pending transfers (:mod:`kvtransfer.wire.pending`). A pair's communicator is created when a
    sender's hello carries a unique id, and aborted and forgotten when an NCCL call on it fails or times
    out, when the sender says bye, when the same sender makes a new one, or when its sender leaves the
    registry (:meth:`evict_peers_except`, called from the worker's heartbeat).

    Args:
        kv_cache: contiguous CUDA tensor ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``
            of ``spec.dtype``; written in place by ncclRecv.
        spec: cache layout; announced pages must match it.
        host / port: control listener (port 0 picks a free one).
        io_timeout_s: seconds a control frame may take to arrive in full (one deadline per frame,
            counted from when the receiver starts waiting for it; a new connection's handshake and
            hello share one from the accept), or one NCCL receive.
        init_timeout_s: seconds a communicator init may wait for the sender.
        library: a loaded :class:`NcclLibrary`; None loads the wheel's.
        secret: cluster secret every control connection must prove first (the HMAC handshake both
            transports share, :mod:`kvtransfer.wire.handshake`); None: no authentication.
        max_connections: control connections served at once (see :mod:`kvtransfer.wire.listener`).
    Raises:
        ValueError: ``kv_cache`` is not a contiguous CUDA tensor matching ``spec``, the secret is too short,
            ``max_connections < 1``.
        NcclUnavailable: the NCCL library cannot be loaded.
        OSError: the address cannot be bound.
    """

    _kind = "NCCL KV receiver"
    _conn_kind = "control connection"
    _thread_prefix = "nccl-kv"
    _conn_type = NcclConn
    keeps_peer_state = True

    def __init__(self, kv_cache: torch.Tensor, spec: KVCacheSpec, host: str = "127.0.0.1", port: int = 0,
                 io_timeout_s: float = 10.0, init_timeout_s: float = 30.0, library: NcclLibrary | None = None,
                 secret: bytes | None = None, max_connections: int = DEFAULT_MAX_CONNECTIONS) -> None:
        check_cuda_cache(kv_cache, spec)
        secret = check_secret(secret, "the KV receiver's secret")
        self._lib = library or load_library()
        self._version = self._lib.version()
        self._pages = DevicePages(kv_cache, spec)
        self._spec = spec
        self._comms = CommCache(self._lib, kv_cache.device, init_timeout_s)
        self._listen(host, port, io_timeout_s, secret, PendingTransfers(spec.num_blocks, spec.num_layers), SCHEME,
                     max_connections)

    def close(self) -> None:
        """Stop listening, fail pending transfers (``"receiver closed"``, on this thread), cut every
        connection and destroy the communicators. Idempotent."""
        if self._stop():
            self._comms.close()

    def evict_peers_except(self, live_peer_ids: Iterable[str]) -> list[str]:
        """Abort and forget the communicators of senders that left: a sender whose id (its hello's
        ``sender_id``, the prefill worker's id when its sender was made with one) was among the live
        ids of an earlier call and is not among ``live_peer_ids`` (see
        :meth:`kvtransfer.nccl.comms.CommCache.evict_peers_except`). A transfer still running on one fails.

        Returns:
            The comm ids evicted.
        """
        return self._comms.evict_peers_except(live_peer_ids, "the sender left the registry")

    # -- one control connection ----------------------------------------------------------------

    def _failure_reason(self, conn: Conn, e: Exception) -> str:
        if isinstance(e, NcclError):
            return f"NCCL failure: {e}"
        return super()._failure_reason(conn, e)

    def _serve_frames(self, conn: NcclConn) -> None:
        first = read_any(conn.sock, conn.deadline)
        if first is None:
            return
        if isinstance(first, Bye):
            self._comms.evict(first.comm_id, "the sender said bye")
            return
        self._handshake(conn, expect(first, Hello))
        while True:
            frame = read_any(conn.sock, time.monotonic() + self._io_timeout_s)
            if frame is None:
                raise PeerClosed("EOF before done")
            request_id = conn.transfer.request_id
            if getattr(frame, "request_id", None) != request_id or not isinstance(frame, Pages | Done | Abort):
                raise FrameError(f"unexpected {frame!r} on the control connection of request {request_id!r}",
                                 request_id)
            if isinstance(frame, Pages):
                self._on_pages(conn, frame)
            elif isinstance(frame, Done):
                self._reply(conn, self._finish(conn.transfer, frame))
                return
            else:
                self._on_abort(conn.transfer, frame)
                return

    def _handshake(self, conn: NcclConn, hello: Hello) -> None:
        """Bind the request, then find or create the pair's communicator (see :mod:`.handshake`)."""
        self._bind_transfer(conn, hello.request_id)
        conn.sock.settimeout(self._io_timeout_s)  # the hello's deadline may have left it short
        conn.comm = negotiate_receiver(conn.sock, hello, self._comms, self._version.code, self._io_timeout_s)

    def _on_pages(self, conn: NcclConn, frame: Pages) -> None:
        transfer, pc = conn.transfer, conn.comm
        self._check_pages(transfer, frame)
        buffers = self._pages.buffers(frame.block_ids, frame.layer_start, frame.layer_end)
        with pc.lock, transfer.write_lock:
            self._check_live(transfer)
            try:
                pc.move(buffers, send=False, timeout_s=self._io_timeout_s,
                        before_post=lambda: self._reply(conn, ClearToSend(transfer.request_id), strict=True))
            except NcclError:  # the communicator was aborted: forget it (the sender re-creates one)
                self._comms.evict(pc.comm_id, "an NCCL receive failed", match=lambda c: c is pc)
                raise
            self._pending.mark(transfer, frame.block_ids, frame.layer_start, frame.layer_end)

    def _end(self, conn: Conn, why: str, linger: bool = True) -> None:
        """The connection failed with ``why``: fail its request (if this call takes it), nack, close.
        Always nacks and lingers (``linger`` is ignored): a control peer waits for an answer."""
        error = self._take_failed(conn, why)
        self._reply(conn, Ack(conn.transfer.request_id if conn.transfer else "", False, error or why))
        try:  # half-close and drain briefly so the nack is not lost to a reset
            conn.sock.shutdown(socket.SHUT_WR)
            conn.sock.settimeout(min(self._io_timeout_s, 1.0))
            deadline = time.monotonic() + min(self._io_timeout_s, 1.0)
            while time.monotonic() < deadline and conn.sock.recv(65536):
                pass
        except OSError:
            pass

    def _reply(self, conn: Conn, frame: Ack | Welcome | ClearToSend, strict: bool = False) -> None:
        try:
            conn.sock.settimeout(self._io_timeout_s)  # a frame deadline may have left it short
            conn.sock.sendall(encode(frame) if isinstance(frame, Ack) else encode_control(frame))
        except (OSError, FrameError):
            if strict:
                raise
