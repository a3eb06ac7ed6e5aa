"""The choices of one HTTP request (one per prompt), each a message stream of the router's internal
``generate`` path, run together::

    first()   every choice's first message, or the first error (the others closed): decided before
              the HTTP status is sent, so a refusal (429, 503, 400) is a status, not a broken stream
    rest()    the remaining messages of all choices in arrival order (a task per choice)
    aclose()  cancels what still runs: the router cancels the requests on their workers, which free
              their KV blocks; called when the client disconnects, on an error, and at the end

A non-streaming request is collected with :func:`collect`, which cancels everything as soon as the
client disconnects.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from typing import Protocol

import anyio

from pdserve.proto import pdserve_pb2
from pdserve.router.http.reply import Choice, Reply
from pdserve.router.recovery import GenerateError

Message = pdserve_pb2.GenerateResponse


class ClientGone(Exception):
    """The client disconnected before its answer was complete."""


class ChoiceStreams:
    """The message streams of one request's choices; see the module docstring. Not reusable."""

    def __init__(self, streams: list[AsyncGenerator[Message, None]]) -> None:
        self._streams = streams
        self._firsts: list[Message] = []
        self._pumps: list[asyncio.Task] = []
        self._closed = False

    async def first(self) -> list[Message]:
        """The first message of every choice, in choice order.

        Raises:
            Exception: the first choice's error (a ``GenerateError`` for refusals); every stream is
                closed before it is raised.
        """
        tasks = [asyncio.ensure_future(_next(s)) for s in self._streams]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            failed = next((t for t in tasks if t.done() and t.exception() is not None), None)
            if failed is not None:
                raise failed.exception()
        except BaseException:
            for t in tasks:
                t.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*tasks, return_exceptions=True)
                await self.aclose()
            raise
        self._firsts = [t.result() for t in tasks]
        return self._firsts

    async def rest(self) -> AsyncIterator[tuple[int, Message]]:
        """``(choice index, message)`` after the first messages, as they arrive, until every choice
        has sent its ``final``.

        Raises:
            Exception: a choice's error (e.g. a ``GenerateError`` after its first token); the caller
                then closes this object.
        """
        queue: asyncio.Queue = asyncio.Queue()
        for index, stream in enumerate(self._streams):  # each to its end, even after its final message
            self._pumps.append(asyncio.create_task(_pump(index, stream, queue)))
        live = len(self._pumps)
        while live:
            index, msg, error = await queue.get()
            if error is not None:
                raise error
            if msg is None:
                live -= 1
            else:
                yield index, msg

    async def aclose(self) -> None:
        """Cancel every choice still running and close every stream (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for p in self._pumps:
            p.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        for s in self._streams:  # streams never pumped: suspended after their first message, or never started
            await s.aclose()


async def _next(stream: AsyncGenerator[Message, None]) -> Message:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        raise RuntimeError("a generate stream ended without its final message") from None


async def _pump(index: int, stream: AsyncGenerator[Message, None], queue: asyncio.Queue) -> None:
    try:
        async for msg in stream:
            queue.put_nowait((index, msg, None))
        queue.put_nowait((index, None, None))
    except Exception as exc:
        queue.put_nowait((index, None, exc))


def add(choice: Choice, msg: Message) -> None:
    """Append a message's text, token ids and log-probabilities (the prompt's, on its first) to ``choice``
    (and its ``final``, on the last one)."""
    choice.text += msg.text
    choice.token_ids.extend(msg.token_ids)
    choice.logprobs.extend(msg.logprobs)
    choice.prompt_logprobs.extend(msg.prompt_logprobs)
    if msg.HasField("final"):
        choice.final = msg.final


async def collect(streams: ChoiceStreams, num_choices: int, disconnected: Callable[[], Awaitable[None]],
                  n: int = 1) -> list[Choice]:
    """Every choice whole (non-streaming answers), cancelling them all when ``disconnected()`` returns first.
    ``num_choices`` streams of ``n`` sequences each: stream ``s``'s sequence ``i`` is choice ``s x n + i``.

    Raises:
        ClientGone: the client disconnected first.
        Exception: a choice's error (the others cancelled).
    """
    async def run() -> list[Choice]:
        firsts = await streams.first()  # validates n (and everything else) before anything is sized by it
        choices = [Choice(i) for i in range(num_choices * n)]
        for s, msg in enumerate(firsts):
            add(choices[s * n + msg.index], msg)
        async for s, msg in streams.rest():
            add(choices[s * n + msg.index], msg)
        return choices

    work, gone = asyncio.ensure_future(run()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            raise ClientGone()
        return work.result()
    finally:
        for t in (work, gone):
            t.cancel()
        await asyncio.gather(work, gone, return_exceptions=True)
        await streams.aclose()


class EventWriter(Protocol):
    """The typed server-sent events of one streamed answer (the Responses and Messages APIs), each a
    ``{"event", "data"}`` dict."""

    def start(self, first: Message) -> Iterator[dict]:
        """The events before any text (``first``: the answer's first message, with the prompt's length)."""

    def text(self, reasoning: str, content: str, calls: list[dict]) -> Iterator[dict]:
        """The events of one message's pieces, as :meth:`Reply.stream_text` split them."""

    def finish(self, final: pdserve_pb2.Final) -> Iterator[dict]:
        """The closing events."""

    def error(self, exc: GenerateError) -> dict:
        """The error event of a failure after the first event."""


async def typed_events(streams: ChoiceStreams, first: Message, reply: Reply, writer: EventWriter
                       ) -> AsyncIterator[dict]:
    """The events of a streamed one-choice answer whose first message the caller has awaited (so that a refusal
    is an HTTP status): ``writer``'s, over the text ``reply``'s parsers split; an error after the first event is
    ``writer``'s error event, and the stream ends there. Closing it (the client gone) cancels the request."""
    def of(msg: Message) -> Iterator[dict]:
        end = msg.HasField("final")
        yield from writer.text(*reply.stream_text(0, msg.text, end=end))
        if end:
            yield from writer.finish(msg.final)

    try:
        for e in (*writer.start(first), *of(first)):
            yield e
        async for _, msg in streams.rest():
            for e in of(msg):
                yield e
    except GenerateError as exc:   # never a silently short answer
        yield writer.error(exc)
    finally:
        with anyio.CancelScope(shield=True):   # runs while the response's task group is being cancelled
            await streams.aclose()
