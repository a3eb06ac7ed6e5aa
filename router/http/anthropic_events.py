"""A streamed Messages API answer as Anthropic's server-sent events (``event: <type>``, ``data: {"type": <type>,
...}``)::

    message_start                                   the message, empty, with the prompt's usage
    per content block, in order (thinking, then text, then each tool_use):
      content_block_start                           the block, empty ({} for a tool_use's input)
      content_block_delta...                        thinking_delta, text_delta or input_json_delta pieces
      content_block_stop
    message_delta                                   the stop_reason, stop_sequence and output tokens
    message_stop

Text is split into reasoning, content and call pieces by the chat reply's parsers (:meth:`Reply.stream_text`), as
chat streams are; a block closes when text of another kind starts. An error after the first event is an
``error`` event in Anthropic's shape, and the stream ends there.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from pdserve.proto import pdserve_pb2
from pdserve.router.http.anthropic import message_object, stop_of, usage_of
from pdserve.router.http.errors import from_status
from pdserve.router.http.reply import FINISH_REASON, stop_reason
from pdserve.router.recovery import GenerateError

Event = dict[str, str]
DELTA = {"thinking": ("thinking_delta", "thinking"), "text": ("text_delta", "text"),
         "tool_use": ("input_json_delta", "partial_json")}


class MessageEvents:
    """The events of one streamed message (a :class:`router.http.streams.EventWriter`); see the module docstring."""

    def __init__(self, model: str, message_id: str) -> None:
        self.model, self.id = model, message_id
        self._index = -1                         # the open block's index (-1: none yet)
        self._open: str | None = None            # its type
        self._calls: set[int] = set()            # the answer's calls (parser indices) already opened

    @staticmethod
    def event(kind: str, **fields: Any) -> Event:
        return {"event": kind, "data": json.dumps({"type": kind, **fields})}

    def start(self, first: pdserve_pb2.GenerateResponse) -> Iterator[Event]:
        usage = usage_of({"prompt_tokens": first.prompt_tokens, "completion_tokens": 0,
                          "prompt_tokens_details": {"cached_tokens": 0}})
        yield self.event("message_start", message=message_object(self.id, self.model, [], None, None, usage))

    def text(self, reasoning: str, content: str, calls: list[dict]) -> Iterator[Event]:
        """Events of one message's pieces, as :meth:`Reply.stream_text` split them."""
        if reasoning:
            yield from self._write("thinking", reasoning)
        if content:
            yield from self._write("text", content)
        for piece in calls:
            if piece["index"] not in self._calls:     # a call's first piece: its id and name
                self._calls.add(piece["index"])
                yield from self._start({"type": "tool_use", "id": piece["id"], "name": piece["function"]["name"],
                                        "input": {}})
            if piece["function"]["arguments"]:
                yield from self._write("tool_use", piece["function"]["arguments"])

    def finish(self, final: pdserve_pb2.Final) -> Iterator[Event]:
        """Close the last block (an empty text block if the answer wrote nothing) and end the message."""
        if self._open is None and self._index < 0:
            yield from self._start({"type": "text", "text": ""})
        yield from self._close()
        reason, sequence = stop_of(FINISH_REASON.get(final.finish_reason), stop_reason(final), bool(self._calls))
        yield self.event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                         usage={"output_tokens": final.usage.completion_tokens})
        yield self.event("message_stop")

    @staticmethod
    def error(exc: GenerateError) -> Event:
        return {"event": "error", "data": json.dumps(from_status(exc.code, exc.message).anthropic_body())}

    def _write(self, kind: str, text: str) -> Iterator[Event]:
        if self._open != kind:
            yield from self._start({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                                   else {"type": "text", "text": ""})
        delta, field = DELTA[kind]
        yield self.event("content_block_delta", index=self._index, delta={"type": delta, field: text})

    def _start(self, block: dict[str, Any]) -> Iterator[Event]:
        yield from self._close()
        self._index += 1
        self._open = block["type"]
        yield self.event("content_block_start", index=self._index, content_block=block)

    def _close(self) -> Iterator[Event]:
        if self._open is not None:
            if self._open == "thinking":
                yield self.event("content_block_delta", index=self._index,
                                 delta={"type": "signature_delta", "signature": ""})
            yield self.event("content_block_stop", index=self._index)
            self._open = None
