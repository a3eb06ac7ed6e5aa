"""Tool call parsers (model/tool_calls.py, model/tool_call_streams.py): each format's calls and content, what is
not a call left as content word for word, a streamed answer split exactly as the whole answer wherever its text
is cut, and a call's arguments streamed as they are written."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.model.tool_calls import TOOL_CALL_PARSERS, CallDelta, parse_tool_calls, tool_call_stream
from pdserve.proto import pdserve_pb2
from pdserve.router.http.reply import Choice, Reply

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}'
TIME = '{"name": "get_time", "arguments": {}}'


def calls_of(parser: str, text: str) -> tuple[str, list[tuple[str, dict]]]:
    content, calls = parse_tool_calls(parser, text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


HERMES = [  # (answer, content, calls)
    ("Just text, no call.", "Just text, no call.", []),
    (f"<tool_call>\n{WEATHER}\n</tool_call>", "", [("get_weather", {"city": "Paris", "unit": "°C"})]),
    (f"Let me look.\n<tool_call>{WEATHER}</tool_call>\n<tool_call>{TIME}</tool_call>\n",
     "Let me look.\n", [("get_weather", {"city": "Paris", "unit": "°C"}), ("get_time", {})]),
    (f"<tool_call>{WEATHER}</tool_call>\n\nDone.", "Done.", [("get_weather", {"city": "Paris", "unit": "°C"})]),
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', "", [("f", {"x": 1})]),  # JSON text
    ('<tool_call>{"name": "f"}</tool_call>', "", [("f", {})]),
    # not calls: stay content, word for word
    ("<tool_call>{not json}</tool_call> after", "<tool_call>{not json}</tool_call> after", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
     []),
    (f"cut short <tool_call>{WEATHER[:20]}", f"cut short <tool_call>{WEATHER[:20]}", []),
    ("ends with a half marker <tool_ca", "ends with a half marker <tool_ca", []),
    (f"<tool_call>{TIME}</tool_call>x<tool_call>bad</tool_call>", "x<tool_call>bad</tool_call>", [("get_time", {})]),
    ("<tool_call>" + "[" * 3000 + "</tool_call>", "<tool_call>" + "[" * 3000 + "</tool_call>", []),   # too deep
]


@pytest.mark.parametrize("text, content, calls", HERMES)
def test_hermes(text, content, calls):
    assert calls_of("hermes", text) == (content, calls)


LLAMA3 = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", {"city": "Paris"})]),
    ('  {"name": "a", "parameters": {}}; {"name": "b", "arguments": {"k": [1, 2]}}', "",
     [("a", {}), ("b", {"k": [1, 2]})]),
    ('[{"name": "a", "parameters": {}}, {"name": "b", "parameters": {}}]', "", [("a", {}), ("b", {})]),
    ("The weather is fine.", "The weather is fine.", []),
    ('{"name": "a", "parameters": {}} and then words', "and then words", [("a", {})]),   # words after the calls
    ('{"name": "a", "parameters": {}, "x": [1, "]"]}; {"parameters": {"k": 1}, "name": "b"} ]', "",
     [("a", {}), ("b", {"k": 1})]),          # a key after the arguments; keys in another order: read whole
    ('{"parameters": {}, "name": "a"} words', '{"parameters": {}, "name": "a"} words', []),
    ('[1, 2]', '[1, 2]', []),
    ('{"no_name": 1}', '{"no_name": 1}', []),
    ("", "", []),
    ("[" * 3000, "[" * 3000, []),
]


@pytest.mark.parametrize("text, content, calls", LLAMA3)
def test_llama3_json(text, content, calls):
    assert calls_of("llama3_json", text) == (content, calls)


GRANITE = [
    ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]', "",
     [("get_weather", {"city": "Paris"})]),
    ('\n<|tool_call|> [{"name": "a", "arguments": {}}, {"arguments": {"k": 1}, "name": "b"}]', "",
     [("a", {}), ("b", {"k": 1})]),
    ("It is sunny.", "It is sunny.", []),
    ('[{"name": "a", "arguments": {}}]', '[{"name": "a", "arguments": {}}]', []),    # no marker: content
    ("<|tool_call|>", "<|tool_call|>", []),
    ("<|tool_call|>not json", "<|tool_call|>not json", []),
    ("<|tool_ca", "<|tool_ca", []),
]


@pytest.mark.parametrize("text, content, calls", GRANITE)
def test_granite(text, content, calls):
    assert calls_of("granite", text) == (content, calls)
    mistral = text.replace("<|tool_call|>", "[TOOL_CALLS]").replace("<|tool_ca", "[TOOL_CA")
    assert calls_of("mistral", mistral) == (content.replace("<|tool_call|>", "[TOOL_CALLS]").replace(
        "<|tool_ca", "[TOOL_CA"), calls)


PYTHONIC = [
    ('[get_weather(city="Paris", unit="°C")]', "", [("get_weather", {"city": "Paris", "unit": "°C"})]),
    ('  [a(), b(k=[1, 2], d={"x": None, "y": True}, t=(1, 2.5))]', "", [("a", {}), ("b", {
        "k": [1, 2], "d": {"x": None, "y": True}, "t": [1, 2.5]})]),
    ('<|python_start|>[f(x=1)]<|python_end|>', "", [("f", {"x": 1})]),
    ("It is sunny.", "It is sunny.", []),
    ("[1, 2]", "[1, 2]", []),                                         # not calls
    ('[f("positional")]', '[f("positional")]', []),                  # keyword arguments only
    ("[f(x=g())]", "[f(x=g())]", []),                                 # not a literal
    ("[f(x={1, 2})]", "[f(x={1, 2})]", []),                           # a set: no JSON for it
    ("[obj.f(x=1)]", "[obj.f(x=1)]", []),
    ("[f(x=1)", "[f(x=1)", []),                                       # cut short
    ("<|python_start|>[f(x=1)]", "<|python_start|>[f(x=1)]", []),     # never closed
    ("<|python_st", "<|python_st", []),
    ("[" * 3000 + "]" * 3000, "[" * 3000 + "]" * 3000, []),           # deeper than the parser's stack
]


@pytest.mark.parametrize("text, content, calls", PYTHONIC)
def test_pythonic(text, content, calls):
    assert calls_of("pythonic", text) == (content, calls)


def test_mistral_call_ids_are_nine_letters_and_digits():
    """Mistral's chat templates refuse other ids when the calls come back in the conversation."""
    _, calls = parse_tool_calls("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"arguments": {}, '
                                           '"name": "b"}]')
    assert len(calls) == 2 and all(len(c.id) == 9 and c.id.isalnum() for c in calls)


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="hermes, llama3_json, granite, mistral, pythonic"):
        tool_call_stream("deepseek_v3")


