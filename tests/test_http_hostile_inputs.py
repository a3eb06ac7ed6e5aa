"""Hostile request bodies at the OpenAI-compatible HTTP API, against a live cluster: each gets a 400 in
OpenAI's shape and costs the router nothing, and the pools are free afterwards. A huge ``n`` (the router
once sized a non-streamed answer's choices by it before checking it: 3,000,000 cost ~830 MB and 5 s,
2^31 - 1 killed the router), strings holding a lone UTF-16 surrogate (valid JSON escapes, once a 500 from
protobuf, the tokenizer or the error body itself), and a positive temperature too small to divide by
(once a float32 overflow that streamed the first infinite logit's token instead of the greedy one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.model.sampling_types import GREEDY_BELOW, SamplingParams
from pdserve.router.http.errors import ApiError
from pdserve.router.http.schemas import lone_surrogate
from tests.http_helpers import raw

pytestmark = pytest.mark.timeout(180)

CHAT = [{"role": "user", "content": "A dog and a cat"}]


def peak_rss_kib(pid: int) -> int:
    """The process's peak resident set (``VmHWM``), KiB."""
    return next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if line.startswith("VmHWM:"))


@pytest.mark.parametrize("stream", [False, True])
def test_a_huge_n_is_a_400_before_anything_is_sized_by_it(http_cluster, stream):
    address, pid = http_cluster.router.http_address, http_cluster.router.proc.pid
    before = peak_rss_kib(pid)
    for path, body in (("/v1/completions", {"prompt": "a", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2})):
        status, _, answer = raw(address, path, {**body, "n": 3_000_000, "stream": stream})
        error = json.loads(answer)["error"]
        assert status == 400 and "n must be in [1, 16]" in error["message"], answer
    assert peak_rss_kib(pid) - before < 64 * 1024          # the old path grew the router by ~830 MB here
    assert raw(address, "/v1/completions", {"prompt": "a", "max_tokens": 2, "n": 2})[0] == 200
    http_cluster.assert_pools_free()


SURROGATES = [  # (path, body, the field the 400 names)
    ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
    ("/v1/completions", {"prompt": ["fine", "a\udc00"]}, "prompt.1"),
    ("/v1/completions", {"prompt": "a", "stop": "\udc00"}, "stop"),
    ("/v1/completions", {"prompt": "a", "model": "\ud800"}, "model"),
    ("/v1/completions", {"prompt": "a", "\ud800": 1}, "\\ud800"),
    ("/v1/completions", {"prompt": "a", "stream": True, "stop": ["x", "\ud800"]}, "stop.1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "\ud800"}]}]},
     "messages.0.content.0.type"),
    ("/v1/chat/completions", {"messages": CHAT, "stop": "\udfff"}, "stop"),
    ("/v1/responses", {"input": "a\ud800"}, "input"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": "\udc00"}]}]},
     "input.0.content.0.text"),
    ("/v1/responses", {"input": "a", "instructions": "\ud800"}, "instructions"),
]


@pytest.mark.parametrize("path, body, field", SURROGATES, ids=[f"{p[4:]}:{f}" for p, _, f in SURROGATES])
def test_a_lone_surrogate_anywhere_is_a_400_naming_where(http_cluster, path, body, field):
    status, _, answer = raw(http_cluster.router.http_address, path, body)   # json.dumps writes "\ud800" escapes
    error = json.loads(answer)["error"]
    assert status == 400 and error["type"] == "invalid_request_error", answer
    assert "lone UTF-16 surrogate" in error["message"] and error["param"] == field, answer
    http_cluster.assert_pools_free()


def test_a_text_part_without_its_text_is_a_400_saying_so(http_cluster):
    status, _, answer = raw(http_cluster.router.http_address, "/v1/chat/completions",
                            {"messages": [{"role": "user", "content": [{"type": "text"}]}]})
    error = json.loads(answer)["error"]
    assert status == 400 and "needs its `text`" in error["message"], answer
    assert error["param"] == "messages.0.content.0.text"


def test_lone_surrogate_finds_keys_and_values_at_any_depth():
    deep: list = ["\ud800"]
    for _ in range(100_000):                                  # no recursion: no stack to run out of
        deep = [deep]
    assert lone_surrogate({"a": [{"b": "ok"}, {"c": deep}]}) == "a.1.c" + ".0" * 100_001
    assert lone_surrogate({"x": "\U0001f600 ok", "y": ["é"]}) is None   # a surrogate pair is one character
    assert lone_surrogate({"k\udc00": 1}) == "k\\udc00"


def test_an_error_that_quotes_the_client_always_renders():
    answer = ApiError(404, "the model `\ud800` does not exist", param="model\udfff").response()
    error = json.loads(answer.body)["error"]
    assert error["message"] == "the model `\\ud800` does not exist" and error["param"] == "model\\udfff"


def test_a_positive_temperature_too_small_to_divide_by_samples_greedily(http_cluster):
    assert SamplingParams(temperature=1e-40).temperature == 0.0
    assert SamplingParams(temperature=GREEDY_BELOW).temperature == GREEDY_BELOW
    address = http_cluster.router.http_address
    outputs = {}
    for t in (0.0, 1e-40, 1e-38, 5e-6):
        status, _, answer = raw(address, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 8,
                                                             "temperature": t, "seed": 1})
        assert status == 200, answer
        outputs[t] = json.loads(answer)["choices"][0]["text"]
    assert len(set(outputs.values())) == 1, outputs       # 1e-40 once streamed the first infinite logit's token
    http_cluster.assert_pools_free()
