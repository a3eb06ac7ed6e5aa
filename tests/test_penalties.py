"""``min_tokens``, logit bias, the repetition, frequency and presence penalties, ``bad_words`` and
``allowed_token_ids`` (model/penalties.py): the row function against a reference written here from the
definitions; each bad value refused by name; greedy
tokens through the decode engine (local prefill, the decode graph, multi-step decoding and n-gram speculation
configured) equal to ``transformers`` generating with the same reference as its logits processor (and with its
``min_new_tokens``), beside a plain request in the same batches; and through a live cluster over HTTP (the
first token picked by the prefill worker, the rest by the decode worker), with 400s for bad values."""

from __future__ import annotations

import openai
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from pdserve.decode_worker.config import DecodeWorkerConfig
from pdserve.decode_worker.engine import DecodeEngine
from pdserve.decode_worker.request import FinishedEvent, TokensEvent
from pdserve.decode_worker.speculative import Proposal, verify
from pdserve.model.loader import load_model
from pdserve.model.penalties import penalize, penalize_rows_
from pdserve.model.sampling import SamplingParams, sample
from pdserve.model.sampling_types import MAX_LOGIT_BIAS
from pdserve.model.tokenizer import Tokenizer
from tests.conftest import CHAT_MODEL

PROMPT = [1, 415, 263, 931, 892, 727, 471, 263, 931]
PENALIZED = dict(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.25,
                 logit_bias=((263, 2.0), (13, -1.5)))   # values exact in float32: no rounding in either order


def reference(logits: torch.Tensor, prompt: list[int], output: list[int], presence: float, frequency: float,
              repetition: float, bias: dict[int, float]) -> torch.Tensor:
    """The four adjustments token by token, in vLLM's order (bias; repetition; frequency; presence)."""
    out = logits.float().clone()
    for t, b in bias.items():
        out[t] += b
    for t in set(prompt) | set(output):
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    for t in set(output):
        out[t] -= frequency * output.count(t)
        out[t] -= presence
    return out


class ReferenceProcessor(LogitsProcessor):
    """:func:`reference` as a ``transformers`` logits processor (the output: what follows the prompt)."""

    def __init__(self, prompt_len: int, **kw) -> None:
        self.prompt_len, self.kw = prompt_len, kw

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        ids = input_ids[0].tolist()
        return reference(scores[0], ids[:self.prompt_len], ids[self.prompt_len:], **self.kw).unsqueeze(0)


def _reference_kw(p: dict) -> dict:
    return dict(presence=p["presence_penalty"], frequency=p["frequency_penalty"],
                repetition=p["repetition_penalty"], bias=dict(p["logit_bias"]))


def hf_penalized(hf_model, prompt: list[int], n: int, **p) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                logits_processor=LogitsProcessorList([ReferenceProcessor(len(prompt),
                                                                                         **_reference_kw(p))]),
                                eos_token_id=None)
    return out[0, len(prompt):].tolist()


def test_penalize_equals_the_definition_and_leaves_its_input_alone():
    torch.manual_seed(0)
    logits = torch.randn(500) * 4
    before = logits.clone()
    prompt, output = torch.randint(0, 500, (40,)).tolist(), torch.randint(0, 60, (70,)).tolist()   # repeats
    p = SamplingParams(presence_penalty=-0.75, frequency_penalty=1.5, repetition_penalty=0.5,
                       logit_bias=((3, 100.0), (499, -100.0), (7, 0.25)))
    got = penalize(logits, p, prompt, output)
    assert torch.equal(got, reference(logits, prompt, output, -0.75, 1.5, 0.5, {3: 100.0, 499: -100.0, 7: 0.25}))
    assert torch.equal(logits, before) and not torch.equal(got, logits)
    # neutral values change nothing, and the sampler leaves unpenalized rows' logits as they are
    assert torch.equal(penalize(logits, SamplingParams(), prompt, output), logits)
    rows = torch.stack([logits, logits])
    plain, pen = SamplingParams(temperature=0), SamplingParams(temperature=0, logit_bias=((11, 100.0),))
    assert sample(rows, [plain, pen], [0, 0], [None, (prompt, output, ())]) == [int(logits.argmax()), 11]
    with pytest.raises(ValueError, match="token history"):
        sample(rows, [plain, pen], [0, 0])


