"""What the request-validation fuzzers share (test_fuzz_validation.py in-process, test_fuzz_live_router.py
through a live router): the embedded model's limits, the router's validation of wire bytes, and hypothesis
strategies of requests (well-formed with values in and out of range, valid, raw protobuf records)."""

from __future__ import annotations

import math

from hypothesis import strategies as st

from pdserve.deploy import client
from pdserve.deploy.config import EMBEDDED_MODEL
from pdserve.model.config import ModelConfig
from pdserve.model.tokenizer import Tokenizer
from pdserve.proto import pdserve_pb2
from pdserve.router.slo import Slo
from pdserve.router.validation import ValidRequest, parse_request, validate

CFG = ModelConfig.from_hf_dir(EMBEDDED_MODEL)
TOKENIZER = Tokenizer(EMBEDDED_MODEL, CFG.bos_token_id)
VOCAB, CONTEXT, DEFAULT_MAX_TOKENS = CFG.vocab_size, CFG.max_position_embeddings, 16


def run(raw: bytes) -> ValidRequest | ValueError:
    """The router's validation of wire bytes: the valid request, or the ValueError it raised."""
    try:
        return validate(parse_request(raw), CFG, TOKENIZER, DEFAULT_MAX_TOKENS, Slo(1.0, 0.1))
    except ValueError as e:
        assert str(e), "a ValueError must say what is wrong"
        return e


I32, I64 = st.integers(-2**31, 2**31 - 1), st.integers(-2**63, 2**63 - 1)
SCHEMAS = ['{"type": "object"}', '{"type": 5}', "[1, 2]", '"text"', "{", "[" * 3000 + "]" * 3000,
           '{"description": "' + "x" * 70_000 + '"}', '{"enum": ["a", "b"]}']
floats = st.floats(width=32) | st.sampled_from([0.0, -0.0, 1e-30, 1.0, 0.5, 1.0000001, math.inf, -math.inf, math.nan])
doubles = st.floats() | st.sampled_from([0.0, -1.0, 1e-9, 0.1, 1.0, 1e308, math.inf, -math.inf, math.nan])
token_ids = (st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
             | st.lists(st.integers(0, VOCAB - 1) | I64 | st.sampled_from([-1, VOCAB]), max_size=40)
             | st.tuples(st.integers(480, 600), st.integers(0, VOCAB - 1)).map(lambda t: [t[1]] * t[0]))


@st.composite
def requests(draw) -> pdserve_pb2.GenerateRequest:
    """Well-formed token-id requests whose fields range over valid and invalid values."""
    s = pdserve_pb2.SamplingParams(top_k=draw(st.integers(-3, 3) | I32), ignore_eos=draw(st.booleans()),
                                   stop_token_ids=draw(st.lists(st.integers(-3, VOCAB + 3) | I64, max_size=5)))
    for name, strategy in (("temperature", floats), ("top_p", floats), ("min_p", floats),
                           ("seed", st.integers(0, 2**64 - 1)),
                           ("max_tokens", st.integers(-3, 40) | I32), ("presence_penalty", floats),
                           ("frequency_penalty", floats), ("repetition_penalty", floats),
                           ("min_tokens", st.integers(-3, 45) | I32)):
        if draw(st.booleans()):
            setattr(s, name, draw(strategy))
    s.logit_bias.update(draw(st.dictionaries(st.integers(-3, VOCAB + 3) | I64, floats | st.floats(-100, 100, width=32),
                                             max_size=4)))
    if draw(st.booleans()):
        s.prompt_logprobs = draw(st.integers(-3, 24) | I32)
    if draw(st.integers(0, 3)) == 0:
        s.truncate_prompt_tokens = draw(st.integers(-3, 12) | st.sampled_from([-1, 600]) | I32)
    kind = draw(st.sampled_from([None, None, "json_object", "json_schema", "regex", "choice", "grammar"]))
    if kind == "json_object":
        s.structured_output.json_object = draw(st.booleans())
    elif kind == "json_schema":
        s.structured_output.json_schema = draw(st.sampled_from(SCHEMAS) | st.text(max_size=20))
    elif kind in ("regex", "grammar"):
        setattr(s.structured_output, kind, draw(st.text(max_size=8) | st.just("a" * 65_537)))
    elif kind == "choice":
        s.structured_output.choice.choices.extend(draw(st.lists(st.text(max_size=3), max_size=3)
                                                       | st.just(["x"] * 1_025) | st.just(["y" * 40_000] * 2)))
    if draw(st.integers(0, 3)) == 0:
        s.allowed_token_ids.extend(draw(st.lists(st.integers(-2, VOCAB + 2), max_size=5)))
    if draw(st.integers(0, 3)) == 0:
        s.bad_words.extend(draw(st.lists(st.sampled_from(["dog", " ran", "", "  ", "a" * 257, "é✓"]), max_size=3)))
    if draw(st.integers(0, 3)) == 0:
        s.structured_output.start_after.extend(draw(st.lists(st.integers(-2, VOCAB + 2), max_size=18)))
    req = pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=draw(token_ids)), sampling=s,
                                      request_id=draw(st.text(max_size=8) | st.text(min_size=250, max_size=300)),
                                      queue_timeout_s=draw(st.just(0.0) | doubles),
                                      cache_salt=draw(st.sampled_from(["", "", "tenant", "x" * 257])))
    for name in ("ttft_slo_s", "tpot_slo_s"):
        if draw(st.booleans()):
            setattr(req, name, draw(doubles))
    return req


@st.composite
def valid_requests(draw, texts: bool = True) -> pdserve_pb2.GenerateRequest:
    """Requests the router must serve: token ids (or text), greedy or seeded sampling, 1..8 tokens."""
    prompt = draw(st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=20))
    choices = [prompt, "Once upon a time", "The dog ran"] if texts else [prompt]
    req = client.make_request(draw(st.sampled_from(choices)),
                              max_tokens=draw(st.integers(1, 8)), temperature=draw(st.sampled_from([0.0, 0.7])),
                              seed=draw(st.integers(0, 2**64 - 1)), top_k=draw(st.integers(0, 50)))
    req.request_id = draw(st.text(max_size=12))
    return req


def varint(n: int) -> bytes:
    n &= 2**64 - 1
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


@st.composite
def wire_records(draw) -> bytes:
    """One protobuf record with any field number and wire type (valid 0, 1, 2, 5; legacy groups 3, 4;
    invalid 6, 7) and a payload that may or may not fit it."""
    field = draw(st.integers(1, 12) | st.integers(1, 2**29 - 1))
    wt = draw(st.sampled_from([0, 0, 1, 2, 2, 5, 3, 4, 6, 7]))
    payload = {0: lambda: varint(draw(st.integers(0, 2**64 - 1))), 1: lambda: draw(st.binary(min_size=8, max_size=8)),
               2: lambda: (lambda b: varint(len(b)) + b)(draw(st.binary(max_size=30))),
               5: lambda: draw(st.binary(min_size=4, max_size=4))}.get(wt, lambda: draw(st.binary(max_size=6)))()
    return varint(field << 3 | wt) + payload


def length_delimited(field: int, body: bytes) -> bytes:
    return varint(field << 3 | 2) + varint(len(body)) + body
