"""Micro-benchmark of the router's prefix index (router/prefix_index.py) and its sync.

Builds an index of 100,000 distinct cached blocks across 8 workers the way a cluster
fills it: ~1,000+ prompts of 100 blocks (16 tokens each) with shared prefixes (20
system prompts, half the prompts continuing an earlier one), each cached on 1-3
workers through ``stored`` events (a worker stores only the part it lacks). Then
measures, on one core, in process:

* lookups/s of 64-block prompts, hashes precomputed (``lookup_hashes``, bisection),
  for a mix (each query shares 0-64 leading blocks with a cached prompt), full hits
  (the worst case of a walk) and misses; the linear walk for comparison;
* prompt hashing alone (``hash_prompt``, 1,024 tokens) and lookups with hashing;
* event applications/s: ``stored`` and ``removed`` of 16-block chains, and decode
  (msgpack stream entry -> KVEvent) + apply, the sync's per-entry path;
* with Redis reachable: ``IndexSync.sync_once`` throughput (XREAD + decode + apply).

Usage: ``.venv/bin/python bench/index.py [--out bench/out/index.json] [--redis URL|none]``.
Timings are the median of ``--repeats`` runs (the best one is reported too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
import uuid
from pathlib import Path

import numpy as np

from pdserve.cluster.kv_events import REMOVED, STORED, KVEvent, _encode, decode_event
from pdserve.router.prefix_index import PrefixIndex

ROOT = Path(__file__).resolve().parent.parent

BS, WORKERS, PROMPT_BLOCKS, QUERY_BLOCKS, EVENT_BLOCKS = 16, 8, 100, 64, 16


def index_mb(idx: PrefixIndex) -> float:
    """Memory of the index's containers and hash objects (each object counted once), MiB."""
    seen: set[int] = set()
    total = sys.getsizeof(idx._table) + sum(sys.getsizeof(s) for s in idx._exact.values())
    for obj in [*idx._table, *(h for s in idx._exact.values() for h in s)]:
        if id(obj) not in seen:
            seen.add(id(obj))
            total += sys.getsizeof(obj)
    return total / 2**20


def build(target_blocks: int, rng: random.Random) -> tuple[PrefixIndex, list[list[int]], dict]:
    """The index, the cached prompts' tokens, and build statistics."""
    idx = PrefixIndex(BS)
    systems = [[rng.randrange(32000) for _ in range(BS * rng.randint(8, 24))] for _ in range(20)]
    prompts: list[list[int]] = []
    held: list[set[int]] = [set() for _ in range(WORKERS)]
    events = 0
    started = time.perf_counter()
    while idx.num_blocks < target_blocks:
        if prompts and rng.random() < 0.5:  # continue an earlier prompt (a conversation's next turn, a shared doc)
            base = rng.choice(prompts)[: BS * rng.randint(10, 90)]
        else:
            base = list(rng.choice(systems))
        tokens = base + [rng.randrange(32000) for _ in range(BS * PROMPT_BLOCKS - len(base))]
        prompts.append(tokens)
        hs = idx.hash_prompt(tokens)
        for w in rng.sample(range(WORKERS), rng.randint(1, 3)):
            k = next((i for i, h in enumerate(hs) if h not in held[w]), len(hs))
            if k < len(hs):
                assert idx.apply(f"w{w}", KVEvent(STORED, hs[k:], hs[k - 1] if k else idx.root, BS))
                held[w].update(hs[k:])
                events += 1
    stats = {"prompts": len(prompts), "distinct_blocks": idx.num_blocks, "worker_block_pairs": idx.num_entries(),
             "stored_events": events, "build_s": round(time.perf_counter() - started, 2)}
    return idx, prompts, stats


def rate(fn, items: list, repeats: int) -> dict:
    """Calls of ``fn`` per second over ``items``: median and best of ``repeats`` passes."""
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for x in items:
            fn(x)
        rates.append(len(items) / (time.perf_counter() - t0))
    return {"per_s": round(statistics.median(rates)), "best_per_s": round(max(rates))}


