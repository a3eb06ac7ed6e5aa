"""The cluster secret: where it comes from, the authenticated KV port (a real TcpKVReceiver and
TcpKVSender on 127.0.0.1, raw sockets as impostors) and the signed worker registry (real Redis).
Router TLS + token and a whole secret-protected cluster: tests/test_router_security.py."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import threading
import time
import uuid

import msgpack
import pytest
import redis
import torch

from pdserve.cluster.registry import RegistryReader, WorkerInfo, WorkerLease, entry_mac
from pdserve.cluster.secret import SECRET_ENV, SECRET_FILE_ENV, cluster_secret, new_secret
from pdserve.kvtransfer.base import TransferError
from pdserve.kvtransfer.tcp import TcpKVReceiver, TcpKVSender
from pdserve.kvtransfer.wire.handshake import PROTO, read_message, write_message
from tests.kv_helpers import Outcome, make_spec

pytestmark = pytest.mark.timeout(30)

SECRET = b"0123456789abcdef0123456789abcdef"
OTHER_SECRET = b"fedcba9876543210fedcba9876543210"
SRC, DST = [3, 0, 5], [1, 6, 2]


@pytest.fixture(autouse=True)
def no_env_secret(monkeypatch):
    """Tests choose their secrets explicitly; an operator's environment must not leak in."""
    for name in (SECRET_ENV, SECRET_FILE_ENV, "PDSERVE_ROUTER_TOKEN"):
        monkeypatch.delenv(name, raising=False)


# -- the secret itself ---------------------------------------------------------------------------


def test_cluster_secret_sources_and_errors(tmp_path):
    path = tmp_path / "secret"
    path.write_text("  " + SECRET.decode() + "\n")
    assert cluster_secret({}) is None
    assert cluster_secret({SECRET_ENV: "  "}) is None  # blank counts as unset
    assert cluster_secret({SECRET_ENV: OTHER_SECRET.decode()}) == OTHER_SECRET
    assert cluster_secret({SECRET_FILE_ENV: str(path), SECRET_ENV: OTHER_SECRET.decode()}) == SECRET  # file wins
    with pytest.raises(ValueError, match=SECRET_ENV + ".*at least 16"):
        cluster_secret({SECRET_ENV: "short"})
    with pytest.raises(ValueError, match=SECRET_FILE_ENV + ".*cannot read"):
        cluster_secret({SECRET_FILE_ENV: str(tmp_path / "missing")})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match=SECRET_FILE_ENV + ".*empty"):
        cluster_secret({SECRET_FILE_ENV: str(tmp_path / "empty")})
    a, b = new_secret(), new_secret()
    assert a != b and len(a) == 64 and cluster_secret({SECRET_ENV: a}) == a.encode()
    with pytest.raises(ValueError, match="at least 16"):
        TcpKVSender(torch.zeros(make_spec().shape), make_spec(), secret=b"short")


# -- KV port ---------------------------------------------------------------------------------------





@pytest.fixture
def kv():
    """A receiver with SECRET (1 s handshake / io timeout), its cache, and a source cache."""
    spec = make_spec()
    src, dst = torch.randn(spec.shape), spec.allocate()
    rx = TcpKVReceiver(dst, spec, io_timeout_s=1.0, secret=SECRET)
    senders: list[TcpKVSender] = []

    def sender(secret: bytes | None) -> TcpKVSender:
        senders.append(TcpKVSender(src, spec, connect_timeout_s=1.0, io_timeout_s=2.0, secret=secret))
        return senders[-1]

    yield spec, src, dst, rx, sender
    for s in senders:
        s.close()
    rx.close()


def expect(rx: TcpKVReceiver, rid: str) -> Outcome:
    out = Outcome()
    rx.expect(rid, DST, 10.0, out.on_complete, out.on_failed)
    return out


def transfer(tx: TcpKVSender, rx: TcpKVReceiver, rid: str, token: int = 9):
    ch = tx.open(rid, rx.address)
    ch.send_pages((0, 2), SRC, DST)
    return ch.finish(token)


