"""TCP KV transport over real sockets on 127.0.0.1: exact bytes, refusals, failures, timeouts."""

from __future__ import annotations

import socket
import struct
import threading
import time
from dataclasses import dataclass

import msgpack
import pytest
import torch

from kvtransfer.base import TransferError
from kvtransfer.tcp import TcpKVReceiver, TcpKVSender
from kvtransfer.tcp.frames import MAX_HEADER_BYTES, Ack, read_frame
from kvtransfer.tcp.pages import PageMemory
from model.kv_cache import KVCacheSpec

pytestmark = pytest.mark.timeout(20)

SRC, DST = [5, 1, 6], [2, 7, 0]  # source ids differ from destination ids on purpose


def make_spec(dtype: torch.dtype = torch.float32, **kw: int) -> KVCacheSpec:
    dims = dict(num_blocks=8, num_layers=2, block_size=4, num_kv_heads=2, head_dim=3) | kw
    return KVCacheSpec(**dims, dtype=dtype)


class Outcome:
    """Records every callback of one registration; ``wait`` returns the first."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.event = threading.Event()

    def on_complete(self, request_id: str, first_token: int) -> None:
        self.calls.append(("complete", request_id, first_token))
        self.event.set()

    def on_failed(self, request_id: str, reason: str) -> None:
        self.calls.append(("failed", request_id, reason))
        self.event.set()

    def wait(self, timeout: float = 5.0) -> tuple:
        assert self.event.wait(timeout), "no callback arrived"
        return self.calls[0]


@dataclass
class Pair:
    spec: KVCacheSpec
    src: torch.Tensor
    dst: torch.Tensor
    rx: TcpKVReceiver
    tx: TcpKVSender

    def expect(self, rid: str, blocks: list[int] = DST, timeout_s: float = 5.0) -> Outcome:
        out = Outcome()
        self.rx.expect(rid, blocks, timeout_s, out.on_complete, out.on_failed)
        return out

    def transfer(self, rid: str, token: int = 7):
        ch = self.tx.open(rid, self.rx.address)
        ch.send_pages((0, self.spec.num_layers), SRC, DST)
        return ch.finish(token)


def make_pair(dtype: torch.dtype = torch.float32, rx_io_timeout_s: float = 2.0, **kw: int) -> Pair:
    spec = make_spec(dtype, **kw)
    src = torch.randn(spec.shape).to(dtype)
    dst = spec.allocate()
    return Pair(spec, src, dst, TcpKVReceiver(dst, spec, io_timeout_s=rx_io_timeout_s),
                TcpKVSender(src, spec, connect_timeout_s=1.0, io_timeout_s=2.0))


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def pair(request):
    p = make_pair(request.param)
    yield p
    p.tx.close()
    p.rx.close()


@pytest.fixture
def pair32():
    p = make_pair()
    yield p
    p.tx.close()
    p.rx.close()


def raw_connect(rx: TcpKVReceiver) -> socket.socket:
    host, port = rx.address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5.0)


def framed(header: object) -> bytes:
    body = msgpack.packb(header)
    return struct.pack(">I", len(body)) + body


def pages_header(spec: KVCacheSpec, rid: str = "r1", blocks: list[int] = DST, ls: int = 0, le: int = 2) -> dict:
    shape = [len(blocks), le - ls, 2, spec.block_size, spec.num_kv_heads, spec.head_dim]
    return {"type": "pages", "request_id": rid, "layer_start": ls, "layer_end": le, "block_ids": blocks,
            "dtype": str(spec.dtype).removeprefix("torch."), "shape": shape,
            "nbytes": len(blocks) * spec.page_nbytes(le - ls)}


def assert_copied(p: Pair, src_ids: list[int], dst_ids: list[int], src_before: torch.Tensor) -> None:
    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(p.dst[d], p.src[s])
    untouched = [b for b in range(p.spec.num_blocks) if b not in dst_ids]
    assert not p.dst[untouched].any()
    assert torch.equal(p.src, src_before)


# -- successful transfers ----------------------------------------------------------------------


def test_full_transfer_copies_exact_bytes_into_destination_blocks(pair):
    before = pair.src.clone()
    out = pair.expect("r1")
    stats = pair.transfer("r1", token=42)
    assert out.calls == [("complete", "r1", 42)]  # called before the ack reached the sender
    assert (stats.num_pages, stats.num_bytes) == (3, 3 * pair.spec.block_nbytes)
    assert stats.seconds > 0
    assert_copied(pair, SRC, DST, before)


def test_pages_sent_in_several_frames_by_layer_complete(pair):
    before = pair.src.clone()
    out = pair.expect("r1")
    ch = pair.tx.open("r1", pair.rx.address)
    ch.send_pages((0, 1), SRC[:2], DST[:2])
    ch.send_pages((0, 1), SRC[2:], DST[2:])
    assert not out.event.is_set()
    ch.send_pages((1, 2), SRC[::-1], DST[::-1])
    stats = ch.finish(3)
    assert out.wait() == ("complete", "r1", 3)
    assert (stats.num_pages, stats.num_bytes) == (6, 3 * pair.spec.block_nbytes)
    assert_copied(pair, SRC, DST, before)


def test_many_blocks_are_split_into_frames_under_the_header_limit():
    p = make_pair(num_blocks=5000, num_layers=1, block_size=1, num_kv_heads=1, head_dim=1)
    try:
        out = p.expect("big", list(range(5000)))
        ch = p.tx.open("big", p.rx.address)
        ch.send_pages((0, 1), list(range(4999, -1, -1)), list(range(5000)))
        assert ch.finish(1).num_pages == 5000
        assert out.wait() == ("complete", "big", 1)
        assert torch.equal(p.dst, p.src.flip(0))
    finally:
        p.tx.close()
        p.rx.close()


def test_page_memory_views_share_the_cache_memory():
    spec = make_spec(torch.bfloat16)
    cache = spec.allocate()
    page = PageMemory(cache, spec).page(3, 1, 2)
    assert page.nbytes == spec.page_nbytes(1) and not page.readonly
    page[:] = bytes(range(page.nbytes))
    assert cache[3, 1].reshape(-1).view(torch.uint8).tolist() == list(range(page.nbytes))
    assert not cache[3, 0].any() and not cache[2].any() and not cache[4].any()
    with pytest.raises(ValueError, match="contiguous"):
        PageMemory(cache.transpose(3, 4).contiguous().transpose(3, 4), spec)
    with pytest.raises(ValueError, match="spec wants"):
        PageMemory(cache.float(), spec)


# -- refusals ----------------------------------------------------------------------------------


def test_incomplete_transfer_fails_on_both_sides(pair):
    out = pair.expect("r1")
    ch = pair.tx.open("r1", pair.rx.address)
    ch.send_pages((0, 1), SRC, DST)
    with pytest.raises(TransferError, match="incomplete transfer: 3 of 6 pages"):
        ch.finish(1)
    assert out.calls == [("failed", "r1", "incomplete transfer: 3 of 6 pages")]


def _header_case(fails_request: bool, **changes):
    layout = {k: changes.pop(k) for k in ("blocks", "ls", "le") if k in changes}

    def build(spec: KVCacheSpec) -> bytes:
        h = pages_header(spec, **layout)
        for key, value in changes.items():
            if value is None:
                del h[key]
            else:
                h[key] = value(h[key]) if callable(value) else value
        return framed(h)
    return build, fails_request


BAD_FRAMES = {
    # name: (frame bytes for a spec, does it fail the registered "r1"?, expected error text)
    "unknown_request": (*_header_case(False, request_id="nobody"), "unknown request 'nobody'"),
    "block_not_registered": (*_header_case(True, blocks=[2, 3]), "block ids [3] are not registered"),
    "block_out_of_range": (*_header_case(True, blocks=[2, 99]), "out of range [0, 8)"),
    "repeated_block": (*_header_case(True, blocks=[2, 2]), "repeated block ids"),
    "wrong_dtype": (*_header_case(True, dtype="float16"), "dtype 'float16' does not match"),
    "wrong_shape": (*_header_case(True, shape=lambda s: s[:3] + [s[3] + 1] + s[4:]), "shape"),
    "nbytes_mismatch": (*_header_case(True, nbytes=lambda n: n + 1), "nbytes"),
    "empty_layer_range": (*_header_case(True, ls=1, le=1), "layer range [1, 1)"),
    "missing_field": (*_header_case(True, nbytes=None), "missing field 'nbytes'"),
    "wrong_field_type": (*_header_case(True, layer_start="0"), "'layer_start' must be int"),
    "unknown_type": (lambda spec: framed({"type": "hello", "request_id": "r1"}), True, "unknown frame type"),
    "ack_from_sender": (lambda spec: framed({"type": "ack", "request_id": "r1", "ok": True, "error": ""}),
                        True, "unexpected ack"),
    "oversize_header": (lambda spec: struct.pack(">I", MAX_HEADER_BYTES + 1) + b"x" * 64, False, "exceeds"),
    "http_garbage": (lambda spec: b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", False, "exceeds"),
    "bad_msgpack": (lambda spec: struct.pack(">I", 4) + b"\xc1\xc1\xc1\xc1", False, "not valid msgpack"),
    "not_a_map": (lambda spec: framed([1, 2, 3]), False, "must be a map"),
}


@pytest.mark.parametrize("case", list(BAD_FRAMES))
def test_bad_frame_is_refused_and_receiver_keeps_serving(pair, case):
    build, fails_request, text = BAD_FRAMES[case]
    out = pair.expect("r1")
    with raw_connect(pair.rx) as s:
        s.sendall(build(pair.spec))
        nack = read_frame(s)
        assert isinstance(nack, Ack) and not nack.ok and text in nack.error
        assert s.recv(1) == b""  # receiver closed the connection
    if fails_request:
        kind, rid, reason = out.wait()
        assert (kind, rid) == ("failed", "r1") and reason.startswith("bad frame") and text in reason
        out = pair.expect("r2")
        pair.transfer("r2")
        assert out.wait() == ("complete", "r2", 7)
    else:
        assert not out.event.is_set()
        pair.transfer("r1")  # the registration survived the stray connection
        assert out.calls == [("complete", "r1", 7)]


def test_sender_gets_the_receivers_reason_for_a_foreign_block(pair32):
    out = pair32.expect("r1")
    ch = pair32.tx.open("r1", pair32.rx.address)
    with pytest.raises(TransferError, match=r"'r1'.*block ids \[3\] are not registered"):
        ch.send_pages((0, 2), [5], [3])
        ch.finish(1)
    assert out.wait()[:2] == ("failed", "r1")
    with pytest.raises(TransferError, match="closed"):
        ch.send_pages((0, 2), [5], [2])


def test_second_connection_for_a_request_is_refused_without_failing_it(pair32):
    out = pair32.expect("r1")
    ch = pair32.tx.open("r1", pair32.rx.address)
    ch.send_pages((0, 1), SRC, DST)
    intruder = pair32.tx.open("r1", pair32.rx.address)
    with pytest.raises(TransferError, match="already has a connection"):
        intruder.send_pages((1, 2), SRC, DST)
        intruder.finish(1)
    ch.send_pages((1, 2), SRC, DST)
    ch.finish(5)
    assert out.calls == [("complete", "r1", 5)]


def test_send_pages_rejects_bad_arguments_before_any_io(pair32):
    out = pair32.expect("r1")
    ch = pair32.tx.open("r1", pair32.rx.address)
    for layers, src, dst in [((0, 2), [5, 1], [2]), ((1, 1), [5], [2]), ((0, 3), [5], [2]),
                             ((0, 2), [8], [2]), ((0, 2), [5, 1], [2, 2]), ((0, 2), [5], [-1])]:
        with pytest.raises(ValueError):
            ch.send_pages(layers, src, dst)
    ch.send_pages((0, 2), SRC, DST)  # the channel is still usable
    ch.finish(1)
    assert out.wait() == ("complete", "r1", 1)


# -- broken connections, stalls, deadlines -------------------------------------------------------


def test_sender_closing_mid_payload_fails_the_request(pair):
    out = pair.expect("r1")
    header = pages_header(pair.spec)
    with raw_connect(pair.rx) as s:
        s.sendall(framed(header) + b"\0" * (header["nbytes"] // 2))
    kind, rid, reason = out.wait()
    assert (kind, rid) == ("failed", "r1") and "connection closed mid-transfer (0 of 6 pages received)" in reason
    out2 = pair.expect("r2")
    pair.transfer("r2")
    assert out2.wait() == ("complete", "r2", 7)


def test_silent_peer_is_dropped_after_io_timeout_and_receiver_still_serves():
    p = make_pair(rx_io_timeout_s=0.5)
    try:
        with raw_connect(p.rx) as s:
            t0 = time.monotonic()
            assert s.recv(1) == b""
            assert 0.4 < time.monotonic() - t0 < 2.5
        out = p.expect("r1")
        p.transfer("r1")
        assert out.wait() == ("complete", "r1", 7)
    finally:
        p.tx.close()
        p.rx.close()


def test_stalled_transfer_fails_its_request_after_io_timeout():
    p = make_pair(rx_io_timeout_s=0.5)
    try:
        out = p.expect("r1")
        with raw_connect(p.rx) as s:
            s.sendall(framed(pages_header(p.spec)))  # header, then silence
            reason = "connection timed out after 0.5 s mid-transfer (0 of 6 pages received)"
            assert out.wait() == ("failed", "r1", reason)
    finally:
        p.tx.close()
        p.rx.close()


def test_registration_deadline_fires_on_failed_exactly_once(pair32):
    t0 = time.monotonic()
    idle = pair32.expect("idle", [3], timeout_s=0.3)
    out = pair32.expect("r1", timeout_s=0.3)
    ch = pair32.tx.open("r1", pair32.rx.address)
    ch.send_pages((0, 1), SRC, DST)
    assert out.wait() == ("failed", "r1", "timed out after 0.3 s waiting for KV pages")
    assert idle.wait() == ("failed", "idle", "timed out after 0.3 s waiting for KV pages")
    assert time.monotonic() - t0 >= 0.3
    with pytest.raises(TransferError, match="timed out"):
        ch.send_pages((1, 2), SRC, DST)
        ch.finish(1)
    with pytest.raises(TransferError, match="unknown request 'idle'"):
        late = pair32.tx.open("idle", pair32.rx.address)
        late.send_pages((0, 2), [5], [3])
        late.finish(1)
    assert len(out.calls) == 1 and len(idle.calls) == 1
    again = pair32.expect("r1")  # the id is free again
    pair32.transfer("r1")
    assert again.wait() == ("complete", "r1", 7) and len(out.calls) == 1


def test_cancel_suppresses_callbacks_and_refuses_later_pages(pair32):
    out = pair32.expect("r1", timeout_s=0.3)
    ch = pair32.tx.open("r1", pair32.rx.address)
    ch.send_pages((0, 1), SRC, DST)
    pair32.rx.cancel("r1")
    pair32.rx.cancel("r1")  # idempotent
    pair32.rx.cancel("never-registered")
    with pytest.raises(TransferError, match="cancelled"):
        ch.send_pages((1, 2), SRC, DST)
        ch.finish(1)
    with pytest.raises(TransferError, match="unknown request 'r1'"):
        late = pair32.tx.open("r1", pair32.rx.address)
        late.send_pages((0, 2), SRC, DST)
        late.finish(1)
    assert not out.event.wait(0.6)  # well past the 0.3 s deadline


def test_abort_frame_fails_the_request_with_the_senders_reason(pair32):
    out = pair32.expect("r1")
    ch = pair32.tx.open("r1", pair32.rx.address)
    ch.send_pages((0, 1), SRC, DST)
    ch.abort("prefill ran out of memory")
    assert out.wait() == ("failed", "r1", "aborted by sender: prefill ran out of memory")
    ch.abort("again")  # never raises
    with pytest.raises(TransferError, match="channel is closed"):
        ch.send_pages((1, 2), SRC, DST)
    assert len(out.calls) == 1


def test_sender_close_aborts_open_channels(pair32):
    out = pair32.expect("r1")
    ch = pair32.tx.open("r1", pair32.rx.address)
    ch.send_pages((0, 1), SRC, DST)
    pair32.tx.close()
    assert out.wait() == ("failed", "r1", "aborted by sender: sender closed")
    with pytest.raises(TransferError, match="closed"):
        ch.finish(1)
    with pytest.raises(TransferError, match="sender is closed"):
        pair32.tx.open("r2", pair32.rx.address)


def test_connecting_to_a_closed_port_fails_fast(pair32):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(TransferError, match=f"'r9'.*127.0.0.1:{port}"):
        pair32.tx.open("r9", f"127.0.0.1:{port}")
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(ValueError, match="host:port"):
        pair32.tx.open("r9", "no-port")


# -- receiver lifecycle --------------------------------------------------------------------------


def test_receiver_close_fails_pending_registrations_and_stops_listening(pair32):
    waiting, streaming = pair32.expect("waiting", [3]), pair32.expect("r1")
    ch = pair32.tx.open("r1", pair32.rx.address)
    ch.send_pages((0, 1), SRC, DST)
    t0 = time.monotonic()
    pair32.rx.close()
    assert time.monotonic() - t0 < 1.0
    assert waiting.calls == [("failed", "waiting", "receiver closed")]
    assert streaming.calls == [("failed", "r1", "receiver closed")]
    with pytest.raises(ConnectionRefusedError):
        raw_connect(pair32.rx)
    with pytest.raises(TransferError):
        ch.send_pages((1, 2), SRC, DST)
        ch.finish(1)
    with pytest.raises(RuntimeError, match="closed"):
        pair32.expect("late")
    pair32.rx.close()  # idempotent


def test_expect_validates_its_arguments(pair32):
    pair32.expect("r1")
    with pytest.raises(ValueError, match="already registered"):
        pair32.expect("r1")
    for blocks, timeout_s in [([], 1.0), ([8], 1.0), ([1, 1], 1.0), ([1], 0.0)]:
        with pytest.raises(ValueError):
            pair32.expect("r2", blocks, timeout_s)


def test_callbacks_may_call_back_into_the_receiver(pair32):
    follow_up = Outcome()
    first = Outcome()

    def on_complete(rid: str, token: int) -> None:
        pair32.rx.cancel("other")
        pair32.rx.expect("r2", DST, 5.0, follow_up.on_complete, follow_up.on_failed)
        first.on_complete(rid, token)

    pair32.expect("other", [4])
    pair32.rx.expect("r1", DST, 5.0, on_complete, first.on_failed)
    pair32.transfer("r1")
    assert first.wait() == ("complete", "r1", 7)
    pair32.transfer("r2", token=8)
    assert follow_up.wait() == ("complete", "r2", 8)


def test_receiver_may_be_closed_from_a_deadline_callback(pair32):
    closed = threading.Event()

    def on_failed(rid: str, reason: str) -> None:
        pair32.rx.close()  # runs on the reaper thread, which close() must not join
        closed.set()

    pending = pair32.expect("pending", [4])
    pair32.rx.expect("r1", DST, 0.2, lambda *a: None, on_failed)
    assert closed.wait(3.0)
    assert pending.calls == [("failed", "pending", "receiver closed")]
