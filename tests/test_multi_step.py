"""Multi-step decoding in the engine (:mod:`decode_worker.multi_step`, ``pd_decode_graph_steps``): greedy and
sampled rows (temperature, top-k) run several steps per C call with the tokens, stop handling and block
accounting of single steps; top-p rows, log-probabilities and a zero window keep single steps; work
posted by another thread ends a run after the step in progress."""

from __future__ import annotations

import threading

import pytest

from pdserve.decode_worker.config import DecodeWorkerConfig
from pdserve.decode_worker.engine import DecodeEngine
from pdserve.decode_worker.request import FinishedEvent, TokensEvent
from pdserve.decode_worker.server import load_decode_model
from pdserve.kernels.cpu.decode_stack import stack_available
from pdserve.model.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not stack_available(bf16_packed=True), reason="no C compiler or no AVX2")
PROMPTS = {"a": [1, 400, 500, 600], "b": list(range(1, 30)), "c": [1, 1094]}


def _engine(model_dir: str, **over) -> DecodeEngine:
    cfg = DecodeWorkerConfig(model_dir=model_dir, worker_id="t", dtype="bfloat16", num_blocks=128, block_size=4,
                             max_batch_size=4, colocated=True, max_num_batched_tokens=64, **over)
    model, model_cfg = load_decode_model(cfg)
    return DecodeEngine(cfg, model, model_cfg)


class _Calls:
    """Counts the engine's multi-step C runs and the steps each returned (the real call, wrapped)."""

    def __init__(self, engine: DecodeEngine, before=None) -> None:
        self.steps: list[int] = []
        self._run, self._before = engine.graph.run_steps, before
        engine.graph.run_steps = self

    def __call__(self, *args, **kwargs):
        if self._before is not None:
            self._before()
        rows = self._run(*args, **kwargs)
        self.steps.append(len(rows[0]))
        return rows


def _generate(engine: DecodeEngine, params: dict[str, SamplingParams], steps: int = 400) -> dict[str, list]:
    events: dict[str, list] = {rid: [] for rid in params}
    for rid, p in params.items():
        engine.add_local(rid, PROMPTS[rid], p, events[rid].append)
    for _ in range(steps):
        engine.step()
        if all(evs and not isinstance(evs[-1], TokensEvent) for evs in events.values()):
            break
    return events


def _tokens(events: list) -> list[int]:
    return [t for ev in events if isinstance(ev, TokensEvent) for t in ev.token_ids]


@pytest.fixture(scope="module")
def reference(model_dir) -> dict[str, list[int]]:
    """Each prompt's 40 greedy tokens from single steps (multi-step off)."""
    engine = _engine(model_dir, multi_step=1)
    try:
        events = _generate(engine, {rid: SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
                                    for rid in PROMPTS})
        return {rid: _tokens(evs) for rid, evs in events.items()}
    finally:
        engine.receiver.close()


@pytest.fixture
def engine(model_dir):
    e = _engine(model_dir, multi_step=8, multi_step_window_s=1.0)
    yield e
    e.receiver.close()


def test_greedy_rows_run_several_steps_a_call_with_the_tokens_of_single_steps(engine, reference):
    calls = _Calls(engine)
    events = _generate(engine, {rid: SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
                                for rid in PROMPTS})
    for rid, evs in events.items():
        assert _tokens(evs) == reference[rid], rid
        assert isinstance(evs[-1], FinishedEvent) and evs[-1].reason == "length" and evs[-1].num_output_tokens == 40
    assert calls.steps and max(calls.steps) == 8                    # the window allows the cap
    assert sum(calls.steps) >= 30                                   # most tokens came from multi-step runs
    assert engine.pool.num_free == engine.num_usable_blocks


def test_a_run_never_passes_max_tokens_and_stops_at_a_stop_token(engine, reference):
    stop = reference["b"][12]
    first = reference["b"].index(stop)
    calls = _Calls(engine)
    events = _generate(engine, {"a": SamplingParams(temperature=0, max_tokens=11, ignore_eos=True),
                                "b": SamplingParams(temperature=0, max_tokens=40, stop_token_ids=(stop,))})
    assert _tokens(events["a"]) == reference["a"][:11] and events["a"][-1].reason == "length"
    assert _tokens(events["b"]) == reference["b"][:first + 1] and events["b"][-1].reason == "stop"
    assert calls.steps and max(calls.steps) <= 10                   # "a" has 10 tokens left after its first
    assert engine.pool.num_free == engine.num_usable_blocks


def test_sampled_rows_run_several_steps_a_call_with_the_tokens_of_single_steps(engine, model_dir):
    params = {"a": SamplingParams(temperature=0.8, seed=3, max_tokens=30, ignore_eos=True),
              "b": SamplingParams(temperature=1.7, seed=4, top_k=8, max_tokens=30, ignore_eos=True),
              "c": SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)}
    single = _engine(model_dir, multi_step=1)
    try:
        want = {rid: _tokens(evs) for rid, evs in _generate(single, params).items()}
    finally:
        single.receiver.close()
    calls = _Calls(engine)
    got = {rid: _tokens(evs) for rid, evs in _generate(engine, params).items()}
    assert got == want
    assert max(calls.steps) == 8 and sum(calls.steps) >= 20
    assert engine.pool.num_free == engine.num_usable_blocks


