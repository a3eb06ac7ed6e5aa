"""Wire format of the KV transports: framing, header codec and validation.

Every frame is ``u32 big-endian header length | msgpack map header | payload``;
only ``pages`` frames carry a payload (``nbytes`` raw bytes: the listed blocks'
pages in order). One connection carries one request's transfer::

    sender                                   receiver
    pages{request_id, layer_start, layer_end, block_ids, dtype, shape, nbytes} + payload
    ...
    done{request_id, first_token}   ──►
                                    ◄──  ack{request_id, ok, error}
    abort{request_id, reason}       ──►  (no reply)

The receiver also sends a not-ok ``ack`` before it closes a connection whose
frame it refused, and one with an empty ``request_id`` and an error starting with
:data:`BUSY` to a connection it will not serve at all (its connection limit is
reached, or it cannot start a handler for it); with a cluster secret that ack may
arrive in place of a handshake message. The NCCL backend sends the same frames on its control connection,
its pages' payload going over NCCL instead (:mod:`kvtransfer.nccl.control`).
"""

from __future__ import annotations

import math
import socket
import struct
import time
from dataclasses import asdict, dataclass
from typing import Any

import msgpack
import torch

from pdserve.model.kv_cache import KVCacheSpec

MAX_HEADER_BYTES = 64 * 1024
_LEN = struct.Struct(">I")
BUSY = "KV receiver busy"
"""How the error of a connection-level refusal (:func:`busy_ack`) starts."""


class FrameError(ValueError):
    """A frame is malformed or not acceptable; the message says which field and why.

    ``request_id`` is the frame's request id when the header named one, else None.
    """

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class PeerClosed(ConnectionError):
    """The peer closed the connection in the middle of a frame."""


@dataclass(frozen=True)
class Pages:
    """Header of a pages frame; ``nbytes`` payload bytes follow it on the wire.

    ``block_ids`` are destination block ids; ``shape`` is
    ``(len(block_ids), layer_end - layer_start, 2, block_size, num_kv_heads, head_dim)``.
    """

    request_id: str
    layer_start: int
    layer_end: int
    block_ids: tuple[int, ...]
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class Done:
    """End of a transfer, carrying the request's first sampled token."""

    request_id: str
    first_token: int


@dataclass(frozen=True)
class Abort:
    """The sender gives up on the request."""

    request_id: str
    reason: str


@dataclass(frozen=True)
class Ack:
    """Receiver's verdict: after ``done``, or (``ok=False``) before closing on a refused frame."""

    request_id: str
    ok: bool
    error: str = ""


Frame = Pages | Done | Abort | Ack
_FIELDS: dict[str, tuple[type, dict[str, str]]] = {
    "pages": (Pages, {"request_id": "str", "layer_start": "int", "layer_end": "int", "block_ids": "list of ints",
                      "dtype": "str", "shape": "list of ints", "nbytes": "int"}),
    "done": (Done, {"request_id": "str", "first_token": "int"}),
    "abort": (Abort, {"request_id": "str", "reason": "str"}),
    "ack": (Ack, {"request_id": "str", "ok": "bool", "error": "str"}),
}
_TYPE_NAME = {cls: name for name, (cls, _) in _FIELDS.items()}


def busy_ack(detail: str) -> Ack:
    """The nack a receiver sends to a connection it will not serve (no request bound): ``ok=False``,
    empty ``request_id``, error ``"KV receiver busy: <detail>"``."""
    return Ack("", False, f"{BUSY}: {detail}")


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a torch dtype, e.g. ``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_CHECKS = {
    "str": lambda v: isinstance(v, str),
    "int": _is_int,
    "bool": lambda v: isinstance(v, bool),
    "list of ints": lambda v: isinstance(v, list) and all(_is_int(x) for x in v),
}


def encode(frame: Frame) -> bytes:
    """Length prefix + msgpack header of ``frame`` (the payload is sent separately).

    Raises:
        FrameError: the header exceeds :data:`MAX_HEADER_BYTES`.
    """
    header = {"type": _TYPE_NAME[type(frame)], **asdict(frame)}  # tuples pack as arrays
    body = msgpack.packb(header, use_bin_type=True)
    if len(body) > MAX_HEADER_BYTES:
        raise FrameError(f"header of {len(body)} bytes exceeds the {MAX_HEADER_BYTES}-byte limit")
    return _LEN.pack(len(body)) + body


def decode(header: Any) -> Frame:
    """Check a decoded header's type and field types and build its frame. Extra keys are ignored.

    Raises:
        FrameError: not a map, unknown ``type``, or a field missing or of the wrong type.
    """
    if not isinstance(header, dict):
        raise FrameError(f"header must be a map, got {type(header).__name__}")
    kind = header.get("type")
    if not isinstance(kind, str) or kind not in _FIELDS:  # an unhashable value must not reach the dict lookup
        raise FrameError(f"unknown frame type {_short(kind)} (expected one of {sorted(_FIELDS)})")
    cls, fields = _FIELDS[kind]
    values = {}
    for name, check in fields.items():
        if name not in header:
            raise FrameError(f"{kind} frame: missing field {name!r}")
        value = header[name]
        if not _CHECKS[check](value):
            raise FrameError(f"{kind} frame: field {name!r} must be {check}, got {_short(value)}")
        values[name] = tuple(value) if isinstance(value, list) else value
    if not values["request_id"] and kind != "ack":
        raise FrameError(f"{kind} frame: empty request_id")
    return cls(**values)


