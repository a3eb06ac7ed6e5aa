"""Property-based fuzzing of the workers' RPCs (``proto/worker.proto``): decode ``Generate`` and prefill
``Prefill``, as :mod:`tests.test_fuzz_validation` fuzzes the router's requests.

Against live worker processes (one prefill + one decode worker, and a router for the registry view,
started once for the module), over thousands of derandomized hypothesis cases whose fields range over
valid and invalid values, extreme floats included (NaN, +-inf, 1e300, -0.0, subnormals, the largest
float32), plus corrupt wire bytes. Property: every call ends as an independent oracle says, never
INTERNAL, UNKNOWN or a hang:

- decode ``Generate``: INVALID_ARGUMENT naming a problem, or the ``allocated`` event (then the test
  cancels the call, or, for a short ``kv_timeout_s``, waits for the deadline: UNAVAILABLE "timed out");
  ``local_prefill`` on this non-colocated worker is FAILED_PRECONDITION once every field is valid;
- prefill ``Prefill``: INVALID_ARGUMENT naming a problem, or, paired with a real decode allocation,
  OK with the decode stream running to ``finished``.

In process, more cases against the pure field checks (``check_decode_request``, ``check_prefill_request``),
and the finding's probes: a bad ``kv_timeout_s`` refused before allocating, an allocation rolled back when
registering its transfer fails, the KV receiver's reaper surviving far deadlines. Afterwards every KV block
of both workers is free, and the decode worker still enforces KV deadlines.
"""

from __future__ import annotations

import math
import re
import struct
import threading
import time
import unicodedata
import uuid
from collections import Counter

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.cluster.rpc_fields import MAX_ATTEMPT_ID_CHARS
from pdserve.decode_worker.request import MAX_KV_TIMEOUT_S
from pdserve.decode_worker.server import CheckedDecodeRequest, check_decode_request
from pdserve.deploy.config import EMBEDDED_MODEL
from pdserve.kvtransfer.wire.pending import PendingTransfers
from pdserve.model.config import ModelConfig
from pdserve.model.sampling import SamplingParams
from pdserve.prefill_worker.server import MAX_KV_ADDRESS_CHARS, CheckedPrefillRequest, check_prefill_request
from pdserve.proto import worker_pb2, worker_pb2_grpc
from tests.conftest import Cluster

pytestmark = pytest.mark.timeout(300)

CFG = ModelConfig.from_hf_dir(EMBEDDED_MODEL)
VOCAB, CONTEXT, EOS = CFG.vocab_size, CFG.max_position_embeddings, tuple(CFG.eos_token_ids)
BLOCK = 16  # the workers' block size (WorkerConfig default)
CASES: Counter = Counter()
MIN_CASES = 5000  # generated cases per run, live and in process together
CALL_TIMEOUT_S = 20.0  # a call taking longer is a hang


def fuzz(n: int) -> settings:
    """Deterministic hypothesis settings running ``n`` examples."""
    return settings(max_examples=n, derandomize=True, database=None, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                           HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])


# -- strategies ------------------------------------------------------------------------------------
# Built from few, cheap draws (sampled values, integers, token lists derived from a seed): hypothesis's
# cost per case, not the RPC's (about a millisecond), bounds how many cases fit the file's time budget.

I32 = st.integers(-2**31, 2**31 - 1)
EXTREMES = [0.0, -0.0, 5e-324, 1e-45, 1.2e-38, 1e-9, 0.5, 1.0, 1.0000001, 3.4028234663852886e38, 1e300, -1e300,
            math.inf, -math.inf, math.nan, -1.0]
# any bit pattern (NaNs, infinities, subnormals, -0.0 included) from one integer draw
float32_bits = st.integers(0, 2**32 - 1).map(lambda b: struct.unpack("<f", struct.pack("<I", b))[0])
float64_bits = st.integers(0, 2**64 - 1).map(lambda b: struct.unpack("<d", struct.pack("<Q", b))[0])
floats32 = st.sampled_from(EXTREMES) | float32_bits  # 1e300 becomes inf in a float32 field
timeouts = (st.sampled_from(EXTREMES + [0.002, 0.01, 2.0, 30.0, MAX_KV_TIMEOUT_S, 3600.0000000000005]) | float64_bits
            | st.integers(1, 10**6).map(lambda n: n / 100))
