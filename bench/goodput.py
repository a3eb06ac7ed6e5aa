"""Disaggregated against colocated serving on the same cores: goodput over a grid of SLOs.

Configurations, each a fresh cluster, each worker pinned to its own core with ``taskset``
(the router and the load generator float):
  - disaggregated: 1 prefill worker (core 0) + 1 decode worker (core 1);
  - colocated, once per prefill chunk budget in ``--budgets`` (``max_num_batched_tokens``, the
    token budget of a step that mixes prompt chunks into decodes): 2 workers that prefill and
    decode in one process (cores 0 and 1).
Each replays the same Azure LLM inference 2023 code-trace requests (Patel et al., "Splitwise",
ISCA 2024) once per rate through ``pdserve bench``, ``--reps`` times (repetition-major, the order
of configurations rotated each repetition, so slow drift of the machine touches all alike).
Every request's TTFT and TPOT are kept, and :mod:`pdserve.bench.slo_grid` scores every
(TTFT, TPOT) SLO pair from those records:
goodput as DistServe (OSDI 2024) defines it, the highest rate with >= 90% of requests meeting
both SLOs (interpolated between tested rates), median and range over repetitions, and the
colocated baseline at its best budget for that SLO pair.

    python bench/goodput.py --out docs/results/goodput
    python bench/goodput.py --rescore --out docs/results/goodput   # re-score the saved runs only

Writes ``OUT/runs/LABEL/repK/results.json`` per replay sweep (``pdserve bench``'s file) and
``OUT/summary.json``: parameters, every run's per-request records, and the table per SLO pair.
"""

from __future__ import annotations

import argparse
import json
import uuid
from pathlib import Path

from pdserve.bench import slo_grid
from pdserve.bench.common import ROOT, replay_trace, stop_all, write_result
from pdserve.cluster.args import default_redis_url
from pdserve.deploy.make_model import make_model
from pdserve.deploy.processes import spawn_role
from pdserve.deploy.redis_server import ensure_redis

TRACE = ROOT.parent / "shared" / "traces" / "azure_llm_inference_2023_code.csv"


def start(kind: str, model: str, redis_url: str, dtype: str, budget: int | None = None) -> list:
    """Start one configuration's workers and router; the router is the last process.

    ``budget`` (tokens) is the colocated workers' ``max_num_batched_tokens`` (the disaggregated
    prefill worker keeps its default of 512).
    """
    cluster = f"goodput-{kind}-" + uuid.uuid4().hex[:6]
    base = dict(model_dir=model, cluster=cluster, redis_url=redis_url, dtype=dtype, num_blocks=2048)
    procs = []
    try:
        if kind == slo_grid.DISAGGREGATED:
            procs.append(spawn_role("prefill_worker", dict(worker_id="p0", **base), cpus="0"))
            procs.append(spawn_role("decode_worker", dict(worker_id="d0", **base), cpus="1"))
        else:
            extra = {} if budget is None else {"max_num_batched_tokens": budget}
            for i in range(2):
                procs.append(spawn_role("decode_worker", dict(worker_id=f"b{i}", colocated="true", **base, **extra),
                                        cpus=str(i)))
        procs.append(spawn_role("router", dict(model_dir=model, cluster=cluster, redis_url=redis_url)))
    except Exception:
        stop_all(procs)
        raise
    return procs


def configurations(budgets: list[int]) -> list[tuple[str, int | None, str]]:
    """(mode, budget, label) of every configuration: disaggregated, then colocated per budget."""
    return [(slo_grid.DISAGGREGATED, None, "disaggregated")] + [
        (slo_grid.COLOCATED, b, f"colocated-b{b}") for b in budgets]


def run_dir(out: Path, label: str, rep: int) -> Path:
    return out / "runs" / label / f"rep{rep}"


def replay_args(args: argparse.Namespace, router: str, label: str, slo: slo_grid.SLO) -> list[str]:
    """``pdserve bench`` flags of one sweep (the SLO given only sets its own printed table)."""
    return ["--router", router, "--trace", str(TRACE), "--rates", args.rates,
            "--max-requests", str(args.max_requests), "--length-scale", args.length_scale,
            "--output-scale", args.output_scale, "--max-prompt-tokens", "1024", "--max-output-tokens", "128",
            "--ttft-slo", str(slo.ttft_s), "--tpot-slo", str(slo.tpot_s), "--model", args.model,
            "--label", label, "--no-progress", "--no-plots"]


