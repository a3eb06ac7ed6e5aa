"""A decode worker's KV pool under requests whose ``max_tokens`` is far above what they use, as chat
clients send them (a cap, or none: the router's ``--max-tokens-limit``). ``--clients`` closed-loop clients
each stream requests (prompts of ``bench.load.make_prompts``, greedy, ``ignore_eos``, ``max_tokens`` =
``--max-tokens``) and cancel each after an output length drawn from [``--min-out``, ``--max-out``] tokens,
which frees its blocks on the decode worker as a stop token would. A refused request (RESOURCE_EXHAUSTED)
is retried after 50 ms, as a client of an overloaded server backs off. Reports, over ``--seconds``:
requests and output tokens completed per second, refusals, TTFT and TPOT percentiles at the client,
the decode worker's mean running batch (sampled from the router's view) and its preemptions
(``pdserve:num_preemptions_total``; absent before 2026-11-29).

Until 2026-11-29 a decode worker took blocks for ``prompt + max_tokens`` up front; to measure that
revision, run this file with ``PYTHONPATH`` pointing at a checkout of it (the spawned processes inherit
it), as ``bench/step_ab.py`` does. Not run in CI.

    .venv/bin/python bench/kv_capacity.py --out docs/results/kv_capacity_<tag>
    git worktree add /tmp/old 8ed2a8a && mkdir -p /tmp/oldpp && ln -s /tmp/old /tmp/oldpp/pdserve
    PYTHONPATH=/tmp/oldpp .venv/bin/python bench/kv_capacity.py --label 8ed2a8a --out /tmp/kv_old
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import grpc

from pdserve.bench.common import ROOT, LocalCluster, machine, worker_metric
from pdserve.bench.load import make_prompts, percentiles
from pdserve.cluster.args import default_redis_url
from pdserve.deploy import client
from pdserve.deploy.redis_server import ensure_redis
from pdserve.proto import pdserve_pb2_grpc


async def _client(address: str, prompts: list, rng: random.Random, args, until: float, out: dict) -> None:
    """One closed-loop client until ``until`` (monotonic seconds)."""
    async with grpc.aio.insecure_channel(address) as channel:
        while time.monotonic() < until:
            request = client.make_request(rng.choice(prompts), max_tokens=args.max_tokens, temperature=0.0,
                                          ignore_eos=True)
            want = rng.randint(args.min_out, args.max_out)
            start, first, n = time.perf_counter(), 0.0, 0
            call = pdserve_pb2_grpc.RouterStub(channel).Generate(request, timeout=120)
            try:
                async for msg in call:
                    if msg.token_ids:
                        first = first or time.perf_counter()
                        n += len(msg.token_ids)
                        if n >= want:
                            break
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    out["errors"].append(f"{exc.code().name}: {exc.details()}")
                else:
                    out["refused"] += 1
                await asyncio.sleep(0.05)
                continue
            finally:
                call.cancel()                   # the client leaves: the workers free the request's blocks
            now = time.perf_counter()
            out["ttft"].append(first - start)
            if n > 1:
                out["tpot"].append((now - first) / (n - 1))
            out["tokens"] += n
            out["requests"] += 1


async def _run(cluster: LocalCluster, args) -> dict:
    prompts, rng = make_prompts(64, 0), random.Random(1)
    out = {"requests": 0, "tokens": 0, "refused": 0, "errors": [], "ttft": [], "tpot": []}
    running: list[int] = []

    async def sample_batch(until: float) -> None:
        async with grpc.aio.insecure_channel(cluster.address) as channel:
            while time.monotonic() < until:
                state = await client.cluster_state(channel)
                running.extend(w.num_running for w in state.workers if w.role == "decode")
                await asyncio.sleep(0.25)

    until = time.monotonic() + args.seconds
    start = time.perf_counter()
    await asyncio.gather(sample_batch(until), *(
        _client(cluster.address, prompts, random.Random(rng.random()), args, until, out)
        for _ in range(args.clients)))
    seconds = time.perf_counter() - start
    async with grpc.aio.insecure_channel(cluster.address) as channel:
        decode = next(w for w in (await client.cluster_state(channel)).workers if w.role == "decode")
    return {"seconds": seconds, "requests_per_s": out["requests"] / seconds, "tokens_per_s": out["tokens"] / seconds,
            "requests": out["requests"], "refused": out["refused"], "errors": out["errors"][:10],
            "num_errors": len(out["errors"]), "ttft_s": percentiles(out["ttft"]), "tpot_s": percentiles(out["tpot"]),
            "mean_running": statistics.fmean(running) if running else 0.0,
            "preemptions": worker_metric(decode.metrics_address, "num_preemptions_total")
            if decode.metrics_address else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / ".bench-models" / "bench-9m"))
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--num-blocks", type=int, default=256, help="the decode worker's KV pool (16-token blocks)")
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--min-out", type=int, default=16)
    ap.add_argument("--max-out", type=int, default=256)
    ap.add_argument("--label", default="working tree", help="what revision of pdserve served (recorded)")
    ap.add_argument("--out", required=True, help="results path without extension (.json is written)")
    args = ap.parse_args()
    redis_url = default_redis_url()
    redis_proc = ensure_redis(redis_url)
    cluster = LocalCluster(args.model, redis_url, decode={"num_blocks": args.num_blocks},
                           common={"num_threads": 1})
    try:
        result = asyncio.run(_run(cluster, args))
    finally:
        cluster.stop()
        if redis_proc is not None:
            redis_proc.terminate()
    result = {"label": args.label, "args": vars(args), "machine": machine(), **result}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(result, indent=1))
    print(f"{args.label}: {result['requests_per_s']:.2f} req/s, {result['tokens_per_s']:.0f} tok/s, "
          f"{result['refused']} refused, {result['num_errors']} errors, mean running batch "
          f"{result['mean_running']:.1f}, preemptions {result['preemptions']}, TTFT p50 "
          f"{result['ttft_s']['p50']:.3f} s p99 {result['ttft_s']['p99']:.3f} s, TPOT p50 "
          f"{result['tpot_s']['p50'] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