def test_rows_penalized_together_equal_each_row_alone():
    """The batched form (one gather and scatter per adjustment over all rows) gives each row exactly what
    the row gets alone, whatever the other rows ask for."""
    torch.manual_seed(1)
    logits = torch.randn(4, 300) * 3
    params = [SamplingParams(frequency_penalty=0.5, logit_bias=((3, 1.0), (9, -2.0))),
              SamplingParams(repetition_penalty=1.5, min_tokens=4, max_tokens=8),
              SamplingParams(),                                                  # only in the batch
              SamplingParams(presence_penalty=-1.0, repetition_penalty=0.75, logit_bias=((3, 5.0),))]
    histories = [(torch.randint(0, 300, (n,)).tolist(), torch.randint(0, 40, (m,)).tolist(), {2, 7})
                 for n, m in ((5, 30), (50, 2), (0, 0), (1, 60))]
    together = penalize_rows_(logits.clone(), params, histories)
    for row in range(4):
        assert torch.equal(together[row], penalize(logits[row], params[row], *histories[row]))
    assert torch.equal(together[2], logits[2]) and together[1, 7] == -torch.inf


def test_allowed_tokens_and_bad_words_mask_as_defined():
    """Allowed tokens keep their logits, every other is -inf; a bad word's last token is -inf exactly where the
    output ends with the tokens before it (a one-token word everywhere); together with the other rows' fields."""
    torch.manual_seed(2)
    logits = torch.randn(64) * 3
    allowed = SamplingParams(allowed_token_ids=(5, 9, 40))
    got = penalize(logits, allowed, [1], [])
    assert (got > -torch.inf).nonzero().flatten().tolist() == [5, 9, 40] and torch.equal(got[[5, 9, 40]],
                                                                                         logits[[5, 9, 40]])
    bad = SamplingParams(bad_words=((7,), (3, 4, 11), (4, 12)))
    masked = {(): [7], (3,): [7], (3, 4): [7, 11, 12], (9, 4): [7, 12], (4, 3, 4): [7, 11, 12]}
    for output, expected in masked.items():
        got = penalize(logits, bad, [3, 4], list(output))        # the prompt's own ends do not count (vLLM)
        assert (got == -torch.inf).nonzero().flatten().tolist() == expected, output
        assert torch.equal(got[got > -torch.inf], logits[got > -torch.inf])
    both = SamplingParams(allowed_token_ids=(7, 8), bad_words=((7,),), logit_bias=((8, 1.0),))
    assert (penalize(logits, both, [], []) > -torch.inf).nonzero().flatten().tolist() == [8]
    histories = [([1], [3, 4], ()), ([1], [], ()), ([1], [], ())]
    rows = penalize_rows_(torch.stack([logits] * 3), [bad, allowed, SamplingParams()], histories)
    for row, p in enumerate((bad, allowed, SamplingParams())):
        assert torch.equal(rows[row], penalize(logits, p, *histories[row]))


@pytest.mark.parametrize("field, value, message", [
    ("presence_penalty", 2.5, "presence_penalty must be in"),
    ("frequency_penalty", float("nan"), "frequency_penalty must be in"),
    ("repetition_penalty", 0.0, "repetition_penalty must be"),
    ("repetition_penalty", float("inf"), "repetition_penalty must be"),
    ("repetition_penalty", 1e-40, "repetition_penalty must be"),    # would make positive logits +inf
    ("repetition_penalty", 101.0, "repetition_penalty must be"),
    ("logit_bias", ((5, 100.5),), "logit_bias values must be in"),
    ("logit_bias", ((5, float("nan")),), "logit_bias values must be in"),
    ("logit_bias", ((32000, 1.0),), "outside the vocabulary"),
    ("logit_bias", ((5, 1.0), (5, 2.0)), "repeats a token id"),
    ("logit_bias", tuple((t, 1.0) for t in range(MAX_LOGIT_BIAS + 1)), "at most"),
    ("min_tokens", 17, "min_tokens must be in"),                   # above max_tokens (16)
    ("min_tokens", -1, "min_tokens must be in"),
    ("allowed_token_ids", (5, 32000), "allowed_token_ids .* outside the vocabulary"),
    ("allowed_token_ids", tuple(range(4097)), "at most 4096"),
    ("bad_words", ((5,), ()), "1 to 64 tokens"),
    ("bad_words", ((5, 40000),), "bad_words token ids .* outside"),
    ("bad_words", ((5,),) * 257, "at most 256"),
])
def test_each_bad_value_is_refused_by_name(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value}).validate(32000)