PIECES = ["Hi ", "there.\n", "<tool_call>", "</tool_call>", WEATHER, TIME, "{", "}", " ", "\n", ";", "<tool_", "call>",
          "<|tool_call|>", "<|tool", "[TOOL_CALLS]", "f(x=1)", "<|python_start|>", "<|python_end|>",
          '{"name": "x", "parameters": {"a": 1}}', "[", "]", ",", "text", "é✓"]


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.sampled_from(PIECES), max_size=12), cuts=st.lists(st.integers(0, 400), max_size=8),
       parser=st.sampled_from([*TOOL_CALL_PARSERS, "forced", "forced:f"]))
def test_streamed_answer_splits_as_the_whole_answer(pieces, cuts, parser):
    text = "".join(pieces)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    content, pieces = streamed(parser, [text[a:b] for a, b in zip(bounds, bounds[1:])])
    whole_content, whole_calls = parse_tool_calls(parser, text)
    assert content == whole_content
    assert assembled(pieces) == [(c.name, c.arguments) for c in whole_calls]
    assert [p.call for p in pieces] == sorted(p.call for p in pieces)     # in order, each call's first piece named
    assert all((p.name is not None) == (i == 0 or pieces[i - 1].call != p.call) for i, p in enumerate(pieces))


def streamed(parser: str, texts: list[str]) -> tuple[str, list[CallDelta]]:
    stream, content, pieces = tool_call_stream(parser), [], []
    for text in texts:
        c, k = stream.feed(text)
        content.append(c)
        pieces += k
    c, k = stream.finish()
    return "".join(content) + c, pieces + k


def assembled(pieces: list[CallDelta]) -> list[tuple[str, str]]:
    calls: list[list[str]] = []
    for p in pieces:
        if p.name is not None:
            calls.append([p.name, ""])
        calls[-1][1] += p.arguments
    return [(name, args) for name, args in calls]


CODE = '{"name": "write", "arguments": {"path": "a.py", "text": "x = \\"}\\" # </tool_call> {[\\n"}}'


