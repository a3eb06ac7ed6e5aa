"""The decode engine's KV blocks taken as requests grow, and recompute preemption when the pool runs short."""

from __future__ import annotations

import pytest

from pdserve.cluster.lifecycle import RequestState
from pdserve.decode_worker.request import FinishedEvent, TokensEvent
from pdserve.model.kv_cache import NoFreeBlocks
from pdserve.model.sampling import SamplingParams
from tests.conftest import hf_greedy


def _hf_greedy_through_eos(model, prompt_ids: list[int], n: int) -> list[int]:
    """``transformers``' argmax tokens, ``n`` of them, EOS included and not stopping (``ignore_eos``)."""
    import torch

    seq = list(prompt_ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt_ids):]


@pytest.fixture
def small_engine(model_dir, request):
    """A colocated engine on the embedded model, 4-token blocks; ``request.param``: (num_blocks, multi_step) and
    optionally a dict of more config fields."""
    from pdserve.decode_worker.config import DecodeWorkerConfig
    from pdserve.decode_worker.engine import DecodeEngine
    from pdserve.model.loader import load_model

    num_blocks, multi_step, *more = request.param
    model, cfg = load_model(model_dir)
    e = DecodeEngine(DecodeWorkerConfig(model_dir=model_dir, worker_id="t", num_blocks=num_blocks, block_size=4,
                                        max_batch_size=4, colocated=True, max_num_batched_tokens=8,
                                        multi_step=multi_step, **(more[0] if more else {})), model, cfg)
    yield e
    e.receiver.close()


def _add(engine, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list]:
    events: dict[str, list] = {rid: [] for rid in prompts}
    for rid, prompt in prompts.items():
        engine.add_local(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens), events[rid].append)
    return events


def _done(events: dict[str, list]) -> bool:
    return all(evs and not isinstance(evs[-1], TokensEvent) for evs in events.values())


def _tokens(evs: list) -> list[int]:
    return [t for ev in evs if isinstance(ev, TokensEvent) for t in ev.token_ids]


@pytest.mark.parametrize("small_engine", [(64, 1)], indirect=True)
def test_a_request_holds_the_blocks_of_its_context_and_one_more_as_it_crosses_a_boundary(small_engine):
    e = small_engine
    events = _add(e, {"a": [1, 400, 500, 600, 700]}, max_tokens=30)   # up front: 5 + 29 positions, 9 blocks
    held = []
    for _ in range(100):
        if _done(events):
            break
        e.step()
        req = e._requests.get("a")
        if req is not None and req.state is RequestState.DECODING:
            # exactly the blocks of the positions written so far, [0, num_tokens - 1) (after the prefill: the
            # prompt's 5 and the next token's); the step that writes position num_tokens - 1 takes its block
            assert len(req.block_table) == e.spec.num_blocks_for(req.num_tokens - 1), req.num_tokens
            assert e.pool.num_allocated == len(req.block_table) + (e.graph is not None)
            held.append(len(req.block_table))
    assert held[0] == 2 and held[-1] == 9 and held == sorted(held)
    assert isinstance(events["a"][-1], FinishedEvent) and len(_tokens(events["a"])) == 30
    assert e.pool.num_free == e.num_usable_blocks


@pytest.mark.parametrize("small_engine", [(12, 8), (12, 1), (12, 1, {"speculative": "ngram", "spec_max_batch_size": 4,
                                                                   "spec_adaptive": False})], indirect=True)
def test_requests_beyond_the_pool_are_preempted_and_recomputed_token_exact(small_engine, hf_model):
    """11 usable blocks of 4 tokens; three requests need 5 each at their end (6-token prompt, 14 new tokens),
    so up front two would have been admitted; all three run, the latest is preempted and prefilled again
    (with multi-step runs, single steps, and n-gram drafts, whose blocks are taken ahead)."""
    e = small_engine
    prompts = {"a": [1, 400, 500, 600, 700, 800], "b": [1, 7, 8, 9, 10, 11], "c": [1, 300, 301, 302, 303, 304]}
    events = _add(e, prompts, max_tokens=14)
    for _ in range(300):
        e.step()
        held = sum(len(r.block_table) for r in e._requests.values())
        assert e.pool.num_allocated == held + (e.graph is not None)      # exact accounting at every step
        if _done(events):
            break
    assert e.num_preemptions >= 1 and e.num_preempted == 0
    for rid, prompt in prompts.items():
        assert isinstance(events[rid][-1], FinishedEvent), (rid, events[rid][-1])
        assert _tokens(events[rid]) == hf_greedy(hf_model, prompt, 14), rid
    assert e.pool.num_free == e.num_usable_blocks and not e._requests
    assert e.proposer is None or sum(evs[-1].num_draft_tokens for evs in events.values()) > 0


