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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import grpc

try:  # the `openai` package's HTTP client (same API as httpx)
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

from pdserve.bench.common import ROOT, stop_all, timed_stream, write_result
from pdserve.bench.load import make_prompts
from pdserve.deploy import client
from pdserve.deploy.processes import RoleProcess, spawn_role

APIS = ("grpc", "http")
CLIENTS_PER_CHANNEL = 50  # as bench/soak.py: separate HTTP/2 connections, as independent clients would open
LOAD_ORDER = ("grpc", "http", "http", "grpc")


class HttpStreamError(RuntimeError):
    """The HTTP API answered an error status or an error event."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status


# -- one request, timed at the client ----------------------------------------------------------------

async def grpc_once(channel: grpc.aio.Channel, prompt: str | list[int], max_tokens: int,
                    timeout_s: float) -> tuple[float, float, int]:
    """(TTFT s, per-token s, tokens) of one greedy streamed ``Generate`` (``client.stream``)."""
    request = client.make_request(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ttft, span, n, final = await asyncio.wait_for(timed_stream(channel, request), timeout_s)
    if final is None or n == 0:
        raise RuntimeError(f"gRPC stream ended without final ({n} tokens)")
    return ttft, span / (n - 1) if n > 1 else 0.0, n


async def http_once(http: httpx.AsyncClient, url: str, prompt: str | list[int], max_tokens: int,
                    timeout_s: float) -> tuple[float, float, int]:
    """(TTFT s, per-token s, tokens) of one greedy streamed ``POST /v1/completions``: the clock is read
    when an SSE ``data`` line arrives, before it is parsed; chunks without tokens are not counted."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    start = time.perf_counter()
    first = last = 0.0
    n, done = 0, False
    async with http.stream("POST", url, json=body, timeout=timeout_s) as r:
        if r.status_code != 200:
            raise HttpStreamError(r.status_code, (await r.aread()).decode(errors="replace")[:200])
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            now = time.perf_counter()
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise HttpStreamError(200, str(chunk["error"])[:200])
            ids = chunk["choices"][0].get("token_ids") if chunk["choices"] else None
            if ids:
                first = first or now
                last, n = now, n + len(ids)
    if not done or n == 0:
        raise RuntimeError(f"HTTP stream ended without [DONE] ({n} tokens)")
    return first - start, (last - first) / (n - 1) if n > 1 else 0.0, n


def _http_client(connections: int, timeout_s: float) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s))


# -- statistics ----------------------------------------------------------------------------------------

