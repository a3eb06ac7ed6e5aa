"""The dispatch policy on hand-built cluster states."""

from __future__ import annotations

import random
from collections import Counter

from pdserve.cluster.registry import WorkerInfo
from pdserve.router.dispatch import PrefillStats, no_pool_holds, rank_decode, rank_prefill


def P(wid: str, queued_tokens: int = 0, running: int = 0) -> WorkerInfo:
    return WorkerInfo(worker_id=wid, role="prefill", address="x", num_queued_tokens=queued_tokens,
                      num_running=running, block_size=16)


def D(wid: str, free: int, running: int = 0) -> WorkerInfo:
    return WorkerInfo(worker_id=wid, role="decode", address="x", num_free_blocks=free, num_total_blocks=100,
                      num_running=running, block_size=16)


def ids(ws):
    return [w.worker_id for w in ws]


def test_cached_prefix_wins_when_queues_are_equal():
    ws = [P("a"), P("b"), P("c")]
    stats = {w: PrefillStats(seconds_per_block=0.01) for w in "abc"}
    assert ids(rank_prefill(ws, 100, {"b": 90, "c": 40}, stats, Counter(), spill_queue_s=10))[:2] == ["b", "c"]


def test_queued_work_outweighs_a_small_cache_hit():
    ws = [P("a", queued_tokens=16 * 50), P("b")]
    stats = {w: PrefillStats(seconds_per_block=0.01) for w in "ab"}
    # a: (100 - 10) + 50 queued = 140 blocks of work; b: 100 blocks
    assert ids(rank_prefill(ws, 100, {"a": 10}, stats, Counter(), spill_queue_s=10))[0] == "b"


def test_measured_speed_matters():
    ws = [P("slow"), P("fast")]
    stats = {"slow": PrefillStats(seconds_per_block=0.05), "fast": PrefillStats(seconds_per_block=0.01)}
    assert ids(rank_prefill(ws, 20, {}, stats, Counter(), spill_queue_s=10))[0] == "fast"


def test_router_queue_counts_before_heartbeats_catch_up():
    ws = [P("a"), P("b")]
    stats = {"a": PrefillStats(0.01, queued_blocks=80), "b": PrefillStats(0.01)}
    assert ids(rank_prefill(ws, 10, {"a": 10}, stats, Counter(), spill_queue_s=10))[0] == "b"


def test_hot_prefix_spills_once_the_best_queue_is_too_long():
    ws = [P("hot", queued_tokens=16 * 300), P("cold")]
    stats = {w: PrefillStats(seconds_per_block=0.01) for w in ("hot", "cold")}
    cached = {"hot": 400}  # everything cached on "hot", but 3 s of work waiting there
    assert ids(rank_prefill(ws, 400, cached, stats, Counter(), spill_queue_s=5.0))[0] == "hot"   # cost 3 s < 4 s
    assert ids(rank_prefill(ws, 400, cached, stats, Counter(), spill_queue_s=2.0))[0] == "cold"  # spill


def test_ties_break_by_load_then_randomly_never_by_id():
    stats = {w: PrefillStats(0.01) for w in "abc"}
    ws = [P("a", running=2), P("b", running=1), P("c", running=2)]
    assert ids(rank_prefill(ws, 8, {}, stats, Counter(), 10))[0] == "b"
    firsts = {ids(rank_prefill([P("a"), P("b"), P("c")], 8, {}, stats, Counter(), 10, random.Random(s)))[0]
              for s in range(30)}
    assert firsts == {"a", "b", "c"}


def test_unmeasured_workers_use_the_mean_of_the_measured():
    ws = [P("new"), P("old")]
    stats = {"old": PrefillStats(0.02)}
    ranked = rank_prefill(ws, 10, {"new": 5}, stats, Counter(), 10)
    assert ids(ranked)[0] == "new"  # same speed assumed, 5 fewer blocks to compute


