"""Adaptive speculation: per request, drafting stops while acceptance is low and resumes when it rises;
output stays the same as plain decoding."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.decode_worker.request import FinishedEvent, TokensEvent
from pdserve.decode_worker.speculative import AdaptiveSpeculation, Proposal
from pdserve.model.sampling import SamplingParams
from tests.conftest import hf_greedy
from tests.test_speculative import PROMPTS

UNPREDICTABLE = "Tom and Sam were friends. Tom and Sam liked to play. Tom and Sam went to the park. Tom and Sam"
REPETITIVE = "Tom said, \"I am sorry.\" Sue said, \"I am sorry.\" Tom said, \"I am sorry.\" Sue said,"


@pytest.fixture(scope="module")
def loaded(model_dir):
    from pdserve.model.config import ModelConfig
    from pdserve.model.loader import load_model
    from pdserve.model.tokenizer import Tokenizer

    model, cfg = load_model(model_dir)
    return model, cfg, Tokenizer(model_dir, ModelConfig.from_hf_dir(model_dir).bos_token_id)


def _generate(model_dir, loaded, prompts: list[list[int]], max_tokens: int, ignore_eos: bool = False,
              **flags) -> list[tuple[list[int], FinishedEvent]]:
    """Greedy, all prompts in one batch, on an in-process engine; (tokens, final event) per prompt."""
    from pdserve.decode_worker.config import DecodeWorkerConfig
    from pdserve.decode_worker.engine import DecodeEngine

    model, cfg, _ = loaded
    engine = DecodeEngine(DecodeWorkerConfig(model_dir=model_dir, worker_id="t", num_blocks=256, block_size=4,
                                             max_batch_size=8, spec_k=4, spec_max_batch_size=8, **flags), model, cfg)
    try:
        events: list[list] = [[] for _ in prompts]
        for i, p in enumerate(prompts):
            engine.add_local(f"r{i}", p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos),
                             events[i].append)
        for _ in range(4 * max_tokens):
            engine.step()
            if all(evs and not isinstance(evs[-1], TokensEvent) for evs in events):
                break
        assert engine.pool.num_free == engine.num_usable_blocks
        return [([t for ev in evs if isinstance(ev, TokensEvent) for t in ev.token_ids], evs[-1]) for evs in events]
    finally:
        engine.receiver.close()


@pytest.mark.parametrize("mode", ["ngram", "self"])
def test_greedy_output_with_adaptive_speculation_is_identical(mode, model_dir, loaded, hf_model):
    prompts = [loaded[2].encode(p) for p in [*PROMPTS, UNPREDICTABLE, REPETITIVE]]
    plain = _generate(model_dir, loaded, prompts, 40)
    adaptive = _generate(model_dir, loaded, prompts, 40, speculative=mode, spec_draft_layers=1)
    for p, (want, _), (got, fin) in zip(prompts, plain, adaptive):
        assert got == want == hf_greedy(hf_model, p, 40)
        assert isinstance(fin, FinishedEvent) and fin.num_accepted_tokens <= fin.num_draft_tokens


def test_drafting_turns_off_on_a_prompt_the_ngram_proposer_cannot_predict(model_dir, loaded):
    prompt = loaded[2].encode(UNPREDICTABLE)
    [(fixed, fixed_end)] = _generate(model_dir, loaded, [prompt], 120, ignore_eos=True, speculative="ngram",
                                     spec_adaptive=False)
    [(tokens, end)] = _generate(model_dir, loaded, [prompt], 120, ignore_eos=True, speculative="ngram")
    assert tokens == fixed and len(tokens) == 120
    assert fixed_end.num_draft_tokens > 0.5 * len(tokens)  # always drafting: a draft on most steps
    assert fixed_end.num_accepted_tokens < 0.3 * fixed_end.num_draft_tokens  # ... rarely accepted
    assert end.num_draft_tokens <= 0.05 * len(tokens)  # adaptive: (almost) never verifies a draft


def test_drafting_stays_on_with_high_acceptance_on_a_repetitive_prompt(model_dir, loaded):
    prompt = loaded[2].encode(REPETITIVE)
    [(tokens, end)] = _generate(model_dir, loaded, [prompt], 120, ignore_eos=True, speculative="ngram")
    assert len(tokens) == 120
    assert end.num_draft_tokens >= 0.5 * len(tokens)
    assert end.num_accepted_tokens >= 0.8 * end.num_draft_tokens


# ---- the rule alone --------------------------------------------------------------------------

class _Proposer:
    """Proposes ``tokens`` for every request (a stand-in for the n-gram lookup)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.calls = tokens, 0

    def propose(self, reqs, ks):
        self.calls += 1
        return [Proposal(self.tokens[:k]) for k in ks]


