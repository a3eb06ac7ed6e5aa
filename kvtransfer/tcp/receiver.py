"""Decode side of the TCP KV transport: accepts pages straight into the local KV cache.

With a cluster secret, a connection must pass the mutual handshake of
:mod:`kvtransfer.wire.handshake` (within ``io_timeout_s`` of the accept, together with
its first frame's header) before its first frame is read; a peer that fails it is
logged and closed, and has touched neither the cache nor any pending transfer.
Connection limits and per-frame deadlines: :mod:`kvtransfer.wire.listener`.
"""

from __future__ import annotations

import socket
import time

import torch

from pdserve.cluster.secret import check_secret
from pdserve.kvtransfer.tcp.pages import page_memory
from pdserve.kvtransfer.wire.conn import Conn
from pdserve.kvtransfer.wire.frames import (
    Ack,
    Done,
    Frame,
    FrameError,
    Pages,
    PeerClosed,
    encode,
    read_frame,
    recv_exact_into,
)
from pdserve.kvtransfer.wire.listener import DEFAULT_MAX_CONNECTIONS, ListeningReceiver
from pdserve.kvtransfer.wire.pending import PendingTransfers
from pdserve.model.kv_cache import KVCacheSpec


class TcpKVReceiver(ListeningReceiver):
    """Listens on ``host:port`` and writes incoming KV pages directly into ``kv_cache``.

    Threads (all daemon): one accept loop, one handler per connection, one reaper for the
    pending transfers' deadlines. Callbacks run on those threads (or on the caller's thread
    inside :meth:`close`) with no internal lock held, so they may call :meth:`expect`
    or :meth:`cancel`. Once :meth:`cancel` returns, or a failure callback starts, no
    more bytes are written into that request's blocks.

    Args:
        kv_cache: contiguous tensor ``[num_blocks, num_layers, 2, block_size, num_kv_heads,
            head_dim]`` of ``spec.dtype``; written in place on the CPU, through host staging on a GPU.
        spec: cache layout; incoming ``dtype``/``shape`` must match it.
        host: interface to bind.
        port: TCP port; 0 picks a free one (see :attr:`address`).
        io_timeout_s: seconds a frame's header may take to arrive in full, counted from when the
            receiver starts waiting for it (between frames included), and each page of a payload;
            a new connection's handshake and first header share one such deadline from the accept.
            A peer that misses one is dropped (trickling bytes does not help) and its request failed.
        secret: cluster secret (at least 16 bytes) every sender must prove it holds;
            None: no authentication.
        max_connections: connections served at once; beyond it unbound connections are displaced,
            or the new one refused, with a "KV receiver busy" nack (:mod:`kvtransfer.wire.listener`).
    Raises:
        ValueError: ``kv_cache`` does not match ``spec``; the secret is too short or its
            environment variable is unusable; ``max_connections < 1`` or ``io_timeout_s <= 0``.
        OSError: the address cannot be bound.
    """

    def __init__(self, kv_cache: torch.Tensor, spec: KVCacheSpec, host: str = "127.0.0.1", port: int = 0,
                 io_timeout_s: float = 10.0, secret: bytes | None = None,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS) -> None:
        secret = check_secret(secret, "the KV receiver's secret")
        self._pages = page_memory(kv_cache, spec)
        self._spec = spec
        self._listen(host, port, io_timeout_s, secret, PendingTransfers(spec.num_blocks, spec.num_layers),
                     max_connections=max_connections)

    def close(self) -> None:
        """Stop listening, fail pending transfers (``on_failed(..., "receiver closed")``, on this
        thread) and cut every connection. Returns within about a second; idempotent."""
        self._stop()

    # -- one connection ------------------------------------------------------------------------

    def _progress(self, conn: Conn) -> str:
        transfer = conn.transfer
        return "" if transfer is None else f" ({len(transfer.arrived)} of {transfer.num_pages} pages received)"

    def _serve_frames(self, conn: Conn) -> None:
        """Handle frames until ``done``/``abort`` or a clean EOF of an idle connection. The first
        header is due by ``conn.deadline``, each later one within ``io_timeout_s`` of the wait for it."""
        deadline = conn.deadline
        while True:
            frame = read_frame(conn.sock, deadline)
            if frame is None:
                if conn.transfer is None:
                    return
                raise PeerClosed("EOF before done")
            self._bind(conn, frame)
            if isinstance(frame, Pages):
                self._on_pages(conn, frame)
            elif isinstance(frame, Done):
                self._send(conn.sock, self._finish(conn.transfer, frame))
                return
            else:
                self._on_abort(conn.transfer, frame)
                return
            deadline = time.monotonic() + self._io_timeout_s

    def _bind(self, conn: Conn, frame: Frame) -> None:
        if isinstance(frame, Ack):
            raise FrameError("unexpected ack frame from a sender", frame.request_id)
        if conn.transfer is None:
            self._bind_transfer(conn, frame.request_id)
        elif frame.request_id != conn.transfer.request_id:
            raise FrameError(f"frame for request {frame.request_id!r} on the connection of "
                             f"request {conn.transfer.request_id!r}")

    def _on_pages(self, conn: Conn, frame: Pages) -> None:
        transfer = conn.transfer
        assert transfer is not None
        self._check_pages(transfer, frame)
        with transfer.write_lock:
            self._check_live(transfer)
            # each page in time, straight into the destination pages (a GPU cache's: through a staging buffer)
            for view in self._pages.write(frame.block_ids, frame.layer_start, frame.layer_end):
                recv_exact_into(conn.sock, view, time.monotonic() + self._io_timeout_s)
            self._pending.mark(transfer, frame.block_ids, frame.layer_start, frame.layer_end)

    def _end(self, conn: Conn, why: str, linger: bool = False) -> None:
        """A connection failed with ``why``: fail its request (if this call takes it), nack, close."""
        error = self._take_failed(conn, why)
        if error is None and not linger:
            return  # an idle connection broke: nobody to tell
        self._send(conn.sock, Ack(conn.transfer.request_id if conn.transfer else "", False, error or why))
        if linger:
            self._linger(conn.sock)

    def _send(self, sock: socket.socket, frame: Ack) -> None:
        try:
            sock.settimeout(self._io_timeout_s)  # a frame deadline may have left the timeout short
            sock.sendall(encode(frame))
        except (OSError, FrameError):
            pass  # peer gone; its channel fails on its own

    def _linger(self, sock: socket.socket) -> None:
        """Half-close and discard what the peer still sends (at most io_timeout_s), so the
        nack is not destroyed by a reset from closing with unread data."""
        scratch = bytearray(64 * 1024)
        deadline = time.monotonic() + self._io_timeout_s
        try:
            sock.shutdown(socket.SHUT_WR)
            while (left := deadline - time.monotonic()) > 0:
                sock.settimeout(left)
                if not sock.recv_into(scratch):
                    return
        except OSError:
            pass
