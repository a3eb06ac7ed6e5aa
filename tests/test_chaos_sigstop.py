"""Chaos: a decode worker that stops answering mid-stream (SIGSTOP: no TCP reset, no error status).

Cluster: 1 prefill + 2 decode workers and a router whose ``stream_idle_timeout_s`` is ``IDLE_S``.
``NUM_REQUESTS`` greedy requests stream at once with no client deadline; once each has tokens, the
decode worker d0 (serving some of them) is SIGSTOPped. Contract:

1. every request completes token-exact against an undisturbed run of the same prompt, those on d0
   through a migration, within ``IDLE_S`` plus a margin of the stop (the stall rule of router/stall.py);
2. a call held open on d0 with no router in between, on a channel of ``deploy.client.open_channel``,
   fails UNAVAILABLE within gRPC keepalive's bound (``cluster.service.KEEPALIVE_CHANNEL_OPTIONS``: a
   ping after 10 s, its ack due 5 s later), where it used to wait forever;
3. d0's lease lapses and new requests are served by d1 alone, without a retry or a wait;
4. after SIGCONT d0 re-registers and serves again, and every worker's KV pool ends fully free.
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import time
from dataclasses import dataclass, field

import grpc
import pytest

from pdserve.deploy import client
from pdserve.model.sampling import SamplingParams
from pdserve.proto import worker_pb2, worker_pb2_grpc
from pdserve.proto.convert import sampling_to_wire
from tests.clusters import Cluster

PROMPTS = [
    "Once upon a time, there was a little dog",
    "Lily and Ben went to the park. They saw a big",
    "The cat was sad because",
    "One day, a big bear found a honey pot in the woods. He",
    "Tim had a red ball. He liked to",
    "The sun was hot and the flowers were",
]
NUM_REQUESTS = len(PROMPTS)
MAX_TOKENS = 400   # long streams: d0 is stopped while they are mid-way
IDLE_S = 2.0       # the router's stream_idle_timeout_s
MARGIN_S = 2.0     # re-prefill and a new decode worker on a loaded machine; below keepalive's ~5 s on a busy
                   # connection (an unacked ping fails it after ping_timeout_ms), so that bound is the idle rule's
KEEPALIVE_BOUND_S = 15.0  # cluster.service.KEEPALIVE_CHANNEL_OPTIONS: a ping after 10 s, its ack due 5 s later
HANG_S = 40.0      # a request still streaming this long after the stop hangs (the bug)


@dataclass
class Stream:
    """One request as its client saw it: each message's arrival time and token ids."""

    prompt: int
    started: float = 0.0
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (monotonic, tokens in the message)
    token_ids: list[int] = field(default_factory=list)
    final: object = None

    def resumed_after(self, t: float) -> float | None:
        """Seconds from ``t`` to the end of the longest gap between messages that ends after ``t`` (the
        stall: messages already in flight at ``t`` may still arrive just after it); None: none ends after."""
        times = [at for at, _ in self.arrivals]
        gaps = [(b - a, b) for a, b in zip(times, times[1:]) if b > t]
        return max(gaps)[1] - t if gaps else None


