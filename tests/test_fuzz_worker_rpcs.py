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

The request strategies and the oracles are in :mod:`tests.worker_rpc_fuzz_helpers`.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections import Counter

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.decode_worker.request import MAX_KV_TIMEOUT_S
from pdserve.decode_worker.server import CheckedDecodeRequest, check_decode_request
from pdserve.kvtransfer.wire.pending import PendingTransfers
from pdserve.model.sampling import SamplingParams
from pdserve.prefill_worker.server import CheckedPrefillRequest, check_prefill_request
from pdserve.proto import worker_pb2, worker_pb2_grpc
from tests.clusters import Cluster
from tests.worker_rpc_fuzz_helpers import (
    BLOCK,
    CONTEXT,
    EOS,
    VOCAB,
    decode_problems,
    decode_requests,
    fuzz,
    prefill_problems,
    prefill_requests,
    unique,
    valid_decode_requests,
    valid_prefill_pairs,
    valid_prefill_requests,
)

pytestmark = pytest.mark.timeout(300)

CASES: Counter = Counter()
MIN_CASES = 5000  # generated cases per run, live and in process together
CALL_TIMEOUT_S = 20.0  # a call taking longer is a hang


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