def _run(engine: DecodeEngine, requests: dict[str, SamplingParams]) -> tuple[dict[str, list[int]], dict]:
    """Each request's tokens, and its finish event."""
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    finished, errors = {}, []

    def sink(rid):
        def on(ev):
            if isinstance(ev, TokensEvent):
                out[rid].extend(ev.token_ids)
            elif isinstance(ev, FinishedEvent):
                finished[rid] = ev
            else:
                errors.append(ev)
        return on
    for rid, sampling in requests.items():
        engine.add_local(rid, PROMPT, sampling, sink(rid))
    for _ in range(2000):
        engine.step()
        if not (engine.num_decoding or engine.num_prefilling):
            break
    assert not errors and finished.keys() == requests.keys()
    return out, finished


def _engine(model_dir: str, speculative: str) -> DecodeEngine:
    """A colocated engine on the embedded model: 64 blocks of 4 tokens, n-gram drafts of 3 when speculating."""
    model, cfg = load_model(model_dir)
    return DecodeEngine(DecodeWorkerConfig(model_dir=model_dir, worker_id="t", num_blocks=64, block_size=4,
                                           speculative=speculative, spec_adaptive=False, spec_k=3,
                                           spec_max_batch_size=4), model, cfg)


@pytest.mark.parametrize("speculative", ["off", "ngram"])
def test_engine_greedy_tokens_with_penalties_equal_transformers(model_dir, hf_model, speculative):
    engine = _engine(model_dir, speculative)
    n = 30
    try:
        # mild enough that the output still repeats: n-gram drafts are proposed and accepted under penalties
        mild = dict(presence_penalty=0.0, frequency_penalty=0.0625, repetition_penalty=1.03125,
                    logit_bias=((931, 1.0),))
        got, finished = _run(engine, {
            "penalized": SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **PENALIZED),
            "mild": SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **mild),
            "plain": SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)})
        assert got["penalized"] == hf_penalized(hf_model, PROMPT, n, **PENALIZED)
        assert got["mild"] == hf_penalized(hf_model, PROMPT, n, **mild)
        if speculative != "off":
            assert finished["mild"].num_accepted_tokens > 0
        plain = hf_penalized(hf_model, PROMPT, n, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                             logit_bias=())
        assert got["plain"] == plain and got["penalized"] != plain           # the penalties changed the text
        assert engine.pool.num_free == engine.num_usable_blocks
    finally:
        engine.receiver.close()


@pytest.mark.parametrize("speculative", ["off", "ngram"])
def test_engine_bad_words_and_allowed_tokens_equal_transformers(model_dir, hf_model, speculative):
    """Greedy tokens under bad words (one one-token word, one two-token word) and under an allowed set equal
    transformers' ``bad_words_ids`` and ``prefix_allowed_tokens_fn``, beside a plain request in the same batches."""
    engine = _engine(model_dir, speculative)
    n = 24
    try:
        plain, _ = _run(engine, {"p": SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)})
        words = ((plain["p"][4],), tuple(plain["p"][:2]))
        assert PROMPT[-1] != words[1][0]                         # the prompt's end is no prefix (vLLM: output only)
        allowed = tuple(sorted(set(plain["p"][::3]) | {13, 263, 931}))
        got, _ = _run(engine, {
            "bad": SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, bad_words=words),
            "allowed": SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, allowed_token_ids=allowed),
            "plain": SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)})
        kw = dict(max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None,
                  attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long))
        with torch.no_grad():
            want_bad = hf_model.generate(torch.tensor([PROMPT]), bad_words_ids=[list(w) for w in words], **kw)
            want_allowed = hf_model.generate(torch.tensor([PROMPT]), **kw,
                                             prefix_allowed_tokens_fn=lambda _b, _ids: list(allowed))
        assert got["bad"] == want_bad[0, len(PROMPT):].tolist() and got["plain"] == plain["p"]
        assert got["allowed"] == want_allowed[0, len(PROMPT):].tolist() and set(got["allowed"]) <= set(allowed)
        assert got["bad"] != plain["p"] and got["allowed"] != plain["p"] and words[0][0] not in got["bad"]
        assert engine.pool.num_free == engine.num_usable_blocks
    finally:
        engine.receiver.close()


