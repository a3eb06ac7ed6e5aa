"""Concurrent ``Generate`` streams the router serves: in all (``RouterConfig.max_concurrent_streams``)
and per bearer token presented (``RouterConfig.max_streams_per_token``)::

    Generate arrives ──► StreamSlots.acquire(metadata) ──► a StreamSlot, held until the stream ends
                               │ over a limit
                               ▼
                         StreamLimitExceeded ──► RESOURCE_EXHAUSTED naming the limit

gRPC's own ``maximum_concurrent_rpcs`` (set above ``max_concurrent_streams``, see
``RouterConfig.max_concurrent_rpcs``) is only the backstop: it refuses every kind of RPC alike,
health checks included, with the bare message "Concurrent RPC limit exceeded!".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence


class StreamLimitExceeded(Exception):
    """A stream was refused; the message names the limit (sent as RESOURCE_EXHAUSTED)."""


class StreamSlot:
    """One admitted stream, counted from :meth:`StreamSlots.acquire` until :meth:`release` or the end
    of its ``with`` block, whichever comes first (later calls do nothing)."""

    def __init__(self, slots: StreamSlots, token_index: int | None) -> None:
        self._slots, self._token_index, self._held = slots, token_index, True

    def release(self) -> None:
        """Give the slot back (and the token's)."""
        if self._held:
            self._held = False
            self._slots._release(self._token_index)

    def __enter__(self) -> StreamSlot:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class StreamSlots:
    """Counts the streams being served, in all and per token.

    Args:
        max_streams: streams at once, in all (>= 1).
        tokens: the bearer tokens the router accepts, in their file's order; each has its own quota.
        max_per_token: streams at once per token; 0: no per-token quota.
    Raises:
        ValueError: ``max_streams < 1`` or ``max_per_token < 0``.
    """

    def __init__(self, max_streams: int, tokens: Sequence[str] = (), max_per_token: int = 0) -> None:
        if max_streams < 1 or max_per_token < 0:
            raise ValueError(f"need max_streams >= 1 and max_per_token >= 0, got {max_streams}, {max_per_token}")
        self.max_streams, self.max_per_token = max_streams, max_per_token
        self._index = {t: i for i, t in enumerate(tokens, 1)}  # token -> its line in the token file
        self.num_streams = 0
        self.num_by_token: Counter = Counter()  # token index -> streams; entries at 0 are removed

    def acquire(self, metadata: Iterable[tuple[str, str | bytes]] = ()) -> StreamSlot:
        """Count one more stream of the call that carried ``metadata`` (its ``authorization: Bearer``
        token, already checked by the bearer-token interceptor, picks the quota).

        Raises:
            StreamLimitExceeded: ``max_streams`` are being served, or the token's quota is.
        """
        if self.num_streams >= self.max_streams:
            raise StreamLimitExceeded(f"the router is serving its limit of {self.max_streams} concurrent Generate "
                                      f"streams (max_concurrent_streams); retry later")
        token_index = self._token_index(metadata) if self.max_per_token else None
        if token_index is not None and self.num_by_token[token_index] >= self.max_per_token:
            raise StreamLimitExceeded(
                f"bearer token {token_index} of {len(self._index)} already has {self.max_per_token} concurrent "
                f"Generate streams, its quota (max_streams_per_token); retry later")
        self.num_streams += 1
        if token_index is not None:
            self.num_by_token[token_index] += 1
        return StreamSlot(self, token_index)

    def _token_index(self, metadata: Iterable[tuple[str, str | bytes]]) -> int | None:
        values = [v for k, v in metadata if k.lower() == "authorization"]
        if not values:
            return None
        value = values[-1].decode(errors="replace") if isinstance(values[-1], bytes) else values[-1]
        return self._index.get(value.strip().partition(" ")[2].strip())

    def _release(self, token_index: int | None) -> None:
        self.num_streams -= 1
        if token_index is not None:
            self.num_by_token[token_index] -= 1
            if self.num_by_token[token_index] <= 0:
                del self.num_by_token[token_index]
