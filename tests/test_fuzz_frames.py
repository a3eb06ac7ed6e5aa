"""Property-based fuzzing of the TCP KV frame codec (``kvtransfer/wire/frames.py``).

Properties, each over thousands of generated inputs (hypothesis, derandomized so CI runs
the same cases every time):

* valid frames round-trip exactly through ``encode`` -> socket -> ``read_frame``;
* a header cut at any byte raises ``PeerClosed`` (``None`` only before the first byte);
* every other invalid input raises ``FrameError`` whose message names the bad field, never
  another exception type, never a hang (sockets carry a timeout), and never an allocation
  sized by attacker-controlled numbers (measured with ``tracemalloc``).

The last test asserts how many generated cases actually ran, so the number in the docs is
a measurement.
"""

from __future__ import annotations

import socket
import struct
import tracemalloc
from collections import Counter

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.kvtransfer.wire.frames import (
    MAX_HEADER_BYTES,
    Abort,
    Ack,
    Done,
    FrameError,
    Pages,
    PeerClosed,
    check_pages,
    decode,
    dtype_name,
    encode,
    read_frame,
    unpack_header,
)
from pdserve.model.kv_cache import KVCacheSpec

pytestmark = pytest.mark.timeout(240)

SPEC = KVCacheSpec(num_blocks=16, num_layers=3, block_size=2, num_kv_heads=2, head_dim=2, dtype=torch.float32)
CASES: Counter = Counter()  # test name -> generated cases that ran to the end
MIN_CASES = 7000  # this file's share of the >= 10,000 generated cases per CI run


def fuzz(n: int) -> settings:
    """Deterministic hypothesis settings running ``n`` examples."""
    return settings(max_examples=n, derandomize=True, database=None, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                           HealthCheck.data_too_large])


# -- strategies ----------------------------------------------------------------------------------

request_ids = st.text(min_size=1, max_size=24)
i64 = st.integers(-2**63, 2**63 - 1)
wire_ints = st.integers(-2**63, 2**64 - 1)  # every int msgpack can carry
scalars = st.none() | st.booleans() | wire_ints | st.floats() | st.text(max_size=12) | st.binary(max_size=12)
wire_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)


@st.composite
def valid_pages(draw, spec: KVCacheSpec = SPEC) -> Pages:
    ls = draw(st.integers(0, spec.num_layers - 1))
    le = draw(st.integers(ls + 1, spec.num_layers))
    blocks = tuple(draw(st.lists(st.integers(0, spec.num_blocks - 1), min_size=1, max_size=8, unique=True)))
    shape = (len(blocks), *spec.page_shape(le - ls))
    return Pages(draw(request_ids), ls, le, blocks, dtype_name(spec.dtype), shape,
                 len(blocks) * spec.page_nbytes(le - ls))


valid_frames = st.one_of(
    valid_pages(),
    st.builds(Done, request_ids, i64),
    st.builds(Abort, request_ids, st.text(max_size=64)),
    st.builds(Ack, st.text(max_size=24), st.booleans(), st.text(max_size=64)),
)

FIELD_KINDS = {"request_id": "str", "layer_start": "int", "layer_end": "int", "block_ids": "ints",
               "dtype": "str", "shape": "ints", "nbytes": "int", "first_token": "int", "reason": "str",
               "ok": "bool", "error": "str"}


