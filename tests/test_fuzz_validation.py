"""Property-based fuzzing of the router's request validation (``router/validation.py``).

In-process, over thousands of derandomized hypothesis cases: arbitrary bytes, well-formed
requests with values in and out of range (checked against an independent oracle), wrong wire
types, unknown fields, invalid UTF-8, huge repeated fields, oversize prompts and bad SLO
values. Property: ``parse_request`` + ``validate`` return a ``ValidRequest`` whose every field
is in range, or raise ``ValueError`` naming the problem; never another exception.

Through a live router: test_fuzz_live_router.py; the strategies and the in-process check: fuzz_requests.py.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.model.sampling_types import MAX_STOP_TOKEN_IDS
from pdserve.model.sampling_types import REPETITION_BOUNDS as REP
from pdserve.proto import pdserve_pb2
from pdserve.router.validation import (
    MAX_PROMPT_LOGPROB_ENTRIES,
    MAX_REQUEST_ID_CHARS,
    ValidRequest,
    printable_id,
)
from tests.fuzz_requests import (
    CONTEXT,
    DEFAULT_MAX_TOKENS,
    TOKENIZER,
    VOCAB,
    length_delimited,
    requests,
    run,
    valid_requests,
    wire_records,
)

pytestmark = pytest.mark.timeout(240)

CASES: Counter = Counter()
MIN_CASES = 3500  # this file's share of the >= 10,000 generated cases per CI run


def fuzz(n: int) -> settings:
    """Deterministic hypothesis settings running ``n`` examples."""
    return settings(max_examples=n, derandomize=True, database=None, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                           HealthCheck.data_too_large])


def assert_in_range(v: ValidRequest) -> None:
    """Every field of a request the router accepted is one the workers can run."""
    s = v.sampling
    assert 0 < len(v.request_id) <= MAX_REQUEST_ID_CHARS
    assert v.prompt_ids and all(0 <= t < VOCAB for t in v.prompt_ids)
    assert 1 <= s.max_tokens and len(v.prompt_ids) + s.max_tokens <= CONTEXT
    assert math.isfinite(s.temperature) and s.temperature >= 0 and 0 < s.top_p <= 1 and s.top_k >= 0
    assert 0 <= s.min_p <= 1
    assert 0 <= s.seed < 2**64 and all(0 <= t < VOCAB for t in s.stop_token_ids)
    assert -2 <= s.presence_penalty <= 2 and -2 <= s.frequency_penalty <= 2 and REP[0] <= s.repetition_penalty <= REP[1]
    assert 0 <= s.min_tokens <= s.max_tokens
    assert all(0 <= t < VOCAB and -100 <= b <= 100 for t, b in s.logit_bias)
    assert s.prompt_logprobs is None or 0 <= s.prompt_logprobs <= 20
    assert s.grammar is None or (_spec_ok(*s.grammar) and not s.ignore_eos and not s.min_tokens)
    assert math.isfinite(v.slo.ttft_s) and v.slo.ttft_s > 0 and math.isfinite(v.slo.tpot_s) and v.slo.tpot_s > 0
    assert math.isfinite(v.queue_timeout_s) and v.queue_timeout_s >= 0


def problems(req: pdserve_pb2.GenerateRequest) -> set[str]:
    """Independent oracle: words naming each problem of a well-formed token-id request (empty: valid)."""
    s, ids, bad = req.sampling, list(req.token_ids.ids), set()
    temperature = s.temperature if s.HasField("temperature") else 1.0
    top_p = s.top_p if s.HasField("top_p") else 1.0
    max_tokens = s.max_tokens if s.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    if len(printable_id(req.request_id)) > MAX_REQUEST_ID_CHARS:  # bounded as the router keeps it
        bad.add("request_id")
    if not ids:
        bad.add("empty prompt")
    ids = truncated(ids, s, max_tokens)
    if ids is None:
        bad.add("truncate_prompt_tokens")
        ids = list(req.token_ids.ids)
    if len(ids) >= CONTEXT or (max_tokens >= 1 and len(ids) + max_tokens > CONTEXT):
        bad.add("context")
    if any(not 0 <= t < VOCAB for t in ids):
        bad.add("outside the vocabulary")
    if not (math.isfinite(temperature) and temperature >= 0):
        bad.add("temperature")
    if not 0 < top_p <= 1:  # NaN fails this too
        bad.add("top_p")
    if s.top_k < 0:
        bad.add("top_k")
    if s.HasField("min_p") and not 0 <= s.min_p <= 1:   # NaN fails this too
        bad.add("min_p")
    if max_tokens < 1:
        bad.add("max_tokens")
    if any(not 0 <= t < VOCAB for t in s.stop_token_ids) or len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        bad.add("stop_token_ids")
    for name in ("presence_penalty", "frequency_penalty"):
        if s.HasField(name) and not -2 <= getattr(s, name) <= 2:
            bad.add(name)
    if s.HasField("repetition_penalty") and not REP[0] <= s.repetition_penalty <= REP[1]:
        bad.add("repetition_penalty")
    if max_tokens >= 1 and not 0 <= s.min_tokens <= max_tokens:
        bad.add("min_tokens")
    if any(not 0 <= t < VOCAB or not -100 <= b <= 100 for t, b in s.logit_bias.items()):
        bad.add("logit_bias")
    if s.HasField("prompt_logprobs") and not (0 <= s.prompt_logprobs <= 20
                                              and len(ids) * (s.prompt_logprobs + 1) <= MAX_PROMPT_LOGPROB_ENTRIES):
        bad.add("prompt_logprobs")
    so = s.structured_output
    grammar = so.WhichOneof("kind")
    if grammar is not None and (grammar != "json_object" or so.json_object) and (s.ignore_eos or s.min_tokens):
        bad.add("structured output")
    if grammar == "choice" and not _spec_ok("choice", json.dumps(list(so.choice.choices))):
        bad.add("choice")
    elif grammar not in (None, "json_object", "choice") and not _spec_ok(grammar, getattr(so, grammar)):
        bad.add(grammar)
    if so.start_after and (grammar is None or grammar == "json_object" and not so.json_object
                           or len(so.start_after) > 16 or any(not 0 <= t < VOCAB for t in so.start_after)):
        bad.add("start_after")
    held = grammar is not None and (grammar != "json_object" or so.json_object)
    if any(not 0 <= t < VOCAB for t in s.allowed_token_ids) or (held and s.allowed_token_ids):
        bad.add("allowed_token_ids")
    if any(not w.strip() or len(w) > 256 for w in s.bad_words) or (held and s.bad_words):
        bad.add("bad_words")
    for name in ("ttft_slo_s", "tpot_slo_s"):
        if req.HasField(name) and not (math.isfinite(getattr(req, name)) and getattr(req, name) > 0):
            bad.add(name)
    if not (math.isfinite(req.queue_timeout_s) and req.queue_timeout_s >= 0):
        bad.add("queue_timeout_s")
    if len(req.cache_salt) > 256:
        bad.add("cache_salt")
    return bad


def truncated(ids: list[int], s: pdserve_pb2.SamplingParams, max_tokens: int) -> list[int] | None:
    """The prompt the router keeps under ``truncate_prompt_tokens`` (None: a value it refuses)."""
    if not s.HasField("truncate_prompt_tokens"):
        return ids
    k = s.truncate_prompt_tokens
    if k == -1:
        return ids[-max(1, CONTEXT - max_tokens):]
    return ids[-k:] if k >= 1 else None


def _spec_ok(kind: str, text: str) -> bool:
    """Whether the router passes a structured-output spec to the workers (which compile it): a schema
    :func:`_schema_ok`, a regex or grammar of 1 to 64 Ki characters, 1 to 1,024 non-empty choices."""
    if kind == "json_schema":
        return _schema_ok(text)
    if kind == "choice":
        choices = json.loads(text)
        return 0 < len(choices) <= 1_024 and all(choices) and len(text) <= 65_536
    return kind == "json_object" or 0 < len(text) <= 65_536


def _schema_ok(text: str) -> bool:
    """Whether ``text`` is a schema the router passes to the workers: JSON text of an object, 64 Ki characters
    at most (the oracle's own parse: ``json`` raises RecursionError on deep nesting)."""
    try:
        return len(text) <= 65_536 and isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


# -- properties ------------------------------------------------------------------------------------

@fuzz(1200)
@given(raw=st.binary(max_size=200))
def test_arbitrary_bytes_are_valid_or_value_error(raw):
    got = run(raw)
    if isinstance(got, ValidRequest):
        assert_in_range(got)
    CASES["bytes"] += 1


@fuzz(1000)
@given(req=requests() | valid_requests(texts=False))
def test_well_formed_requests_match_the_oracle(req):
    got, bad = run(req.SerializeToString()), problems(req)
    CASES["oracle_valid" if not bad else "oracle"] += 1
    if not bad:
        assert isinstance(got, ValidRequest), f"rejected a valid request: {got}"
        assert_in_range(got)
        assert got.prompt_ids == truncated(list(req.token_ids.ids), req.sampling, req.sampling.max_tokens
                                           if req.sampling.HasField("max_tokens") else DEFAULT_MAX_TOKENS)
        assert got.request_id == (printable_id(req.request_id) or got.request_id)  # escaped for the logs
    else:
        assert isinstance(got, ValueError), f"accepted a request with {bad}"
        assert any(word in str(got) for word in bad), (bad, str(got))


@fuzz(600)
@given(base=requests(), records=st.lists(wire_records(), min_size=1, max_size=4), where=st.integers(0, 4),
       nested=st.sampled_from([None, 2, 3]))
def test_unknown_fields_and_wrong_wire_types_are_value_errors_or_valid(base, records, where, nested):
    raw = base.SerializeToString()
    junk = b"".join(records)
    if nested is None:  # at the top level, before, between or after the real fields
        cut = min(where * 7, len(raw))
        data = raw[:cut] + junk + raw[cut:] if _on_record_boundary(raw, cut) else raw + junk
    else:  # inside the sampling or token_ids sub-message
        data = raw + length_delimited(nested, junk)
    got = run(data)
    if isinstance(got, ValidRequest):
        assert_in_range(got)
    CASES["wire"] += 1


def _on_record_boundary(raw: bytes, cut: int) -> bool:
    """Whether ``cut`` falls between two top-level records of ``raw`` (so inserting keeps them intact)."""
    pos = 0
    while pos < cut:
        try:
            pos = _skip_record(raw, pos)
        except (IndexError, ValueError):
            return False
    return pos == cut


def _read_varint(raw: bytes, pos: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = raw[pos]
        value |= (b & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not b & 0x80:
            return value, pos


def _skip_record(raw: bytes, pos: int) -> int:
    tag, pos = _read_varint(raw, pos)
    wt = tag & 7
    if wt == 0:
        return _read_varint(raw, pos)[1]
    if wt == 2:
        n, pos = _read_varint(raw, pos)
        return pos + n
    return pos + {1: 8, 5: 4}[wt]


@fuzz(300)
@given(junk=st.binary(min_size=1, max_size=20).filter(lambda b: _not_utf8(b)), field=st.sampled_from([1, 4]),
       prefix=st.text(max_size=5))
def test_invalid_utf8_strings_are_value_errors(junk, field, prefix):
    body = prefix.encode() + junk
    raw = length_delimited(field, body) + (length_delimited(1, b"Hi") if field == 4 else b"")
    got = run(raw)
    assert isinstance(got, ValueError), got
    CASES["utf8"] += 1


def _not_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


@fuzz(150)
@given(n=st.integers(CONTEXT, 5_000), value=st.integers(-5, VOCAB + 5))
def test_huge_repeated_fields_are_refused_quickly(n, value):
    ids = pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=[value] * n))
    stops = pdserve_pb2.GenerateRequest(text="Hi", sampling=pdserve_pb2.SamplingParams(stop_token_ids=[VOCAB] * n))
    for req, words in ((ids, "context"), (stops, "stop_token_ids")):
        got = run(req.SerializeToString())
        assert isinstance(got, ValueError) and words in str(got), got
    CASES["huge_repeated"] += 1


def test_a_million_token_ids_are_refused_in_well_under_a_second():
    req = pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=[VOCAB + 1] * 1_000_000))
    start = time.perf_counter()
    got = run(req.SerializeToString())
    assert isinstance(got, ValueError) and "context" in str(got), got
    assert time.perf_counter() - start < 1.0


