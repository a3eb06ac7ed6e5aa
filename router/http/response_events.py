"""A streamed Responses API answer as OpenAI's server-sent events (``event: <type>``, ``data: {"type": <type>,
"sequence_number": n, ...}``)::

    response.created, response.in_progress                          the response, in progress, no output yet
    per output item, in order (reasoning, then the message, then each function call):
      response.output_item.added                                    the item, in progress, empty
      reasoning: response.content_part.added, response.reasoning_text.delta..., .done, response.content_part.done
      message:   response.content_part.added, response.output_text.delta..., .done, response.content_part.done
      call:      response.function_call_arguments.delta..., .done
      response.output_item.done                                     the item whole
    response.completed (or response.incomplete, cut by max_output_tokens)   the response whole, with its usage

Text is split into reasoning, content and call pieces by the chat reply's parsers (:meth:`Reply.stream_text`), as
chat streams are; an item closes when text of another kind starts. An error after the first event is an
``error`` event, and the stream ends there.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from pdserve.proto import pdserve_pb2
from pdserve.router.http.errors import from_status
from pdserve.router.http.reply import usage
from pdserve.router.http.responses import (
    call_item,
    message_item,
    new_id,
    output_text,
    reasoning_item,
    response_object,
)
from pdserve.router.http.schemas import ResponsesRequest
from pdserve.router.recovery import GenerateError

Event = dict[str, str]


class ResponseEvents:
    """The events of one streamed response (a :class:`router.http.streams.EventWriter`); see the module
    docstring."""

    def __init__(self, body: ResponsesRequest, model: str, response_id: str, created: float) -> None:
        self.body, self.model, self.id, self.created = body, model, response_id, created
        self.items: list[dict[str, Any]] = []   # closed items, whole
        self._seq = 0
        self._open: dict[str, Any] | None = None   # the item being written: kind, id, text, (call) call id, name
        self._calls: set[int] = set()            # the answer's calls (parser indices) already opened

    def event(self, kind: str, **fields: Any) -> Event:
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return {"event": kind, "data": json.dumps(data)}

    def start(self, first: pdserve_pb2.GenerateResponse) -> Iterator[Event]:
        empty = response_object(self.id, self.body, self.model, self.created, "in_progress", [])
        yield self.event("response.created", response=empty)
        yield self.event("response.in_progress", response=empty)

    def text(self, reasoning: str, content: str, calls: list[dict]) -> Iterator[Event]:
        """Events of one message's pieces, as :meth:`Reply.stream_text` split them."""
        if reasoning:
            yield from self._write("reasoning", reasoning)
        if content:
            yield from self._write("message", content)
        for piece in calls:
            if piece["index"] not in self._calls:     # a call's first piece: its id and name
                self._calls.add(piece["index"])
                yield from self._close()
                yield from self._add({"kind": "call", "id": new_id("fc"), "text": "", "call_id": piece["id"],
                                      "name": piece["function"]["name"]})
            yield from self._write("call", piece["function"]["arguments"])

    def finish(self, final: pdserve_pb2.Final) -> Iterator[Event]:
        """Close the last item (an empty message if the answer wrote nothing) and send the whole response."""
        if self._open is None and not self.items:
            yield from self._add({"kind": "message", "id": new_id("msg"), "text": ""})
        yield from self._close()
        status = "incomplete" if final.finish_reason == pdserve_pb2.FINISH_REASON_LENGTH else "completed"
        whole = response_object(self.id, self.body, self.model, self.created, status, self.items, usage([final]))
        yield self.event("response.completed" if status == "completed" else "response.incomplete", response=whole)

    def error(self, exc: GenerateError) -> Event:
        error = from_status(exc.code, exc.message).body()["error"]
        return self.event("error", code=error.get("code"), message=error["message"], param=error.get("param"))

    def _write(self, kind: str, text: str) -> Iterator[Event]:
        if not text and kind != "call":
            return
        if self._open is None or self._open["kind"] != kind:
            yield from self._close()
            yield from self._add({"kind": kind, "id": new_id("rs" if kind == "reasoning" else "msg"), "text": ""})
        item = self._open
        item["text"] += text
        where = {"item_id": item["id"], "output_index": len(self.items)}
        if kind == "call":
            if text:
                yield self.event("response.function_call_arguments.delta", **where, delta=text)
        elif kind == "reasoning":
            yield self.event("response.reasoning_text.delta", **where, content_index=0, delta=text)
        else:
            yield self.event("response.output_text.delta", **where, content_index=0, delta=text, logprobs=[])

    def _add(self, item: dict[str, Any]) -> Iterator[Event]:
        self._open = item
        where = {"output_index": len(self.items)}
        yield self.event("response.output_item.added", **where, item=self._item(item, "in_progress"))
        if item["kind"] != "call":
            empty = output_text("") if item["kind"] == "message" else {"type": "reasoning_text", "text": ""}
            yield self.event("response.content_part.added", **where, item_id=item["id"], content_index=0, part=empty)

    def _close(self) -> Iterator[Event]:
        item, self._open = self._open, None
        if item is None:
            return
        where = {"item_id": item["id"], "output_index": len(self.items)}
        whole = self._item(item, "completed")
        if item["kind"] == "call":
            yield self.event("response.function_call_arguments.done", **where, name=item["name"],
                             arguments=item["text"])
        elif item["kind"] == "reasoning":
            yield self.event("response.reasoning_text.done", **where, content_index=0, text=item["text"])
            yield self.event("response.content_part.done", **where, content_index=0, part=whole["content"][0])
        else:
            yield self.event("response.output_text.done", **where, content_index=0, text=item["text"], logprobs=[])
            yield self.event("response.content_part.done", **where, content_index=0, part=whole["content"][0])
        self.items.append(whole)
        yield self.event("response.output_item.done", output_index=len(self.items) - 1, item=whole)

    @staticmethod
    def _item(item: dict[str, Any], status: str) -> dict[str, Any]:
        if item["kind"] == "call":
            return call_item(item["call_id"], item["name"], item["text"], status, item["id"])
        make = reasoning_item if item["kind"] == "reasoning" else message_item
        return make(item["text"], status, item["id"])
