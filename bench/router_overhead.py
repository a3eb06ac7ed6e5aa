"""The router's added latency: the same request straight to a colocated worker and through a
router in front of it (part 1 of ``bench/soak.py``)."""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc

from pdserve.bench.load import make_prompts, percentiles, stream_once
from pdserve.deploy import client
from pdserve.deploy.processes import RoleProcess, spawn_role
from pdserve.proto import worker_pb2, worker_pb2_grpc


async def _direct(stub, ids: list[int], max_tokens: int) -> tuple[float, float]:
    sampling = worker_pb2.ResolvedSampling(temperature=0.0, top_p=1.0, seed=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    first = last = 0.0
    n = 0
    async for ev in stub.Generate(worker_pb2.DecodeRequest(request_id=uuid.uuid4().hex, prompt_token_ids=ids,
                                                           sampling=sampling, local_prefill=True), timeout=60):
        if ev.WhichOneof("event") == "tokens":
            last, n = time.perf_counter(), n + len(ev.tokens.token_ids)
            first = first or last
    assert n == max_tokens, f"direct call streamed {n} of {max_tokens} tokens"
    return first - start, (last - first) / (n - 1)


async def _routed(channel, ids: list[int], max_tokens: int) -> tuple[float, float]:
    request = client.make_request(ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ttft, tpot, n = await stream_once(channel, request, 60)
    assert n == max_tokens, f"routed call streamed {n} of {max_tokens} tokens"
    return ttft, tpot


async def router_overhead(worker_address: str, router_address: str, pairs: int, prompts: list[list[int]],
                          max_tokens: int = 16) -> dict:
    """Client-side TTFT and TPOT of the same requests direct to a colocated worker and through a
    router in front of it (sequential, alternating order), with p50/p99 and the router's addition."""
    got: dict[str, dict[str, list[float]]] = {p: {"ttft_s": [], "tpot_s": []} for p in ("direct", "routed")}
    async with grpc.aio.insecure_channel(worker_address) as wch, grpc.aio.insecure_channel(router_address) as rch:
        stub = worker_pb2_grpc.DecodeWorkerStub(wch)
        calls = {"direct": lambda ids: _direct(stub, ids, max_tokens),
                 "routed": lambda ids: _routed(rch, ids, max_tokens)}
        for i in range(10):  # warm both paths (channels, graph buckets, registry read)
            for path in calls:
                await calls[path](prompts[i % len(prompts)])
        for i in range(pairs):
            order = ("direct", "routed") if i % 2 == 0 else ("routed", "direct")
            for path in order:
                ttft, tpot = await calls[path](prompts[i % len(prompts)])
                got[path]["ttft_s"].append(ttft)
                got[path]["tpot_s"].append(tpot)
    out = {path: {m: percentiles(v) for m, v in metrics.items()} for path, metrics in got.items()}
    out["added"] = {m: {q: out["routed"][m][q] - out["direct"][m][q] for q in ("p50", "p99")} for m in got["direct"]}
    # Per pair (same prompt, back to back): less exposed to load from other processes than the difference of
    # two independent percentiles.
    out["paired_added"] = {m: percentiles([r - d for r, d in zip(got["routed"][m], got["direct"][m])])
                           for m in got["direct"]}
    out["pairs"], out["max_tokens"] = pairs, max_tokens
    return out


def measure_router_overhead(model: str, redis_url: str, pairs: int, seed: int) -> dict:
    """Start a colocated worker and a router in front of it, measure :func:`router_overhead`, stop them."""
    ns = "soak-lat-" + uuid.uuid4().hex[:8]
    procs: list[RoleProcess] = []
    try:
        procs.append(spawn_role("decode_worker", dict(worker_id="c0", model_dir=model, cluster=ns, redis_url=redis_url,
                                                      colocated="true"), "colocated"))
        procs.append(spawn_role("router", dict(model_dir=model, cluster=ns, redis_url=redis_url), "router"))
        prompts = [p for p in make_prompts(64, seed) if isinstance(p, list)]
        return asyncio.run(router_overhead(procs[0].address, procs[1].address, pairs, prompts))
    finally:
        for p in reversed(procs):
            p.stop()


