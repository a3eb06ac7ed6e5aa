"""Anthropic's Messages API (``POST /v1/messages``) end to end, through the official ``anthropic`` client: the same
answer as the chat request it amounts to (text on the embedded model; thinking, text and a tool call on a scripted
checkpoint behind ``--reasoning-parser qwen3 --tool-call-parser hermes``), whole and streamed (the client's own
stream accumulator builds the final message from the events); past tool calls and results as content blocks;
the key as ``x-api-key``; errors in Anthropic's shape."""

from __future__ import annotations

import json
import time

import anthropic
import openai
import pytest

from pdserve.deploy.processes import spawn_role
from tests.conftest import CHAT_MODEL
from tests.http_helpers import raw
from tests.scripted_model import THOUGHT, thinking_cluster

pytestmark = pytest.mark.timeout(180)

MODEL, TOKEN = "thinker", "messages-test-token"
WEATHER = {"name": "get_weather", "description": "The weather in a city now.", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def text_api(http_cluster):
    yield anthropic.Anthropic(base_url=f"http://{http_cluster.router.http_address}", api_key="unused",
                              max_retries=0)
    http_cluster.assert_pools_free()


@pytest.fixture(scope="module")
def thinker(redis_url, tmp_path_factory):
    c = thinking_cluster(redis_url, tmp_path_factory.mktemp("messages") / MODEL)
    yield c
    c.stop()


@pytest.fixture
def api(thinker):
    yield anthropic.Anthropic(base_url=f"http://{thinker.router.http_address}", api_key="unused", max_retries=0)
    thinker.assert_pools_free()


def test_text_answer_equals_the_chat_answer(text_api, http_cluster):
    """system + messages are the chat's messages; cut by max_tokens: stop_reason max_tokens."""
    chat_api = openai.OpenAI(base_url=f"http://{http_cluster.router.http_address}/v1", api_key="unused")
    chat = chat_api.chat.completions.create(model=CHAT_MODEL, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Tell a story."}, {"role": "user", "content": "Once upon a time"}])
    got = text_api.messages.create(model=CHAT_MODEL, max_tokens=12, extra_body={"temperature": 0},
                                   system="Tell a story.", messages=[{"role": "user", "content": "Once upon a time"}])
    assert got.type == "message" and got.role == "assistant" and got.id.startswith("msg_")
    [block] = got.content
    assert block.type == "text" and block.text == chat.choices[0].message.content and block.text
    assert got.stop_reason == "max_tokens" and got.stop_sequence is None
    assert got.usage.input_tokens + got.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert got.usage.output_tokens == 12


def test_a_last_assistant_message_is_continued(text_api, http_cluster):
    """Anthropic's prefill: the answer continues the assistant's text, as chat's continue_final_message does."""
    chat_api = openai.OpenAI(base_url=f"http://{http_cluster.router.http_address}/v1", api_key="unused")
    turns = [{"role": "user", "content": "Tell me about Lily."}, {"role": "assistant", "content": "Lily was a"}]
    chat = chat_api.chat.completions.create(model=CHAT_MODEL, max_tokens=8, temperature=0, messages=turns,
                                            extra_body={"add_generation_prompt": False,
                                                        "continue_final_message": True})
    got = text_api.messages.create(model=CHAT_MODEL, max_tokens=8, extra_body={"temperature": 0}, messages=turns)
    assert got.content[0].text == chat.choices[0].message.content and got.content[0].text


def test_streamed_text_adds_up_to_the_whole_answer(text_api):
    kw = dict(model=CHAT_MODEL, max_tokens=10, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Once"}]}])
    whole = text_api.messages.create(**kw)
    with text_api.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type != "text"]     # the client adds "text" events of its own
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == whole.content[0].text
    assert final.content[0].text == whole.content[0].text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 10


def test_thinking_text_and_tool_use_come_back_as_blocks(api):
    got = api.messages.create(model=MODEL, max_tokens=16, messages=ASK, tools=[WEATHER])
    assert [b.type for b in got.content] == ["thinking", "text", "tool_use"] and got.stop_reason == "tool_use"
    thinking, text, call = got.content
    assert thinking.thinking == THOUGHT and text.text == "Checking."
    assert call.name == "get_weather" and call.input == {"city": "Paris"} and call.id.startswith("call_")


def test_streamed_blocks_equal_the_whole_ones(api):
    with api.messages.stream(model=MODEL, max_tokens=16, messages=ASK, tools=[WEATHER]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].thinking == THOUGHT and final.content[1].text == "Checking."
    assert final.content[2].input == {"city": "Paris"} and final.stop_reason == "tool_use"
    starts = [e.index for e in events if e.type == "content_block_start"]
    assert starts == [0, 1, 2]
    pieces = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta"
                     and e.delta.type == "input_json_delta")
    assert json.loads(pieces) == {"city": "Paris"}


def test_past_tool_use_and_results_render_as_the_chat_messages(api, thinker):
    """An assistant's tool_use blocks and the user's tool_result blocks become the chat's tool_calls and tool
    message: the prompt has as many tokens as the chat request's."""
    chat_api = openai.OpenAI(base_url=f"http://{thinker.router.http_address}/v1", api_key="unused")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    chat = chat_api.chat.completions.create(model=MODEL, max_tokens=16, tools=[{"type": "function", "function": {
        "name": WEATHER["name"], "description": WEATHER["description"], "parameters": WEATHER["input_schema"]}}],
        messages=[*ASK, {"role": "assistant", "content": "Checking.", "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C."}])
    got = api.messages.create(model=MODEL, max_tokens=16, tools=[WEATHER], messages=[*ASK, {
        "role": "assistant", "content": [{"type": "thinking", "thinking": "Hm.", "signature": ""},
                                         {"type": "text", "text": "Checking."},
                                         {"type": "tool_use", "id": "call_1", "name": "get_weather",
                                          "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                      "content": [{"type": "text", "text": "Sunny, 21 C."}]}]}])
    assert got.usage.input_tokens + got.usage.cache_read_input_tokens == chat.usage.prompt_tokens


def test_the_key_comes_as_x_api_key_or_a_bearer_token(thinker, tmp_path):
    """A second router of the cluster, with a token: Anthropic's SDK sends it as x-api-key."""
    (tmp_path / "token").write_text(TOKEN)
    router = spawn_role("router", thinker.router_flags | {"token_file": str(tmp_path / "token")}, "router-token")
    try:
        deadline = time.monotonic() + 10
        while raw(router.http_address, "/health")[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        got = anthropic.Anthropic(base_url=f"http://{router.http_address}", api_key=TOKEN, max_retries=0
                                  ).messages.create(model=MODEL, max_tokens=16, messages=ASK)
        assert got.content[-1].text.startswith("Checking.")      # no tools given: the call is text
        body = {"model": MODEL, "max_tokens": 4, "messages": ASK}
        assert raw(router.http_address, "/v1/messages", body, {"Authorization": f"Bearer {TOKEN}"})[0] == 200
        status, _, answer = raw(router.http_address, "/v1/messages", body, {"x-api-key": "wrong"})
        assert status == 401 and json.loads(answer)["error"]["type"] == "authentication_error", answer
    finally:
        router.stop()
    thinker.assert_pools_free()


@pytest.mark.parametrize("change, words", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image block is not served"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "only custom tools"),
    ({"messages": [{"role": "system", "content": "x"}]}, "must be user or assistant"),
    ({"tool_choice": {"type": "tool"}}, "needs the tool's `name`"),
    ({"max_tokens": None}, "max_tokens"),
    ({"frequency_penalty": 1.0}, "unknown parameter"),
])
def test_what_cannot_be_served_is_a_400_in_anthropics_shape(thinker, change, words):
    body = {k: v for k, v in ({"model": MODEL, "max_tokens": 4, "messages": ASK} | change).items() if v is not None}
    status, _, answer = raw(thinker.router.http_address, "/v1/messages", body)
    error = json.loads(answer)
    assert status == 400 and error["type"] == "error", error
    assert error["error"]["type"] == "invalid_request_error" and words in error["error"]["message"], error
    thinker.assert_pools_free()
