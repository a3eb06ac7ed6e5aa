"""OpenAI's Responses API (``POST /v1/responses``) on top of the chat path.

A Responses request is read as the chat request it amounts to (:func:`chat_body`): ``instructions`` become a
system message, ``input`` (a string, or message, ``function_call`` and ``function_call_output`` items) the
conversation, flat function ``tools`` OpenAI's chat tools, ``text.format`` the ``response_format``,
``max_output_tokens`` ``max_tokens`` and ``reasoning.effort`` ``reasoning_effort``. It then runs as a chat
completion does (chat template, tool call and reasoning parsers, the router's own ``generate`` path), and its
answer is written back as a ``response`` object (:func:`response_object`): a ``reasoning`` item (with
``--reasoning-parser``), a ``message`` item with one ``output_text`` part, and a ``function_call`` item per tool
call; ``status`` ``incomplete`` (``incomplete_details.reason`` ``max_output_tokens``) for an answer cut by the
token limit. Streams are in :mod:`router.http.response_events`.

Nothing is stored (as vLLM without its response store): ``store`` is accepted and ignored, and what needs a
stored response (``previous_response_id``, ``conversation``, ``item_reference`` inputs, ``background``) is
refused by name, as are tools other than functions and inputs other than text.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pdserve.router.http.errors import ApiError, validate_part
from pdserve.router.http.schemas import (
    CalledFunction,
    ChatCompletionRequest,
    ChatMessage,
    FunctionDefinition,
    FunctionName,
    FunctionTool,
    JsonSchemaFormat,
    MessageToolCall,
    NamedToolChoice,
    ResponseFormat,
    ResponsesRequest,
    Tool,
)

TEXT_PARTS = ("input_text", "output_text", "text")   # content part types whose text is read


# field -> (accepted values, what is refused)
REFUSED: dict[str, tuple[tuple, str]] = {
    "previous_response_id": ((None,), "`previous_response_id` (pdserve stores no responses: send the whole input)"),
    "conversation": ((None,), "`conversation` (pdserve stores no conversations: send the whole input)"),
    "background": ((None, False), "`background` true"),
    "prompt": ((None,), "`prompt` (stored prompt templates)"),
    "truncation": ((None, "disabled"), "`truncation` auto"),
    "include": ((None, []), "`include`"),
    "top_logprobs": ((None, 0), "`top_logprobs`"),
    "max_tool_calls": ((None,), "`max_tool_calls`"),
    "service_tier": ((None, "auto", "default"), "`service_tier` other than auto or default"),
}
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop", "priority", "cache_salt",
            "metadata", "user", "safety_identifier", "prompt_cache_key", "service_tier")


def chat_body(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request ``body`` amounts to (see the module docstring).

    Raises:
        ApiError: 400 naming a refused field (:data:`REFUSED`), a tool that is not a function, or an input item
            that cannot be read (its index and field named).
    """
    refused = [(name, what) for name, (ok, what) in REFUSED.items()
               if name in body.model_fields_set and getattr(body, name) not in ok]
    if refused:
        raise ApiError(400, "not supported: " + ", ".join(what for _, what in refused), param=refused[0][0],
                       code="unsupported_parameter")
    messages = [ChatMessage(role="system", content=body.instructions)] if body.instructions is not None else []
    messages += input_messages(body.input)
    if not messages:
        raise ApiError(400, "`input` holds no message", param="input")
    fields: dict[str, Any] = {name: getattr(body, name) for name in SAMPLING if name in body.model_fields_set}
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_schema" and (fmt.name is None or fmt.schema_ is None):
            raise ApiError(400, "`text.format` json_schema needs its `name` and `schema`", param="text.format")
        fields["response_format"] = ResponseFormat(type=fmt.type, json_schema=None if fmt.type != "json_schema" else
                                                   JsonSchemaFormat(name=fmt.name, schema=fmt.schema_,
                                                                    description=fmt.description, strict=fmt.strict))
    if body.tools is not None:
        fields["tools"] = [_tool(t, i) for i, t in enumerate(body.tools)]
    if body.tool_choice is not None:
        choice = body.tool_choice
        fields["tool_choice"] = choice if isinstance(choice, str) else NamedToolChoice(
            type="function", function=FunctionName(name=choice.name))
    if body.reasoning is not None and body.reasoning.effort is not None:
        fields["reasoning_effort"] = body.reasoning.effort
    return ChatCompletionRequest(model=body.model, messages=messages, max_tokens=body.max_output_tokens,
                                 stream=body.stream, parallel_tool_calls=body.parallel_tool_calls, **fields)


def _tool(tool: dict[str, Any], i: int) -> Tool:
    if tool.get("type") != "function":
        raise ApiError(400, f"only function tools are served, got type `{tool.get('type')}`", param=f"tools.{i}.type",
                       code="unsupported_parameter")
    t = validate_part(FunctionTool, tool, f"tools.{i}")    # the fields the client gave only: the template shows them
    return Tool(type="function", function=FunctionDefinition(**t.model_dump(exclude_unset=True, exclude={"type"})))


