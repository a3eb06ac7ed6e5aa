"""The KV receiver under a connection flood, a byte-trickling peer and failing handler threads: a real
TcpKVReceiver and TcpKVSender on 127.0.0.1, raw sockets as the flood; and a worker whose receiver died
leaving the real Redis registry (kvtransfer/wire/listener.py, cluster/worker_process.py)."""

from __future__ import annotations

import resource
import select
import socket
import statistics
import struct
import threading
import time
import uuid
from types import SimpleNamespace

import msgpack
import pytest
import redis
import torch

from pdserve.cluster.registry import WorkerInfo
from pdserve.cluster.secret import SECRET_ENV, SECRET_FILE_ENV
from pdserve.cluster.worker_process import Heartbeat, WorkerConfig, WorkerProcess
from pdserve.kvtransfer.base import TransferError
from pdserve.kvtransfer.tcp import TcpKVReceiver, TcpKVSender
from pdserve.kvtransfer.wire.frames import BUSY, read_header_bytes, unpack_header
from pdserve.kvtransfer.wire.handshake import authenticate_receiver
from tests.kv_helpers import Outcome, make_spec

pytestmark = pytest.mark.timeout(120)

SECRET = b"0123456789abcdef0123456789abcdef"
NUM_FLOOD = 2500  # idle connections from this process
MAX_CONNECTIONS = 64  # the receiver's limit in these tests
IO_TIMEOUT_S = 3.0
TRICKLE_EVERY_S = 0.2  # one byte per this, well inside IO_TIMEOUT_S: a per-recv timeout never fires
SPEC = make_spec(num_blocks=64, num_layers=4, block_size=16, num_kv_heads=4, head_dim=32)  # 64 KiB per block
SRC_BLOCKS, DST_BLOCKS = list(range(0, 32)), list(range(32, 64))  # 2 MiB per transfer


