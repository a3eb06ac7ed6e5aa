"""Reasoning models' answers split into their reasoning and their content, as vLLM's reasoning parsers
(``--reasoning-parser``) split them: the model thinks between ``<think>`` and ``</think>``, then answers::

    <think>\\nThe user wants 2 + 2.\\n</think>\\n\\nIt is 4.   ->  reasoning "\\nThe user wants 2 + 2.\\n",
                                                             content   "\\n\\nIt is 4."

Two parsers, which differ in where the reasoning starts:

* ``deepseek_r1`` (DeepSeek-R1 and its distills, QwQ, Qwen3's ``*-Thinking-2507``, whose templates open the
  ``<think>`` block in the prompt): the answer starts in its reasoning (a ``<think>`` it writes itself is
  dropped); everything up to ``</think>`` is reasoning, and an answer with no ``</think>`` (cut by
  ``max_tokens``) is all reasoning.
* ``qwen3`` (Qwen3's hybrid models, which think only when ``enable_thinking`` leaves them to): an answer that
  starts with ``<think>`` is reasoning up to ``</think>``; any other answer (thinking off: the template wrote an
  empty block into the prompt) is all content.

Streamed text is split the same way (:class:`ReasoningStream`): text that may still be the start of a marker
is held back until it is told apart, so the streamed parts add up to the whole answer's.
"""

from __future__ import annotations

REASONING_PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"


class ReasoningStream:
    """Splits one answer's text deltas into ``(reasoning, content)`` deltas.

    Args:
        parser: one of :data:`REASONING_PARSERS`.

    Raises:
        ValueError: an unknown parser.
    """

    def __init__(self, parser: str) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}: one of {', '.join(REASONING_PARSERS)}")
        self._parser = parser
        self._state = "start"     # -> "reasoning" -> "content", or "start" -> "content"
        self._held = ""
        self.reasoned = False     # whether the answer has a reasoning part (else its reasoning is None)

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the content that ``text`` (the answer's next delta) releases."""
        buf, self._held = self._held + text, ""
        if self._state == "start":
            if START.startswith(buf) and buf != START:       # "", "<", "<th": not told apart yet
                self._held = buf
                return "", ""
            opened = buf.startswith(START)
            self._begin(opened)
            buf = buf[len(START):] if opened else buf
        if self._state == "content":
            return "", buf
        at = buf.find(END)
        if at >= 0:
            self._state = "content"
            return buf[:at], buf[at + len(END):]
        keep = next((n for n in range(min(len(END) - 1, len(buf)), 0, -1) if buf.endswith(END[:n])), 0)
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], ""

    def finish(self) -> tuple[str, str]:
        """What was held back when the answer ended: a partial marker is text of the part it was in."""
        held, self._held = self._held, ""
        if self._state == "start":
            self._begin(False)
        return (held, "") if self._state == "reasoning" else ("", held)

    def _begin(self, opened: bool) -> None:
        """Leave the start, where the answer opened a ``<think>`` block (``opened``) or not."""
        self._state = "reasoning" if opened or self._parser == "deepseek_r1" else "content"
        self.reasoned = self._state == "reasoning"


def split_reasoning(parser: str, text: str) -> tuple[str | None, str]:
    """A whole answer's ``(reasoning, content)``; reasoning None when the answer has none (see the module).

    Raises:
        ValueError: an unknown parser.
    """
    stream = ReasoningStream(parser)
    reasoning, content = stream.feed(text)
    more_reasoning, more_content = stream.finish()
    return (reasoning + more_reasoning if stream.reasoned else None), content + more_content


def grammar_start(start_ids: list[int], end_ids: list[int], prompt_ids: list[int]) -> list[int] | None:
    """Where a grammar starts in a reasoning model's answer to ``prompt_ids`` (``start_ids`` and ``end_ids``:
    ``<think>`` and ``</think>`` as the tokenizer writes them): after ``end_ids``, which it returns, when the
    prompt leaves the reasoning to the answer; None when the prompt has closed it already (its last ``</think>``
    after its last ``<think>``: Qwen3 with ``enable_thinking`` off), and the grammar holds the whole answer, as
    vLLM checks the prompt for the reasoning's end before it starts a grammar."""
    backwards = prompt_ids[::-1]

    def last(ids: list[int]) -> int:   # the start of ids' last occurrence in the prompt, -1 for none
        at = 0    # in `backwards`: where ids' last token may lie
        while True:
            try:
                at = backwards.index(ids[-1], at)   # list.index: a scan in C, for prompts of 100k tokens
            except ValueError:
                return -1
            start = len(prompt_ids) - at - len(ids)
            if start < 0:
                return -1
            if prompt_ids[start:start + len(ids)] == ids:
                return start
            at += 1
    return None if last(end_ids) > last(start_ids) else end_ids
