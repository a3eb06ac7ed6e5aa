"""From OpenAI request bodies to the router's ``GenerateRequest``, and from its messages back to
OpenAI's JSON (responses and stream chunks).

:func:`check_supported` refuses, by name, every parameter the router does not implement;
:func:`generate_request` is the one place where an HTTP body's sampling fields become protobuf fields,
so a parameter the router learns is one line here (and its name leaves :data:`NOT_YET`).

``n`` sequences of each prompt become choices ``prompt index x n + sequence index`` (the router's
``GenerateResponse.index``); the usage counts each prompt once. Log-probabilities take OpenAI's two
shapes: completions ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` (offsets into the
choice's text), chat ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.model.tool_calls import (
    FORCED,
    TOOL_CALL_PARSERS,
    ToolCall,
    ToolCallStream,
    forced_calls_schema,
    parse_tool_calls,
    tool_call_stream,
)
from pdserve.proto import pdserve_pb2
from pdserve.router.http.errors import ApiError
from pdserve.router.http.schemas import INT64, ChatCompletionRequest, ResponseFormat, SamplingBody, StructuredOutputs

FINISH_REASON = {pdserve_pb2.FINISH_REASON_STOP: "stop", pdserve_pb2.FINISH_REASON_LENGTH: "length"}

# parameter -> (its neutral values, which are accepted, and what is refused): added to both APIs later
NOT_YET: dict[str, tuple[tuple, str]] = {}
# not implemented by the router
UNSUPPORTED = {
    "best_of": ((None, 1), "`best_of` other than 1"),
    "suffix": ((None, ""), "`suffix`"),
    "functions": ((None, []), "`functions`"),
    "function_call": ((None, "none"), "`function_call`"),
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
    if isinstance(body, ChatCompletionRequest) and body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "`top_logprobs` needs `logprobs`: true", param="top_logprobs")
    if isinstance(body, ChatCompletionRequest) and None not in (body.max_tokens, body.max_completion_tokens) \
            and body.max_tokens != body.max_completion_tokens:
        raise ApiError(400, "`max_tokens` and `max_completion_tokens` differ: give one", param="max_tokens")


def tool_parser_for(body: ChatCompletionRequest, parser: str) -> str:
    """How ``body``'s answer is read for tool calls (:func:`model.tool_calls.tool_call_stream`'s mode): ``parser``
    (the router's ``--tool-call-parser``) when the request lets the model call its tools (``tool_choice`` ``auto``,
    the default with ``tools``); ``forced`` for ``required`` and ``forced:<name>`` for a named function, whose
    answers a grammar holds to calls (:func:`generate_request`), as vLLM forces them, with no parser needed; ""
    for ``none`` or no tools (the answer is all content, the tools still shown to the model, as vLLM shows them).

    Raises:
        ApiError: 400 for a ``tool_choice`` other than ``none`` without ``tools``; a named function that is not
            among them; ``required`` or a named function with a ``response_format`` or ``structured_outputs``
            (both hold the answer);
            ``auto`` on a router started without a tool call parser.
    """
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none")
    if choice == "none":
        return ""
    if not body.tools:
        raise ApiError(400, "`tool_choice` other than none needs `tools`", param="tool_choice")
    if choice != "auto":
        if body.response_format is not None and body.response_format.type != "text" \
                or body.structured_outputs is not None:
            raise ApiError(400, "`tool_choice` required or a named function holds the answer to tool calls: "
                                "give no `response_format` or `structured_outputs` with it", param="tool_choice")
        if choice == "required":
            return FORCED
        if choice.function.name not in {t.function.name for t in body.tools}:
            raise ApiError(400, f"`tool_choice` names {choice.function.name!r}, which is not among `tools`",
                           param="tool_choice")
        return f"{FORCED}:{choice.function.name}"
    if not parser:
        raise ApiError(400, "`tool_choice` auto (the default with `tools`) needs the router started with "
                            f"--tool-call-parser ({' or '.join(TOOL_CALL_PARSERS)})", param="tool_choice")
    return parser


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
                                   stop_token_ids=body.stop_token_ids or (), ignore_eos=bool(body.ignore_eos),
                                   include_stop_str_in_output=bool(body.include_stop_str_in_output))
    for name in ("temperature", "top_p", "seed", "n", "presence_penalty", "frequency_penalty", "repetition_penalty",
                 "min_tokens", "skip_special_tokens"):
        if getattr(body, name) is not None:
            setattr(s, name, getattr(body, name))
    for token, bias in (body.logit_bias or {}).items():
        token_id = _token_id(token)
        if token_id in s.logit_bias:
            raise ApiError(400, f"logit_bias names token {token_id} twice", param="logit_bias")
        s.logit_bias[token_id] = bias
    if body.stop:
        s.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop)
    if body.response_format is not None and body.response_format.type != "text":
        s.structured_output.CopyFrom(_structured_output(body.response_format))
    if body.structured_outputs is not None:
        if s.HasField("structured_output"):
            raise ApiError(400, "give `structured_outputs` or a `response_format` other than text, not both",
                           param="structured_outputs")
        s.structured_output.CopyFrom(_vllm_structured_outputs(body.structured_outputs))
    if isinstance(body, ChatCompletionRequest) and body.tools and body.tool_choice not in (None, "none", "auto"):
        named = None if body.tool_choice == "required" else body.tool_choice.function.name
        s.structured_output.json_schema = json.dumps(forced_calls_schema(
            [t.model_dump(exclude_unset=True) for t in body.tools], named, body.parallel_tool_calls is not False))
    if isinstance(body, ChatCompletionRequest):
        if body.logprobs:
            s.logprobs = body.top_logprobs or 0
    elif body.logprobs is not None:
        s.logprobs = body.logprobs
        if body.echo:   # the echoed prompt's tokens get theirs too, as vLLM gives them
            s.prompt_logprobs = body.logprobs
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


def _structured_output(fmt: ResponseFormat) -> pdserve_pb2.StructuredOutput:
    """``response_format`` ``json_object`` or ``json_schema`` as the router's ``StructuredOutput``.

    Raises:
        ApiError: 400 for ``json_schema`` without its ``json_schema.schema``.
    """
    if fmt.type == "json_object":
        return pdserve_pb2.StructuredOutput(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise ApiError(400, "`response_format` json_schema needs `json_schema.schema` (a JSON Schema object)",
                       param="response_format")
    return pdserve_pb2.StructuredOutput(json_schema=json.dumps(fmt.json_schema.schema_))


def _vllm_structured_outputs(so: StructuredOutputs) -> pdserve_pb2.StructuredOutput:
    """vLLM's ``structured_outputs`` as the router's ``StructuredOutput`` (the router checks the texts' sizes,
    the workers compile them).

    Raises:
        ApiError: 400 unless exactly one kind is given (``json_object`` false counts as none).
    """
    given = {k: v for k, v in (("json_schema", so.json_), ("regex", so.regex), ("choice", so.choice),
                               ("grammar", so.grammar), ("json_object", so.json_object or None)) if v is not None}
    if len(given) != 1:
        raise ApiError(400, "`structured_outputs` takes exactly one of json, regex, choice, grammar, json_object; "
                            f"got {len(given)}", param="structured_outputs")
    (kind, value), = given.items()
    if kind == "json_schema":
        return pdserve_pb2.StructuredOutput(json_schema=value if isinstance(value, str) else json.dumps(value))
    if kind == "choice":
        return pdserve_pb2.StructuredOutput(choice=pdserve_pb2.Choices(choices=value))
    return pdserve_pb2.StructuredOutput(**{kind: value})


def _token_id(key: str) -> int:
    """A ``logit_bias`` key: OpenAI's JSON object keys are token ids written as decimal strings.

    Raises:
        ApiError: 400 for a key that is not one.
    """
    if not re.fullmatch(r"-?[0-9]+", key):              # ASCII digits only: int() would take "1_0" and " 10 "
        raise ApiError(400, f"logit_bias keys must be token ids (decimal integers), got {key!r}",
                       param="logit_bias")
    token = int(key)
    if not INT64[0] <= token <= INT64[1]:
        raise ApiError(400, f"logit_bias key {key!r} is not a token id", param="logit_bias")
    return token


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
    logprobs: list[pdserve_pb2.TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[pdserve_pb2.TokenLogprob] = field(default_factory=list)  # echo: one per prompt token


def usage(finals: Sequence[pdserve_pb2.Final | None], n: int = 1) -> dict:
    """OpenAI's ``usage`` summed over choices (cached prompt tokens in ``prompt_tokens_details``); with
    ``n`` sequences per prompt (choices ``prompt x n + i``) each prompt counts once (sequence 0's)."""
    done = [f for f in finals if f is not None]
    firsts = [f for i, f in enumerate(finals) if f is not None and i % n == 0]
    prompt = sum(f.usage.prompt_tokens for f in firsts)
    completion = sum(f.usage.completion_tokens for f in done)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(f.usage.cached_prompt_tokens for f in firsts)}}


