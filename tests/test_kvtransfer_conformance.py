"""One transfer conformance suite for every KV transport this machine can run.

Each test runs once per backend: TCP between two CPU caches always; NCCL between ``cuda:0`` and
``cuda:1`` when two GPUs and ``libnccl.so.2`` are present (otherwise its cases show as skipped with
the reason). Sender and receiver are built by :mod:`kvtransfer.select` from the caches' devices,
so the automatic choice is exercised too. Real sockets on 127.0.0.1, real threads, no fakes.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from dataclasses import dataclass

import pytest
import torch

from pdserve.kvtransfer.base import KVReceiver, TransferError
from pdserve.kvtransfer.select import make_receiver, make_sender, nccl_status
from pdserve.model.kv_cache import KVCacheSpec
from tests.kv_helpers import Outcome

pytestmark = pytest.mark.timeout(30)

SRC, DST = [5, 1, 6], [2, 7, 0]  # source ids differ from destination ids on purpose
RECEIVER_CLASS = {"tcp": "TcpKVReceiver", "nccl": "NcclKVReceiver"}


def _nccl_skip_reason() -> str | None:
    if torch.cuda.device_count() < 2:
        return f"NCCL KV transport needs 2 CUDA devices, this machine has {torch.cuda.device_count()}"
    return nccl_status()


BACKENDS = [pytest.param(("tcp", "cpu", "cpu"), id="tcp"),
            pytest.param(("nccl", "cuda:0", "cuda:1"), id="nccl",
                         marks=pytest.mark.skipif(_nccl_skip_reason() is not None, reason=str(_nccl_skip_reason())))]


def make_spec(dtype: torch.dtype = torch.float32, **kw: int) -> KVCacheSpec:
    dims = dict(num_blocks=8, num_layers=2, block_size=4, num_kv_heads=2, head_dim=3) | kw
    return KVCacheSpec(**dims, dtype=dtype)


def random_cache(spec: KVCacheSpec, device: str, seed: int = 0) -> torch.Tensor:
    """Random bytes reinterpreted as the cache dtype: every bit pattern (NaNs included) must survive."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (*spec.shape[:-1], spec.head_dim * spec.dtype.itemsize), dtype=torch.uint8,
                        generator=g)
    return raw.view(spec.dtype).reshape(spec.shape).contiguous().to(device)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)




@dataclass
class Pair:
    backend: str
    spec: KVCacheSpec
    src: torch.Tensor
    dst: torch.Tensor
    rx: KVReceiver
    tx: object

    def expect(self, rid: str, blocks: list[int] = DST, timeout_s: float = 5.0) -> Outcome:
        out = Outcome()
        self.rx.expect(rid, blocks, timeout_s, out.on_complete, out.on_failed)
        return out

    def transfer(self, rid: str, token: int = 7, src: list[int] = SRC, dst: list[int] = DST):
        ch = self.tx.open(rid, self.rx.address)
        ch.send_pages((0, self.spec.num_layers), src, dst)
        return ch.finish(token)

    def address_for(self, hostport: str) -> str:
        return ("nccl://" if self.backend == "nccl" else "") + hostport

    def hostport(self) -> tuple[str, int]:
        host, port = self.rx.address.removeprefix("nccl://").rsplit(":", 1)
        return host, int(port)

    def close(self) -> None:
        self.tx.close()
        self.rx.close()


@pytest.fixture(params=BACKENDS)
def backend(request) -> tuple[str, str, str]:
    return request.param


@pytest.fixture
def make_pair(backend):
    """Factory of sender/receiver pairs for the backend under test; closes them all at the end."""
    name, tx_device, rx_device = backend
    made: list[Pair] = []

    def make(dtype: torch.dtype = torch.float32, rx_io_timeout_s: float = 2.0, tx_io_timeout_s: float = 2.0,
             **kw: int) -> Pair:
        spec = make_spec(dtype, **kw)
        src, dst = random_cache(spec, tx_device), spec.allocate(rx_device)
        rx = make_receiver(dst, spec, io_timeout_s=rx_io_timeout_s)
        tx = make_sender(src, spec, connect_timeout_s=1.0, io_timeout_s=tx_io_timeout_s)
        assert type(rx).__name__ == RECEIVER_CLASS[name] and tx.backends == (name,)
        made.append(Pair(name, spec, src, dst, rx, tx))
        return made[-1]

    yield make
    for p in made:
        p.close()


