"""Load and soak: many concurrent streaming clients against the router, for minutes.

    .venv/bin/python bench/soak.py --clients 500 --duration 300 --out docs/results/soak

Two parts, each on real processes on the embedded model:

1. Router overhead (``--latency-pairs``, on an otherwise idle colocated worker, role ``both``):
   the same request (token ids, greedy, fixed length) is sent straight to the worker's
   ``DecodeWorker.Generate`` with ``local_prefill`` and through a router in front of that
   worker, one at a time, alternating which path goes first. Both paths run the same
   engine work, so the difference in client-side TTFT and per-token latency is what the
   router's hop (validation, dispatch, relay, detokenization) adds.
2. Soak: router + prefill + decode worker (disaggregated). ``--clients`` asyncio clients,
   spread over ``--client-procs`` processes so that the client side does not bottleneck on
   one core, each loop requests for ``--duration`` seconds: prompts from a fixed set of
   ``--num-prompts`` (text and token ids), ``max_tokens`` 4..32, half greedy, half sampled
   with a seed. Every error status is counted (the goal is zero).

   Warm-up (``--warmup``, default 20% of the run, at least 10 s) runs at full concurrency,
   so it reaches the peak number of requests in flight (the high-water mark of touched KV
   blocks and gRPC buffers), runs every decode batch size up to ``max_batch_size`` and sends
   every prompt of the fixed set at least once (so the prefill worker's prefix cache and the
   router's prefix index reach their final size). What grows after that is growth.

   Memory, two ways. At rest: the warm-up and the measured load run as two phases; after each,
   every client's last request finishes and every KV pool is free, and the RSS of the router
   and each worker (``VmRSS`` of ``/proc/PID/status``) is read at rest (median of 5 reads over 2 s).
   Rest growth is the second reading over the first, also per measured request: what a leak
   keeps and in-flight work does not. Under load: RSS sampled every second, growth the
   high-water mark over the last 5 s of the measured phase over the high-water mark up to its
   first 5 s (``RssSampler.growth``). Under load a torch-free router's RSS is mostly in-flight
   gRPC buffers and swings by ~20 MiB within seconds at constant load (117-136 MiB on a Zen 5,
   2026-12-02), and one CI run read +23 MiB of high-water growth with no leak; at rest the same
   router read 113.7, 116.1 and 112.5 MiB after a warm-up and two 35-second phases of ~4,600
   requests each (a scratch run of this procedure), where a leak of 8 KiB a request adds ~36 MiB.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import grpc

from pdserve.bench.load import make_prompts, make_request, percentiles, stream_once
from pdserve.bench.router_overhead import measure_router_overhead
from pdserve.deploy import client
from pdserve.deploy.processes import RoleProcess, spawn_role

ROOT = Path(__file__).resolve().parent.parent

CLIENTS_PER_CHANNEL = 50  # separate HTTP/2 connections, as many independent clients would open


def rss_kb(pid: int) -> int:
    """Resident set size (``VmRSS``, KiB) of process ``pid``.

    Raises:
        ProcessLookupError: the process is gone.
    """
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except FileNotFoundError:
        pass
    raise ProcessLookupError(f"no VmRSS for pid {pid}")


# -- clients (run in child processes) ------------------------------------------------------------------

async def _clients(address: str, num_clients: int, start_at: float, end_at: float, seed: int,
                   prompts: list, timeout_s: float) -> list[tuple]:
    records: list[tuple] = []
    opts = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(address, options=opts)
                for _ in range(-(-num_clients // CLIENTS_PER_CHANNEL))]

    async def loop(i: int) -> None:
        rng = random.Random(seed * 100_003 + i)
        channel = channels[i // CLIENTS_PER_CHANNEL]
        while (now := time.time()) < end_at:
            request = make_request(rng, prompts)
            try:
                ttft, tpot, n = await stream_once(channel, request, timeout_s)
                records.append((now - start_at, "OK", ttft, tpot, n))
            except grpc.aio.AioRpcError as e:
                records.append((now - start_at, e.code().name, 0.0, 0.0, 0, (e.details() or "")[:200]))
            except Exception as e:  # counted, never hidden
                records.append((now - start_at, "CLIENT_" + type(e).__name__, 0.0, 0.0, 0, str(e)[:200]))

    await asyncio.sleep(max(0.0, start_at - time.time()))
    await asyncio.gather(*(loop(i) for i in range(num_clients)))
    for ch in channels:
        await ch.close()
    return records


def run_clients(address: str, num_clients: int, start_at: float, end_at: float, seed: int, prompts: list,
                timeout_s: float) -> list[tuple]:
    """Child-process entry: ``num_clients`` clients loop requests from ``start_at`` until ``end_at``
    (``time.time()`` seconds), each finishing its last request. Returns one record per request:
    ``(start s after start_at, status name, TTFT s, TPOT s, tokens[, error details])``."""
    return asyncio.run(_clients(address, num_clients, start_at, end_at, seed, prompts, timeout_s))


# -- RSS sampling ------------------------------------------------------------------------------------

class RssSampler(threading.Thread):
    """Samples the VmRSS (KiB) of named processes every ``period_s`` seconds until stopped."""

    def __init__(self, pids: dict[str, int], t0: float, period_s: float = 1.0) -> None:
        super().__init__(name="rss-sampler", daemon=True)
        self.pids, self.t0, self.period_s = pids, t0, period_s
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.period_s):
            self.samples.append((time.time() - self.t0, {n: rss_kb(p) for n, p in self.pids.items()}))

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def growth(self, start_s: float, end_s: float, window_s: float = 5.0) -> dict:
        """Per process, in MiB: the RSS high-water mark from the first sample to the end of the window
        of ``window_s`` from ``start_s`` (baseline), the high-water mark over the last ``window_s``
        before ``end_s`` (end), and the growth end / baseline - 1 in %; the medians over the same two
        windows are reported beside them. ``start_s``, ``end_s``: the measured load's bounds, seconds
        after the sampler's ``t0``.

        High-water marks, not medians, because RSS dips at constant load: the allocator hands
        freed arenas back to the OS and takes them again, swinging a router's RSS by up to ~4%
        within seconds (374 -> 360 -> 377 MiB in one 30-second run, when it still loaded torch). A
        median baseline taken in a dip reads the return to the plateau as growth; a leak instead
        raises the high-water mark. A torch-free router's RSS (~100-150 MiB under this load) is
        mostly its in-flight gRPC buffers, so the swing is larger in percent: 129-146 MiB within
        20 s at constant load on a Xeon 207, -10.2 to +12.8 MiB of high-water growth over nine
        30-second soaks there; ``growth_mib`` gives the absolute figure.

        Raises:
            RuntimeError: no sample falls in one of the two windows.
        """
        out = {}
        for name in self.pids:
            upto = [s[name] for t, s in self.samples if t < start_s + window_s]
            base = [s[name] for t, s in self.samples if start_s <= t < start_s + window_s]
            end = [s[name] for t, s in self.samples if end_s - window_s <= t < end_s]
            if not base or not end:
                raise RuntimeError(f"not enough RSS samples for {name} (run shorter than warm-up + 2 windows?)")
            b, e = max(upto), max(end)
            out[name] = {"baseline_mib": b / 1024, "end_mib": e / 1024, "growth_pct": 100 * (e / b - 1),
                         "growth_mib": (e - b) / 1024,
                         "baseline_median_mib": statistics.median(base) / 1024,
                         "end_median_mib": statistics.median(end) / 1024,
                         "peak_mib": max(s[name] for _, s in self.samples) / 1024}
        return out


# -- soak ----------------------------------------------------------------------------------------------

def start_cluster(model: str, redis_url: str, decode_blocks: int, max_batch_size: int) -> list[RoleProcess]:
    """Decode worker, prefill worker and router (in that order) on a fresh registry namespace."""
    ns = "soak-" + uuid.uuid4().hex[:8]
    base = dict(model_dir=model, cluster=ns, redis_url=redis_url)
    procs: list[RoleProcess] = []
    try:
        procs.append(spawn_role("decode_worker", dict(worker_id="d0", num_blocks=decode_blocks,
                                                      max_batch_size=max_batch_size, **base), "decode"))
        procs.append(spawn_role("prefill_worker", dict(worker_id="p0", **base), "prefill"))
        procs.append(spawn_role("router", dict(base, prefill_timeout_s=120.0), "router"))
    except Exception:
        for p in reversed(procs):
            p.stop()
        raise
    return procs


def wait_pools_free(address: str, timeout_s: float = 15.0) -> dict:
    """Wait until every worker reports all KV blocks free; returns ``{worker: (free, total)}`` as last seen.

    Raises:
        AssertionError: blocks are still allocated after ``timeout_s``.
    """
    async def state():
        async with grpc.aio.insecure_channel(address) as ch:
            return await client.cluster_state(ch)
    deadline = time.monotonic() + timeout_s
    while True:
        seen = {w.worker_id: (w.num_free_blocks, w.num_total_blocks) for w in asyncio.run(state()).workers}
        if seen and all(f == t for f, t in seen.values()):
            return seen
        if time.monotonic() > deadline:
            raise AssertionError(f"KV blocks still allocated (free, total): {seen}")
        time.sleep(0.3)


def rss_at_rest(address: str, pids: dict[str, int], reads: int = 5, period_s: float = 0.4,
                ) -> tuple[dict[str, float], dict]:
    """Each process's RSS (KiB) at rest: once every KV pool is free (:func:`wait_pools_free`; the clients have
    finished), the median of ``reads`` reads ``period_s`` apart; with the pools as :func:`wait_pools_free` saw them.

    Raises:
        AssertionError: KV blocks still allocated (as :func:`wait_pools_free`).
    """
    pools = wait_pools_free(address)
    samples = []
    for _ in range(reads):
        time.sleep(period_s)
        samples.append({n: rss_kb(p) for n, p in pids.items()})
    return {n: statistics.median(s[n] for s in samples) for n in pids}, pools


def summarize(records: list[tuple], warmup_s: float, duration_s: float) -> dict:
    """Counts by status over the whole run; throughput and latency over requests started after the warm-up."""
    statuses = Counter(r[1] for r in records)
    measured = [r for r in records if r[0] >= warmup_s and r[1] == "OK"]
    window = duration_s - warmup_s
    errors = {}
    for r in records:
        if r[1] != "OK":
            errors.setdefault(r[1], r[5] if len(r) > 5 else "")
    return {"requests": len(records), "statuses": dict(statuses), "errors": sum(v for k, v in statuses.items()
                                                                                 if k != "OK"),
            "error_examples": errors, "measured_requests": len(measured),
            "requests_per_s": len(measured) / window, "tokens_per_s": sum(r[4] for r in measured) / window,
            "ttft_s": percentiles([r[2] for r in measured]),
            "tpot_s": percentiles([r[3] for r in measured if r[4] > 1])}


def soak(model: str, redis_url: str, clients: int, duration_s: float, warmup_s: float, client_procs: int = 4,
         num_prompts: int = 200, seed: int = 0, timeout_s: float = 120.0, decode_blocks: int = 4096,
         max_batch_size: int = 64) -> dict:
    """Run the soak on a fresh cluster, the warm-up and the measured load as two phases; returns the summary,
    each process's RSS growth (at rest between and after the phases, and its high-water mark under load) and the
    pools' final state.

    Raises:
        ValueError: the warm-up leaves no measured window.
        AssertionError: KV blocks still allocated after a phase.
    """
    if not 0 < warmup_s < duration_s - 10:
        raise ValueError(f"warm-up {warmup_s} s must leave at least 10 s of a {duration_s} s run")
    procs = start_cluster(model, redis_url, decode_blocks, max_batch_size)
    try:
        router = procs[-1]
        prompts = make_prompts(num_prompts, seed)
        procs_n = max(1, min(client_procs, clients))
        share = [clients // procs_n + (i < clients % procs_n) for i in range(procs_n)]
        pids = {p.name: p.proc.pid for p in procs}

        def phase(pool, start_at: float, seconds: float, seed0: int) -> list[tuple]:
            futures = [pool.submit(run_clients, router.address, n, start_at, start_at + seconds, seed0 + i, prompts,
                                   timeout_s) for i, n in enumerate(share)]
            return [r for f in futures for r in f.result()]

        with ProcessPoolExecutor(procs_n, mp_context=get_context("spawn")) as pool:
            t0 = time.time() + 3.0 + 0.5 * procs_n  # children import and connect first (late ones join in)
            sampler = RssSampler(pids, t0)
            sampler.start()
            warm = phase(pool, t0, warmup_s, seed)
            rest_warm, _ = rss_at_rest(router.address, pids)
            t1 = time.time() + 0.5
            measured = phase(pool, t1, duration_s - warmup_s, seed + procs_n)
            rest_end, pools_at_end = rss_at_rest(router.address, pids)
            sampler.stop()
        dead = [p.name for p in procs if p.proc.poll() is not None]
        if dead:
            raise RuntimeError(f"processes died during the soak: {dead}")
        result = summarize(warm + [(r[0] + warmup_s, *r[1:]) for r in measured], warmup_s, duration_s)
        result["rss"] = sampler.growth(t1 - t0, t1 - t0 + duration_s - warmup_s)
        for name, g in result["rss"].items():
            b, e = rest_warm[name], rest_end[name]
            g.update(rest_after_warmup_mib=b / 1024, rest_end_mib=e / 1024, rest_growth_mib=(e - b) / 1024,
                     rest_growth_pct=100 * (e / b - 1), rest_growth_kib_per_request=(e - b) / max(1, len(measured)))
        result["rss_series"] = [(round(t, 1), s) for t, s in sampler.samples]
        result["measured_from_s"] = round(t1 - t0, 1)
        result["pools_at_end"] = pools_at_end
        result.update(clients=clients, duration_s=duration_s, warmup_s=warmup_s, client_procs=procs_n,
                      num_prompts=num_prompts, decode_blocks=decode_blocks, max_batch_size=max_batch_size)
        return result
    finally:
        for p in reversed(procs):
            p.stop()


def print_table(result: dict) -> None:
    """Print the soak summary, the RSS table and the router-overhead table (milliseconds)."""
    s = result["soak"]
    print(f"\nsoak: {s['clients']} clients x {s['duration_s']:g} s (warm-up {s['warmup_s']:g} s): "
          f"{s['requests']} requests, errors {s['errors']} {s['statuses']}")
    print(f"  measured: {s['requests_per_s']:.1f} req/s, {s['tokens_per_s']:.0f} tokens/s; "
          f"TTFT p50 {s['ttft_s']['p50'] * 1e3:.0f} ms p99 {s['ttft_s']['p99'] * 1e3:.0f} ms; "
          f"TPOT p50 {s['tpot_s']['p50'] * 1e3:.1f} ms p99 {s['tpot_s']['p99'] * 1e3:.1f} ms")
    print(f"  {'process':<10}{'at rest: after warm-up':>24}{'at end':>8}{'growth %':>10}{'KiB/request':>13}"
          f"   under load: {'baseline':>9}{'end':>7}{'peak':>7}{'growth %':>10}   (MiB)")
    for name, g in s["rss"].items():
        print(f"  {name:<10}{g['rest_after_warmup_mib']:>24.1f}{g['rest_end_mib']:>8.1f}{g['rest_growth_pct']:>10.2f}"
              f"{g['rest_growth_kib_per_request']:>13.2f}   {'':>12}{g['baseline_mib']:>9.1f}{g['end_mib']:>7.1f}"
              f"{g['peak_mib']:>7.1f}{g['growth_pct']:>10.2f}")
    lat = result.get("router_overhead")
    if lat:
        print(f"\nrouter overhead ({lat['pairs']} sequential pairs, {lat['max_tokens']} tokens, colocated worker):")
        print(f"  {'metric':<8}{'direct p50':>12}{'routed p50':>12}{'added p50':>11}{'direct p99':>12}"
              f"{'routed p99':>12}{'added p99':>11}   (ms)")
        for m in ("ttft_s", "tpot_s"):
            d, r, a, pa = lat["direct"][m], lat["routed"][m], lat["added"][m], lat["paired_added"][m]
            print(f"  {m[:-2]:<8}{d['p50'] * 1e3:>12.2f}{r['p50'] * 1e3:>12.2f}{a['p50'] * 1e3:>11.2f}"
                  f"{d['p99'] * 1e3:>12.2f}{r['p99'] * 1e3:>12.2f}{a['p99'] * 1e3:>11.2f}"
                  f"   paired added p50 {pa['p50'] * 1e3:.2f} p99 {pa['p99'] * 1e3:.2f}")


def plot_rss(soak_result: dict, out: Path) -> None:
    """RSS (MiB) of each process over the run, with the start of the measured load marked, to ``out`` (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    series = soak_result["rss_series"]
    for name in soak_result["rss"]:
        ax.plot([t for t, _ in series], [s[name] / 1024 for _, s in series], label=name)
    ax.axvline(soak_result["measured_from_s"], color="grey", linestyle="--", label="measured load from")
    ax.set(xlabel="seconds", ylabel="VmRSS (MiB)",
           title=f"soak: {soak_result['clients']} streaming clients, {soak_result['errors']} errors")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    """Command line: router overhead, then the soak; prints tables, writes ``results.json`` and
    ``rss.png`` under ``--out``. Returns the result dict."""
    from pdserve.bench.common import write_result
    from pdserve.cluster.args import default_redis_url
    from pdserve.deploy.config import EMBEDDED_MODEL

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=500)
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of load, warm-up included")
    ap.add_argument("--warmup", type=float, default=None, help="seconds (default: max(10, 20%% of --duration))")
    ap.add_argument("--client-procs", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--latency-pairs", type=int, default=200, help="0 skips the router-overhead measurement")
    ap.add_argument("--decode-blocks", type=int, default=4096)
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=EMBEDDED_MODEL)
    ap.add_argument("--redis-url", default=default_redis_url())
    ap.add_argument("--out", type=Path, default=None, help="directory for results.json")
    args = ap.parse_args(argv)
    warmup = args.warmup if args.warmup is not None else max(10.0, 0.2 * args.duration)
    result: dict = {}
    if args.latency_pairs:
        result["router_overhead"] = measure_router_overhead(args.model, args.redis_url, args.latency_pairs, args.seed)
    result["soak"] = soak(args.model, args.redis_url, args.clients, args.duration, warmup, args.client_procs,
                          args.num_prompts, args.seed, decode_blocks=args.decode_blocks,
                          max_batch_size=args.max_batch_size)
    print_table(result)
    if args.out is not None:
        write_result(result, args.out / "results.json")
        plot_rss(result["soak"], args.out / "rss.png")
        print(f"\nwrote {args.out / 'results.json'} and rss.png")
    return result


if __name__ == "__main__":
    main()
