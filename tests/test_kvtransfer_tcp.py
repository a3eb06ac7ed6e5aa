"""What only the TCP KV transport has: zero-copy page views, its wire frames (every malformed frame is
refused, the receiver keeps serving), raw peers that stall or hang up mid-payload. The backend-generic
contract (integrity, ordering, partial/aborted transfers, timeouts, cancel, exactly-once callbacks) is
in tests/test_kvtransfer_conformance.py, which runs it against TCP too."""

from __future__ import annotations

import socket
import struct
import time
from dataclasses import dataclass

import msgpack
import pytest
import torch

from pdserve.kvtransfer.tcp import TcpKVReceiver, TcpKVSender
from pdserve.kvtransfer.tcp import pages as pages_module
from pdserve.kvtransfer.tcp.pages import PageMemory, StagedPageMemory, page_memory
from pdserve.kvtransfer.wire.frames import MAX_HEADER_BYTES, Ack, read_frame
from pdserve.model.kv_cache import KVCacheSpec
from tests.kv_helpers import Outcome, make_spec

pytestmark = pytest.mark.timeout(20)

SRC, DST = [5, 1, 6], [2, 7, 0]  # source ids differ from destination ids on purpose





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


# -- page memory -------------------------------------------------------------------------------


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


def test_staged_pages_read_and_write_in_groups_of_the_stage_size():
    """A GPU cache's pages go through a host buffer (forced here on a CPU cache, the same code): reads
    give the pages' bytes in order, a group per view; writes land once a group's last page is in."""
    spec = make_spec(torch.bfloat16)
    cache = torch.randn(spec.shape).to(torch.bfloat16)
    staged = StagedPageMemory(cache, spec, stage_bytes=2 * spec.page_nbytes(1))  # two one-layer pages a copy
    views = [bytes(v) for v in staged.read([5, 1, 6], 1, 2)]
    assert [len(v) for v in views] == [2 * spec.page_nbytes(1), spec.page_nbytes(1)]
    plain = PageMemory(cache, spec)
    assert b"".join(views) == b"".join(bytes(plain.page(b, 1, 2)) for b in (5, 1, 6))
    dst = spec.allocate()
    writes = staged_dst = StagedPageMemory(dst, spec, stage_bytes=2 * spec.page_nbytes(1))
    pages = iter(writes.write([2, 7, 0], 1, 2))
    for i, want in enumerate((5, 1)):
        next(pages)[:] = bytes(plain.page(want, 1, 2))
        assert not dst.any(), "nothing lands before its group is complete"
    next(pages)[:] = bytes(plain.page(6, 1, 2))  # group 1 landed when the third view was asked for
    assert torch.equal(dst[2, 1], cache[5, 1]) and torch.equal(dst[7, 1], cache[1, 1]) and not dst[0].any()
    assert next(pages, None) is None             # exhausted: the last group is in
    assert torch.equal(dst[0, 1], cache[6, 1]) and not dst[:, 0].any()
    assert staged_dst is writes and isinstance(page_memory(cache, spec), PageMemory)


def test_staging_buffers_are_pooled_across_transfers_and_threads():
    """Each transfer holds one buffer while it runs (two at once: two buffers); finished transfers give
    theirs back, so later ones, on any thread, allocate (pin) nothing new."""
    spec = make_spec(torch.bfloat16)
    staged = StagedPageMemory(torch.randn(spec.shape).to(torch.bfloat16), spec)
    first, second = staged.read([1, 2], 0, 2), staged.read([3], 0, 2)
    next(first), next(second)
    assert staged._pool == []
    list(first), list(second)
    held = {id(b) for b in staged._pool}
    assert len(held) == 2
    for _ in range(3):
        list(staged.read([4, 5, 6], 0, 2))
    assert {id(b) for b in staged._pool} == held


def test_a_transfer_through_staged_pages_is_exact(monkeypatch):
    """The TCP sender and receiver drive the staged path (a CUDA cache's) as they drive the zero-copy one:
    forced on CPU caches with a stage of one page, every page arrives bit-exact."""
    monkeypatch.setattr("pdserve.kvtransfer.tcp.sender.page_memory",
                        lambda cache, spec: StagedPageMemory(cache, spec, stage_bytes=1))
    monkeypatch.setattr("pdserve.kvtransfer.tcp.receiver.page_memory",
                        lambda cache, spec: StagedPageMemory(cache, spec, stage_bytes=spec.page_nbytes(2) * 2))
    p = make_pair(torch.bfloat16)
    try:
        assert isinstance(p.tx._pages, StagedPageMemory) and isinstance(p.rx._pages, StagedPageMemory)
        out = p.expect("r1")
        stats = p.transfer("r1")
        assert out.wait() == ("complete", "r1", 7) and stats.num_pages == 3
        for s, d in zip(SRC, DST):
            assert torch.equal(p.dst[d], p.src[s])
        assert not p.dst[[b for b in range(p.spec.num_blocks) if b not in DST]].any()
    finally:
        p.tx.close()
        p.rx.close()
    assert pages_module.STAGE_BYTES >= p.spec.page_nbytes(p.spec.num_layers)


# -- refusals ----------------------------------------------------------------------------------


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
