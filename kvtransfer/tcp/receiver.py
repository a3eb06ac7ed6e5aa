"""Decode side of the TCP KV transport: accepts pages straight into the local KV cache.

With a cluster secret, a connection must pass the mutual handshake of
:mod:`kvtransfer.tcp.handshake` (within ``io_timeout_s``) before its first frame is
read; a peer that fails it is logged and closed, and has touched neither the cache
nor any registration.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from deploy.secret import check_secret, cluster_secret
from kvtransfer.base import KVReceiver, OnComplete, OnFailed
from kvtransfer.tcp.frames import (
    Abort,
    Ack,
    Done,
    Frame,
    FrameError,
    Pages,
    PeerClosed,
    check_pages,
    encode,
    read_frame,
    recv_exact_into,
)
from kvtransfer.tcp.handshake import HandshakeError, authenticate_sender
from kvtransfer.tcp.pages import PageMemory
from kvtransfer.tcp.registry import Registration, Registry
from model.kv_cache import KVCacheSpec

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    reg: Registration | None = None  # the request this connection feeds, once its first frame names it


def _shutdown(sock: socket.socket, how: int) -> None:
    try:
        sock.shutdown(how)
    except OSError:
        pass  # already closed or never connected


def _progress(conn: _Conn) -> str:
    reg = conn.reg
    return "" if reg is None else f" ({len(reg.arrived)} of {reg.num_pages} pages received)"


def _call(fn: Callable[..., None], *args: object) -> None:
    try:
        fn(*args)
    except Exception:  # a callback must not kill a receiver thread
        log.exception("KV receiver callback %r raised", fn)


class TcpKVReceiver(KVReceiver):
    """Listens on ``host:port`` and writes incoming KV pages directly into ``kv_cache``.

    Threads (all daemon): one accept loop, one handler per connection, one reaper for
    registration deadlines. Callbacks run on those threads (or on the caller's thread
    inside :meth:`close`) with no internal lock held, so they may call :meth:`expect`
    or :meth:`cancel`. Once :meth:`cancel` returns, or a failure callback starts, no
    more bytes are written into that request's blocks.

    Args:
        kv_cache: contiguous CPU tensor ``[num_blocks, num_layers, 2, block_size, num_kv_heads,
            head_dim]`` of ``spec.dtype``; written in place.
        spec: cache layout; incoming ``dtype``/``shape`` must match it.
        host: interface to bind.
        port: TCP port; 0 picks a free one (see :attr:`address`).
        io_timeout_s: seconds a connection may stay silent (mid-frame or between frames)
            before it is dropped and its request failed; also the bound on the whole
            authentication handshake of a new connection.
        secret: cluster secret (at least 16 bytes) every sender must prove it holds;
            None: :func:`deploy.secret.cluster_secret` from the environment, and no
            authentication when that is None too.
    Raises:
        ValueError: ``kv_cache`` does not match ``spec``; the secret is too short or its
            environment variable is unusable.
        OSError: the address cannot be bound.
    """

    def __init__(self, kv_cache: torch.Tensor, spec: KVCacheSpec, host: str = "127.0.0.1", port: int = 0,
                 io_timeout_s: float = 10.0, secret: bytes | None = None) -> None:
        self._secret = check_secret(secret, "the KV receiver's secret") if secret is not None else cluster_secret()
        self._num_refused = 0
        self._pages = PageMemory(kv_cache, spec)
        self._spec = spec
        self._io_timeout_s = io_timeout_s
        self._registry = Registry(spec.num_blocks, spec.num_layers)
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._stopping = threading.Event()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family)
        port = self._listener.getsockname()[1]
        self._address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._accept_thread = threading.Thread(target=self._accept_loop, name=f"kv-accept-{port}", daemon=True)
        self._reaper = threading.Thread(target=self._reap_loop, name=f"kv-reaper-{port}", daemon=True)
        self._accept_thread.start()
        self._reaper.start()

    @property
    def address(self) -> str:
        """``host:port`` senders connect to (``[host]:port`` for IPv6), with the bound port."""
        return self._address

    @property
    def num_refused(self) -> int:
        """Connections closed because their peer failed the authentication handshake."""
        return self._num_refused

    def expect(self, request_id: str, block_ids: Sequence[int], timeout_s: float,
               on_complete: OnComplete, on_failed: OnFailed) -> None:
        """Register ``request_id`` to receive every layer of ``block_ids`` within ``timeout_s`` seconds.

        Raises:
            ValueError: already registered; block ids empty, repeated or outside ``[0, num_blocks)``;
                ``timeout_s <= 0``.
            RuntimeError: the receiver is closed.
        """
        self._registry.add(request_id, block_ids, timeout_s, on_complete, on_failed)

    def cancel(self, request_id: str) -> None:
        """Forget ``request_id`` without a callback; its connection, if any, is cut. Idempotent."""
        reg = self._registry.take_id(request_id, "cancelled by the receiver")
        if reg is not None:
            self._stop_writes(reg)

    def close(self) -> None:
        """Stop listening, fail pending registrations (``on_failed(..., "receiver closed")``, on this
        thread) and cut every connection. Returns within about a second; idempotent."""
        with self._conns_lock:
            if self._stopping.is_set():
                return
            self._stopping.set()
            conns = list(self._conns)
        _shutdown(self._listener, socket.SHUT_RDWR)  # wakes accept() (Linux)
        for reg in self._registry.close():
            self._stop_writes(reg)
            _call(reg.on_failed, reg.request_id, reg.ended)
        for sock in conns:
            _shutdown(sock, socket.SHUT_RDWR)
        for thread in (self._accept_thread, self._reaper):
            if thread is not threading.current_thread():  # close() may run inside a reaper callback
                thread.join(timeout=1.0)
        self._listener.close()

    # -- threads -------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                sock, peer = self._listener.accept()
            except OSError:
                self._stopping.wait(0.05)  # closed (loop ends) or transient (e.g. EMFILE)
                continue
            sock.settimeout(self._io_timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._conns_lock:
                if self._stopping.is_set():
                    sock.close()
                    return
                self._conns.add(sock)
            threading.Thread(target=self._serve, args=(sock, peer), name="kv-conn", daemon=True).start()

    def _reap_loop(self) -> None:
        while (expired := self._registry.wait_expired()) is not None:
            for reg in expired:
                self._stop_writes(reg)
                _call(reg.on_failed, reg.request_id, reg.ended)

    def _stop_writes(self, reg: Registration) -> None:
        """After ``reg`` was taken by a non-handler thread: cut its connection's reads and wait
        out an in-flight page write, so its blocks can be reused."""
        if reg.conn is not None:
            _shutdown(reg.conn, socket.SHUT_RD)  # recv returns EOF at once; the handler can still nack
        with reg.write_lock:
            pass

    # -- one connection ------------------------------------------------------------------------

    def _serve(self, sock: socket.socket, peer: object) -> None:
        conn = _Conn(sock)
        try:
            if self._secret is not None and not self._authenticate(sock, peer):
                return
            self._serve_frames(conn)
        except FrameError as e:
            if conn.reg is None and e.request_id is not None:
                try:  # fail the registered request the bad frame names, unless another connection feeds it
                    conn.reg = self._registry.bind(e.request_id, sock)
                except FrameError:
                    pass
            self._end(conn, f"bad frame: {e}", linger=True)
        except TimeoutError:
            self._end(conn, f"connection timed out after {self._io_timeout_s:g} s mid-transfer{_progress(conn)}")
        except OSError as e:  # PeerClosed included
            self._end(conn, f"connection closed mid-transfer{_progress(conn)}: {e}")
        except Exception as e:
            log.exception("KV receiver connection handler failed")
            self._end(conn, f"receiver error: {e!r}")
        finally:
            with self._conns_lock:
                self._conns.discard(sock)
            sock.close()

    def _authenticate(self, sock: socket.socket, peer: object) -> bool:
        """Run the handshake; on failure log it (never the secret) and count it. The caller closes."""
        assert self._secret is not None
        try:
            authenticate_sender(sock, self._secret, self._io_timeout_s)
        except HandshakeError as e:
            if self._stopping.is_set():  # cut by close(), not refused
                return False
            with self._conns_lock:
                self._num_refused += 1
            log.warning("KV receiver %s refused a connection from %s: %s", self._address, peer, e)
            return False
        sock.settimeout(self._io_timeout_s)
        return True

    def _serve_frames(self, conn: _Conn) -> None:
        """Handle frames until ``done``/``abort`` or a clean EOF of an idle connection."""
        while True:
            frame = read_frame(conn.sock)
            if frame is None:
                if conn.reg is None:
                    return
                raise PeerClosed("EOF before done")
            self._bind(conn, frame)
            if isinstance(frame, Pages):
                self._on_pages(conn, frame)
            elif isinstance(frame, Done):
                self._on_done(conn, frame)
                return
            else:
                self._on_abort(conn, frame)
                return

    def _bind(self, conn: _Conn, frame: Frame) -> None:
        if isinstance(frame, Ack):
            raise FrameError("unexpected ack frame from a sender", frame.request_id)
        if conn.reg is None:
            conn.reg = self._registry.bind(frame.request_id, conn.sock)
        elif frame.request_id != conn.reg.request_id:
            raise FrameError(f"frame for request {frame.request_id!r} on the connection of "
                             f"request {conn.reg.request_id!r}")

    def _on_pages(self, conn: _Conn, frame: Pages) -> None:
        reg = conn.reg
        assert reg is not None
        check_pages(frame, self._spec)
        foreign = [b for b in frame.block_ids if b not in reg.block_set]
        if foreign:
            raise FrameError(f"request {reg.request_id!r}: block ids {foreign[:16]} are not registered for it")
        with reg.write_lock:
            if not self._registry.is_live(reg):
                raise FrameError(f"request {reg.request_id!r} is no longer registered")
            for block in frame.block_ids:  # payload lands straight in the destination pages
                recv_exact_into(conn.sock, self._pages.page(block, frame.layer_start, frame.layer_end))
            self._registry.mark(reg, frame.block_ids, frame.layer_start, frame.layer_end)

    def _on_done(self, conn: _Conn, frame: Done) -> None:
        reg = conn.reg
        assert reg is not None
        taken, complete = self._registry.finish(reg)
        if not taken:
            raise FrameError(f"request {reg.request_id!r} is no longer registered")
        if complete:
            _call(reg.on_complete, reg.request_id, frame.first_token)
        else:
            _call(reg.on_failed, reg.request_id, reg.ended)
        self._send(conn.sock, Ack(reg.request_id, complete, "" if complete else reg.ended or ""))

    def _on_abort(self, conn: _Conn, frame: Abort) -> None:
        reg = conn.reg
        assert reg is not None
        why = f"aborted by sender: {frame.reason}"
        if self._registry.take(reg, why):
            _call(reg.on_failed, reg.request_id, why)

    def _end(self, conn: _Conn, why: str, linger: bool = False) -> None:
        """A connection failed with ``why``: fail its request (if this call takes it), nack, close."""
        reg = conn.reg
        if reg is not None and self._registry.take(reg, why):
            _call(reg.on_failed, reg.request_id, why)
            error = why
        elif reg is not None:  # ended elsewhere (cancel, deadline, close, an earlier done)
            error = f"request {reg.request_id!r} is no longer registered: {reg.ended}"
        elif linger:
            error = why
        else:
            return  # an idle connection broke: nobody to tell
        self._send(conn.sock, Ack(reg.request_id if reg else "", False, error))
        if linger:
            self._linger(conn.sock)

    def _send(self, sock: socket.socket, frame: Ack) -> None:
        try:
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
