"""Redis with a password (AUTH) and over TLS (``rediss://``): the registry, admission, KV events and
index sync all reach a private real ``redis-server`` through their URL alone; a wrong password is
a clear error, and ``ensure_redis`` never starts a server for a URL it cannot serve."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
import uuid
from urllib.parse import quote

import pytest
import redis

from pdserve.cluster.kv_events import KVEvent, KVEventPublisher, read_events
from pdserve.cluster.registry import RegistryReader, WorkerInfo, WorkerLease
from pdserve.deploy.redis_server import ensure_redis, ping_error, redact, redis_server_binary
from pdserve.model.block_hash import block_hashes, root_hash
from pdserve.router.admission import Admission
from pdserve.router.index_sync import IndexSync
from pdserve.router.prefix_index import PrefixIndex
from tests.tls_files import make_tls_files

pytestmark = pytest.mark.timeout(60)

PASSWORD = "s3cret pw/with:odd@chars"  # percent-encoded in the URL
SECRET = b"0123456789abcdef0123456789abcdef"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(tmp_path, *args: str, url: str) -> subprocess.Popen:
    """A private redis-server (no persistence) with extra ``args``; returns once it answers at ``url``."""
    proc = subprocess.Popen([redis_server_binary(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path), *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 10
    while (error := ping_error(url, 0.3)) is not None:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"private redis-server did not come up: {error}; {proc.stderr.read()[-2000:]!r}")
        time.sleep(0.05)
    return proc


@pytest.fixture(scope="module")
def auth_redis(tmp_path_factory):
    """``redis://:password@127.0.0.1:PORT/0`` of a private server started with ``--requirepass``."""
    tmp, port = tmp_path_factory.mktemp("redis-auth"), free_port()
    url = f"redis://:{quote(PASSWORD, safe='')}@127.0.0.1:{port}/0"
    proc = start_redis(tmp, "--port", str(port), "--requirepass", PASSWORD, url=url)
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    """``rediss://:password@127.0.0.1:PORT/0?ssl_ca_certs=...`` of a private TLS-only server with a password."""
    tmp, port = tmp_path_factory.mktemp("redis-tls"), free_port()
    tls = make_tls_files(tmp)
    url = (f"rediss://:{quote(PASSWORD, safe='')}@127.0.0.1:{port}/0"
           f"?ssl_ca_certs={quote(tls['ca'], safe='')}&ssl_cert_reqs=required")
    proc = start_redis(tmp, "--port", "0", "--tls-port", str(port), "--tls-cert-file", tls["cert"],
                       "--tls-key-file", tls["key"], "--tls-ca-cert-file", tls["ca"], "--tls-auth-clients", "no",
                       "--requirepass", PASSWORD, url=url)
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture(params=["auth", "tls"])
def secured_url(request):
    return request.getfixturevalue(f"{request.param}_redis")


def test_lease_registry_admission_events_and_index_sync(secured_url):
    cluster = "sec-" + uuid.uuid4().hex[:8]
    lease = WorkerLease(secured_url, cluster, 5.0, secret=SECRET)
    lease.renew(WorkerInfo("d0", "decode", "127.0.0.1:1", kv_address="127.0.0.1:2", num_free_blocks=7))
    lease.renew(WorkerInfo("p0", "prefill", "127.0.0.1:3"))
    tokens = list(range(1, 10))  # two full blocks of 4
    pub = KVEventPublisher(secured_url, cluster, "p0", retry_s=0.05)
    pub.publish_cleared(4)
    pub.publish(KVEvent("stored", block_hashes(tokens, 4), parent=root_hash(), block_size=4))
    assert pub.flush(5.0) and pub.num_published == 2 and pub.num_dropped == 0
    pub.close()
    assert [e.type for e in read_events(secured_url, cluster, "p0")] == ["cleared", "stored"]

    async def router_side():
        reader, adm = RegistryReader(secured_url, cluster, secret=SECRET), Admission(secured_url, cluster)
        index = PrefixIndex(block_size=4)
        sync = IndexSync(secured_url, cluster, index)
        try:
            workers = await reader.list_workers()
            sync.set_workers([w.worker_id for w in workers if w.role == "prefill"])
            await sync.sync_once()
            decision = await adm.try_admit("r1", "p0", 0.2, 1.0, "d0", (0.01, 0.001, 0.0, 100), 0.1)
            held = await adm.load("p0", "d0")
            await adm.release_prefill("r1", "p0")
            await adm.release_decode("r1", "d0")
            return workers, index.lookup(tokens), decision, held, await adm.load("p0", "d0")
        finally:
            await reader.close()
            await adm.aclose()
            await sync.aclose()

    try:
        workers, cached, decision, held, released = asyncio.run(router_side())
    finally:
        lease.release("d0")
        lease.release("p0")
        lease.close()
    assert [(w.worker_id, w.num_free_blocks) for w in workers] == [("d0", 7), ("p0", 0)]
    assert cached == {"p0": 2}
    assert decision.admitted and decision.predicted_ttft_s == pytest.approx(0.2)
    assert held["prefill_reserved_s"] == pytest.approx(0.2) and held["decode_requests"] == 1
    assert released["prefill_reserved_s"] == 0 and released["decode_requests"] == 0


@pytest.mark.parametrize("which", ["auth", "tls"])
def test_wrong_or_missing_password_is_a_clear_error(request, which):
    url = request.getfixturevalue(f"{which}_redis")
    wrong = url.replace(quote(PASSWORD, safe=""), "not-the-password")
    with pytest.raises(redis.AuthenticationError, match="WRONGPASS|invalid username-password"):
        WorkerLease(wrong, "c", 1.0).renew(WorkerInfo("d0", "decode", "x:1"))
    missing = url.replace(f":{quote(PASSWORD, safe='')}@", "")
    with pytest.raises(redis.AuthenticationError):
        asyncio.run(RegistryReader(missing, "c").list_workers())
    for bad in (wrong, missing):
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="AuthenticationError.*wrong or missing password") as err:
            ensure_redis(bad)  # reports the error; never starts a second server on that port
        assert time.monotonic() - started < 5
        assert "not-the-password" not in str(err.value) and redact(bad) in str(err.value)  # password redacted


def test_ensure_redis_does_not_start_servers_it_cannot_serve():
    port = free_port()  # nothing listens here
    for url, why in ((f"rediss://127.0.0.1:{port}/0", "scheme is rediss"),
                     (f"redis://:pw@127.0.0.1:{port}/0", "carries credentials"),
                     (f"redis://10.255.255.1:{port}/0", "not this machine")):
        with pytest.raises(RuntimeError, match=why):
            ensure_redis(url)
        assert ping_error(f"redis://127.0.0.1:{port}/0", 0.3) is not None  # still nothing started there
    assert redact("redis://u:pw@h:1/0") == "redis://u:***@h:1/0" and redact("redis://h:1/0") == "redis://h:1/0"


def test_plaintext_client_cannot_use_the_tls_port(tls_redis):
    plain = tls_redis.replace("rediss://", "redis://").split("?")[0]
    assert isinstance(ping_error(plain, 1.0), redis.ConnectionError)
