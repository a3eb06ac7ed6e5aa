"""Tool calling over the OpenAI-compatible API, end to end: a router started with ``--tool-call-parser hermes``
in front of real workers serving a checkpoint whose greedy answer is a tool call (tests/scripted_model.py),
through the official ``openai`` client, whole and streamed; past calls and tool results rendered into the
prompt; what cannot be served refused by name."""

from __future__ import annotations

import json

import openai
import pytest

from pdserve.model.chat_template import ChatTemplate
from tests.clusters import Cluster
from tests.http_helpers import raw
from tests.scripted_model import scripted_chat_model

pytestmark = pytest.mark.timeout(180)

CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
ANSWER = ["Checking.", "<tool_call>", CALL, "</tool_call>"]
MODEL = "scripted"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def scripted_dir(tmp_path_factory) -> str:
    return str(scripted_chat_model(tmp_path_factory.mktemp("tools") / MODEL, ANSWER))


@pytest.fixture(scope="module")
def tools_cluster(redis_url, scripted_dir):
    c = Cluster(scripted_dir, redis_url, router_flags={"http_port": 0, "tool_call_parser": "hermes"})
    yield c
    c.stop()


@pytest.fixture
def api(tools_cluster):
    yield openai.OpenAI(base_url=f"http://{tools_cluster.router.http_address}/v1", api_key="unused", max_retries=0)
    tools_cluster.assert_pools_free()


def test_the_answer_comes_back_as_a_tool_call(api):
    got = api.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=16)
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_streamed_tool_calls_of_each_choice(api):
    content, calls, reasons = {0: "", 1: ""}, {0: [], 1: []}, {}
    for chunk in api.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=16, n=2,
                                             stream=True):
        for c in chunk.choices:
            content[c.index] += c.delta.content or ""
            calls[c.index] += c.delta.tool_calls or []
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert reasons == {0: "tool_calls", 1: "tool_calls"} and content == {0: "Checking.", 1: "Checking."}
    for index in (0, 1):
        [call] = calls[index]
        assert call.index == 0 and call.id.startswith("call_") and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert calls[0][0].id != calls[1][0].id


def test_bad_words_keep_a_word_out_of_the_answer(api):
    """vLLM's ``bad_words``: the scripted answer's first piece (one added token, as the router tokenizes the word)
    is never written, so the rest of the script, which follows only from it, is not either."""
    got = api.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0,
                                      extra_body={"bad_words": [ANSWER[0]]}).choices[0].message.content
    assert ANSWER[0] not in got and ANSWER[1] not in got and got


@pytest.mark.parametrize("extra", [{}, {"tools": TOOLS, "tool_choice": "none"}], ids=["no tools", "choice none"])
def test_without_auto_tool_choice_the_answer_is_text(api, extra):
    got = api.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16, **extra)
    assert got.choices[0].message.content == "".join(ANSWER) and not got.choices[0].message.tool_calls
    assert got.choices[0].finish_reason == "stop"


def test_past_calls_and_results_are_rendered_for_the_model(api, tools_cluster, scripted_dir):
    past = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    got = api.chat.completions.create(model=MODEL, messages=past, tools=TOOLS, max_tokens=16)
    assert got.choices[0].finish_reason == "tool_calls"
    status, _, body = raw(tools_cluster.router.http_address, "/tokenize", {"messages": past, "tools": TOOLS})
    assert status == 200
    expected = [*ASK, {"role": "assistant", "content": "", "tool_calls": [  # arguments as an object, as vLLM passes
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    template = ChatTemplate.load(scripted_dir)
    text = template.render(expected, tools=TOOLS)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert '"description": "The weather in a city now."' in text and "18 C, sunny" in text
    assert json.loads(body)["tokens"] == template.encode(text)


@pytest.fixture(scope="module")
def special_markers_cluster(redis_url, tmp_path_factory):
    """The same answer from a checkpoint whose tokenizer marks <tool_call> and </tool_call> special (as some
    Hermes checkpoints do): left out of the text by default."""
    model = scripted_chat_model(tmp_path_factory.mktemp("tools-special") / MODEL, ANSWER,
                                special=("<tool_call>", "</tool_call>"))
    c = Cluster(str(model), redis_url, router_flags={"http_port": 0, "tool_call_parser": "hermes"})
    yield c
    c.stop()


def test_call_markers_that_are_special_tokens_reach_the_parser(special_markers_cluster):
    api = openai.OpenAI(base_url=f"http://{special_markers_cluster.router.http_address}/v1", api_key="unused",
                        max_retries=0)
    got = api.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=16)
    assert got.choices[0].finish_reason == "tool_calls" and got.choices[0].message.content == "Checking."
    assert got.choices[0].message.tool_calls[0].function.name == "get_weather"
    kept = api.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16, extra_body={
        "skip_special_tokens": False})                           # no tools: markers kept on request, EOS never
    assert kept.choices[0].message.content == "".join(ANSWER)
    dropped = api.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=16, extra_body={
        "skip_special_tokens": True})                            # the client's choice wins: no markers, no call
    assert dropped.choices[0].message.content == "Checking." + CALL and not dropped.choices[0].message.tool_calls
    special_markers_cluster.assert_pools_free()


REFUSED = [  # (body fields, param named, words in the message)
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "not among `tools`"),
    ({"tool_choice": "auto"}, "tool_choice", "needs `tools`"),
    ({"tool_choice": "sometimes"}, "tool_choice", '"none", "auto", "required"'),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name", "pattern"),
    ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages.1.tool_call_id", "tool_call_id"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}}]}]},
     "messages.1.tool_calls.0.function.arguments", "JSON text of an object"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 5000}}]}]},
     "messages.1.tool_calls.0.function.arguments", "JSON text of an object"),   # deeper than the parser's stack
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages.0.tool_calls", "only assistant messages"),
]


@pytest.mark.parametrize("fields, param, words", REFUSED, ids=[r[1] + "-" + r[2][:12] for r in REFUSED])
def test_what_cannot_be_served_is_a_400_naming_it(tools_cluster, fields, param, words):
    status, _, body = raw(tools_cluster.router.http_address, "/v1/chat/completions",
                          {"model": MODEL, "messages": ASK, "max_tokens": 4, **fields})
    error = json.loads(body)["error"]
    assert status == 400 and error["type"] == "invalid_request_error", body
    assert words in error["message"] and error["param"] == param, error
    tools_cluster.assert_pools_free()
