"""Prefill side of the TCP KV transport: streams KV pages from the local cache, zero-copy from a CPU
cache, through a host staging buffer from a GPU's (:mod:`kvtransfer.tcp.pages`).

With a cluster secret, every connection first runs the mutual handshake of
:mod:`kvtransfer.wire.handshake`, and :meth:`TcpKVSender.open` fails unless the receiver
proves that it holds the secret too: pages never go to an impostor.
"""

from __future__ import annotations

import operator
import select
import socket
import time
from collections.abc import Callable, Sequence

import torch

from pdserve.cluster.secret import check_secret
from pdserve.kvtransfer.base import TransferError, TransferStats
from pdserve.kvtransfer.tcp.pages import PageMemory, StagedPageMemory, page_memory
from pdserve.kvtransfer.wire.channel import (
    MAX_BLOCKS_PER_FRAME,
    SocketChannel,
    SocketSender,
    check_send_args,
    parse_address,
)
from pdserve.kvtransfer.wire.frames import Ack, Done, FrameError, Pages, dtype_name, encode, read_frame
from pdserve.kvtransfer.wire.handshake import HandshakeError, authenticate_receiver
from pdserve.model.kv_cache import KVCacheSpec


class TcpKVChannel(SocketChannel):
    """One request's transfer over one TCP connection; made by :meth:`TcpKVSender.open`.

    Every method closes the socket when it fails; :meth:`finish` and :meth:`abort`
    always close it. :meth:`abort` may be called from another thread (the sender's
    :meth:`TcpKVSender.close` does): if the owner thread is mid-I/O the connection is
    cut instead and the owner's call raises :class:`TransferError`.
    """

    _read_reply = staticmethod(read_frame)

    def __init__(self, sock: socket.socket, request_id: str, address: str, pages: PageMemory | StagedPageMemory,
                 io_timeout_s: float, started: float, on_close: Callable[[TcpKVChannel], None]) -> None:
        super().__init__(sock, request_id, address, pages.spec, io_timeout_s, started, on_close)
        self._pages = pages

    def send_pages(self, layer_range: tuple[int, int], src_block_ids: Sequence[int],
                   dst_block_ids: Sequence[int]) -> None:
        """Send ``kv_cache[src, layer_start:layer_end]`` for each source block, to land in the
        receiver's matching destination block. An empty block list sends nothing.

        Raises:
            ValueError: bad layer range; lengths differ; source id outside ``[0, num_blocks)``;
                destination ids negative or repeated.
            TransferError: the channel is closed, the connection failed or timed out,
                or the receiver refused an earlier frame.
        """
        ls, le, src, dst = check_send_args(self._spec, layer_range, src_block_ids, dst_block_ids)
        page_nbytes = self._spec.page_nbytes(le - ls)
        with self._io():
            for i in range(0, len(src), MAX_BLOCKS_PER_FRAME):
                src_part, dst_part = src[i:i + MAX_BLOCKS_PER_FRAME], dst[i:i + MAX_BLOCKS_PER_FRAME]
                self._raise_if_refused()
                frame = Pages(self.request_id, ls, le, tuple(dst_part), dtype_name(self._spec.dtype),
                              (len(dst_part), *self._spec.page_shape(le - ls)), len(dst_part) * page_nbytes)
                try:
                    self._sock.sendall(encode(frame))
                    for view in self._pages.read(src_part, ls, le):  # the cache's memory, or a staged copy
                        self._sock.sendall(view)
                except OSError as e:
                    raise self._error(f"sending pages failed: {e!r}", self._read_refusal()) from e
                self._num_pages += len(src_part)
                self._num_bytes += frame.nbytes

    def finish(self, first_token: int) -> TransferStats:
        """Send ``done`` with ``first_token`` and wait up to ``io_timeout_s`` for the ack. Closes.

        Returns:
            Pages and payload bytes sent, and seconds from :meth:`TcpKVSender.open` to the ack.
        Raises:
            TransferError: the receiver rejected the transfer (its error text is included),
                did not answer in time, or the connection failed.
        """
        first_token = operator.index(first_token)
        with self._io():
            try:
                self._sock.sendall(encode(Done(self.request_id, first_token)))
            except OSError as e:
                raise self._error(f"sending done failed: {e!r}", self._read_refusal()) from e
            try:
                reply = read_frame(self._sock)
            except TimeoutError:
                raise self._error(f"no ack within {self._io_timeout_s:g} s") from None
            except (OSError, FrameError) as e:
                raise self._error(f"reading the ack failed: {e!r}") from None
            finally:
                self._close()
            if isinstance(reply, Ack) and not reply.ok:  # also a connection-level refusal (no request id)
                raise self._error("receiver rejected the transfer", reply)
            if not isinstance(reply, Ack) or reply.request_id != self.request_id:
                raise self._error(f"invalid reply to done: {reply!r}")
            return TransferStats(self._num_pages, self._num_bytes, time.monotonic() - self._started)

    # -- internals -----------------------------------------------------------------------------

    def _raise_if_refused(self) -> None:
        """The receiver only speaks early to refuse: if it has, raise with its reason."""
        poller = select.poll()  # not select.select: fds above 1024 are fine
        poller.register(self._sock, select.POLLIN)
        if poller.poll(0):
            raise self._error("receiver refused the transfer", self._read_refusal())


