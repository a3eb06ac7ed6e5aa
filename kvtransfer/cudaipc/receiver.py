"""Decode side of the CUDA IPC KV transport: a TCP control listener; pages are copied device to device
from the sender's mapped cache into the local one (:mod:`.handles`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from pdserve.cluster.secret import check_secret
from pdserve.kvtransfer.cudaipc.control import SCHEME, CacheShare, IpcHello, IpcPages, expect, read_any
from pdserve.kvtransfer.cudaipc.handles import PeerCacheError, PeerCaches, copy_pages, open_peer_cache
from pdserve.kvtransfer.tcp.pages import check_cache
from pdserve.kvtransfer.tcp.receiver import TcpKVReceiver
from pdserve.kvtransfer.wire.conn import Conn
from pdserve.kvtransfer.wire.frames import Abort, Done, FrameError, Pages, PeerClosed, dtype_name
from pdserve.kvtransfer.wire.listener import DEFAULT_MAX_CONNECTIONS
from pdserve.kvtransfer.wire.pending import PendingTransfers
from pdserve.model.kv_cache import KVCacheSpec


@dataclass(eq=False)
class IpcConn(Conn):
    """A control connection, plus the sender's mapped cache once its hello is accepted."""

    peer: torch.Tensor | None = None


class CudaIpcKVReceiver(TcpKVReceiver):
    """Accepts control connections on ``host:port``; each request's pages are copied from its sender's
    cache, mapped through CUDA IPC, straight into ``kv_cache``.

    Same contract, threads, limits and authentication as :class:`kvtransfer.tcp.TcpKVReceiver` (whose
    nack-and-linger it shares). A page list is checked in full (destination blocks registered for the
    request, source blocks inside the sender's cache, same count) before anything is copied, and the
    copy has finished before the next frame is read, so a failure callback never races a write. The
    mapping of a sender's cache is kept per sender id and dropped when that worker leaves the registry
    (:meth:`evict_peers_except`, called from the worker's heartbeat), freeing a dead worker's memory.

    Args:
        kv_cache: contiguous tensor ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` of
            ``spec.dtype`` (a CUDA one: the default ``open_peer`` maps CUDA memory only).
        spec: cache layout; a sender's cache must have the same pages (its block count may differ).
        host / port / io_timeout_s / secret / max_connections: as for the TCP receiver.
        open_peer: maps a sender's checked :class:`~.control.CacheShare` (default: CUDA IPC).
    Raises:
        ValueError: ``kv_cache`` does not match ``spec`` or is not contiguous; the secret is too short;
            ``max_connections < 1``.
        OSError: the address cannot be bound.
    """

    _kind = "CUDA IPC KV receiver"
    _conn_kind = "control connection"
    _thread_prefix = "ipc-kv"
    _conn_type = IpcConn
    keeps_peer_state = True

    def __init__(self, kv_cache: torch.Tensor, spec: KVCacheSpec, host: str = "127.0.0.1", port: int = 0,
                 io_timeout_s: float = 10.0, secret: bytes | None = None,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 open_peer: Callable[[CacheShare, KVCacheSpec], torch.Tensor] = open_peer_cache) -> None:
        check_cache(kv_cache, spec)
        secret = check_secret(secret, "the KV receiver's secret")
        self._cache = kv_cache
        self._spec = spec
        self._peers = PeerCaches(spec, open_peer)
        self._listen(host, port, io_timeout_s, secret, PendingTransfers(spec.num_blocks, spec.num_layers), SCHEME,
                     max_connections)

    def close(self) -> None:
        """Stop listening, fail pending transfers (``"receiver closed"``, on this thread), cut every
        connection and drop the mapped caches. Idempotent."""
        if self._stop():
            self._peers.clear()

    def evict_peers_except(self, live_peer_ids: Iterable[str]) -> list[str]:
        """Drop the mapped caches of senders that left the registry (see
        :meth:`kvtransfer.cudaipc.handles.PeerCaches.evict_peers_except`). Returns the sender ids dropped."""
        return self._peers.evict_peers_except(live_peer_ids)

    def _serve_frames(self, conn: IpcConn) -> None:
        first = read_any(conn.sock, conn.deadline)
        if first is None:
            return
        hello = expect(first, IpcHello)
        self._bind_transfer(conn, hello.request_id)
        try:
            conn.peer = self._peers.get(hello.sender_id, hello)   # an IpcHello is the sender's CacheShare
        except PeerCacheError as e:
            raise FrameError(f"request {hello.request_id!r}: {e}", hello.request_id) from None
        while True:
            frame = read_any(conn.sock, time.monotonic() + self._io_timeout_s)
            if frame is None:
                raise PeerClosed("EOF before done")
            if getattr(frame, "request_id", None) != hello.request_id or not isinstance(frame, IpcPages | Done | Abort):
                raise FrameError(f"unexpected {frame!r} on the control connection of request {hello.request_id!r}",
                                 hello.request_id)
            if isinstance(frame, IpcPages):
                self._copy(conn, frame)
            elif isinstance(frame, Done):
                self._send(conn.sock, self._finish(conn.transfer, frame))
                return
            else:
                self._on_abort(conn.transfer, frame)
                return

    def _copy(self, conn: IpcConn, frame: IpcPages) -> None:
        transfer, peer, spec = conn.transfer, conn.peer, self._spec
        rid, ls, le, src, dst = (frame.request_id, frame.layer_start, frame.layer_end, frame.src_block_ids,
                                 frame.dst_block_ids)
        if not all(type(b) is int for b in (*src, *dst)) or len(src) != len(dst):
            raise FrameError(f"request {rid!r}: src_block_ids and dst_block_ids must be int lists of one length "
                             f"(got {len(src)} and {len(dst)})", rid)
        pages = Pages(rid, ls, le, tuple(dst), dtype_name(spec.dtype), (len(dst), *spec.page_shape(max(le - ls, 0))),
                      len(dst) * spec.page_nbytes(max(le - ls, 0)))
        self._check_pages(transfer, pages)  # destination blocks registered, layers in range
        outside = [b for b in src if not 0 <= b < peer.shape[0]]
        if outside:
            raise FrameError(f"request {rid!r}: source block ids {outside[:16]} are outside the sender's "
                             f"{peer.shape[0]} blocks", rid)
        with transfer.write_lock:
            self._check_live(transfer)
            copy_pages(peer, self._cache, src, dst, ls, le)
            self._pending.mark(transfer, dst, ls, le)
