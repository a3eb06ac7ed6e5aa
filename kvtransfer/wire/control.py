"""Control frames of a backend's own, read and written beside the frames of :mod:`kvtransfer.wire.frames`.

A backend that moves its pages outside the socket (NCCL, CUDA IPC) adds a few frames of its own to the
same wire shape (``u32 big-endian header length | msgpack map`` whose ``type`` names the frame). A
:class:`ControlCodec` is built from a table ``type name -> (dataclass, {field: exact Python type})``;
every field a peer sends is checked for its exact type before the dataclass is built (a bool is not
an int, a list is only a list: a list's items are the backend's to check).
"""

from __future__ import annotations

import socket
import struct
from dataclasses import asdict
from typing import Any

import msgpack

from pdserve.kvtransfer.wire.frames import FrameError, decode_tagged, read_header_bytes, unpack_header

_LEN = struct.Struct(">I")  # the frames' length prefix


class ControlCodec:
    """Encodes and reads one backend's control frames (module doc).

    Args:
        fields: ``type name -> (dataclass, {field name: exact type})``; the names must not clash with
            those of :mod:`kvtransfer.wire.frames` (pages, done, abort, ack).
    """

    def __init__(self, fields: dict[str, tuple[type, dict[str, type]]]) -> None:
        self._fields = dict(fields)
        self._type_name = {cls: name for name, (cls, _) in self._fields.items()}

    def encode(self, frame: Any) -> bytes:
        """Length prefix + msgpack header of one control frame."""
        body = msgpack.packb({"type": self._type_name[type(frame)], **asdict(frame)}, use_bin_type=True)
        return _LEN.pack(len(body)) + body

    def _decode(self, kind: str, header: dict[str, Any]) -> Any:
        cls, fields = self._fields[kind]
        values = {}
        for name, typ in fields.items():
            value = header.get(name)
            if type(value) is not typ:  # exact: a bool is not an int here
                rid = header.get("request_id")
                raise FrameError(f"{kind} frame: field {name!r} must be {typ.__name__}, got {type(value).__name__}",
                                 rid if isinstance(rid, str) else None)
            values[name] = value
        return cls(**values)

    def read_any(self, sock: socket.socket, deadline: float | None = None) -> Any:
        """Read one frame header: a control frame of this codec or a frame of :mod:`kvtransfer.wire.frames`.
        Returns None on a clean EOF before the frame starts.

        Args:
            deadline: ``time.monotonic()`` by which the whole header must have arrived (see
                :func:`kvtransfer.wire.frames.read_header_bytes`); None: the socket's timeout, per ``recv``.
        Raises:
            FrameError: oversize, not msgpack (or a repeated map key), unknown type or bad fields.
            PeerClosed: EOF inside the header.
            OSError: socket error or timeout (``TimeoutError``, also when ``deadline`` passed).
        """
        body = read_header_bytes(sock, deadline)
        if body is None:
            return None
        header = unpack_header(body)
        if isinstance(header, dict) and header.get("type") in self._fields:
            return self._decode(header["type"], header)
        return decode_tagged(header)

    def expect(self, frame: object, cls: type, request_id: str | None = None) -> Any:
        """``frame`` if it is a ``cls`` (for ``request_id`` when given).

        Raises:
            FrameError: anything else (None meaning the peer closed).
        """
        if not isinstance(frame, cls) or (request_id is not None
                                          and getattr(frame, "request_id", None) != request_id):
            raise FrameError(f"expected {self._type_name.get(cls, cls.__name__)}"
                             + (f" for request {request_id!r}" if request_id else "") + f", got {frame!r}",
                             request_id)
        return frame