class TcpKVSender(SocketSender):
    """Opens one TCP connection per request to a :class:`TcpKVReceiver` and sends pages of ``kv_cache``.

    Args:
        kv_cache: contiguous tensor ``[num_blocks, num_layers, 2, block_size, num_kv_heads,
            head_dim]`` of ``spec.dtype``; only read: in place on the CPU, staged through host memory on a GPU.
        spec: cache layout.
        connect_timeout_s: seconds :meth:`open` may take: the TCP connect, then (with a
            secret) the authentication handshake, each within this bound.
        io_timeout_s: seconds any single send or the wait for the ack may take.
        secret: cluster secret (at least 16 bytes) that receivers must prove they hold;
            None: no authentication.
    Raises:
        ValueError: ``kv_cache`` does not match ``spec``; the secret is too short or its
            environment variable is unusable.
    """

    def __init__(self, kv_cache: torch.Tensor, spec: KVCacheSpec, connect_timeout_s: float = 5.0,
                 io_timeout_s: float = 10.0, secret: bytes | None = None) -> None:
        secret = check_secret(secret, "the KV sender's secret")
        self._pages = page_memory(kv_cache, spec)
        self._init_channels(connect_timeout_s, io_timeout_s, secret)

    @property
    def authenticated(self) -> bool:
        """True when every connection runs the mutual handshake (a secret is configured)."""
        return self._secret is not None

    def open(self, request_id: str, dst_address: str) -> TcpKVChannel:
        """Connect to ``dst_address`` ("host:port") for ``request_id`` and, with a secret,
        authenticate both ways before anything else is sent.

        Raises:
            TransferError: cannot connect within ``connect_timeout_s``; the handshake failed
                (the receiver refused our proof, its own proof is wrong, or it did not answer
                in time; the message says which); or the sender is closed.
            ValueError: ``dst_address`` is not "host:port".
        """
        started = time.monotonic()
        sock = self._open_socket(request_id, dst_address, dst_address)
        channel = TcpKVChannel(sock, request_id, dst_address, self._pages, self._io_timeout_s, started,
                               self._forget)
        self._adopt(channel)
        return channel

    def _open_socket(self, request_id: str, dst_address: str, hostport: str) -> socket.socket:
        """A connection to ``hostport`` ("host:port"), authenticated both ways with a secret, set to
        ``io_timeout_s`` with Nagle off.

        Raises:
            TransferError: cannot connect, or the handshake failed (see :meth:`open`).
            ValueError: ``hostport`` is not "host:port".
        """
        host, port = parse_address(hostport)
        sock = self._connect(request_id, dst_address, host, port)
        if self._secret is not None:
            try:
                authenticate_receiver(sock, self._secret, self._connect_timeout_s)
            except HandshakeError as e:
                sock.close()
                raise TransferError(f"KV transfer of request {request_id!r}: authentication with {dst_address} "
                                    f"failed: {e}") from None
        sock.settimeout(self._io_timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def close(self) -> None:
        """Abort every open channel (reason "sender closed"); later :meth:`open` calls fail. Idempotent."""
        self._abort_all()