def test_real_probes_back_off_and_resume_when_acceptance_recovers():
    rule = AdaptiveSpeculation(min_acceptance=0.3, weight=0.5, interval=2, max_interval=8, shadow=False)
    req, prop = SimpleNamespace(attempt_id="a", output_ids=[5]), _Proposer([])
    assert rule.plan([req], [4], prop) == [4]  # starts drafting
    rule.observe(req, 4, 0)                    # nothing accepted: off
    ks = [rule.plan([req], [4], prop)[0] for _ in range(2)]
    assert ks == [0, 4]                        # probes after the interval
    rule.observe(req, 4, 0)                    # failed probe: interval doubles
    ks = [rule.plan([req], [4], prop)[0] for _ in range(4)]
    assert ks == [0, 0, 0, 4]
    rule.observe(req, 4, 4)                    # 0 -> 0.5: acceptance recovered, drafting again
    assert rule.plan([req], [4], prop) == [4] and rule.state(req).interval == 2
    assert rule.plan([req], [0], prop) == [0]  # nothing left to draft for (max_tokens, context)


def test_shadow_probes_cost_no_verification_and_turn_drafting_on_when_they_match():
    rule = AdaptiveSpeculation(min_acceptance=0.3, interval=4, max_interval=8)
    req = SimpleNamespace(attempt_id="a", output_ids=[5])
    assert rule.plan([req], [4], _Proposer([9, 9, 9, 9])) == [0]   # first step: a shadow proposal, not verified
    req.output_ids += [9, 7]                                         # plain decoding diverged at the second
    assert rule.plan([req], [4], _Proposer([])) == [0]
    assert rule.state(req).estimate == pytest.approx(0.25) and not rule.state(req).drafting
    assert rule.state(req).interval == 8                             # failed probe: backed off
    for _ in range(6):                                               # (that step was the first of 8)
        assert rule.plan([req], [4], _Proposer([])) == [0]
    matching = _Proposer([1, 2, 3, 4])
    assert rule.plan([req], [4], matching) == [0] and matching.calls == 1  # the 8th step probes
    req.output_ids += [1, 2, 3, 4]
    assert rule.plan([req], [4], _Proposer([])) == [4]               # all four matched: drafting now
    rule.forget(req)
    assert rule.state(req).estimate is None


def test_a_shadow_probe_that_proposes_nothing_is_repeated_at_the_next_step():
    rule = AdaptiveSpeculation(min_acceptance=0.3, interval=4, max_interval=8)
    req = SimpleNamespace(attempt_id="a", output_ids=[5])
    empty = _Proposer([])
    for step in range(3):                       # no n-gram match yet: a probe at every step, none verified
        assert rule.plan([req], [4], empty) == [0]
        assert empty.calls == step + 1
        req.output_ids.append(6)
    assert rule.state(req).estimate is None     # empty probes are not observations
    matching = _Proposer([1, 2])
    assert rule.plan([req], [4], matching) == [0] and matching.calls == 1
    req.output_ids += [1, 2]
    assert rule.plan([req], [4], empty) == [4]  # matched: drafting from the next step on


def test_a_good_probe_that_does_not_yet_lift_the_estimate_is_repeated_at_once():
    rule = AdaptiveSpeculation(min_acceptance=0.3, weight=0.3, interval=4, max_interval=32, shadow=False)
    req, prop = SimpleNamespace(attempt_id="a", output_ids=[5]), _Proposer([])
    rule.plan([req], [4], prop)
    rule.observe(req, 4, 0)                    # off, estimate 0
    assert [rule.plan([req], [4], prop)[0] for _ in range(4)] == [0, 0, 0, 4]
    rule.observe(req, 4, 3)                    # 0.75 at the probe, estimate 0.225: not yet, but again at once
    assert not rule.state(req).drafting and rule.state(req).interval == 4
    assert rule.plan([req], [4], prop) == [4]
    rule.observe(req, 4, 3)                    # 0.225 -> 0.3825: drafting again
    assert rule.state(req).drafting
