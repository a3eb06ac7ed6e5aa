"""A chat request's prompt: OpenAI messages rendered by the chat template and tokenized (no special
tokens added: the template writes them), with the room left for the answer."""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from pdserve.model.chat_template import RESERVED, ChatTemplate, ChatTemplateError
from pdserve.model.config import ModelConfig
from pdserve.model.tokenizer import Tokenizer
from pdserve.model.tool_calls import json_object
from pdserve.router.config import RouterConfig
from pdserve.router.http.errors import ApiError
from pdserve.router.http.schemas import ChatMessage, TokenizeRequest, Tool
from pdserve.router.validation import check_tokenized

LONG_TEXT_CHARS = 4096  # rendered prompts longer than this are tokenized on a worker thread


class _Model(Protocol):
    cfg: RouterConfig
    model_cfg: ModelConfig
    tokenizer: Tokenizer


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """``messages`` as a chat template reads them: ``role``, ``content`` as one string (text parts
    joined by newlines), ``name`` when given, an assistant's ``tool_calls`` with their ``arguments`` parsed
    into objects (as transformers' templates expect them, and vLLM passes them), a tool message's
    ``tool_call_id``.

    Raises:
        ApiError: 400, a content part that is not text, a text part without its text, ``tool_calls`` on
            another role than the assistant's or with arguments that are not a JSON object, or a ``tool``
            message without its ``tool_call_id``.
    """
    out = []
    for i, m in enumerate(messages):
        if m.tool_calls is not None and m.role != "assistant":
            raise ApiError(400, "only assistant messages carry `tool_calls`", param=f"messages.{i}.tool_calls")
        if m.role == "tool" and m.tool_call_id is None:
            raise ApiError(400, "a tool message needs the `tool_call_id` it answers",
                           param=f"messages.{i}.tool_call_id")
        content = m.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type != "text":
                    raise ApiError(400, f"only text content parts are served, got type `{part.type}`",
                                   param=f"messages.{i}.content.{j}")
                if part.text is None:
                    raise ApiError(400, "a text content part needs its `text` (a string)",
                                   param=f"messages.{i}.content.{j}.text")
            content = "\n".join(part.text for part in content)
        item: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.name is not None:
            item["name"] = m.name
        if m.tool_calls is not None:
            item["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments, f"messages.{i}.tool_calls.{j}")}}
                for j, c in enumerate(m.tool_calls)]
        if m.tool_call_id is not None:
            item["tool_call_id"] = m.tool_call_id
        out.append(item)
    return out


def _arguments(text: str, where: str) -> dict[str, Any]:
    args = json_object(text)
    if args is None:
        raise ApiError(400, "a tool call's `arguments` must be JSON text of an object",
                       param=f"{where}.function.arguments")
    return args


def template_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """OpenAI ``tools`` as a chat template reads them: each entry as the client wrote it (absent fields
    stay absent); None when the request gives none."""
    return None if tools is None else [t.model_dump(exclude_unset=True) for t in tools]