def _top(alternatives: Sequence[pdserve_pb2.TopLogprob]) -> dict[str, float]:
    out: dict[str, float] = {}
    for a in alternatives:  # two ids may share a text: keep the likelier (first)
        out.setdefault(a.token, a.logprob)
    return out


def completion_logprobs(logprobs: Sequence[pdserve_pb2.TokenLogprob], offset: int = 0,
                        prompt: Sequence[pdserve_pb2.TokenLogprob] = ()) -> dict:
    """The completions API's ``logprobs`` object; ``text_offset`` counts from ``offset`` (the length
    of the choice's text before these tokens). ``prompt`` (``echo``): the prompt's tokens first, the first one's
    logprob and alternatives null (nothing comes before it), as OpenAI's and vLLM's echo gives them."""
    offsets, tokens = [], [*prompt, *logprobs]
    for lp in tokens:
        offsets.append(offset)
        offset += len(lp.token)
    return {"tokens": [lp.token for lp in tokens],
            "token_logprobs": [None if i == 0 and prompt else lp.logprob for i, lp in enumerate(tokens)],
            "top_logprobs": [None if i == 0 and prompt else _top(lp.top) for i, lp in enumerate(tokens)],
            "text_offset": offsets}


def chat_logprobs(logprobs: Sequence[pdserve_pb2.TokenLogprob]) -> dict:
    """The chat API's ``logprobs`` object."""
    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
    return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(a.token, a.logprob) for a in lp.top]}
                        for lp in logprobs]}


