"""Structured output (model/structured.py): answers held to a JSON Schema by xgrammar's token masks, through a
prefill worker's first token and a decode worker's steps (and a colocated worker's), token-exact against
``transformers`` greedy decoding under the same masks; sampled answers always valid; refusals by name. Over the
HTTP API: test_structured_output_http.py."""

from __future__ import annotations

import json
import re

import grpc
import pytest
import torch

from pdserve.deploy import client
from pdserve.model.structured import Grammars
from pdserve.model.tokenizer import Tokenizer
from pdserve.proto import pdserve_pb2
from tests.clusters import Cluster, colocated_cluster
from tests.conftest import CHATML
from tests.scripted_model import JSON_TOKENS, json_capable_model
from tests.structured_cases import CHOICES, EBNF, PROMPT, REGEX, SCHEMA, valid

pytestmark = pytest.mark.timeout(240)

def run(c: Cluster, req: pdserve_pb2.GenerateRequest) -> client.Completion:
    return c.run(lambda channel: client.complete(channel, req, timeout_s=60))


@pytest.fixture(scope="module")
def json_dir(tmp_path_factory) -> str:
    return str(json_capable_model(tmp_path_factory.mktemp("json") / "tinystories-json", CHATML))


@pytest.fixture(scope="module")
def vocab(json_dir) -> int:
    return json.loads(open(f"{json_dir}/config.json").read())["vocab_size"]


@pytest.fixture(scope="module")
def cluster(redis_url, json_dir):
    c = Cluster(json_dir, redis_url, dtype="float32", router_flags={"http_port": 0})
    yield c
    c.stop()


@pytest.fixture(scope="module")
def colocated(redis_url, json_dir):
    c = colocated_cluster(json_dir, redis_url, max_num_batched_tokens=8, dtype="float32")
    yield c
    c.stop()


def constrained(prompt, schema=SCHEMA, **kw) -> pdserve_pb2.GenerateRequest:
    req = client.make_request(prompt, **kw)
    req.sampling.structured_output.json_schema = json.dumps(schema)
    return req


