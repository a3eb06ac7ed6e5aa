"""Sender plumbing shared by the TCP and NCCL KV transports: receiver addresses and argument checks, the
per-request channel's lock/close/abort/error handling, and the sender's connect + channel bookkeeping.

A backend channel subclasses :class:`SocketChannel` and sets ``_read_reply`` (how to read one frame
header from the socket); a backend sender subclasses :class:`SocketSender`.
"""

from __future__ import annotations

import operator
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

from pdserve.kvtransfer.base import KVChannel, KVSender, TransferError
from pdserve.kvtransfer.wire.frames import Abort, Ack, FrameError, encode
from pdserve.model.kv_cache import KVCacheSpec

MAX_BLOCKS_PER_FRAME = 4096  # keeps a pages header (~5 bytes per id) far below the 64 KiB header limit
REFUSAL_WAIT_S = 1.0  # how long to look for the receiver's nack after a send fails


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6host]:port"`` -> (host, port).

    Raises:
        ValueError: no port, or the port is not an integer in [1, 65535].
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"KV address must be 'host:port', got {address!r}")
    return host.removeprefix("[").removesuffix("]"), int(port)


def check_send_args(spec: KVCacheSpec, layer_range: tuple[int, int], src: Sequence[int],
                    dst: Sequence[int]) -> tuple[int, int, list[int], list[int]]:
    """Validate :meth:`KVChannel.send_pages` arguments against the local cache; returns them as ints.

    Raises:
        ValueError: bad layer range, lengths differ, source id out of range, destination ids negative or repeated.
    """
    try:
        ls, le = (operator.index(x) for x in layer_range)
    except (TypeError, ValueError):
        raise ValueError(f"layer_range must be (start, end) ints, got {layer_range!r}") from None
    if not 0 <= ls < le <= spec.num_layers:
        raise ValueError(f"layer_range {layer_range!r} is empty or outside [0, {spec.num_layers})")
    src_ids, dst_ids = [operator.index(b) for b in src], [operator.index(b) for b in dst]
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks but {len(dst_ids)} destination blocks")
    if any(not 0 <= b < spec.num_blocks for b in src_ids):
        raise ValueError(f"source block ids {src_ids} outside [0, {spec.num_blocks})")
    if any(b < 0 for b in dst_ids) or len(set(dst_ids)) != len(dst_ids):
        raise ValueError(f"destination block ids must be distinct and non-negative, got {dst_ids}")
    return ls, le, src_ids, dst_ids


class SocketChannel(KVChannel):
    """Base of a request's transfer over one connection (see module doc).

    Every I/O method runs inside :meth:`_io`, which closes the channel when it fails; :meth:`abort`
    may be called from another thread: if the owner thread is mid-I/O the connection is cut instead
    and the owner's call raises :class:`TransferError`.
    """

    _read_reply: ClassVar[Callable[[socket.socket], Any]]

    def __init__(self, sock: socket.socket, request_id: str, address: str, spec: KVCacheSpec,
                 io_timeout_s: float, started: float, on_close: Callable[[Any], None]) -> None:
        self.request_id = request_id
        self.address = address
        self._sock = sock
        self._spec = spec
        self._io_timeout_s = io_timeout_s
        self._started = started
        self._on_close = on_close
        self._lock = threading.Lock()  # held for each I/O call
        self._closed = False
        self._num_pages = 0
        self._num_bytes = 0

    def abort(self, reason: str) -> None:
        """Send ``abort`` (best effort, never raises) and close."""
        if not self._lock.acquire(blocking=False):  # owner thread is mid-I/O: cut it off
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        try:
            if self._closed:
                return
            try:
                self._sock.settimeout(min(self._io_timeout_s, REFUSAL_WAIT_S))
                self._sock.sendall(encode(Abort(self.request_id, str(reason)[:1024])))
            except (OSError, FrameError):
                pass
            self._close()
        finally:
            self._lock.release()

    @contextmanager
    def _io(self) -> Iterator[None]:
        """Hold the channel lock, refuse a closed channel, close the channel on any error."""
        with self._lock:
            if self._closed:
                raise self._error("channel is closed")
            try:
                yield
            except BaseException:
                self._close()
                raise

    def _read_refusal(self) -> Ack | None:
        """Best effort: the nack the receiver sent before closing, if it arrives soon."""
        try:
            self._sock.settimeout(min(self._io_timeout_s, REFUSAL_WAIT_S))
            reply = type(self)._read_reply(self._sock)
        except (OSError, FrameError):
            return None
        return reply if isinstance(reply, Ack) else None

    def _error(self, cause: str, reply: Ack | None = None) -> TransferError:
        if reply is not None and not reply.ok:
            cause = f"{cause}: {reply.error}"
        return TransferError(f"KV transfer of request {self.request_id!r} to {self.address}: {cause}")

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sock.close()
            self._on_close(self)


class SocketSender(KVSender):
    """Base of the KV senders: per-request connections and the set of open channels."""

    keeps_peer_state = False
    """Whether the sender caches state per receiver (NCCL communicators) that :meth:`evict_peers_except` prunes."""

    def _init_channels(self, connect_timeout_s: float, io_timeout_s: float, secret: bytes | None) -> None:
        self._secret = secret
        self._connect_timeout_s = connect_timeout_s
        self._io_timeout_s = io_timeout_s
        self._channels: set[SocketChannel] = set()
        self._lock = threading.Lock()
        self._closed = False

    def _connect(self, request_id: str, dst_address: str, host: str, port: int) -> socket.socket:
        """TCP connection to ``(host, port)`` within ``connect_timeout_s``.

        Raises:
            TransferError: cannot connect (the message names ``dst_address`` and the timeout).
        """
        try:
            return socket.create_connection((host, port), timeout=self._connect_timeout_s)
        except OSError as e:
            raise TransferError(f"KV transfer of request {request_id!r}: cannot connect to {dst_address} "
                                f"within {self._connect_timeout_s:g} s: {e!r}") from e

    def evict_peers_except(self, live_addresses: Iterable[str]) -> list[str]:
        """Drop per-receiver state of receivers no longer live (see the NCCL sender); the TCP transport
        keeps none. Returns what was dropped."""
        return []

    def _adopt(self, channel: SocketChannel) -> None:
        """Track ``channel`` so :meth:`_abort_all` reaches it.

        Raises:
            TransferError: the sender was closed meanwhile (the channel's socket is closed).
        """
        with self._lock:
            if not self._closed:
                self._channels.add(channel)
                return
        channel._sock.close()
        raise TransferError(f"KV transfer of request {channel.request_id!r}: sender is closed")

    def _abort_all(self) -> bool:
        """Mark closed and abort every open channel ("sender closed"). Returns True if already closed."""
        with self._lock:
            was_closed, self._closed = self._closed, True
            channels = list(self._channels)
        for channel in channels:
            channel.abort("sender closed")
        return was_closed

    def _forget(self, channel: SocketChannel) -> None:
        with self._lock:
            self._channels.discard(channel)