def test_decode_by_batch_then_free_blocks_and_room():
    ws = [D("a", free=50, running=3), D("b", free=10, running=1), D("c", free=90, running=1), D("full", free=1)]
    assert ids(rank_decode(ws, Counter(), num_tokens=100)) == ["c", "b", "a"]   # 7 blocks needed: "full" is out
    assert ids(rank_decode(ws, Counter({"c": 5}), num_tokens=100)) == ["b", "a", "c"]


def test_decode_needs_room_now_and_a_pool_for_the_whole_request():
    """Workers take blocks as a request grows: free blocks for its context now, a pool for prompt + max_tokens."""
    small = WorkerInfo(worker_id="small", role="decode", address="x", num_free_blocks=20, num_total_blocks=20,
                       block_size=16)
    ws = [D("a", free=10), small]
    assert ids(rank_decode(ws, Counter(), num_tokens=100, lifetime_tokens=1600)) == ["a"]   # 100 blocks: "small" never
    assert ids(rank_decode(ws, Counter(), num_tokens=100, lifetime_tokens=320)) == ["small", "a"]
    assert ids(rank_decode(ws, Counter(), num_tokens=200, lifetime_tokens=320)) == ["small"]  # 13 blocks now
    assert no_pool_holds(ws, "decode", 1601) and not no_pool_holds(ws, "decode", 1600)
    assert not no_pool_holds(ws, "both", 10**6)                                   # no such workers: not this


def test_decode_workers_without_a_common_kv_transport_are_never_chosen():
    from dataclasses import replace

    cpu, gpu = replace(D("cpu", free=100), kv_backends=("tcp",)), replace(D("gpu", free=100), kv_backends=("nccl",))
    old = D("old", free=100)  # an entry without kv_backends reads as TCP
    workers = [cpu, gpu, old]
    assert ids(rank_decode(workers, Counter(), 16, kv_backends=("nccl",))) == ["gpu"]
    assert sorted(ids(rank_decode(workers, Counter(), 16, kv_backends=("tcp",)))) == ["cpu", "old"]
    assert sorted(ids(rank_decode(workers, Counter(), 16, kv_backends=()))) == ["cpu", "old"]


def test_a_prompt_logprobs_attempt_is_credited_no_cached_prefix():
    """Its prefill worker runs the whole prompt past its cache, so no worker's cache counts in its ranking or
    work estimate, until tokens have been streamed (a migrated attempt's prefill uses the cache again)."""
    from pdserve.model.sampling import SamplingParams
    from pdserve.router.choose import credited_cache
    from pdserve.router.recovery import Progress
    from pdserve.router.slo import Slo
    from pdserve.router.validation import ValidRequest
    from pdserve.router.view import ClusterView

    ws = [P("hot", queued_tokens=16 * 30), P("cold")]
    view = ClusterView(workers=lambda: ws, inflight=Counter(), channel=lambda address: None,
                       cached_blocks=lambda ids, block_size: {"hot": len(ids) // block_size})
    context, stats = list(range(1600)), {w: PrefillStats(seconds_per_block=0.01) for w in ("hot", "cold")}

    def first_choice(req, progress):
        cached = credited_cache(view, req, progress, context, 16)
        return ids(rank_prefill(ws, 100, cached, stats, Counter(), spill_queue_s=10))[0], cached
    plain = ValidRequest("r", context, SamplingParams(), Slo(1.0, 0.1))
    scored = ValidRequest("r", context, SamplingParams(prompt_logprobs=0), Slo(1.0, 0.1))
    assert first_choice(plain, Progress()) == ("hot", {"hot": 100})        # 30 queued < 100 to compute
    assert first_choice(scored, Progress()) == ("cold", {})                # 100 + 30 on hot against 100
    migrated = Progress()
    migrated.generated.append(7)
    assert first_choice(scored, migrated) == ("hot", {"hot": 100})
    salted = ValidRequest("r", context, SamplingParams(cache_salt="tenant"), Slo(1.0, 0.1))
    assert first_choice(salted, migrated) == ("cold", {})      # its prefixes are cached apart, never indexed
