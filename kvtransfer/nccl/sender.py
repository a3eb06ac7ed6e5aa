"""Prefill side of the NCCL KV transport: control frames over TCP, pages by ncclSend from the CUDA KV cache."""

from __future__ import annotations

import operator
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Sequence

import torch

from pdserve.cluster.secret import check_secret
from pdserve.kvtransfer.base import TransferError, TransferStats
from pdserve.kvtransfer.nccl.comms import CommCache, DevicePages, PairComm, check_cuda_cache
from pdserve.kvtransfer.nccl.control import SCHEME, Bye, ClearToSend, encode_control, expect, read_any
from pdserve.kvtransfer.nccl.handshake import negotiate_sender
from pdserve.kvtransfer.nccl.library import NcclError, NcclLibrary, load_library
from pdserve.kvtransfer.wire.channel import (
    MAX_BLOCKS_PER_FRAME,
    SocketChannel,
    SocketSender,
    check_send_args,
    parse_address,
)
from pdserve.kvtransfer.wire.frames import Ack, Done, FrameError, Pages, dtype_name, encode
from pdserve.kvtransfer.wire.handshake import authenticate_receiver
from pdserve.model.kv_cache import KVCacheSpec


class NcclKVChannel(SocketChannel):
    """One request's transfer: a control connection plus the pair's NCCL communicator.

    Every method closes the channel when it fails; :meth:`finish` and :meth:`abort` always do.
    :meth:`abort` from another thread while the owner is mid-call cuts the control connection; an
    ncclSend already posted still completes or times out (``io_timeout_s``) first.
    """

    _read_reply = staticmethod(read_any)

    def __init__(self, sock: socket.socket, request_id: str, address: str, pages: DevicePages, comm: PairComm,
                 io_timeout_s: float, started: float, on_close: Callable[[NcclKVChannel], None]) -> None:
        super().__init__(sock, request_id, address, pages.spec, io_timeout_s, started, on_close)
        self._pages, self._comm = pages, comm

    def send_pages(self, layer_range: tuple[int, int], src_block_ids: Sequence[int],
                   dst_block_ids: Sequence[int]) -> None:
        """Announce each chunk of pages on the control connection, wait for the receiver's clear-to-send,
        then ncclSend ``kv_cache[src, layer_start:layer_end]`` per block and wait for completion.

        Raises:
            ValueError: see :func:`check_send_args` (nothing is sent).
            TransferError: channel closed; the receiver refused (its reason included); the control
                connection or the NCCL send failed or timed out (the pair's communicator is then dropped).
        """
        ls, le, src, dst = check_send_args(self._spec, layer_range, src_block_ids, dst_block_ids)
        page_nbytes = self._spec.page_nbytes(le - ls)
        with self._io():
            for i in range(0, len(src), MAX_BLOCKS_PER_FRAME):
                src_part, dst_part = src[i:i + MAX_BLOCKS_PER_FRAME], dst[i:i + MAX_BLOCKS_PER_FRAME]
                frame = Pages(self.request_id, ls, le, tuple(dst_part), dtype_name(self._spec.dtype),
                              (len(dst_part), *self._spec.page_shape(le - ls)), len(dst_part) * page_nbytes)
                with self._comm.lock:
                    if self._comm.broken is not None:  # before the receiver commits to a receive
                        raise self._error(f"the pair's NCCL communicator is broken: {self._comm.broken}")
                    self._send(encode(frame), "sending a pages header")
                    self._expect_reply(ClearToSend, "the clear-to-send")
                    try:
                        self._comm.move(self._pages.buffers(src_part, ls, le), send=True,
                                        timeout_s=self._io_timeout_s)
                    except NcclError as e:
                        raise self._error(f"NCCL send failed: {e}") from e
                self._num_pages += len(src_part)
                self._num_bytes += frame.nbytes

    def finish(self, first_token: int) -> TransferStats:
        """Send ``done`` with ``first_token`` and wait up to ``io_timeout_s`` for the ack. Closes.

        Raises:
            TransferError: rejected (e.g. pages missing; the receiver's reason included), no answer in time,
                or the connection failed.
        """
        first_token = operator.index(first_token)
        with self._io():
            try:
                self._send(encode(Done(self.request_id, first_token)), "sending done")
                self._expect_reply(Ack, "the ack")
            finally:
                self._close()
            return TransferStats(self._num_pages, self._num_bytes, time.monotonic() - self._started)

    # -- internals -----------------------------------------------------------------------------

    def _send(self, data: bytes, what: str) -> None:
        try:
            self._sock.sendall(data)
        except OSError as e:
            raise self._error(f"{what} failed: {e!r}", self._read_refusal()) from e

    def _expect_reply(self, cls: type, what: str) -> object:
        try:
            reply = read_any(self._sock)
        except TimeoutError:
            raise self._error(f"no {what} within {self._io_timeout_s:g} s") from None
        except (OSError, FrameError) as e:
            raise self._error(f"reading {what} failed: {e!r}") from None
        if isinstance(reply, Ack) and not reply.ok:
            raise self._error("receiver refused the transfer", reply)
        try:
            return expect(reply, cls, self.request_id)
        except FrameError as e:
            raise self._error(str(e)) from None


