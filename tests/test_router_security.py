"""Router TLS + bearer token and a whole cluster with a cluster secret, as real processes (the secret
passed in their environment, as the Ray launcher does): tokens checked, health open, plaintext refused,
a forged registry entry never listed, generation end to end over authenticated KV transfer, no leaked
KV block, and every listener bound to loopback in local mode."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import struct
import time
import uuid
from pathlib import Path

import grpc
import msgpack
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.cluster.registry import WorkerInfo
from pdserve.cluster.secret import SECRET_ENV, SECRET_FILE_ENV, new_secret
from pdserve.deploy import client
from pdserve.deploy.processes import spawn_role
from pdserve.kvtransfer.wire.handshake import PROTO, read_message
from pdserve.proto import pdserve_pb2
from pdserve.router.config import RouterConfig
from tests.tls_files import make_tls_files

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def no_env_token(monkeypatch):
    monkeypatch.delenv("PDSERVE_ROUTER_TOKEN", raising=False)


def listening_addresses(pid: int) -> set[tuple[str, int]]:
    """(ip, port) of every TCP socket process ``pid`` listens on, from /proc (IPv4 and IPv6;
    an IPv4-mapped IPv6 address, as gRPC binds ``127.0.0.1``, is given as the IPv4 address)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                continue
            ip_hex, port_hex = cols[1].split(":")
            raw = b"".join(struct.pack("<I", int(ip_hex[i:i + 8], 16)) for i in range(0, len(ip_hex), 8))
            ip = ipaddress.ip_address(socket.inet_ntop(family, raw))
            ip = getattr(ip, "ipv4_mapped", None) or ip
            found.add((str(ip), int(port_hex, 16)))
    return found


@pytest.fixture(scope="module")
def secure_cluster(tmp_path_factory, redis_url, model_dir):
    """d0 + p0 + router as processes sharing a cluster secret; the router serves TLS and wants a token."""
    tmp = tmp_path_factory.mktemp("secure")
    tls, token = make_tls_files(tmp), new_secret()
    (tmp / "token").write_text(token + "\n")
    env = {SECRET_ENV: new_secret(), SECRET_FILE_ENV: "", "PDSERVE_ROUTER_TOKEN": ""}
    cluster = "sec-" + uuid.uuid4().hex[:8]
    common = dict(model_dir=model_dir, cluster=cluster, redis_url=redis_url, lease_s=2.0)
    procs = []
    try:
        procs.append(spawn_role("decode_worker", dict(worker_id="d0", **common), "d0", env=env))
        procs.append(spawn_role("prefill_worker", dict(worker_id="p0", **common), "p0", env=env))
        procs.append(spawn_role("router", dict(model_dir=model_dir, cluster=cluster, redis_url=redis_url,
                                               kv_timeout_s=10.0, tls_cert_file=tls["cert"], tls_key_file=tls["key"],
                                               token_file=str(tmp / "token")), "router", env=env))
        yield dict(address=procs[-1].address, ca=tls["ca"], token=token, cluster=cluster, procs=procs)
    finally:
        for p in reversed(procs):
            p.stop()


def call(address: str, fn, **channel_kw):
    """Run ``fn(channel)`` on a fresh ``client.open_channel(address, **channel_kw)`` (30 s at most)."""
    async def go():
        async with client.open_channel(address, **channel_kw) as channel:
            return await asyncio.wait_for(fn(channel), 30)
    return asyncio.run(go())


def state(channel):
    return client.cluster_state(channel)


def test_router_security_settings_are_checked_at_startup(tmp_path, monkeypatch):
    tls = make_tls_files(tmp_path)
    (tmp_path / "short").write_text("abc\n")
    (tmp_path / "notpem").write_text("hello\n")
    for kw, match in ((dict(tls_cert_file=tls["cert"]), "together"),
                      (dict(tls_cert_file=str(tmp_path / "notpem"), tls_key_file=tls["key"]), "no PEM block"),
                      (dict(tls_cert_file=tls["cert"], tls_key_file=str(tmp_path / "nope")), "cannot be read"),
                      (dict(token_file=str(tmp_path / "short")), "at least 16"),
                      (dict(token_file=str(tmp_path / "nope")), "cannot be read")):
        with pytest.raises(ValueError, match=match):
            RouterConfig(model_dir="m", **kw)
    monkeypatch.setenv("PDSERVE_ROUTER_TOKEN", "has spaces in it, not a token")
    with pytest.raises(ValueError, match="PDSERVE_ROUTER_TOKEN.*visible ASCII"):
        RouterConfig(model_dir="m")
    monkeypatch.setenv("PDSERVE_ROUTER_TOKEN", " " + "t" * 20 + "\n")
    assert RouterConfig(model_dir="m").bearer_token() == "t" * 20
    assert RouterConfig(model_dir="m", tls_cert_file=tls["cert"], tls_key_file=tls["key"]).tls_key_pair()[0].startswith(
        b"-----BEGIN")
    with pytest.raises(ValueError, match="holds no PEM certificate"):
        client.open_channel("127.0.0.1:1", tls_ca_file=str(tmp_path / "notpem"))


def test_router_rejects_calls_without_the_token(secure_cluster):
    c = secure_cluster
    for kw, why in ((dict(), "missing"), (dict(token="not-the-token-0123456789"), "invalid bearer token")):
        for fn in (state, lambda ch: client.complete(ch, client.make_request("Hi"), timeout_s=10)):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                call(c["address"], fn, tls_ca_file=c["ca"], **kw)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and why in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:  # a plaintext client cannot talk to the TLS port at all
        call(c["address"], state, token=c["token"])
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    for kw in (dict(), dict(token="not-the-token-0123456789")):  # load balancers probe without a token
        assert call(c["address"], health, tls_ca_file=c["ca"], **kw) == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as err:  # a held-open Watch stream needs it: no lock-out
            call(c["address"], watch, tls_ca_file=c["ca"], **kw)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert call(c["address"], watch, tls_ca_file=c["ca"], token=c["token"]) == health_pb2.HealthCheckResponse.SERVING
    assert len(call(c["address"], state, tls_ca_file=c["ca"], token=c["token"]).workers) == 2