def test_a_huge_request_id_is_refused_on_its_length_before_it_is_escaped():
    """1.39 million zero-width spaces (4 MB): escaping them for the logs took the router's event loop 0.5 s."""
    req = pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=[1, 2]), request_id="\u200b" * 1_390_000)
    start = time.perf_counter()
    got = run(req.SerializeToString())
    assert isinstance(got, ValueError), got
    assert str(got) == f"request_id of 1390000 characters exceeds {MAX_REQUEST_ID_CHARS}"
    assert time.perf_counter() - start < 0.25


def test_stop_token_ids_are_capped():
    """A valid stop list is forwarded to every worker of the request, n times: its length is bounded."""
    def stops(n: int) -> ValidRequest | ValueError:
        sampling = pdserve_pb2.SamplingParams(stop_token_ids=[5] * n, max_tokens=1)
        return run(pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=[1]), sampling=sampling)
                   .SerializeToString())
    assert isinstance(stops(MAX_STOP_TOKEN_IDS), ValidRequest)
    got = stops(MAX_STOP_TOKEN_IDS + 1)
    assert isinstance(got, ValueError) and f"at most {MAX_STOP_TOKEN_IDS}" in str(got), got


@fuzz(250)
@given(extra=st.integers(1, 100_000) | st.sampled_from([3_000_000]),
       char=st.sampled_from(["a", " ", "\u200b", "\x00", "é", "🙂", "Once "]))
