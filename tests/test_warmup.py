"""Start-up warm-up (decode_worker/warmup.py, prefill_worker/warmup.py, WorkerProcess.start): engines in
process run every bucket and chunk class and give every block back; real worker processes register only
after their warm-up, count no request, and still answer token-exactly."""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cluster.args import add_config_args, config_from_args
from pdserve.cluster.registry import WorkerLease
from pdserve.cluster.warmup import row_classes
from pdserve.cluster.worker_config import add_no_warmup_flag
from pdserve.decode_worker.config import DecodeWorkerConfig
from pdserve.decode_worker.engine import DecodeEngine
from pdserve.decode_worker.request import TokensEvent
from pdserve.decode_worker.warmup import warm_up_decode
from pdserve.deploy import client
from pdserve.deploy.processes import spawn_role
from pdserve.deploy.ray_cluster import delete_cluster_keys
from pdserve.model.loader import load_model
from pdserve.model.sampling import SamplingParams
from pdserve.prefill_worker.config import PrefillWorkerConfig
from pdserve.prefill_worker.engine import PrefillEngine
from pdserve.prefill_worker.warmup import continuation_lengths, warm_up_prefill
from tests.conftest import hf_greedy

PROMPT_IDS = [1, 415, 263, 931, 892, 727, 471]


def test_row_classes():
    assert row_classes(512) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert row_classes(300) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 300]
    assert row_classes(1) == [1] and row_classes(0) == []
    assert continuation_lengths(240) == [1, 8, 16, 240] and continuation_lengths(5) == [1, 5]


def test_no_warmup_flag():
    parser = argparse.ArgumentParser()
    add_config_args(parser, DecodeWorkerConfig)
    add_no_warmup_flag(parser)
    base = ["--model-dir", "m", "--worker-id", "d"]
    assert config_from_args(DecodeWorkerConfig, parser.parse_args(base)).warmup is True
    assert config_from_args(DecodeWorkerConfig, parser.parse_args([*base, "--no-warmup"])).warmup is False
    assert config_from_args(DecodeWorkerConfig, parser.parse_args([*base, "--warmup", "false"])).warmup is False


def _decode_tokens(engine: DecodeEngine, prompt: list[int], n: int) -> list[int]:
    """Greedy output of ``prompt`` through the engine (prefilled locally), ``n`` tokens, EOS ignored."""
    out: list[int] = []
    engine.add_local("exact", prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                     lambda ev: out.extend(ev.token_ids) if isinstance(ev, TokensEvent) else None)
    for _ in range(4 * n):
        engine.step()
        if not (engine.num_decoding or engine.num_prefilling):
            break
    return out


@pytest.mark.parametrize("speculative", ["off", "ngram", "self"])
def test_decode_warmup_frees_every_block_and_stays_exact(model_dir, hf_model, speculative):
    cfg = DecodeWorkerConfig(model_dir=model_dir, worker_id="w", num_blocks=40, block_size=16,
                             speculative=speculative, spec_max_batch_size=2)
    model, model_cfg = load_model(model_dir)
    engine = DecodeEngine(cfg, model, model_cfg)
    try:
        free = engine.pool.num_free
        assert free == cfg.num_blocks - 1  # the graph runner's padding block
        report = warm_up_decode(engine)
        # 39 usable blocks hold the 33 one-block requests that reach the largest bucket (64): every bucket runs
        spec_classes = len(row_classes(2)) if speculative != "off" else 0
        assert report.num_decode_buckets == len(engine.graph.buckets) + spec_classes
        assert report.num_prefill_shapes == 0  # not colocated
        assert engine.pool.num_free == free
        assert (engine.num_decoding, engine.num_prefilling, engine.num_transferring) == (0, 0, 0)
        assert engine.last_step == (0, 0, 0.0)
        if engine.adaptive is not None:
            assert not engine.adaptive._states  # every warm-up request forgotten
        assert _decode_tokens(engine, PROMPT_IDS, 12) == hf_greedy_ignoring_eos(hf_model, PROMPT_IDS, 12)
        assert engine.pool.num_free == free
    finally:
        engine.receiver.close()


