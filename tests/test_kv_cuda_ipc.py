"""The CUDA IPC KV transport's own checks: what a hostile or broken sender can send it (shares that do not
fit, page lists outside either cache, frames out of order), the per-sender mappings and their eviction,
and how ``--kv-transport cuda-ipc`` is chosen. The transfer contract itself runs in the conformance suite
(tests/test_kvtransfer_conformance*.py, ``cuda-ipc-host`` everywhere and ``cuda-ipc`` on a GPU). The last
test maps a cache across two real processes on a GPU (skipped without one)."""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import msgpack
import pytest
import torch

from pdserve.cluster.worker_config import WorkerConfig
from pdserve.kvtransfer.backends import choose_backend, host_port
from pdserve.kvtransfer.base import TransferError
from pdserve.kvtransfer.cudaipc import CudaIpcKVReceiver, CudaIpcKVSender
from pdserve.kvtransfer.cudaipc.control import IpcHello, IpcPages, encode_control
from pdserve.kvtransfer.cudaipc.handles import PeerCacheError, PeerCaches, check_share, open_peer_cache
from pdserve.kvtransfer.select import explain_no_backend, local_backends, make_receiver
from pdserve.kvtransfer.wire.frames import Ack, Done, encode, read_frame
from pdserve.prefill_worker.server import check_kv_address
from tests.kv_conformance import host_export, host_open, random_cache
from tests.kv_helpers import Outcome, make_spec

pytestmark = pytest.mark.timeout(30)
SPEC = make_spec()


@pytest.fixture
def ends():
    """A receiver over a zeroed CPU cache and a sender over a random one, the driver's calls stood in
    for (tests/kv_conformance.py)."""
    src, dst = random_cache(SPEC, "cpu"), SPEC.allocate()
    rx = CudaIpcKVReceiver(dst, SPEC, io_timeout_s=2.0, open_peer=host_open)
    tx = CudaIpcKVSender(src, SPEC, 1.0, 2.0, sender_id="p0", export=host_export)
    yield src, dst, rx, tx
    tx.close()
    rx.close()


def raw_hello(tx: CudaIpcKVSender, rid: str, **change) -> bytes:
    share = tx._shared(rid)
    return encode_control(dataclasses.replace(IpcHello(**dataclasses.asdict(share), request_id=rid,
                                                       sender_id=tx.sender_id), **change))


def send_raw(rx: CudaIpcKVReceiver, *frames: bytes) -> Ack:
    """Send ``frames`` on one connection; the receiver's answer (its nack, or the ack of a done)."""
    with socket.create_connection(rx.address.removeprefix("cuda-ipc://").rsplit(":", 1)) as sock:
        sock.settimeout(5.0)
        for frame in frames:
            sock.sendall(frame)
        reply = read_frame(sock)
    assert isinstance(reply, Ack)
    return reply


def test_pages_land_and_the_mapping_is_made_once_per_sender(ends):
    src, dst, rx, tx = ends
    for rid, (s, d) in {"r1": ([5, 1], [2, 7]), "r2": ([0], [3])}.items():
        out = Outcome()
        rx.expect(rid, d, 5.0, out.on_complete, out.on_failed)
        ch = tx.open(rid, rx.address)
        ch.send_pages((0, 1), s, d)
        ch.send_pages((1, 2), s, d)
        stats = ch.finish(11)
        assert out.wait() == ("complete", rid, 11)
        assert stats.num_pages == 2 * len(s) and stats.num_bytes == len(s) * SPEC.page_nbytes(2)
        assert torch.equal(dst.view(torch.uint8)[d], src.view(torch.uint8)[s])
    assert rx._peers.names() == ["p0"]


@pytest.mark.parametrize("src_ids, dst_ids, why", [
    ([8], [2], "source block ids [8] are outside the sender's 8 blocks"),
    ([-1], [2], "source block ids [-1] are outside"),
    ([1, 2], [2], "int lists of one length"),
    ([1.5], [2], "int lists of one length"),
    ([1], [5], "block ids [5] are not registered"),
])
def test_page_lists_outside_either_cache_fail_the_request_and_write_nothing(ends, src_ids, dst_ids, why):
    src, dst, rx, tx = ends
    out = Outcome()
    rx.expect("r1", [2, 7], 5.0, out.on_complete, out.on_failed)
    reply = send_raw(rx, raw_hello(tx, "r1"), encode_control(IpcPages("r1", 0, 2, src_ids, dst_ids)))
    assert not reply.ok and why in reply.error
    kind, rid, reason = out.wait()
    assert (kind, rid) == ("failed", "r1") and why in reason
    assert not dst.any()