async def _run(channel: grpc.aio.Channel, s: Stream) -> Stream:
    request = client.make_request(PROMPTS[s.prompt], max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    s.started = time.monotonic()
    async for msg in client.stream(channel, request):  # no deadline: nothing but the router ends a stall
        s.arrivals.append((time.monotonic(), len(msg.token_ids)))
        s.token_ids.extend(msg.token_ids)
        if msg.HasField("final"):
            s.final = msg.final
    return s


def _state_worker(state, worker_id: str):
    return next((w for w in state.workers if w.worker_id == worker_id), None)


@pytest.fixture
def stall_cluster(redis_url, model_dir):
    c = Cluster(model_dir, redis_url, num_prefill=1, num_decode=2, router_flags={"stream_idle_timeout_s": IDLE_S})
    yield c
    for w in c.workers:  # a stopped process would sit out SIGTERM's timeout
        if w.proc.poll() is None:
            os.kill(w.proc.pid, signal.SIGCONT)
    c.stop()


def test_sigstopped_decode_worker_is_detected_and_its_requests_migrate(stall_cluster):
    c = stall_cluster
    began = time.monotonic()
    victim = c.worker("d0")

    async def references() -> list[list[int]]:
        async with grpc.aio.insecure_channel(c.address) as ch:
            done = await asyncio.gather(*(_run(ch, Stream(i)) for i in range(NUM_REQUESTS)))
        return [s.token_ids for s in done]

    refs = asyncio.run(references())  # the undisturbed cluster
    assert all(len(r) == MAX_TOKENS for r in refs)

    async def stall() -> dict:
        out: dict = {}
        async with grpc.aio.insecure_channel(c.address) as ch, \
                client.open_channel(victim.address) as dch:  # the client helper's keepalive, end to end
            # a call held open on d0 with no router in between: it waits for KV pages that never come
            held = worker_pb2_grpc.DecodeWorkerStub(dch).Generate(worker_pb2.DecodeRequest(
                request_id="held-by-test", prompt_token_ids=[1, 2, 3, 4, 5], kv_timeout_s=300,
                sampling=sampling_to_wire(SamplingParams(temperature=0, max_tokens=8))))
            assert (await held.read()).WhichOneof("event") == "allocated"
            streams = [Stream(i) for i in range(NUM_REQUESTS)]
            tasks = [asyncio.create_task(_run(ch, s)) for s in streams]
            deadline = time.monotonic() + 30
            while True:  # every request streaming, and d0 decoding some of them
                state = await client.cluster_state(ch)
                on_victim = _state_worker(state, "d0").num_router_inflight
                if all(len(s.token_ids) >= 5 for s in streams) and on_victim >= 1:
                    break
                assert not any(t.done() for t in tasks), "a request ended before the stop"
                assert time.monotonic() < deadline, "the requests never all streamed with some on d0"
                await asyncio.sleep(0.01)
            os.kill(victim.proc.pid, signal.SIGSTOP)
            out["stopped_at"] = stopped = time.monotonic()
            out["on_victim"] = on_victim
            out["tokens_at_stop"] = [len(s.token_ids) for s in streams]

            async def held_fails() -> float:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await held.read()
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
                return time.monotonic() - stopped

            async def unlisted() -> float:  # the router drops d0 once its lease lapsed
                while _state_worker(await client.cluster_state(ch), "d0") is not None:
                    await asyncio.sleep(0.05)
                return time.monotonic() - stopped

            keepalive, lapse = asyncio.create_task(held_fails()), asyncio.create_task(unlisted())
            done, pending = await asyncio.wait(tasks, timeout=HANG_S)
            for t in pending:
                t.cancel()
            assert not pending, (f"{len(pending)} of {NUM_REQUESTS} requests hung {HANG_S:.0f} s after d0 "
                                 f"stopped; tokens: {[len(s.token_ids) for s in streams]}")
            out["all_done_s"] = time.monotonic() - stopped
            out["streams"] = [t.result() for t in tasks]
            out["lapsed_s"] = await asyncio.wait_for(lapse, 15)
            try:
                out["keepalive_s"] = await asyncio.wait_for(keepalive, KEEPALIVE_BOUND_S + 10)
            except asyncio.TimeoutError:
                pytest.fail(f"the call held on the stopped d0 did not fail within {KEEPALIVE_BOUND_S + 10:.0f} s "
                            "(no gRPC keepalive?)")
        return out

    out = asyncio.run(stall())
    stopped, streams = out["stopped_at"], out["streams"]

    # 1. every request token-exact; d0's migrated, detected about IDLE_S after the stop
    for s in streams:
        assert s.token_ids == refs[s.prompt], f"request {s.prompt} is not token-exact"
        assert s.final is not None and s.final.usage.completion_tokens == MAX_TOKENS
    migrated = [s for s in streams if s.final.num_migrations]
    assert len(migrated) >= 1, "the stop landed on no stream"
    assert all(s.final.num_migrations == 1 and s.final.num_retries == 0 for s in migrated)
    resumed = [s.resumed_after(stopped) for s in migrated]
    assert all(r is not None and IDLE_S - 0.5 <= r <= IDLE_S + MARGIN_S for r in resumed), resumed
    assert out["keepalive_s"] <= KEEPALIVE_BOUND_S + 5, out["keepalive_s"]

    # 2. d0's lease lapses; new requests go to d1 only, served at once
    c.wait_workers({"p0", "d1"}, timeout_s=10)

    async def after_lapse() -> list[Stream]:
        async with grpc.aio.insecure_channel(c.address) as ch:
            return await asyncio.wait_for(asyncio.gather(*(_run(ch, Stream(i)) for i in range(4))), HANG_S)

    for s in asyncio.run(after_lapse()):
        assert s.token_ids == refs[s.prompt]
        assert (s.final.num_retries, s.final.num_migrations) == (0, 0)
        assert s.arrivals[0][0] - s.started < IDLE_S  # first token before an allocation wait on d0 could end

    # 3. SIGCONT: d0 re-registers, frees what it held (the router's cancelled streams, the held call) and serves
    os.kill(victim.proc.pid, signal.SIGCONT)
    resumed_at = time.monotonic()
    c.wait_workers({"p0", "d0", "d1"}, timeout_s=15)
    rejoin_s = time.monotonic() - resumed_at
    c.assert_pools_free(timeout_s=15)

    async def after_rejoin() -> tuple[list[Stream], int]:
        async with grpc.aio.insecure_channel(c.address) as ch:
            tasks = [asyncio.create_task(_run(ch, Stream(i))) for i in range(NUM_REQUESTS)]
            most_on_d0 = 0
            while not all(t.done() for t in tasks):
                w = _state_worker(await client.cluster_state(ch), "d0")
                most_on_d0 = max(most_on_d0, w.num_router_inflight if w else 0)
                await asyncio.sleep(0.02)
            return [t.result() for t in tasks], most_on_d0

    rejoined, most_on_d0 = asyncio.run(asyncio.wait_for(after_rejoin(), HANG_S))
    assert all(s.token_ids == refs[s.prompt] for s in rejoined)
    assert most_on_d0 >= 1, "d0 took no request after it rejoined"
    c.assert_pools_free()

    print(f"\nSIGSTOP chaos: 1 prefill + 2 decode workers (tinystories-656k, CPU), {NUM_REQUESTS} greedy "
          f"{MAX_TOKENS}-token requests in flight, no client deadline, stream_idle_timeout_s {IDLE_S:g}; "
          f"{time.monotonic() - began:.1f} s in all")
    print(f"in flight on d0 at the stop: {out['on_victim']}; tokens streamed then: {out['tokens_at_stop']}")
    print(f"completed token-exact: {len(streams)}/{NUM_REQUESTS}; migrated: {len(migrated)}; "
          f"retried: {sum(s.final.num_retries > 0 for s in streams)}")
    print(f"stall detected, stream resumed on d1 (s after SIGSTOP): min {min(resumed):.2f}, "
          f"median {statistics.median(resumed):.2f}, max {max(resumed):.2f}; all requests done {out['all_done_s']:.2f}")
    print(f"held call on d0 failed by keepalive: {out['keepalive_s']:.2f} s after SIGSTOP "
          f"(bound {KEEPALIVE_BOUND_S:g} s)")
    print(f"d0 unlisted (lease lapsed): {out['lapsed_s']:.2f} s after SIGSTOP; re-registered {rejoin_s:.2f} s after "
          f"SIGCONT; requests on it after rejoining: up to {most_on_d0} at once; KV blocks leaked: 0")
