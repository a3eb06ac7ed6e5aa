"""Stop strings, matched by the router on a sequence's detokenized output as it streams.

A stop string can span token boundaries ("the e" + "nd"), so text that could still be the start of
a stop string is held back; it is released as soon as it cannot be (or when the sequence ends)::

    pushed text   "Once upon a ti"   stop "time"  ->  released "Once upon a ", held "ti"
    pushed text   "me, there"                     ->  match: released "" (the text ends before "time")

The matcher belongs to the request (one per sequence), not to an attempt: a migrated sequence goes on
with the same held text, so what the client reads is the same as without the migration.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 256


def check_stop_strings(stop: Sequence[str]) -> tuple[str, ...]:
    """Return ``stop`` as a tuple if it is usable: at most :data:`MAX_STOP_STRINGS` strings of 1 to
    :data:`MAX_STOP_CHARS` characters.

    Raises:
        ValueError: naming the problem.
    """
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"{len(stop)} stop strings; at most {MAX_STOP_STRINGS} are allowed")
    for s in stop:
        if not s:
            raise ValueError("a stop string is empty")
        if len(s) > MAX_STOP_CHARS:
            raise ValueError(f"a stop string of {len(s)} characters exceeds {MAX_STOP_CHARS}")
    return tuple(stop)


class StopMatcher:
    """Finds the first stop string in a stream of text deltas; holds back what may still become one.

    ``push`` returns the text the client may see now and whether a stop string matched (then the
    sequence ends: nothing after the match is ever released); ``flush`` releases the held text when the
    sequence ends for another reason. With no stop strings every delta is released at once.

    ``include`` (vLLM's ``include_stop_str_in_output``) releases the matched stop string with the text
    before it. ``matched_string`` is the stop string that matched (the one that starts first; of those that
    start at the same place, the first in ``stop``), or None.
    """

    def __init__(self, stop: Sequence[str], include: bool = False) -> None:
        self._stop, self._include = tuple(stop), include
        self._held = ""
        self.matched_string: str | None = None

    def push(self, text: str, armed: bool = True) -> tuple[str, bool]:
        """Add a text delta; return ``(released text, matched)``. While not ``armed`` (the request's
        ``min_tokens`` not reached yet, as vLLM's stop checker skips stop strings then) nothing matches;
        text that may begin a stop string is still held, so one that straddles the point where the matcher
        is armed is found then.

        Raises:
            RuntimeError: called after a match.
        """
        if self.matched:
            raise RuntimeError("the sequence already ended at a stop string")
        if not self._stop:
            return text, False
        buf = self._held + text
        # only the held text and the new delta can hold a match: released text was checked when pushed
        found = [(i, k) for k, i in enumerate(buf.find(s) for s in self._stop) if i >= 0] if armed else []
        if found:
            at, k = min(found)
            self._held, self.matched_string = "", self._stop[k]
            return buf[:at + len(self._stop[k]) if self._include else at], True
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    @property
    def matched(self) -> bool:
        """Whether a stop string has matched (the sequence ended there)."""
        return self.matched_string is not None

    def flush(self) -> str:
        """The held text (the sequence ended without a match); the matcher is empty afterwards."""
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best