def input_messages(items: str | list[dict[str, Any]]) -> list[ChatMessage]:
    """The chat messages of a Responses ``input``: a string is one user message; ``message`` items (or items with
    a ``role`` and no ``type``) are messages, their text parts joined; ``function_call`` items join the assistant
    message before them as its ``tool_calls`` (or make one); ``function_call_output`` items are ``tool``
    messages; ``reasoning`` items are left out (chat templates drop earlier turns' reasoning).

    Raises:
        ApiError: 400 naming the item (``input.3``) and what cannot be read.
    """
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    out: list[ChatMessage] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message" if "role" in item else None)
        where = f"input.{i}"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ApiError(400, f"`{where}.role` must be user, system, developer or assistant, got {role!r}",
                               param=f"{where}.role")
            out.append(ChatMessage(role=role, content=_text(item.get("content"), f"{where}.content")))
        elif kind == "function_call":
            call = _fields(item, where, ("call_id", "name", "arguments"))
            tool_call = MessageToolCall(id=call["call_id"], function=CalledFunction(name=call["name"],
                                                                                    arguments=call["arguments"]))
            if out and out[-1].role == "assistant":
                out[-1].tool_calls = [*(out[-1].tool_calls or []), tool_call]
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[tool_call]))
        elif kind == "function_call_output":
            call_id = _fields(item, where, ("call_id",))["call_id"]
            out.append(ChatMessage(role="tool", tool_call_id=call_id,
                                   content=_text(item.get("output"), f"{where}.output")))
        elif kind != "reasoning":
            raise ApiError(400, f"`{where}.type` {kind!r} is not served (message, function_call, "
                                "function_call_output or reasoning items)", param=f"{where}.type")
    return out


def _fields(item: dict[str, Any], where: str, names: tuple[str, ...]) -> dict[str, str]:
    for name in names:
        if not isinstance(item.get(name), str):
            raise ApiError(400, f"`{where}.{name}` must be a string", param=f"{where}.{name}")
    return item


def _text(content: Any, where: str) -> str:
    """A message's (or a function output's) text: a string, or its text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"`{where}` must be a string or a list of text parts", param=where)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ApiError(400, f"only text parts are served (input_text with its `text`), got `{kind}`",
                           param=f"{where}.{j}")
        texts.append(part["text"])
    return "\n".join(texts)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_object(response_id: str, body: ResponsesRequest, model: str, created: float, status: str,
                    output: list[dict[str, Any]], chat_usage: dict | None = None) -> dict[str, Any]:
    """A ``response`` object: ``status`` (``in_progress``, ``completed`` or ``incomplete``), its ``output``
    items, the request's settings echoed, and the usage in the Responses API's names."""
    body_format = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format \
        else {"type": "text"}
    choice = body.tool_choice if body.tool_choice is not None else "auto"
    out: dict[str, Any] = {
        "id": response_id, "object": "response", "created_at": created, "status": status, "model": model,
        "output": output, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": None, "reasoning": {"effort": body.reasoning.effort if body.reasoning else None,
                                                    "summary": None},
        "store": False, "temperature": body.temperature, "top_p": body.top_p,
        "text": {"format": body_format}, "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
        "tools": body.tools or [], "truncation": "disabled", "user": body.user, "usage": None}
    if chat_usage is not None:
        out["usage"] = {"input_tokens": chat_usage["prompt_tokens"],
                        "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
                        "output_tokens": chat_usage["completion_tokens"],
                        "output_tokens_details": {"reasoning_tokens": 0},
                        "total_tokens": chat_usage["total_tokens"]}
    return out


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    content = [] if status == "in_progress" else [output_text(text)]
    return {"id": item_id or new_id("msg"), "type": "message", "status": status, "role": "assistant",
            "content": content}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    content = [] if status == "in_progress" else [{"type": "reasoning_text", "text": text}]
    return {"id": item_id or new_id("rs"), "type": "reasoning", "summary": [], "content": content, "status": status}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed",
              item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or new_id("fc"), "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_items(chat: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """``(output items, status)`` of a whole chat completion body (one choice): its reasoning, its content (an
    empty message when it has neither content nor calls) and its tool calls, in that order; ``incomplete``
    when the answer was cut by its token limit, else ``completed``."""
    choice = chat["choices"][0]
    message = choice["message"]
    items = [reasoning_item(message["reasoning"])] if message.get("reasoning") else []
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append(message_item(message.get("content") or ""))
    items += [call_item(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]
    return items, "incomplete" if choice["finish_reason"] == "length" else "completed"


def whole_response(response_id: str, body: ResponsesRequest, model: str, created: float, chat: dict) -> dict:
    """The ``response`` object of a whole chat completion body (one choice)."""
    items, status = output_items(chat)
    return response_object(response_id, body, model, created, status, items, chat["usage"])


def now() -> float:
    return float(int(time.time()))