def assert_honest_transfer_completes(spec, src, dst, rx, sender, out: Outcome, rid: str) -> None:
    """After whatever was refused, the registration still completes, with exact bytes."""
    stats = transfer(sender(SECRET), rx, rid)
    assert stats.num_pages == len(DST)
    assert out.event.wait(5) and out.calls == [("complete", rid, 9)]
    for s, d in zip(SRC, DST):
        assert torch.equal(dst[d], src[s])
    assert not dst[[b for b in range(spec.num_blocks) if b not in DST]].any()


def wait_refused(rx: TcpKVReceiver, n: int) -> None:
    """Wait until ``rx`` counted ``n`` refused connections (counted after the peer is told)."""
    deadline = time.monotonic() + 3
    while rx.num_refused < n and time.monotonic() < deadline:
        time.sleep(0.02)
    assert rx.num_refused == n


def test_authenticated_transfer_copies_exact_pages(kv):
    spec, src, dst, rx, sender = kv
    out = expect(rx, "r1")
    assert_honest_transfer_completes(spec, src, dst, rx, sender, out, "r1")
    assert rx.num_refused == 0


@pytest.mark.parametrize("secret", [None, OTHER_SECRET], ids=["no-secret", "wrong-secret"])
def test_receiver_refuses_sender_without_the_secret(kv, secret):
    spec, src, dst, rx, sender = kv
    out = expect(rx, "r1")
    with pytest.raises(TransferError, match="r1") as err:
        transfer(sender(secret), rx, "r1")
    if secret is not None:  # an authenticating sender is told why
        assert "refused our authentication" in str(err.value) and "proof is wrong" in str(err.value)
    wait_refused(rx, 1)
    assert not dst.any(), "a refused sender wrote into the KV cache"
    assert out.calls == []  # the registration is untouched ...
    assert_honest_transfer_completes(spec, src, dst, rx, sender, out, "r1")  # ... and still completes


