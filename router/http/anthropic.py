"""Anthropic's Messages API (``POST /v1/messages``: what the Anthropic SDKs and Claude-Code-style agents call, as
vLLM serves it) on top of the chat path.

A Messages request is read as the chat request it amounts to (:func:`chat_body`): ``system`` becomes a system
message, each message's ``text`` blocks its content, an assistant's ``tool_use`` blocks its ``tool_calls`` and a
user's ``tool_result`` blocks ``tool`` messages (before the user's text), ``tools`` (``name``, ``description``,
``input_schema``) OpenAI's function tools, ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` chat's ``auto``
/ ``required`` / a named function / ``none``, ``stop_sequences`` ``stop``; a last assistant message with text is
an answer begun, which the model continues (vLLM's ``continue_final_message``), as Anthropic's prefill does. The
answer comes back as a ``message`` (:func:`message_object`) whose ``content`` holds a ``thinking`` block (with
``--reasoning-parser``), a ``text`` block and a ``tool_use`` block per call, with Anthropic's ``stop_reason``
(``end_turn``, ``max_tokens``, ``stop_sequence``, ``tool_use``) and usage; streams are in
:mod:`router.http.anthropic_events`. Errors take Anthropic's shape there (:mod:`router.http.errors`), and the key
may come as ``x-api-key``.

Refused by name: image and document blocks, server tools (``web_search``, ``bash``, ... : a ``type`` other than
``custom``), and ``thinking`` budgets are not enforced (a reasoning model thinks as its template lets it).
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import Field

from pdserve.model.tool_calls import json_object
from pdserve.router.http.errors import ApiError, validate_part
from pdserve.router.http.schemas import (
    CalledFunction,
    ChatCompletionRequest,
    ChatMessage,
    FunctionDefinition,
    FunctionName,
    Int32,
    MessageToolCall,
    NamedToolChoice,
    Strict,
    Tool,
    UnicodeBody,
)


class AnthropicTool(Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class AnthropicToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(Strict):
    type: Literal["enabled", "disabled"]
    budget_tokens: Int32 | None = None


class MessagesRequest(UnicodeBody):
    """``POST /v1/messages``; see the module docstring. Content blocks are read there (:func:`chat_messages`)."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1, le=2**31 - 1)]
    messages: Annotated[list[dict[str, Any]], Field(min_length=1)]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int32 | None = None
    stream: bool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: AnthropicToolChoice | None = None
    metadata: dict[str, Any] | None = None
    thinking: Thinking | None = None
    service_tier: Literal["auto", "standard_only"] | None = None


def chat_body(body: MessagesRequest) -> ChatCompletionRequest:
    """The chat request ``body`` amounts to (see the module docstring).

    Raises:
        ApiError: 400 naming a block, tool or choice that cannot be served.
    """
    messages = [ChatMessage(role="system", content=_text(body.system, "system"))] if body.system else []
    messages += chat_messages(body.messages)
    fields: dict[str, Any] = {name: getattr(body, name) for name in ("temperature", "top_p", "top_k")
                              if getattr(body, name) is not None}
    if body.stop_sequences:
        fields["stop"] = body.stop_sequences
    if body.tools:
        fields["tools"] = [_tool(t, i) for i, t in enumerate(body.tools)]
    choice = body.tool_choice
    last = messages[-1]
    if last.role == "assistant" and last.content and not last.tool_calls:   # a prefilled answer, continued
        fields |= {"add_generation_prompt": False, "continue_final_message": True}
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise ApiError(400, "`tool_choice` of type tool needs the tool's `name`", param="tool_choice.name")
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
            NamedToolChoice(type="function", function=FunctionName(name=choice.name))
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    return ChatCompletionRequest(model=body.model, messages=messages, max_tokens=body.max_tokens,
                                 stream=body.stream, **fields)


def _tool(tool: dict[str, Any], i: int) -> Tool:
    if tool.get("type") not in (None, "custom"):
        raise ApiError(400, f"only custom tools (name, description, input_schema) are served, got type "
                            f"`{tool.get('type')}`", param=f"tools.{i}.type")
    t = validate_part(AnthropicTool, tool, f"tools.{i}")
    given = {"name": t.name, "parameters": t.input_schema} | ({"description": t.description} if t.description else {})
    return Tool(type="function", function=FunctionDefinition(**given))