def test_verification_penalizes_each_position_over_the_drafts_before_it():
    """Position j of a verify step is sampled as plain decoding would sample it after drafts 0 .. j - 1:
    draft A accepted at position 0 makes A pay the frequency penalty at position 1, where B then wins."""
    a, b = 7, 9
    logits = torch.zeros(3, 32)
    logits[0, a] = 1.0
    logits[1, a], logits[1, b] = 1.0, 0.9
    greedy = SamplingParams(temperature=0, frequency_penalty=0.5)
    assert verify(logits, Proposal([a, a]), greedy, 0, ([5], [], frozenset())) == [a, b]
    assert verify(logits, Proposal([a, a]), SamplingParams(temperature=0), 0) == [a, a, 0]   # unpenalized
    with pytest.raises(ValueError, match="token history"):
        verify(logits, Proposal([a, a]), greedy, 0)


def test_min_tokens_masks_the_stop_tokens_until_the_output_is_long_enough():
    logits = torch.zeros(16)
    logits[5] = 3.0
    p = SamplingParams(temperature=0, min_tokens=2)
    assert int(penalize(logits, p, [1], [], {5, 6}).argmax()) != 5
    assert penalize(logits, p, [1], [9], {5, 6})[[5, 6]].tolist() == [-float("inf")] * 2
    assert torch.equal(penalize(logits, p, [1], [9, 9], {5, 6}), logits)          # two output tokens: free


@pytest.mark.parametrize("speculative", ["off", "ngram"])
def test_engine_min_tokens_equals_transformers_min_new_tokens(model_dir, hf_model, speculative):
    """A stop token that greedy decoding reaches at its third token: with min_tokens 12 it is passed over until
    12 tokens are out (transformers: ``min_new_tokens`` with that token as EOS), then ends the request."""
    model, cfg = load_model(model_dir)
    engine = DecodeEngine(DecodeWorkerConfig(model_dir=model_dir, worker_id="t", num_blocks=64, block_size=4,
                                             speculative=speculative, spec_adaptive=False, spec_max_batch_size=4),
                          model, cfg)
    try:
        plain, _ = _run(engine, {"p": SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)})
        stop = plain["p"][2]
        got, _ = _run(engine, {"m": SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, min_tokens=12,
                                                   stop_token_ids=(stop,))})
        with torch.no_grad():
            want = hf_model.generate(torch.tensor([PROMPT]), max_new_tokens=40, do_sample=False, min_new_tokens=12,
                                     eos_token_id=[stop], pad_token_id=0,
                                     attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long))[0, len(PROMPT):]
        assert got["m"] == want.tolist() and len(got["m"]) > 12 and stop not in got["m"][:12]
    finally:
        engine.receiver.close()


@pytest.fixture
def cl(http_cluster):
    yield http_cluster
    http_cluster.assert_pools_free()


