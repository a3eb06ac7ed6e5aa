"""One accepted KV connection's state (:class:`Conn`), a receiver's counters (:class:`ReceiverStats`) and the
helpers the listener uses to close, refuse and call back without raising: what
:mod:`kvtransfer.wire.listener` keeps per connection and shares with the TCP and NCCL receivers."""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.kvtransfer.wire.frames import Ack, FrameError, encode
from pdserve.kvtransfer.wire.pending import PendingTransfer

log = logging.getLogger(__name__)

LOG_EVERY_S = 10.0  # repeated warnings (refusals, failed starts) are logged at most this often per kind


@dataclass(eq=False)
class Conn:
    """One accepted connection and the pending transfer its first frame names (None until then).

    ``deadline`` (``time.monotonic()``) bounds the unbound phase: handshake and first frame header.
    ``displaced`` is set, under the receiver's connection lock, when the accept loop closes the
    connection to make room; a displaced connection is never bound to a request. ``ending`` is set
    (same lock) once its handler is finishing: it is not displaced any more.
    """

    sock: socket.socket
    transfer: PendingTransfer | None = None
    deadline: float = math.inf
    displaced: bool = False
    ending: bool = False


@dataclass(frozen=True)
class ReceiverStats:
    """Counters of one receiver since it started.

    Attributes:
        num_open: connections being served now.
        num_refused_auth: connections closed because the peer failed the authentication handshake.
        num_refused_busy: connections told :func:`~kvtransfer.wire.frames.busy_ack` at the connection
            limit (refused at once, or displaced while unbound).
        num_failed_starts: connections told ``busy_ack`` because their handler could not start.
        num_timed_out: connections dropped because a frame (or a page) missed its deadline.
    """

    num_open: int
    num_refused_auth: int
    num_refused_busy: int
    num_failed_starts: int
    num_timed_out: int


class LogThrottle:
    """At most one log line per kind every ``LOG_EVERY_S`` seconds; counts what it held back."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def ready(self, kind: str) -> int | None:
        """None: do not log now; else the number of lines held back since the last one."""
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(kind, -math.inf) < LOG_EVERY_S:
                self._held[kind] = self._held.get(kind, 0) + 1
                return None
            self._last[kind] = now
            return self._held.pop(kind, 0)


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


def refuse_quietly(sock: socket.socket, ack: Ack) -> None:
    """Tell the peer of a connection nobody serves ``ack`` and close it, without ever blocking:
    drain what it already sent (so closing does not reset the connection before the nack is
    read), send the nack into the empty send buffer, half-close, close. Never raises."""
    try:
        sock.setblocking(False)
        try:
            for _ in range(16):  # at most 1 MiB: a peer that keeps sending gets a reset instead
                if not sock.recv(65536):
                    break
        except OSError:
            pass
        sock.send(encode(ack))
        sock.shutdown(socket.SHUT_WR)
    except (OSError, FrameError):
        pass
    finally:
        sock.close()
