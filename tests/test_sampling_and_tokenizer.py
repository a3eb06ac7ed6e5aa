"""Sampling rules, reproducibility, and streaming detokenization."""

from __future__ import annotations

import pytest
import torch

from pdserve.model.config import ModelConfig
from pdserve.model.sampling import SamplingParams, sample
from pdserve.model.tokenizer import IncrementalDetokenizer, Tokenizer


def test_greedy_and_degenerate_filters_pick_the_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    top = logits.argmax(-1).tolist()
    assert sample(logits, [SamplingParams(temperature=0)] * 4, [0] * 4) == top
    assert sample(logits, [SamplingParams(temperature=1.0, top_k=1, seed=i) for i in range(4)], [0] * 4) == top
    assert sample(logits, [SamplingParams(temperature=1.0, top_p=1e-6, seed=i) for i in range(4)], [0] * 4) == top


def test_seeded_sampling_is_reproducible_and_index_dependent():
    logits = torch.zeros(1, 1000)
    p = SamplingParams(temperature=1.0, seed=42)
    assert sample(logits, [p], [3]) == sample(logits, [p], [3])
    draws = {sample(logits, [p], [i])[0] for i in range(20)}
    assert len(draws) > 10  # different output positions draw different noise


def test_sampling_follows_the_distribution():
    """Chi-square goodness of fit of 4,000 seeded draws from a 4-token distribution."""
    probs = torch.tensor([0.5, 0.25, 0.15, 0.10])
    logits = probs.log()[None]
    counts = torch.zeros(4)
    for i in range(4000):
        counts[sample(logits, [SamplingParams(temperature=1.0, seed=i)], [0])[0]] += 1
    expected = probs * 4000
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.27  # p = 0.001 critical value at 3 degrees of freedom


def test_top_k_and_top_p_never_pick_outside_the_kept_set():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs.log()[None]
    picks_k = {sample(logits, [SamplingParams(temperature=1.0, top_k=2, seed=i)], [0])[0] for i in range(300)}
    picks_p = {sample(logits, [SamplingParams(temperature=1.0, top_p=0.65, seed=i)], [0])[0] for i in range(300)}
    assert picks_k == {0, 1} and picks_p == {0, 1}


def test_min_p_keeps_the_tokens_within_its_fraction_of_the_likeliest_as_vllm_orders_it():
    """Min-p over the temperature-scaled distribution, then top-k and top-p (vLLM's order: its min-p logits
    processor runs before the top-k/top-p sampler); draws stay in the kept set and follow it; multi-step
    decoding (log-space draws) does not take such rows."""
    from pdserve.model.sampling import filtered_probs, log_space

    gen = torch.Generator().manual_seed(3)
    for _ in range(50):
        logits = torch.randn(200, generator=gen) * 3
        temperature, min_p = float(torch.rand(1, generator=gen)) * 2 + 0.1, float(torch.rand(1, generator=gen))
        top_k, top_p = int(torch.randint(0, 60, (1,), generator=gen)), float(torch.rand(1, generator=gen)) * 0.9 + 0.1
        probs = torch.softmax(logits / temperature, -1)             # the reference, step by step
        ref = (logits / temperature).masked_fill(probs < min_p * probs.max(), -torch.inf)
        if top_k:
            ref = ref.masked_fill(ref < ref.topk(top_k).values[-1], -torch.inf)
        ref = torch.softmax(ref, -1)
        ordered, order = ref.sort(descending=True)
        ref = ref.scatter(0, order, ordered.masked_fill(ordered.cumsum(0) - ordered >= top_p, 0.0))
        got = filtered_probs(logits, SamplingParams(temperature=temperature, min_p=min_p, top_k=top_k, top_p=top_p))
        torch.testing.assert_close(got / got.sum(), ref / ref.sum(), rtol=0, atol=1e-6)
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    p = SamplingParams(temperature=1.0, min_p=0.45, seed=0)
    picks = [sample(probs.log()[None], [SamplingParams(temperature=1.0, min_p=0.45, seed=i)], [0])[0]
             for i in range(2000)]
    assert set(picks) == {0, 1, 2} and abs(picks.count(0) / 2000 - 0.4 / 0.9) < 0.05   # 0.1 < 0.45 x 0.4: dropped
    assert not log_space(p) and log_space(SamplingParams(temperature=1.0, min_p=0.0))
    assert sample(probs.log()[None], [SamplingParams(temperature=1.0, min_p=1.0, seed=5)], [0]) == [0]


@pytest.mark.parametrize("field, value", [("temperature", -1.0), ("temperature", float("nan")), ("top_p", 0.0),
                                          ("top_p", 1.01), ("top_k", -1), ("max_tokens", 0), ("min_p", -0.1),
                                          ("min_p", 1.5), ("min_p", float("nan"))])
def test_invalid_params_are_named(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate(100)


def test_incremental_detokenizer_adds_up_to_the_full_text(model_dir):
    tok = Tokenizer(model_dir, ModelConfig.from_hf_dir(model_dir).bos_token_id)
    prompt = tok.encode("Once upon a time")
    assert prompt[0] == 1  # BOS, as the checkpoint asks
    out = tok.encode("there was a little dog named Max. He liked to eat ice-cream!")[1:]
    detok, text = IncrementalDetokenizer(tok, prompt), ""
    for t in out:
        text += detok.push([t])
    assert text == tok.decode(prompt + out)[len(tok.decode(prompt)):]


def test_temperature_draw_is_the_exponential_race_in_log_space():
    """Temperature-only rows (model.sampling.temperature_draw, also the multi-step C loop's rule) pick the
    token the exponential race over the softmax picks from the same noise: argmax(p / E) = argmax(log p - log E)."""
    from pdserve.model.sampling import draw, filtered_probs, log_noise, request_generator, temperature_draw

    logits = torch.randn(512, generator=torch.Generator().manual_seed(5)) * 3
    for temperature, top_k in ((0.5, 0), (1.0, 0), (2.0, 0), (1.0, 40), (2.0, 7), (1.5, 512)):
        p = SamplingParams(temperature=temperature, top_k=top_k)
        picks = [temperature_draw(logits, temperature, log_noise(seed, 7, 512), top_k) for seed in range(200)]
        assert picks == [draw(filtered_probs(logits, p), request_generator(seed, 7)) for seed in range(200)]
        assert len(set(picks)) > 5                  # it samples: not one argmax
        if top_k:
            assert set(picks) <= set(logits.topk(top_k).indices.tolist())


def test_special_tokens_are_left_out_of_text_by_id(model_dir):
    """The embedded tokenizer's special tokens are normalized (``▁<|end_story|>`` in its vocabulary), which
    ``tokenizers``' own skipping misses; they are left out by id, as transformers leaves them out."""
    from transformers import AutoTokenizer

    tok, hf = Tokenizer(model_dir, 1), AutoTokenizer.from_pretrained(model_dir)
    ids = tok.encode("Once upon a time")
    for with_special in ([*ids, 2], [1, *ids, 2, 0], [2]):
        assert tok.decode(with_special) == hf.decode(with_special, skip_special_tokens=True)
    assert tok.decode([*ids, 2]) == tok.decode(ids) and "end_story" not in tok.decode([*ids, 2])
    detok = IncrementalDetokenizer(tok, ids[:2])
    assert "".join(detok.push([t]) for t in [*ids[2:], 2]) == tok.decode(ids[2:])
