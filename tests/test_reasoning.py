"""Reasoning split off answers (model/reasoning.py): whole answers as vLLM's deepseek_r1 and qwen3 parsers split
them, and streamed answers, cut anywhere (markers included), adding up to the same parts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.model.reasoning import REASONING_PARSERS, ReasoningStream, grammar_start, split_reasoning

CASES = [  # answer, deepseek_r1's (reasoning, content), qwen3's
    ("<think>\nadd them\n</think>\n\nIt is 4.", ("\nadd them\n", "\n\nIt is 4."), ("\nadd them\n", "\n\nIt is 4.")),
    ("add them</think>It is 4.", ("add them", "It is 4."), (None, "add them</think>It is 4.")),
    ("<think>still thinking when cut", ("still thinking when cut", ""), ("still thinking when cut", "")),
    ("It is 4.", ("It is 4.", ""), (None, "It is 4.")),
    ("", ("", ""), (None, "")),
    ("<thi", ("<thi", ""), (None, "<thi")),                   # a marker's start, never finished
    ("<think></think>It is 4.", ("", "It is 4."), ("", "It is 4.")),
    ("<think>a</thin", ("a</thin", ""), ("a</thin", "")),
    ("<think>a</think>b</think>c", ("a", "b</think>c"), ("a", "b</think>c")),   # the first end marker ends it
    (" <think>a</think>b", (" <think>a", "b"), (None, " <think>a</think>b")),
]


@pytest.mark.parametrize("answer, r1, qwen3", CASES)
def test_whole_answers_split_as_each_parser_reads_them(answer, r1, qwen3):
    assert split_reasoning("deepseek_r1", answer) == r1
    assert split_reasoning("qwen3", answer) == qwen3


def _streamed(parser: str, answer: str, cuts: list[int]) -> tuple[str | None, str]:
    stream, reasoning, content = ReasoningStream(parser), "", ""
    bounds = [0, *sorted(c % (len(answer) + 1) for c in cuts), len(answer)]
    for lo, hi in zip(bounds, bounds[1:]):
        r, c = stream.feed(answer[lo:hi])
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    return (reasoning + r if stream.reasoned else None), content + c


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([c[0] for c in CASES]) | st.text(alphabet="<>/thinka4 ", max_size=30),
       st.lists(st.integers(0, 64), max_size=8), st.sampled_from(REASONING_PARSERS))
def test_streamed_deltas_add_up_to_the_whole_answer_split(answer, cuts, parser):
    assert _streamed(parser, answer, cuts) == split_reasoning(parser, answer)


def test_no_reasoning_is_released_before_it_is_told_apart_from_content():
    stream = ReasoningStream("qwen3")
    assert stream.feed("<th") == ("", "")            # may still be "<think>"
    assert stream.feed("ink>a</th") == ("a", "")     # "</th" held: may still be "</think>"
    assert stream.feed("ink>b") == ("", "b")
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        ReasoningStream("granite")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([1, 2, 3, 4]), max_size=14), st.sampled_from([[1], [1, 2], [2, 1, 2]]),
       st.sampled_from([[3], [3, 4], [4, 4]]))
def test_grammar_start_reads_whether_the_prompt_closed_the_reasoning(prompt, start, end):
    """None (the grammar from the first token) exactly when the prompt's last ``</think>`` begins after its last
    ``<think>`` (a plain scan as the oracle); else the grammar starts after ``end``."""
    def last(ids):
        return max((i for i in range(len(prompt) - len(ids) + 1) if prompt[i:i + len(ids)] == ids), default=-1)
    assert grammar_start(start, end, prompt) == (None if last(end) > last(start) else end)
    assert grammar_start([7], [8], [1, 7, 2]) == [8] and grammar_start([7], [8], [7, 2, 8, 2]) is None