def chat_messages(items: list[dict[str, Any]]) -> list[ChatMessage]:
    """The chat messages of Anthropic ``messages``: a user's ``tool_result`` blocks become ``tool`` messages
    (before its text), an assistant's ``tool_use`` blocks its ``tool_calls``, ``thinking`` blocks are left out.

    Raises:
        ApiError: 400 naming the message or block (``messages.2.content.1``) that cannot be read.
    """
    out: list[ChatMessage] = []
    for i, m in enumerate(items):
        role, content, where = m.get("role"), m.get("content"), f"messages.{i}"
        if role not in ("user", "assistant"):
            raise ApiError(400, f"`{where}.role` must be user or assistant, got {role!r}", param=f"{where}.role")
        if isinstance(content, str):
            out.append(ChatMessage(role=role, content=content))
            continue
        if not isinstance(content, list):
            raise ApiError(400, f"`{where}.content` must be a string or a list of content blocks",
                           param=f"{where}.content")
        texts, calls = [], []
        for j, block in enumerate(content):
            at = f"{where}.content.{j}"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use" and role == "assistant":
                calls.append(_tool_use(block, at))
            elif kind == "tool_result" and role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise ApiError(400, f"`{at}.tool_use_id` must be a string", param=f"{at}.tool_use_id")
                out.append(ChatMessage(role="tool", tool_call_id=block["tool_use_id"],
                                       content=_text(block.get("content", ""), f"{at}.content")))
            elif kind not in ("thinking", "redacted_thinking"):
                raise ApiError(400, f"`{at}`: a {kind or 'malformed'} block is not served here (text, tool_use in "
                                    "assistant messages, tool_result in user messages)", param=at)
        if texts or calls or not content:
            out.append(ChatMessage(role=role, content="\n".join(texts) if texts or not calls else None,
                                   tool_calls=calls or None))
    return out


def _tool_use(block: dict[str, Any], at: str) -> MessageToolCall:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
            or not isinstance(block.get("input"), dict):
        raise ApiError(400, f"`{at}`: a tool_use block needs its `id`, `name` and `input` (an object)", param=at)
    return MessageToolCall(id=block["id"], function=CalledFunction(name=block["name"],
                                                                   arguments=json.dumps(block["input"])))


def _text(content: Any, where: str) -> str:
    """A string, or its ``text`` blocks joined by newlines."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                         and isinstance(b.get("text"), str) for b in content):
        return "\n".join(b["text"] for b in content)
    raise ApiError(400, f"`{where}` must be a string or a list of text blocks", param=where)


def new_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def message_object(message_id: str, model: str, content: list[dict], stop_reason: str | None,
                   stop_sequence: str | None, usage: dict[str, int]) -> dict[str, Any]:
    """A ``message`` object: its ``content`` blocks, why it stopped, and the usage in Anthropic's names."""
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}


def usage_of(chat_usage: dict | None, output_tokens: int = 0) -> dict[str, int]:
    """Anthropic's usage from a chat usage dict (None: nothing counted yet but ``output_tokens``)."""
    if chat_usage is None:
        return {"input_tokens": 0, "output_tokens": output_tokens, "cache_read_input_tokens": 0,
                "cache_creation_input_tokens": 0}
    cached = chat_usage["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": chat_usage["prompt_tokens"] - cached, "output_tokens": chat_usage["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def stop_of(finish_reason: str | None, stop_reason: str | int | None, called: bool) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)`` of an answer from the chat choice's finish and vLLM's stop reason."""
    if finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def content_blocks(chat: dict[str, Any]) -> tuple[list[dict], str, str | None]:
    """``(content, stop_reason, stop_sequence)`` of a whole chat completion body (one choice): its reasoning as a
    ``thinking`` block, its content as a ``text`` block (also when it is empty and nothing was called), each call
    as a ``tool_use`` block with its arguments parsed."""
    choice = chat["choices"][0]
    message = choice["message"]
    blocks = [{"type": "thinking", "thinking": message["reasoning"], "signature": ""}] \
        if message.get("reasoning") else []
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        blocks.append({"type": "text", "text": message.get("content") or ""})
    blocks += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                "input": json_object(c["function"]["arguments"]) or {}} for c in calls]
    return (blocks, *stop_of(choice["finish_reason"], choice.get("stop_reason"), bool(calls)))


def whole_message(message_id: str, model: str, chat: dict[str, Any]) -> dict[str, Any]:
    """The ``message`` object of a whole chat completion body (one choice)."""
    content, stop, sequence = content_blocks(chat)
    return message_object(message_id, model, content, stop, sequence, usage_of(chat["usage"]))
