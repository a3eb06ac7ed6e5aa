"""From the router's messages back to OpenAI's JSON: whole responses and stream chunks (:class:`Reply`).

``n`` sequences of each prompt become choices ``prompt index x n + sequence index`` (the router's
``GenerateResponse.index``); the usage counts each prompt once. Log-probabilities take OpenAI's two
shapes: completions ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` (offsets into the
choice's text), chat ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``. Chat answers
are split into reasoning (``--reasoning-parser``, :mod:`model.reasoning`), content and tool calls
(``--tool-call-parser``, :mod:`model.tool_calls`), in that order.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.model.reasoning import ReasoningStream, split_reasoning
from pdserve.model.tool_calls import FORCED, ToolCallStream, parse_tool_calls, tool_call_stream
from pdserve.proto import pdserve_pb2

FINISH_REASON = {pdserve_pb2.FINISH_REASON_STOP: "stop", pdserve_pb2.FINISH_REASON_LENGTH: "length"}


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


def vllm_prompt_logprobs(logprobs: Sequence[pdserve_pb2.TokenLogprob]) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: None for the prompt's first token, then for each token a dict by token id
    (JSON keys: the ids as strings) of ``{"logprob", "rank", "decoded_token"}``, the token's own first, then
    its alternatives, most likely first (ranked 1, 2, ...)."""
    out: list[dict | None] = [None] if logprobs else []
    for lp in logprobs[1:]:
        entry = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.token}}
        for rank, alt in enumerate(lp.top, 1):
            entry.setdefault(str(alt.token_id), {"logprob": alt.logprob, "rank": rank, "decoded_token": alt.token})
        out.append(entry)
    return out


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
        reasoning_parser: chat answers' reasoning is split off first, into ``reasoning`` (vLLM's name) and
            ``reasoning_content`` (its earlier one, which DeepSeek's API and many clients read), null in an
            answer without (:mod:`model.reasoning`; empty: no split, no such fields).
        echo: completions' ``echo``: each prompt's text (in prompt order), which its choices' text starts with
            (and their log-probabilities with its tokens', when they were asked for); None: no echo.
        prompt_logprobs: vLLM's ``prompt_logprobs`` were asked for: each completions choice, and a chat response,
            carries them in vLLM's shape (:func:`vllm_prompt_logprobs`).
    """

    def __init__(self, chat: bool, model: str, return_token_ids: bool, n: int = 1,
                 logprobs: bool = False, tool_parser: str = "", parallel_tool_calls: bool = True,
                 echo: list[str] | None = None, reasoning_parser: str = "", prompt_logprobs: bool = False) -> None:
        self.chat, self.model, self.return_token_ids, self.n, self.echo = chat, model, return_token_ids, n, echo
        self.logprobs, self.tool_parser, self.parallel_tool_calls = logprobs, tool_parser, parallel_tool_calls
        self._offsets: dict[int, int] = {}  # choice -> text length streamed so far (completions' text_offset)
        self.reasoning_parser, self.prompt_logprobs = reasoning_parser, prompt_logprobs
        self._tools: dict[int, ToolCallStream] = {}   # choice -> its tool call parser (streams)
        self._thinking: dict[int, ReasoningStream] = {}   # choice -> its reasoning parser (streams)
        self._called: set[int] = set()                # choices that have called a tool
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
            if self.chat:
                reasoning, text = split_reasoning(self.reasoning_parser, c.text) if self.reasoning_parser \
                    else (None, c.text)
                content, calls = parse_tool_calls(self.tool_parser, text) if self.tool_parser else (text, [])
                calls = calls if self.parallel_tool_calls else calls[:1]
                item["message"] = {"role": "assistant", "content": content or (None if calls else "")}
                if self.reasoning_parser:
                    item["message"] |= {"reasoning": reasoning, "reasoning_content": reasoning}
                if calls:
                    item["message"]["tool_calls"] = [call.as_openai() for call in calls]
                    item["finish_reason"] = self._called_reason(reason)
            else:
                item["text"] = self.echo_text(c.index) + c.text
                if self.prompt_logprobs:
                    item["prompt_logprobs"] = vllm_prompt_logprobs(choices[c.index - c.index % self.n].prompt_logprobs)
            if self.return_token_ids:
                item["token_ids"] = c.token_ids
            out.append(item)
        body = {**self._head("chat.completion" if self.chat else "text_completion"), "choices": out,
                "usage": usage([c.final for c in choices], self.n)}
        if self.chat and self.prompt_logprobs:     # vLLM's chat responses carry them once, beside the choices
            body["prompt_logprobs"] = vllm_prompt_logprobs(choices[0].prompt_logprobs)
        return body

    def stream_text(self, index: int, text: str, end: bool = False) -> tuple[str, str, list[dict]]:
        """``(reasoning, content, tool_calls delta entries)`` of choice ``index``'s next streamed ``text`` (and,
        with ``end``, of what its parsers held back); ``("", text, [])`` without parsers."""
        reasoning = ""
        if self.reasoning_parser:
            thinking = self._thinking.setdefault(index, ReasoningStream(self.reasoning_parser))
            reasoning, text = thinking.feed(text)
            if end:
                more_reasoning, more = thinking.finish()
                reasoning, text = reasoning + more_reasoning, text + more
        if not self.tool_parser:
            return reasoning, text, []
        stream = self._tools.setdefault(index, tool_call_stream(self.tool_parser))
        content, pieces = stream.feed(text)
        if end:
            rest, more = stream.finish()
            content, pieces = content + rest, pieces + more
        pieces = [p for p in pieces if self.parallel_tool_calls or p.call == 0]
        if pieces:
            self._called.add(index)
        return reasoning, content, [p.as_openai() for p in pieces]

    def _called_reason(self, reason: str | None) -> str | None:
        """A choice's finish reason once it has called a tool: ``tool_calls``, but ``stop`` for a function
        ``tool_choice`` named (OpenAI's), where the model had no choice, and ``length`` for an answer cut by
        ``max_tokens`` (its last call's arguments may be cut)."""
        return reason if self.tool_parser.startswith(FORCED + ":") or reason == "length" else "tool_calls"

    def chunk(self, index: int, text: str | None, token_ids: Sequence[int] = (),
              final: pdserve_pb2.Final | None = None, role: bool = False,
              logprobs: Sequence[pdserve_pb2.TokenLogprob] = (), tool_calls: Sequence[dict] = (),
              prompt_logprobs: Sequence[pdserve_pb2.TokenLogprob] = (), reasoning: str = "") -> dict:
        """A stream chunk of choice ``index``: a text delta (chat: ``role`` opens the message; a
        ``final`` closes the choice with its finish reason, ``tool_calls`` once it has called one), with its
        tokens' ``logprobs`` (after its echoed prompt's ``prompt_logprobs``) and the ``reasoning`` and
        ``tool_calls`` entries :meth:`stream_text` gave."""
        reason = FINISH_REASON.get(final.finish_reason) if final is not None else None
        if final is not None and index in self._called:
            reason = self._called_reason(reason)
        offset = self._offsets.get(index, 0)
        self._offsets[index] = offset + len(text or "")
        item: dict[str, Any] = {"index": index, "finish_reason": reason, "stop_reason": stop_reason(final),
                                "logprobs": self._logprobs(logprobs, offset, prompt_logprobs) if logprobs else None}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None and (text or not (tool_calls or reasoning)):
                delta["content"] = text
            if reasoning:
                delta |= {"reasoning": reasoning, "reasoning_content": reasoning}
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
