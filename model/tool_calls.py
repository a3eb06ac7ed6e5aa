"""Tool calls in a model's answer: its text split into content and calls, in the format the checkpoint's
chat template taught it, as vLLM's tool parsers (``--tool-call-parser``) split it::

    hermes       text <tool_call>{"name": "f", "arguments": {...}}</tool_call> text <tool_call>...</tool_call>
                 (Hermes 2 Pro / 3, Qwen2.5, Qwen3: calls anywhere in the answer, any number)
    llama3_json  {"name": "f", "parameters": {...}}; {"name": "g", "parameters": {...}}
                 (Llama 3.1-3.3's JSON tool calling: an answer that starts with calls)
    granite      <|tool_call|>[{"name": "f", "arguments": {...}}, ...]
                 (Granite 3.x: an answer that starts with the marker, then an array of calls)
    mistral      [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]
                 (Mistral 7B v0.3, NeMo, Small: likewise; call ids of 9 letters and digits, which Mistral's
                 templates require when the calls come back in the conversation)
    pythonic     [get_weather(city="Paris"), get_time()]
                 (Llama 3.2 / Llama 4's pythonic calls, Llama 4's between <|python_start|> and <|python_end|>:
                 an answer that starts with them, read whole at its end)

All work on a stream (:meth:`ToolCallStream.feed` text as it is decoded, :meth:`ToolCallStream.finish` at
the end), and a whole answer is parsed by the same code in one feed (:func:`parse_tool_calls`), so a streamed
answer's content and calls are exactly the whole answer's, wherever the text was cut. Content is released as
soon as it cannot be the start of a call: hermes holds back only a tail that may begin ``<tool_call>``;
llama3_json decides at the answer's first non-blank character (``{`` or ``[``: calls), granite and mistral once
the answer's start is or is not their marker. A call's arguments stream as the model writes them, once its
``name`` is written before them (:mod:`model.tool_call_streams`).

With ``tool_choice`` ``required`` or a named function the answer is held to calls by a grammar
(:func:`forced_calls_schema`, :mod:`model.structured`), whatever the model's own format, as vLLM forces them,
and streamed the same way.

What is not a call stays content, word for word: a ``<tool_call>`` block whose body is not a JSON object with
a string ``name`` (and ``arguments`` an object, or JSON text of one), a block never closed before its call's
arguments began, or a llama3_json answer that does not start as calls. Blank text right after a call is
dropped (the newline between two calls is no content).
"""

from __future__ import annotations

from pdserve.model.tool_call_json import (
    CallDelta,
    ToolCall,
    ToolCallStream,
    call_of,
    json_object,
    mistral_call_id,
    new_call_id,
)
from pdserve.model.tool_call_streams import ArgumentsStream, CallListStream, HermesStream, PythonicStream

__all__ = ["CallDelta", "FORCED", "TOOL_CALL_PARSERS", "ToolCall", "ToolCallStream", "call_of", "forced_calls_schema",
           "json_object", "new_call_id", "parse_tool_calls", "tool_call_stream"]

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "granite", "mistral", "pythonic")


def forced_calls_schema(tools: list[dict], function: str | None, parallel: bool = True) -> dict:
    """The JSON Schema that holds an answer to calls of ``tools`` (OpenAI ``tools`` entries), as vLLM forces
    them: for a named ``function``, its ``parameters`` object (any object when it has none); for
    ``required``, an array of at least one (exactly one unless ``parallel``) ``{"name", "parameters"}``
    object, each a tool's name with its parameters."""
    def params(tool: dict) -> dict:
        return tool["function"].get("parameters") or {"type": "object"}
    if function is not None:
        return params(next(t for t in tools if t["function"]["name"] == function))
    one = [{"type": "object", "properties": {"name": {"enum": [t["function"]["name"]]}, "parameters": params(t)},
            "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    return {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}), "items": {"anyOf": one}}


STREAMS = {"hermes": HermesStream, "llama3_json": CallListStream,
           "granite": lambda: CallListStream(("arguments", "parameters"), marker="<|tool_call|>"),
           "mistral": lambda: CallListStream(("arguments",), marker="[TOOL_CALLS]", new_id=mistral_call_id),
           "pythonic": PythonicStream}
FORCED = "forced"   # tool_call_stream's mode of an answer a grammar held to calls: "forced" or "forced:<name>"


def tool_call_stream(parser: str) -> ToolCallStream:
    """A fresh stream parser of the format ``parser`` (one of :data:`TOOL_CALL_PARSERS`, or ``forced`` /
    ``forced:<function>`` for answers a grammar holds to calls: an array of ``{"name", "parameters"}`` objects,
    or the named function's arguments).

    Raises:
        ValueError: an unknown parser name.
    """
    if parser == FORCED:
        return CallListStream(("parameters",))
    if parser.startswith(FORCED + ":"):
        return ArgumentsStream(parser.partition(":")[2])
    if parser not in STREAMS:
        raise ValueError(f"unknown tool call parser {parser!r}: one of {', '.join(TOOL_CALL_PARSERS)}")
    return STREAMS[parser]()


def parse_tool_calls(parser: str, text: str) -> tuple[str, list[ToolCall]]:
    """``(content, calls)`` of a whole answer ``text`` in the format ``parser``.

    Raises:
        ValueError: an unknown parser name.
    """
    stream = tool_call_stream(parser)
    content, pieces = stream.feed(text)
    rest, more = stream.finish()
    calls: list[ToolCall] = []
    for piece in pieces + more:
        if piece.name is not None:
            calls.append(ToolCall(piece.name, piece.arguments, piece.id))
        else:
            calls[-1] = ToolCall(calls[-1].name, calls[-1].arguments + piece.arguments, calls[-1].id)
    return content + rest, calls