def reference(json_dir: str, vocab: int, prompt: list[int], max_tokens: int,
              spec: tuple[str, str] = ("json_schema", json.dumps(SCHEMA)), start_after: list[int] = ()) -> list[int]:
    """``transformers`` greedy decoding with every step's logits masked by the grammar of ``spec`` (from the
    token after ``start_after``, when given)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(json_dir, dtype=torch.float32).eval()
    constraint = Grammars(json_dir, vocab, [2]).constraint(spec, start_after=start_after)
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_tokens):
            token = int(constraint.mask(model(torch.tensor([ids])).logits[0, -1]).argmax())
            constraint.accept(token)
            out.append(token)
            ids.append(token)
            if token == 2:
                break
    return out


def test_grammar_masks_hold_sampling_to_the_schema(json_dir, vocab):
    grammars, tok = Grammars(json_dir, vocab, [2]), Tokenizer(json_dir, 1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):                       # random logits, sampled: every answer valid and ended
        c, out = grammars.constraint(("json_schema", json.dumps(SCHEMA))), []
        while not c.done:
            probs = torch.softmax(c.mask(torch.randn(vocab, generator=gen) * 3), dim=-1)
            out.append(int(torch.multinomial(probs, 1, generator=gen)))
            c.accept(out[-1])
        assert out[-1] == 2 and valid(tok.decode(out[:-1]))
    allowed = grammars.constraint(("json_object", "")).mask(torch.zeros(vocab)) > -torch.inf
    brace = tok.encode("{", add_special_tokens=False)
    assert brace == [2048 + JSON_TOKENS.index("{")] and allowed[brace[0]] and not allowed[tok.encode("a")[-1]]
    assert not allowed[2048 + JSON_TOKENS.index("[")]          # an object, as OpenAI's json_object: no array
    with pytest.raises(ValueError, match="cannot be compiled"):
        grammars.compile(("json_schema", '{"type": 5}'))
    with pytest.raises(ValueError, match="not allowed"):
        grammars.constraint(("json_schema", json.dumps(SCHEMA)), prior=[tok.encode("a")[-1]])


def test_greedy_answers_are_token_exact_disaggregated_and_colocated(cluster, colocated, json_dir, vocab):
    prompt = Tokenizer(json_dir, 1).encode(PROMPT)
    expected = reference(json_dir, vocab, prompt, 40)
    assert expected[-1] == 2
    for c in (cluster, colocated):
        got = run(c, constrained(prompt, max_tokens=40, temperature=0))
        assert got.token_ids == expected and got.final.finish_reason == pdserve_pb2.FINISH_REASON_STOP
        assert valid(got.text)
        c.assert_pools_free()


def test_a_grammar_started_after_a_marker_leaves_the_tokens_before_it_free(json_dir, vocab):
    grammars, marker, a = Grammars(json_dir, vocab, [2]), [300, 301], 400   # two tokens, and another
    spec = ("json_schema", json.dumps(SCHEMA))
    c = grammars.constraint(spec, start_after=marker)
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(0))
    for token in (a, marker[0], a, marker[1], marker[0]):     # the marker's tokens apart, then its first: still free
        assert not c.started and torch.equal(c.mask(logits), logits) and not c.done
        c.accept(token)
    c.accept(marker[1])                                        # in a row: held from the next token on
    assert c.started and not c.done and (c.mask(logits) > -torch.inf).sum() < vocab / 10
    with pytest.raises(ValueError, match="not allowed"):
        c.accept(a)
    resumed = grammars.constraint(spec, prior=[a, *marker, 2048 + JSON_TOKENS.index("{")], start_after=marker)
    fresh = grammars.constraint(spec, prior=[2048 + JSON_TOKENS.index("{")])   # a prior past the marker: resumed
    assert resumed.started and torch.equal(resumed.mask(logits), fresh.mask(logits))


def test_a_grammar_started_after_a_marker_is_token_exact_through_both_clusters(cluster, colocated, json_dir, vocab):
    """The marker is the free answer's first two tokens: its first is the prefill worker's, its second a decode
    worker's (a colocated worker's, in its mixed step), and the grammar holds every token after it there, as in
    the reference."""
    prompt = Tokenizer(json_dir, 1).encode(PROMPT)
    free = reference(json_dir, vocab, prompt, 2, start_after=[-1])      # a marker never written: free tokens
    expected = reference(json_dir, vocab, prompt, 40, start_after=free)
    assert expected[:2] == free and expected[-1] == 2 and valid(Tokenizer(json_dir, 1).decode(expected[2:-1]))
    for c in (cluster, colocated):
        req = constrained(prompt, max_tokens=40, temperature=0)
        req.sampling.structured_output.start_after.extend(free)
        assert run(c, req).token_ids == expected
        c.assert_pools_free()


@pytest.mark.parametrize("after, kind, words", [
    ([5], False, "start_after needs a structured output kind"),
    (list(range(17)), True, "at most 16"),
    ([5, 10 ** 9], True, "outside the vocabulary"),
])
def test_start_after_refused_as_invalid_argument(cluster, after, kind, words):
    req = constrained(PROMPT, max_tokens=8) if kind else client.make_request(PROMPT, max_tokens=8)
    req.sampling.structured_output.start_after.extend(after)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        run(cluster, req)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in info.value.details(), \
        info.value.details()
    cluster.assert_pools_free()




def held(prompt, kind: str, value, **kw) -> pdserve_pb2.GenerateRequest:
    req = client.make_request(prompt, **kw)
    if kind == "choice":
        req.sampling.structured_output.choice.choices.extend(value)
    else:
        setattr(req.sampling.structured_output, kind, value)
    return req


def test_regex_choice_and_ebnf_grammar_hold_sampled_answers(cluster, json_dir, vocab):
    """vLLM's other structured_outputs kinds: every sampled answer matches its regex, is one of its choices
    (escapes included), or is a sentence of its EBNF grammar, and ends there (STOP); greedy answers equal
    transformers' under the same masks."""
    async def all_at_once(channel):
        import asyncio
        reqs = [held(PROMPT, kind, value, max_tokens=40, temperature=1.0, seed=seed)
                for seed in range(3) for kind, value in (("regex", REGEX), ("choice", CHOICES), ("grammar", EBNF))]
        return await asyncio.gather(*[client.complete(channel, r, timeout_s=60) for r in reqs])
    got = cluster.run(all_at_once)
    for k, answer in enumerate(got):
        assert answer.final.finish_reason == pdserve_pb2.FINISH_REASON_STOP and answer.token_ids[-1] == 2
        text = answer.text
        assert [re.fullmatch(REGEX, text), text in CHOICES, re.fullmatch(r"The answer is (yes|no|[0-9]+)\.",
                                                                         text)][k % 3], (k, text)
    prompt = Tokenizer(json_dir, 1).encode(PROMPT)
    for kind, value in (("regex", REGEX), ("choice", CHOICES)):
        spec = (kind, json.dumps(value) if kind == "choice" else value)
        expected = reference(json_dir, vocab, prompt, 40, spec)
        assert run(cluster, held(prompt, kind, value, max_tokens=40, temperature=0)).token_ids == expected
    cluster.assert_pools_free()


@pytest.mark.parametrize("kind, value, words", [
    ("regex", "(unclosed", "the regex cannot be compiled: Regex parsing error"),
    ("grammar", "root ::= undefined_rule", 'the grammar cannot be compiled: EBNF parser error'),
    ("choice", [], "structured_output.choice must be 1 to 1024 non-empty strings"),
    ("choice", ["ok", ""], "structured_output.choice must be"),
    ("regex", "", "structured_output.regex is empty"),
    ("grammar", "x" * 65_537, "structured_output.grammar of 65537 characters exceeds 65536"),
])
def test_other_kinds_refused_as_invalid_argument(cluster, kind, value, words):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        run(cluster, held(PROMPT, kind, value, max_tokens=8))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in info.value.details(), \
        info.value.details()
    cluster.assert_pools_free()


