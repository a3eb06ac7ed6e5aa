"""Worker faults under one request: a decode worker killed mid-stream (the request migrates and
stays token-identical), a prefill worker killed mid-transfer (the decode worker frees the blocks it
pre-allocated), and the engine's continuation of a migrated request's output."""

from __future__ import annotations

import asyncio
import re
import threading
import time
import uuid

import grpc
import msgpack
import pytest
import redis

from pdserve.decode_worker.request import FinishedEvent, TokensEvent
from pdserve.deploy import client
from pdserve.deploy.processes import spawn_role
from pdserve.model.sampling import SamplingParams
from pdserve.proto import pdserve_pb2, worker_pb2, worker_pb2_grpc
from pdserve.proto.convert import sampling_to_wire
from pdserve.router.recovery import GenerateError, Progress, WorkerFailure
from tests.clusters import Cluster

PROMPT = "Once upon a time, there was a little dog named Max. He"
MAX_TOKENS = 400  # long enough that a kill after a few tokens lands mid-stream


# ---- in process: the decode engine continues a migrated request's output -----------------------------

def _run_local(engine, prompt, sampling, prior=()):
    events = []
    engine.add_local(uuid.uuid4().hex, prompt, sampling, events.append, prior_output_ids=list(prior))
    for _ in range(400):
        engine.step()
        if events and not isinstance(events[-1], TokensEvent):
            break
    return [t for ev in events if isinstance(ev, TokensEvent) for t in ev.token_ids], events[-1]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_prior_output_continues_the_same_stream(engine, temperature):
    """Prefill of prompt + the first k outputs, then decode, gives outputs k.. of the uninterrupted run:
    seeded sampling continues at output index k and max_tokens counts the prior tokens."""
    prompt = [1, 400, 500, 600, 7, 8]
    sampling = SamplingParams(temperature=temperature, seed=1234, max_tokens=20, ignore_eos=True)
    full, last = _run_local(engine, prompt, sampling)
    assert len(full) == 20 and isinstance(last, FinishedEvent)
    for k in (1, 7, 19):
        rest, last = _run_local(engine, prompt, sampling, full[:k])
        assert rest == full[k:], k
        assert isinstance(last, FinishedEvent) and last.reason == "length" and last.num_output_tokens == 20
    assert engine.pool.num_free == engine.num_usable_blocks


def test_prior_output_that_already_ends_the_request_is_refused(engine):
    sampling = SamplingParams(temperature=0, max_tokens=4)
    eos = engine.model_cfg.eos_token_ids[0]
    with pytest.raises(ValueError, match="reach max_tokens"):
        engine.add_local("a", [1, 2, 3], sampling, lambda ev: None, prior_output_ids=[5, 6, 7, 8])
    with pytest.raises(ValueError, match="stop token"):
        engine.add_local("b", [1, 2, 3], sampling, lambda ev: None, prior_output_ids=[5, eos])
    assert engine.pool.num_free == engine.num_usable_blocks  # nothing allocated, ids released
    engine.add_local("a", [1, 2, 3], sampling, lambda ev: None)


def test_attempts_are_bounded_and_name_every_failure():
    progress = Progress()
    assert progress.record(WorkerFailure({"p0"}, "prefill worker p0 failed: x"), None) >= 0
    progress.generated = [5, 6]
    progress.record(WorkerFailure({"d0"}, "decode worker d0 failed mid-stream: y"), None)
    progress.record(WorkerFailure({"d1"}, "decode worker d1 failed mid-stream: z"), None)
    assert (progress.num_retries, progress.num_migrations, progress.avoid) == (1, 2, {"p0", "d0", "d1"})
    with pytest.raises(GenerateError) as info:
        progress.record(WorkerFailure({"d2"}, "decode worker d2 failed mid-stream: w"), None)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert all(w in info.value.message for w in ("p0", "d0", "d1", "d2"))
    with pytest.raises(GenerateError, match="deadline"):
        Progress().record(WorkerFailure({"d0"}, "d0 died"), time.monotonic() + 0.1)


# ---- real processes ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mig_cluster(redis_url, model_dir):
    """1 prefill + 3 decode workers: each migration test kills one decode worker."""
    c = Cluster(model_dir, redis_url, num_prefill=1, num_decode=3)
    yield c
    c.stop()


async def _stream_killing_decode(c: Cluster, request, after_tokens: int = 5):
    """Stream ``request``; once ``after_tokens`` tokens arrived, kill -9 the decode worker serving it.
    Returns (completion, victim id, tokens received before the kill)."""
    out, reached = client.Completion(), asyncio.Event()
    async with grpc.aio.insecure_channel(c.address) as channel:
        async def consume():
            async for msg in client.stream(channel, request, timeout_s=60):
                out.text += msg.text
                out.token_ids.extend(msg.token_ids)
                out.final = msg.final if msg.HasField("final") else out.final
                if len(out.token_ids) >= after_tokens:
                    reached.set()

        task = asyncio.create_task(consume())
        waiter = asyncio.create_task(reached.wait())
        await asyncio.wait({task, waiter}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        assert reached.is_set() and not task.done(), "the request did not stream (or ended before the kill)"
        state = await client.cluster_state(channel)
        victims = [w.worker_id for w in state.workers if w.role == "decode" and w.num_router_inflight > 0]
        assert len(victims) == 1, victims
        before = len(out.token_ids)
        c.kill(victims[0])
        await asyncio.wait_for(task, 60)
    return out, victims[0], before


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8, seed=4321)],
                         ids=["greedy", "seeded"])
