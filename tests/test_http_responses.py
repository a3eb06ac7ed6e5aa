"""OpenAI's Responses API (``POST /v1/responses``) end to end, through the official ``openai`` client: the same
answer as the chat request it amounts to (text on the embedded model; reasoning, content and a tool call on a
scripted checkpoint behind ``--reasoning-parser qwen3 --tool-call-parser hermes``), whole and streamed (the
client's own stream accumulator checks the events' order and indices); past calls and their outputs as input
items; what needs a stored response, other tools and non-text input refused by name."""

from __future__ import annotations

import json

import openai
import pytest

from tests.conftest import CHAT_MODEL
from tests.http_helpers import raw
from tests.scripted_model import THOUGHT, thinking_cluster

pytestmark = pytest.mark.timeout(180)

MODEL = "thinker"
WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK = "What is the weather in Paris?"


@pytest.fixture
def text_api(http_cluster):
    yield openai.OpenAI(base_url=f"http://{http_cluster.router.http_address}/v1", api_key="unused", max_retries=0)
    http_cluster.assert_pools_free()


@pytest.fixture(scope="module")
def thinker(redis_url, tmp_path_factory):
    c = thinking_cluster(redis_url, tmp_path_factory.mktemp("responses") / MODEL)
    yield c
    c.stop()


@pytest.fixture
def api(thinker):
    yield openai.OpenAI(base_url=f"http://{thinker.router.http_address}/v1", api_key="unused", max_retries=0)
    thinker.assert_pools_free()


def test_text_answer_equals_the_chat_answer(text_api):
    """instructions + input are the chat's system and user messages; cut by max_output_tokens: incomplete."""
    messages = [{"role": "system", "content": "Tell a story."}, {"role": "user", "content": "Once upon a time"}]
    chat = text_api.chat.completions.create(model=CHAT_MODEL, messages=messages, max_tokens=12, temperature=0)
    got = text_api.responses.create(model=CHAT_MODEL, instructions="Tell a story.", input="Once upon a time",
                                    max_output_tokens=12, temperature=0)
    assert got.object == "response" and got.id.startswith("resp_") and got.model == CHAT_MODEL
    assert got.output_text == chat.choices[0].message.content and got.output_text
    [item] = got.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert got.usage.input_tokens == chat.usage.prompt_tokens and got.usage.output_tokens == 12
    assert got.usage.total_tokens == got.usage.input_tokens + 12
    assert chat.choices[0].finish_reason == "length"
    assert got.status == "incomplete" and got.incomplete_details.reason == "max_output_tokens"


def test_streamed_text_adds_up_to_the_whole_answer(text_api):
    kw = dict(model=CHAT_MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": "Once"}]}],
              max_output_tokens=10, temperature=0)
    whole = text_api.responses.create(**kw)
    with text_api.responses.stream(**kw) as stream:
        events = list(stream)
    final = events[-1].response     # the client's get_final_response() wants response.completed, OpenAI's too
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text and final.status == "incomplete"
    assert final.usage.output_tokens == 10


def test_reasoning_content_and_tool_call_come_back_as_items(api):
    got = api.responses.create(model=MODEL, input=ASK, tools=[WEATHER], max_output_tokens=16)
    assert got.status == "completed" and [i.type for i in got.output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = got.output
    assert reasoning.content[0].text == THOUGHT
    assert message.content[0].text == "Checking." == got.output_text
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")


def test_streamed_items_equal_the_whole_ones(api):
    with api.responses.stream(model=MODEL, input=ASK, tools=[WEATHER], max_output_tokens=16) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [i.type for i in final.output] == ["reasoning", "message", "function_call"]
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert added == [i.type for i in done] == ["reasoning", "message", "function_call"]
    assert [e.output_index for e in events if e.type == "response.output_item.done"] == [0, 1, 2]
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(arguments) == {"city": "Paris"} and done[2].arguments == arguments
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THOUGHT
    assert final.output[1].content[0].text == "Checking." and final.output[2].call_id == done[2].call_id
    assert events[-1].type == "response.completed"


def test_past_calls_and_outputs_render_as_the_chat_messages(api):
    """function_call and function_call_output items become the assistant's tool_calls and a tool message: the
    prompt has as many tokens as the chat request's."""
    past = [{"role": "user", "content": ASK},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C."}]
    chat = api.chat.completions.create(model=MODEL, tools=[{"type": "function", "function": {
        k: v for k, v in WEATHER.items() if k != "type"}}], max_tokens=16, messages=[
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": "Checking.", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C."}])
    got = api.responses.create(model=MODEL, input=past, tools=[WEATHER], max_output_tokens=16)
    assert got.usage.input_tokens == chat.usage.prompt_tokens
    assert got.output[1].content[0].text == chat.choices[0].message.content


@pytest.mark.parametrize("body, param, words", [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type", "only function tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0",
     "only text parts"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type", "is not served"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id", "must be a string"),
    ({"input": []}, "input", "holds no message"),
    ({"text": {"format": {"type": "json_schema"}}}, "text.format", "needs its `name` and `schema`"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools.0.name", "pattern"),
    ({"include": ["reasoning.encrypted_content"]}, "include", "`include`"),
    ({"frequency_penalty": 1.0}, "frequency_penalty", "unknown parameter"),
])
def test_what_cannot_be_served_is_refused_by_name(thinker, body, param, words):
    status, _, answer = raw(thinker.router.http_address, "/v1/responses", {"model": MODEL, "input": ASK} | body)
    error = json.loads(answer)["error"]
    assert status == 400 and error["param"] == param and words in error["message"], error
    thinker.assert_pools_free()
