"""The signatures of the KV event stream and snapshot (:mod:`cluster.kv_events`): with the cluster secret every
stream entry and snapshot carries an HMAC-SHA256 (``mac``) over its fields, the cluster and the worker id
(:func:`event_mac`, :func:`snapshot_mac`); a consumer with the secret refuses (:class:`ForgedEntry`) what a
process without it wrote, or what was copied from another worker's or cluster's keys (``docs/kv_events.md``).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

import msgpack

_EVENT_MAC_LABEL = b"pdserve-kv-event/1"
_SNAPSHOT_MAC_LABEL = b"pdserve-kv-snapshot/1"
_EVENT_SIGNED_FIELDS = ("seq", "epoch", "type", "hashes", "parent", "block_size", "ts")
SNAPSHOT_HEAD_FIELDS = ("epoch", "seq", "ts", "digest", "mac")
"""Snapshot fields a consumer reads to check (with :func:`verify_snapshot_head`) a snapshot's epoch and seq
without its hashes."""


class ForgedEntry(ValueError):
    """A KV event or snapshot whose ``mac`` is missing or wrong for the cluster secret: written without
    the secret, copied from another worker's or cluster's keys, or altered."""


def _as_bytes(value: bytes | str | int | float | None) -> bytes | None:
    """A field value as Redis stores it (redis-py's encoding: ``str(int)``, ``repr(float)``, UTF-8)."""
    if value is None or isinstance(value, bytes):
        return value
    if isinstance(value, float):
        return repr(value).encode()
    return str(value).encode()


def _field(fields: Mapping, name: str) -> bytes | None:
    """``fields[name]`` as bytes, for maps keyed by str (publisher) or by bytes (what redis-py returns)."""
    value = fields.get(name)
    if value is None:
        value = fields.get(name.encode())
    return _as_bytes(value)


def event_mac(secret: bytes, cluster: str, worker_id: str, fields: Mapping) -> bytes:
    """``HMAC-SHA256(secret, msgpack([label, cluster, worker_id, seq, epoch, type, hashes, parent, block_size,
    ts]))`` of one stream entry, each field as the bytes Redis stores (a missing ``parent`` as nil): the
    ``mac`` field of a signed entry. ``fields`` may be keyed by str or bytes."""
    msg = msgpack.packb([_EVENT_MAC_LABEL, cluster.encode(), worker_id.encode(),
                         *(_field(fields, name) for name in _EVENT_SIGNED_FIELDS)], use_bin_type=True)
    return hmac.new(secret, msg, hashlib.sha256).digest()


def snapshot_mac(secret: bytes, cluster: str, worker_id: str, fields: Mapping) -> bytes:
    """``HMAC-SHA256(secret, msgpack([label, cluster, worker_id, epoch, seq, ts, digest]))`` of a snapshot,
    ``digest`` being the hex SHA-256 of its ``hashes`` bytes: the head (epoch, seq) can be checked without
    reading the hashes. ``fields`` may be keyed by str or bytes."""
    msg = msgpack.packb([_SNAPSHOT_MAC_LABEL, cluster.encode(), worker_id.encode(),
                         *(_field(fields, name) for name in ("epoch", "seq", "ts", "digest"))], use_bin_type=True)
    return hmac.new(secret, msg, hashlib.sha256).digest()


def _check_mac(what: str, mac: bytes | None, want: bytes) -> None:
    if mac is None:
        raise ForgedEntry(f"unsigned {what} (written without the cluster secret)")
    if not hmac.compare_digest(mac, want):
        raise ForgedEntry(f"wrong MAC on the {what} (written without the cluster secret, for another worker or "
                          "cluster, or altered)")


def verify_event(fields: Mapping, secret: bytes, cluster: str, worker_id: str) -> None:
    """Check a stream entry's ``mac`` (fields as redis-py returns them).

    Raises:
        ForgedEntry: ``mac`` missing or wrong.
    """
    _check_mac("KV event", _field(fields, "mac"), event_mac(secret, cluster, worker_id, fields))


def verify_snapshot_head(fields: Mapping, secret: bytes, cluster: str, worker_id: str) -> None:
    """Check a snapshot's ``mac`` over its head (:data:`SNAPSHOT_HEAD_FIELDS`); not its hashes.

    Raises:
        ForgedEntry: ``mac`` missing or wrong.
    """
    _check_mac("KV snapshot", _field(fields, "mac"), snapshot_mac(secret, cluster, worker_id, fields))


def verify_snapshot(fields: Mapping, secret: bytes, cluster: str, worker_id: str) -> None:
    """Check a whole snapshot: its head's ``mac`` and that ``hashes`` matches the signed ``digest``.

    Raises:
        ForgedEntry: ``mac`` missing or wrong, or ``hashes`` altered.
    """
    verify_snapshot_head(fields, secret, cluster, worker_id)
    hashes = _field(fields, "hashes") or b""
    if not hmac.compare_digest(hashlib.sha256(hashes).hexdigest().encode(), _field(fields, "digest") or b""):
        raise ForgedEntry("the KV snapshot's hashes do not match its signed digest (altered)")