def stop_reason(final: pdserve_pb2.Final | None) -> str | int | None:
    """vLLM's ``stop_reason`` of a choice: the stop string or stop token id that ended it, else None."""
    if final is None:
        return None
    which = final.WhichOneof("stop_reason")
    return getattr(final, which) if which else None


class Reply:
    """Builds one request's answer: a whole response or stream chunks, for completions or chat.

    Args:
        tool_parser: chat answers are split into content and ``tool_calls`` in this format
            (:mod:`model.tool_calls`; empty: all content); a choice with calls finishes with ``tool_calls``.
        parallel_tool_calls: False keeps a choice's first call only.
        echo: completions' ``echo``: each prompt's text (in prompt order), which its choices' text starts with
            (and their log-probabilities with its tokens', when they were asked for); None: no echo.
    """

    def __init__(self, chat: bool, model: str, return_token_ids: bool, n: int = 1,
                 logprobs: bool = False, tool_parser: str = "", parallel_tool_calls: bool = True,
                 echo: list[str] | None = None) -> None:
        self.chat, self.model, self.return_token_ids, self.n, self.echo = chat, model, return_token_ids, n, echo
        self.logprobs, self.tool_parser, self.parallel_tool_calls = logprobs, tool_parser, parallel_tool_calls
        self._offsets: dict[int, int] = {}  # choice -> text length streamed so far (completions' text_offset)
        self._tools: dict[int, ToolCallStream] = {}   # choice -> its tool call parser (streams)
        self._called: dict[int, int] = {}             # choice -> tool calls sent so far
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def response(self, choices: Sequence[Choice]) -> dict:
        """The non-streaming body: every choice whole, and the usage."""
        out = []
        for c in choices:
            reason = FINISH_REASON.get(c.final.finish_reason) if c.final is not None else None
            item: dict[str, Any] = {"index": c.index, "logprobs": self._logprobs(c.logprobs, 0, c.prompt_logprobs),
                                    "finish_reason": reason, "stop_reason": stop_reason(c.final)}
            if self.chat and self.tool_parser:
                content, calls = parse_tool_calls(self.tool_parser, c.text)
                calls = calls if self.parallel_tool_calls else calls[:1]
                item["message"] = {"role": "assistant", "content": content or (None if calls else "")}
                if calls:
                    item["message"]["tool_calls"] = [call.as_openai() for call in calls]
                    item["finish_reason"] = self._called_reason(reason)
            elif self.chat:
                item["message"] = {"role": "assistant", "content": c.text}
            else:
                item["text"] = self.echo_text(c.index) + c.text
            if self.return_token_ids:
                item["token_ids"] = c.token_ids
            out.append(item)
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": out,
                "usage": usage([c.final for c in choices], self.n)}

    def stream_text(self, index: int, text: str, end: bool = False) -> tuple[str, list[dict]]:
        """``(content, tool_calls delta entries)`` of choice ``index``'s next streamed ``text`` (and, with
        ``end``, of what its parser held back); ``(text, [])`` without a tool call parser."""
        if not self.tool_parser:
            return text, []
        stream = self._tools.setdefault(index, tool_call_stream(self.tool_parser))
        content, calls = stream.feed(text)
        if end:
            rest, more = stream.finish()
            content, calls = content + rest, calls + more
        return content, [self._call_delta(index, call) for call in calls if self.parallel_tool_calls
                         or not self._called.get(index)]

    def _called_reason(self, reason: str | None) -> str | None:
        """A choice's finish reason once it has called a tool: ``tool_calls``, but ``stop`` for a function
        ``tool_choice`` named (OpenAI's), where the model had no choice."""
        return reason if self.tool_parser.startswith(FORCED + ":") else "tool_calls"

    def _call_delta(self, index: int, call: ToolCall) -> dict:
        k = self._called[index] = self._called.get(index, 0) + 1
        return call.as_openai(k - 1)

    def chunk(self, index: int, text: str | None, token_ids: Sequence[int] = (),
              final: pdserve_pb2.Final | None = None, role: bool = False,
              logprobs: Sequence[pdserve_pb2.TokenLogprob] = (), tool_calls: Sequence[dict] = (),
              prompt_logprobs: Sequence[pdserve_pb2.TokenLogprob] = ()) -> dict:
        """A stream chunk of choice ``index``: a text delta (chat: ``role`` opens the message; a
        ``final`` closes the choice with its finish reason, ``tool_calls`` once it has called one), with its
        tokens' ``logprobs`` (after its echoed prompt's ``prompt_logprobs``) and the ``tool_calls`` entries
        :meth:`stream_text` gave."""
        reason = FINISH_REASON.get(final.finish_reason) if final is not None else None
        if final is not None and self._called.get(index):
            reason = self._called_reason(reason)
        offset = self._offsets.get(index, 0)
        self._offsets[index] = offset + len(text or "")
        item: dict[str, Any] = {"index": index, "finish_reason": reason, "stop_reason": stop_reason(final),
                                "logprobs": self._logprobs(logprobs, offset, prompt_logprobs) if logprobs else None}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None and (text or not tool_calls):
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = list(tool_calls)
            item["delta"] = delta
        else:
            item["text"] = text or ""
        if self.return_token_ids:
            item["token_ids"] = list(token_ids)
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [item]}

    def usage_chunk(self, finals: Sequence[pdserve_pb2.Final | None]) -> dict:
        """The last chunk under ``stream_options.include_usage``: no choices, the usage."""
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": usage(finals, self.n)}

    def echo_text(self, index: int) -> str:
        """The text choice ``index`` starts with: its prompt's under ``echo``, else nothing."""
        return self.echo[index // self.n] if self.echo is not None else ""

    def _logprobs(self, logprobs: Sequence[pdserve_pb2.TokenLogprob], offset: int,
                  prompt: Sequence[pdserve_pb2.TokenLogprob] = ()) -> dict | None:
        if not self.logprobs:
            return None
        return chat_logprobs(logprobs) if self.chat else completion_logprobs(logprobs, offset, prompt)
