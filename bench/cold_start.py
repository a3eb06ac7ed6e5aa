"""Cold start: TTFT of a fresh cluster's first minute against the same cluster warmed, with the workers'
start-up warm-up on and off.

For each mode (``--modes on,off``: ``WorkerConfig.warmup``) one run starts a fresh router + 1 prefill +
1 decode worker (as :class:`bench.common.LocalCluster`) with an empty kernel cache (``XDG_CACHE_HOME``
a new temporary directory, so the C kernels of :mod:`kernels.cpu` are built as on a fresh machine),
then sends two held-out workloads of Poisson arrivals at ``--rate`` requests/s for ``--duration`` s:

    cold   the cluster's first requests (with warm-up off they meet every shape for the first time)
    warm   the same lengths, arrival times and sampling again, with fresh token ids (no prefix-cache
           hit), on the now warm cluster

Prompt and output lengths follow the Azure LLM inference trace (code, 2023; ``/work/shared/traces``),
scaled into ``--max-prompt`` and ``--max-output`` tokens. Reported: TTFT p50/p90/max at the client per
pass, the cold/warm ratio of each, each worker's time to ``ready`` and its warm-up time (the registry's
``warmup_s``). Target: the cold pass within 20% of the warm pass at p50 and p90 with warm-up on.
Heavy (minutes of a loaded CPU); not run in CI. On a shared machine the numbers are noisy: rerun.

    nice python bench/cold_start.py --out bench/out/cold_start        # makes bench-80m if needed
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import math
import random
import tempfile
import time
import uuid
from pathlib import Path

import grpc

from pdserve.bench.common import ROOT, stop_all, write_result
from pdserve.bench.load import stream_once
from pdserve.cluster.args import default_redis_url
from pdserve.cluster.registry import WorkerLease
from pdserve.deploy import client
from pdserve.deploy.make_model import make_model
from pdserve.deploy.processes import RoleProcess, spawn_role
from pdserve.deploy.ray_cluster import delete_cluster_keys
from pdserve.deploy.redis_server import ensure_redis
from pdserve.model.config import ModelConfig

AZURE_TRACE = Path("/work/shared/traces/azure_llm_inference_2023_code.csv")


def trace_lengths(num: int, max_prompt: int, max_output: int, seed: int) -> list[tuple[int, int]]:
    """``num`` (prompt tokens, output tokens) pairs drawn (seeded) from the Azure code trace: prompts scaled
    by ``max_prompt / the trace's longest`` so their spread survives (at least 4 tokens), outputs capped at
    ``max_output`` (the trace's median is 13). Without the trace: uniform in [4, max_prompt], [2, max_output]."""
    rng = random.Random(seed)
    if not AZURE_TRACE.exists():
        return [(rng.randint(4, max_prompt), rng.randint(2, max_output)) for _ in range(num)]
    with AZURE_TRACE.open() as f:
        rows = [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(f)]
    top_in = max(r[0] for r in rows)
    picked = [rows[rng.randrange(len(rows))] for _ in range(num)]
    return [(max(4, round(i * max_prompt / top_in)), max(2, min(o, max_output))) for i, o in picked]


def workload(lengths: list[tuple[int, int]], vocab: int, rate: float, seed: int,
             token_seed: int) -> list[tuple[float, object]]:
    """(arrival offset s, request) per length pair: Poisson arrivals at ``rate``/s seeded by ``seed``, random
    token-id prompts (BOS first) seeded by ``token_seed``, greedy, EOS ignored so every request runs its
    output length. Two workloads of one ``seed`` arrive at the same times (the same queueing)."""
    arrivals, tokens, at, out = random.Random(seed), random.Random(token_seed), 0.0, []
    for prompt_len, output_len in lengths:
        ids = [1] + [tokens.randrange(3, vocab) for _ in range(prompt_len - 1)]
        out.append((at, client.make_request(ids, max_tokens=output_len, temperature=0.0, ignore_eos=True)))
        at += arrivals.expovariate(rate)
    return out


def nearest_rank(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


async def run_pass(address: str, requests: list[tuple[float, object]]) -> dict:
    """Send ``requests`` at their offsets; TTFT p50/p90/max (seconds) at the client, and every TTFT."""
    async with grpc.aio.insecure_channel(address) as channel:
        start = time.perf_counter()

        async def one(at: float, request) -> float:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            ttft, _, _ = await stream_once(channel, request, timeout_s=600.0)
            return ttft

        ttfts = await asyncio.gather(*(one(at, r) for at, r in requests))
    return {"ttft_p50_s": nearest_rank(ttfts, 0.5), "ttft_p90_s": nearest_rank(ttfts, 0.9), "ttft_max_s": max(ttfts),
            "ttfts_s": list(ttfts), "n": len(ttfts)}


def start_cluster(model: str, redis_url: str, dtype: str, warmup: bool, cache_dir: str) -> tuple[list[RoleProcess],
                                                                                                  str, dict]:
    """Decode, prefill, router (LocalCluster's order) with ``XDG_CACHE_HOME=cache_dir``; returns the processes,
    the cluster name and each worker's seconds to ``ready``."""
    cluster = "cold-" + uuid.uuid4().hex[:8]
    env = {"XDG_CACHE_HOME": cache_dir}
    base = dict(model_dir=model, cluster=cluster, redis_url=redis_url, dtype=dtype, warmup=warmup)
    procs, ready_s = [], {}
    try:
        for role, name in (("decode_worker", "d0"), ("prefill_worker", "p0")):
            started = time.perf_counter()
            procs.append(spawn_role(role, dict(worker_id=name, **base), name, timeout_s=900.0, env=env))
            ready_s[name] = time.perf_counter() - started
        procs.append(spawn_role("router", dict(model_dir=model, cluster=cluster, redis_url=redis_url,
                                               prefill_timeout_s=600.0), "router", env=env))
    except Exception:
        stop_all(procs)
        raise
    return procs, cluster, ready_s


def run_mode(args, warmup: bool, vocab: int) -> dict:
    lengths = trace_lengths(args.num_requests, args.max_prompt, args.max_output, args.seed)
    cold = workload(lengths, vocab, args.rate, args.seed, args.seed)
    warm = workload(lengths, vocab, args.rate, args.seed, args.seed + 1)  # same lengths and arrivals, fresh ids
    with tempfile.TemporaryDirectory(prefix="pdserve-cold-") as cache_dir:
        procs, cluster, ready_s = start_cluster(args.model, args.redis_url, args.dtype, warmup, cache_dir)
        try:
            infos = {w.worker_id: w for w in WorkerLease(args.redis_url, cluster, 3.0).list_workers()}
            cold_res = asyncio.run(run_pass(procs[-1].address, cold))
            warm_res = asyncio.run(run_pass(procs[-1].address, warm))
        finally:
            stop_all(procs)
            delete_cluster_keys(args.redis_url, cluster)
    ratio = {k: cold_res[k] / warm_res[k] for k in ("ttft_p50_s", "ttft_p90_s", "ttft_max_s")}
    res = {"warmup": warmup, "ready_s": ready_s, "warmup_s": {k: w.warmup_s for k, w in infos.items()},
           "cold": cold_res, "warm": warm_res, "cold_over_warm": ratio,
           "within_20pct": ratio["ttft_p50_s"] <= 1.2 and ratio["ttft_p90_s"] <= 1.2}
    print(f"warm-up {'on ' if warmup else 'off'}: ready " + ", ".join(f"{k} {v:.1f} s" for k, v in ready_s.items())
          + "; warm-up " + ", ".join(f"{k} {v:.2f} s" for k, v in res["warmup_s"].items()), flush=True)
    for name, r in (("cold", cold_res), ("warm", warm_res)):
        print(f"  {name}: TTFT p50 {r['ttft_p50_s']:.3f} s, p90 {r['ttft_p90_s']:.3f} s, max {r['ttft_max_s']:.3f} s "
              f"({r['n']} requests)", flush=True)
    print(f"  cold/warm: p50 {ratio['ttft_p50_s']:.2f}x, p90 {ratio['ttft_p90_s']:.2f}x, "
          f"max {ratio['ttft_max_s']:.2f}x", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / ".bench-models" / "bench-80m"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rate", type=float, default=0.5, help="requests/s")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per pass")
    ap.add_argument("--max-prompt", type=int, default=256, help="prompt tokens the trace's longest maps to")
    ap.add_argument("--max-output", type=int, default=32, help="cap on output tokens")
    ap.add_argument("--modes", default="on,off", help="warm-up settings to run, in order")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--redis-url", default=default_redis_url())
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "cold_start"))
    args = ap.parse_args()
    args.num_requests = max(1, round(args.rate * args.duration))
    if not Path(args.model, "config.json").exists():
        make_model("bench-80m", args.model)
    vocab = ModelConfig.from_hf_dir(args.model).vocab_size
    redis_proc = ensure_redis(args.redis_url)
    try:
        modes = [m.strip() == "on" for m in args.modes.split(",")]
        result = {"model": args.model, "dtype": args.dtype, "rate": args.rate, "duration_s": args.duration,
                  "max_prompt": args.max_prompt, "max_output": args.max_output,
                  "runs": [run_mode(args, warmup, vocab) for warmup in modes]}
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
    write_result(result, Path(args.out))


if __name__ == "__main__":
    main()
