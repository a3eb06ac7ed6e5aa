"""The KV transfer conformance suite, continued (see tests/test_kvtransfer_conformance.py): deadlines on
both sides, cancel, receiver close, argument checks and callbacks that call back into the receiver. Each
test runs once per backend this machine can run.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from pdserve.kvtransfer.base import TransferError
from tests.kv_conformance import BACKENDS, DST, SRC, Pair, as_bytes, pair_factory, wait_for_pages
from tests.kv_helpers import Outcome

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(params=BACKENDS)
def backend(request) -> tuple[str, str, str]:
    return request.param


@pytest.fixture
def make_pair(backend):
    """Factory of sender/receiver pairs for the backend under test; closes them all at the end."""
    yield from pair_factory(backend)


@pytest.fixture
def pair(make_pair) -> Pair:
    return make_pair()


# -- timeouts, cancel, lifecycle -----------------------------------------------------------------


def test_sender_that_never_finishes_fails_by_the_deadline_exactly_once(pair):
    t0 = time.monotonic()
    idle = pair.expect("idle", [3], timeout_s=0.3)
    out = pair.expect("r1", timeout_s=0.6)
    ch = pair.tx.open("r1", pair.rx.address)
    ch.send_pages((0, 1), SRC, DST)
    wait_for_pages(pair, SRC, DST, slice(0, 1))  # the receiver has bound the request to this channel
    assert idle.wait() == ("failed", "idle", "timed out after 0.3 s waiting for KV pages")
    assert out.wait() == ("failed", "r1", "timed out after 0.6 s waiting for KV pages")
    assert 0.6 <= time.monotonic() - t0 < 2.5
    with pytest.raises(TransferError, match="timed out"):
        ch.send_pages((1, 2), SRC, DST)
        ch.finish(1)
    assert len(out.calls) == 1 and len(idle.calls) == 1


def test_receiver_that_never_answers_fails_the_sender_within_its_timeout(make_pair):
    p = make_pair(tx_io_timeout_s=0.5)
    with socket.create_server(("127.0.0.1", 0), backlog=4) as silent:  # accepts (backlog), never reads or acks
        address = p.address_for(f"127.0.0.1:{silent.getsockname()[1]}")
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="within 0.5 s|timed out"):
            ch = p.tx.open("r1", address)
            ch.send_pages((0, 2), SRC, DST)
            ch.finish(1)
        assert time.monotonic() - t0 < 0.5 + 1.5


def test_cancel_suppresses_callbacks_and_refuses_later_pages(pair):
    out = pair.expect("r1", timeout_s=0.3)
    ch = pair.tx.open("r1", pair.rx.address)
    ch.send_pages((0, 1), SRC, DST)
    pair.rx.cancel("r1")
    snapshot = as_bytes(pair.dst).clone()
    pair.rx.cancel("r1")  # idempotent
    pair.rx.cancel("never-registered")
    with pytest.raises(TransferError, match="cancelled"):
        ch.send_pages((1, 2), SRC, DST)
        ch.finish(1)
    with pytest.raises(TransferError, match="unknown request 'r1'"):
        late = pair.tx.open("r1", pair.rx.address)
        late.send_pages((0, 2), SRC, DST)
        late.finish(1)
    assert not out.event.wait(0.6)  # well past the 0.3 s deadline
    assert torch.equal(as_bytes(pair.dst), snapshot)


def test_every_registration_ends_exactly_once_and_both_sides_agree(make_pair):
    """Transfers race their deadlines: each request gets one callback, and the sender's finish succeeded
    exactly when the receiver called on_complete."""
    p = make_pair(num_blocks=24, num_layers=4)
    results: dict[str, str] = {}
    outs = {}
    for i in range(8):
        rid = f"r{i}"
        outs[rid] = p.expect(rid, [3 * i, 3 * i + 1, 3 * i + 2], timeout_s=0.02 + 0.08 * i)

    def run(i: int) -> None:
        rid = f"r{i}"
        try:
            ch = p.tx.open(rid, p.rx.address)
            for layer in range(4):
                ch.send_pages((layer, layer + 1), [0, 1, 2], [3 * i, 3 * i + 1, 3 * i + 2])
                time.sleep(0.02)
            ch.finish(i)
            results[rid] = "complete"
        except TransferError:
            results[rid] = "failed"

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10.0)
    time.sleep(0.5)  # every deadline has passed: late callbacks would show now
    for rid, out in outs.items():
        assert len(out.calls) == 1, (rid, out.calls)
        assert out.calls[0][0] == results[rid], (rid, out.calls, results[rid])
    assert "failed" in results.values()  # the shortest deadline (20 ms) is shorter than the 4 x 20 ms of sends
    assert "complete" in results.values()  # the longest (580 ms) leaves ample time


def test_connecting_to_a_closed_port_fails_fast(pair):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(TransferError, match=f"'r9'.*127.0.0.1:{port}"):
        pair.tx.open("r9", pair.address_for(f"127.0.0.1:{port}"))
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(ValueError, match="host:port"):
        pair.tx.open("r9", pair.address_for("no-port"))


def test_receiver_close_fails_pending_registrations_and_stops_listening(pair):
    waiting, streaming = pair.expect("waiting", [3]), pair.expect("r1")
    ch = pair.tx.open("r1", pair.rx.address)
    ch.send_pages((0, 1), SRC, DST)
    t0 = time.monotonic()
    pair.rx.close()
    assert time.monotonic() - t0 < 1.5
    assert waiting.calls == [("failed", "waiting", "receiver closed")]
    assert streaming.calls == [("failed", "r1", "receiver closed")]
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(pair.hostport(), timeout=2.0)
    with pytest.raises(TransferError):
        ch.send_pages((1, 2), SRC, DST)
        ch.finish(1)
    with pytest.raises(RuntimeError, match="closed"):
        pair.expect("late")
    pair.rx.close()  # idempotent


def test_expect_validates_its_arguments(pair):
    pair.expect("r1")
    with pytest.raises(ValueError, match="already registered"):
        pair.expect("r1")
    for blocks, timeout_s in [([], 1.0), ([8], 1.0), ([1, 1], 1.0), ([1], 0.0)]:
        with pytest.raises(ValueError):
            pair.expect("r2", blocks, timeout_s)


def test_callbacks_may_call_back_into_the_receiver(pair):
    follow_up, first = Outcome(), Outcome()

    def on_complete(rid: str, token: int) -> None:
        pair.rx.cancel("other")
        pair.rx.expect("r2", DST, 5.0, follow_up.on_complete, follow_up.on_failed)
        first.on_complete(rid, token)

    pair.expect("other", [4])
    pair.rx.expect("r1", DST, 5.0, on_complete, first.on_failed)
    pair.transfer("r1")
    assert first.wait() == ("complete", "r1", 7)
    pair.transfer("r2", token=8)
    assert follow_up.wait() == ("complete", "r2", 8)


def test_receiver_may_be_closed_from_a_deadline_callback(pair):
    closed = threading.Event()

    def on_failed(rid: str, reason: str) -> None:
        pair.rx.close()  # runs on the reaper thread, which close() must not join
        closed.set()

    pending = pair.expect("pending", [4])
    pair.rx.expect("r1", DST, 0.2, lambda *a: None, on_failed)
    assert closed.wait(3.0)
    assert pending.calls == [("failed", "pending", "receiver closed")]