def queries(prompts: list[list[int]], n: int, kind: str, rng: random.Random) -> list[list[int]]:
    out = []
    for _ in range(n):
        p = rng.choice(prompts)
        k = {"mixed": rng.randint(0, QUERY_BLOCKS), "full": QUERY_BLOCKS, "miss": 0}[kind] * BS
        out.append(p[:k] + [rng.randrange(32000) for _ in range(QUERY_BLOCKS * BS - k)])
    return out


def bench_events(idx: PrefixIndex, n: int, repeats: int, rng: random.Random) -> dict:
    """stored then removed of fresh 16-block chains under blocks the worker holds."""
    out = {}
    held = {w: sorted(idx.hashes_of(w)) for w in idx.workers()}
    for r in range(repeats):
        evs = []
        for _ in range(n):
            w = f"w{rng.randrange(WORKERS)}"
            parent = rng.choice(held[w])
            hs = [rng.getrandbits(64) for _ in range(EVENT_BLOCKS)]
            evs.append((w, KVEvent(STORED, hs, parent, BS), KVEvent(REMOVED, hs[::-1], None, BS)))
        t0 = time.perf_counter()
        for w, st, _ in evs:
            idx.apply(w, st)
        t1 = time.perf_counter()
        for w, _, rm in evs:
            idx.apply(w, rm)
        t2 = time.perf_counter()
        out.setdefault("stored", []).append(n / (t1 - t0))
        out.setdefault("removed", []).append(n / (t2 - t1))
        # the sync's per-entry path: a stream entry as redis-py returns it -> KVEvent -> apply
        raw = [(w, f"{r}-{i}".encode(), {k.encode(): (v if isinstance(v, bytes) else str(v).encode())
                                         for k, v in _encode(ev).items()})
               for i, (w, st, rm) in enumerate(evs) for ev in (st, rm)]
        t0 = time.perf_counter()
        for w, eid, fields in raw:
            idx.apply(w, decode_event(eid, fields))
        out.setdefault("decode+apply", []).append(len(raw) / (time.perf_counter() - t0))
    return {k: {"per_s": round(statistics.median(v)), "best_per_s": round(max(v)),
                "blocks_per_s": round(statistics.median(v) * EVENT_BLOCKS)} for k, v in out.items()}