@pytest.mark.parametrize("small_engine", [(12, 8)], indirect=True)
def test_a_request_that_can_never_fit_is_refused_and_new_ones_wait_for_the_preempted(small_engine):
    e = small_engine
    with pytest.raises(NoFreeBlocks, match="more than this worker's 11"):
        _add(e, {"big": [1, 2, 3]}, max_tokens=60)                     # 62 positions: 16 blocks
    assert e.pool.num_free == e.num_usable_blocks
    events = _add(e, {"a": [1, 400, 500, 600, 700, 800], "b": [1, 7, 8, 9, 10, 11],
                      "c": [1, 300, 301, 302, 303, 304]}, max_tokens=14)
    for _ in range(100):
        if e.num_preempted:
            break
        e.step()
    assert not _done(events)
    preempted = e._requests["c"]                                       # the latest admitted
    assert preempted.state is RequestState.PREFILLING and not preempted.block_table
    with pytest.raises(NoFreeBlocks, match="preempted requests are waiting"):
        _add(e, {"late": [1, 2]}, max_tokens=2)
    e.abort("c")
    e.step()
    assert e.num_preempted == 0 and "c" not in e._requests
    for _ in range(100):
        if _done({k: events[k] for k in ("a", "b")}):
            break
        e.step()
    late = _add(e, {"late": [1, 2]}, max_tokens=2)                    # admitted again
    for _ in range(20):
        if _done(late):
            break
        e.step()
    assert isinstance(late["late"][-1], FinishedEvent) and len(_tokens(late["late"])) == 2
    assert e.pool.num_free == e.num_usable_blocks


def test_a_decode_worker_serves_more_than_its_pool_holds_up_front_through_the_cluster(redis_url, model_dir, hf_model):
    """A decode worker of 8 usable 16-token blocks, six concurrent requests of 67 positions (5 blocks each at
    their end: up front, one at a time would have fit): every stream ends with transformers' greedy tokens, the
    worker preempted some and every block comes back. Refusals while preempted requests wait are
    RESOURCE_EXHAUSTED, which the clients retry as a client of an overloaded server would."""
    import asyncio
    import threading

    import grpc

    from pdserve.bench.common import worker_metric
    from pdserve.deploy import client
    from tests.clusters import Cluster

    prompts = [[1, 400 + 37 * i, 500, 600 + i, 700, 800, 9, 10] for i in range(6)]
    c = Cluster(model_dir, redis_url, decode_flags={"num_blocks": 9})
    try:
        results: dict[int, list[int]] = {}
        refused = []

        def run(i: int) -> None:
            async def go():
                async with grpc.aio.insecure_channel(c.address) as ch:
                    while True:
                        try:
                            return await client.complete(ch, client.make_request(
                                prompts[i], max_tokens=60, temperature=0.0, ignore_eos=True), timeout_s=60)
                        except grpc.aio.AioRpcError as exc:
                            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                                raise
                            refused.append(i)
                            await asyncio.sleep(0.05)
            results[i] = asyncio.run(go()).token_ids

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for i, prompt in enumerate(prompts):
            assert results[i] == _hf_greedy_through_eos(hf_model, prompt, 60), i
        c.assert_pools_free()
        address = next(w for w in c.state().workers if w.role == "decode").metrics_address
        preempted = worker_metric(address, "num_preemptions_total")
        assert preempted >= 1, (preempted, len(refused))
        with pytest.raises(grpc.RpcError) as err:       # 8 + 200 tokens: no worker's pool could ever hold it
            c.complete(prompts[0], max_tokens=200, temperature=0.0)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "KV pool" in err.value.details()
    finally:
        c.stop()


@pytest.mark.parametrize("small_engine", [(12, 1)], indirect=True)
def test_with_priorities_the_lowest_priority_request_is_preempted(small_engine, hf_model):
    """vLLM's priority policy: the first admitted request, with the highest ``priority`` value, is the one
    preempted (not the latest, as with equal priorities), and every answer is still token-exact."""
    e = small_engine
    prompts = {"a": [1, 400, 500, 600, 700, 800], "b": [1, 7, 8, 9, 10, 11], "c": [1, 300, 301, 302, 303, 304]}
    events: dict[str, list] = {rid: [] for rid in prompts}
    for rid, prompt in prompts.items():
        e.add_local(rid, prompt, SamplingParams(temperature=0, max_tokens=14, priority=5 if rid == "a" else 0),
                    events[rid].append)
    victims = []
    for _ in range(300):
        before = e.num_preemptions
        e.step()
        if e.num_preemptions > before:
            victims += [r.attempt_id for r in e._requests.values()
                        if r.state is RequestState.PREFILLING and not r.block_table]
        if _done(events):
            break
    assert victims and set(victims) == {"a"}
    for rid, prompt in prompts.items():
        assert _tokens(events[rid]) == hf_greedy(hf_model, prompt, 14), rid
    assert e.pool.num_free == e.num_usable_blocks
