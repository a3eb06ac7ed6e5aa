"""Reasoning models over the chat API, end to end: a router started with ``--reasoning-parser qwen3`` and
``--tool-call-parser hermes`` in front of real workers serving a checkpoint whose greedy answer thinks, says a
word and calls a tool (tests/scripted_model.py); the answer comes back split into ``reasoning``, content and
``tool_calls``, whole and streamed, through the official ``openai`` client. vLLM's chat extras
(``chat_template_kwargs``, ``add_generation_prompt``, ``continue_final_message``) shape the prompt."""

from __future__ import annotations

import json

import openai
import pytest

from pdserve.model.chat_template import ChatTemplate
from tests.clusters import Cluster
from tests.http_helpers import raw
from tests.scripted_model import ASSISTANT, TEMPLATE, scripted_chat_model

pytestmark = pytest.mark.timeout(180)

CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
THOUGHT = "The user wants the weather."
ANSWER = ["<think>", THOUGHT, "</think>", "Checking.", "<tool_call>", CALL, "</tool_call>"]
MODEL = "thinker"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# Qwen3's switch: thinking off writes an empty block into the prompt (the scripted answer is the same after it)
THINKING_TEMPLATE = TEMPLATE.replace(
    "{%- if add_generation_prompt %}" + ASSISTANT,
    "{%- if add_generation_prompt %}{% if enable_thinking is defined and not enable_thinking %}"
    "<think></think>{% endif %}" + ASSISTANT)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(scripted_chat_model(tmp_path_factory.mktemp("reasoning") / MODEL, ANSWER, THINKING_TEMPLATE))


@pytest.fixture(scope="module")
def cluster(redis_url, model_dir):
    c = Cluster(model_dir, redis_url, router_flags={"http_port": 0, "tool_call_parser": "hermes",
                                                     "reasoning_parser": "qwen3"})
    yield c
    c.stop()


@pytest.fixture
def api(cluster):
    yield openai.OpenAI(base_url=f"http://{cluster.router.http_address}/v1", api_key="unused", max_retries=0)
    cluster.assert_pools_free()


def test_reasoning_content_and_tool_calls_come_apart(api):
    got = api.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=16).choices[0]
    assert got.message.reasoning == got.message.reasoning_content == THOUGHT
    assert got.message.content == "Checking." and got.finish_reason == "tool_calls"
    [call] = got.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    plain = api.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16).choices[0]   # no tools
    assert plain.message.reasoning == THOUGHT and plain.message.content == "Checking.<tool_call>" + CALL + \
        "</tool_call>" and plain.finish_reason == "stop"


def test_streamed_reasoning_then_content_then_calls(api):
    """A delta may carry the end of the reasoning and the start of the content together (several tokens a
    message, multi-step decoding), as vLLM's do; read in field order, the parts never interleave back."""
    reasoning, content, calls, order = "", "", [], []
    for chunk in api.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=16, stream=True):
        for c in chunk.choices:
            delta = c.delta.model_dump()
            if delta.get("reasoning"):
                assert delta["reasoning_content"] == delta["reasoning"]
                reasoning += delta["reasoning"]
                order.append("reasoning")
            if delta.get("content"):
                content += delta["content"]
                order.append("content")
            if delta.get("tool_calls"):
                calls += delta["tool_calls"]
                order.append("calls")
    assert reasoning == THOUGHT and content == "Checking." and len(calls) == 1
    assert order == sorted(order, key=["reasoning", "content", "calls"].index)     # never interleaved back


def test_a_grammar_holds_the_answer_after_its_reasoning(api):
    """As vLLM starts a grammar after a reasoning parser's end: the thinking is free, the answer after
    ``</think>`` is held (whole and streamed); with the reasoning closed in the prompt (thinking off), the
    grammar holds the whole answer, which has no reasoning."""
    ask = dict(model=MODEL, messages=ASK, max_tokens=16, temperature=0,
               extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    got = api.chat.completions.create(**ask).choices[0]
    assert got.message.reasoning == THOUGHT and got.message.content in ("yes", "no") and got.finish_reason == "stop"
    deltas = [c.delta.model_dump() for chunk in api.chat.completions.create(**ask, stream=True) for c in chunk.choices]
    assert "".join(d.get("reasoning") or "" for d in deltas) == THOUGHT
    assert "".join(d.get("content") or "" for d in deltas) == got.message.content
    off = api.chat.completions.create(**{**ask, "extra_body": {**ask["extra_body"], "chat_template_kwargs": {
        "enable_thinking": False}}}).choices[0]
    assert off.message.content in ("yes", "no") and off.message.model_dump().get("reasoning") is None


def test_reasoning_effort_goes_to_a_template_that_reads_it(tmp_path_factory, redis_url):
    """OpenAI's ``reasoning_effort`` becomes the template variable of that name (gpt-oss-style templates); a
    template that does not read it refuses it by name (tests/test_http_api.py)."""
    template = THINKING_TEMPLATE.replace(ASSISTANT, "{% if reasoning_effort %}Effort: {{ reasoning_effort }}"
                                                    "{% endif %}" + ASSISTANT)
    path = scripted_chat_model(tmp_path_factory.mktemp("effort") / MODEL, ANSWER, template)
    c = Cluster(str(path), redis_url, router_flags={"http_port": 0})
    try:
        def tokens(**body) -> list[int]:
            status, _, out = raw(c.router.http_address, "/tokenize", {"model": MODEL, "messages": ASK, **body})
            assert status == 200, out
            return json.loads(out)["tokens"]
        rendered = ChatTemplate.load(str(path))
        effort = rendered.encode(rendered.render(ASK, reasoning_effort="low"))
        assert tokens(chat_template_kwargs={"reasoning_effort": "low"}) == effort != tokens()
        api = openai.OpenAI(base_url=f"http://{c.router.http_address}/v1", api_key="unused", max_retries=0)
        got = api.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, reasoning_effort="low")
        assert got.usage.prompt_tokens == len(effort)
        c.assert_pools_free()
    finally:
        c.stop()


def test_chat_template_kwargs_and_continue_final_message_shape_the_prompt(cluster, model_dir):
    address = cluster.router.http_address
    template = ChatTemplate.load(model_dir)
    think_ids = [template.encode(t)[0] for t in ("<think>", "</think>")]

    def tokens(**body) -> list[int]:
        status, _, out = raw(address, "/tokenize", {"model": MODEL, "messages": ASK, **body})
        assert status == 200, out
        return json.loads(out)["tokens"]
    on, off = tokens(), tokens(chat_template_kwargs={"enable_thinking": False})
    assert off == on[:-1] + think_ids + on[-1:]                    # the empty block before the assistant's turn
    begun = [*ASK, {"role": "assistant", "content": "Checking"}]
    cont = tokens(messages=begun, add_generation_prompt=False, continue_final_message=True)
    assert cont == template.encode(template.render(begun, add_generation_prompt=False)[:-len("<|im_end|>\n")])
    for body, param in (({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
                        ({"continue_final_message": True}, "continue_final_message"),     # with the generation prompt
                        ({"messages": [*ASK, {"role": "assistant", "content": ""}], "add_generation_prompt": False,
                          "continue_final_message": True}, "continue_final_message")):
        for path in ("/v1/chat/completions", "/tokenize"):
            extra = {"max_tokens": 4} if path.startswith("/v1") else {}
            status, _, out = raw(address, path, {"model": MODEL, "messages": ASK, **extra, **body})
            assert status == 400 and json.loads(out)["error"]["param"] == param, (path, body, out)
