"""``pdserve bench``: replay a request trace against a running router at a sweep of request
rates and report SLO attainment and goodput (DistServe, OSDI 2024).

    pdserve bench --router 127.0.0.1:50051 --trace azure --max-requests 200 \\
        --length-scale 1/16 --output-scale 1 --rates 2,4,8,16 --ttft-slo 0.25 --tpot-slo 0.025 \\
        --label pd-1p1d --out bench/out/replay/pd-1p1d

Each rate replays the same requests with their arrival gaps rescaled to that mean rate
(requests/s). The prompt text is salted per rate (unless ``--same-prompts``) so that one
replay's prefix cache does not serve the next; sharing within a replay (Mooncake hash ids)
is kept. The text is a function of ``--seed``: a second invocation on the same cluster with the
same seed finds its prompts cached (use another seed, or restart the cluster, to start cold).
Writes ``results.json`` (parameters, command line, every request record, the attainment
table, goodput) and PNG plots to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import sys
import time
from fractions import Fraction
from pathlib import Path

import grpc
import numpy as np

from pdserve.bench.replay import goodput as gp
from pdserve.bench.replay import runner
from pdserve.bench.replay.prompts import PromptBuilder
from pdserve.bench.replay.records import OK
from pdserve.bench.replay.traces import Trace, TraceOptions, load_trace
from pdserve.deploy import client
from pdserve.deploy.config import EMBEDDED_MODEL
from pdserve.model.config import ModelConfig


def add_command(sub: argparse._SubParsersAction) -> None:
    """Register ``pdserve bench`` (the ``pdserve.commands`` entry point in pyproject.toml)."""
    bench = sub.add_parser("bench", help="replay a trace against a running router; SLO attainment and goodput")
    add_arguments(bench)
    bench.set_defaults(func=main)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``pdserve bench``."""
    parser.add_argument("--router", required=True, metavar="HOST:PORT", help="a running router")
    parser.add_argument("--trace", default="azure", help="azure | mooncake (the shared traces) | PATH")
    parser.add_argument("--format", default="auto", choices=["auto", "azure", "mooncake"],
                        help="trace format (auto: .csv azure, .jsonl mooncake)")
    parser.add_argument("--rates", default=None,
                        help="comma-separated request rates (requests/s), one replay each "
                             "(default: one replay at the trace's own timing times --time-scale)")
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiply inter-arrival gaps (no --rates)")
    parser.add_argument("--max-requests", type=int, default=100, help="first N requests of the trace")
    parser.add_argument("--length-scale", type=_number, default=Fraction(1, 16),
                        help="multiply prompt lengths and Mooncake's 512-token block (e.g. 1/16)")
    parser.add_argument("--output-scale", type=_number, default=None,
                        help="multiply output lengths (default: --length-scale; the Azure code trace's outputs are "
                             "short already, 1 keeps them)")
    parser.add_argument("--min-prompt-tokens", type=int, default=1)
    parser.add_argument("--max-prompt-tokens", type=int, default=384)
    parser.add_argument("--min-output-tokens", type=int, default=1)
    parser.add_argument("--max-output-tokens", type=int, default=128)
    parser.add_argument("--ttft-slo", type=float, default=0.25,
                        help="seconds (default: ~10x the embedded model's unloaded TTFT on 2 CPU cores)")
    parser.add_argument("--tpot-slo", type=float, default=0.025,
                        help="seconds per output token (default: ~6x the embedded model's unloaded TPOT)")
    parser.add_argument("--target", type=float, default=0.9, help="SLO attainment goal of goodput (0..1)")
    parser.add_argument("--model", default=EMBEDDED_MODEL, help="checkpoint whose tokenizer builds the prompts")
    parser.add_argument("--seed", type=int, default=0, help="prompt text and sampling seed")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--same-prompts", action="store_true", help="same prompt text at every rate")
    parser.add_argument("--warmup", type=int, default=2, help="unrecorded short requests before the sweep")
    parser.add_argument("--max-concurrency", type=int, default=256, help="requests in flight at most")
    parser.add_argument("--time-limit", type=float, default=600.0, help="seconds per replay")
    parser.add_argument("--request-timeout", type=float, default=None, help="seconds per request")
    parser.add_argument("--label", default="pdserve", help="configuration name in tables and plots")
    parser.add_argument("--out", default=None, help="output directory (default: bench/out/replay/LABEL)")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--no-progress", action="store_true")


