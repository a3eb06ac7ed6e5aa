"""The cluster secret: one shared key that authenticates the processes of a cluster to each other.

It guards the two doors through which a process could inject state into a running cluster:

    KV port (decode worker)   mutual HMAC challenge-response before any KV frame is read
                              (kvtransfer/wire/handshake.py)
    worker registry (Redis)   every lease entry carries an HMAC; the router ignores entries
                              without a valid one (cluster/registry.py)
    worker gRPC (router side) the router sends ``authorization: Bearer worker_rpc_token(K)`` on
                              its calls to workers (router/server.py), for workers to check

Where it comes from, in this order:

    PDSERVE_CLUSTER_SECRET_FILE  path of a file holding the secret (surrounding whitespace stripped)
    PDSERVE_CLUSTER_SECRET       the secret itself
    neither                      None: local development mode, no authentication

Each process resolves it once, at start (:func:`cluster_secret`: the worker process base, the
router, the pool controller), and passes it to the KV transport, the registry and the gRPC auth
it builds; none of those reads the environment.

A process that listens on a non-loopback address refuses to start without it (and the router
without a bearer token or TLS) unless ``--insecure`` is given, which it then logs at start and
every minute (:func:`check_exposure`, :class:`InsecureReminder`).

The Ray launcher makes one per cluster with :func:`new_secret` and hands it to every actor
through these variables. The secret is never logged and never sent on the wire.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import time
from collections.abc import Mapping

SECRET_FILE_ENV = "PDSERVE_CLUSTER_SECRET_FILE"
SECRET_ENV = "PDSERVE_CLUSTER_SECRET"
MIN_SECRET_BYTES = 16


def check_secret(secret: bytes | None, source: str = "the cluster secret") -> bytes | None:
    """Return ``secret`` if it is long enough to be a key; None (no authentication) passes through.

    Components never look the secret up themselves: a process resolves it once with
    :func:`cluster_secret` and hands it to what it builds, which checks it with this.

    Raises:
        TypeError: ``secret`` is not bytes.
        ValueError: shorter than :data:`MIN_SECRET_BYTES` bytes (``source`` names where it came from).
    """
    if secret is None:
        return None
    if not isinstance(secret, bytes):
        raise TypeError(f"{source} must be bytes, got {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{source} is {len(secret)} bytes; at least {MIN_SECRET_BYTES} are required "
                         f"(make one with `python -c 'import secrets; print(secrets.token_hex(32))'`)")
    return secret


def cluster_secret(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The cluster secret from ``environ`` (default ``os.environ``), or None if none is configured.

    ``PDSERVE_CLUSTER_SECRET_FILE`` wins over ``PDSERVE_CLUSTER_SECRET``; an empty variable counts as unset.

    Raises:
        ValueError: the file cannot be read or is empty, or the secret is shorter than 16 bytes;
            the message names the variable (never the secret).
    """
    env = os.environ if environ is None else environ
    path = env.get(SECRET_FILE_ENV, "")
    if path:
        try:
            with open(path, "rb") as f:
                value = f.read().strip()
        except OSError as e:
            raise ValueError(f"{SECRET_FILE_ENV}={path!r}: cannot read the secret file: {e.strerror}") from None
        if not value:
            raise ValueError(f"{SECRET_FILE_ENV}={path!r}: the secret file is empty")
        return check_secret(value, f"the secret in {SECRET_FILE_ENV}={path!r}")
    value = env.get(SECRET_ENV, "").strip()
    if value:
        return check_secret(value.encode(), f"{SECRET_ENV}")
    return None


def worker_rpc_token(secret: bytes) -> str:
    """The bearer token the router presents on the workers' gRPC APIs: ``HMAC-SHA256(secret,
    "pdserve-worker-rpc/1")`` in hex, so the secret itself never travels; 64 characters."""
    return hmac.new(secret, b"pdserve-worker-rpc/1", hashlib.sha256).hexdigest()


def new_secret() -> str:
    """A fresh random secret (64 hex characters = 256 bits) for one cluster."""
    return secrets.token_hex(32)


def is_loopback(host: str) -> bool:
    """True for an address only this machine reaches (``127.0.0.0/8``, ``::1``, ``localhost``)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


class InsecureBindError(ValueError):
    """A process was asked to listen on a network address without the credentials that guard it."""


def check_exposure(who: str, host: str, secret: bytes | None, insecure: bool,
                   client_auth: bool | None = None) -> bool:
    """Refuse to run ``who`` on a non-loopback ``host`` unguarded; say whether it runs exposed.

    A process reachable from the network needs the cluster secret (KV handshake, signed registry
    entries, worker RPC token); the router's public API also needs a bearer token or TLS
    (``client_auth``: whether it has one; None for a worker). ``insecure`` (``--insecure``) lets it
    run without them, for a private network, and the caller then warns with :class:`InsecureReminder`.

    Returns:
        True when ``who`` runs exposed (non-loopback, something missing, ``insecure`` given).
    Raises:
        InsecureBindError: non-loopback, something missing, and ``insecure`` not given; the message
            says what is missing and how to provide it.
    """
    if is_loopback(host):
        return False
    missing = []
    if secret is None:
        missing.append(f"a cluster secret ({SECRET_FILE_ENV} or {SECRET_ENV})")
    if client_auth is False:
        missing.append("a bearer token (--token-file or PDSERVE_ROUTER_TOKEN) or TLS (--tls-cert/--tls-key)")
    if not missing:
        return False
    if not insecure:
        raise InsecureBindError(f"{who} would listen on {host}, reachable from the network, without "
                                f"{' and '.join(missing)}; provide it, or pass --insecure to run unauthenticated "
                                "on a network you trust")
    return True


class InsecureReminder:
    """Logs that ``who`` runs unauthenticated on the network: at once, then at most every ``period_s``
    seconds when :meth:`tick` is called (from a loop the process runs anyway)."""

    def __init__(self, who: str, host: str, period_s: float = 60.0,
                 log: logging.Logger = logging.getLogger(__name__)) -> None:
        self._text = (f"INSECURE: {who} listens on {host} without authentication (--insecure): anyone who "
                      "reaches this address can use it")
        self._period_s, self._log, self._last = period_s, log, float("-inf")
        self.num_warnings = 0
        self.tick()

    def tick(self, now: float | None = None) -> None:
        """Warn again if ``period_s`` passed since the last warning (``now``: ``time.monotonic()``)."""
        now = time.monotonic() if now is None else now
        if now - self._last >= self._period_s:
            self._log.warning(self._text)
            self._last, self.num_warnings = now, self.num_warnings + 1
