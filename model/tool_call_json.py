"""Tool calls as values: their ids, a whole call (:class:`ToolCall`) and a streamed piece of one
(:class:`CallDelta`), the parser protocol (:class:`ToolCallStream`), and the JSON reading the parsers of
:mod:`model.tool_call_streams` share: a call from a parsed object, the calls of a text, the header regex of a
call whose arguments can stream."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Protocol


def new_call_id() -> str:
    """A fresh tool call id (``call_`` and 24 hex digits, as OpenAI's look)."""
    return "call_" + uuid.uuid4().hex[:24]


def mistral_call_id() -> str:
    """A fresh tool call id of 9 letters and digits, the only ids Mistral's chat templates take back."""
    return uuid.uuid4().hex[:9]


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's ``name`` and its ``arguments`` as JSON text (OpenAI's wire form)."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def as_openai(self) -> dict:
        """OpenAI's ``tool_calls`` entry of a whole message."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class CallDelta:
    """A piece of the answer's ``call``-th tool call (from 0): the first piece of a call carries its ``name`` and
    ``id``, the later ones None; the pieces' ``arguments`` add up to the call's."""

    call: int
    arguments: str = ""
    name: str | None = None
    id: str | None = None

    def as_openai(self) -> dict:
        """OpenAI's stream delta entry: ``index``, and ``id``, ``type`` and the name on a call's first piece."""
        if self.name is None:
            return {"index": self.call, "function": {"arguments": self.arguments}}
        return {"index": self.call, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class ToolCallStream(Protocol):
    """The parser of one answer, fed its text in order."""

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        """``(content, call pieces)`` that ``text`` releases, after what was fed before."""
        ...

    def finish(self) -> tuple[str, list[CallDelta]]:
        """The rest, once the answer has ended: held-back text as content, or held calls."""
        ...


def json_object(text: str) -> dict | None:
    """``text`` parsed, when it is JSON text of an object; else None (not JSON, another value, or nested deeper
    than the parser's stack, which raises RecursionError)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


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


def json_calls(text: str, argument_keys: tuple[str, ...]) -> list[ToolCall] | None:
    """Every call of ``text``: JSON objects (or lists of them) separated by blanks, ``;``, ``,`` and brackets; None
    unless all of it parses (and it holds one call at least)."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] in ";,[]"):
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


def held_tail(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that ``marker`` starts with (shorter than ``marker``)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def header(keys: tuple[str, ...]) -> re.Pattern[str]:
    """A streamable call's start: ``{"name": "<name>", "<one of keys>":`` up to the ``{`` of its arguments
    (group ``name``: the name as a JSON string)."""
    return re.compile(r'\s*\{\s*"name"\s*:\s*(?P<name>"(?:[^"\\]|\\.)*")\s*,\s*"(?:' + "|".join(map(re.escape, keys))
                      + r')"\s*:\s*(?=\{)')