unit = st.integers(1, 2**24).map(lambda n: n / 2**24)  # (0, 1]


def _ids(n: int, seed: int) -> list[int]:
    """``n`` token ids in the vocabulary, spread by ``seed``."""
    return [(seed + i * 2654435761) % VOCAB for i in range(n)]


seeds = st.integers(0, 2**32)
valid_ids = st.builds(_ids, st.integers(1, 40), seeds)
bad_ids = st.builds(lambda ids, bad, at: ids[:at] + [bad] + ids[at:], valid_ids | st.just([]),
                    st.sampled_from([-1, VOCAB, VOCAB + 1, 2**40, -2**63, 2**63 - 1]), st.integers(0, 40))
long_ids = st.builds(_ids, st.integers(CONTEXT - 3, CONTEXT + 3) | st.just(5000), seeds)
any_ids = valid_ids | bad_ids | long_ids | st.just([])
attempt_ids = (st.uuids().map(lambda u: u.hex) | st.text(max_size=6)
               | st.sampled_from(["", "a", "attempt-1-2", "é🙂", "x" * MAX_ATTEMPT_ID_CHARS,
                                  "y" * (MAX_ATTEMPT_ID_CHARS + 1), "z" * 5000, "ok\n", "\x1b[31mred", "rtl\u202e",
                                  "line\u2028", "nul\x00", "\t", " spaced id "]))
stop_lists = st.sampled_from([[], [2], [0, VOCAB - 1], [5, 6, 7], [VOCAB], [-1], [2**40], [-2**63]])


def unique(attempt_id: str) -> str:
    """Make a drawn id unique per call (a worker refuses an id it still holds, and a cancelled call's id is
    released a moment later) without changing its validity: valid ids get a random tail, within the limit."""
    if not attempt_id or len(attempt_id) > MAX_ATTEMPT_ID_CHARS or _unsafe(attempt_id):
        return attempt_id
    return attempt_id[: MAX_ATTEMPT_ID_CHARS - 9] + "-" + uuid.uuid4().hex[:8]


@st.composite
def samplings(draw, valid: bool = False, max_tokens: int | None = None) -> worker_pb2.ResolvedSampling:
    if valid:
        temperature = draw(st.sampled_from([0.0, -0.0, 1e-45, 1.2e-38, 0.7, 1.0, 3.4028234663852886e38])
                           | unit.map(lambda x: 10 * x))
        top_p = draw(st.sampled_from([1.0, 1e-45, 0.9, 0.5]) | unit)
        top_k = draw(st.integers(0, 50) | st.just(2**31 - 1))
        stops = draw(st.sampled_from([[], [2], [0, VOCAB - 1], [5, 6, 7]]))
        mt = max_tokens if max_tokens is not None else draw(st.integers(1, 8))
    else:
        temperature, top_p = draw(floats32), draw(floats32)
        top_k, stops = draw(st.integers(-3, 3) | I32), draw(stop_lists)
        mt = draw(st.integers(-3, 40) | I32 | st.sampled_from([CONTEXT - 1, CONTEXT, CONTEXT + 1]))
    return worker_pb2.ResolvedSampling(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=mt,
                                       seed=draw(st.sampled_from([0, 2**63, 2**64 - 1]) | st.integers(0, 2**64 - 1)),
                                       stop_token_ids=stops, ignore_eos=draw(st.booleans()))


@st.composite
def decode_requests(draw) -> worker_pb2.DecodeRequest:
    """Decode requests whose fields range over valid and invalid values."""
    return worker_pb2.DecodeRequest(
        request_id=draw(attempt_ids), prompt_token_ids=draw(any_ids), sampling=draw(samplings()),
        kv_timeout_s=draw(timeouts), local_prefill=draw(st.sampled_from([False] * 7 + [True])),
        prior_output_token_ids=draw(st.just([]) | st.builds(_ids, st.integers(1, 6), seeds) | bad_ids))