@pytest.mark.parametrize("change, why", [
    (dict(page_shape=[2, 2, 4, 2, 4]), "pages of [2, 2, 4, 2, 4]"),
    (dict(dtype="bfloat16"), "bfloat16 pages"),
    (dict(num_blocks=9), "does not hold its 9 blocks"),
    (dict(num_blocks=0), "does not hold its 0 blocks"),
    (dict(ref_counter=b"/etc/passwd"), "not one torch makes"),
    (dict(ref_counter_offset=10_000), "not one torch makes"),
    (dict(event_sync=True), "an IPC event of 0 bytes"),
    (dict(handle=b"\0" * 16), "no shared cache"),
    (dict(device_uuid="GPU-elsewhere"), "no shared cache"),
])
def test_a_share_that_does_not_fit_is_refused_before_anything_is_mapped(ends, change, why):
    _, dst, rx, tx = ends
    out = Outcome()
    rx.expect("r1", [2], 5.0, out.on_complete, out.on_failed)
    reply = send_raw(rx, raw_hello(tx, "r1", **change))
    assert not reply.ok and why in reply.error
    assert out.wait()[0] == "failed" and rx._peers.names() == []
    assert not dst.any()


def test_malformed_or_out_of_order_frames_are_refused():
    rx = CudaIpcKVReceiver(SPEC.allocate(), SPEC, io_timeout_s=2.0, open_peer=host_open)
    tx = CudaIpcKVSender(random_cache(SPEC, "cpu"), SPEC, 1.0, 2.0, export=host_export)
    try:
        out = Outcome()
        rx.expect("r1", [2], 5.0, out.on_complete, out.on_failed)
        hello = msgpack.unpackb(raw_hello(tx, "r1")[4:])
        bad = msgpack.packb({**hello, "num_blocks": True})  # a bool is not an int
        reply = send_raw(rx, len(bad).to_bytes(4, "big") + bad)
        assert not reply.ok and "field 'num_blocks' must be int" in reply.error
        assert out.wait()[0] == "failed"
        rx.expect("r2", [2], 5.0, out.on_complete, out.on_failed)
        reply = send_raw(rx, encode_control(IpcPages("r2", 0, 2, [1], [2])))  # pages before any hello
        assert not reply.ok and "expected ipc_hello" in reply.error
        rx.expect("r3", [2], 5.0, out.on_complete, out.on_failed)
        reply = send_raw(rx, raw_hello(tx, "r3"), encode_control(IpcPages("r4", 0, 2, [1], [2])))
        assert not reply.ok and "unexpected" in reply.error and "'r3'" in reply.error
        rx.expect("r5", [2], 5.0, out.on_complete, out.on_failed)
        reply = send_raw(rx, raw_hello(tx, "r5"), encode(Done("r5", 3)))  # done with no pages
        assert not reply.ok and reply.request_id == "r5" and "incomplete transfer: 0 of 2 pages" in reply.error
    finally:
        tx.close()
        rx.close()


def test_a_restarted_sender_replaces_its_mapping_and_a_departed_one_is_dropped():
    opened = []

    def opener(share, spec):
        opened.append(share.handle)
        return host_open(share, spec)

    peers = PeerCaches(SPEC, opener, max_peers=2)
    first, second = host_export(random_cache(SPEC, "cpu")), host_export(random_cache(SPEC, "cpu", seed=1))
    a = peers.get("p0", first)
    assert peers.get("p0", first) is a and opened == [first.handle]  # mapped once
    assert peers.get("p0", second) is not a and opened == [first.handle, second.handle]  # a new allocation
    peers.get("p1", first)
    assert peers.evict_peers_except(["p0", "p1"]) == []  # seen live
    assert peers.evict_peers_except(["p1"]) == ["p0"] and peers.names() == ["p1"]
    peers.get("", first)  # no sender id: known by its handle
    peers.get("p2", second)
    assert peers.names() == [first.handle.hex(), "p2"]  # the least recently used went first


