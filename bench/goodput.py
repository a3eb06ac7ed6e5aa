"""Disaggregated against colocated serving on the same cores: goodput from a trace replay.

Two configurations, one after the other, each worker pinned to its own core with
``taskset`` (the router and the load generator float):
  - disaggregated: 1 prefill worker (core 0) + 1 decode worker (core 1);
  - colocated: 2 workers that prefill and decode in one process (cores 0 and 1).
Each replays the same Azure LLM inference 2023 code-trace requests (Patel et al.,
"Splitwise", ISCA 2024) at a sweep of rates through ``pdserve bench``; goodput is the
highest rate with >= 90% of requests meeting both SLOs (DistServe, OSDI 2024).

    python bench/goodput.py --out docs/results/goodput
"""

from __future__ import annotations

import argparse
import json
import uuid
from pathlib import Path

from pdserve.bench.common import ROOT, replay_trace, stop_all, write_result
from pdserve.cluster.worker_process import default_redis_url
from pdserve.deploy.make_model import make_model
from pdserve.deploy.processes import spawn_role
from pdserve.deploy.redis_server import ensure_redis


def start(kind: str, model: str, redis_url: str, dtype: str) -> list:
    cluster = f"goodput-{kind}-" + uuid.uuid4().hex[:6]
    base = dict(model_dir=model, cluster=cluster, redis_url=redis_url, dtype=dtype, num_blocks=2048)
    procs = []
    if kind == "disaggregated":
        procs.append(spawn_role("prefill_worker", dict(worker_id="p0", **base), cpus="0"))
        procs.append(spawn_role("decode_worker", dict(worker_id="d0", **base), cpus="1"))
    else:
        for i in range(2):
            procs.append(spawn_role("decode_worker", dict(worker_id=f"b{i}", colocated="true", **base), cpus=str(i)))
    procs.append(spawn_role("router", dict(model_dir=model, cluster=cluster, redis_url=redis_url)))
    return procs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / ".bench-models" / "bench-9m"))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rates", default="1,2,4,8")
    ap.add_argument("--max-requests", type=int, default=60)
    ap.add_argument("--length-scale", default="1/4")
    ap.add_argument("--output-scale", default="2")
    ap.add_argument("--ttft-slo", type=float, default=1.0)
    ap.add_argument("--tpot-slo", type=float, default=0.025)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "goodput"))
    args = ap.parse_args()
    if not Path(args.model, "config.json").exists():
        make_model("bench-9m", args.model, dtype=args.dtype)
    redis_url = default_redis_url()
    redis_proc = ensure_redis(redis_url)
    out, summary = Path(args.out), {}
    try:
        for kind in ("disaggregated", "colocated"):
            procs = start(kind, args.model, redis_url, args.dtype)
            try:
                results = replay_trace([
                    "--router", procs[-1].address, "--trace", str(ROOT.parent / "shared" / "traces" /
                                                                  "azure_llm_inference_2023_code.csv"),
                    "--rates", args.rates, "--max-requests", str(args.max_requests),
                    "--length-scale", args.length_scale, "--output-scale", args.output_scale,
                    "--max-prompt-tokens", "1024", "--max-output-tokens", "128",
                    "--ttft-slo", str(args.ttft_slo), "--tpot-slo", str(args.tpot_slo), "--model", args.model,
                    "--label", kind, "--no-progress"], out / kind)
                summary[kind] = results["goodput"]
            finally:
                stop_all(procs)
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
    d, c = summary["disaggregated"], summary["colocated"]
    ratio = (d["rate"] / c["rate"]) if c.get("rate") else None
    write_result({"model": args.model, "rates": args.rates, "ttft_slo_s": args.ttft_slo, "tpot_slo_s": args.tpot_slo,
                  "length_scale": args.length_scale, "output_scale": args.output_scale,
                  "max_requests": args.max_requests, "goodput": summary, "disaggregated_over_colocated": ratio},
                 out / "summary")
    print(json.dumps({"disaggregated": d, "colocated": c, "ratio": ratio}, indent=1))


if __name__ == "__main__":
    main()