def bench_sync(url: str, n: int) -> dict | None:
    """IndexSync.sync_once over ``n`` 16-block events per worker (2 workers) published to Redis."""
    import redis

    from pdserve.cluster.kv_events import KVEventPublisher
    from pdserve.router.index_sync import IndexSync

    try:
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
    except (redis.RedisError, OSError):
        return None
    cluster, rng = "bench-idx-" + uuid.uuid4().hex[:8], random.Random(1)
    idx = PrefixIndex(BS)
    try:
        for w in ("p0", "p1"):
            pub = KVEventPublisher(url, cluster, w, queue_size=4 * n)
            for i in range(n):  # stored then removed chains
                if i % 2 == 0:
                    hs = [rng.getrandbits(64) for _ in range(EVENT_BLOCKS)]
                pub.publish(KVEvent(STORED, hs, idx.root, BS) if i % 2 == 0 else KVEvent(REMOVED, hs[::-1], None, BS))
            assert pub.flush(60) and pub.num_dropped == 0
            pub.close()

        async def go():
            sync = IndexSync(url, cluster, idx, count=500, max_rounds=10**9)
            sync.set_workers(["p0", "p1"])
            t0 = time.perf_counter()
            await sync.sync_once()  # first sync: walks each stream back to seq 1 and replays it
            first = time.perf_counter() - t0
            sync2 = IndexSync(url, cluster, PrefixIndex(BS), count=500, max_rounds=10**9)
            sync2.set_workers([])
            await sync2.sync_once()
            for w in ("p0", "p1"):  # live path: a worker in sync, reading on from the stream's start
                sync2._workers[w] = type(sync._workers[w])(epoch=sync._workers[w].epoch, synced=True)
            t0 = time.perf_counter()
            applied = await sync2.sync_once()
            live = time.perf_counter() - t0
            await sync.aclose()
            await sync2.aclose()
            return first, live, applied

        first, live, applied = asyncio.run(go())
        return {"events": 2 * n, "first_sync_events_per_s": round(2 * n / first),
                "live_events_per_s": round(applied / live), "live_applied": applied}
    finally:
        r = redis.Redis.from_url(url)
        keys = r.keys(f"pdserve:{cluster}:*")
        if keys:
            r.delete(*keys)
        r.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench/out/index.json"))
    ap.add_argument("--blocks", type=int, default=100_000, help="distinct cached blocks")
    ap.add_argument("--queries", type=int, default=5_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="URL for the sync benchmark, or 'none'")
    args = ap.parse_args()
    rng = random.Random(0)
    idx, prompts, build_stats = build(args.blocks, rng)
    build_stats["index_mb"] = round(index_mb(idx), 1)
    res: dict = {"machine": {"platform": platform.platform(), "python": platform.python_version(),
                             "cpus": os.cpu_count()},
                 "config": {"block_size": BS, "workers": WORKERS, "query_blocks": QUERY_BLOCKS,
                            "event_blocks": EVENT_BLOCKS, "queries": args.queries, "repeats": args.repeats},
                 "build": build_stats, "lookup": {}}
    toks = {k: queries(prompts, args.queries, k, rng) for k in ("mixed", "full", "miss")}
    hashed = {k: [idx.hash_prompt(t) for t in v] for k, v in toks.items()}
    hits = [idx.lookup_hashes(h) for h in hashed["mixed"]]
    res["build"]["mixed_mean_best_blocks"] = round(statistics.mean(max(h.values(), default=0) for h in hits), 1)
    res["build"]["mixed_mean_workers_hit"] = round(statistics.mean(len(h) for h in hits), 2)
    L = res["lookup"]
    for k in ("mixed", "full", "miss"):
        L[f"lookup_hashes {k}"] = rate(idx.lookup_hashes, hashed[k], args.repeats)
    for k in ("mixed", "full"):
        L[f"lookup_linear {k}"] = rate(idx.lookup_linear, hashed[k], args.repeats)
    L["hash_prompt (list)"] = rate(idx.hash_prompt, toks["mixed"], args.repeats)
    arrays = [np.asarray(t, dtype=np.int64) for t in toks["mixed"]]
    L["hash_prompt (numpy)"] = rate(idx.hash_prompt, arrays, args.repeats)
    L["lookup (hash + lookup) mixed"] = rate(idx.lookup, toks["mixed"], args.repeats)
    res["events"] = bench_events(idx, 2_000, args.repeats, rng)
    res["sync"] = None if args.redis == "none" else bench_sync(args.redis, 5_000)

    b = res["build"]
    print(f"index: {b['distinct_blocks']:,} blocks, {b['worker_block_pairs']:,} (worker, block) pairs, "
          f"{b['prompts']:,} prompts x {PROMPT_BLOCKS} blocks, {WORKERS} workers, {b['index_mb']} MiB; "
          f"mixed queries: best worker holds {b['mixed_mean_best_blocks']} blocks, "
          f"{b['mixed_mean_workers_hit']} workers hit on average")
    print(f"{'operation (64-block prompts, 16-block events)':<46} {'median/s':>12} {'best/s':>12} {'us/op':>8}")
    for name, r in [*L.items(), *((f"apply {k}" + (" (16-block events)" if k != "decode+apply" else ""), v)
                                  for k, v in res["events"].items())]:
        print(f"{name:<46} {r['per_s']:>12,} {r['best_per_s']:>12,} {1e6 / r['per_s']:>8.1f}")
    if res["sync"]:
        s = res["sync"]
        print(f"IndexSync over Redis ({s['events']:,} events): first sync {s['first_sync_events_per_s']:,} events/s, "
              f"live {s['live_events_per_s']:,} events/s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
