"""NCCL communicators of peers that left the registry are evicted (kvtransfer/nccl/comms.py ``CommCache``),
and the worker's heartbeat hands its KV transport the registry's live workers (cluster/worker_process.py).
No GPU here: a fake NCCL library stands in for the communicators' bookkeeping; the registry is the real Redis."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from types import SimpleNamespace

import pytest
import redis
import torch

from pdserve.cluster.registry import WorkerInfo, WorkerLease
from pdserve.cluster.worker_process import Heartbeat, WorkerConfig, WorkerProcess
from pdserve.kvtransfer.nccl import comms as comms_module
from pdserve.kvtransfer.nccl.comms import CommCache
from pdserve.kvtransfer.nccl.control import Hello, Welcome, read_any
from pdserve.kvtransfer.nccl.handshake import negotiate_receiver
from pdserve.kvtransfer.nccl.library import UNIQUE_ID_BYTES

pytestmark = pytest.mark.timeout(30)


class FakeLib:
    """Just enough of NcclLibrary for CommCache: handles are counters, aborts and destroys are recorded."""

    def __init__(self) -> None:
        self.next_handle, self.aborted, self.destroyed = 100, [], []

    def comm_init_rank(self, nranks: int, unique_id: bytes, rank: int, timeout_s: float) -> int:
        self.next_handle += 1
        return self.next_handle

    def comm_abort(self, handle: int) -> None:
        self.aborted.append(handle)

    def comm_destroy(self, handle: int) -> None:
        self.destroyed.append(handle)


@pytest.fixture
def cache(monkeypatch):
    monkeypatch.setattr(comms_module.torch.cuda, "Stream", lambda device: object())  # no CUDA stream here
    lib = FakeLib()
    return lib, CommCache(lib, torch.device("cpu"), init_timeout_s=1.0)


def test_communicators_of_peers_that_left_are_evicted(cache):
    lib, comms = cache
    uid = bytes(UNIQUE_ID_BYTES)
    handle = {key: comms.create(key, key, uid, rank=1, peer_id=peer).handle
              for key, peer in [("c0", "p0"), ("c1", "p1"), ("c2", ""), ("c3", "random-sender-id")]}
    assert comms.peer_ids() == {"p0", "p1", "random-sender-id"}
    assert comms.evict_peers_except(["p0", "p1", "d0"]) == []  # both listed: seen live, kept
    assert comms.evict_peers_except(["p1", "d0"]) == ["c0"]  # p0 left the registry
    assert lib.aborted == [handle["c0"]] and comms.get("c0") is None
    assert comms.evict_peers_except([]) == ["c1"]
    # never listed (no peer id, or an id the registry does not know): cannot be told from a live peer
    assert sorted(comms.keys()) == ["c2", "c3"]
    # a peer that comes back gets a new communicator, tracked afresh
    again = comms.create("c4", "c4", uid, rank=1, peer_id="p0")
    assert comms.evict_peers_except(["p0"]) == [] and again.seen_live
    comms.close()
    assert sorted(lib.destroyed) == sorted([handle["c2"], handle["c3"], again.handle])


def test_a_new_communicator_of_a_peer_supersedes_its_older_ones(cache):
    """A sender keeps one communicator per receiver: when it makes another (it lost the first, or it
    restarted under the same worker id), the receiver's older one is dead and is dropped at once."""
    lib, comms = cache
    uid = bytes(UNIQUE_ID_BYTES)
    old = comms.create("c0", "c0", uid, rank=1, peer_id="p0")
    other = comms.create("c1", "c1", uid, rank=1, peer_id="p1")
    new = comms.create("c2", "c2", uid, rank=1, peer_id="p0")
    assert sorted(comms.keys()) == ["c1", "c2"] and old.broken and lib.aborted == [old.handle]
    assert other.broken is None and new.broken is None
    comms.close()


def test_receiver_handshake_records_the_senders_id(cache):
    lib, comms = cache
    a, b = socket.socketpair()
    try:
        hello = Hello("r1", "comm-1", "prefill-7", 22703, bytes(UNIQUE_ID_BYTES))
        got = {}
        t = threading.Thread(target=lambda: got.update(pc=negotiate_receiver(b, hello, comms, 22703, 2.0)))
        t.start()
        assert read_any(a) == Welcome("r1", True, True, False, "")
        t.join(5)
        assert got["pc"].peer_id == "prefill-7" and comms.peer_ids() == {"prefill-7"}
    finally:
        a.close()
        b.close()
        comms.close()


class End:
    """A KV transport end as the worker sees it (``evict_peers_except`` records its calls)."""

    def __init__(self, keeps_peer_state: bool = True) -> None:
        self.keeps_peer_state, self.alive, self.calls = keeps_peer_state, True, []

    def evict_peers_except(self, live):
        self.calls.append(sorted(live))
        return []


def test_heartbeat_hands_the_registrys_live_workers_to_the_kv_transport(redis_url):
    cluster = "peers-" + uuid.uuid4().hex[:8]
    receiver, sender = End(), End()
    engine = SimpleNamespace(receiver=receiver, kv_sender=sender, run_forever=lambda stop: None)
    cfg = WorkerConfig(model_dir="unused", worker_id="d0", cluster=cluster, redis_url=redis_url, lease_s=0.4)
    worker = WorkerProcess(cfg, engine)
    other = WorkerLease(redis_url, cluster, 30.0)
    other.renew(WorkerInfo("p0", "prefill", "127.0.0.1:5"))
    other.renew(WorkerInfo("d1", "decode", "127.0.0.1:6", kv_address="nccl://127.0.0.1:7"))
    beat = Heartbeat(cfg, lambda: WorkerInfo("d0", "decode", "127.0.0.1:8", kv_address="nccl://127.0.0.1:9"),
                     healthy=worker.healthy, on_registry=worker.on_registry, wants_registry=worker.keeps_peer_state)
    beat.start()
    try:
        deadline = time.monotonic() + 5
        while not receiver.calls:
            assert time.monotonic() < deadline, "on_registry never ran"
            time.sleep(0.02)
        assert receiver.calls[0] == ["d0", "d1", "p0"]  # receivers match senders by worker id
        assert sender.calls[0] == ["nccl://127.0.0.1:7", "nccl://127.0.0.1:9"]  # senders by KV address
        other.release("p0")
        deadline = time.monotonic() + 5
        while receiver.calls[-1] != ["d0", "d1"]:
            assert time.monotonic() < deadline, receiver.calls
            time.sleep(0.02)
        # a TCP-only worker keeps no per-peer state: its heartbeat does not read the registry
        receiver.keeps_peer_state = sender.keeps_peer_state = False
        time.sleep(0.5)
        n = len(receiver.calls)
        time.sleep(1.0)
        assert len(receiver.calls) == n
    finally:
        beat.stop()
        other.release("d1")
        other.close()
        r = redis.Redis.from_url(redis_url)
        for key in r.scan_iter(f"pdserve:{cluster}:*"):
            r.delete(key)
        r.close()
