"""Request bodies of the HTTP API (pydantic, strict types, ``extra='forbid'``: an unknown field is a 400
naming it, never ignored).

Every OpenAI parameter a client may send is declared, so that one the router does not implement can
be refused by name (:func:`router.http.mapping.check_supported`) instead of passing unnoticed. Numbers
are bounded to the protobuf fields they end up in; their meaning is checked where the gRPC API checks
it (:func:`router.validation.validate`), with the same messages.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WrapValidator, model_validator
from pydantic_core import PydanticCustomError

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)

TokenId = Annotated[int, Field(ge=INT64[0], le=INT64[1])]
Int32 = Annotated[int, Field(ge=INT32[0], le=INT32[1])]


def one_of(description: str) -> WrapValidator:
    """One clear error for a union field instead of one per member type."""
    def check(value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("union_type", f"must be {description}") from None
    return WrapValidator(check)


Prompt = Annotated[str | list[TokenId] | list[str] | list[list[TokenId]],
                   one_of("a string, a list of token ids (64-bit integers), or a list of strings or of "
                           "token id lists")]
Stop = Annotated[str | list[str] | None, one_of("a string or a list of strings")]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def lone_surrogate(data: Any) -> str | None:
    """The path (``messages.0.content``) of a string of a parsed JSON body, key or value, that
    holds a lone UTF-16 surrogate (JSON's ``"\\ud800"`` escape without its pair: valid JSON, but no
    Unicode text, so UTF-8, protobuf and the tokenizer cannot take it); None if there is none. Walks
    without recursion, so a deeply nested body costs no stack."""
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not _is_text(value):
                return path or "body"
        elif isinstance(value, dict):
            for key, item in value.items():
                at = f"{path}.{key}" if path else str(key)
                if isinstance(key, str) and not _is_text(key):
                    return at.encode("utf-8", "backslashreplace").decode()   # a path that can be printed
                stack.append((item, at))
        elif isinstance(value, list):
            stack.extend((item, f"{path}.{i}" if path else str(i)) for i, item in enumerate(value))
    return None


def _is_text(s: str) -> bool:
    """Whether ``s`` is Unicode text (UTF-8 can encode it: no lone surrogate)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class StreamOptions(Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None     # vLLM's: with include_usage, every chunk carries the usage so far


class UnicodeBody(Strict):
    """A request body whose every string must be Unicode text."""

    @model_validator(mode="before")
    @classmethod
    def _unicode_text(cls, data: Any) -> Any:
        """Refuse a body with a lone surrogate anywhere (:func:`lone_surrogate`): a 400 naming where."""
        where = lone_surrogate(data)
        if where is not None:
            raise PydanticCustomError("invalid_unicode", "`{where}` holds a lone UTF-16 surrogate (a \\ud800-"
                                      "\\udfff escape without its pair): not Unicode text", {"where": where})
        return data


class JsonSchemaFormat(Strict):
    """``response_format.json_schema``: the answer must match ``schema`` (a JSON Schema object)."""

    name: str
    description: str | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    strict: bool | None = None


class StructuredOutputs(Strict):
    """vLLM's ``structured_outputs`` (exactly one key): ``json`` (a JSON Schema, object or text), ``regex``,
    ``choice`` (the answer is one of these strings), ``grammar`` (xgrammar's EBNF, start rule ``root``) or
    ``json_object`` (true: any JSON object). vLLM's ``whitespace_pattern`` and ``structural_tag`` are not
    accepted (400 naming them)."""

    json_: Annotated[dict[str, Any] | str | None, Field(alias="json")] = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class ResponseFormat(Strict):
    """``response_format``: ``text`` (free), ``json_object`` (any JSON object) or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingBody(UnicodeBody):
    """The fields both endpoints share: sampling, streaming, the model, and the parameters refused by
    name. The vLLM extensions ``top_k`` (-1 or 0: off), ``min_p``, ``truncate_prompt_tokens``, ``stop_token_ids``,
    ``ignore_eos``, ``repetition_penalty``, ``min_tokens``, ``skip_special_tokens``, ``include_stop_str_in_output``,
    ``bad_words``, ``allowed_token_ids``, ``prompt_logprobs``, ``priority``, ``cache_salt`` and ``return_token_ids``
    (token ids beside the text) are accepted too."""

    model: str | None = None
    max_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: Annotated[int, Field(ge=0, lt=2**64)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: Int32 | None = None
    min_p: float | None = None
    truncate_prompt_tokens: Int32 | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    return_token_ids: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[TokenId] | None = None
    prompt_logprobs: Int32 | None = None
    priority: Int32 | None = None
    cache_salt: str | None = None
    # stop strings and n sequences per prompt (router/http/mapping.py)
    stop: Stop = None
    n: Int32 | None = None
    # logit bias, penalties and min_tokens (model/penalties.py); repetition_penalty and min_tokens are vLLM's
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: Int32 | None = None
    # structured output (model/structured.py): OpenAI's response_format, on completions too as in vLLM, and
    # vLLM's structured_outputs
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # OpenAI fields that do not change an answer here, accepted as OpenAI's SDKs and agents send them: `store`
    # false (true is refused: nothing is kept), `metadata` (tags for stored completions), `service_tier` auto or
    # default, and the routing and abuse hints `prompt_cache_key` and `safety_identifier` (the router routes on
    # the prompt's cached prefix itself)
    store: bool | None = None
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=16)] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class CompletionRequest(SamplingBody):
    """``POST /v1/completions``: ``prompt`` is a string, token ids, or a list of either (one choice per prompt)."""

    prompt: Prompt
    logprobs: Int32 | None = None
    best_of: Int32 | None = None
    echo: bool | None = None
    suffix: str | None = None
    add_special_tokens: bool = True      # vLLM's: false tokenizes text prompts without their BOS


class ContentPart(BaseModel):
    """A part of a message's content; only ``{"type": "text", "text": ...}`` is served."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class FunctionDefinition(Strict):
    """A tool's function: OpenAI's name rule (letters, digits, ``_`` and ``-``, 1 to 64), a JSON Schema of
    its ``parameters``; shown to the model by the chat template as the client wrote it."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class CalledFunction(Strict):
    """The function an assistant message called: ``arguments`` is JSON text, as OpenAI sends it."""

    name: str
    arguments: str


class MessageToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class ChatMessage(Strict):
    """One message: a ``tool`` message answers the assistant's call ``tool_call_id``; an assistant
    message may carry the ``tool_calls`` it made (its ``content`` then may be null)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingBody):
    """``POST /v1/chat/completions``: ``messages`` rendered by the chat template into one prompt."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Int32 | None = None
    logprobs: bool | None = None
    top_logprobs: Int32 | None = None
    tools: list[Tool] | None = None
    tool_choice: Annotated[Literal["none", "auto", "required"] | NamedToolChoice | None,
                           one_of('"none", "auto", "required" or an object naming a function')
                           ] = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat extras (router/http/chat.py): template variables, and a prompt that continues the last message
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # OpenAI's, given to a chat template that reads it (gpt-oss-style templates) as `reasoning_effort`
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    functions: list[Any] | None = None
    function_call: Any = None


# OpenAI's Responses API (router/http/responses.py)

class FunctionTool(Strict):
    """A Responses function tool: the chat API's ``function`` object, flat, beside ``type``."""

    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with its ``name`` and ``schema`` flat."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    strict: bool | None = None