@st.composite
def valid_decode_requests(draw) -> worker_pb2.DecodeRequest:
    """Decode requests the worker must allocate for (extreme but valid values)."""
    sampling = draw(samplings(valid=True, max_tokens=draw(st.integers(1, 40) | st.just(CONTEXT - 40))))
    stops = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(EOS))
    prior = [t for t in _ids(draw(st.integers(0, min(4, sampling.max_tokens - 1))), draw(seeds)) if t not in stops]
    prompt = _ids(draw(st.integers(1, min(40, CONTEXT - sampling.max_tokens))), draw(seeds))
    return worker_pb2.DecodeRequest(
        request_id=draw(st.uuids().map(lambda u: u.hex) | st.sampled_from(["r", "é🙂", "x" * 240])),
        prompt_token_ids=prompt, sampling=sampling, prior_output_token_ids=prior,
        kv_timeout_s=draw(st.sampled_from([5e-324, 0.002, 0.01, 1.0, 30.0, MAX_KV_TIMEOUT_S])
                          | st.integers(50, 10**4).map(lambda n: n / 100)))


addresses = (st.sampled_from(["127.0.0.1:1", "localhost:65535", "[::1]:50051", "decode-0.pdserve.svc:7000",
                              "", "127.0.0.1", "127.0.0.1:0", "127.0.0.1:65536", "127.0.0.1:-1", ":80", "h:80x",
                              " 127.0.0.1:5", "a b:5", "::1:5", "tcp://h:5", "nccl://127.0.0.1:5", "h:5\n",
                              "x" * MAX_KV_ADDRESS_CHARS + ":1", "é.example:5", "[::1%eth0]:5", "h/..:5"])
             | st.text(max_size=8)
             | st.builds(lambda host, port: f"{host}:{port}", st.sampled_from(["10.0.0.7", "h", "a-b.c", "[fe80::1]"]),
                         st.integers(-2, 70000)))


def _blocks(need: int, start: int, kind: str) -> list[int]:
    """A destination block table for ``need`` blocks: distinct ids, or one ``kind`` of wrong."""
    ids = [start + 3 * i for i in range(need)]
    if kind == "repeated":
        return ids + ids[:1] if need < 2 else ids[:-1] + ids[:1]
    if kind == "negative":
        return ids[:-1] + [-1 - start]
    return {"short": ids[:-1], "long": ids + [start + 3 * need], "i32max": ids[:-1] + [2**31 - 1]}.get(kind, ids)


@st.composite
def prefill_requests(draw) -> worker_pb2.PrefillRequest:
    """Prefill requests whose fields range over valid and invalid values (block ids often of the right count)."""
    ids = draw(any_ids)
    kind = draw(st.sampled_from(["ok"] * 4 + ["repeated", "negative", "short", "long", "i32max"]))
    return worker_pb2.PrefillRequest(
        request_id=draw(attempt_ids), token_ids=ids, sampling=draw(samplings() | samplings(valid=True)),
        dst_kv_address=draw(addresses), dst_block_ids=_blocks(-(-len(ids) // BLOCK), draw(st.integers(0, 600)), kind),
        first_output_index=draw(st.integers(-2, 10) | I32))


@st.composite
def valid_prefill_pairs(draw) -> tuple[worker_pb2.PrefillRequest, worker_pb2.DecodeRequest]:
    """A prefill request every field of which is valid (extreme but valid sampling, migrated or not), and the
    decode request that allocates its destination (the test fills in dst_block_ids and dst_kv_address)."""
    sampling = draw(samplings(valid=True))
    first = draw(st.integers(0, sampling.max_tokens - 1))
    prompt = _ids(draw(st.integers(1, 40)), draw(seeds))
    stops = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(EOS))
    prior = [t if t not in stops else 3 + t for t in _ids(first, draw(seeds))]  # 3 + t: never a stop id here
    rid = uuid.uuid4().hex
    prefill = worker_pb2.PrefillRequest(request_id=rid, token_ids=prompt + prior, sampling=sampling,
                                        first_output_index=first)
    decode = worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling, kv_timeout_s=20,
                                      prior_output_token_ids=prior)
    return prefill, decode