def test_sampled_answers_are_valid(cluster):
    async def all_at_once(channel):
        import asyncio
        return await asyncio.gather(*[client.complete(channel, constrained(PROMPT, max_tokens=60, temperature=1.0,
                                                                           seed=seed), timeout_s=60)
                                      for seed in range(6)])
    for got in cluster.run(all_at_once):
        assert got.final.finish_reason == pdserve_pb2.FINISH_REASON_STOP and valid(got.text)
    cluster.assert_pools_free()


def test_a_schema_that_cannot_be_completed_fails_its_request_alone(cluster, json_dir, vocab):
    """A pattern nothing matches: the grammar allows the opening quote, then no token. That request ends
    INVALID_ARGUMENT; a request decoding beside it finishes as it would alone."""
    dead = {"type": "string", "pattern": "[^\\s\\S]"}
    c = Grammars(json_dir, vocab, [2]).constraint(("json_schema", json.dumps(dead)))
    c.accept(int(c.mask(torch.zeros(vocab)).argmax()))
    assert (c.mask(torch.zeros(vocab)) > -torch.inf).nonzero().flatten().tolist() == [2] and not c.done
    c.accept(2)
    assert c.dead_end and c.done

    async def both(channel):
        import asyncio
        return await asyncio.gather(
            client.complete(channel, client.make_request(PROMPT, max_tokens=30, temperature=0, ignore_eos=True)),
            client.complete(channel, constrained(PROMPT, dead, max_tokens=30)), return_exceptions=True)
    plain, failed = cluster.run(both)
    assert isinstance(failed, grpc.aio.AioRpcError) and failed.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cannot be completed" in failed.details()
    alone = run(cluster, client.make_request(PROMPT, max_tokens=30, temperature=0, ignore_eos=True))
    assert plain.token_ids == alone.token_ids and len(plain.token_ids) == 30
    cluster.assert_pools_free()


@pytest.mark.parametrize("schema, extra, words", [
    ({"type": 5}, {}, "cannot be compiled"),
    (SCHEMA, {"ignore_eos": True}, "ignore_eos or min_tokens"),
    (SCHEMA, {"min_tokens": 2}, "ignore_eos or min_tokens"),
])
def test_refused_as_invalid_argument(cluster, schema, extra, words):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        run(cluster, constrained(PROMPT, schema, max_tokens=8, **extra))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in info.value.details()
    req = client.make_request(PROMPT)
    req.sampling.structured_output.json_schema = "[1, 2"
    with pytest.raises(grpc.aio.AioRpcError, match="not JSON"):
        run(cluster, req)
    cluster.assert_pools_free()


@pytest.mark.parametrize("more", [{}, {"speculative": "ngram", "spec_max_batch_size": 4, "spec_adaptive": False}],
                         ids=["plain", "ngram"])
def test_constrained_requests_preempted_and_recomputed_stay_token_exact(json_dir, vocab, more):
    """A colocated engine whose 11 usable blocks cannot hold three constrained answers at once: the latest is
    preempted, prefilled again and continues in its grammar (its state past every token it had), as the
    reference does; a batch holding constrained requests is not speculated."""
    from pdserve.decode_worker.config import DecodeWorkerConfig
    from pdserve.decode_worker.engine import DecodeEngine
    from pdserve.decode_worker.request import FinishedEvent, TokensEvent
    from pdserve.model.loader import load_model
    from pdserve.model.sampling import SamplingParams

    model, cfg = load_model(json_dir, dtype=torch.float32)
    e = DecodeEngine(DecodeWorkerConfig(model_dir=json_dir, worker_id="t", num_blocks=12, block_size=4,
                                        max_batch_size=4, colocated=True, max_num_batched_tokens=8, multi_step=8,
                                        dtype="float32", **more), model, cfg)
    try:
        prompts = {"a": [1, 400, 500, 600, 700, 800], "b": [1, 7, 8, 9, 10, 11], "c": [1, 300, 301, 302, 303, 304]}
        events = {rid: [] for rid in prompts}
        sampling = SamplingParams(temperature=0, max_tokens=24, grammar=("json_schema", json.dumps(SCHEMA)))
        for rid, prompt in prompts.items():
            e.add_local(rid, prompt, sampling, events[rid].append)
        for _ in range(400):
            e.step()
            if all(evs and not isinstance(evs[-1], TokensEvent) for evs in events.values()):
                break
        assert e.num_preemptions >= 1
        for rid, prompt in prompts.items():
            assert isinstance(events[rid][-1], FinishedEvent), (rid, events[rid][-1])
            got = [t for ev in events[rid] if isinstance(ev, TokensEvent) for t in ev.token_ids]
            assert got == reference(json_dir, vocab, prompt, 24), rid
        assert sum(evs[-1].num_draft_tokens for evs in events.values()) == 0
        assert e.pool.num_free == e.num_usable_blocks
    finally:
        e.receiver.close()