class NcclKVSender(SocketSender):
    """Opens a control connection per request to an :class:`~kvtransfer.nccl.receiver.NcclKVReceiver` and
    sends pages of ``kv_cache`` over the pair's NCCL communicator, created on first use (this sender is
    rank 0 and makes the unique id) and cached per receiver address.

    Args:
        kv_cache: contiguous CUDA tensor of ``spec.shape`` and ``spec.dtype``; only read.
        spec: cache layout.
        connect_timeout_s: seconds :meth:`open` waits for the control connection.
        io_timeout_s: seconds a control reply or one NCCL send may take.
        init_timeout_s: seconds a communicator init may wait for the receiver.
        library: a loaded :class:`NcclLibrary`; None loads the wheel's.
        secret: cluster secret proved on every control connection (the HMAC handshake both transports
            share, :mod:`kvtransfer.wire.handshake`); None: no authentication.
        sender_id: how receivers know this sender's communicators (the hello's ``sender_id``); pass the
            worker id so decode workers can drop them once this worker leaves the registry
            (:meth:`NcclKVReceiver.evict_peers_except`). None: a random id, never evicted that way.
    Raises:
        ValueError: ``kv_cache`` is not a contiguous CUDA tensor matching ``spec``, or the secret is too short.
        NcclUnavailable: the NCCL library cannot be loaded.
    """

    keeps_peer_state = True

    def __init__(self, kv_cache: torch.Tensor, spec: KVCacheSpec, connect_timeout_s: float = 5.0,
                 io_timeout_s: float = 10.0, init_timeout_s: float = 30.0, library: NcclLibrary | None = None,
                 secret: bytes | None = None, sender_id: str | None = None) -> None:
        check_cuda_cache(kv_cache, spec)
        secret = check_secret(secret, "the KV sender's secret")
        self._lib = library or load_library()
        self._version = self._lib.version()
        self._pages = DevicePages(kv_cache, spec)
        self._comms = CommCache(self._lib, kv_cache.device, init_timeout_s)
        self.sender_id = sender_id or uuid.uuid4().hex
        self._init_channels(connect_timeout_s, io_timeout_s, secret)

    def open(self, request_id: str, dst_address: str) -> NcclKVChannel:
        """Connect to ``dst_address`` (``nccl://host:port`` or ``host:port``) for ``request_id``; on the first
        request to that receiver, create the pair's communicator (exchanging the unique id on the control
        connection).

        Raises:
            TransferError: cannot connect, the receiver refused (unknown request, version mismatch), the
                communicator init failed or timed out, or the sender is closed.
            ValueError: ``dst_address`` is malformed.
        """
        hostport = dst_address.removeprefix(SCHEME)
        host, port = parse_address(hostport)
        if self._closed:  # before the handshake, which could create a communicator
            raise TransferError(f"KV transfer of request {request_id!r}: sender is closed")
        started = time.monotonic()
        sock = self._connect(request_id, dst_address, host, port)
        try:
            if self._secret is not None:
                authenticate_receiver(sock, self._secret, self._connect_timeout_s)
            sock.settimeout(self._io_timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            comm = self._handshake(sock, request_id, hostport)
        except BaseException as e:
            sock.close()
            if isinstance(e, (OSError, FrameError, NcclError)):
                raise TransferError(f"KV transfer of request {request_id!r} to {dst_address}: {e}") from e
            raise
        channel = NcclKVChannel(sock, request_id, dst_address, self._pages, comm, self._io_timeout_s, started,
                                self._forget)
        self._adopt(channel)
        return channel

    def close(self) -> None:
        """Abort open channels ("sender closed"), tell each receiver to free the pair's communicator (best
        effort) and destroy the local ends; later :meth:`open` calls fail. Idempotent."""
        was_closed = self._abort_all()
        if was_closed:
            return
        for hostport in self._comms.keys():
            comm = self._comms.get(hostport)
            if comm is None:
                continue
            try:
                with socket.create_connection(parse_address(hostport), timeout=min(self._connect_timeout_s, 1.0)) as s:
                    if self._secret is not None:
                        authenticate_receiver(s, self._secret, min(self._connect_timeout_s, 1.0))
                    s.sendall(encode_control(Bye(comm.comm_id)))
            except OSError:
                pass  # the receiver is gone: its end died with it
        self._comms.close()

    def evict_peers_except(self, live_addresses: Iterable[str]) -> list[str]:
        """Abort and forget the communicators to receivers that left the registry: an address (``host:port``
        or ``nccl://host:port``) listed by an earlier call and not by this one. Returns the evicted addresses."""
        live = [a.removeprefix(SCHEME) for a in live_addresses]
        return self._comms.evict_peers_except(live, "the receiver left the registry")

    def _handshake(self, sock: socket.socket, request_id: str, hostport: str) -> PairComm:
        return negotiate_sender(sock, request_id, hostport, self._comms, self._version.code, self.sender_id,
                                self._lib.get_unique_id)
