"""From OpenAI request bodies to the router's ``GenerateRequest`` (the answers go back through
:mod:`router.http.reply`).

:func:`check_supported` refuses, by name, every parameter the router does not implement;
:func:`generate_request` is the one place where an HTTP body's sampling fields become protobuf fields,
so a parameter the router learns is one line here (and its name leaves :data:`NOT_YET`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from pdserve.model.tool_calls import (
    FORCED,
    TOOL_CALL_PARSERS,
    forced_calls_schema,
)
from pdserve.proto import pdserve_pb2
from pdserve.router.http.errors import ApiError
from pdserve.router.http.schemas import INT64, ChatCompletionRequest, ResponseFormat, SamplingBody, StructuredOutputs

# parameter -> (its neutral values, which are accepted, and what is refused): added to both APIs later
NOT_YET: dict[str, tuple[tuple, str]] = {}
# not implemented by the router
UNSUPPORTED = {
    "best_of": ((None, 1), "`best_of` other than 1"),
    "suffix": ((None, ""), "`suffix`"),
    "functions": ((None, []), "`functions`"),
    "function_call": ((None, "none"), "`function_call`"),
    "store": ((None, False), "`store` true (pdserve keeps no completions)"),
    "service_tier": ((None, "auto", "default"), "`service_tier` other than auto or default"),
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
                                   include_stop_str_in_output=bool(body.include_stop_str_in_output),
                                   bad_words=body.bad_words or (), allowed_token_ids=body.allowed_token_ids or ())
    for name in ("temperature", "top_p", "min_p", "seed", "n", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "min_tokens", "skip_special_tokens", "truncate_prompt_tokens"):
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
    if body.prompt_logprobs is not None:     # vLLM's: each prompt token's, in the reply's `prompt_logprobs`
        if body.stream:
            raise ApiError(400, "`prompt_logprobs` is not available with `stream`: true", param="prompt_logprobs")
        if s.HasField("prompt_logprobs") and s.prompt_logprobs != body.prompt_logprobs:
            raise ApiError(400, "with `echo`, `prompt_logprobs` must equal `logprobs` (the prompt's log-probabilities "
                                "are computed once)", param="prompt_logprobs")
        s.prompt_logprobs = body.prompt_logprobs
    given = body.max_tokens
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        given = body.max_completion_tokens
    if given is not None or max_tokens is not None:
        s.max_tokens = given if given is not None else max_tokens
    req = pdserve_pb2.GenerateRequest(sampling=s, request_id=request_id, priority=body.priority or 0,
                                      cache_salt=body.cache_salt or "")
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
