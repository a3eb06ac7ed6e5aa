"""The decode engine in process: local prefill, continuous batching, and a failing step."""

from __future__ import annotations

import grpc

from pdserve.decode_worker.request import ErrorEvent, FinishedEvent, TokensEvent
from pdserve.model.sampling import SamplingParams
from tests.conftest import hf_greedy


def _run(engine, requests: dict[str, list[int]], max_tokens: int, steps: int = 200) -> dict[str, list]:
    events: dict[str, list] = {rid: [] for rid in requests}
    for rid, prompt in requests.items():
        engine.add_local(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens), events[rid].append)
    for _ in range(steps):
        engine.step()
        if all(evs and not isinstance(evs[-1], TokensEvent) for evs in events.values()):
            break
    return events


def test_chunked_local_prefill_mixed_with_decodes_matches_transformers(engine, hf_model):
    prompts = {"a": [1, 400, 500, 600], "b": list(range(1, 30)), "c": [1, 1094], "d": [1, 7, 8, 9, 10, 11],
               "e": [1, 300]}  # five requests, batch bound 4: one waits a step
    events = _run(engine, prompts, max_tokens=12)
    for rid, prompt in prompts.items():
        tokens = [t for ev in events[rid] if isinstance(ev, TokensEvent) for t in ev.token_ids]
        assert tokens == hf_greedy(hf_model, prompt, 12), rid
        assert isinstance(events[rid][-1], FinishedEvent)
    assert engine.pool.num_free == engine.num_usable_blocks


def test_a_failing_step_fails_the_batch_and_frees_its_blocks(engine, monkeypatch):
    """The engine loop survives an exception in a step: the batch ends with INTERNAL, blocks come back."""
    import threading

    done = threading.Event()
    events: list = []

    def emit(ev):
        events.append(ev)
        if not isinstance(ev, TokensEvent):
            done.set()

    monkeypatch.setattr(engine.graph, "run", lambda steps: (_ for _ in ()).throw(RuntimeError("boom")))
    stop = threading.Event()
    loop = threading.Thread(target=engine.run_forever, args=(stop,))
    loop.start()
    try:
        engine.add_local("x", [1, 2, 3], SamplingParams(temperature=0, max_tokens=50), emit)
        assert done.wait(10)
        assert isinstance(events[-1], ErrorEvent) and events[-1].code == grpc.StatusCode.INTERNAL
        assert engine.pool.num_free == engine.num_usable_blocks
    finally:
        stop.set()
        loop.join(10)


def test_a_first_token_outside_the_vocabulary_fails_only_its_request(engine):
    """A KV sender's ``done`` carrying a first token outside the vocabulary ends that request with
    UNAVAILABLE and frees its blocks; a request decoding beside it finishes normally."""
    from pdserve.decode_worker.request import KVArrived

    events: dict[str, list] = {"bad": [], "good": []}
    engine.add_request("bad", [1, 400, 500], SamplingParams(temperature=0, max_tokens=4), 30.0,
                       events["bad"].append)
    engine.add_local("good", [1, 400, 500], SamplingParams(temperature=0, max_tokens=4), events["good"].append)
    engine._inbox.put(KVArrived("bad", engine.model_cfg.vocab_size))  # as the receiver's on_complete would
    for _ in range(50):
        engine.step()
        if all(evs and not isinstance(evs[-1], TokensEvent) for evs in events.values()):
            break
    assert isinstance(events["bad"][-1], ErrorEvent) and events["bad"][-1].code == grpc.StatusCode.UNAVAILABLE
    assert "outside the vocabulary" in events["bad"][-1].message
    assert isinstance(events["good"][-1], FinishedEvent)
    assert engine.pool.num_free == engine.num_usable_blocks
