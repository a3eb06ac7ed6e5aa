"""Prefix-aware against cache-blind dispatch on the Mooncake trace (Qin et al., "Mooncake",
FAST 2025), with 2 prefill workers and 1 decode worker.

For each configuration the same requests are replayed (``pdserve bench``); the prefix-cache
hit rate (cached prompt tokens / prompt tokens, reported by the prefill workers) is
compared with an oracle that knows every cache and has unlimited capacity: a request's
best possible hit is its longest block-aligned prefix already seen in an earlier request.

    python bench/prefix_routing.py --out docs/results/prefix_routing
"""

from __future__ import annotations

import argparse
import json
import statistics
import uuid
from fractions import Fraction
from pathlib import Path

from pdserve.bench.common import ROOT, replay_trace, stop_all, write_result
from pdserve.bench.replay.traces import Trace, TraceOptions, load_trace
from pdserve.cluster.worker_process import default_redis_url
from pdserve.deploy.make_model import make_model
from pdserve.deploy.processes import spawn_role
from pdserve.deploy.redis_server import ensure_redis

TRACE = ROOT.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"


def oracle_hit_tokens(trace: Trace, cache_block: int = 16) -> int:
    """Prompt tokens an all-knowing router with unlimited caches could serve from cache: a
    request's leading hash blocks already seen as a prefix of an earlier request (prompts are
    BOS + hash blocks of ``trace.block_tokens`` tokens), in whole cache blocks, never the last token."""
    seen: set[tuple[int, ...]] = set()
    total = 0
    for req in trace.requests:
        ids = req.block_ids or ()
        full = min(len(ids), (req.prompt_tokens - 1) // trace.block_tokens)  # hash blocks wholly in the prompt
        k = 0
        while k < full and tuple(ids[:k + 1]) in seen:
            k += 1
        total += min((1 + k * trace.block_tokens) // cache_block, (req.prompt_tokens - 1) // cache_block) * cache_block
        seen.update(tuple(ids[:j]) for j in range(1, full + 1))
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / ".bench-models" / "bench-9m"))
    ap.add_argument("--rate", default="2")
    ap.add_argument("--max-requests", type=int, default=80)
    ap.add_argument("--length-scale", default="1/16")
    ap.add_argument("--output-scale", default="1/8")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "prefix_routing"))
    args = ap.parse_args()
    if not Path(args.model, "config.json").exists():
        make_model("bench-9m", args.model, dtype="float32")
    redis_url = default_redis_url()
    redis_proc = ensure_redis(redis_url)
    out, summary = Path(args.out), {}
    trace = load_trace(TRACE, options=TraceOptions(
        max_requests=args.max_requests, length_scale=float(Fraction(args.length_scale)),
        output_scale=float(Fraction(args.output_scale)), max_prompt_tokens=2048, max_output_tokens=64))
    try:
        for label, prefix_routing in (("prefix-aware", "true"), ("cache-blind", "false")):
            cluster = f"prefix-{label}-" + uuid.uuid4().hex[:6]
            base = dict(model_dir=args.model, cluster=cluster, redis_url=redis_url, num_blocks=4096)
            procs = [spawn_role("prefill_worker", dict(worker_id=f"p{i}", **base)) for i in range(2)]
            procs.append(spawn_role("decode_worker", dict(worker_id="d0", **base)))
            procs.append(spawn_role("router", dict(model_dir=args.model, cluster=cluster, redis_url=redis_url,
                                                   prefix_routing=prefix_routing)))
            try:
                res = replay_trace([
                    "--router", procs[-1].address,
                    "--trace", str(TRACE),
                    "--rates", args.rate, "--max-requests", str(args.max_requests), "--same-prompts",
                    "--length-scale", args.length_scale, "--output-scale", args.output_scale,
                    "--max-prompt-tokens", "2048", "--max-output-tokens", "64", "--ttft-slo", "5", "--tpot-slo", "1",
                    "--model", args.model, "--label", label, "--no-progress"], out / label)
                recs = [r for run in res["runs"] for r in run["records"]]
                prompt = sum(r["prompt_tokens"] for r in recs)
                summary[label] = {"hit_rate": sum(r["cached_prompt_tokens"] for r in recs) / prompt,
                                  "oracle_hit_rate": oracle_hit_tokens(trace) / prompt,
                                  "mean_ttft_s": statistics.mean(r["ttft_s"] for r in recs if r["ttft_s"]),
                                  "requests": len(recs)}
            finally:
                stop_all(procs)
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
    aware, blind = summary["prefix-aware"], summary["cache-blind"]
    summary["hit_rate_over_oracle"] = (aware["hit_rate"] / aware["oracle_hit_rate"]
                                       if aware["oracle_hit_rate"] else None)  # no reusable prefix in the slice
    summary["ttft_aware_over_blind"] = aware["mean_ttft_s"] / blind["mean_ttft_s"]
    write_result({"model": args.model, "rate": args.rate, "length_scale": args.length_scale, **summary},
                 out / "summary")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
