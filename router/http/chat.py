"""A chat request's prompt: OpenAI messages rendered by the chat template and tokenized (no special
tokens added: the template writes them), with the room left for the answer."""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from pdserve.model.chat_template import ChatTemplate, ChatTemplateError
from pdserve.model.config import ModelConfig
from pdserve.model.tokenizer import Tokenizer
from pdserve.router.config import RouterConfig
from pdserve.router.http.errors import ApiError
from pdserve.router.http.schemas import ChatMessage, TokenizeRequest
from pdserve.router.validation import check_tokenized

LONG_TEXT_CHARS = 4096  # rendered prompts longer than this are tokenized on a worker thread


class _Model(Protocol):
    cfg: RouterConfig
    model_cfg: ModelConfig
    tokenizer: Tokenizer


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """``messages`` as a chat template reads them: ``role``, ``content`` as one string (text parts
    joined by newlines), and ``name`` when given.

    Raises:
        ApiError: 400, a content part that is not text, or a text part without its text.
    """
    out = []
    for i, m in enumerate(messages):
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
        out.append(item)
    return out


async def chat_prompt(template: ChatTemplate, messages: list[ChatMessage], model: _Model,
                      add_generation_prompt: bool = True) -> tuple[list[int], int]:
    """``(prompt ids, room)``: the conversation's prompt ids (ending with the assistant's turn opened, when
    ``add_generation_prompt``), and the most tokens the answer can have (up to the context, at most
    ``max_tokens_limit``: the ``max_tokens`` of a request that gives none).

    Raises:
        ApiError: 400, the template refused the conversation, or its text cannot fit the context (the
            gRPC API's message for a text prompt that long), or it tokenizes past the model's vocabulary.
    """
    try:
        text = template.render(template_messages(messages), add_generation_prompt=add_generation_prompt)
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc), param="messages") from None
    context = model.model_cfg.max_position_embeddings
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
        ids, _ = await chat_prompt(template, body.messages, model, body.add_generation_prompt)
    else:
        context = model.model_cfg.max_position_embeddings
        limit = context * model.tokenizer.max_token_chars
        if len(body.prompt) > limit:
            raise ApiError(400, f"prompt text of {len(body.prompt)} characters exceeds the model's context of "
                                f"{context} tokens (no text over {limit} characters fits)", param="prompt")
        ids = await asyncio.to_thread(model.tokenizer.encode, body.prompt, body.add_special_tokens) \
            if len(body.prompt) > LONG_TEXT_CHARS else model.tokenizer.encode(body.prompt, body.add_special_tokens)
    return {"count": len(ids), "max_model_len": model.model_cfg.max_position_embeddings, "tokens": ids,
            "token_strs": model.tokenizer.token_strs(ids) if body.return_token_strs else None}
