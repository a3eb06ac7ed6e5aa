"""The tool call parsers of :mod:`model.tool_calls`, each read a piece of text at a time: content out as soon as it
cannot start a call, and a call's arguments out as the model writes them (:class:`CallDelta`), as vLLM streams
them, so that a client sees a long argument grow.

A call is streamed once its header is written: a JSON object whose first key is ``"name"`` (a string) and whose
second is the arguments' key, whose value opens with ``{`` (:func:`~model.tool_call_json.header`). From there its
arguments are the model's own text up to the brace that closes them (JSON strings and nesting followed,
:class:`_Arguments`), so what streams is what a whole answer's call holds. A call written another way (keys in
another order, arguments as a string of JSON, none) is read whole where it ends, and sent in one piece with its
arguments re-serialized.
A streamed call cut short (``max_tokens``, or a block closed inside its arguments) keeps what was written: a
client cannot take back what it was sent, so the whole answer reads it the same way.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Callable

from pdserve.model.tool_call_json import (
    CallDelta,
    ToolCall,
    call_of,
    header,
    held_tail,
    json_calls,
    json_object,
    new_call_id,
)


class Content:
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


class Calls:
    """The call pieces of one answer, numbered, consecutive pieces of a call merged."""

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        self.count, self._new_id = 0, new_id
        self._out: list[CallDelta] = []

    def start(self, name: str) -> None:
        self._out.append(CallDelta(self.count, "", name, self._new_id()))
        self.count += 1

    def whole(self, call: ToolCall) -> None:
        self._out.append(CallDelta(self.count, call.arguments, call.name, self._new_id()))
        self.count += 1

    def arguments(self, text: str) -> None:
        if not text:
            return
        last = self._out[-1] if self._out else None
        if last is not None and last.call == self.count - 1:
            self._out[-1] = CallDelta(last.call, last.arguments + text, last.name, last.id)
        else:
            self._out.append(CallDelta(self.count - 1, text))

    def take(self) -> list[CallDelta]:
        out, self._out = self._out, []
        return out


class _Arguments:
    """Where a call's arguments object closes, read a piece at a time: braces and brackets counted outside JSON
    strings (escapes followed)."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escape = 0, False, False

    def read(self, text: str, stop: str = "") -> tuple[int, str]:
        """``(n, how)``: the first ``n`` characters of ``text`` are arguments, and then ``how`` they end: ``"closed"``
        (the ``n``-th closed them), ``"stop"`` (``stop`` follows, outside a string), ``"held"`` (what follows may
        begin ``stop``) or ``"open"`` (all of ``text`` read)."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
                continue
            if stop and ch == stop[0]:
                rest = text[i:i + len(stop)]
                if rest == stop:
                    return i, "stop"
                if stop.startswith(rest):
                    return i, "held"
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1, "closed"
        return len(text), "open"


class _Stepped:
    """A parser run as a state machine over its buffer: :meth:`feed` appends text and steps the machine until a
    step must wait for more."""

    _buf: str
    _out: Content
    _calls: Calls

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self._buf += text
        while self._step():
            pass
        return self._out.take(), self._calls.take()

    def _step(self) -> bool:
        """Read what the state can of the buffer; whether to go on."""
        raise NotImplementedError


class HermesStream(_Stepped):
    """``<tool_call>`` JSON ``</tool_call>`` blocks among content (see :mod:`model.tool_calls`)."""

    START, END = "<tool_call>", "</tool_call>"
    HEADER = header(("arguments",))

    def __init__(self) -> None:
        self._buf, self._state = "", "content"   # -> "header" -> "arguments" -> "rest" -> "content"
        self._out, self._calls, self._args = Content(), Calls(), _Arguments()

    def _step(self) -> bool:
        buf = self._buf
        if self._state == "content":
            at = buf.find(self.START)
            if at < 0:
                keep = held_tail(buf, self.START)
                self._out.add(buf[:len(buf) - keep])
                self._buf = buf[len(buf) - keep:]
                return False
            self._out.add(buf[:at])
            self._buf, self._state = buf[at + len(self.START):], "header"
        elif self._state == "header":
            end, head = buf.find(self.END), self.HEADER.match(buf)
            if head is not None and (end < 0 or head.end() < end):
                self._calls.start(json.loads(head.group("name")))
                self._buf, self._state, self._args = buf[head.end():], "arguments", _Arguments()
            elif end >= 0:
                call = _json_call(buf[:end], ("arguments",))
                if call is None:
                    self._out.add(self.START + buf[:end] + self.END)
                else:
                    self._calls.whole(call)
                    self._out.after_call = True
                self._buf, self._state = buf[end + len(self.END):], "content"
            else:
                return False
        elif self._state == "arguments":
            n, how = self._args.read(buf, self.END)
            self._calls.arguments(buf[:n])
            self._buf = buf[n:]
            if how in ("open", "held"):
                return False
            self._state = "rest" if how == "closed" else "end"
        else:   # "rest" of the block after its arguments, or "end": its end marker next
            end = buf.find(self.END)
            if end < 0:
                self._buf = buf[len(buf) - held_tail(buf, self.END):]
                return False
            self._buf, self._state, self._out.after_call = buf[end + len(self.END):], "content", True
        return True

    def finish(self) -> tuple[str, list[CallDelta]]:
        if self._state == "header":       # a block never closed, before a call began: content as written
            self._out.add(self.START + self._buf)
        elif self._state == "arguments":  # cut inside the arguments: they end as written
            self._calls.arguments(self._buf)
        elif self._state == "content":
            self._out.add(self._buf)
        self._buf, self._state = "", "content"
        return self._out.take(), self._calls.take()


def _json_call(body: str, argument_keys: tuple[str, ...]) -> ToolCall | None:
    obj = json_object(body)
    return None if obj is None else call_of(obj, argument_keys)


class CallListStream(_Stepped):
    """An answer of JSON calls one after another, separated by blanks, ``;``, ``,`` and the brackets of lists:
    Llama 3's JSON tool calls (``parameters``, or ``arguments``), the array of calls a grammar holds an answer
    to under ``tool_choice`` ``required`` (``parameters``), and Granite 3's and Mistral's, an array after
    ``<|tool_call|>`` or ``[TOOL_CALLS]`` (``marker``; Mistral's calls take ids its templates accept:
    ``new_id``). Decided at the answer's start: its first non-blank character ``{`` or ``[`` (or the ``marker``,
    when one is given) begins calls, anything else is content, all of it. Text after the calls
    that is no call is content; an object that is not a streamable call is held to the end and read whole
    with what follows it, as content if it does not parse (the whole answer, when no call came before)."""

    SEPARATORS = " \t\r\n;,[]"

    def __init__(self, keys: tuple[str, ...] = ("parameters", "arguments"), marker: str = "",
                 new_id: Callable[[], str] = new_call_id) -> None:
        self._keys, self._header, self._marker = keys, header(keys), marker
        self._buf, self._state = "", "start"   # "start" -> "between" <-> "header" / "arguments" -> "rest"; "content"
        self._opening = ""                     # the marker read at the start (and the blanks before it)
        self._pending = ""                     # since the last call: separators, or an object not yet read
        self._out, self._calls, self._args = Content(), Calls(new_id), _Arguments()

    def _unread(self) -> str:
        """What the calls were thought to start with, when none came: content again."""
        return "" if self._calls.count else self._opening

    def _step(self) -> bool:
        buf = self._buf
        if self._state == "content":
            self._out.add(buf)
            self._buf = ""
            return False
        if self._state == "start":
            head = buf.lstrip()
            if not head or self._marker.startswith(head) and head != self._marker:   # not told apart yet
                return False
            if not self._marker:
                self._state = "between" if head[0] in "{[" else "content"
            elif head.startswith(self._marker):
                at = len(buf) - len(head) + len(self._marker)
                self._opening, self._buf, self._state = buf[:at], buf[at:], "between"
            else:
                self._state = "content"
        elif self._state == "between":
            n = len(buf) - len(buf.lstrip(self.SEPARATORS))
            self._pending, self._buf = self._pending + buf[:n], buf[n:]
            if not self._buf:
                return False
            if self._buf[0] != "{":     # words after the calls
                self._state = "content"
                self._buf = (self._unread() + self._pending if not self._calls.count else "") + self._buf
                self._pending = ""
            else:
                self._state = "header"
        elif self._state == "header":
            head = self._header.match(buf)
            if head is None:
                return False             # held: read whole at the end
            self._calls.start(json.loads(head.group("name")))
            self._buf, self._state, self._pending, self._args = buf[head.end():], "arguments", "", _Arguments()
        elif self._state == "arguments":
            n, how = self._args.read(buf)
            self._calls.arguments(buf[:n])
            self._buf = buf[n:]
            if how == "open":
                return False
            self._state, self._args = "rest", _Arguments()
            self._args.depth = 1        # the call's own object is still open
        else:   # "rest": up to the brace that closes the call's object
            n, how = self._args.read(buf)
            self._buf = buf[n:]
            if how == "open":
                return False
            self._state, self._out.after_call = "between", True
        return True

    def finish(self) -> tuple[str, list[CallDelta]]:
        rest, self._buf = self._pending + self._buf, ""
        state, self._state, self._pending = self._state, "start", ""
        if state == "arguments":
            self._calls.arguments(rest)
        elif state in ("start", "content"):
            self._out.add(rest)
        elif state == "header":
            calls = json_calls(rest, self._keys)
            if calls is None:
                self._out.add(self._unread() + rest)
            for call in calls or ():
                self._calls.whole(call)
        elif state == "between" and not self._calls.count:   # separators alone ("[[["): content as written
            self._out.add(self._unread() + rest)
        self._opening = ""
        return self._out.take(), self._calls.take()


class ArgumentsStream:
    """An answer that is one function's arguments, written whole (``tool_choice`` naming a function, whose
    answer a grammar holds to its parameters): one call of ``function``, streamed as it is written."""

    def __init__(self, function: str) -> None:
        self._calls = Calls()
        self._calls.start(function)

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self._calls.arguments(text)
        return "", self._calls.take()

    def finish(self) -> tuple[str, list[CallDelta]]:
        return "", self._calls.take()


PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"


class PythonicStream:
    """An answer that is a Python list of calls with keyword arguments, ``[f(a=1, b="x"), g()]`` (Llama 3.2's
    and Llama 4's pythonic tool calls; Llama 4 wraps it in ``<|python_start|>`` ... ``<|python_end|>``), as vLLM's
    ``pythonic`` parser reads it: decided at the answer's first non-blank character (``[``, or the marker), held
    to the end and parsed whole (:func:`pythonic_calls`); what does not parse stays content, all of it. Its
    calls arrive in one piece each, at the end: Python literals cannot be streamed as JSON text."""

    def __init__(self) -> None:
        self._buf, self._calls = "", None      # _calls: None undecided, False content, True calls

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        if self._calls is False:
            return text, []
        self._buf += text
        head = self._buf.lstrip()
        if not head or (PYTHON_START.startswith(head) and head != PYTHON_START):   # not told apart yet
            return "", []
        if self._calls is None:
            self._calls = head.startswith(("[", PYTHON_START))
        if self._calls:
            return "", []
        out, self._buf = self._buf, ""
        return out, []

    def finish(self) -> tuple[str, list[CallDelta]]:
        text, self._buf = self._buf, ""
        calls = pythonic_calls(text) if self._calls else None
        if calls is None:
            return text, []
        out = Calls()
        for call in calls:
            out.whole(call)
        return "", out.take()


def pythonic_calls(text: str) -> list[ToolCall] | None:
    """The calls of ``text``, a Python list of calls (optionally between ``<|python_start|>`` and
    ``<|python_end|>``) whose functions are plain names and whose arguments are keyword arguments with literal
    values that JSON can hold (``ast.literal_eval``: strings, numbers, booleans, None, lists, tuples, dicts);
    None for anything else (or a parse nested deeper than Python's stack)."""
    body = text.strip()
    if body.startswith(PYTHON_START):
        body = body[len(PYTHON_START):].removesuffix(PYTHON_END).strip() if body.endswith(PYTHON_END) else ""
    try:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args \
                    or any(k.arg is None for k in node.keywords):
                return None
            args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            calls.append(ToolCall(node.func.id, json.dumps(args, ensure_ascii=False)))
        return calls
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None