def check_pages(frame: Pages, spec: KVCacheSpec) -> None:
    """Check a pages header against the cache layout (not against any registration).

    Raises:
        FrameError: no block ids, bad layer range, block id out of range or repeated, wrong dtype,
            shape or nbytes. Nothing here allocates from the frame's numbers: the expected shape and
            byte count come from ``spec``, so an attacker's ``shape``/``nbytes`` is only compared.
    """
    rid, ls, le = frame.request_id, frame.layer_start, frame.layer_end
    if not frame.block_ids:
        raise FrameError(f"request {rid!r}: block_ids is empty (a pages frame carries at least one block)")
    if not 0 <= ls < le <= spec.num_layers:
        raise FrameError(f"request {rid!r}: layer range [{ls}, {le}) is not within [0, {spec.num_layers})")
    bad = [b for b in frame.block_ids if not 0 <= b < spec.num_blocks]
    if bad:
        raise FrameError(f"request {rid!r}: block ids {_short(bad)} out of range [0, {spec.num_blocks})")
    if len(set(frame.block_ids)) != len(frame.block_ids):
        raise FrameError(f"request {rid!r}: repeated block ids in {_short(list(frame.block_ids))}")
    want_dtype = dtype_name(spec.dtype)
    if frame.dtype != want_dtype:
        raise FrameError(f"request {rid!r}: dtype {frame.dtype!r} does not match the cache dtype {want_dtype!r}")
    want_shape = (len(frame.block_ids), *spec.page_shape(le - ls))
    if frame.shape != want_shape:
        raise FrameError(f"request {rid!r}: shape {list(frame.shape)} != expected {list(want_shape)}")
    want_nbytes = math.prod(want_shape) * spec.dtype.itemsize
    if frame.nbytes != want_nbytes:
        raise FrameError(f"request {rid!r}: nbytes {frame.nbytes} != expected {want_nbytes}")


def recv_exact_into(sock: socket.socket, buf: memoryview, deadline: float | None = None) -> None:
    """Fill the writable byte buffer ``buf`` from ``sock`` (no intermediate copy).

    Args:
        deadline: ``time.monotonic()`` by which the whole buffer must have arrived (the socket's
            timeout is set to what is left before each ``recv``, so a peer trickling bytes cannot
            stretch it); None: the socket's own timeout, per ``recv``.
    Raises:
        PeerClosed: EOF before ``buf`` is full.
        OSError: socket error or timeout (``TimeoutError``, also when ``deadline`` passed).
    """
    got, n = 0, buf.nbytes
    while got < n:
        if deadline is not None:
            _settimeout_until(sock, deadline, f"after {got} of {n} bytes")
        k = sock.recv_into(buf[got:], n - got)
        if k == 0:
            raise PeerClosed(f"connection closed after {got} of {n} bytes")
        got += k


def _unique_keys(pairs: list[tuple[Any, Any]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise FrameError(f"header map repeats the key {_short(dup)}")
    return out


def unpack_header(body: bytes | bytearray) -> Any:
    """Decode a header body (at most :data:`MAX_HEADER_BYTES`) from msgpack; not yet checked.

    Container lengths are bounded by the body's size (msgpack's defaults), so garbage cannot
    make this allocate much more than ``len(body)``. Maps with a repeated key are refused, so
    two readers can never disagree on which value counts.

    Raises:
        FrameError: not msgpack, trailing bytes, invalid UTF-8 in a string, a map key that is not a string,
            or a repeated map key.
    """
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True, object_pairs_hook=_unique_keys)
    except FrameError:
        raise
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise FrameError(f"header is not valid msgpack: {type(e).__name__}: {e}") from None


def _settimeout_until(sock: socket.socket, deadline: float, where: str) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"frame deadline passed {where}")
    sock.settimeout(left)


def read_header_bytes(sock: socket.socket, deadline: float | None = None) -> bytearray | None:
    """Read one length-prefixed header body (not decoded, no payload). Returns None on a clean EOF
    before the frame starts.

    Args:
        deadline: ``time.monotonic()`` by which the whole header (prefix and body) must have arrived,
            however the peer spreads its bytes; None: the socket's own timeout, per ``recv``.
    Raises:
        FrameError: the announced length exceeds :data:`MAX_HEADER_BYTES`.
        PeerClosed: EOF inside the header.
        OSError: socket error or timeout (``TimeoutError``, also when ``deadline`` passed).
    """
    prefix = bytearray(_LEN.size)
    if deadline is not None:
        _settimeout_until(sock, deadline, "before the frame started")
    first = sock.recv_into(prefix)
    if first == 0:
        return None
    recv_exact_into(sock, memoryview(prefix)[first:], deadline)
    (length,) = _LEN.unpack(prefix)
    if length > MAX_HEADER_BYTES:
        raise FrameError(f"header length {length} exceeds the {MAX_HEADER_BYTES}-byte limit")
    body = bytearray(length)
    recv_exact_into(sock, memoryview(body), deadline)
    return body


def decode_tagged(header: object) -> Frame:
    """:func:`decode`, but a :class:`FrameError` carries the header's ``request_id`` (when it is a str),
    so the receiver can fail the request a bad frame names.

    Raises:
        FrameError: see :func:`decode`.
    """
    try:
        return decode(header)
    except FrameError as e:
        rid = header.get("request_id") if isinstance(header, dict) else None
        e.request_id = rid if isinstance(rid, str) else None
        raise


def read_frame(sock: socket.socket, deadline: float | None = None) -> Frame | None:
    """Read one header (not the payload). Returns None on a clean EOF before the frame starts.

    Args:
        deadline: see :func:`read_header_bytes`.
    Raises:
        FrameError: header too large, not msgpack, or invalid (see :func:`decode`).
        PeerClosed: EOF inside the header.
        OSError: socket error or timeout (``TimeoutError``, also when ``deadline`` passed).
    """
    body = read_header_bytes(sock, deadline)
    return None if body is None else decode_tagged(unpack_header(body))
