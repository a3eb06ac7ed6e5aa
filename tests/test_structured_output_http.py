"""Structured output over the OpenAI-compatible HTTP API: chat's ``response_format``, the Responses API's
``text.format``, vLLM's ``structured_outputs`` (choice, regex, json, grammar) and tool_choice required / named,
answers held to them on a live cluster of the json-capable model; refusals as 400s naming the field."""

from __future__ import annotations

import json
import re

import openai
import pytest

from tests.clusters import Cluster
from tests.conftest import CHATML
from tests.scripted_model import json_capable_model
from tests.structured_cases import CHOICES, EBNF, PROMPT, REGEX, SCHEMA, valid

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def cluster(redis_url, tmp_path_factory):
    json_dir = str(json_capable_model(tmp_path_factory.mktemp("json") / "tinystories-json", CHATML))
    c = Cluster(json_dir, redis_url, dtype="float32", router_flags={"http_port": 0})
    yield c
    c.stop()


def test_response_format_over_http(cluster):
    api = openai.OpenAI(base_url=f"http://{cluster.router.http_address}/v1", api_key="unused", max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    got = api.chat.completions.create(model="tinystories-json", messages=[{"role": "user", "content": PROMPT}],
                                      response_format=fmt, max_tokens=60, temperature=0.7, seed=3)
    assert got.choices[0].finish_reason == "stop" and valid(got.choices[0].message.content)
    streamed = "".join(c.choices[0].delta.content or "" for c in api.chat.completions.create(
        model="tinystories-json", messages=[{"role": "user", "content": PROMPT}], response_format=fmt, max_tokens=60,
        temperature=0, stream=True) if c.choices)
    assert valid(streamed)
    with pytest.raises(openai.BadRequestError, match="cannot be compiled"):
        api.completions.create(model="tinystories-json", prompt=PROMPT, max_tokens=8, extra_body={
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}})
    with pytest.raises(openai.BadRequestError, match="json_schema.schema"):
        api.chat.completions.create(model="tinystories-json", messages=[{"role": "user", "content": PROMPT}],
                                    response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    cluster.assert_pools_free()


def test_text_format_over_the_responses_api(cluster):
    """Responses' text.format json_schema holds the answer as chat's response_format does, whole and streamed."""
    api = openai.OpenAI(base_url=f"http://{cluster.router.http_address}/v1", api_key="unused", max_retries=0)
    text = {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}}
    got = api.responses.create(model="tinystories-json", input=PROMPT, text=text, max_output_tokens=60,
                               temperature=0.7, extra_body={"seed": 3})     # vLLM's extra
    assert got.status == "completed" and valid(got.output_text), got.output_text
    with api.responses.stream(model="tinystories-json", input=PROMPT, text=text, max_output_tokens=60,
                              temperature=0) as stream:
        final = stream.get_final_response()
    assert valid(final.output_text) and final.text.format.type == "json_schema"
    cluster.assert_pools_free()


WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "time", "parameters": {"type": "object", "properties": {},
                                                                       "additionalProperties": False}}}


def test_vllm_structured_outputs_over_http(cluster):
    api = openai.OpenAI(base_url=f"http://{cluster.router.http_address}/v1", api_key="unused", max_retries=0)
    chat = dict(model="tinystories-json", messages=[{"role": "user", "content": PROMPT}], max_tokens=40)
    got = api.chat.completions.create(**chat, temperature=0.9, seed=1,
                                      extra_body={"structured_outputs": {"choice": CHOICES}})
    assert got.choices[0].message.content in CHOICES and got.choices[0].finish_reason == "stop"
    got = api.completions.create(model="tinystories-json", prompt=PROMPT, max_tokens=40, temperature=0.9, seed=2,
                                 extra_body={"structured_outputs": {"regex": REGEX}})
    assert re.fullmatch(REGEX, got.choices[0].text)
    got = api.chat.completions.create(**chat, temperature=0, extra_body={"structured_outputs": {"json": SCHEMA}})
    assert valid(got.choices[0].message.content)
    streamed = "".join(c.choices[0].text for c in api.completions.create(
        model="tinystories-json", prompt=PROMPT, max_tokens=40, temperature=0, stream=True,
        extra_body={"structured_outputs": {"grammar": EBNF}}) if c.choices)
    assert re.fullmatch(r"The answer is (yes|no|[0-9]+)\.", streamed)
    for bad, words in (({"structured_outputs": {"regex": REGEX, "choice": ["a"]}}, "exactly one"),
                       ({"structured_outputs": {}}, "exactly one"),
                       ({"structured_outputs": {"whitespace_pattern": " "}}, "whitespace_pattern"),
                       ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}},
                        "not both"),
                       ({"structured_outputs": {"regex": "(x"}}, "cannot be compiled")):
        with pytest.raises(openai.BadRequestError, match=words):
            api.chat.completions.create(**chat, extra_body=bad)
    with pytest.raises(openai.BadRequestError, match="structured_outputs"):
        api.chat.completions.create(**chat, tools=[WEATHER], tool_choice="required",
                                    extra_body={"structured_outputs": {"choice": ["a"]}})
    cluster.assert_pools_free()


def test_tool_choice_required_and_named_are_held_to_calls(cluster):
    """No --tool-call-parser on this router: forced calls need none (the grammar writes them as JSON)."""
    api = openai.OpenAI(base_url=f"http://{cluster.router.http_address}/v1", api_key="unused", max_retries=0)
    ask = dict(model="tinystories-json", messages=[{"role": "user", "content": PROMPT}], tools=[WEATHER, TIME],
               max_tokens=80, temperature=0.8)
    for seed in range(3):
        got = api.chat.completions.create(tool_choice="required", seed=seed, parallel_tool_calls=False, **ask)
        assert got.choices[0].message.tool_calls, got.choices[0].message.content
        [call] = got.choices[0].message.tool_calls
        assert got.choices[0].finish_reason == "tool_calls" and got.choices[0].message.content is None
        assert call.function.name in ("weather", "time") and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        assert args in ({"city": "Paris"}, {"city": "Rome"}) if call.function.name == "weather" else args == {}
        named = api.chat.completions.create(tool_choice={"type": "function", "function": {"name": "weather"}},
                                            seed=seed, **ask)
        [call] = named.choices[0].message.tool_calls
        assert named.choices[0].finish_reason == "stop" and call.function.name == "weather"
        assert json.loads(call.function.arguments) in ({"city": "Paris"}, {"city": "Rome"})
    for choice in ({"type": "function", "function": {"name": "weather"}}, "required"):
        # streamed: the arguments in pieces as they are written, which the SDK's own accumulator adds up
        weather = {**ask, "tools": [WEATHER], "tool_choice": choice, "seed": 5, "parallel_tool_calls": False}
        with api.chat.completions.stream(**weather) as stream:
            events = [event.type for event in stream]
            got = stream.get_final_completion().choices[0]
        whole = api.chat.completions.create(**weather).choices[0]
        [call], [same] = got.message.tool_calls, whole.message.tool_calls
        assert (call.function.name, call.function.arguments) == (same.function.name, same.function.arguments)
        assert call.function.name == "weather"
        assert events.count("tool_calls.function.arguments.delta") > 1 and got.finish_reason == whole.finish_reason
    for bad, words in (({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among"),
                       ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format")):
        with pytest.raises(openai.BadRequestError, match=words):
            api.chat.completions.create(**ask, **bad)
    cluster.assert_pools_free()