@pytest.fixture
def pair(make_pair) -> Pair:
    return make_pair()


def assert_copied(p: Pair, src_ids: list[int], dst_ids: list[int], src_before: torch.Tensor) -> None:
    dst, src = as_bytes(p.dst), as_bytes(p.src)
    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(dst[d], src[s]), f"block {s} -> {d} differs"
    untouched = [b for b in range(p.spec.num_blocks) if b not in dst_ids]
    assert not dst[untouched].any(), "bytes landed outside the destination blocks"
    assert torch.equal(src, as_bytes(src_before)), "the sender's cache changed"


# -- integrity and ordering ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn],
                         ids=["f32", "bf16", "f16", "fp8"])
def test_full_transfer_is_byte_exact(make_pair, dtype):
    p = make_pair(dtype)
    before = p.src.clone()
    out = p.expect("r1")
    stats = p.transfer("r1", token=42)
    assert out.calls == [("complete", "r1", 42)]  # called before the ack reached the sender
    assert (stats.num_pages, stats.num_bytes) == (3, 3 * p.spec.block_nbytes)
    assert stats.seconds > 0
    assert_copied(p, SRC, DST, before)


def test_pages_in_any_order_of_layer_ranges_and_blocks_land_in_place(make_pair):
    p = make_pair(torch.bfloat16, num_blocks=12, num_layers=5)
    rng = random.Random(1234)
    src, dst = rng.sample(range(12), 6), rng.sample(range(12), 6)
    ranges = [(0, 2), (2, 3), (3, 5)]
    pieces = [(r, i) for r in ranges for i in range(0, 6, 2)]  # (layer range, pair of blocks)
    rng.shuffle(pieces)
    before = p.src.clone()
    out = p.expect("r1", dst)
    ch = p.tx.open("r1", p.rx.address)
    for n, (layers, i) in enumerate(pieces):
        ch.send_pages(layers, src[i:i + 2][::-1], dst[i:i + 2][::-1])
        if n < len(pieces) - 1:
            assert not out.event.is_set()
    stats = ch.finish(3)
    assert out.wait() == ("complete", "r1", 3)
    assert (stats.num_pages, stats.num_bytes) == (len(pieces) * 2, 6 * p.spec.block_nbytes)
    assert_copied(p, src, dst, before)


def test_many_blocks_are_split_into_frames_under_the_header_limit(make_pair):
    p = make_pair(num_blocks=5000, num_layers=1, block_size=1, num_kv_heads=1, head_dim=1)
    out = p.expect("big", list(range(5000)))
    ch = p.tx.open("big", p.rx.address)
    ch.send_pages((0, 1), list(range(4999, -1, -1)), list(range(5000)))
    assert ch.finish(1).num_pages == 5000
    assert out.wait() == ("complete", "big", 1)
    assert torch.equal(as_bytes(p.dst), as_bytes(p.src.flip(0)))


def test_concurrent_requests_on_one_receiver(make_pair):
    p = make_pair(num_blocks=16)
    before = p.src.clone()
    plans = {f"r{i}": (list(range(4 * i, 4 * i + 4))[::-1], [15 - 4 * i - k for k in range(4)]) for i in range(4)}
    outs = {rid: p.expect(rid, dst) for rid, (_, dst) in plans.items()}
    errors: list[BaseException] = []

    def run(rid: str) -> None:
        try:
            src, dst = plans[rid]
            ch = p.tx.open(rid, p.rx.address)
            for layer in range(p.spec.num_layers):
                ch.send_pages((layer, layer + 1), src, dst)
            ch.finish(int(rid[1:]))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(rid,)) for rid in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10.0)
    assert not errors
    assert {rid: out.wait() for rid, out in outs.items()} == {rid: ("complete", rid, int(rid[1:])) for rid in plans}
    all_src = [b for s, _ in plans.values() for b in s]
    all_dst = [b for _, d in plans.values() for b in d]
    assert_copied(p, all_src, all_dst, before)


# -- partial, refused, aborted -----------------------------------------------------------------


def test_incomplete_transfer_is_rejected_and_fails_the_registration_once(pair):
    out = pair.expect("r1", timeout_s=0.5)
    ch = pair.tx.open("r1", pair.rx.address)
    ch.send_pages((0, 1), SRC, DST)
    with pytest.raises(TransferError, match="incomplete transfer: 3 of 6 pages"):
        ch.finish(1)
    assert out.calls == [("failed", "r1", "incomplete transfer: 3 of 6 pages")]
    time.sleep(0.7)  # past the registration deadline: no second callback
    assert len(out.calls) == 1
    again = pair.expect("r1")  # the id is free again
    pair.transfer("r1")
    assert again.wait() == ("complete", "r1", 7)


