"""From OpenAI request bodies to the router's ``GenerateRequest``, and from its messages back to
OpenAI's JSON (responses and stream chunks).

:func:`check_supported` refuses, by name, every parameter the router does not implement (or not yet:
``stop``, ``n`` > 1, ``logprobs``); :func:`generate_request` is the one place where an HTTP body's
sampling fields become protobuf fields, so a parameter the router learns is one line here (and its
name leaves :data:`NOT_YET`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.proto import pdserve_pb2
from pdserve.router.http.errors import ApiError
from pdserve.router.http.schemas import ChatCompletionRequest, SamplingBody

FINISH_REASON = {pdserve_pb2.FINISH_REASON_STOP: "stop", pdserve_pb2.FINISH_REASON_LENGTH: "length"}

# parameter -> (its neutral values, which are accepted, and what is refused): added to both APIs later
NOT_YET = {
    "stop": ((None, "", []), "`stop`"),
    "n": ((None, 1), "`n` other than 1"),
    "logprobs": ((None, False), "`logprobs`"),
    "top_logprobs": ((None, 0), "`top_logprobs`"),
}
# not implemented by the router
UNSUPPORTED = {
    "presence_penalty": ((None, 0), "`presence_penalty` other than 0"),
    "frequency_penalty": ((None, 0), "`frequency_penalty` other than 0"),
    "logit_bias": ((None, {}), "`logit_bias`"),
    "best_of": ((None, 1), "`best_of` other than 1"),
    "echo": ((None, False), "`echo`"),
    "suffix": ((None, ""), "`suffix`"),
    "tools": ((None, []), "`tools`"),
    "tool_choice": ((None, "none"), "`tool_choice`"),
    "parallel_tool_calls": ((None,), "`parallel_tool_calls`"),
    "functions": ((None, []), "`functions`"),
    "function_call": ((None, "none"), "`function_call`"),
    "response_format": ((None, {"type": "text"}), "`response_format` other than text"),
}


def check_supported(body: SamplingBody) -> None:
    """Refuse a body that asks for something the router does not do.

    Raises:
        ApiError: 400 naming every such parameter (``param``: the first), e.g. "not supported yet:
            `stop`; not supported: `presence_penalty` other than 0".
    """
    given = body.model_fields_set
    later = [(name, what) for name, (neutral, what) in NOT_YET.items()
             if name in given and not _neutral(getattr(body, name), neutral)]
    never = [(name, what) for name, (neutral, what) in UNSUPPORTED.items()
             if name in given and not _neutral(getattr(body, name), neutral)]
    parts = ([f"not supported yet: {', '.join(w for _, w in later)}"] if later else []) + (
        [f"not supported: {', '.join(w for _, w in never)}"] if never else [])
    if parts:
        raise ApiError(400, "; ".join(parts), param=(later + never)[0][0], code="unsupported_parameter")
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "`stream_options` is only allowed with `stream`: true", param="stream_options")
    if isinstance(body, ChatCompletionRequest) and None not in (body.max_tokens, body.max_completion_tokens) \
            and body.max_tokens != body.max_completion_tokens:
        raise ApiError(400, "`max_tokens` and `max_completion_tokens` differ: give one", param="max_tokens")


def _neutral(value: Any, neutral: tuple) -> bool:
    # a boolean is not a number here: completions' `logprobs: 0` asks for log-probabilities, `false` does not
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral)


def generate_request(body: SamplingBody, prompt: str | list[int], request_id: str,
                     max_tokens: int | None = None) -> pdserve_pb2.GenerateRequest:
    """The router's request for one prompt of ``body`` (text, tokenized by the router, or token ids).

    Args:
        max_tokens: when the body gives none (None: the router's ``default_max_tokens``).
    """
    s = pdserve_pb2.SamplingParams(top_k=0 if body.top_k in (None, -1) else body.top_k,  # vLLM: -1 is off
                                   stop_token_ids=body.stop_token_ids or (), ignore_eos=bool(body.ignore_eos))
    for name in ("temperature", "top_p", "seed"):
        if getattr(body, name) is not None:
            setattr(s, name, getattr(body, name))
    given = body.max_tokens
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        given = body.max_completion_tokens
    if given is not None or max_tokens is not None:
        s.max_tokens = given if given is not None else max_tokens
    req = pdserve_pb2.GenerateRequest(sampling=s, request_id=request_id)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


def prompts_of(prompt: str | list) -> list[str | list[int]]:
    """The prompts of a completions body: a string or token ids is one; a list of either, several
    (an empty list is one empty prompt, refused as the gRPC API refuses it)."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


@dataclass
class Choice:
    """One prompt's output so far: text, token ids and the router's ``final`` (None until it ends)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    final: pdserve_pb2.Final | None = None


def usage(finals: Sequence[pdserve_pb2.Final | None]) -> dict:
    """OpenAI's ``usage`` summed over choices (cached prompt tokens in ``prompt_tokens_details``)."""
    done = [f for f in finals if f is not None]
    prompt = sum(f.usage.prompt_tokens for f in done)
    completion = sum(f.usage.completion_tokens for f in done)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(f.usage.cached_prompt_tokens for f in done)}}


class Reply:
    """Builds one request's answer: a whole response or stream chunks, for completions or chat."""

    def __init__(self, chat: bool, model: str, return_token_ids: bool) -> None:
        self.chat, self.model, self.return_token_ids = chat, model, return_token_ids
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def response(self, choices: Sequence[Choice]) -> dict:
        """The non-streaming body: every choice whole, and the usage."""
        out = []
        for c in choices:
            reason = FINISH_REASON.get(c.final.finish_reason) if c.final is not None else None
            item: dict[str, Any] = {"index": c.index, "logprobs": None, "finish_reason": reason}
            if self.chat:
                item["message"] = {"role": "assistant", "content": c.text}
            else:
                item["text"] = c.text
            if self.return_token_ids:
                item["token_ids"] = c.token_ids
            out.append(item)
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": out,
                "usage": usage([c.final for c in choices])}

    def chunk(self, index: int, text: str | None, token_ids: Sequence[int] = (),
              final: pdserve_pb2.Final | None = None, role: bool = False) -> dict:
        """A stream chunk of choice ``index``: a text delta (chat: ``role`` opens the message; a
        ``final`` closes the choice with its finish reason)."""
        reason = FINISH_REASON.get(final.finish_reason) if final is not None else None
        item: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": reason}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            item["delta"] = delta
        else:
            item["text"] = text or ""
        if self.return_token_ids:
            item["token_ids"] = list(token_ids)
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [item]}

    def usage_chunk(self, finals: Sequence[pdserve_pb2.Final | None]) -> dict:
        """The last chunk under ``stream_options.include_usage``: no choices, the usage."""
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": usage(finals)}