def test_raw_frames_without_handshake_never_reach_the_cache(kv):
    """A pages frame + payload sent straight after connect (no handshake) is refused unread."""
    spec, src, dst, rx, sender = kv
    out = expect(rx, "r1")
    host, port = rx.address.rsplit(":", 1)
    header = msgpack.packb({"type": "pages", "request_id": "r1", "layer_start": 0, "layer_end": 2,
                            "block_ids": DST, "dtype": "float32", "shape": [3, 2, 2, 4, 2, 3],
                            "nbytes": 3 * spec.page_nbytes(2)})
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(struct.pack(">I", len(header)) + header + torch.ones(3 * spec.page_nbytes(2) // 4).numpy()
                     .tobytes())
        challenge = read_message(sock, "auth_challenge", time.monotonic() + 2)
        assert challenge["proto"] == PROTO and len(challenge["nonce"]) == 32
        result = read_message(sock, "auth_result", time.monotonic() + 2)
        assert result["ok"] is False and "the peer has no cluster secret" in result["error"]
    wait_refused(rx, 1)
    assert not dst.any() and out.calls == []
    assert_honest_transfer_completes(spec, src, dst, rx, sender, out, "r1")


@pytest.mark.parametrize("trickle", [False, True], ids=["silent", "trickling"])
def test_stalled_peer_is_dropped_within_the_handshake_timeout(kv, trickle):
    spec, src, dst, rx, sender = kv
    out = expect(rx, "r1")
    host, port = rx.address.rsplit(":", 1)
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        read_message(sock, "auth_challenge", time.monotonic() + 2)
        closed_at, drip = None, iter(struct.pack(">I", 200) + bytes(200))  # a valid prefix, then a slow body
        while closed_at is None and time.monotonic() - started < 4:
            if trickle:  # one byte per 0.2 s: each read is quick, the whole handshake is not
                try:
                    sock.sendall(bytes([next(drip)]))
                except OSError:
                    closed_at = time.monotonic()
                    break
            sock.settimeout(0.2)
            try:
                if sock.recv(4096) == b"":
                    closed_at = time.monotonic()
            except TimeoutError:
                pass
            except OSError:
                closed_at = time.monotonic()
    assert closed_at is not None, "the stalled peer was never dropped"
    assert 0.9 < closed_at - started < 1.0 + 1.5  # dropped by io_timeout_s (1 s), which bounds the whole handshake
    wait_refused(rx, 1)
    assert not dst.any() and out.calls == []
    assert_honest_transfer_completes(spec, src, dst, rx, sender, out, "r1")


def impostor_receiver(behaviour: str) -> tuple[socket.socket, list[bytes], threading.Thread]:
    """A listener that does not hold the secret. ``"fake_ok"``: challenges, ignores the proof and
    claims success with a random proof; ``"silent"``: never speaks. Records bytes sent after that."""
    listener = socket.create_server(("127.0.0.1", 0))
    received: list[bytes] = []

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            deadline = time.monotonic() + 3
            if behaviour == "fake_ok":
                write_message(conn, {"type": "auth_challenge", "proto": PROTO, "nonce": os.urandom(32)}, deadline)
                read_message(conn, "auth_response", deadline)
                write_message(conn, {"type": "auth_result", "ok": True, "proof": os.urandom(32), "error": ""},
                              deadline)
            conn.settimeout(2.0)
            try:
                while chunk := conn.recv(65536):
                    received.append(chunk)
            except OSError:
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, received, thread


@pytest.mark.parametrize("behaviour,cause", [("fake_ok", "receiver's proof is wrong"),
                                             ("silent", "no valid authentication challenge")])
def test_sender_never_pushes_pages_to_an_impostor(kv, behaviour, cause):
    spec, src, dst, rx, sender = kv
    listener, received, thread = impostor_receiver(behaviour)
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    started = time.monotonic()
    with pytest.raises(TransferError, match=cause):
        sender(SECRET).open("r9", address)
    assert time.monotonic() - started < 1.0 + 0.8  # connect_timeout_s bounds the handshake
    thread.join(5)
    listener.close()
    assert received == [], "the sender sent bytes to a receiver that did not prove the secret"


# -- registry --------------------------------------------------------------------------------------


def test_registry_lists_only_signed_entries(redis_url, caplog):
    cluster = "sec-" + uuid.uuid4().hex[:8]
    r = redis.Redis.from_url(redis_url)
    lease = WorkerLease(redis_url, cluster, 5.0, secret=SECRET)
    try:
        lease.renew(WorkerInfo("d0", "decode", "127.0.0.1:1", kv_address="127.0.0.1:2"))
        forged = WorkerInfo("evil", "decode", "10.0.0.66:1", kv_address="10.0.0.66:2", num_free_blocks=10**6)
        r.set(f"pdserve:{cluster}:worker:evil", msgpack.packb(forged.__dict__), px=5000)  # no MAC
        other = WorkerLease(redis_url, cluster, 5.0, secret=OTHER_SECRET)
        other.renew(WorkerInfo("evil2", "prefill", "10.0.0.66:3"))  # signed with another key
        other.close()
        good_raw = r.get(f"pdserve:{cluster}:worker:d0")  # a valid entry replayed under another id
        r.set(f"pdserve:{cluster}:worker:evil3", good_raw, px=5000)

        async def read(secret):
            reader = RegistryReader(redis_url, cluster, secret=secret)
            try:
                return [await reader.list_workers() for _ in range(2)]
            finally:
                await reader.close()

        with caplog.at_level("WARNING", logger="pdserve.cluster.registry"):
            first, second = asyncio.run(read(SECRET))
        assert [w.worker_id for w in first] == [w.worker_id for w in second] == ["d0"]
        assert first[0].kv_address == "127.0.0.1:2" and first[0].heartbeat_at > 0
        warned = sorted(rec.getMessage().split("'")[1] for rec in caplog.records)
        assert warned == ["evil", "evil2", "evil3"]  # once per worker id, not once per read
        assert "unsigned" in caplog.text and "wrong MAC" in caplog.text
        # without a secret nothing is checked (local development mode): every decodable entry is listed
        unchecked, _ = asyncio.run(read(None))
        assert sorted(w.worker_id for w in unchecked) == ["d0", "d0", "evil", "evil2"]
        assert len(entry_mac(SECRET, cluster, "d0", b"x")) == 32
    finally:
        for key in r.scan_iter(f"pdserve:{cluster}:*"):
            r.delete(key)
        lease.close()
        r.close()