def test_oversize_text_prompts_are_refused_before_tokenizing(extra, char):
    limit = CONTEXT * TOKENIZER.max_token_chars
    text = (char * (limit // len(char) + 1 + extra // len(char)))[: limit + extra]
    start = time.perf_counter()
    got = run(pdserve_pb2.GenerateRequest(text=text).SerializeToString())
    assert isinstance(got, ValueError) and "exceeds the model's context" in str(got), got
    assert time.perf_counter() - start < 1.0  # tokenizing megabytes takes seconds on this machine
    CASES["oversize_text"] += 1


@fuzz(300)
@given(text=st.text(min_size=1, max_size=300))
def test_any_text_prompt_is_valid_or_value_error(text):
    got = run(pdserve_pb2.GenerateRequest(text=text, sampling=pdserve_pb2.SamplingParams(max_tokens=1))
              .SerializeToString())
    if isinstance(got, ValidRequest):
        assert_in_range(got)
        assert got.prompt_ids == TOKENIZER.encode(text)
    CASES["text"] += 1


def test_generated_case_count():
    """Runs after the in-process properties: how many generated cases ran (printed for the docs)."""
    total = sum(CASES.values())
    print(f"\nfuzz validation: {total} generated cases in-process: {dict(CASES)}")
    assert total >= MIN_CASES, dict(CASES)
    assert CASES["oracle_valid"] >= 0.1 * (CASES["oracle_valid"] + CASES["oracle"]), "too few valid requests"
