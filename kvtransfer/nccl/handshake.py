"""The hello/welcome exchange that opens every NCCL control connection and, on a pair's first request,
hands the sender's NCCL unique id to the receiver so both can join one 2-rank communicator.

Both functions are shared by :mod:`.sender` and :mod:`.receiver` and need no GPU until the
communicator itself is created (see :mod:`.control` for the frames)::

    sender                                    receiver
    cached comm for this receiver?
      yes: hello{comm_id, unique_id=b""}  ─►  knows comm_id?  yes: welcome{ok}          -> reuse
                                                              no:  welcome{need_unique_id}
      no:  hello{new comm_id, unique_id}  ─►  welcome{init}; ncclCommInitRank(rank 1)
           ncclCommInitRank(rank 0)                            (both cache it under comm_id)
"""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Callable

from pdserve.kvtransfer.nccl.comms import CommCache, PairComm
from pdserve.kvtransfer.nccl.control import Hello, Welcome, encode_control, expect, read_any
from pdserve.kvtransfer.nccl.library import UNIQUE_ID_BYTES
from pdserve.kvtransfer.wire.frames import Ack, FrameError


def negotiate_sender(sock: socket.socket, request_id: str, key: str, comms: CommCache, nccl_version: int,
                     sender_id: str, make_unique_id: Callable[[], bytes]) -> PairComm:
    """Sender side: reuse the communicator cached under ``key`` (the receiver's address) or create one as
    rank 0 with a fresh unique id from ``make_unique_id``. Holds ``comms.key_lock(key)`` throughout.

    Raises:
        FrameError: the receiver refused (unknown request, version mismatch: its reason included) or
            answered out of protocol.
        NcclError: communicator init failed or timed out.
        OSError: the control connection failed or timed out.
    """
    with comms.key_lock(key):
        comm = comms.get(key)
        for _ in range(2):
            comm_id = comm.comm_id if comm is not None else uuid.uuid4().hex
            unique_id = b"" if comm is not None else make_unique_id()
            sock.sendall(encode_control(Hello(request_id, comm_id, sender_id, nccl_version, unique_id)))
            reply = read_any(sock)
            if isinstance(reply, Ack) and not reply.ok:
                raise FrameError(f"receiver refused the transfer: {reply.error}", request_id)
            welcome: Welcome = expect(reply, Welcome, request_id)
            if not welcome.ok:
                raise FrameError(f"receiver refused the transfer: {welcome.error}", request_id)
            if welcome.init and unique_id:
                return comms.create(key, comm_id, unique_id, rank=0, peer_id=key)
            if welcome.need_unique_id and comm is not None:  # the receiver lost its end (restarted?)
                comms.evict(key, "the receiver does not know this communicator")
                comm = None
                continue
            if comm is not None and not welcome.init and not welcome.need_unique_id:
                return comm
            raise FrameError(f"welcome {welcome!r} does not answer hello(unique id sent: {bool(unique_id)})",
                             request_id)
        raise FrameError("the receiver asked for a unique id twice", request_id)


def negotiate_receiver(sock: socket.socket, hello: Hello, comms: CommCache, nccl_version: int,
                       io_timeout_s: float | None = None) -> PairComm:
    """Receiver side, after reading the first ``hello`` (whose request the caller already bound): find
    the communicator ``hello.comm_id`` or, given a unique id, create it as rank 1 (cached under its id,
    its peer being ``hello.sender_id``, which supersedes older communicators of that sender).

    Args:
        io_timeout_s: seconds a second hello may take to arrive in full (one deadline for the whole
            frame) and each reply to send; None: the socket's timeout.
    Raises:
        FrameError: NCCL versions differ, the unique id is not 128 bytes, a second hello is malformed
            or still carries no unique id.
        NcclError: communicator init failed or timed out.
        OSError: the control connection failed or timed out.
    """
    for attempt in range(2):
        if hello.nccl_version != nccl_version:
            raise FrameError(f"sender runs NCCL version code {hello.nccl_version}, this receiver {nccl_version}; "
                             "both ends need the same NCCL version", hello.request_id)
        if hello.unique_id:
            if len(hello.unique_id) != UNIQUE_ID_BYTES:
                raise FrameError(f"unique_id is {len(hello.unique_id)} bytes, not {UNIQUE_ID_BYTES}", hello.request_id)
            sock.sendall(encode_control(Welcome(hello.request_id, True, True, False, "")))
            return comms.create(hello.comm_id, hello.comm_id, hello.unique_id, rank=1, peer_id=hello.sender_id)
        comm = comms.get(hello.comm_id)
        if comm is not None:
            sock.sendall(encode_control(Welcome(hello.request_id, True, False, False, "")))
            return comm
        if attempt == 1:
            break
        sock.sendall(encode_control(Welcome(hello.request_id, True, False, True, "")))
        hello = expect(read_any(sock, None if io_timeout_s is None else time.monotonic() + io_timeout_s),
                       Hello, hello.request_id)
        if io_timeout_s is not None:
            sock.settimeout(io_timeout_s)  # the deadline left it short: the replies get the full timeout
    raise FrameError("the sender sent no unique id for an unknown communicator", hello.request_id)