async def chat_prompt(template: ChatTemplate, messages: list[ChatMessage], model: _Model,
                      add_generation_prompt: bool = True, tools: list[Tool] | None = None,
                      template_kwargs: dict[str, Any] | None = None, continue_final_message: bool = False,
                      reasoning_effort: str | None = None) -> tuple[list[int], int]:
    """``(prompt ids, room)``: the conversation's prompt ids (ending with the assistant's turn opened, when
    ``add_generation_prompt``; ``tools`` shown to the model as its template shows them), and the most tokens
    the answer can have (up to the context, at most ``max_tokens_limit``: the ``max_tokens`` of a request
    that gives none).

    Args:
        template_kwargs: vLLM's ``chat_template_kwargs``, further template variables (Qwen3's
            ``enable_thinking``, Granite's ``thinking``); the names the router sets itself are refused.
        continue_final_message: vLLM's: the prompt ends inside the last message (an assistant's answer begun),
            its text cut right after that message's content, so the model goes on writing it.
        reasoning_effort: OpenAI's, the template variable ``reasoning_effort`` of a template that reads it.

    Raises:
        ApiError: 400, both ``add_generation_prompt`` and ``continue_final_message``; a reserved template
            variable; ``reasoning_effort`` for a template that does not read it (it would change nothing); a
            last message with no text to continue, or whose text the template does not show; the
            template refused the conversation, or its text cannot fit the context (the gRPC API's message for a
            text prompt that long), or it tokenizes past the model's vocabulary.
    """
    if add_generation_prompt and continue_final_message:
        raise ApiError(400, "`continue_final_message` continues the last message: set `add_generation_prompt` "
                            "to false with it", param="continue_final_message")
    taken = sorted(set(template_kwargs or ()) & set(RESERVED))
    if taken:
        raise ApiError(400, f"`chat_template_kwargs` cannot set {', '.join(taken)} (the router sets them)",
                       param="chat_template_kwargs")
    if reasoning_effort is not None:
        if "reasoning_effort" not in template.source:
            raise ApiError(400, "this model's chat template does not read `reasoning_effort`, so it would change "
                                "nothing: leave it out", param="reasoning_effort")
        template_kwargs = {"reasoning_effort": reasoning_effort, **(template_kwargs or {})}
    shown = template_messages(messages)
    try:
        text = template.render(shown, add_generation_prompt=add_generation_prompt, tools=template_tools(tools),
                               **(template_kwargs or {}))
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc), param="messages") from None
    if continue_final_message:
        last = shown[-1].get("content") or ""
        at = text.rfind(last) if last else -1
        if at < 0:
            raise ApiError(400, "`continue_final_message` needs a last message whose text the chat template shows",
                           param="continue_final_message")
        text = text[:at + len(last)]
    context = model.model_cfg.max_model_len
    limit = context * model.tokenizer.max_token_chars
    if len(text) > limit:  # as router.validation refuses a long text before tokenizing it
        raise ApiError(400, f"prompt text of {len(text)} characters exceeds the model's context of {context} "
                            f"tokens (no text over {limit} characters fits)", param="messages")
    ids = await asyncio.to_thread(template.encode, text) if len(text) > LONG_TEXT_CHARS else template.encode(text)
    try:
        check_tokenized(ids, model.model_cfg.vocab_size, model.tokenizer)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="messages") from None
    return ids, max(1, min(context - len(ids), model.cfg.max_tokens_limit))


async def encode_prompt(text: str, model: _Model, add_special_tokens: bool = True) -> list[int]:
    """A completions prompt's token ids, as the router tokenizes a text prompt (its BOS only with
    ``add_special_tokens``); a long text off the event loop.

    Raises:
        ApiError: 400, a text too long for the context (the gRPC API's message for a text prompt that long).
    """
    context = model.model_cfg.max_model_len
    limit = context * model.tokenizer.max_token_chars
    if len(text) > limit:
        raise ApiError(400, f"prompt text of {len(text)} characters exceeds the model's context of {context} "
                            f"tokens (no text over {limit} characters fits)", param="prompt")
    if len(text) > LONG_TEXT_CHARS:
        return await asyncio.to_thread(model.tokenizer.encode, text, add_special_tokens)
    return model.tokenizer.encode(text, add_special_tokens)


async def tokenize_body(body: TokenizeRequest, model: _Model, template: ChatTemplate | None) -> dict:
    """vLLM's ``/tokenize`` answer: ``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs``
    None unless asked) for a prompt, tokenized as the completions endpoint tokenizes one, or for chat
    messages, as the chat endpoint renders and tokenizes them.

    Raises:
        ApiError: 400, a text too long for the context (as a completion's prompt), or messages without a chat
            template or refused as a chat request's (:func:`chat_prompt`).
    """
    if body.messages is not None:
        if template is None:
            raise ApiError(400, "the model has no chat template: tokenize a `prompt`", param="messages",
                           code="no_chat_template")
        ids, _ = await chat_prompt(template, body.messages, model, body.add_generation_prompt, body.tools,
                                   body.chat_template_kwargs, body.continue_final_message)
    else:
        ids = await encode_prompt(body.prompt, model, body.add_special_tokens)
    return {"count": len(ids), "max_model_len": model.model_cfg.max_model_len, "tokens": ids,
            "token_strs": model.tokenizer.token_strs(ids) if body.return_token_strs else None}