def main(args: argparse.Namespace) -> int:
    """Run the sweep; 0 on success, 1 when the router cannot be reached, 2 on bad arguments
    (requests failing during the replay is still 0: it is a result)."""
    try:
        trace, rates = _load(args)
    except (ValueError, OSError) as exc:
        print(f"pdserve bench: {exc}", file=sys.stderr)
        return 2
    slo = gp.SLO(args.ttft_slo, args.tpot_slo)
    cfg = runner.RunnerConfig(max_concurrency=args.max_concurrency, time_limit_s=args.time_limit,
                              request_timeout_s=args.request_timeout, temperature=args.temperature, seed=args.seed,
                              progress=False if args.no_progress else None)
    print(f"{trace.name}: {len(trace.requests)} requests, native mean rate {trace.mean_rate():.3g} req/s "
          f"after --time-scale; lengths x{float(args.length_scale):g} (prompt) "
          f"x{float(_out_scale(args)):g} (output)", file=sys.stderr)
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    try:
        runs, cluster = asyncio.run(_sweep(args, trace, rates, cfg, slo))
    except (ConnectionError, grpc.aio.AioRpcError) as exc:
        detail = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
        print(f"pdserve bench: router {args.router}: {detail}", file=sys.stderr)
        return 1
    good = gp.goodput([(run["rate"], run["attainment"]["both"]) for run in runs], args.target) if runs else None
    result = {
        "label": args.label, "command": shlex.join(sys.argv), "started": started,
        "parameters": {k: (float(v) if isinstance(v, Fraction) else v) for k, v in vars(args).items()
                       if not callable(v)},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "cluster": cluster, "trace": _trace_info(trace, args),
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s}, "target": args.target,
        "goodput": good.to_dict() if good else None, "runs": runs,
    }
    out = Path(args.out) if args.out else Path("bench") / "out" / "replay" / args.label
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    if not args.no_plots and runs:
        from pdserve.bench.replay import plots
        plots.plot_comparison([result], out / "attainment.png")
        plots.plot_rates(result, out / "latency.png")
    print(_table(result, good))
    print(f"wrote {out}/results.json" + ("" if args.no_plots else ", attainment.png, latency.png"))
    return 0


def _load(args: argparse.Namespace) -> tuple[Trace, list[float | None]]:
    rates = [float(r) for r in args.rates.split(",") if r.strip()] if args.rates else [None]
    if any(r is not None and r <= 0 for r in rates):
        raise ValueError(f"rates must be positive requests/s: {args.rates}")
    options = TraceOptions(max_requests=args.max_requests, time_scale=args.time_scale,
                           length_scale=float(args.length_scale), output_scale=_out_scale(args),
                           min_prompt_tokens=args.min_prompt_tokens, max_prompt_tokens=args.max_prompt_tokens,
                           min_output_tokens=args.min_output_tokens, max_output_tokens=args.max_output_tokens)
    trace = load_trace(args.trace, None if args.format == "auto" else args.format, options)
    if not trace.requests:
        raise ValueError(f"trace {args.trace} has no requests")
    ctx = ModelConfig.from_hf_dir(args.model).max_position_embeddings
    too_long = [i for i, r in enumerate(trace.requests) if r.prompt_tokens + r.output_tokens > ctx]
    if too_long:
        raise ValueError(f"{len(too_long)} requests (first: {too_long[0]}) need more than the model's context of "
                         f"{ctx} tokens; lower --length-scale or --max-prompt-tokens/--max-output-tokens")
    return trace, rates


async def _sweep(args, trace: Trace, rates: list[float | None], cfg: runner.RunnerConfig,
                 slo: gp.SLO) -> tuple[list[dict], dict]:
    runs = []
    async with grpc.aio.insecure_channel(args.router) as channel:
        try:
            await asyncio.wait_for(channel.channel_ready(), timeout=10.0)
        except TimeoutError:
            raise ConnectionError("not reachable within 10 s") from None
        cluster = await _cluster_info(channel)
        base = PromptBuilder(args.model, seed=args.seed)
        if args.warmup:
            await runner.warm_up(channel, base.bos + base.block("warmup", 16), args.warmup)
        for k, rate in enumerate(rates):
            scaled = trace.at_rate(rate) if rate is not None else trace
            builder = base if args.same_prompts or k == 0 else PromptBuilder(args.model, seed=f"{args.seed}.r{k}")
            prompts = [builder.prompt(r, i, trace.block_tokens) for i, r in enumerate(scaled.requests)]
            actual = rate if rate is not None else scaled.mean_rate()
            if scaled.requests[-1].arrival_s > cfg.time_limit_s:
                print(f"warning: at {actual:.3g} req/s the last request arrives at "
                      f"{scaled.requests[-1].arrival_s:.0f} s, after the {cfg.time_limit_s:g} s --time-limit",
                      file=sys.stderr)
            res = await runner.replay(channel, scaled.requests, prompts, cfg, desc=f"{actual:.3g} req/s")
            att = gp.attainment(res.records, slo)
            runs.append({"rate": actual, "wall_s": res.wall_s, "attainment": att.to_dict(),
                         "summary": _summary(res.records, res.wall_s),
                         "records": [r.to_dict() for r in res.records]})
            print(f"  {actual:.3g} req/s: attainment {att.both:.1%} ({att.ok}/{att.n} ok) in {res.wall_s:.1f} s",
                  file=sys.stderr, flush=True)
            if trace.block_tokens is None and runs[-1]["summary"]["cached_prompt_tokens"]:
                print("  note: prompts without hash ids share no prefix, so these prefix cache hits are from an "
                      "earlier run on this cluster with the same --seed", file=sys.stderr)
    return runs, cluster