class TextOptions(Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningOptions(Strict):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesStreamOptions(Strict):
    include_obfuscation: bool | None = None


class ResponsesRequest(UnicodeBody):
    """``POST /v1/responses`` (:mod:`router.http.responses`): ``input`` is a string or a list of items, read
    there. vLLM's sampling extras ``top_k``, ``min_p``,
    ``repetition_penalty``, ``seed``, ``stop``, ``priority`` and ``cache_salt`` are accepted too."""

    model: str | None = None
    input: Annotated[str | list[dict[str, Any]], one_of("a string or a list of input items")]
    instructions: str | None = None
    max_output_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Annotated[Literal["none", "auto", "required"] | FunctionChoice | None,
                           one_of('"none", "auto", "required" or an object naming a function')] = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    store: bool | None = None
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=16)] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None
    top_logprobs: Int32 | None = None
    max_tool_calls: Int32 | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    # vLLM's sampling extras
    top_k: Int32 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: Annotated[int, Field(ge=0, lt=2**64)] | None = None
    stop: Stop = None
    priority: Int32 | None = None
    cache_salt: str | None = None


class TokenizeRequest(UnicodeBody):
    """vLLM's ``POST /tokenize``: a ``prompt`` (tokenized as a completions prompt is, BOS included unless
    ``add_special_tokens`` is false) or chat ``messages`` (rendered by the chat template with ``tools``, the
    assistant's turn opened unless ``add_generation_prompt`` is false), exactly one of them."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_prompt(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise PydanticCustomError("one_prompt", "give exactly one of `prompt` and `messages`")
        return self


class DetokenizeRequest(Strict):
    """vLLM's ``POST /detokenize``: the text of ``tokens``."""

    model: str | None = None
    tokens: list[TokenId]
