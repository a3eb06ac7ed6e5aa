"""Prefix-aware against cache-blind dispatch on the Mooncake trace (Qin et al., "Mooncake",
FAST 2025), with 2 prefill workers and 1 decode worker.

For each configuration the same requests are replayed (``pdserve bench``, a fresh cluster per
configuration and repetition); the prefix-cache hit rate (cached prompt tokens / prompt
tokens, reported by the prefill workers) is compared with the oracle of
:mod:`pdserve.bench.prefix_oracle`: one unbounded cache holding every full block (of the
workers' block size) of every prompt sent before, warm-up prompts included, matched on the
real prompt token ids. No dispatch policy can beat it, so a measured hit rate above the oracle
is a bug: the script then exits with status 1 (after writing its results).

    python bench/prefix_routing.py --out docs/results/prefix_routing
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import uuid
from pathlib import Path

from pdserve.bench.common import ROOT, replay_trace, stop_all, write_result
from pdserve.bench.prefix_oracle import oracle_check
from pdserve.bench.slo_grid import median_spread
from pdserve.cluster.args import default_redis_url
from pdserve.deploy.make_model import make_model
from pdserve.deploy.processes import spawn_role
from pdserve.deploy.redis_server import ensure_redis

TRACE = ROOT.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
LABELS = (("prefix-aware", "true"), ("cache-blind", "false"))


def run_one(args: argparse.Namespace, redis_url: str, label: str, prefix_routing: str, out: Path) -> dict:
    """Replay the requests on a fresh cluster; ``pdserve bench``'s results."""
    cluster = f"prefix-{label}-" + uuid.uuid4().hex[:6]
    base = dict(model_dir=args.model, cluster=cluster, redis_url=redis_url, num_blocks=4096)
    procs = []
    try:
        procs += [spawn_role("prefill_worker", dict(worker_id=f"p{i}", **base)) for i in range(2)]
        procs.append(spawn_role("decode_worker", dict(worker_id="d0", **base)))
        procs.append(spawn_role("router", dict(model_dir=args.model, cluster=cluster, redis_url=redis_url,
                                               prefix_routing=prefix_routing)))
        return replay_trace([
            "--router", procs[-1].address, "--trace", str(TRACE),
            "--rates", args.rate, "--max-requests", str(args.max_requests), "--same-prompts",
            "--length-scale", args.length_scale, "--output-scale", args.output_scale,
            "--max-prompt-tokens", "2048", "--max-output-tokens", "64", "--ttft-slo", "5", "--tpot-slo", "1",
            "--model", args.model, "--label", label, "--no-progress"], out)
    finally:
        stop_all(procs)


def summarize(res: dict) -> dict:
    """Hit rate, oracle hit rate, their ratio and mean TTFT (s) of one sweep's results."""
    recs = [r for run in res["runs"] for r in run["records"]]
    check = oracle_check(res)
    prompt = check["prompt_tokens"]
    ttfts = [r["ttft_s"] for r in recs if r["ttft_s"]]
    return {"hit_rate": check["measured_tokens"] / prompt, "oracle_hit_rate": check["oracle_tokens"] / prompt,
            "hit_over_oracle": check["measured_tokens"] / check["oracle_tokens"] if check["oracle_tokens"] else None,
            "mean_ttft_s": statistics.mean(ttfts) if ttfts else None, "requests": len(recs), **check}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / ".bench-models" / "bench-9m"))
    ap.add_argument("--rate", "--rates", dest="rate", default="2",
                    help="requests/s; a comma-separated list replays the same prompts on the same cluster")
    ap.add_argument("--max-requests", type=int, default=80)
    ap.add_argument("--length-scale", default="1/16")
    ap.add_argument("--output-scale", default="1/8")
    ap.add_argument("--reps", type=int, default=1, help="repetitions of each configuration (fresh cluster each)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "prefix_routing"))
    args = ap.parse_args()
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    if not Path(args.model, "config.json").exists():
        make_model("bench-9m", args.model, dtype="float32")
    redis_url = default_redis_url()
    redis_proc = ensure_redis(redis_url)
    out = Path(args.out)
    per_rep: dict[str, list[dict]] = {label: [] for label, _ in LABELS}
    try:
        for rep in range(args.reps):
            for label, prefix_routing in LABELS:
                where = out / label / f"rep{rep}" if args.reps > 1 else out / label
                per_rep[label].append(summarize(run_one(args, redis_url, label, prefix_routing, where)))
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
    summary: dict = {}
    for label, reps in per_rep.items():
        summary[label] = {key: median_spread([r[key] for r in reps]) if args.reps > 1 else reps[0][key]
                          for key in ("hit_rate", "oracle_hit_rate", "hit_over_oracle", "mean_ttft_s")
                          if all(r[key] is not None for r in reps)}
        summary[label].update(reps=reps, within_oracle=all(r["within_oracle"] for r in reps))
    aware, blind = per_rep["prefix-aware"], per_rep["cache-blind"]
    ratios = [a["mean_ttft_s"] / b["mean_ttft_s"] for a, b in zip(aware, blind)
              if a["mean_ttft_s"] and b["mean_ttft_s"]]
    over = [a["hit_over_oracle"] for a in aware if a["hit_over_oracle"] is not None]  # None: nothing reusable
    summary["hit_rate_over_oracle"] = statistics.median(over) if over else None
    summary["ttft_aware_over_blind"] = statistics.median(ratios) if ratios else None
    write_result({"model": args.model, "rate": args.rate, "length_scale": args.length_scale, "reps": args.reps,
                  **summary}, out / "summary")
    print(json.dumps({k: v for k, v in summary.items() if k not in LABELS}, indent=1))
    for label, _ in LABELS:
        print(label, json.dumps({k: v for k, v in summary[label].items() if k != "reps"}))
    if not all(summary[label]["within_oracle"] for label, _ in LABELS):
        print("measured prefix-cache hits exceed the oracle's: the oracle or the hit accounting is wrong",
              file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