def test_without_the_senders_gpu_the_real_mapping_says_so():
    share = host_export(random_cache(SPEC, "cpu"))
    check_share(share, SPEC)
    with pytest.raises(PeerCacheError, match="is not visible to this process"):
        open_peer_cache(dataclasses.replace(share, device_uuid="GPU-00000000-0000-0000-0000-000000000000"), SPEC)


def test_cuda_ipc_is_chosen_only_when_asked_and_only_for_cuda_caches():
    cpu = SPEC.allocate()
    assert local_backends(cpu, transport="cuda-ipc") == ()
    assert "CUDA IPC shares CUDA memory only" in explain_no_backend(cpu, transport="cuda-ipc")
    with pytest.raises(RuntimeError, match="--kv-transport cuda-ipc"):
        make_receiver(cpu, SPEC, transport="cuda-ipc")
    assert choose_backend(["nccl", "cuda-ipc", "tcp"], ["cuda-ipc"]) == "cuda-ipc"
    assert choose_backend(["nccl", "cuda-ipc", "tcp"], ["tcp"]) == "tcp"
    with pytest.raises(ValueError, match="no common KV transport"):
        choose_backend(["tcp"], ["cuda-ipc"])
    assert check_kv_address("cuda-ipc://10.0.0.7:9000", ("cuda-ipc", "tcp")) == "cuda-ipc://10.0.0.7:9000"
    assert host_port("cuda-ipc://[::1]:9") == "[::1]:9"
    with pytest.raises(ValueError, match="names the cuda-ipc KV transport"):
        check_kv_address("cuda-ipc://10.0.0.7:9000", ("tcp",))
    assert WorkerConfig(worker_id="d0", model_dir="m", kv_transport="cuda-ipc").kv_transport == "cuda-ipc"


def test_a_sender_that_cannot_share_its_cache_fails_the_request_clearly():
    def refuse(cache):
        raise RuntimeError("expandable segments cannot be shared")

    tx = CudaIpcKVSender(SPEC.allocate(), SPEC, 1.0, 1.0, export=refuse)
    with pytest.raises(TransferError, match="'r1'.*cannot be shared through CUDA IPC: expandable"):
        tx.open("r1", "cuda-ipc://127.0.0.1:9")
    with pytest.raises(ValueError, match="cuda-ipc://host:port"):
        tx.open("r1", "127.0.0.1:9")


_SENDER = textwrap.dedent("""
    import sys, torch
    from pdserve.kvtransfer.cudaipc import CudaIpcKVSender
    from tests.kv_conformance import random_cache
    from tests.kv_helpers import make_spec
    spec = make_spec(torch.bfloat16, num_blocks=64, num_layers=4, block_size=16, num_kv_heads=8, head_dim=64)
    cache = random_cache(spec, "cuda")
    tx = CudaIpcKVSender(cache, spec, 5.0, 10.0, sender_id="p-proc")
    ch = tx.open("r1", sys.argv[1])
    ch.send_pages((0, 2), [5, 9, 63], [0, 1, 2])
    ch.send_pages((2, 4), [5, 9, 63], [0, 1, 2])
    print(ch.finish(42))
    tx.close()
""")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a CUDA GPU")
def test_pages_cross_two_processes_on_one_gpu():
    spec = make_spec(torch.bfloat16, num_blocks=16, num_layers=4, block_size=16, num_kv_heads=8, head_dim=64)
    dst = spec.allocate("cuda")
    rx = make_receiver(dst, spec, transport="cuda-ipc")
    try:
        out = Outcome()
        rx.expect("r1", [0, 1, 2], 20.0, out.on_complete, out.on_failed)
        root = Path(__file__).resolve().parents[1]
        done = subprocess.run([sys.executable, "-c", _SENDER, rx.address], cwd=root, capture_output=True,
                              text=True, timeout=120)  # `-c` puts the cwd first on sys.path: `tests` imports
        assert done.returncode == 0, done.stderr[-2000:]
        assert out.wait(10.0) == ("complete", "r1", 42)
        want = random_cache(make_spec(torch.bfloat16, num_blocks=64, num_layers=4, block_size=16, num_kv_heads=8,
                                      head_dim=64), "cpu")
        assert torch.equal(dst.cpu().view(torch.uint8)[:3], want.view(torch.uint8)[[5, 9, 63]])
        assert rx.evict_peers_except(["p-proc"]) == [] and rx.evict_peers_except([]) == ["p-proc"]
    finally:
        rx.close()