def quantile(values: list[float], q: float) -> float:
    """Nearest-rank ``q`` quantile (as :func:`bench.load.percentiles`); NaN when empty."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def summary(values: list[float]) -> dict:
    return {"p50": quantile(values, 0.5), "p90": quantile(values, 0.9),
            "mean": statistics.fmean(values) if values else math.nan, "n": len(values)}


def bootstrap_ci(stat, samples: tuple[list[float], ...], iters: int, rng: random.Random) -> list[float]:
    """95% percentile-bootstrap interval of ``stat(*resampled)``, each sample resampled on its own."""
    draws = sorted(stat(*[rng.choices(s, k=len(s)) for s in samples]) for _ in range(iters))
    return [draws[int(0.025 * iters)], draws[min(iters - 1, int(0.975 * iters))]]


def difference(grpc_v: list[float], http_v: list[float], iters: int, seed: int, paired: bool) -> dict:
    """HTTP - gRPC of the medians and the p90s (bootstrap intervals); with ``paired`` (same prompt,
    back to back) also the median of the per-pair differences."""
    rng = random.Random(seed)
    out: dict = {}
    for name, q in (("p50", 0.5), ("p90", 0.9)):
        out[name] = quantile(http_v, q) - quantile(grpc_v, q)
        out[name + "_ci95"] = bootstrap_ci(lambda g, h, q=q: quantile(h, q) - quantile(g, q), (grpc_v, http_v),
                                           iters, rng)
    if paired:
        d = [h - g for g, h in zip(grpc_v, http_v)]
        out["paired_median"] = statistics.median(d)
        out["paired_median_ci95"] = bootstrap_ci(statistics.median, (d,), iters, rng)
    return out


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


# -- batch 1 ---------------------------------------------------------------------------------------------

async def batch1(address: str, url: str, prompts: list, repeats: int, warmup: int, max_tokens: int,
                 timeout_s: float) -> dict[str, dict[str, list[float]]]:
    """``repeats`` pairs, one request per API each, alternating which goes first; raw samples."""
    got = {api: {"ttft_s": [], "tpot_s": []} for api in APIS}
    async with client.open_channel(address) as channel, _http_client(4, timeout_s) as http:
        calls = {"grpc": lambda p: grpc_once(channel, p, max_tokens, timeout_s),
                 "http": lambda p: http_once(http, url, p, max_tokens, timeout_s)}
        for i in range(warmup):
            for api in APIS:
                await calls[api](prompts[i % len(prompts)])
        for i in range(repeats):
            prompt = prompts[i % len(prompts)]
            for api in (APIS if i % 2 == 0 else APIS[::-1]):
                ttft, tpot, n = await calls[api](prompt)
                if n != max_tokens:
                    raise RuntimeError(f"{api} streamed {n} of {max_tokens} tokens")
                got[api]["ttft_s"].append(ttft)
                got[api]["tpot_s"].append(tpot)
    return got


# -- load (client processes) -----------------------------------------------------------------------------

async def _load_clients(api: str, address: str, url: str, num_clients: int, start_at: float, end_at: float,
                        prompts: list, max_tokens: int, timeout_s: float, seed: int) -> list[tuple]:
    records: list[tuple] = []
    channels = [client.open_channel(address) for _ in range(-(-num_clients // CLIENTS_PER_CHANNEL))] \
        if api == "grpc" else []
    http = _http_client(num_clients + 4, timeout_s) if api == "http" else None

    async def loop(i: int) -> None:
        rng = random.Random(seed * 100_003 + i)
        while (now := time.time()) < end_at:
            prompt = rng.choice(prompts)
            try:
                if api == "grpc":
                    ttft, tpot, n = await grpc_once(channels[i // CLIENTS_PER_CHANNEL], prompt, max_tokens, timeout_s)
                else:
                    ttft, tpot, n = await http_once(http, url, prompt, max_tokens, timeout_s)
                records.append((now - start_at, "OK", ttft, tpot, n))
            except grpc.aio.AioRpcError as e:
                records.append((now - start_at, e.code().name, 0.0, 0.0, 0, (e.details() or "")[:200]))
            except HttpStreamError as e:
                records.append((now - start_at, f"HTTP_{e.status}", 0.0, 0.0, 0, str(e)[:200]))
            except Exception as e:  # counted, never hidden
                records.append((now - start_at, "CLIENT_" + type(e).__name__, 0.0, 0.0, 0, str(e)[:200]))

    try:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        await asyncio.gather(*(loop(i) for i in range(num_clients)))
    finally:
        for ch in channels:
            await ch.close()
        if http is not None:
            await http.aclose()
    return records


def run_load_clients(api: str, address: str, url: str, num_clients: int, start_at: float, end_at: float,
                     prompts: list, max_tokens: int, timeout_s: float, seed: int) -> tuple[list[tuple], float]:
    """Child-process entry: ``num_clients`` clients of ``api`` loop requests from ``start_at`` until
    ``end_at`` (``time.time()``), each finishing its last one. Returns one record per request,
    ``(start s after start_at, status, TTFT s, per-token s, tokens[, error details])``, and the CPU
    seconds this process spent."""
    cpu = time.process_time()
    records = asyncio.run(_load_clients(api, address, url, num_clients, start_at, end_at, prompts, max_tokens,
                                        timeout_s, seed))
    return records, time.process_time() - cpu


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def load(address: str, url: str, prompts: list, clients: int, duration_s: float, warmup_s: float,
         client_procs: int, max_tokens: int, timeout_s: float, seed: int, router_pid: int) -> dict:
    """Phases gRPC, HTTP, HTTP, gRPC of ``warmup_s + duration_s / 2`` seconds each; per API the
    requests started after each phase's warm-up, summarized over both of its phases, and the CPU
    time of the router and of the clients per completed request (whole phases, warm-up included)."""
    from pdserve.bench import http_overhead as me  # picklable by its package name in the children

    procs_n = max(1, min(client_procs, clients))
    share = [clients // procs_n + (i < clients % procs_n) for i in range(procs_n)]
    window = duration_s / 2
    records: dict[str, list[tuple]] = {api: [] for api in APIS}
    cpu = {api: {"router_s": 0.0, "clients_s": 0.0, "requests": 0} for api in APIS}
    phases = []
    with ProcessPoolExecutor(procs_n, mp_context=get_context("spawn")) as pool:
        for p, api in enumerate(LOAD_ORDER):
            start_at = time.time() + (3.0 + 0.5 * procs_n if p == 0 else 1.0)  # children import first
            end_at = start_at + warmup_s + window
            futures = [pool.submit(me.run_load_clients, api, address, url, n, start_at, end_at, prompts, max_tokens,
                                   timeout_s, seed + 1000 * p + i) for i, n in enumerate(share)]
            router_cpu = cpu_seconds(router_pid)
            done = [f.result() for f in futures]
            router_cpu = cpu_seconds(router_pid) - router_cpu
            got = [r for rec, _ in done for r in rec]
            cpu[api]["router_s"] += router_cpu
            cpu[api]["clients_s"] += sum(c for _, c in done)
            cpu[api]["requests"] += sum(r[1] == "OK" for r in got)
            measured = [r for r in got if r[0] >= warmup_s and r[1] == "OK"]
            phases.append({"api": api, "requests": len(measured), "errors": sum(r[1] != "OK" for r in got),
                           "tokens_per_s": sum(r[4] for r in measured) / window,
                           "ttft_p50_s": quantile([r[2] for r in measured], 0.5),
                           "tpot_p50_s": quantile([r[3] for r in measured], 0.5),
                           "router_cpu_ms_per_request": 1e3 * router_cpu / max(1, sum(r[1] == "OK" for r in got))})
            records[api] += got
    out: dict = {}
    for api in APIS:
        rec = records[api]
        measured = [r for r in rec if r[0] >= warmup_s and r[1] == "OK"]
        errors: dict[str, str] = {}
        for r in rec:
            if r[1] != "OK":
                errors.setdefault(r[1], r[5] if len(r) > 5 else "")
        out[api] = {"requests": len(measured), "requests_per_s": len(measured) / duration_s,
                    "tokens_per_s": sum(r[4] for r in measured) / duration_s,
                    "errors": sum(r[1] != "OK" for r in rec), "error_examples": errors,
                    "ttft_s": summary([r[2] for r in measured]), "tpot_s": summary([r[3] for r in measured]),
                    "router_cpu_ms_per_request": 1e3 * cpu[api]["router_s"] / max(1, cpu[api]["requests"]),
                    "client_cpu_ms_per_request": 1e3 * cpu[api]["clients_s"] / max(1, cpu[api]["requests"]),
                    "samples": {"ttft_s": [r[2] for r in measured], "tpot_s": [r[3] for r in measured]}}
    out["phases"] = phases
    return out


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

    from pdserve.cluster.worker_process import default_redis_url
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
