"""Mutual HMAC-SHA256 challenge-response that opens every KV connection when a cluster secret is set.

Neither side learns anything it could replay, and no KV frame is read (so no byte reaches
the KV cache) before both sides have proved that they hold the secret::

    sender (prefill)                                        receiver (decode)
                          ◄── challenge{proto, nonce_r} ──  nonce_r: 32 random bytes
    nonce_s: 32 random bytes
    proof_s = HMAC(K, proto|"sender"|nonce_r|nonce_s)
                      ── response{proto, nonce_s, proof_s} ──►  check proof_s (compare_digest)
                          ◄── result{ok, proof_r, error} ──   proof_r = HMAC(K, proto|"receiver"|nonce_r|nonce_s)
    check proof_r (compare_digest)                           (ok=False, no proof_r: refused, then closed)
    ── frames (see frames.py) ──►

The role names in the MAC keep a proof from being reflected back to its maker; the
receiver reveals ``proof_r`` only after ``proof_s`` checked out, and the sender's own fresh
nonce makes ``proof_r`` unforgeable without the key. This is the usual challenge-response
construction (RFC 2104 HMAC; cf. the mutual authentication of SCRAM, RFC 5802). It authenticates
the peer at connect time; it neither encrypts nor MACs the pages that follow, so on a network
where an attacker can hijack TCP streams run the KV traffic over a private network or VPN.

Messages use the frames' wire shape (``u32 big-endian length | msgpack map``) with their own
types, so a sender that does not authenticate reads the challenge as an unknown frame and
fails at once instead of pushing pages. Every read runs against one deadline for the whole
handshake, so a peer that stalls (or trickles bytes) is dropped when it passes.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
import time
from typing import Any

import msgpack

PROTO = "pdserve-kv-auth/1"
NONCE_BYTES = 32
_MAX_MESSAGE_BYTES = 1024
_LEN = struct.Struct(">I")


class HandshakeError(ConnectionError):
    """The peer failed to authenticate (wrong or missing secret, bad message, stalled, or closed).
    The message says which, never anything derived from the secret."""


def proof(secret: bytes, role: str, nonce_r: bytes, nonce_s: bytes) -> bytes:
    """``HMAC-SHA256(secret, PROTO | role | nonce_r | nonce_s)`` (32 bytes); ``role`` is
    ``"sender"`` or ``"receiver"``."""
    msg = b"\0".join((PROTO.encode(), role.encode(), nonce_r, nonce_s))
    return hmac.new(secret, msg, hashlib.sha256).digest()


def write_message(sock: socket.socket, message: dict[str, Any], deadline: float) -> None:
    """Send one handshake message (a msgpack map with a ``type``) before ``deadline`` (``time.monotonic()``).

    Raises:
        HandshakeError: the send failed or timed out.
    """
    body = msgpack.packb(message, use_bin_type=True)
    try:
        sock.settimeout(_left(deadline))
        sock.sendall(_LEN.pack(len(body)) + body)
    except TimeoutError:
        raise HandshakeError("timed out sending the handshake") from None
    except OSError as e:
        raise HandshakeError(f"connection failed during the handshake: {e!r}") from None


def read_message(sock: socket.socket, want_type: str, deadline: float) -> dict[str, Any]:
    """Read one handshake message of type ``want_type`` before ``deadline`` (``time.monotonic()``).

    Raises:
        HandshakeError: timeout, EOF, oversized or non-msgpack message, or another type
            (a KV frame here means the peer does not authenticate).
    """
    (length,) = _LEN.unpack(_recv_exact(sock, _LEN.size, deadline))
    if length > _MAX_MESSAGE_BYTES:
        raise HandshakeError(f"expected a {want_type!r} handshake message, got a {length}-byte message "
                             f"(the peer does not speak {PROTO})")
    try:
        message = msgpack.unpackb(_recv_exact(sock, length, deadline), raw=False)
    except HandshakeError:
        raise
    except Exception:  # msgpack raises several unrelated types on garbage
        raise HandshakeError(f"expected a {want_type!r} handshake message, got bytes that are not msgpack") from None
    kind = message.get("type") if isinstance(message, dict) else None
    if kind == "ack" and message.get("ok") is False:  # the receiver refused the connection (busy)
        raise HandshakeError(f"the receiver refused the connection: {str(message.get('error'))[:200]}")
    if kind != want_type:
        hint = " (a KV frame: the peer has no cluster secret)" if kind in ("pages", "done", "abort", "ack") else ""
        raise HandshakeError(f"expected a {want_type!r} handshake message, got {str(kind)[:40]!r}{hint}")
    return message


def authenticate_sender(sock: socket.socket, secret: bytes, timeout_s: float, deadline: float | None = None) -> None:
    """Receiver side: challenge the connected peer and make it prove ``secret``, then prove it back.

    On failure, tells the peer why (best effort) before raising; the caller closes the socket.

    Args:
        deadline: ``time.monotonic()`` by which the whole handshake must be done; None: ``timeout_s``
            seconds from now.
    Raises:
        HandshakeError: the peer's proof is missing or wrong, or it stalled past the deadline.
    """
    deadline = time.monotonic() + timeout_s if deadline is None else deadline
    nonce_r = secrets.token_bytes(NONCE_BYTES)
    write_message(sock, {"type": "auth_challenge", "proto": PROTO, "nonce": nonce_r}, deadline)
    try:
        reply = read_message(sock, "auth_response", deadline)
        nonce_s, proof_s = _field(reply, "nonce"), _field(reply, "proof")
        if reply.get("proto") != PROTO:
            raise HandshakeError(f"peer speaks {str(reply.get('proto'))[:40]!r}, not {PROTO!r}")
        if not hmac.compare_digest(proof_s, proof(secret, "sender", nonce_r, nonce_s)):
            raise HandshakeError("the peer's proof is wrong (it does not hold the cluster secret)")
    except HandshakeError as e:
        try:
            write_message(sock, {"type": "auth_result", "ok": False, "proof": b"", "error": str(e)},
                          time.monotonic() + 1.0)
        except HandshakeError:
            pass
        raise
    write_message(sock, {"type": "auth_result", "ok": True, "proof": proof(secret, "receiver", nonce_r, nonce_s),
                         "error": ""}, deadline)


def authenticate_receiver(sock: socket.socket, secret: bytes, timeout_s: float) -> None:
    """Sender side: answer the receiver's challenge with a proof of ``secret`` and check the
    receiver's proof, so pages are never pushed to a process without the secret.

    Raises:
        HandshakeError: no challenge within ``timeout_s`` seconds (the receiver does not
            authenticate), the receiver refused our proof, or its own proof is wrong.
    """
    deadline = time.monotonic() + timeout_s
    try:
        challenge = read_message(sock, "auth_challenge", deadline)
    except HandshakeError as e:
        raise HandshakeError(f"no valid authentication challenge from the receiver ({e}); "
                             "does the decode worker have the cluster secret?") from None
    if challenge.get("proto") != PROTO:
        raise HandshakeError(f"receiver speaks {str(challenge.get('proto'))[:40]!r}, not {PROTO!r}")
    nonce_r, nonce_s = _field(challenge, "nonce"), secrets.token_bytes(NONCE_BYTES)
    write_message(sock, {"type": "auth_response", "proto": PROTO, "nonce": nonce_s,
                         "proof": proof(secret, "sender", nonce_r, nonce_s)}, deadline)
    result = read_message(sock, "auth_result", deadline)
    if result.get("ok") is not True:
        raise HandshakeError(f"receiver refused our authentication: {str(result.get('error'))[:200]}")
    if not hmac.compare_digest(_field(result, "proof"), proof(secret, "receiver", nonce_r, nonce_s)):
        raise HandshakeError("the receiver's proof is wrong (it does not hold the cluster secret)")


# -- internals ---------------------------------------------------------------------------------


def _field(message: dict[str, Any], name: str) -> bytes:
    value = message.get(name)
    if not isinstance(value, bytes) or len(value) != NONCE_BYTES:
        raise HandshakeError(f"{message.get('type')} message: {name!r} must be {NONCE_BYTES} bytes")
    return value


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    try:
        while got < n:
            sock.settimeout(_left(deadline))
            k = sock.recv_into(view[got:], n - got)
            if k == 0:
                raise HandshakeError(f"peer closed the connection during the handshake (after {got} of {n} bytes)")
            got += k
    except TimeoutError:
        raise HandshakeError("peer stalled: the handshake did not complete in time") from None
    except HandshakeError:
        raise
    except OSError as e:
        raise HandshakeError(f"connection failed during the handshake: {e!r}") from None
    return bytes(buf)
