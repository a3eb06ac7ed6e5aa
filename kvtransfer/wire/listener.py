"""Receiver plumbing shared by the TCP and NCCL KV transports: the listener, the accept loop, the
per-connection lifecycle (authentication, error-to-reason mapping, cleanup) and the deadline reaper.

A backend subclasses :class:`ListeningReceiver`, calls :meth:`ListeningReceiver._listen` from its
constructor and implements ``_serve_frames(conn)`` (read frames until the transfer ends) and
``_end(conn, why, linger)`` (fail the connection's request and nack), and sets ``_spec`` (the cache layout
announced pages are checked against). Errors raised by
``_serve_frames`` become the failure reason given to ``on_failed``, see :meth:`_failure_reason`.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.kvtransfer.base import KVReceiver, OnComplete, OnFailed
from pdserve.kvtransfer.wire.frames import Abort, Ack, Done, FrameError, Pages, check_pages
from pdserve.kvtransfer.wire.handshake import HandshakeError, authenticate_sender
from pdserve.kvtransfer.wire.pending import PendingTransfer, PendingTransfers

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Conn:
    """One accepted connection and the pending transfer its first frame names (None until then)."""

    sock: socket.socket
    transfer: PendingTransfer | None = None


def shutdown_quietly(sock: socket.socket, how: int) -> None:
    """``sock.shutdown(how)``, ignoring a socket that is already closed or never connected."""
    try:
        sock.shutdown(how)
    except OSError:
        pass


def call_quietly(fn: Callable[..., None], *args: object) -> None:
    """Run a user callback; an exception is logged, never raised (it must not kill a receiver thread)."""
    try:
        fn(*args)
    except Exception:
        log.exception("KV receiver callback %r raised", fn)


class ListeningReceiver(KVReceiver):
    """Base of the socket-listening KV receivers (see module doc). Not usable on its own.

    Class attributes name the backend in logs and failure reasons: ``_kind`` ("KV receiver"),
    ``_conn_kind`` ("connection" or "control connection") and ``_thread_prefix`` ("kv").
    """

    _kind = "KV receiver"
    _conn_kind = "connection"
    _thread_prefix = "kv"
    _conn_type: type[Conn] = Conn

    def _listen(self, host: str, port: int, io_timeout_s: float, secret: bytes | None,
                pending: PendingTransfers, scheme: str = "") -> None:
        """Bind ``host:port`` and start the accept and reaper threads (daemons).

        Raises:
            OSError: the address cannot be bound.
        """
        self._secret = secret
        self._io_timeout_s = io_timeout_s
        self._pending = pending
        self._num_refused = 0
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._stopping = threading.Event()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family)
        port = self._listener.getsockname()[1]
        self._address = scheme + (f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        prefix = self._thread_prefix
        self._threads = [threading.Thread(target=self._accept_loop, name=f"{prefix}-accept-{port}", daemon=True),
                         threading.Thread(target=self._reap_loop, name=f"{prefix}-reaper-{port}", daemon=True)]
        for thread in self._threads:
            thread.start()

    @property
    def address(self) -> str:
        """Where senders connect: ``host:port`` (``[host]:port`` for IPv6) with the bound port, after the
        backend's scheme prefix if it has one."""
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
        self._pending.add(request_id, block_ids, timeout_s, on_complete, on_failed)

    def cancel(self, request_id: str) -> None:
        """Forget ``request_id`` without a callback; its connection, if any, is cut and an in-flight write
        into its blocks is waited out. Idempotent."""
        transfer = self._pending.take_id(request_id, "cancelled by the receiver")
        if transfer is not None:
            self._stop_writes(transfer)

    def _stop(self) -> bool:
        """Shared part of ``close()``: stop listening, fail pending transfers ("receiver closed", on
        this thread), cut every connection, join the threads. Returns False if already stopped."""
        with self._conns_lock:
            if self._stopping.is_set():
                return False
            self._stopping.set()
            conns = list(self._conns)
        shutdown_quietly(self._listener, socket.SHUT_RDWR)  # wakes accept() (Linux)
        for transfer in self._pending.close():
            self._stop_writes(transfer)
            call_quietly(transfer.on_failed, transfer.request_id, transfer.ended)
        for sock in conns:
            shutdown_quietly(sock, socket.SHUT_RDWR)
        for thread in self._threads:
            if thread is not threading.current_thread():  # close() may run inside a reaper callback
                thread.join(timeout=1.0)
        self._listener.close()
        return True

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
            threading.Thread(target=self._serve, args=(sock, peer), name=f"{self._thread_prefix}-conn",
                             daemon=True).start()

    def _reap_loop(self) -> None:
        while (expired := self._pending.wait_expired()) is not None:
            for transfer in expired:
                self._stop_writes(transfer)
                call_quietly(transfer.on_failed, transfer.request_id, transfer.ended)

    def _stop_writes(self, transfer: PendingTransfer) -> None:
        """After ``transfer`` was taken by a non-handler thread: cut its connection's reads and wait
        out an in-flight page write, so its blocks can be reused."""
        if transfer.conn is not None:
            shutdown_quietly(transfer.conn, socket.SHUT_RD)  # recv returns EOF at once; the handler can still nack
        with transfer.write_lock:
            pass

    # -- one connection ------------------------------------------------------------------------

    def _serve(self, sock: socket.socket, peer: object) -> None:
        conn = self._conn_type(sock)
        try:
            if self._secret is not None and not self._authenticate(sock, peer):
                return
            self._serve_frames(conn)
        except FrameError as e:
            if conn.transfer is None and e.request_id is not None:
                try:  # fail the registered request the bad frame names, unless another connection feeds it
                    conn.transfer = self._pending.bind(e.request_id, sock)
                except FrameError:
                    pass
            self._end(conn, f"bad frame: {e}", linger=True)
        except Exception as e:
            self._end(conn, self._failure_reason(conn, e))
        finally:
            with self._conns_lock:
                self._conns.discard(sock)
            sock.close()

    def _failure_reason(self, conn: Conn, e: Exception) -> str:
        """The ``on_failed`` reason for a connection that died of ``e`` (not a :class:`FrameError`)."""
        if isinstance(e, TimeoutError):
            return (f"{self._conn_kind} timed out after {self._io_timeout_s:g} s mid-transfer"
                    f"{self._progress(conn)}")
        if isinstance(e, OSError):  # PeerClosed included
            return f"{self._conn_kind} closed mid-transfer{self._progress(conn)}: {e}"
        log.error("%s connection handler failed", self._kind, exc_info=e)
        return f"receiver error: {e!r}"

    def _progress(self, conn: Conn) -> str:
        """Suffix for failure reasons telling how far the transfer got ("" when unknown)."""
        return ""

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
            log.warning("%s %s refused a %s from %s: %s", self._kind, self._address, self._conn_kind, peer, e)
            return False
        sock.settimeout(self._io_timeout_s)
        return True

    def _take_failed(self, conn: Conn, why: str) -> str | None:
        """Fail ``conn``'s request with ``why`` if this call takes it. Returns the nack's error text:
        ``why``, or why the request is no longer registered; None when no request is bound."""
        transfer = conn.transfer
        if transfer is None:
            return None
        if self._pending.take(transfer, why):
            call_quietly(transfer.on_failed, transfer.request_id, why)
            return why
        return f"request {transfer.request_id!r} is no longer registered: {transfer.ended}"  # ended elsewhere

    def _check_pages(self, transfer: PendingTransfer, frame: Pages) -> None:
        """Raise :class:`FrameError` unless ``frame`` matches the cache layout and names only ``transfer``'s blocks."""
        check_pages(frame, self._spec)
        foreign = [b for b in frame.block_ids if b not in transfer.block_set]
        if foreign:
            raise FrameError(f"request {transfer.request_id!r}: block ids {foreign[:16]} are not registered for it")

    def _check_live(self, transfer: PendingTransfer) -> None:
        """Raise :class:`FrameError` if ``transfer`` was ended (cancel, deadline, close). Call it holding
        ``transfer.write_lock``."""
        if not self._pending.is_live(transfer):
            raise FrameError(f"request {transfer.request_id!r} is no longer registered: {transfer.ended}")

    def _finish(self, transfer: PendingTransfer, frame: Done) -> Ack:
        """``done`` arrived: end ``transfer``, run its callback and return the ack to send.

        Raises:
            FrameError: ``transfer`` was already ended elsewhere.
        """
        taken, complete = self._pending.finish(transfer)
        if not taken:
            raise FrameError(f"request {transfer.request_id!r} is no longer registered: {transfer.ended}")
        if complete:
            call_quietly(transfer.on_complete, transfer.request_id, frame.first_token)
        else:
            call_quietly(transfer.on_failed, transfer.request_id, transfer.ended)
        return Ack(transfer.request_id, complete, "" if complete else transfer.ended or "")

    def _on_abort(self, transfer: PendingTransfer, frame: Abort) -> None:
        """The sender gave up: fail ``transfer`` with its reason (if it is still registered)."""
        why = f"aborted by sender: {frame.reason}"
        if self._pending.take(transfer, why):
            call_quietly(transfer.on_failed, transfer.request_id, why)

    def _serve_frames(self, conn: Conn) -> None:
        raise NotImplementedError

    def _end(self, conn: Conn, why: str, linger: bool = False) -> None:
        raise NotImplementedError