def test_http_penalties_and_logit_bias_through_the_cluster(cl, hf_model, chat_model_dir):
    api = openai.OpenAI(base_url=f"http://{cl.router.http_address}/v1", api_key="unused", max_retries=0)
    text = "Once upon a time, there was a little dog"
    prompt = Tokenizer(chat_model_dir, 1).encode(text)
    got = api.completions.create(
        model=CHAT_MODEL, prompt=text, max_tokens=20, temperature=0, presence_penalty=0.5, frequency_penalty=0.25,
        logit_bias={"263": 2.0, "13": -1.5},
        extra_body={"repetition_penalty": 1.25, "ignore_eos": True, "return_token_ids": True})
    assert got.choices[0].token_ids == hf_penalized(hf_model, prompt, 20, **PENALIZED)
    # a bias of 100 decides every token, the prefill worker's first one and the decode worker's after it
    forced = api.completions.create(model=CHAT_MODEL, prompt=text, max_tokens=4, temperature=0.9, seed=3,
                                    logit_bias={"500": 100}, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert forced.choices[0].token_ids == [500] * 4
    # min_tokens passes over the stop token greedy decoding picks first (the prefill worker's token), and
    # over the stop string of its text
    first = api.completions.create(model=CHAT_MODEL, prompt=text, max_tokens=1, temperature=0,
                                   extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0]
    for stops in ({"stop_token_ids": first.token_ids}, {"stop": [first.text.strip()]}):
        held = api.completions.create(model=CHAT_MODEL, prompt=text, max_tokens=6, temperature=0,
                                      extra_body={"min_tokens": 6, "ignore_eos": True, "return_token_ids": True,
                                                  **stops}).choices[0]
        assert len(held.token_ids) == 6 and held.finish_reason == "length", stops
        assert held.token_ids[0] != first.token_ids[0] or "stop" in stops
    for bad, param in (({"presence_penalty": 2.5}, "presence_penalty"), ({"logit_bias": {"dog": 1}}, "logit_bias"),
                       ({"logit_bias": {"5": 101}}, "logit_bias"), ({"extra_body": {"repetition_penalty": 0}},
                                                                    "repetition_penalty"),
                       ({"extra_body": {"min_tokens": 3}}, "min_tokens"),        # more than max_tokens (2)
                       ({"logit_bias": {"1_0": 1}}, "logit_bias"),                 # int() would read 10
                       ({"logit_bias": {"10": 1, "010": 2}}, "logit_bias")):      # one token twice
        with pytest.raises(openai.BadRequestError, match=param):
            api.completions.create(model=CHAT_MODEL, prompt=text, max_tokens=2, **bad)


def test_http_bad_words_and_allowed_tokens_through_the_cluster(cl, hf_model, chat_model_dir):
    """vLLM's ``bad_words`` (strings, tokenized by the router in both spellings) and ``allowed_token_ids``, the
    prefill worker's first token and the decode worker's after it: equal to transformers under the same ids."""
    from pdserve.router.validation import bad_word_ids

    api = openai.OpenAI(base_url=f"http://{cl.router.http_address}/v1", api_key="unused", max_retries=0)
    tok = Tokenizer(chat_model_dir, 1)
    text = "Once upon a time, there was a little dog"
    prompt = tok.encode(text)
    ask = dict(model=CHAT_MODEL, prompt=text, max_tokens=16, temperature=0)
    plain = api.completions.create(**ask, extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0]
    word = plain.text.split()[0]                                  # the first word greedy decoding writes
    got = api.completions.create(**ask, extra_body={"ignore_eos": True, "return_token_ids": True,
                                                    "bad_words": [word]}).choices[0]
    ids = bad_word_ids([word], tok)
    kw = dict(max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None,
              attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    with torch.no_grad():
        want = hf_model.generate(torch.tensor([prompt]), bad_words_ids=[list(w) for w in ids], **kw)
    # (this tokenizer prepends "▁" to a word's first piece, so a word's ids rarely follow text mid-answer;
    # tests/test_http_tools.py bans a word the answer writes)
    assert got.token_ids == want[0, len(prompt):].tolist()
    allowed = [263, 931, 13, 500]
    only = api.completions.create(**ask, extra_body={"ignore_eos": True, "return_token_ids": True,
                                                     "allowed_token_ids": allowed}).choices[0]
    assert set(only.token_ids) <= set(allowed) and len(only.token_ids) == 16
    for bad, param in (({"allowed_token_ids": [5, 10 ** 6]}, "allowed_token_ids"), ({"bad_words": [" "]}, "bad_words"),
                       ({"bad_words": ["dog"], "structured_outputs": {"choice": ["a"]}}, "bad_words")):
        with pytest.raises(openai.BadRequestError, match=param):
            api.completions.create(**ask, extra_body=bad)