def hf_greedy_ignoring_eos(hf_model, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens, going on past EOS like a request with ``ignore_eos`` (:func:`hf_greedy` stops)."""
    out = hf_greedy(hf_model, prompt, n)
    while len(out) < n:  # transformers stopped at EOS: continue from there
        out += hf_greedy(hf_model, prompt + out, n - len(out))[: n - len(out)]
    return out


def test_decode_warmup_skips_buckets_the_pool_cannot_reach(model_dir):
    """6 blocks (5 usable): batches of 1, 2, 3, 5 reach buckets 1, 2, 4, 8; bucket 16 needs 9 requests."""
    model, model_cfg = load_model(model_dir)
    engine = DecodeEngine(DecodeWorkerConfig(model_dir=model_dir, worker_id="w", num_blocks=6), model, model_cfg)
    try:
        assert warm_up_decode(engine).num_decode_buckets == 4
        assert engine.pool.num_free == 5
    finally:
        engine.receiver.close()


def test_colocated_decode_warmup_runs_the_chunk_classes(model_dir):
    model, model_cfg = load_model(model_dir)
    cfg = DecodeWorkerConfig(model_dir=model_dir, worker_id="w", num_blocks=64, block_size=4, max_batch_size=4,
                             colocated=True, max_num_batched_tokens=8)
    engine = DecodeEngine(cfg, model, model_cfg)
    try:
        report = warm_up_decode(engine)
        assert report.num_prefill_shapes == len(row_classes(8)) + 1  # classes and one continuation
        assert report.num_decode_buckets == len(engine.graph.buckets)
        assert engine.pool.num_free == cfg.num_blocks - 1
    finally:
        engine.receiver.close()


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_prefill_warmup_leaves_no_state(model_dir, prefix_cache):
    model, model_cfg = load_model(model_dir)
    events = []
    cfg = PrefillWorkerConfig(model_dir=model_dir, worker_id="w", num_blocks=40, prefix_cache=prefix_cache)
    engine = PrefillEngine(cfg, model, model_cfg, events.append)
    report = warm_up_prefill(engine)
    budget = min(cfg.max_num_batched_tokens, model_cfg.max_position_embeddings - 1)  # 511 on the tiny model
    if prefix_cache:  # classes; the 240-token prefix; its continuations (at most 271 tokens); two sequences
        expected = len(row_classes(budget)) + 1 + len(continuation_lengths(511 - 240)) + 1
    else:  # classes; two sequences (no prompt is longer than one chunk on this context)
        expected = len(row_classes(budget)) + 1
    assert report.num_prefill_shapes == expected
    assert engine.pool.num_free == cfg.num_blocks
    assert engine.blocks.num_available == cfg.num_blocks
    if prefix_cache:
        assert engine.blocks.num_cached == 0 and engine.blocks.num_owned == 0
        engine.blocks.check_invariants()
    assert events == []  # nothing published: routers' prefix index sees nothing
    assert engine.seconds_per_token is None and engine.num_queued == engine.num_in_flight == 0


# ---- real processes -------------------------------------------------------------------------------
def _scrape(address: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if "finished_reason" not in s.labels}


def test_workers_register_only_after_warmup_and_count_no_request(redis_url, model_dir, hf_model):
    """Every registry entry a watcher sees while the workers start already carries the warm-up time and a
    free pool; the log says so before ``ready``; the metrics show the warm-up and no request; a request
    afterwards is token-exact. A worker started with ``warmup false`` reports none."""
    cluster = "warmup-" + uuid.uuid4().hex[:8]
    lease = WorkerLease(redis_url, cluster, 2.0)
    seen, stop = [], threading.Event()

    def watch() -> None:
        while not stop.wait(0.01):  # polls; a busy loop would slow the starts on a small machine
            seen.extend(lease.list_workers())

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    common = dict(model_dir=model_dir, cluster=cluster, redis_url=redis_url, lease_s=2.0, log_level="INFO")
    procs = []
    try:
        with ThreadPoolExecutor(max_workers=3) as pool:  # started together, as the clusters of other tests
            futures = [pool.submit(spawn_role, role, dict(worker_id=name, **flags, **common), name)
                       for role, name, flags in (("prefill_worker", "p0", {}), ("decode_worker", "d0", {}),
                                                 ("decode_worker", "d1", {"warmup": False}))]
            for f in futures:
                procs.append(f.result())
        stop.set()
        watcher.join()
        entries = {w.worker_id: w for w in lease.list_workers()}
        seen.extend(entries.values())  # the watcher may have stopped before the last registration
        assert {w.worker_id for w in seen} == {"p0", "d0", "d1"}
        for w in seen:
            assert w.num_free_blocks == w.num_total_blocks, w
            assert (w.warmup_s > 0) == (w.worker_id != "d1"), w
        for name in ("p0", "d0"):
            metrics = _scrape(entries[name].metrics_address)
            assert metrics["pdserve:warmup_seconds"] == pytest.approx(entries[name].warmup_s)
            assert metrics["pdserve:prompt_tokens_total"] == 0
            assert metrics["pdserve:generation_tokens_total"] == 0
            assert metrics["pdserve:kv_cache_usage_perc"] == 0
        assert _scrape(entries["d1"].metrics_address)["pdserve:warmup_seconds"] == 0
        procs[-1].stop()  # d1 leaves: the request below goes through the warmed-up d0
        procs.append(spawn_role("router", dict(model_dir=model_dir, cluster=cluster, redis_url=redis_url), "router"))


        async def go():
            async with grpc.aio.insecure_channel(procs[-1].address) as channel:
                deadline = time.monotonic() + 10
                while {w.worker_id for w in (await client.cluster_state(channel)).workers} != {"p0", "d0"}:
                    assert time.monotonic() < deadline, "the router never listed p0 and d0 alone"
                    await asyncio.sleep(0.1)
                return await client.complete(channel, client.make_request(PROMPT_IDS, max_tokens=16, temperature=0.0),
                                             timeout_s=60)
        done = asyncio.run(go())
        assert done.token_ids == hf_greedy(hf_model, PROMPT_IDS, 16)
    finally:
        stop.set()
        for p in reversed(procs):
            p.stop()
        delete_cluster_keys(redis_url, cluster)
    for p in procs[:2]:
        log = p.proc.stderr.read()
        warmed = [line for line in log.splitlines() if "warmed up in" in line]
        assert len(warmed) == 1 and " prefill shapes, " in warmed[0] and " decode buckets" in warmed[0], log[-2000:]


def test_a_batch_bound_past_the_pool_is_held_to_the_usable_blocks(model_dir):
    """Every decoding request holds a block, so no batch outgrows the usable pool: a --max-batch-size
    beyond it (200,000 had warmed graph buckets up to itself, 2.4 GB of static buffers) stops there, and
    warm-up runs the buckets up to it."""
    cfg = DecodeWorkerConfig(model_dir=model_dir, worker_id="w", num_blocks=24, block_size=16,
                             max_batch_size=200_000)
    model, model_cfg = load_model(model_dir)
    engine = DecodeEngine(cfg, model, model_cfg)
    try:
        assert engine.max_batch_size == 23 == engine.graph.max_batch_size   # 24 blocks less the padding block
        assert engine.graph.buckets == (1, 2, 4, 8, 16, 23)
        report = warm_up_decode(engine)
        assert report.num_decode_buckets == 6 and engine.pool.num_free == 23
    finally:
        engine.receiver.close()
    small = DecodeEngine(DecodeWorkerConfig(model_dir=model_dir, worker_id="w", num_blocks=24, max_batch_size=8,
                                            graph=False), model, model_cfg)
    try:
        assert small.max_batch_size == 8
    finally:
        small.receiver.close()


def test_the_prefill_queue_takes_lower_priority_values_first(model_dir):
    """vLLM's priority: a queued prompt goes after every one with a priority value at most its own, so the
    queue is by priority, then arrival."""
    from pdserve.model.sampling import SamplingParams
    from pdserve.prefill_worker.request import PrefillRequest

    model, model_cfg = load_model(model_dir)
    engine = PrefillEngine(PrefillWorkerConfig(model_dir=model_dir, worker_id="w", num_blocks=40), model, model_cfg)
    try:
        for rid, priority in (("a", 0), ("b", 2), ("c", -1), ("d", 0), ("e", 2), ("f", 1)):
            engine.add_request(PrefillRequest(rid, [1, 5, 6], SamplingParams(priority=priority), "127.0.0.1:1", [0],
                                              lambda _r: None))
        assert [r.attempt_id for r in engine._queue] == ["c", "a", "d", "f", "b", "e"]
    finally:
        engine.sender.close()