@pytest.fixture(autouse=True)
def no_env_secret(monkeypatch):
    for name in (SECRET_ENV, SECRET_FILE_ENV):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def enough_fds():
    """Room for the flood's client sockets plus the receiver's (both ends live in this process)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * NUM_FLOOD + 1024
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {need}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def transfer(rx: TcpKVReceiver, tx: TcpKVSender, src: torch.Tensor, dst: torch.Tensor, rid: str) -> float:
    """One real transfer of SRC_BLOCKS into DST_BLOCKS, checked; returns its seconds (open to callback)."""
    out = Outcome()
    rx.expect(rid, DST_BLOCKS, 30.0, out.on_complete, out.on_failed)
    t0 = time.perf_counter()
    ch = tx.open(rid, rx.address)
    for i in range(0, len(SRC_BLOCKS), 8):  # four pages frames, as a chunked prefill sends them
        ch.send_pages((0, SPEC.num_layers), SRC_BLOCKS[i:i + 8], DST_BLOCKS[i:i + 8])
    ch.finish(7)
    assert out.wait(10) == ("complete", rid, 7)
    seconds = time.perf_counter() - t0
    assert torch.equal(dst[DST_BLOCKS], src[SRC_BLOCKS])
    dst[DST_BLOCKS] = 0
    return seconds


def connect(rx: TcpKVReceiver) -> socket.socket:
    host, port = rx.address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10.0)


def messages(sock: socket.socket, wait_s: float) -> list[dict]:
    """Every length-prefixed msgpack message (handshake messages and frame headers) the receiver sent
    before closing, as maps; stops at EOF, a reset, or after ``wait_s`` of silence."""
    out = []
    sock.settimeout(wait_s)
    try:
        while (body := read_header_bytes(sock)) is not None:
            out.append(unpack_header(body))
    except OSError:
        pass
    return out


def busy_nack(msgs: list[dict]) -> bool:
    return any(m.get("type") == "ack" and m.get("ok") is False and m.get("request_id") == ""
               and m.get("error", "").startswith(BUSY) for m in msgs)


def trickle(rx: TcpKVReceiver, secret: bytes | None, result: dict) -> None:
    """A peer that authenticates (when asked to), then announces a 60,000-byte header and sends it one
    byte every TRICKLE_EVERY_S; records how long the receiver took to drop it and the bytes it sent."""
    sock = connect(rx)
    t0 = time.monotonic()
    sent = 0
    try:
        if secret is not None:
            authenticate_receiver(sock, secret, 5.0)
        sock.sendall(struct.pack(">I", 60_000))
        sock.settimeout(TRICKLE_EVERY_S)
        while time.monotonic() - t0 < 4 * IO_TIMEOUT_S:
            try:
                if sock.recv(1) == b"":
                    break  # the receiver closed it
            except TimeoutError:
                pass
            sock.send(b"\x00")
            sent += 1
    except OSError:
        pass  # reset by the receiver
    finally:
        result["dropped_after_s"] = time.monotonic() - t0
        result["bytes"] = sent
        sock.close()


@pytest.mark.parametrize("secret", [None, SECRET], ids=["no-secret", "secret"])
def test_flood_of_idle_connections_and_a_trickler_leave_real_transfers_on_time(secret, enough_fds):
    src, dst = torch.randn(SPEC.shape), SPEC.allocate()
    rx = TcpKVReceiver(dst, SPEC, io_timeout_s=IO_TIMEOUT_S, secret=secret, max_connections=MAX_CONNECTIONS)
    tx = TcpKVSender(src, SPEC, connect_timeout_s=5.0, io_timeout_s=10.0, secret=secret)
    flood: list[socket.socket] = []
    try:
        transfer(rx, tx, src, dst, "warmup")
        baseline = statistics.median(transfer(rx, tx, src, dst, f"base-{i}") for i in range(5))

        t0 = time.monotonic()
        for _ in range(NUM_FLOOD):
            flood.append(connect(rx))
        flood_s = time.monotonic() - t0
        deadline = time.monotonic() + 20
        while rx.stats.num_refused_busy < NUM_FLOOD - MAX_CONNECTIONS:  # every extra one was handled
            assert time.monotonic() < deadline, rx.stats
            time.sleep(0.01)
        handlers = sum(t.name == "kv-conn" for t in threading.enumerate())
        assert handlers <= MAX_CONNECTIONS + 32, f"{handlers} handler threads for {NUM_FLOOD} idle connections"

        trickled: dict = {}
        trickler = threading.Thread(target=trickle, args=(rx, secret, trickled))
        trickler.start()
        time.sleep(0.3)  # the trickler holds a slot now, as do the newest flood connections
        flooded = [transfer(rx, tx, src, dst, f"flood-{i}") for i in range(5)]
        trickler.join(4 * IO_TIMEOUT_S + 5)

        # the trickler kept every recv busy, yet the frame's deadline dropped it
        assert trickled["bytes"] >= 0.5 * IO_TIMEOUT_S / TRICKLE_EVERY_S, trickled
        assert trickled["dropped_after_s"] < IO_TIMEOUT_S + 1.5, trickled

        # every flood connection was either told "busy" at once, or dropped at its deadline
        poller = select.poll()
        for s in flood:
            poller.register(s, select.POLLIN)
        by_fd = {s.fileno(): s for s in flood}
        nacked = dropped = 0
        done: set[int] = set()
        deadline = time.monotonic() + IO_TIMEOUT_S + 5
        while len(done) < len(flood) and time.monotonic() < deadline:
            for fd, _ in poller.poll(200):
                if fd in done:
                    continue
                done.add(fd)
                poller.unregister(fd)
                msgs = messages(by_fd[fd], 1.0)
                if busy_nack(msgs):
                    nacked += 1
                else:
                    dropped += 1
        assert len(done) == len(flood), f"{len(flood) - len(done)} flood connections still open"
        stats = rx.stats
        print(f"\nflood ({'secret' if secret else 'no secret'}): {NUM_FLOOD} idle connections in {flood_s:.2f} s, "
              f"limit {MAX_CONNECTIONS}; transfer of {len(SRC_BLOCKS) * SPEC.page_nbytes(SPEC.num_layers) >> 20} MiB: "
              f"median {baseline * 1e3:.1f} ms before, {statistics.median(flooded) * 1e3:.1f} ms under the flood "
              f"(max {max(flooded) * 1e3:.1f} ms); trickler dropped after {trickled['dropped_after_s']:.2f} s "
              f"({trickled['bytes']} bytes); {nacked} told busy, {dropped} dropped at their deadline; {stats}")
        assert nacked == stats.num_refused_busy >= NUM_FLOOD - MAX_CONNECTIONS
        assert nacked + dropped == NUM_FLOOD
        # the ones not displaced ran out their deadline, as did the trickler: the handshake (secret) or
        # the first frame's header (no secret)
        assert stats.num_refused_auth + stats.num_timed_out == dropped + 1, stats
        assert statistics.median(flooded) < 3 * baseline + 0.25, (baseline, flooded)
        assert rx.alive and stats.num_failed_starts == 0
    finally:
        for s in flood:
            s.close()
        tx.close()
        rx.close()


def test_a_sender_refused_at_the_limit_gets_the_busy_reason():
    """All served connections feed transfers: a new one is refused with the busy nack, and the sender's
    error says so (with a secret the nack arrives in place of the handshake)."""
    src, dst = torch.randn(SPEC.shape), SPEC.allocate()
    rx = TcpKVReceiver(dst, SPEC, io_timeout_s=IO_TIMEOUT_S, secret=SECRET, max_connections=2)
    tx = TcpKVSender(src, SPEC, connect_timeout_s=2.0, io_timeout_s=2.0, secret=SECRET)
    try:
        outs = [Outcome() for _ in range(2)]
        channels = []
        for i, out in enumerate(outs):
            rx.expect(f"r{i}", [DST_BLOCKS[i]], 30.0, out.on_complete, out.on_failed)
            channels.append(tx.open(f"r{i}", rx.address))
            channels[-1].send_pages((0, SPEC.num_layers), [SRC_BLOCKS[i]], [DST_BLOCKS[i]])  # binds it
        deadline = time.monotonic() + 5
        while rx.stats.num_open < 2 or any(c.transfer is None for c in rx._conns.values()):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(TransferError, match=f"refused the connection: {BUSY}"):
            tx.open("r2", rx.address)
        assert rx.stats.num_refused_busy == 1
        for i, ch in enumerate(channels):  # the bound transfers were not disturbed
            ch.finish(i)
            assert outs[i].wait() == ("complete", f"r{i}", i)
    finally:
        tx.close()
        rx.close()


def test_accept_loop_survives_handler_threads_that_cannot_start(monkeypatch):
    src, dst = torch.randn(SPEC.shape), SPEC.allocate()
    rx = TcpKVReceiver(dst, SPEC, io_timeout_s=IO_TIMEOUT_S)
    tx = TcpKVSender(src, SPEC, connect_timeout_s=2.0, io_timeout_s=2.0)
    real_start, failures = threading.Thread.start, [3]

    def start(self):  # a thread or PID limit, for the receiver's first three connection handlers only
        if self.name == "kv-conn" and failures[0] > 0:
            failures[0] -= 1
            raise RuntimeError("can't start new thread")
        return real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    try:
        for _ in range(3):
            with connect(rx) as s:
                msgs = messages(s, 5.0)
            assert busy_nack(msgs) and "can't start new thread" in msgs[-1]["error"], msgs
        assert rx.stats.num_failed_starts == 3 and rx.alive
        assert transfer(rx, tx, src, dst, "after") < 5.0
        assert rx.stats.num_open == 0 or rx.alive
    finally:
        monkeypatch.setattr(threading.Thread, "start", real_start)
        tx.close()
        rx.close()


def test_worker_whose_receiver_stopped_accepting_leaves_the_registry(redis_url):
    """The accept thread dies (here: its listening socket is shut down under it): ``alive`` turns False,
    the worker's default health check says so, and the heartbeat releases the lease and stops renewing."""
    cluster = "flood-" + uuid.uuid4().hex[:8]
    rx = TcpKVReceiver(SPEC.allocate(), SPEC, io_timeout_s=IO_TIMEOUT_S)
    engine = SimpleNamespace(receiver=rx, run_forever=lambda stop: None)
    cfg = WorkerConfig(model_dir="unused", worker_id="d0", cluster=cluster, redis_url=redis_url, lease_s=0.8)
    worker = WorkerProcess(cfg, engine)
    info = lambda: WorkerInfo("d0", "decode", "127.0.0.1:1", kv_address=rx.address)  # noqa: E731
    r = redis.Redis.from_url(redis_url)
    key = f"pdserve:{cluster}:worker:d0"
    beat = Heartbeat(cfg, info, healthy=worker.healthy)
    beat.start()
    try:
        assert worker.healthy() and rx.alive
        time.sleep(0.5)
        assert r.exists(key) and msgpack.unpackb(r.get(key))["lease_s"] == 0.8
        rx._listener.shutdown(socket.SHUT_RDWR)  # accept() fails for good: the accept thread ends
        deadline = time.monotonic() + 5
        while rx.alive:
            assert time.monotonic() < deadline, "receiver still reports alive"
            time.sleep(0.01)
        assert not worker.healthy()
        deadline = time.monotonic() + 2
        while r.exists(key):
            assert time.monotonic() < deadline, "the lease was not released"
            time.sleep(0.02)
        time.sleep(3 * cfg.lease_s)  # and it is not renewed
        assert not r.exists(key)
    finally:
        beat.stop()
        rx.close()
        r.close()
