"""Single-request TTFT and decode tokens/s through the cluster, next to ``transformers``
and next to the decode engine alone.

Starts a router, one prefill and one decode worker as processes (one torch thread
each) on the given checkpoint, and in the same run times ``transformers``
``generate`` on the same checkpoint in this process (one torch thread) and the decode
engine's batch-1 step in this process, loaded as the decode worker loads it (same dtype,
GraphRunner as the worker's default): the cluster's TPOT over that step time is what the
router -> prefill -> KV -> decode -> client path costs per token. ``--core N`` pins this
process and so every worker it starts to one core; ``--decode-core M`` then gives the decode
worker a core of its own (router, prefill worker and client stay on N), as a 2-core machine
would be laid out, and the engine's step is timed on core M too. Warm-up first, medians of
repeated runs. Writes JSON and a PNG bar chart.

    python bench/e2e.py --out bench/out/e2e
    python bench/e2e.py --model .bench-models/bench-80m --dtype bfloat16 --core 1 --out docs/results/e2e_bench80m
    python bench/e2e.py --model .bench-models/bench-80m --dtype bfloat16 --core 0 --decode-core 1 --out /tmp/e2e-split
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

import grpc
import torch

from pdserve.bench.common import hf_generate_seconds, machine
from pdserve.cluster.args import default_redis_url
from pdserve.decode_worker.config import DecodeWorkerConfig
from pdserve.deploy import client
from pdserve.deploy.config import EMBEDDED_MODEL
from pdserve.deploy.processes import spawn_role
from pdserve.deploy.redis_server import ensure_redis

ROOT = Path(__file__).resolve().parent.parent


async def _timed_stream(channel, request) -> tuple[float, float, int]:
    """(TTFT s, last-token time after the first s, tokens) measured at the client."""
    start = time.perf_counter()
    first = last = 0.0
    n = 0
    async for msg in client.stream(channel, request):
        if msg.token_ids:
            now = time.perf_counter()
            first = first or now
            last, n = now, n + len(msg.token_ids)
    return first - start, last - first, n


def bench_cluster(model: str, prompt: list[int], decode_tokens: int, repeats: int, redis_url: str,
                  dtype: str = "auto", decode_core: int | None = None,
                  window_s: float = DecodeWorkerConfig.multi_step_window_s) -> dict:
    name = "bench-" + uuid.uuid4().hex[:8]
    common = dict(model_dir=model, cluster=name, redis_url=redis_url, num_threads=1, dtype=dtype)
    decode_cpus = None if decode_core is None else str(decode_core)
    procs = [spawn_role("decode_worker", dict(worker_id="d0", multi_step_window_s=window_s, **common),
                        cpus=decode_cpus),
             spawn_role("prefill_worker", dict(worker_id="p0", **common))]
    procs.append(spawn_role("router", dict(model_dir=model, cluster=name, redis_url=redis_url)))
    try:
        async def run() -> dict:
            async with grpc.aio.insecure_channel(procs[-1].address) as ch:
                for _ in range(3):  # warm-up
                    await _timed_stream(ch, client.make_request(prompt, max_tokens=32, temperature=0, ignore_eos=True))
                ttfts = [(await _timed_stream(ch, client.make_request(prompt, max_tokens=1, temperature=0)))[0]
                         for _ in range(repeats)]
                rates = []
                for _ in range(repeats):
                    _, span, n = await _timed_stream(ch, client.make_request(
                        prompt, max_tokens=decode_tokens, temperature=0, ignore_eos=True))
                    rates.append((n - 1) / span)
                return {"ttft_s": statistics.median(ttfts), "decode_tokens_per_s": statistics.median(rates),
                        "ttft_runs_s": ttfts, "decode_runs_tokens_per_s": rates}
        return asyncio.run(run())
    finally:
        for p in reversed(procs):
            p.stop()


def bench_engine(model: str, prompt: list[int], decode_tokens: int, repeats: int, dtype: str,
                 window_s: float = DecodeWorkerConfig.multi_step_window_s) -> dict:
    """The decode engine alone at batch 1, in this process: median step seconds over ``repeats`` runs of
    ``decode_tokens`` steps, loaded as the decode worker loads it (``dtype`` resolved as the worker does,
    the same multi-step window)."""
    from pdserve.bench.decode import _engine, run_decode, tokens_budget
    from pdserve.cluster.compute import resolve_dtype

    short = {"float32": "fp32", "bfloat16": "bf16"}[resolve_dtype(dtype, model)]
    budget = tokens_budget(DecodeWorkerConfig(model_dir=model, worker_id="bench"), decode_tokens)
    engine, model_obj = _engine(model, short, "native", DecodeWorkerConfig.graph, 1, (len(prompt) + budget) // 16 + 16,
                                multi_step_window_s=window_s)
    try:
        steps = [run_decode(engine, [prompt], decode_tokens)["step_s"] for _ in range(repeats)]
    finally:
        engine.receiver.close()
    return {"dtype": short, "step_s": statistics.median(steps), "step_runs_s": steps,
            "decode_tokens_per_s": 1 / statistics.median(steps)}


def _on_core(core: int | None, fn):
    """``fn()`` with this process pinned to ``core`` (if given), its affinity restored after."""
    if core is None:
        return fn()
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        return fn()
    finally:
        os.sched_setaffinity(0, before)


def bench_transformers(model: str, prompt: list[int], decode_tokens: int, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])

    def gen(n: int) -> float:
        return hf_generate_seconds(hf, ids, n)

    for _ in range(3):
        gen(32)
    ttfts = [gen(1) for _ in range(repeats)]
    rates = [(decode_tokens - 1) / (gen(decode_tokens) - statistics.median(ttfts)) for _ in range(repeats)]
    return {"ttft_s": statistics.median(ttfts), "decode_tokens_per_s": statistics.median(rates),
            "ttft_runs_s": ttfts, "decode_runs_tokens_per_s": rates}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=EMBEDDED_MODEL)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dtype", default="auto", help="the workers' and the engine's dtype (auto: as pdserve up)")
    ap.add_argument("--core", type=int, default=None, help="pin this process and every worker to this core")
    ap.add_argument("--decode-core", type=int, default=None,
                    help="pin the decode worker (and the engine-alone run) to this core instead")
    ap.add_argument("--multi-step-window", type=float, default=DecodeWorkerConfig.multi_step_window_s,
                    help="the decode worker's and the engine's multi-step window in seconds "
                         "(pdserve up --multi-step-window)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "e2e"))
    args = ap.parse_args()
    if args.core is not None:
        os.sched_setaffinity(0, {args.core})                 # inherited by the workers spawned below
    torch.set_num_threads(1)
    redis_url = default_redis_url()
    redis_proc = ensure_redis(redis_url)
    gen = torch.Generator().manual_seed(0)
    prompt = [1] + torch.randint(3, 2000, (args.prompt_tokens - 1,), generator=gen).tolist()
    try:
        result = {
            "command": "python " + " ".join(sys.argv),
            "machine": machine(), "core": args.core, "decode_core": args.decode_core, "dtype": args.dtype,
            "model": args.model, "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
            "repeats": args.repeats, "multi_step_window_s": args.multi_step_window,
            "pdserve_cluster": bench_cluster(args.model, prompt, args.decode_tokens, args.repeats, redis_url,
                                             args.dtype, args.decode_core, args.multi_step_window),
            "decode_engine": _on_core(args.decode_core, lambda: bench_engine(
                args.model, prompt, args.decode_tokens, args.repeats, args.dtype, args.multi_step_window)),
            "transformers_generate": bench_transformers(args.model, prompt, args.decode_tokens, args.repeats),
        }
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
    c, h, e = result["pdserve_cluster"], result["transformers_generate"], result["decode_engine"]
    result["ratios"] = {"ttft_cluster_over_transformers": c["ttft_s"] / h["ttft_s"],
                        "decode_speedup_over_transformers": c["decode_tokens_per_s"] / h["decode_tokens_per_s"],
                        "cluster_tpot_over_engine_step": e["decode_tokens_per_s"] / c["decode_tokens_per_s"]}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    print(f"{'':28s}{'TTFT (ms)':>12s}{'decode tok/s':>14s}")
    for label, r in (("pdserve (router+P+D)", c), ("transformers.generate", h)):
        print(f"{label:28s}{r['ttft_s'] * 1e3:12.2f}{r['decode_tokens_per_s']:14.1f}")
    print(f"{'decode engine alone':28s}{'':>12s}{e['decode_tokens_per_s']:14.1f}")
    print(f"ratios: {json.dumps(result['ratios'])}")
    _plot(result, out.with_suffix(".png"))


def _plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["pdserve cluster", "transformers"]
    runs = [result["pdserve_cluster"], result["transformers_generate"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.2))
    a.bar(labels, [r["ttft_s"] * 1e3 for r in runs], color=["tab:blue", "tab:gray"])
    a.set_ylabel("TTFT, ms (median)")
    b.bar(labels, [r["decode_tokens_per_s"] for r in runs], color=["tab:blue", "tab:gray"])
    b.set_ylabel("decode tokens/s (median, batch 1)")
    fig.suptitle(f"{Path(result['model']).name}: {result['prompt_tokens']}-token prompt, "
                 f"{result['decode_tokens']} decoded tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