async def health(channel) -> int:
    return (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))).status


async def watch(channel) -> int:
    """The first status of a health ``Watch`` stream (then the stream is cancelled)."""
    stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
    try:
        return (await stream.read()).status
    finally:
        stream.cancel()


def test_generate_through_a_secret_protected_cluster(secure_cluster, redis_url):
    c = secure_cluster
    r = redis.Redis.from_url(redis_url)
    forged = WorkerInfo("evil", "decode", "127.0.0.1:9", kv_address="127.0.0.1:9", num_total_blocks=10**6,
                        num_free_blocks=10**6, heartbeat_at=time.time())
    r.set(f"pdserve:{c['cluster']}:worker:evil", msgpack.packb(forged.__dict__), px=60_000)  # unsigned
    try:
        workers = call(c["address"], state, tls_ca_file=c["ca"], token=c["token"]).workers
        assert sorted(w.worker_id for w in workers) == ["d0", "p0"]  # the forged entry is never listed
        out = call(c["address"], lambda ch: client.complete(ch, client.make_request(
            "Once upon a time", max_tokens=6, temperature=0, ignore_eos=True), timeout_s=60),
            tls_ca_file=c["ca"], token=c["token"])
        assert len(out.token_ids) == 6 and out.final.finish_reason == pdserve_pb2.FINISH_REASON_LENGTH
        assert out.final.usage.completion_tokens == 6 and out.final.num_retries == 0
    finally:
        r.delete(f"pdserve:{c['cluster']}:worker:evil")
        r.close()
    decode = next(w for w in workers if w.role == "decode")
    host, port = decode.kv_address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:  # the real KV port demands the handshake
        assert read_message(sock, "auth_challenge", time.monotonic() + 3)["proto"] == PROTO
    deadline = time.monotonic() + 6  # no leaked KV block
    while True:
        workers = call(c["address"], state, tls_ca_file=c["ca"], token=c["token"]).workers
        if all(w.num_free_blocks == w.num_total_blocks for w in workers) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert all(w.num_free_blocks == w.num_total_blocks for w in workers), workers


def test_local_mode_binds_every_listener_to_loopback(secure_cluster):
    c = secure_cluster
    workers = call(c["address"], state, tls_ca_file=c["ca"], token=c["token"]).workers
    advertised = {c["address"]} | {w.address for w in workers} | {w.kv_address for w in workers if w.kv_address}
    assert len(advertised) == 4 and all(a.startswith("127.0.0.1:") for a in advertised)
    bound = set().union(*(listening_addresses(p.proc.pid) for p in c["procs"]))
    assert {f"{ip}:{port}" for ip, port in bound} >= advertised
    assert all(ip in ("127.0.0.1", "::1") for ip, _ in bound), bound  # nothing on 0.0.0.0 or a public address
    assert RouterConfig(model_dir="m").host == "127.0.0.1"


def test_plaintext_router_with_token_in_process(tmp_path, redis_url, model_dir):
    """Token without TLS (local use): ``open_channel`` sends it as metadata; the Router class in-process."""
    from pdserve.router.server import Router

    token = new_secret()
    (tmp_path / "token").write_text(token)
    cfg = RouterConfig(model_dir=model_dir, cluster="tok-" + uuid.uuid4().hex[:8], redis_url=redis_url,
                       token_file=str(tmp_path / "token"))

    async def go():
        router = Router(cfg)
        address = await router.start()
        try:
            results = []
            for kw in (dict(token=token), dict(), dict(token=token[::-1])):
                async with client.open_channel(address, **kw) as channel:
                    try:
                        results.append(len((await client.cluster_state(channel)).workers))
                    except grpc.aio.AioRpcError as e:
                        results.append(e.code())
                    try:  # a unary-stream call carries the token too (no worker: UNAVAILABLE past the check)
                        await client.complete(channel, client.make_request("Hi"), timeout_s=10)
                    except grpc.aio.AioRpcError as e:
                        results.append(e.code())
            return results
        finally:
            await router.stop()

    unauth, unavailable = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAVAILABLE
    assert asyncio.run(go()) == [0, unavailable, unauth, unauth, unauth, unauth]


def test_a_router_without_the_secret_says_why_the_workers_refuse_it(secure_cluster, redis_url, model_dir):
    """A router started without the cluster's secret reads the workers' signed registry entries (a reader
    without the secret cannot check them) and the workers refuse its calls; it says why, once, in an error
    line, where the only sign had been each request's "missing bearer token"."""
    env = {SECRET_ENV: "", SECRET_FILE_ENV: "", "PDSERVE_ROUTER_TOKEN": ""}
    router = spawn_role("router", dict(model_dir=model_dir, cluster=secure_cluster["cluster"], redis_url=redis_url,
                                       registry_poll_s=0.1), "bare router", env=env)
    try:
        with pytest.raises(grpc.aio.AioRpcError):
            call(router.address, lambda ch: client.complete(ch, client.make_request("Hi", max_tokens=2), timeout_s=10))
    finally:
        router.stop()
    errors = router.proc.stderr.read()
    assert errors.count("sign their registry entries with a cluster secret, and this router has none") == 1, errors