def fits(kind: str, value: object) -> bool:
    """Whether ``value`` has the wire type ``kind`` that the codec accepts for a field."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    return {"str": isinstance(value, str), "int": is_int, "bool": isinstance(value, bool),
            "ints": isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in value),
            }[kind]


def header_of(frame) -> dict:
    """The msgpack map ``encode`` puts on the wire for ``frame`` (decoded back)."""
    return msgpack.unpackb(encode(frame)[4:], raw=False)


def framed(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def read_bytes(data: bytes, close: bool = True, timeout_s: float = 2.0):
    """``read_frame`` over a real socket pair after the peer sent ``data`` (and closed, if asked)."""
    a, b = socket.socketpair()
    try:
        b.settimeout(timeout_s)
        a.sendall(data)
        if close:
            a.shutdown(socket.SHUT_WR)
        return read_frame(b)
    finally:
        a.close()
        b.close()


def refused(data: bytes, close: bool = True) -> FrameError:
    with pytest.raises(FrameError) as info:
        read_bytes(data, close)
    return info.value


# -- valid frames ----------------------------------------------------------------------------------

@fuzz(800)
@given(frame=valid_frames, extra=st.dictionaries(st.text(min_size=1, max_size=8).filter(lambda k: k not in
                                                                                         {*FIELD_KINDS, "type"}),
                                                 wire_values, max_size=3))
def test_valid_frames_round_trip_exactly(frame, extra):
    assert read_bytes(encode(frame)) == frame
    if isinstance(frame, Pages):
        check_pages(frame, SPEC)  # a well-formed pages frame fits the cache it was made for
    # Unknown keys are ignored (forward compatibility) and change nothing.
    assert read_bytes(framed(msgpack.packb({**header_of(frame), **extra}, use_bin_type=True))) == frame
    CASES["round_trip"] += 1


@fuzz(250)
@given(frame=valid_frames)
def test_truncated_at_every_byte_is_peer_closed(frame):
    data = encode(frame)
    assert read_bytes(b"") is None  # clean EOF before a frame starts
    for cut in range(1, len(data)):
        with pytest.raises(PeerClosed):
            read_bytes(data[:cut])
        CASES["truncation_points"] += 1
    CASES["truncated_frames"] += 1


# -- malformed headers -----------------------------------------------------------------------------

@fuzz(250)
@given(length=st.integers(MAX_HEADER_BYTES + 1, 2**32 - 1), tail=st.binary(max_size=16))
def test_header_length_over_limit_is_refused_before_reading_it(length, tail):
    # The peer does not close: reading the body would time out instead of failing at once.
    err = refused(struct.pack(">I", length) + tail, close=False)
    assert "header length" in str(err) and str(length) in str(err)
    CASES["oversized"] += 1


@fuzz(1500)
@given(body=st.binary(max_size=600))
def test_garbage_body_is_frame_error_or_a_valid_frame(body):
    try:
        frame = read_bytes(framed(body))
    except FrameError as e:
        assert str(e)
    else:  # garbage that happens to be a valid header must decode to exactly that header
        assert isinstance(frame, (Pages, Done, Abort, Ack))
    CASES["garbage"] += 1


@fuzz(800)
@given(header=wire_values)
def test_arbitrary_msgpack_values_decode_or_frame_error(header):
    body = msgpack.packb(header, use_bin_type=True)
    try:
        frame = read_bytes(framed(body))
    except FrameError as e:
        assert str(e)
    else:
        assert isinstance(frame, (Pages, Done, Abort, Ack))
    CASES["msgpack_values"] += 1


@fuzz(400)
@given(kind=st.sampled_from(["pages", "done", "abort", "ack", "nope", ""]) | wire_values)
def test_unknown_or_unhashable_frame_type_is_frame_error(kind):
    good = header_of(Done("r", 1))
    if kind in ("pages", "done", "abort", "ack"):
        return  # a known type is not this property's business
    err = refused(framed(msgpack.packb({**good, "type": kind}, use_bin_type=True)))
    assert "unknown frame type" in str(err)
    CASES["frame_type"] += 1


@fuzz(1000)
@given(frame=valid_frames, data=st.data())
def test_wrong_type_in_any_field_names_the_field(frame, data):
    header = header_of(frame)
    field = data.draw(st.sampled_from(sorted(set(header) - {"type"})))
    bad = data.draw(wire_values.filter(lambda v: not fits(FIELD_KINDS[field], v)))
    header[field] = bad
    err = refused(framed(msgpack.packb(header, use_bin_type=True)))
    assert repr(field) in str(err), str(err)
    # The error carries the request id whenever the header still names one, so the receiver can fail it.
    assert err.request_id == (header["request_id"] if isinstance(header["request_id"], str) else None)
    CASES["wrong_type"] += 1


@fuzz(400)
@given(frame=valid_frames, data=st.data())
def test_missing_field_names_the_field(frame, data):
    header = header_of(frame)
    field = data.draw(st.sampled_from(sorted(set(header) - {"type"})))
    del header[field]
    err = refused(framed(msgpack.packb(header, use_bin_type=True)))
    assert f"missing field {field!r}" in str(err)
    CASES["missing"] += 1


@fuzz(300)
@given(frame=valid_frames, data=st.data())
def test_repeated_map_key_is_refused(frame, data):
    header = header_of(frame)
    key = data.draw(st.sampled_from(sorted(header)))
    pairs = [*header.items(), (key, data.draw(wire_values))]
    order = data.draw(st.permutations(range(len(pairs))))
    body = msgpack.Packer(use_bin_type=True).pack_map_pairs([pairs[i] for i in order])
    err = refused(framed(body))
    assert "repeats the key" in str(err) and repr(key) in str(err)
    CASES["dup_key"] += 1


@fuzz(200)
@given(frame=st.builds(Done, st.just(""), i64) | st.builds(Abort, st.just(""), st.text(max_size=8)))
def test_empty_request_id_is_refused(frame):
    err = refused(encode(frame))
    assert "empty request_id" in str(err)
    CASES["empty_id"] += 1


@fuzz(250)
@given(body=st.binary(min_size=1, max_size=40), key=st.integers(-5, 5) | st.binary(max_size=4) | st.none())
def test_invalid_utf8_and_non_string_keys_are_frame_errors(body, key):
    bad_text = b"\xa4\xff\xfe\xfd\xfc"  # fixstr of 4 bytes that are not UTF-8
    with pytest.raises(FrameError, match="not valid msgpack"):
        unpack_header(b"\x81\xa4type" + bad_text)
    with pytest.raises(FrameError):  # int/None keys fail to unpack; bytes keys leave no "type"
        decode(unpack_header(msgpack.packb({key: 1}, use_bin_type=True)))
    with pytest.raises(FrameError):
        unpack_header(msgpack.packb({"type": "done"}) + body)  # trailing bytes after the header
    CASES["utf8_keys"] += 1


@pytest.mark.parametrize("body", [b"\x91" * 60_000 + b"\xc0", b"\x81\xa1a" * 20_000 + b"\xc0"],
                         ids=["nested-arrays", "nested-maps"])
def test_deep_nesting_is_frame_error_not_recursion_error(body):
    err = refused(framed(body))
    assert "not valid msgpack" in str(err) and "StackError" in str(err)


# -- pages that do not fit the cache -----------------------------------------------------------------

def _layer_range(draw):
    ls, le = draw(st.tuples(i64, i64).filter(lambda r: not 0 <= r[0] < r[1] <= SPEC.num_layers))
    return {"layer_start": ls, "layer_end": le}, "layer range"


def _block_out_of_range(draw, p: Pages):
    bad = draw(st.integers(-2**63, -1) | st.integers(SPEC.num_blocks, 2**63 - 1))
    ids = list(p.block_ids)
    ids[draw(st.integers(0, len(ids) - 1))] = bad
    return {"block_ids": ids}, "out of range"


def _block_repeated(draw, p: Pages):
    ids = [*p.block_ids, draw(st.sampled_from(p.block_ids))]
    shape = [len(ids), *p.shape[1:]]
    return {"block_ids": ids, "shape": shape, "nbytes": p.nbytes // len(p.block_ids) * len(ids)}, "repeated block ids"


def _dtype(draw, p: Pages):
    bad = draw(st.sampled_from(["bfloat16", "float16", "float64", "int8", "torch.float32", "Float32", "float32 ", ""])
               | st.text(max_size=10))
    return ({"dtype": bad}, "dtype") if bad != p.dtype else ({"block_ids": []}, "empty")


def _shape(draw, p: Pages):
    bad = draw(st.lists(i64, max_size=8).filter(lambda s: tuple(s) != p.shape))
    return {"shape": bad}, "shape"


def _nbytes(draw, p: Pages):
    bad = draw(i64.filter(lambda n: n != p.nbytes) | st.sampled_from([p.nbytes + 1, p.nbytes - 1, 0, -p.nbytes]))
    return {"nbytes": bad}, "nbytes"


MUTATIONS = {"layers": lambda d, p: _layer_range(d), "block_range": _block_out_of_range,
             "block_repeat": _block_repeated, "dtype": _dtype, "shape": _shape, "nbytes": _nbytes,
             "empty_blocks": lambda d, p: ({"block_ids": [], "shape": [0, *p.shape[1:]], "nbytes": 0}, "empty")}


@fuzz(2000)
@given(frame=valid_pages(), data=st.data())
def test_pages_that_do_not_fit_the_cache_name_the_field(frame, data):
    name = data.draw(st.sampled_from(sorted(MUTATIONS)))
    change, words = MUTATIONS[name](data.draw, frame)
    header = {**header_of(frame), **change}
    parsed = read_bytes(framed(msgpack.packb(header, use_bin_type=True)))  # types are fine: it decodes
    with pytest.raises(FrameError) as info:
        check_pages(parsed, SPEC)
    assert words in str(info.value), (name, str(info.value))
    CASES["pages_" + name] += 1


# -- no allocation sized by the attacker --------------------------------------------------------------

CLAIMS = [b"\xdb", b"\xc6", b"\xdd", b"\xdf"]  # str32, bin32, array32, map32: a u32 length follows


@fuzz(150)
@given(kind=st.sampled_from(CLAIMS), claimed=st.integers(2**20, 2**32 - 1), tail=st.binary(max_size=64),
       nbytes=st.integers(2**40, 2**63 - 1), length=st.integers(MAX_HEADER_BYTES + 1, 2**32 - 1))
def test_attacker_sizes_never_drive_allocation(kind, claimed, tail, nbytes, length):
    pages = header_of(Pages("r", 0, 1, (0,), "float32", (2**31, 1, 2, 2, 2, 2), 8))
    tracemalloc.start()
    try:
        with pytest.raises(FrameError):  # containers claiming up to 4 GiB inside a tiny header
            read_bytes(framed(kind + struct.pack(">I", claimed) + tail))
        with pytest.raises(FrameError):  # a header length claiming up to 4 GiB
            read_bytes(struct.pack(">I", length), close=False)
        frame = decode({**pages, "nbytes": nbytes})  # a huge nbytes and shape are only compared
        with pytest.raises(FrameError, match="shape"):
            check_pages(frame, SPEC)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 256 * 1024, f"peak allocation {peak} bytes"
    CASES["allocation"] += 1


# -- a stalled peer ------------------------------------------------------------------------------------

@pytest.mark.parametrize("sent", [b"", b"\x00\x00", struct.pack(">I", 40) + b"\x85"], ids=["silent", "mid-length",
                                                                                          "mid-header"])
def test_stalled_peer_times_out_instead_of_hanging(sent):
    with pytest.raises(TimeoutError):
        read_bytes(sent, close=False, timeout_s=0.2)


def test_generated_case_count():
    """Runs last: the number of generated cases this file ran (printed for the docs)."""
    total = sum(v for k, v in CASES.items() if k != "truncation_points")
    print(f"\nfuzz frames: {total} generated cases ({CASES['truncation_points']} truncation points): {dict(CASES)}")
    assert total >= MIN_CASES, dict(CASES)
