"""Receiver plumbing shared by the TCP and NCCL KV transports: the listener, the accept loop, the
per-connection lifecycle (authentication, error-to-reason mapping, cleanup) and the deadline reaper.

A backend subclasses :class:`ListeningReceiver`, calls :meth:`ListeningReceiver._listen` from its
constructor and implements ``_serve_frames(conn)`` (read frames until the transfer ends) and
``_end(conn, why, linger)`` (fail the connection's request and nack) with the frame actions of
:class:`~kvtransfer.wire.transfer_frames.TransferFrames`, and sets ``_spec`` (the cache layout announced pages
are checked against). Errors raised by
``_serve_frames`` become the failure reason given to ``on_failed``, see :meth:`_failure_reason`.

What a peer can make a receiver spend, and when it is dropped::

    accept      at most max_connections connections are served (one thread each). At the limit a new
                connection displaces the oldest one not yet bound to a request, which is told
                busy_ack(...) and closed; when every served connection feeds a transfer, the new one
                is told busy_ack(...) and closed instead. Both count in stats.num_refused_busy.
    unbound     the handshake (with a secret) and the first frame's header: within io_timeout_s of
                the accept, one deadline for all of it, however the peer spreads its bytes
    bound       each later frame's header within io_timeout_s of the wait for it starting, each page
                of a payload within io_timeout_s, the whole transfer within its registration's
                timeout (the reaper cuts it then)

A connection whose handler cannot start (e.g. a thread or PID limit) is told busy_ack(...) and closed
(stats.num_failed_starts); the accept loop goes on. Should the accept or reaper thread end anyway,
:attr:`ListeningReceiver.alive` turns False: the worker must leave the registry
(:meth:`cluster.worker_process.WorkerProcess.healthy`).
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from collections.abc import Iterable, Sequence

from pdserve.kvtransfer.base import KVReceiver, OnComplete, OnFailed
from pdserve.kvtransfer.wire.conn import (
    Conn,
    LogThrottle,
    ReceiverStats,
    call_quietly,
    refuse_quietly,
    shutdown_quietly,
)
from pdserve.kvtransfer.wire.frames import FrameError, busy_ack, encode
from pdserve.kvtransfer.wire.handshake import HandshakeError, authenticate_sender
from pdserve.kvtransfer.wire.pending import PendingTransfer, PendingTransfers
from pdserve.kvtransfer.wire.transfer_frames import TransferFrames

log = logging.getLogger(__name__)

DEFAULT_MAX_CONNECTIONS = 256
"""Connections a receiver serves at once unless told otherwise (one thread each)."""
LISTEN_BACKLOG = 1024  # connections the kernel queues for accept() (capped by net.core.somaxconn)
_LISTENER_GONE = {errno.EBADF, errno.EINVAL, errno.ENOTSOCK}  # accept() on a closed or shut-down listener


class _Displaced(Exception):
    """Raised in a handler whose connection the accept loop closed to make room."""


class ListeningReceiver(TransferFrames, KVReceiver):
    """Base of the socket-listening KV receivers (see module doc). Not usable on its own.

    Class attributes name the backend in logs and failure reasons: ``_kind`` ("KV receiver"),
    ``_conn_kind`` ("connection" or "control connection") and ``_thread_prefix`` ("kv").
    """

    _kind = "KV receiver"
    _conn_kind = "connection"
    _thread_prefix = "kv"
    _conn_type: type[Conn] = Conn
    keeps_peer_state = False
    """Whether the receiver caches state per sender (NCCL communicators) that :meth:`evict_peers_except` prunes."""

    def _listen(self, host: str, port: int, io_timeout_s: float, secret: bytes | None,
                pending: PendingTransfers, scheme: str = "",
                max_connections: int = DEFAULT_MAX_CONNECTIONS) -> None:
        """Bind ``host:port`` and start the accept and reaper threads (daemons).

        Raises:
            ValueError: ``max_connections < 1`` or ``io_timeout_s <= 0``.
            OSError: the address cannot be bound.
        """
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        if not io_timeout_s > 0:
            raise ValueError(f"io_timeout_s must be positive, got {io_timeout_s}")
        self._secret = secret
        self._io_timeout_s = io_timeout_s
        self._max_connections = max_connections
        self._pending = pending
        self._num_refused = 0
        self._num_busy = 0
        self._num_failed_starts = 0
        self._num_timed_out = 0
        self._num_displaced_open = 0  # displaced connections whose handler has not closed them yet
        self._throttle = LogThrottle()
        self._conns: dict[socket.socket, Conn] = {}  # in accept order: the first unbound one is the oldest
        self._conns_lock = threading.Lock()
        self._stopping = threading.Event()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
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

    @property
    def stats(self) -> ReceiverStats:
        """The receiver's connection counters (a consistent snapshot)."""
        with self._conns_lock:
            return ReceiverStats(len(self._conns), self._num_refused, self._num_busy, self._num_failed_starts,
                                 self._num_timed_out)

    @property
    def alive(self) -> bool:
        """True while the receiver can take transfers: not closed, and both its accept thread and its
        deadline reaper run. False means it never will again: its worker must stop advertising it
        (leave the registry) instead of letting senders wait on it."""
        return not self._stopping.is_set() and all(t.is_alive() for t in self._threads)

    def evict_peers_except(self, live_peer_ids: Iterable[str]) -> list[str]:
        """Drop per-peer state of senders that are no longer live (see the NCCL receiver); the TCP
        transport keeps none. Returns what was dropped."""
        return []

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
        try:
            while not self._stopping.is_set():
                try:
                    sock, peer = self._listener.accept()
                except OSError as e:
                    if self._stopping.is_set() or e.errno in _LISTENER_GONE:
                        return  # closed (or shut down under us: alive turns False)
                    self._warn("accept", "%s %s: accept failed (retrying): %r", self._kind, self._address, e)
                    self._stopping.wait(0.05)  # transient: EMFILE, ENFILE, ENOBUFS, ...
                    continue
                try:
                    self._admit(sock, peer)
                except Exception:  # a bug in admitting one connection must not stop the receiver
                    log.exception("%s %s: admitting a %s from %s failed", self._kind, self._address,
                                  self._conn_kind, peer)
                    with self._conns_lock:
                        self._conns.pop(sock, None)
                    sock.close()
        finally:
            if not self._stopping.is_set():
                log.error("%s %s stopped accepting connections: its worker must leave the registry",
                          self._kind, self._address)

    def _admit(self, sock: socket.socket, peer: object) -> None:
        """Serve ``sock`` on a new handler thread, within the connection limit (see module doc)."""
        conn = self._conn_type(sock, deadline=time.monotonic() + self._io_timeout_s)
        victim: Conn | None = None
        with self._conns_lock:
            if self._stopping.is_set():
                sock.close()
                return
            num_open = len(self._conns) - self._num_displaced_open
            if num_open >= self._max_connections:
                self._num_busy += 1
                victim = next((c for c in self._conns.values()
                               if c.transfer is None and not c.displaced and not c.ending), None)
                if victim is not None:
                    victim.displaced = True
                    self._num_displaced_open += 1
            if num_open < self._max_connections or victim is not None:
                self._conns[sock] = conn
        if num_open >= self._max_connections:
            self._warn("busy", "%s %s is at its limit of %d connections: %s", self._kind, self._address,
                       self._max_connections, "closing the oldest unbound one" if victim is not None
                       else f"refusing a {self._conn_kind} from {peer} (all feed transfers)")
            if victim is None:
                refuse_quietly(sock, busy_ack(f"all {self._max_connections} connections it serves feed "
                                              "transfers; try again later"))
                return
            shutdown_quietly(victim.sock, socket.SHUT_RD)  # its handler wakes, tells it busy_ack, closes
        try:
            sock.settimeout(self._io_timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn, peer), name=f"{self._thread_prefix}-conn",
                             daemon=True).start()
        except Exception as e:  # e.g. RuntimeError("can't start new thread") at a thread or PID limit
            with self._conns_lock:
                self._conns.pop(sock, None)
                self._num_failed_starts += 1
            self._warn("start", "%s %s cannot serve a %s from %s: %r", self._kind, self._address,
                       self._conn_kind, peer, e)
            refuse_quietly(sock, busy_ack(f"cannot serve a connection now ({e})"))

    def _reap_loop(self) -> None:
        while True:
            try:
                expired = self._pending.wait_expired()
                if expired is None:
                    return
                for transfer in expired:
                    self._stop_writes(transfer)
                    call_quietly(transfer.on_failed, transfer.request_id, transfer.ended)
            except Exception:  # keep enforcing deadlines: a leaked registration would hold its blocks
                log.exception("%s %s: deadline reaper failed (continuing)", self._kind, self._address)
                time.sleep(0.05)

    def _stop_writes(self, transfer: PendingTransfer) -> None:
        """After ``transfer`` was taken by a non-handler thread: cut its connection's reads and wait
        out an in-flight page write, so its blocks can be reused."""
        if transfer.conn is not None:
            shutdown_quietly(transfer.conn, socket.SHUT_RD)  # recv returns EOF at once; the handler can still nack
        with transfer.write_lock:
            pass

    def _warn(self, kind: str, msg: str, *args: object) -> None:
        held = self._throttle.ready(kind)
        if held is not None:
            log.warning(msg + (f" ({held} more like this since the last report)" if held else ""), *args)

    # -- one connection ------------------------------------------------------------------------

    def _bind_transfer(self, conn: Conn, request_id: str) -> PendingTransfer:
        """Bind ``conn`` to the pending transfer of ``request_id`` (sets ``conn.transfer``).

        Raises:
            FrameError: not registered, or already fed by another connection.
            _Displaced: the accept loop closed this connection to make room.
        """
        with self._conns_lock:  # excludes displacement: an unbound connection is displaced or bound, not both
            if conn.displaced:
                raise _Displaced
            conn.transfer = self._pending.bind(request_id, conn.sock)
            return conn.transfer

    def _displaced_at_end(self, conn: Conn) -> bool:
        """The handler is finishing: True if the accept loop displaced ``conn`` (then it has no
        transfer, and gets the busy nack); else mark it ``ending`` so that it never will be."""
        with self._conns_lock:
            conn.ending = not conn.displaced
            return conn.displaced

    def _serve(self, conn: Conn, peer: object) -> None:
        sock = conn.sock
        try:
            if self._secret is not None and not self._authenticate(conn, peer):
                return
            self._serve_frames(conn)
        except FrameError as e:
            if conn.transfer is None and e.request_id is not None:
                try:  # fail the registered request the bad frame names, unless another connection feeds it
                    self._bind_transfer(conn, e.request_id)
                except (FrameError, _Displaced):
                    pass
            if not self._displaced_at_end(conn):
                self._end(conn, f"bad frame: {e}", linger=True)
        except Exception as e:
            if self._displaced_at_end(conn):
                return  # closed to make room: told below
            if isinstance(e, TimeoutError):
                with self._conns_lock:
                    self._num_timed_out += 1
            self._end(conn, self._failure_reason(conn, e))
        finally:
            if self._displaced_at_end(conn):
                try:
                    sock.settimeout(1.0)
                    sock.sendall(encode(busy_ack(f"{self._max_connections} connections open; this one fed no "
                                                 "transfer yet and was closed to make room")))
                    sock.shutdown(socket.SHUT_WR)
                except (OSError, FrameError):
                    pass
            with self._conns_lock:
                if self._conns.pop(sock, None) is not None and conn.displaced:
                    self._num_displaced_open -= 1
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

    def _authenticate(self, conn: Conn, peer: object) -> bool:
        """Run the handshake by ``conn.deadline``; on failure log it (never the secret; throttled) and
        count it. The caller closes."""
        assert self._secret is not None
        try:
            authenticate_sender(conn.sock, self._secret, self._io_timeout_s, deadline=conn.deadline)
        except HandshakeError as e:
            if self._stopping.is_set() or self._displaced_at_end(conn):  # cut by close() or to make room
                return False
            with self._conns_lock:
                self._num_refused += 1
            self._warn("auth", "%s %s refused a %s from %s: %s", self._kind, self._address, self._conn_kind, peer, e)
            return False
        conn.sock.settimeout(self._io_timeout_s)
        return True

    def _serve_frames(self, conn: Conn) -> None:
        raise NotImplementedError

    def _end(self, conn: Conn, why: str, linger: bool = False) -> None:
        raise NotImplementedError