@st.composite
def valid_prefill_requests(draw) -> worker_pb2.PrefillRequest:
    """Prefill requests every field of which is valid, for the in-process checks (no decode worker behind them)."""
    prefill, _ = draw(valid_prefill_pairs())
    prefill.request_id = draw(attempt_ids.filter(lambda rid: not _id_problems(rid)))
    prefill.dst_block_ids[:] = _blocks(-(-len(prefill.token_ids) // BLOCK), draw(st.integers(0, 2**31 - 200)), "ok")
    prefill.dst_kv_address = draw(st.sampled_from(["127.0.0.1:1", "localhost:65535", "[::1]:50051",
                                                   "decode-0.pdserve.svc:7000", "[fe80::1%eth0]:9"]))
    return prefill


# -- independent oracles: the words naming each problem (empty: valid) -------------------------------

def _unsafe(text: str) -> bool:
    return any(unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp", "Cs") for c in text)


def _id_problems(attempt_id: str) -> set[str]:
    return {"request_id"} if not attempt_id or len(attempt_id) > MAX_ATTEMPT_ID_CHARS or _unsafe(attempt_id) else set()


def _sampling_problems(s: worker_pb2.ResolvedSampling) -> set[str]:
    bad = set()
    if not (math.isfinite(s.temperature) and s.temperature >= 0):
        bad.add("temperature")
    if not (math.isfinite(s.top_p) and 0 < s.top_p <= 1):
        bad.add("top_p")
    if s.top_k < 0:
        bad.add("top_k")
    if s.max_tokens < 1:
        bad.add("max_tokens")
    if any(not 0 <= t < VOCAB for t in s.stop_token_ids):
        bad.add("stop_token_ids")
    return bad


def decode_problems(req: worker_pb2.DecodeRequest) -> set[str]:
    s, prompt, prior = req.sampling, list(req.prompt_token_ids), list(req.prior_output_token_ids)
    bad = _id_problems(req.request_id) | _sampling_problems(s)
    if not prompt or len(prompt) >= CONTEXT or any(not 0 <= t < VOCAB for t in prompt):
        bad.add("prompt_token_ids")
    if s.max_tokens >= 1 and len(prompt) + s.max_tokens > CONTEXT:
        bad.add("context")
    if any(not 0 <= t < VOCAB for t in prior) or (s.max_tokens >= 1 and len(prior) >= s.max_tokens):
        bad.add("prior_output_token_ids")
    if prior and (prior[-1] in s.stop_token_ids or (not s.ignore_eos and prior[-1] in EOS)):
        bad.add("stop token")
    kv = req.kv_timeout_s
    if not (math.isfinite(kv) and 0 < kv <= MAX_KV_TIMEOUT_S) and not (req.local_prefill and kv == 0):
        bad.add("kv_timeout_s")
    return bad


_ADDRESS = re.compile(r"(?:[A-Za-z0-9._-]+|\[[0-9A-Za-z.:%_-]+\]):([0-9]+)")


def prefill_problems(req: worker_pb2.PrefillRequest) -> set[str]:
    s, ids, blocks, first = req.sampling, list(req.token_ids), list(req.dst_block_ids), req.first_output_index
    bad = _id_problems(req.request_id) | _sampling_problems(s)
    if not ids or len(ids) >= CONTEXT or any(not 0 <= t < VOCAB for t in ids):
        bad.add("token_ids")
    if s.max_tokens >= 1:
        if not 0 <= first < s.max_tokens:
            bad.add("first_output_index")
        elif first >= len(ids) or len(ids) - first + s.max_tokens > CONTEXT:
            bad.add("context")
    if len(blocks) != -(-len(ids) // BLOCK):
        bad.add("destination blocks")
    if any(b < 0 for b in blocks) or len(set(blocks)) != len(blocks):
        bad.add("dst_block_ids")
    address = req.dst_kv_address
    m = _ADDRESS.fullmatch(address)
    if len(address) > MAX_KV_ADDRESS_CHARS or not m or not 1 <= int(m.group(1)) <= 65535:
        bad |= {"dst_kv_address", "KV address", "KV transport"}
    return bad


def assert_refusal_names(details: str, bad: set[str]) -> None:
    assert details and any(word in details for word in bad), (bad, details)


# -- in process: the probe's cases, then the field checks ------------------------------------------------

BAD_KV_TIMEOUTS = [0.0, -0.0, -1.0, -math.inf, math.nan, math.inf, 1e300, MAX_KV_TIMEOUT_S * (1 + 1e-15)]


@pytest.mark.parametrize("kv_timeout_s", BAD_KV_TIMEOUTS)
def test_engine_refuses_a_bad_kv_timeout_before_allocating(engine, kv_timeout_s):
    free = engine.pool.num_free
    with pytest.raises(ValueError, match="kv_timeout_s"):
        engine.add_request(f"t-{kv_timeout_s}", list(range(1, 30)), SamplingParams(temperature=0, max_tokens=4),
                           kv_timeout_s, lambda ev: None)
    engine.step()  # drains the inbox: nothing may be left there holding blocks
    assert engine.pool.num_free == free and engine.num_transferring == 0


def test_engine_rolls_the_allocation_back_when_registering_the_transfer_fails(engine, monkeypatch):
    free = engine.pool.num_free

    def refuse(*args, **kwargs):
        raise RuntimeError("receiver is closed")

    monkeypatch.setattr(engine.receiver, "expect", refuse)
    with pytest.raises(RuntimeError):
        engine.add_request("r", list(range(1, 30)), SamplingParams(temperature=0, max_tokens=4), 5.0, lambda ev: None)
    engine.step()
    assert engine.pool.num_free == free and engine.num_transferring == 0
    monkeypatch.undo()
    engine.add_request("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4), 5.0, lambda ev: None)  # id free
    engine.abort("r")
    engine.step()
    assert engine.pool.num_free == free


@pytest.mark.parametrize("far_s", [1e300, math.inf, 1e9])
def test_the_reaper_survives_a_far_deadline_and_keeps_reaping(far_s):
    """A registration with a far (or infinite) deadline must not break the reaper's wait (OverflowError in
    ``Condition.wait``): a later, near deadline is still enforced on time."""
    table = PendingTransfers(num_blocks=8, num_layers=1)
    noop = lambda *args: None  # noqa: E731
    table.add("far", [0], far_s, noop, noop)
    reaped, errors = [], []

    def reap() -> None:
        try:
            while (expired := table.wait_expired()) is not None:
                reaped.extend(t.request_id for t in expired)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    thread = threading.Thread(target=reap, daemon=True)
    thread.start()
    time.sleep(0.1)
    table.add("near", [1], 0.2, noop, noop)
    deadline = time.monotonic() + 3
    while "near" not in reaped and not errors and time.monotonic() < deadline:
        time.sleep(0.01)
    table.close()
    thread.join(5)
    assert not errors and reaped == ["near"] and not thread.is_alive()


# -- in process: the field checks --------------------------------------------------------------------

@fuzz(850)
@given(req=decode_requests() | valid_decode_requests())
def test_decode_field_checks_match_the_oracle(req):
    bad = decode_problems(req)
    try:
        got = check_decode_request(req, VOCAB, CONTEXT, EOS)
    except ValueError as exc:
        assert bad, f"refused a valid request: {exc}"
        assert_refusal_names(str(exc), bad)
        CASES["inproc_decode_refused"] += 1
        return
    assert not bad, f"accepted a request with {bad}"
    assert isinstance(got, CheckedDecodeRequest) and got.prompt_ids == list(req.prompt_token_ids)
    assert got.kv_timeout_s is None if req.local_prefill else 0 < got.kv_timeout_s <= MAX_KV_TIMEOUT_S
    CASES["inproc_decode_valid"] += 1


@fuzz(850)
@given(req=prefill_requests() | valid_prefill_requests())
def test_prefill_field_checks_match_the_oracle(req):
    bad = prefill_problems(req)
    try:
        got = check_prefill_request(req, VOCAB, CONTEXT, BLOCK, ("tcp",))
    except ValueError as exc:
        assert bad, f"refused a valid request: {exc}"
        assert_refusal_names(str(exc), bad)
        CASES["inproc_prefill_refused"] += 1
        return
    assert not bad, f"accepted a request with {bad}"
    assert isinstance(got, CheckedPrefillRequest) and got.dst_block_ids == list(req.dst_block_ids)
    CASES["inproc_prefill_valid"] += 1


def test_nccl_addresses_are_refused_by_a_tcp_only_prefill_worker_and_taken_by_an_nccl_one():
    req = worker_pb2.PrefillRequest(request_id="r", token_ids=[1, 2], dst_kv_address="nccl://10.0.0.7:9000",
                                    dst_block_ids=[3], sampling=worker_pb2.ResolvedSampling(top_p=1, max_tokens=2))
    with pytest.raises(ValueError, match="nccl KV transport"):
        check_prefill_request(req, VOCAB, CONTEXT, BLOCK, ("tcp",))
    assert check_prefill_request(req, VOCAB, CONTEXT, BLOCK, ("nccl",)).dst_kv_address == "nccl://10.0.0.7:9000"


# -- live worker processes -----------------------------------------------------------------------------

class Workers:
    """Blocking stubs to the live decode and prefill workers of a cluster."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        workers = cluster.state().workers
        self.decode_info = next(w for w in workers if w.role == "decode")
        prefill = next(w for w in workers if w.role == "prefill")
        self._channels = [grpc.insecure_channel(self.decode_info.address), grpc.insecure_channel(prefill.address)]
        self.decode = worker_pb2_grpc.DecodeWorkerStub(self._channels[0])
        self.prefill = worker_pb2_grpc.PrefillWorkerStub(self._channels[1])
        self.raw_decode = self._channels[0].unary_stream("/pdserve.worker.v1.DecodeWorker/Generate")
        self.raw_prefill = self._channels[1].unary_unary("/pdserve.worker.v1.PrefillWorker/Prefill")

    def open_decode(self, req) -> tuple[str, str, object, worker_pb2.DecodeEvent | None]:
        """Call Generate and read its first event: (status name, details, call, first event)."""
        call = self.decode.Generate(req, timeout=CALL_TIMEOUT_S)
        try:
            first = next(call)
        except grpc.RpcError as exc:
            return exc.code().name, exc.details() or "", call, None
        return "OK", "", call, first

    def close(self) -> None:
        for ch in self._channels:
            ch.close()


@pytest.fixture(scope="module")
def workers(redis_url, model_dir):
    c = Cluster(model_dir, redis_url)
    w = Workers(c)
    yield w
    w.close()
    c.stop()


def _drain(call) -> tuple[str, str, list[worker_pb2.DecodeEvent]]:
    events = []
    try:
        for ev in call:
            events.append(ev)
    except grpc.RpcError as exc:
        return exc.code().name, exc.details() or "", events
    return "OK", "", events


def test_live_decode_refuses_every_bad_kv_timeout_and_leaks_no_block(workers):
    """The probe of the finding: a non-positive, NaN, huge or infinite kv_timeout_s is INVALID_ARGUMENT before
    any block is allocated (it used to leave blocks TRANSFERRING without a deadline, or kill the reaper)."""
    for kv in BAD_KV_TIMEOUTS:
        req = worker_pb2.DecodeRequest(request_id=uuid.uuid4().hex, prompt_token_ids=list(range(1, 60)),
                                       kv_timeout_s=kv, sampling=worker_pb2.ResolvedSampling(top_p=1, max_tokens=4))
        code, details, call, _ = workers.open_decode(req)
        call.cancel()
        assert code == "INVALID_ARGUMENT" and "kv_timeout_s" in details, (kv, code, details)
    workers.cluster.assert_pools_free()


@fuzz(1800)
@given(req=decode_requests() | valid_decode_requests())
def test_live_decode_generate_refuses_or_allocates(workers, req):
    req.request_id = unique(req.request_id)
    bad = decode_problems(req)
    code, details, call, first = workers.open_decode(req)
    if bad:
        assert code == "INVALID_ARGUMENT", (code, details, bad)
        assert_refusal_names(details, bad)
        CASES["live_decode_refused"] += 1
        return
    if req.local_prefill:
        assert code == "FAILED_PRECONDITION" and "not colocated" in details, (code, details)
        CASES["live_decode_not_colocated"] += 1
        return
    assert code == "OK" and first.WhichOneof("event") == "allocated", (code, details)
    assert len(first.allocated.block_ids) == -(-(len(req.prompt_token_ids) + len(req.prior_output_token_ids))
                                                // BLOCK)
    if req.kv_timeout_s <= 0.05:  # no pages will come: the deadline must end it, and free the blocks
        started = time.monotonic()
        code, details, _ = _drain(call)
        assert code == "UNAVAILABLE" and "timed out" in details, (code, details)
        assert time.monotonic() - started < req.kv_timeout_s + 5
        CASES["live_decode_timed_out"] += 1
    else:
        call.cancel()  # the router's cancel: the worker frees the blocks
        CASES["live_decode_allocated"] += 1


@fuzz(1200)
@given(req=prefill_requests())
def test_live_prefill_refuses_every_bad_field(workers, req):
    """Requests with a bad field end INVALID_ARGUMENT before anything is queued (valid ones are the next
    test's: a valid request must be paired with a real decode allocation)."""
    bad = prefill_problems(req)
    if not bad:
        req.first_output_index = -1  # make it invalid: no valid request leaves for a made-up decode worker here
        bad = {"first_output_index"}
    req.request_id = unique(req.request_id)
    try:
        workers.prefill.Prefill(req, timeout=CALL_TIMEOUT_S)
        code, details = "OK", ""
    except grpc.RpcError as exc:
        code, details = exc.code().name, exc.details() or ""
    assert code == "INVALID_ARGUMENT", (code, details, bad)
    assert_refusal_names(details, bad)
    CASES["live_prefill_refused"] += 1


@fuzz(120)
@given(pair=valid_prefill_pairs())
def test_live_valid_prefill_with_extreme_values_is_served(workers, pair):
    prefill, decode = pair
    code, details, call, first = workers.open_decode(decode)
    assert code == "OK" and first.WhichOneof("event") == "allocated", (code, details)
    try:
        prefill.dst_block_ids[:] = first.allocated.block_ids
        prefill.dst_kv_address = first.allocated.kv_address
        answer = workers.prefill.Prefill(prefill, timeout=CALL_TIMEOUT_S)
        assert 0 <= answer.first_token < VOCAB
        code, details, events = _drain(call)
        assert code == "OK" and events and events[-1].WhichOneof("event") == "finished", (code, details)
        streamed = sum(len(ev.tokens.token_ids) for ev in events if ev.WhichOneof("event") == "tokens")
        assert events[-1].finished.num_output_tokens == prefill.first_output_index + 1 + streamed
        assert events[-1].finished.num_output_tokens <= prefill.sampling.max_tokens
    finally:
        call.cancel()
    CASES["live_prefill_served"] += 1


@fuzz(300)
@given(raw=st.binary(max_size=80), which=st.sampled_from(["decode", "prefill"]))
def test_live_corrupt_or_arbitrary_bytes_end_invalid_argument_or_are_served(workers, raw, which):
    """Bytes that are no message end INVALID_ARGUMENT (not gRPC's UNKNOWN); those that parse are checked as above."""
    msg_type = worker_pb2.DecodeRequest if which == "decode" else worker_pb2.PrefillRequest
    try:
        parsed = msg_type.FromString(raw)
    except Exception:
        parsed = None
    try:
        if which == "decode":
            call = workers.raw_decode(raw, timeout=CALL_TIMEOUT_S)
            next(call)
            call.cancel()
        else:
            workers.raw_prefill(raw, timeout=CALL_TIMEOUT_S)
        code, details = "OK", ""
    except grpc.RpcError as exc:
        code, details = exc.code().name, exc.details() or ""
    if parsed is None:
        assert code == "INVALID_ARGUMENT" and "malformed" in details, (code, details)
    else:
        bad = decode_problems(parsed) if which == "decode" else prefill_problems(parsed)
        if bad:
            assert code == "INVALID_ARGUMENT", (code, details, bad)
        else:
            assert code in ("OK", "FAILED_PRECONDITION", "UNAVAILABLE"), (code, details)
    CASES["live_bytes"] += 1


def test_generated_case_count_and_workers_are_whole_afterwards(workers):
    """Runs after the properties: how many cases ran; every KV block is free again; the decode worker still
    enforces KV deadlines (its reaper lives) and the cluster serves."""
    total = sum(CASES.values())
    print(f"\nfuzz worker RPCs: {total} generated cases: {dict(CASES)}")
    assert total >= MIN_CASES, dict(CASES)
    assert CASES["live_decode_allocated"] + CASES["live_decode_timed_out"] >= 300, dict(CASES)
    assert CASES["live_prefill_served"] >= 100, dict(CASES)
    workers.cluster.assert_pools_free()
    req = worker_pb2.DecodeRequest(request_id=uuid.uuid4().hex, prompt_token_ids=list(range(1, 40)), kv_timeout_s=0.3,
                                   sampling=worker_pb2.ResolvedSampling(top_p=1, max_tokens=4))
    started = time.monotonic()
    code, details, call, first = workers.open_decode(req)
    assert code == "OK", details
    code, details, _ = _drain(call)
    assert code == "UNAVAILABLE" and "timed out" in details and time.monotonic() - started < 3
    done = workers.cluster.complete("Once upon a time", max_tokens=4, temperature=0)
    assert done.final.usage.completion_tokens == 4
    workers.cluster.assert_pools_free()