def test_top_p_and_logprobs_keep_single_steps(engine, reference):
    calls = _Calls(engine)
    events = _generate(engine, {"b": SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=12,
                                                    ignore_eos=True),
                                "c": SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)})
    assert calls.steps == []
    assert _tokens(events["c"]) == reference["c"][:12]
    assert all(ev.logprobs is not None and len(ev.logprobs) == len(ev.token_ids)
               for ev in events["c"][1:-1])


def test_a_zero_window_keeps_single_steps(model_dir, reference):
    engine = _engine(model_dir, multi_step=8, multi_step_window_s=0.0)
    try:
        calls = _Calls(engine)
        events = _generate(engine, {"b": SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)})
        assert calls.steps == [] and _tokens(events["b"]) == reference["b"][:20]
    finally:
        engine.receiver.close()


def test_work_posted_during_a_run_ends_it_after_one_step(engine, reference):
    """Another thread adds a request while the C loop runs (the wrapper lets it in just before the call):
    the run returns after one step, the new request joins at the next step, both get their tokens."""
    events: dict[str, list] = {"a": [], "c": []}
    posted = threading.Event()

    def add_c() -> None:
        engine.add_local("c", PROMPTS["c"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                         events["c"].append)
        posted.set()

    def post_once() -> None:
        if not posted.is_set():
            worker = threading.Thread(target=add_c)
            worker.start()
            worker.join(10)            # posted after the step began: only the interrupt flag can end the run

    calls = _Calls(engine, before=post_once)
    engine.add_local("a", PROMPTS["a"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                     events["a"].append)
    for _ in range(400):
        engine.step()
        if all(evs and not isinstance(evs[-1], TokensEvent) for evs in events.values()):
            break
    assert calls.steps[0] == 1 and max(calls.steps) > 1
    assert _tokens(events["a"]) == reference["a"] and _tokens(events["c"]) == reference["c"][:20]
    assert engine.pool.num_free == engine.num_usable_blocks


def test_config_refuses_bad_multi_step_settings():
    for over in ({"multi_step": 0}, {"multi_step_window_s": -0.1}, {"multi_step_window_s": float("nan")}):
        with pytest.raises(ValueError, match="multi_step"):
            DecodeWorkerConfig(model_dir="m", worker_id="w", **over)


def test_plan_steps_follows_the_window_the_rows_and_the_noise_budget():
    from pdserve.cluster.lifecycle import RequestState
    from pdserve.decode_worker.multi_step import MAX_NOISE_BYTES, plan_steps
    from pdserve.decode_worker.request import DecodeRequest

    def req(**sampling) -> DecodeRequest:
        return DecodeRequest("r", [1, 2], SamplingParams(**{"max_tokens": 100, **sampling}), frozenset(), 512, [0],
                             lambda ev: None, RequestState.DECODING, output_ids=[5])

    cfg = DecodeWorkerConfig(model_dir="m", worker_id="w", multi_step=8, multi_step_window_s=0.025)
    greedy = [req(temperature=0), req(temperature=0)]
    assert plan_steps(cfg, greedy, (2, 10, 0.005), 2048) == 5                  # 25 ms / 5 ms
    assert plan_steps(cfg, greedy, (2, 10, 0.001), 2048) == 8                  # the cap
    assert plan_steps(cfg, greedy, (2, 10, 0.030), 2048) == 1                  # one step is past the window
    assert plan_steps(cfg, greedy, (1, 10, 0.001), 2048) == 1                  # a larger batch: measure first
    assert plan_steps(cfg, greedy, (2, 10, 0.0), 2048) == 1                    # no step measured yet
    assert plan_steps(cfg, greedy[:1], (2, 10, 0.001), 2048) == 8              # a smaller batch: an overestimate
    assert plan_steps(cfg, [req(temperature=0, max_tokens=4)], (1, 10, 0.001), 2048) == 3   # 3 tokens left
    assert plan_steps(cfg, [req(temperature=0.7)], (1, 10, 0.001), 2048) == 8
    wide = MAX_NOISE_BYTES // (4 * 3 * 2)                                     # a vocabulary where 3 steps fit
    assert plan_steps(cfg, [req(temperature=0.7), req(temperature=0)], (2, 10, 0.001), wide) == 3
    assert plan_steps(cfg, [req(temperature=0.7, top_k=5)], (1, 10, 0.001), 2048) == 8
    for other in ({"temperature": 0.7, "top_p": 0.9}, {"temperature": 0, "logprobs": 1}):
        assert plan_steps(cfg, [req(temperature=0), req(**other)], (2, 10, 0.001), 2048) == 1
    assert plan_steps(DecodeWorkerConfig(model_dir="m", worker_id="w", multi_step=1), greedy, (2, 10, 0.001), 2048) == 1
