"""Prefill side of the CUDA IPC KV transport: control frames over TCP; the receiver copies the pages out
of this worker's cache, which it maps once through the handle each connection's hello carries."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict

import torch

from pdserve.cluster.secret import check_secret
from pdserve.kvtransfer.base import TransferError
from pdserve.kvtransfer.cudaipc.control import SCHEME, CacheShare, IpcHello, IpcPages, encode_control
from pdserve.kvtransfer.cudaipc.handles import export_cache
from pdserve.kvtransfer.tcp.pages import check_cache
from pdserve.kvtransfer.tcp.sender import TcpKVChannel, TcpKVSender
from pdserve.kvtransfer.wire.channel import MAX_BLOCKS_PER_FRAME, SocketChannel, check_send_args
from pdserve.model.kv_cache import KVCacheSpec


class CudaIpcKVChannel(TcpKVChannel):
    """One request's transfer: page lists over its control connection; made by :meth:`CudaIpcKVSender.open`.
    Closing, aborting and :meth:`finish` (``done``, then the receiver's ack) are the TCP channel's."""

    def __init__(self, sock, request_id: str, address: str, kv_cache: torch.Tensor, spec: KVCacheSpec,
                 io_timeout_s: float, started: float, on_close: Callable[[TcpKVChannel], None]) -> None:
        SocketChannel.__init__(self, sock, request_id, address, spec, io_timeout_s, started, on_close)
        self._cache = kv_cache

    def send_pages(self, layer_range: tuple[int, int], src_block_ids: Sequence[int],
                   dst_block_ids: Sequence[int]) -> None:
        """Have the receiver copy ``kv_cache[src, layer_start:layer_end]`` into its matching destination
        blocks. The device is synchronized first, so kernels still writing these pages have finished
        before the receiver reads them; the receiver's copy has finished when :meth:`finish` returns.
        An empty block list sends nothing.

        Raises:
            ValueError: bad layer range; lengths differ; source id outside ``[0, num_blocks)``;
                destination ids negative or repeated.
            TransferError: the channel is closed, the connection failed or timed out, or the receiver
                refused an earlier frame.
        """
        ls, le, src, dst = check_send_args(self._spec, layer_range, src_block_ids, dst_block_ids)
        if not src:
            return
        if self._cache.device.type == "cuda":
            torch.cuda.synchronize(self._cache.device)
        with self._io():
            for i in range(0, len(src), MAX_BLOCKS_PER_FRAME):
                src_part, dst_part = src[i:i + MAX_BLOCKS_PER_FRAME], dst[i:i + MAX_BLOCKS_PER_FRAME]
                self._raise_if_refused()
                try:
                    self._sock.sendall(encode_control(IpcPages(self.request_id, ls, le, src_part, dst_part)))
                except OSError as e:
                    raise self._error(f"sending pages failed: {e!r}", self._read_refusal()) from e
                self._num_pages += len(src_part)
                self._num_bytes += len(src_part) * self._spec.page_nbytes(le - ls)


class CudaIpcKVSender(TcpKVSender):
    """Opens one control connection per request to a :class:`~.receiver.CudaIpcKVReceiver` and shares
    ``kv_cache`` with it (exported once, on the first :meth:`open`).

    Args:
        kv_cache: contiguous CUDA tensor ``[num_blocks, num_layers, 2, block_size, num_kv_heads,
            head_dim]`` of ``spec.dtype``; only read (by the receivers).
        spec: cache layout.
        connect_timeout_s / io_timeout_s / secret: as for :class:`kvtransfer.tcp.TcpKVSender`.
        sender_id: how receivers know this sender's cache across requests (the prefill worker's id, so
            a receiver unmaps it once the worker leaves the registry); None: a random id.
        export: shares the cache (default :func:`~.handles.export_cache`).
    Raises:
        ValueError: ``kv_cache`` does not match ``spec`` or is not contiguous; the secret is too short.
    """

    def __init__(self, kv_cache: torch.Tensor, spec: KVCacheSpec, connect_timeout_s: float = 5.0,
                 io_timeout_s: float = 10.0, secret: bytes | None = None, sender_id: str | None = None,
                 export: Callable[[torch.Tensor], CacheShare] = export_cache) -> None:
        check_cache(kv_cache, spec)
        self._cache = kv_cache
        self._spec = spec
        self.sender_id = sender_id or uuid.uuid4().hex
        self._export = export
        self._share: CacheShare | None = None
        self._share_lock = threading.Lock()
        self._init_channels(connect_timeout_s, io_timeout_s, check_secret(secret, "the KV sender's secret"))

    def open(self, request_id: str, dst_address: str) -> CudaIpcKVChannel:
        """Connect to ``dst_address`` (``cuda-ipc://host:port``) for ``request_id``, authenticate with a
        secret, and send the hello that shares the cache.

        Raises:
            TransferError: the cache cannot be shared; cannot connect within ``connect_timeout_s``; the
                handshake failed; the hello could not be sent; or the sender is closed.
            ValueError: ``dst_address`` is not ``cuda-ipc://host:port``.
        """
        if not dst_address.startswith(SCHEME):
            raise ValueError(f"a CUDA IPC KV address is '{SCHEME}host:port', got {dst_address!r}")
        share = self._shared(request_id)
        started = time.monotonic()
        sock = self._open_socket(request_id, dst_address, dst_address.removeprefix(SCHEME))
        try:
            sock.sendall(encode_control(IpcHello(**asdict(share), request_id=request_id, sender_id=self.sender_id)))
        except OSError as e:
            sock.close()
            raise TransferError(f"KV transfer of request {request_id!r} to {dst_address}: sending the hello "
                                f"failed: {e!r}") from e
        channel = CudaIpcKVChannel(sock, request_id, dst_address, self._cache, self._spec, self._io_timeout_s,
                                   started, self._forget)
        self._adopt(channel)
        return channel

    def _shared(self, request_id: str) -> CacheShare:
        with self._share_lock:
            if self._share is None:
                try:
                    self._share = self._export(self._cache)
                except (RuntimeError, ValueError) as e:
                    raise TransferError(f"KV transfer of request {request_id!r}: the KV cache cannot be shared "
                                        f"through CUDA IPC: {e}") from None
            return self._share
