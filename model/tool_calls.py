"""Tool calls in a model's answer: its text split into content and calls, in the format the checkpoint's
chat template taught it, as vLLM's tool parsers (``--tool-call-parser``) split it::

    hermes       text <tool_call>{"name": "f", "arguments": {...}}</tool_call> text <tool_call>...</tool_call>
                 (Hermes 2 Pro / 3, Qwen2.5, Qwen3: calls anywhere in the answer, any number)
    llama3_json  {"name": "f", "parameters": {...}}; {"name": "g", "parameters": {...}}
                 (Llama 3.1-3.3's JSON tool calling: the whole answer is calls, or none of it is)

Both work on a stream (:meth:`ToolCallStream.feed` text as it is decoded, :meth:`ToolCallStream.finish` at
the end), and a whole answer is parsed by the same code in one feed (:func:`parse_tool_calls`), so a streamed
answer's content and calls are exactly the whole answer's, wherever the text was cut. Content is released as
soon as it cannot be the start of a call: hermes holds back only a tail that may begin ``<tool_call>``;
llama3_json decides at the answer's first non-blank character (``{`` or ``[``: calls, held to the end).

With ``tool_choice`` ``required`` or a named function the answer is held to calls by a grammar
(:func:`forced_calls_schema`, :mod:`model.structured`), whatever the model's own format, as vLLM forces them;
:class:`ForcedCallsStream` reads that answer.

What is not a well-formed call stays content, word for word: a ``<tool_call>`` block whose body is not a JSON
object with a string ``name`` (and ``arguments`` an object, or JSON text of one), one never closed, or a
llama3_json answer that does not parse whole. Blank text right after a call is dropped (the newline between
two calls is no content).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Protocol

TOOL_CALL_PARSERS = ("hermes", "llama3_json")


def new_call_id() -> str:
    """A fresh tool call id (``call_`` and 24 hex digits, as OpenAI's look)."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's ``name`` and its ``arguments`` as compact JSON text (OpenAI's wire form)."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def as_openai(self, index: int | None = None) -> dict:
        """OpenAI's ``tool_calls`` entry (a stream's delta entry carries the call's ``index`` too)."""
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


class ToolCallStream(Protocol):
    """The parser of one answer, fed its text in order."""

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """``(content, calls)`` that ``text`` completes, after what was fed before."""
        ...

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The rest, once the answer has ended: held-back text as content, or the held calls."""
        ...


def call_of(obj: object, argument_keys: tuple[str, ...]) -> ToolCall | None:
    """The call a parsed JSON value describes: an object with a string ``name`` and its arguments under the
    first of ``argument_keys`` present (an object, or a string of JSON text that holds one; absent: ``{}``);
    None for anything else."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in argument_keys if k in obj), {})
    if isinstance(args, str):
        args = json_object(args)
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def json_object(text: str) -> dict | None:
    """``text`` parsed, when it is JSON text of an object; else None (not JSON, another value, or nested deeper
    than the parser's stack, which raises RecursionError)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


class _Content:
    """Content text out of a parser, less the blank text right after a call."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.after_call = False

    def add(self, text: str) -> None:
        if self.after_call:
            text = text.lstrip()
            if not text:
                return
            self.after_call = False
        self.parts.append(text)

    def take(self) -> str:
        out, self.parts = "".join(self.parts), []
        return out


def _held_tail(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that ``marker`` starts with (shorter than ``marker``)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class HermesStream:
    """``<tool_call>`` JSON ``</tool_call>`` blocks among content (see the module docstring)."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buf, self._in_call, self._out = "", False, _Content()

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        calls: list[ToolCall] = []
        while True:
            if not self._in_call:
                at = self._buf.find(self.START)
                if at < 0:
                    keep = _held_tail(self._buf, self.START)
                    self._out.add(self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return self._out.take(), calls
                self._out.add(self._buf[:at])
                self._buf, self._in_call = self._buf[at + len(self.START):], True
            else:
                end = self._buf.find(self.END)
                if end < 0:
                    return self._out.take(), calls
                body, self._buf, self._in_call = self._buf[:end], self._buf[end + len(self.END):], False
                call = _json_call(body, ("arguments",))
                if call is None:
                    self._out.add(self.START + body + self.END)
                else:
                    calls.append(call)
                    self._out.after_call = True

    def finish(self) -> tuple[str, list[ToolCall]]:
        self._out.add((self.START if self._in_call else "") + self._buf)
        self._buf, self._in_call = "", False
        return self._out.take(), []


def _json_call(body: str, argument_keys: tuple[str, ...]) -> ToolCall | None:
    obj = json_object(body)
    return None if obj is None else call_of(obj, argument_keys)


class Llama3JsonStream:
    """An answer of JSON calls separated by ``;`` (see the module docstring)."""

    KEYS = ("parameters", "arguments")

    def __init__(self) -> None:
        self._buf, self._calls = "", None   # _calls: None undecided, False content, True calls

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        if self._calls is False:
            return text, []
        self._buf += text
        head = self._buf.lstrip()
        if not head:
            return "", []
        self._calls = head[0] in "{["
        if self._calls:
            return "", []
        out, self._buf = self._buf, ""
        return out, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        text, self._buf = self._buf, ""
        if not self._calls:
            return text, []
        calls = _json_calls(text, self.KEYS)
        return ("", calls) if calls else (text, [])


def _json_calls(text: str, argument_keys: tuple[str, ...]) -> list[ToolCall] | None:
    """Every call of ``text``: JSON objects (or lists of them) separated by blanks and ``;``; None unless
    all of it parses."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
        if at == len(text):
            return calls or None
        try:
            value, at = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            return None
        for item in value if isinstance(value, list) else [value]:
            call = call_of(item, argument_keys)
            if call is None:
                return None
            calls.append(call)


class ForcedCallsStream:
    """An answer a grammar held to calls (``tool_choice`` ``required`` or a named function, see
    :func:`forced_calls_schema`): held whole, read at the end; text that does not parse (an answer cut short
    by ``max_tokens``) stays content."""

    def __init__(self, function: str | None) -> None:
        self._function, self._buf = function, ""

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        return "", []

    def finish(self) -> tuple[str, list[ToolCall]]:
        text, self._buf = self._buf, ""
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            return text, []
        if self._function is not None:      # the answer is the named function's arguments
            return ("", [ToolCall(self._function, json.dumps(value, ensure_ascii=False))]) if isinstance(
                value, dict) else (text, [])
        calls = [call_of(item, ("parameters",)) for item in value] if isinstance(value, list) else [None]
        return ("", calls) if calls and None not in calls else (text, [])   # type: ignore[return-value]


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


STREAMS = {"hermes": HermesStream, "llama3_json": Llama3JsonStream}
FORCED = "forced"   # tool_call_stream's mode of an answer a grammar held to calls: "forced" or "forced:<name>"


def tool_call_stream(parser: str) -> ToolCallStream:
    """A fresh stream parser of the format ``parser`` (one of :data:`TOOL_CALL_PARSERS`, or ``forced`` /
    ``forced:<function>`` for answers held to calls: :class:`ForcedCallsStream`).

    Raises:
        ValueError: an unknown parser name.
    """
    if parser == FORCED or parser.startswith(FORCED + ":"):
        return ForcedCallsStream(parser.partition(":")[2] or None)
    if parser not in STREAMS:
        raise ValueError(f"unknown tool call parser {parser!r}: one of {', '.join(TOOL_CALL_PARSERS)}")
    return STREAMS[parser]()


def parse_tool_calls(parser: str, text: str) -> tuple[str, list[ToolCall]]:
    """``(content, calls)`` of a whole answer ``text`` in the format ``parser``.

    Raises:
        ValueError: an unknown parser name.
    """
    stream = tool_call_stream(parser)
    content, calls = stream.feed(text)
    rest, more = stream.finish()
    return content + rest, calls + more
