"""The router's stop-string matcher (router/stop_strings.py), in process: matches across deltas, the
text ends before the match, held text is released once it cannot match (and by ``flush``)."""

from __future__ import annotations

import pytest

from pdserve.router.stop_strings import StopMatcher, check_stop_strings


def run(stops, deltas):
    m = StopMatcher(stops)
    out = []
    for d in deltas:
        text, matched = m.push(d)
        out.append(text)
        if matched:
            return "".join(out), True
    return "".join(out) + m.flush(), False


@pytest.mark.parametrize("stops, deltas, want", [
    (["time"], ["Once upon a ti", "me, there"], ("Once upon a ", True)),
    (["time"], ["Once upon a t", "i", "m", "e"], ("Once upon a ", True)),
    (["the end"], ["and th", "e e", "nd."], ("and ", True)),
    (["xyz"], ["ab", "x", "y"], ("abxy", False)),            # held "xy" released at the end
    (["lo", "hello"], ["hel", "lo"], ("", True)),             # the match that starts first wins
    ([], ["a", "b"], ("ab", False)),
    (["."], ["Hi. There."], ("Hi", True)),
])
def test_matches_across_deltas(stops, deltas, want):
    assert run(stops, deltas) == want


def test_held_text_is_released_once_it_cannot_match():
    m = StopMatcher(["time"])
    assert m.push("a ti") == ("a ", False)
    assert m.push("de") == ("tide", False)  # "tide" cannot become "time"
    assert m.flush() == ""


def test_concatenation_equals_whole_text_for_any_split():
    text, stop = "The cat sat on the mat. The end.", ["the mat", "end"]
    want = run(stop, [text])
    for cut in range(1, len(text)):
        assert run(stop, [text[:cut], text[cut:]]) == want
    assert run(stop, list(text)) == want


def test_nothing_matches_until_armed_and_a_straddling_match_is_found_then():
    """``min_tokens``: while the matcher is not armed, stop strings pass (released, not held once they cannot
    grow into one); a stop string begun before it is armed and ended after matches."""
    m = StopMatcher(["time"])
    assert m.push("a time, ", armed=False) == ("a time, ", False)
    assert m.push("one ti", armed=False) == ("one ", False)        # "ti" may still become "time": held
    assert m.push("me", armed=True) == ("", True)                    # the text ends before it
    m = StopMatcher(["time"])
    assert m.push("time", armed=False) == ("time", False) and m.push("s", armed=True) == ("s", False)


def test_checks():
    assert check_stop_strings(["a"]) == ("a",)
    for bad in ([""], ["x"] * 9, ["y" * 257]):
        with pytest.raises(ValueError):
            check_stop_strings(bad)