@pytest.mark.parametrize("parser, text, name, arguments, content", [
    ("hermes", f"Writing.<tool_call>\n{CODE}\n</tool_call>", "write",
     '{"path": "a.py", "text": "x = \\"}\\" # </tool_call> {[\\n"}', "Writing."),
    ("llama3_json", '{"name": "f", "parameters": {"a": [1, {"b": "}"}]}}', "f", '{"a": [1, {"b": "}"}]}', ""),
    ("forced", '[{"name": "f", "parameters": {"a": "]}"}}]', "f", '{"a": "]}"}', ""),
    ("forced:f", '{"a": {"b": 1}}', "f", '{"a": {"b": 1}}', ""),
    ("granite", '<|tool_call|>[{"name": "f", "arguments": {"a": "[{"}}]', "f", '{"a": "[{"}', ""),
])
def test_arguments_stream_as_they_are_written(parser, text, name, arguments, content):
    """Fed a character at a time, a call's name and id come first, then its arguments grow with the text, as the
    model wrote them (braces, brackets and the end marker inside strings are argument text); they add up to
    the whole answer's."""
    stream, got, pieces, seen = tool_call_stream(parser), "", [], []
    for ch in text:
        c, k = stream.feed(ch)
        got, pieces = got + c, pieces + k
        seen.append("".join(p.arguments for p in pieces))
    c, k = stream.finish()
    got, pieces = got + c, pieces + k
    assert got == content and assembled(pieces) == [(name, arguments)] == [
        (c.name, c.arguments) for c in parse_tool_calls(parser, text)[1]]
    assert pieces[0].name == name and pieces[0].id.startswith("call_") and len(pieces) >= len(arguments) // 2
    assert any(0 < len(s) < len(arguments) for s in seen)          # part of the arguments out before the rest


def test_a_streamed_call_cut_short_keeps_what_was_written():
    """max_tokens cuts a call inside its arguments, or the model closes its block there: the call stands with
    the arguments written (a client has them already); the text after the block is content."""
    for parser, text, args, content in (
            ("hermes", '<tool_call>{"name": "f", "arguments": {"a": "long', '{"a": "long', ""),
            ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1</tool_call> then', '{"a": 1', "then"),
            ("llama3_json", '{"name": "f", "parameters": {"a": [1,', '{"a": [1,', ""),
            ("forced:f", '{"a": ', '{"a": ', "")):
        got, pieces = streamed(parser, [text])
        assert (got, assembled(pieces)) == (content, [("f", args)]) == (
            parse_tool_calls(parser, text)[0], [(c.name, c.arguments) for c in parse_tool_calls(parser, text)[1]])


def final(reason=pdserve_pb2.FINISH_REASON_STOP) -> pdserve_pb2.Final:
    return pdserve_pb2.Final(finish_reason=reason)


def test_reply_gives_openai_tool_calls_whole_and_streamed():
    text = f"Looking.<tool_call>{WEATHER}</tool_call><tool_call>{TIME}</tool_call>"
    for parallel, names in ((True, ["get_weather", "get_time"]), (False, ["get_weather"])):
        reply = Reply(True, "m", False, tool_parser="hermes", parallel_tool_calls=parallel)
        body = reply.response([Choice(0, text, final=final())])
        choice = body["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Looking."
        assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == names
        assert all(c["id"].startswith("call_") and c["type"] == "function" for c in choice["message"]["tool_calls"])
        # streamed in three messages, the last with the final
        deltas = []
        for i, (piece, end) in enumerate(((text[:13], False), (text[13:60], False), (text[60:], True))):
            _, content, calls = reply.stream_text(0, piece, end)
            deltas.append(reply.chunk(0, content, tool_calls=calls)["choices"][0]["delta"])
        last = reply.chunk(0, None, final=final())["choices"][0]
        assert last["finish_reason"] == "tool_calls"
        assert "".join(d.get("content", "") for d in deltas) == "Looking."
        entries = [e for d in deltas for e in d.get("tool_calls", [])]
        heads = [e for e in entries if "id" in e]
        assert [(e["index"], e["function"]["name"], e["type"]) for e in heads] == [
            (i, name, "function") for i, name in enumerate(names)]
        assert all(set(e) == {"index", "function"} and set(e["function"]) == {"arguments"}
                   for e in entries if "id" not in e)               # later pieces: arguments alone, as vLLM's
        weather = "".join(e["function"]["arguments"] for e in entries if e["index"] == 0)
        assert len([e for e in entries if e["index"] == 0]) > 1 and json.loads(weather) == {
            "city": "Paris", "unit": "°C"}                          # cut mid-arguments: sent in two pieces
    reply = Reply(True, "m", False, tool_parser="hermes")
    cut = reply.response([Choice(0, "<tool_call>" + WEATHER[:-4],
                                 final=final(pdserve_pb2.FINISH_REASON_LENGTH))])["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["tool_calls"][0]["function"]["arguments"] == \
        '{"city": "Paris", "unit": "°'                            # a call cut by max_tokens: as written


def test_reply_without_calls_is_plain_content():
    reply = Reply(True, "m", False, tool_parser="hermes")
    choice = reply.response([Choice(0, "No tools needed.", final=final())])["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "No tools needed."}
    assert choice["finish_reason"] == "stop"
    cut = reply.response([Choice(0, "<tool_call>{", final=final(pdserve_pb2.FINISH_REASON_LENGTH))])["choices"][0]
    assert cut["message"]["content"] == "<tool_call>{" and cut["finish_reason"] == "length"