def test_pages_for_unregistered_blocks_or_requests_are_refused(pair):
    out = pair.expect("r1")
    ch = pair.tx.open("r1", pair.rx.address)
    with pytest.raises(TransferError, match=r"'r1'.*block ids \[3\] are not registered"):
        ch.send_pages((0, 2), [5], [3])
        ch.finish(1)
    assert out.wait()[:2] == ("failed", "r1") and len(out.calls) == 1
    with pytest.raises(TransferError, match="closed"):
        ch.send_pages((0, 2), [5], [2])
    with pytest.raises(TransferError, match="unknown request 'ghost'"):
        stray = pair.tx.open("ghost", pair.rx.address)
        stray.send_pages((0, 2), [5], [2])
        stray.finish(1)
    assert not as_bytes(pair.dst).any(), "refused pages reached the cache"


def test_send_pages_rejects_bad_arguments_before_any_io(pair):
    out = pair.expect("r1")
    ch = pair.tx.open("r1", pair.rx.address)
    for layers, src, dst in [((0, 2), [5, 1], [2]), ((1, 1), [5], [2]), ((0, 3), [5], [2]), ((-1, 1), [5], [2]),
                             ((0, 2), [8], [2]), ((0, 2), [5, 1], [2, 2]), ((0, 2), [5], [-1])]:
        with pytest.raises(ValueError):
            ch.send_pages(layers, src, dst)
    ch.send_pages((0, 2), SRC, DST)  # the channel is still usable
    ch.finish(1)
    assert out.wait() == ("complete", "r1", 1)


def wait_for_pages(p: Pair, src_ids: list[int], dst_ids: list[int], layers: slice, timeout_s: float = 5.0) -> None:
    """Until those pages have landed: proof that the receiver has read the channel's first frame."""
    deadline = time.monotonic() + timeout_s
    want = as_bytes(p.src)[src_ids, layers]
    while not torch.equal(as_bytes(p.dst)[dst_ids, layers], want):
        assert time.monotonic() < deadline, "pages did not arrive"
        time.sleep(0.005)


def test_second_connection_for_a_request_is_refused_without_failing_it(pair):
    out = pair.expect("r1")
    ch = pair.tx.open("r1", pair.rx.address)
    ch.send_pages((0, 1), SRC, DST)
    wait_for_pages(pair, SRC, DST, slice(0, 1))  # else the intruder's connection could be read first
    with pytest.raises(TransferError, match="already has a connection"):
        intruder = pair.tx.open("r1", pair.rx.address)
        intruder.send_pages((1, 2), SRC, DST)
        intruder.finish(1)
    ch.send_pages((1, 2), SRC, DST)
    ch.finish(5)
    assert out.calls == [("complete", "r1", 5)]


def test_abort_fails_the_request_once_and_its_blocks_stay_untouched(pair):
    out = pair.expect("r1", timeout_s=0.5)
    ch = pair.tx.open("r1", pair.rx.address)
    ch.send_pages((0, 1), SRC, DST)
    ch.abort("prefill ran out of memory")
    assert out.wait() == ("failed", "r1", "aborted by sender: prefill ran out of memory")
    snapshot = as_bytes(pair.dst).clone()
    ch.abort("again")  # never raises
    with pytest.raises(TransferError, match="channel is closed"):
        ch.send_pages((1, 2), SRC, DST)
    with pytest.raises(TransferError, match="unknown request 'r1'"):
        late = pair.tx.open("r1", pair.rx.address)
        late.send_pages((0, 2), SRC, DST)
        late.finish(1)
    time.sleep(0.7)  # past the deadline
    assert len(out.calls) == 1
    assert torch.equal(as_bytes(pair.dst), snapshot)


def test_sender_close_aborts_open_channels(pair):
    out = pair.expect("r1")
    ch = pair.tx.open("r1", pair.rx.address)
    ch.send_pages((0, 1), SRC, DST)
    pair.tx.close()
    assert out.wait() == ("failed", "r1", "aborted by sender: sender closed")
    with pytest.raises(TransferError, match="closed"):
        ch.finish(1)
    with pytest.raises(TransferError, match="sender is closed"):
        pair.tx.open("r2", pair.rx.address)


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
