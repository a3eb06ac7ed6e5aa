"""One transfer conformance suite for every KV transport this machine can run.

Each test runs once per backend: TCP between two CPU caches always; NCCL between ``cuda:0`` and
``cuda:1`` when two GPUs and ``libnccl.so.2`` are present (otherwise its cases show as skipped with
the reason). Sender and receiver are built by :mod:`kvtransfer.select` from the caches' devices,
so the automatic choice is exercised too. Real sockets on 127.0.0.1, real threads, no fakes.

Here: byte-exact transfers in any order, refused, partial and aborted ones; deadlines, cancel, close and
callbacks are in tests/test_kvtransfer_conformance_lifecycle.py, the helpers in tests/kv_conformance.py.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from pdserve.kvtransfer.base import TransferError
from tests.kv_conformance import BACKENDS, DST, SRC, Pair, as_bytes, assert_copied, pair_factory, wait_for_pages

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