async def _cluster_info(channel) -> dict:
    try:
        state = await client.cluster_state(channel)
    except grpc.aio.AioRpcError as exc:
        return {"error": f"{exc.code().name}: {exc.details()}"}
    return {"model": state.model, "workers": [{"worker_id": w.worker_id, "role": w.role, "block_size": w.block_size,
                                               "num_total_blocks": w.num_total_blocks} for w in state.workers]}


def _summary(records, wall_s: float) -> dict:
    """Latency percentiles (s) of OK requests, token counts, prefix cache hits, throughput."""
    ok = [r for r in records if r.status == OK]
    out = {"ok": len(ok), "wrong_length": sum(r.tokens != r.output_tokens for r in ok),
           "errors": sorted({r.status for r in records if r.status != OK}),
           "output_tokens_per_s": sum(r.tokens for r in ok) / wall_s if wall_s > 0 else 0.0,
           "prompt_tokens": sum(r.prompt_tokens for r in records),
           "cached_prompt_tokens": sum(r.cached_prompt_tokens for r in ok),
           "max_send_delay_s": max((r.send_delay_s for r in records if r.send_delay_s is not None), default=None)}
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        vals = [getattr(r, key) for r in ok if getattr(r, key) is not None]
        for q in (50, 90, 99):
            out[f"{key[:-2]}_p{q}_s"] = float(np.percentile(vals, q)) if vals else None
    return out


def _table(result: dict, good: gp.Goodput | None) -> str:
    head = (f"{'rate/s':>7} {'n':>5} {'ok':>5} {'SLO':>6} {'TTFT':>6} {'TPOT':>6} {'TTFT p50/p90 ms':>16} "
            f"{'TPOT p50/p90 ms':>16} {'cached':>7} {'tok/s':>7}")
    lines = [f"{result['label']}: TTFT SLO {result['slo']['ttft_s']:g} s, TPOT SLO {result['slo']['tpot_s']:g} s",
             head]
    for run in result["runs"]:
        a, s = run["attainment"], run["summary"]
        cached = s["cached_prompt_tokens"] / s["prompt_tokens"] if s["prompt_tokens"] else 0.0
        lines.append(f"{run['rate']:>7.3g} {a['n']:>5} {a['ok']:>5} {a['both']:>6.1%} {a['ttft']:>6.1%} "
                     f"{a['tpot']:>6.1%} {_ms(s['ttft_p50_s'], s['ttft_p90_s']):>16} "
                     f"{_ms(s['tpot_p50_s'], s['tpot_p90_s']):>16} {cached:>7.1%} {s['output_tokens_per_s']:>7.1f}")
    if good is not None:
        lines.append(f"goodput: {good.describe()}")
    return "\n".join(lines)


def _ms(p50: float | None, p90: float | None) -> str:
    return "-" if p50 is None else f"{p50 * 1e3:.0f}/{p90 * 1e3:.0f}"


def _trace_info(trace: Trace, args) -> dict:
    reqs = trace.requests
    return {"name": trace.name, "format": trace.format, "source": trace.source, "requests": len(reqs),
            "mean_rate_per_s": trace.mean_rate(), "length_scale": float(args.length_scale),
            "output_scale": float(_out_scale(args)), "block_tokens": trace.block_tokens,
            "prompt_tokens_mean": float(np.mean([r.prompt_tokens for r in reqs])),
            "output_tokens_mean": float(np.mean([r.output_tokens for r in reqs]))}


def _out_scale(args) -> float:
    return float(args.length_scale if args.output_scale is None else args.output_scale)


def _number(text: str) -> Fraction:
    """A positive number, ``0.0625`` or ``1/16``."""
    try:
        value = Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"expected a number like 0.25 or 1/4, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return value


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m pdserve.bench.replay.cli", description=__doc__,
                                      formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
