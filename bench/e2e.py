"""Single-request TTFT and decode tokens/s through the cluster, next to ``transformers``.

Starts a router, one prefill and one decode worker as processes (one torch thread
each) on the given checkpoint, and in the same run times ``transformers``
``generate`` on the same checkpoint in this process (one torch thread). Warm-up
first, medians of repeated runs. Writes JSON and a PNG bar chart.

    python bench/e2e.py --out bench/out/e2e
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
import uuid
from pathlib import Path

import grpc
import torch

from pdserve.bench.common import hf_generate_seconds
from pdserve.cluster.worker_process import default_redis_url
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


def bench_cluster(model: str, prompt: list[int], decode_tokens: int, repeats: int, redis_url: str) -> dict:
    name = "bench-" + uuid.uuid4().hex[:8]
    common = dict(model_dir=model, cluster=name, redis_url=redis_url, num_threads=1)
    procs = [spawn_role("decode_worker", dict(worker_id="d0", **common)),
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
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "e2e"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    redis_url = default_redis_url()
    redis_proc = ensure_redis(redis_url)
    gen = torch.Generator().manual_seed(0)
    prompt = [1] + torch.randint(3, 2000, (args.prompt_tokens - 1,), generator=gen).tolist()
    try:
        result = {
            "command": "python " + " ".join(sys.argv),
            "machine": {"cpus": torch.get_num_threads(), "platform": platform.platform(), "torch": torch.__version__},
            "model": args.model, "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
            "repeats": args.repeats,
            "pdserve_cluster": bench_cluster(args.model, prompt, args.decode_tokens, args.repeats, redis_url),
            "transformers_generate": bench_transformers(args.model, prompt, args.decode_tokens, args.repeats),
        }
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
    c, h = result["pdserve_cluster"], result["transformers_generate"]
    result["ratios"] = {"ttft_cluster_over_transformers": c["ttft_s"] / h["ttft_s"],
                        "decode_speedup_over_transformers": c["decode_tokens_per_s"] / h["decode_tokens_per_s"]}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    print(f"{'':28s}{'TTFT (ms)':>12s}{'decode tok/s':>14s}")
    for label, r in (("pdserve (router+P+D)", c), ("transformers.generate", h)):
        print(f"{label:28s}{r['ttft_s'] * 1e3:12.2f}{r['decode_tokens_per_s']:14.1f}")
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