def test_decode_killed_mid_stream_migrates_token_exact(mig_cluster, sampling):
    """kill -9 of the decode worker mid-stream: the client sees one stream, identical to an
    uninterrupted run (no token duplicated or dropped), with one migration and the full usage."""
    kw = dict(max_tokens=MAX_TOKENS, ignore_eos=True, **sampling)
    reference = mig_cluster.complete(PROMPT, **kw)
    assert len(reference.token_ids) == MAX_TOKENS
    started = time.monotonic()
    done, victim, before = asyncio.run(_stream_killing_decode(mig_cluster, client.make_request(PROMPT, **kw)))
    assert 5 <= before < MAX_TOKENS
    assert done.token_ids == reference.token_ids
    assert done.text == reference.text
    f = done.final
    assert (f.num_migrations, f.num_retries) == (1, 0)
    assert f.usage.completion_tokens == MAX_TOKENS and f.finish_reason == pdserve_pb2.FINISH_REASON_LENGTH
    assert time.monotonic() - started < 30
    mig_cluster.workers = [w for w in mig_cluster.workers if w.name != victim]
    mig_cluster.wait_workers({w.name for w in mig_cluster.workers})  # the victim's lease lapsed
    mig_cluster.assert_pools_free()


def _registry_entry(redis_url: str, cluster: str, worker_id: str) -> dict | None:
    raw = redis.Redis.from_url(redis_url).get(f"pdserve:{cluster}:worker:{worker_id}")
    return None if raw is None else msgpack.unpackb(raw)


def test_prefill_killed_mid_transfer_frees_the_decode_blocks(mig_cluster, model_dir, redis_url):
    """A prefill worker dies after sending the pages but before ``done``: the decode worker's receiver
    fails the registration, the stream ends UNAVAILABLE naming the cut transfer, and the blocks it
    pre-allocated are free again, without waiting for kv_timeout_s."""
    namespace = "held-" + uuid.uuid4().hex[:8]  # not the cluster's: the router never sees this worker
    held = spawn_role("prefill_worker", dict(model_dir=model_dir, worker_id="held", cluster=namespace,
                                             redis_url=redis_url, lease_s=2.0, kv_events=False,
                                             fault_hold_transfer_s=120.0), "held")
    try:
        decode = next(w for w in mig_cluster.state().workers if w.role == "decode")
        prompt = list(range(1, 101))
        outcome: dict = {}

        async def go():
            async with grpc.aio.insecure_channel(decode.address) as dch, \
                    grpc.aio.insecure_channel(held.address) as pch:
                sampling = sampling_to_wire(SamplingParams(temperature=0, max_tokens=8))
                rid = "held-" + uuid.uuid4().hex
                call = worker_pb2_grpc.DecodeWorkerStub(dch).Generate(worker_pb2.DecodeRequest(
                    request_id=rid, prompt_token_ids=prompt, kv_timeout_s=120,
                    sampling=sampling))
                first = await call.read()
                outcome["blocks"] = list(first.allocated.block_ids)
                prefill = worker_pb2_grpc.PrefillWorkerStub(pch).Prefill(worker_pb2.PrefillRequest(
                    request_id=rid, token_ids=prompt, sampling=sampling, dst_kv_address=first.allocated.kv_address,
                    dst_block_ids=first.allocated.block_ids), timeout=120)
                deadline = time.monotonic() + 20
                while (_registry_entry(redis_url, namespace, "held") or {}).get("num_running") != 1:
                    assert time.monotonic() < deadline, "the held prefill never admitted the request"
                    await asyncio.sleep(0.05)
                await asyncio.sleep(1.0)  # compute and page sends of 100 tokens take milliseconds
                threading.Thread(target=held.proc.kill).start()
                killed = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await asyncio.wait_for(call.read(), 10)
                outcome["ended_after_s"] = time.monotonic() - killed
                outcome["error"] = info.value
                with pytest.raises(grpc.aio.AioRpcError):
                    await prefill

        asyncio.run(go())
        assert len(outcome["blocks"]) == 7
        err = outcome["error"]
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        # every page written, the done frame (with the first token) never came
        assert "mid-transfer" in err.details() and re.search(r"(\d+) of \1 pages received", err.details()), \
            err.details()
        assert outcome["ended_after_s"] < 5
        mig_cluster.assert_pools_free()
    finally:
        held.stop()
