"""Decode side of the NCCL KV transport: a TCP control listener; pages arrive by ncclRecv into the CUDA KV cache."""

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
from kvtransfer.nccl.comms import CommCache, DevicePages, PairComm, check_cuda_cache
from kvtransfer.nccl.control import SCHEME, Bye, ClearToSend, Hello, Welcome, encode_control, expect, read_any
from kvtransfer.nccl.handshake import negotiate_receiver
from kvtransfer.nccl.library import NcclError, NcclLibrary, load_library
from kvtransfer.tcp.frames import Abort, Ack, Done, FrameError, Pages, PeerClosed, check_pages, encode
from kvtransfer.tcp.handshake import HandshakeError, authenticate_sender
from kvtransfer.tcp.registry import Registration, Registry
from model.kv_cache import KVCacheSpec

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    reg: Registration | None = None
    comm: PairComm | None = None


def _call(fn: Callable[..., None], *args: object) -> None:
    try:
        fn(*args)
    except Exception:  # a callback must not kill a receiver thread
        log.exception("KV receiver callback %r raised", fn)


def _shutdown(sock: socket.socket, how: int) -> None:
    try:
        sock.shutdown(how)
    except OSError:
        pass


class NcclKVReceiver(KVReceiver):
    """Accepts control connections on ``host:port``; KV pages arrive over NCCL straight into ``kv_cache``.

    Same contract and threads as :class:`kvtransfer.tcp.TcpKVReceiver` (accept loop, one handler per
    control connection, a deadline reaper; callbacks run without internal locks held), and the same
    registration table. A pair's communicator is created when a sender's hello carries a unique id, and
    aborted and forgotten when an NCCL call on it fails or times out, or when the sender says bye.

    Args:
        kv_cache: contiguous CUDA tensor ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``
            of ``spec.dtype``; written in place by ncclRecv.
        spec: cache layout; announced pages must match it.
        host / port: control listener (port 0 picks a free one).
        io_timeout_s: seconds a control read or one NCCL receive may take.
        init_timeout_s: seconds a communicator init may wait for the sender.
        library: a loaded :class:`NcclLibrary`; None loads the wheel's.
        secret: cluster secret every control connection must prove first (the TCP transport's HMAC
            handshake, :mod:`kvtransfer.tcp.handshake`); None: :func:`deploy.secret.cluster_secret`.
    Raises:
        ValueError: ``kv_cache`` is not a contiguous CUDA tensor matching ``spec``, or the secret is too short.
        NcclUnavailable: the NCCL library cannot be loaded.
        OSError: the address cannot be bound.
    """

    def __init__(self, kv_cache: torch.Tensor, spec: KVCacheSpec, host: str = "127.0.0.1", port: int = 0,
                 io_timeout_s: float = 10.0, init_timeout_s: float = 30.0, library: NcclLibrary | None = None,
                 secret: bytes | None = None) -> None:
        check_cuda_cache(kv_cache, spec)
        self._secret = check_secret(secret, "the KV receiver's secret") if secret is not None else cluster_secret()
        self._lib = library or load_library()
        self._version = self._lib.version()
        self._pages = DevicePages(kv_cache, spec)
        self._spec = spec
        self._io_timeout_s = io_timeout_s
        self._comms = CommCache(self._lib, kv_cache.device, init_timeout_s)
        self._registry = Registry(spec.num_blocks, spec.num_layers)
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._stopping = threading.Event()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family)
        port = self._listener.getsockname()[1]
        self._address = SCHEME + (f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        self._threads = [threading.Thread(target=self._accept_loop, name=f"nccl-kv-accept-{port}", daemon=True),
                         threading.Thread(target=self._reap_loop, name=f"nccl-kv-reaper-{port}", daemon=True)]
        for thread in self._threads:
            thread.start()

    @property
    def address(self) -> str:
        """``nccl://host:port`` of the control listener (the scheme tells senders which transport to use)."""
        return self._address

    def expect(self, request_id: str, block_ids: Sequence[int], timeout_s: float,
               on_complete: OnComplete, on_failed: OnFailed) -> None:
        """Register ``request_id`` to receive every layer of ``block_ids`` within ``timeout_s`` seconds.

        Raises:
            ValueError: already registered; block ids empty, repeated or out of range; ``timeout_s <= 0``.
            RuntimeError: the receiver is closed.
        """
        self._registry.add(request_id, block_ids, timeout_s, on_complete, on_failed)

    def cancel(self, request_id: str) -> None:
        """Forget ``request_id`` without a callback; its control connection is cut and an in-flight ncclRecv
        into its blocks is waited out (at most ``io_timeout_s``). Idempotent."""
        reg = self._registry.take_id(request_id, "cancelled by the receiver")
        if reg is not None:
            self._stop_writes(reg)

    def close(self) -> None:
        """Stop listening, fail pending registrations (``"receiver closed"``, on this thread), cut every
        connection and destroy the communicators. Idempotent."""
        with self._conns_lock:
            if self._stopping.is_set():
                return
            self._stopping.set()
            conns = list(self._conns)
        _shutdown(self._listener, socket.SHUT_RDWR)
        for reg in self._registry.close():
            self._stop_writes(reg)
            _call(reg.on_failed, reg.request_id, reg.ended)
        for sock in conns:
            _shutdown(sock, socket.SHUT_RDWR)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=1.0)
        self._listener.close()
        self._comms.close()

    # -- threads -------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                self._stopping.wait(0.05)
                continue
            sock.settimeout(self._io_timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._conns_lock:
                if self._stopping.is_set():
                    sock.close()
                    return
                self._conns.add(sock)
            threading.Thread(target=self._serve, args=(sock,), name="nccl-kv-conn", daemon=True).start()

    def _reap_loop(self) -> None:
        while (expired := self._registry.wait_expired()) is not None:
            for reg in expired:
                self._stop_writes(reg)
                _call(reg.on_failed, reg.request_id, reg.ended)

    def _stop_writes(self, reg: Registration) -> None:
        if reg.conn is not None:
            _shutdown(reg.conn, socket.SHUT_RD)
        with reg.write_lock:
            pass

    # -- one control connection ----------------------------------------------------------------

    def _serve(self, sock: socket.socket) -> None:
        conn = _Conn(sock)
        try:
            if self._secret is not None:
                try:
                    authenticate_sender(sock, self._secret, self._io_timeout_s)
                except HandshakeError as e:
                    log.warning("NCCL KV receiver %s refused a control connection: %s", self._address, e)
                    return
                sock.settimeout(self._io_timeout_s)
            self._serve_frames(conn)
        except FrameError as e:
            if conn.reg is None and e.request_id is not None:
                try:
                    conn.reg = self._registry.bind(e.request_id, sock)
                except FrameError:
                    pass
            self._end(conn, f"bad frame: {e}")
        except NcclError as e:
            self._end(conn, f"NCCL failure: {e}")
        except TimeoutError:
            self._end(conn, f"control connection timed out after {self._io_timeout_s:g} s mid-transfer")
        except OSError as e:  # PeerClosed included
            self._end(conn, f"control connection closed mid-transfer: {e}")
        except Exception as e:
            log.exception("NCCL KV receiver connection handler failed")
            self._end(conn, f"receiver error: {e!r}")
        finally:
            with self._conns_lock:
                self._conns.discard(sock)
            sock.close()

    def _serve_frames(self, conn: _Conn) -> None:
        first = read_any(conn.sock)
        if first is None:
            return
        if isinstance(first, Bye):
            self._comms.evict(first.comm_id, "the sender said bye")
            return
        self._handshake(conn, expect(first, Hello))
        while True:
            frame = read_any(conn.sock)
            if frame is None:
                raise PeerClosed("EOF before done")
            if getattr(frame, "request_id", None) != conn.reg.request_id or not isinstance(frame, Pages | Done | Abort):
                raise FrameError(f"unexpected {frame!r} on the control connection of request "
                                 f"{conn.reg.request_id!r}", conn.reg.request_id)
            if isinstance(frame, Pages):
                self._on_pages(conn, frame)
            elif isinstance(frame, Done):
                self._on_done(conn, frame)
                return
            else:
                why = f"aborted by sender: {frame.reason}"
                if self._registry.take(conn.reg, why):
                    _call(conn.reg.on_failed, conn.reg.request_id, why)
                return

    def _handshake(self, conn: _Conn, hello: Hello) -> None:
        """Bind the request, then find or create the pair's communicator (see :mod:`.handshake`)."""
        conn.reg = self._registry.bind(hello.request_id, conn.sock)
        conn.comm = negotiate_receiver(conn.sock, hello, self._comms, self._version.code)

    def _on_pages(self, conn: _Conn, frame: Pages) -> None:
        reg, pc = conn.reg, conn.comm
        check_pages(frame, self._spec)
        foreign = [b for b in frame.block_ids if b not in reg.block_set]
        if foreign:
            raise FrameError(f"request {reg.request_id!r}: block ids {foreign[:16]} are not registered for it")
        buffers = self._pages.buffers(frame.block_ids, frame.layer_start, frame.layer_end)
        with pc.lock, reg.write_lock:
            if not self._registry.is_live(reg):
                raise FrameError(f"request {reg.request_id!r} is no longer registered: {reg.ended}")
            try:
                pc.move(buffers, send=False, timeout_s=self._io_timeout_s,
                        before_post=lambda: self._reply(conn, ClearToSend(reg.request_id), strict=True))
            except NcclError:  # the communicator was aborted: forget it (the sender re-creates one)
                self._comms.evict(pc.comm_id, "an NCCL receive failed", match=lambda c: c is pc)
                raise
            self._registry.mark(reg, frame.block_ids, frame.layer_start, frame.layer_end)

    def _on_done(self, conn: _Conn, frame: Done) -> None:
        reg = conn.reg
        taken, complete = self._registry.finish(reg)
        if not taken:
            raise FrameError(f"request {reg.request_id!r} is no longer registered: {reg.ended}")
        if complete:
            _call(reg.on_complete, reg.request_id, frame.first_token)
        else:
            _call(reg.on_failed, reg.request_id, reg.ended)
        self._reply(conn, Ack(reg.request_id, complete, "" if complete else reg.ended or ""))

    def _end(self, conn: _Conn, why: str) -> None:
        """The connection failed with ``why``: fail its request (if this call takes it), nack, close."""
        reg = conn.reg
        if reg is not None and self._registry.take(reg, why):
            _call(reg.on_failed, reg.request_id, why)
            error = why
        elif reg is not None:
            error = f"request {reg.request_id!r} is no longer registered: {reg.ended}"
        else:
            error = why
        self._reply(conn, Ack(reg.request_id if reg else "", False, error))
        try:  # half-close and drain briefly so the nack is not lost to a reset
            conn.sock.shutdown(socket.SHUT_WR)
            conn.sock.settimeout(min(self._io_timeout_s, 1.0))
            deadline = time.monotonic() + min(self._io_timeout_s, 1.0)
            while time.monotonic() < deadline and conn.sock.recv(65536):
                pass
        except OSError:
            pass

    def _reply(self, conn: _Conn, frame: Ack | Welcome | ClearToSend, strict: bool = False) -> None:
        try:
            conn.sock.sendall(encode(frame) if isinstance(frame, Ack) else encode_control(frame))
        except (OSError, FrameError):
            if strict:
                raise
