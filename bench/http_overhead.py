"""What the OpenAI-compatible HTTP API costs over gRPC: the same requests through both APIs of one router.

    .venv/bin/python bench/http_overhead.py --out docs/results/http_overhead
    .venv/bin/python bench/http_overhead.py --repeats 10 --clients 8 --duration 10   # a quick check

One cluster (decode worker, prefill worker, router with ``--http-port 0``) on a fresh registry
namespace, the embedded model by default. Every request is greedy, ``ignore_eos``, exactly
``--max-tokens`` tokens, with a prompt of a fixed set (text and token ids, :func:`bench.load.make_prompts`),
so both APIs run the same engine work and differ only in the router's front end and the client's
protocol. Both are timed at the client, the same way: TTFT from request start to the first message
(gRPC) / SSE chunk (HTTP) that carries tokens (``return_token_ids``, so an HTTP chunk is counted as
the gRPC message it was made from), per-token time as (last - first) / (tokens - 1). The HTTP client
is ``httpx`` with a line-level SSE reader (the clock is read before a chunk is parsed), not the
``openai`` client, whose per-chunk parsing would be client time.

1. Batch 1: ``--repeats`` pairs of sequential requests, the same prompt through gRPC
   (``deploy/client.py`` ``stream``) and through ``POST /v1/completions`` with ``stream``, back to
   back, alternating which API goes first, so drift of the machine hits both alike. Reported:
   median and p90 of each, HTTP - gRPC of the medians and of the p90s (95% bootstrap intervals,
   each API resampled apart), and the median of the per-pair differences (95% bootstrap interval).
2. Under load: ``--clients`` concurrent streaming clients (spread over ``--client-procs`` processes)
   loop requests in one API at a time, phases ordered gRPC, HTTP, HTTP, gRPC (``--duration`` / 2
   seconds each, each after ``--load-warmup`` seconds that are not counted), so each API gets
   ``--duration`` measured seconds and drift cancels to first order. Reported per API: requests
   and tokens per second (of requests started in the measured windows), TTFT and per-token
   p50/p90, errors (every error counted, none hidden), and CPU milliseconds per request of the
   router (``/proc/PID/stat``) and of the clients, which share the machine with the cluster: a
   heavier HTTP client takes cores from the router and workers, so read the latencies beside it.
   Per phase too, as a spread.

Pinning follows ``bench/goodput.py``: by default the prefill worker runs on core 0 and the decode
worker on core 1 (``--cpus``), the router and the clients float (``--router-cpus`` pins the router).
Writes ``OUT.json`` (with the command, ``machine()``, the CPU model and the load average before and
after) and ``OUT.png``, and prints a table (milliseconds). Not run in CI.

The timed requests, batch 1 and the load are in ``bench/http_overhead_clients.py``, the statistics in
``bench/http_overhead_stats.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import uuid
from pathlib import Path

from pdserve.bench.common import ROOT, stop_all, write_result
from pdserve.bench.http_overhead_clients import APIS, LOAD_ORDER, batch1, load
from pdserve.bench.http_overhead_stats import difference, summary
from pdserve.bench.load import make_prompts
from pdserve.deploy.processes import RoleProcess, spawn_role

# -- cluster -------------------------------------------------------------------------------------------

def start_cluster(model: str, redis_url: str, cpus: list[str | None], router_cpus: str | None,
                  num_blocks: int, max_batch_size: int) -> list[RoleProcess]:
    """Decode worker, prefill worker and router with an HTTP port (in that order)."""
    ns = "httpbench-" + uuid.uuid4().hex[:8]
    base = dict(model_dir=model, cluster=ns, redis_url=redis_url)
    procs: list[RoleProcess] = []
    try:
        procs.append(spawn_role("decode_worker", dict(worker_id="d0", num_blocks=num_blocks,
                                                      max_batch_size=max_batch_size, **base), "decode", cpus=cpus[1]))
        procs.append(spawn_role("prefill_worker", dict(worker_id="p0", **base), "prefill", cpus=cpus[0]))
        procs.append(spawn_role("router", dict(base, prefill_timeout_s=120.0, http_port=0), "router",
                                cpus=router_cpus))
    except Exception:
        stop_all(procs)
        raise
    if not procs[-1].http_address:
        stop_all(procs)
        raise RuntimeError("the router printed no HTTP address")
    return procs


# -- output ----------------------------------------------------------------------------------------------

def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def print_table(result: dict) -> None:
    ms = 1e3
    b = result["batch1"]
    s = result["settings"]
    print(f"\nbatch 1: {s['repeats']} pairs, {s['max_tokens']} greedy tokens, alternating order (ms)")
    print(f"  {'':<10}{'gRPC p50':>9}{'p90':>8}{'HTTP p50':>10}{'p90':>8}"
          f"{'HTTP-gRPC p50 [95% CI]':>28}{'p90 [95% CI]':>26}{'paired median [95% CI]':>28}")
    for m, label in (("ttft_s", "TTFT"), ("tpot_s", "per-token")):
        g, h, d = b["grpc"][m], b["http"][m], b["http_minus_grpc"][m]

        def ci(key: str) -> str:
            return f"{d[key] * ms:+.3f} [{d[key + '_ci95'][0] * ms:+.3f}, {d[key + '_ci95'][1] * ms:+.3f}]"
        print(f"  {label:<10}{g['p50'] * ms:>9.3f}{g['p90'] * ms:>8.3f}{h['p50'] * ms:>10.3f}{h['p90'] * ms:>8.3f}"
              f"{ci('p50'):>28}{ci('p90'):>26}{ci('paired_median'):>28}")
    ld = result["load"]
    print(f"\nunder load: {s['clients']} clients per API, {s['duration_s']:g} s measured each "
          f"(phases {' '.join(LOAD_ORDER)}, {s['load_warmup_s']:g} s warm-up each) (ms)")
    print(f"  {'API':<6}{'req/s':>8}{'tok/s':>9}{'TTFT p50':>10}{'p90':>8}{'tok p50':>9}{'p90':>8}{'errors':>8}"
          f"{'router CPU/req':>16}{'client CPU/req':>16}")
    for api in APIS:
        a = ld[api]
        print(f"  {api:<6}{a['requests_per_s']:>8.1f}{a['tokens_per_s']:>9.0f}{a['ttft_s']['p50'] * ms:>10.2f}"
              f"{a['ttft_s']['p90'] * ms:>8.2f}{a['tpot_s']['p50'] * ms:>9.3f}{a['tpot_s']['p90'] * ms:>8.3f}"
              f"{a['errors']:>8}{a['router_cpu_ms_per_request']:>16.2f}{a['client_cpu_ms_per_request']:>16.2f}")
    d = ld["http_minus_grpc"]
    print(f"  HTTP-gRPC: TTFT p50 {d['ttft_s']['p50'] * ms:+.2f} ms [{d['ttft_s']['p50_ci95'][0] * ms:+.2f}, "
          f"{d['ttft_s']['p50_ci95'][1] * ms:+.2f}], per-token p50 {d['tpot_s']['p50'] * ms:+.3f} ms "
          f"[{d['tpot_s']['p50_ci95'][0] * ms:+.3f}, {d['tpot_s']['p50_ci95'][1] * ms:+.3f}], "
          f"throughput {100 * (ld['http']['tokens_per_s'] / ld['grpc']['tokens_per_s'] - 1):+.1f}%")
    print("  phases: " + ", ".join(f"{p['api']} {p['tokens_per_s']:.0f} tok/s" for p in ld["phases"]))
    h = result["host"]
    print(f"\n{h['cpu_model']}, {h['cpus']} CPUs; load average {h['loadavg_start'][0]:.2f} before, "
          f"{h['loadavg_end'][0]:.2f} after")


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    b, ld = result["batch1"], result["load"]
    for ax, m, label in ((axes[0][0], "ttft_s", "TTFT"), (axes[0][1], "tpot_s", "per-token time")):
        ax.boxplot([[v * 1e3 for v in b["samples"][api][m]] for api in APIS], tick_labels=["gRPC", "HTTP"],
                   whis=(10, 90))
        ax.set_ylabel("ms")
        ax.set_title(f"batch 1: {label} ({result['settings']['repeats']} pairs; whiskers p10/p90)")
    ax = axes[1][0]
    names = ["TTFT p50", "TTFT p90", "tok p50 x10", "tok p90 x10"]
    width = 0.38
    for k, api in enumerate(APIS):
        a = ld[api]
        vals = [a["ttft_s"]["p50"] * 1e3, a["ttft_s"]["p90"] * 1e3, a["tpot_s"]["p50"] * 1e4, a["tpot_s"]["p90"] * 1e4]
        ax.bar([i + (k - 0.5) * width for i in range(len(names))], vals, width, label=api)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("ms (per-token x10)")
    ax.set_title(f"under load: {result['settings']['clients']} clients per API")
    ax.legend()
    ax = axes[1][1]
    for k, api in enumerate(APIS):
        phases = [p["tokens_per_s"] for p in ld["phases"] if p["api"] == api]
        ax.bar(k, ld[api]["tokens_per_s"], 0.6, label=api)
        ax.scatter([k] * len(phases), phases, color="black", zorder=3, s=12)
    ax.set_xticks(range(len(APIS)), ["gRPC", "HTTP"])
    ax.set_ylabel("tokens/s")
    ax.set_title("under load: throughput (dots: each phase)")
    fig.suptitle(result["command"], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "assets" / "models" / "tinystories-656k"))
    ap.add_argument("--repeats", type=int, default=40, help="batch-1 pairs (one request per API each)")
    ap.add_argument("--warmup", type=int, default=10, help="batch-1 warm-up pairs, not counted")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--clients", type=int, default=32, help="concurrent streaming clients under load, per API")
    ap.add_argument("--duration", type=float, default=30.0, help="measured seconds under load, per API")
    ap.add_argument("--load-warmup", type=float, default=3.0, help="uncounted seconds at the start of each phase")
    ap.add_argument("--client-procs", type=int, default=2, help="processes the load clients are spread over")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--cpus", default="0,1", help="cores of the prefill and decode worker ('' : not pinned)")
    ap.add_argument("--router-cpus", default="", help="cores of the router ('' : not pinned)")
    ap.add_argument("--num-blocks", type=int, default=2048, help="decode worker KV blocks")
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples for the intervals")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "http_overhead"))
    args = ap.parse_args()

    from pdserve.cluster.args import default_redis_url
    from pdserve.deploy.redis_server import ensure_redis

    cpus = [c or None for c in args.cpus.split(",")] if args.cpus else [None, None]
    if len(cpus) != 2:
        ap.error("--cpus takes two core lists: prefill,decode (e.g. 0,1)")
    host = {"cpu_model": cpu_model(), "cpus": os.cpu_count(), "cpus_allowed": len(os.sched_getaffinity(0)),
            "loadavg_start": list(os.getloadavg())}
    redis_url = default_redis_url()
    redis_proc = ensure_redis(redis_url)
    procs: list[RoleProcess] = []
    try:
        procs = start_cluster(args.model, redis_url, cpus, args.router_cpus or None, args.num_blocks,
                              args.max_batch_size)
        router = procs[-1]
        url = f"http://{router.http_address}/v1/completions"
        prompts = make_prompts(args.num_prompts, args.seed)
        b1 = asyncio.run(batch1(router.address, url, prompts, args.repeats, args.warmup, args.max_tokens,
                                args.timeout))
        ld = load(router.address, url, prompts, args.clients, args.duration, args.load_warmup, args.client_procs,
                  args.max_tokens, args.timeout, args.seed, router.proc.pid)
        dead = [p.name for p in procs if p.proc.poll() is not None]
        if dead:
            raise RuntimeError(f"processes died during the run: {dead}")
    finally:
        stop_all(procs)
        if redis_proc is not None:
            redis_proc.terminate()
    host["loadavg_end"] = list(os.getloadavg())
    batch = {api: {m: summary(v) for m, v in b1[api].items()} for api in APIS}
    batch["http_minus_grpc"] = {m: difference(b1["grpc"][m], b1["http"][m], args.bootstrap, args.seed, True)
                                for m in ("ttft_s", "tpot_s")}
    batch["samples"] = b1
    ld["http_minus_grpc"] = {m: difference(ld["grpc"]["samples"][m], ld["http"]["samples"][m], args.bootstrap,
                                           args.seed, False) for m in ("ttft_s", "tpot_s")}
    result = {"benchmark": "http_overhead", "host": host,
              "settings": {"model": args.model, "repeats": args.repeats, "warmup_pairs": args.warmup,
                           "max_tokens": args.max_tokens, "clients": args.clients, "duration_s": args.duration,
                           "load_warmup_s": args.load_warmup, "client_procs": args.client_procs,
                           "num_prompts": args.num_prompts, "prefill_cpus": cpus[0], "decode_cpus": cpus[1],
                           "router_cpus": args.router_cpus or None, "num_blocks": args.num_blocks,
                           "max_batch_size": args.max_batch_size, "load_order": list(LOAD_ORDER),
                           "http_endpoint": "/v1/completions (stream, return_token_ids)"},
              "batch1": batch, "load": ld}
    out = Path(args.out)
    write_result(result, out)
    result = json.loads(out.with_suffix(".json").read_text())  # with the command and machine() write_result adds
    plot(result, out.with_suffix(".png"))
    print_table(result)
    print(f"\nwrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