def run_all(args: argparse.Namespace, budgets: list[int], slos: list[slo_grid.SLO]) -> None:
    """Run every configuration and repetition not already on disk (with ``--resume``)."""
    if not Path(args.model, "config.json").exists():
        make_model("bench-9m", args.model, dtype=args.dtype)
    redis_url = default_redis_url()
    redis_proc = ensure_redis(redis_url)
    out = Path(args.out)
    try:
        for rep in range(args.reps):
            cfgs = configurations(budgets)
            for mode, budget, label in cfgs[rep % len(cfgs):] + cfgs[:rep % len(cfgs)]:  # rotated per repetition
                where = run_dir(out, label, rep)
                if args.resume and (where / "results.json").exists():
                    continue
                procs = start(mode, args.model, redis_url, args.dtype, budget)
                try:
                    replay_trace(replay_args(args, procs[-1].address, label, slos[0]), where)
                finally:
                    stop_all(procs)
    finally:
        if redis_proc is not None:
            redis_proc.terminate()


def load_runs(out: Path, budgets: list[int], reps: int) -> tuple[list[slo_grid.Run], list[dict]]:
    """Every saved run as :class:`slo_grid.Run` s, and per sweep its label, rep, budget, rates and records.

    Raises:
        FileNotFoundError: a configuration's ``results.json`` is missing.
    """
    runs, raw = [], []
    for rep in range(reps):
        for mode, budget, label in configurations(budgets):
            results = json.loads((run_dir(out, label, rep) / "results.json").read_text())
            runs += slo_grid.runs_from_results(results, mode, budget, rep)
            raw.append({"label": label, "mode": mode, "budget": budget, "rep": rep, "cluster": results["cluster"],
                        "runs": [{"rate": r["rate"], "wall_s": r["wall_s"], "records": r["records"]}
                                 for r in results["runs"]]})
    return runs, raw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / ".bench-models" / "bench-9m"))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rates", default="1,2,4,8", help="requests/s, one replay each")
    ap.add_argument("--max-requests", type=int, default=60)
    ap.add_argument("--length-scale", default="1/4")
    ap.add_argument("--output-scale", default="2")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of every configuration (fresh cluster each)")
    ap.add_argument("--budgets", default="128,256,512,1024",
                    help="colocated prefill chunk budgets, tokens per step (max_num_batched_tokens)")
    ap.add_argument("--ttft-slos", default="0.5,1,2", help="TTFT SLOs, seconds")
    ap.add_argument("--tpot-slos", default="0.025,0.05,0.1", help="TPOT SLOs, seconds per output token")
    ap.add_argument("--ttft-slo", type=float, default=None, help="one TTFT SLO (overrides --ttft-slos)")
    ap.add_argument("--tpot-slo", type=float, default=None, help="one TPOT SLO (overrides --tpot-slos)")
    ap.add_argument("--target", type=float, default=0.9, help="SLO attainment goal of goodput (0..1)")
    ap.add_argument("--resume", action="store_true", help="skip configurations whose results.json exists")
    ap.add_argument("--rescore", action="store_true", help="run nothing: score the runs saved under --out")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "goodput"))
    args = ap.parse_args()
    budgets = [int(b) for b in slo_grid.parse_floats(args.budgets)]
    if not budgets or any(b <= 0 for b in budgets) or len(set(budgets)) != len(budgets) or args.reps < 1:
        ap.error("--budgets must be distinct positive token counts and --reps >= 1")
    try:
        slos = slo_grid.slo_grid([args.ttft_slo] if args.ttft_slo else slo_grid.parse_floats(args.ttft_slos),
                                 [args.tpot_slo] if args.tpot_slo else slo_grid.parse_floats(args.tpot_slos))
    except ValueError as exc:
        ap.error(str(exc))
    if not args.rescore:
        run_all(args, budgets, slos)
    out = Path(args.out)
    runs, raw = load_runs(out, budgets, args.reps)
    rows = slo_grid.score(runs, slos, args.target)
    write_result({"model": args.model, "rates": args.rates, "reps": args.reps, "budgets": budgets,
                  "ttft_slos_s": sorted({s.ttft_s for s in slos}), "tpot_slos_s": sorted({s.tpot_s for s in slos}),
                  "target": args.target, "length_scale": args.length_scale, "output_scale": args.output_scale,
                  "max_requests": args.max_requests, "table": rows, "runs": raw}, out / "summary")
    print(slo_grid.format_table(rows))


if __name__ == "__main__":
    main()
