"""A request's life as the router sees it, with per-state timestamps.

::

    QUEUED ──► PREFILLING ──► TRANSFERRING ──► DECODING ──► FINISHED
    (validated,   (prefill worker    (pages in flight;   (decode worker   (stop, length,
     workers       runs the prompt)   decode worker has   streams tokens)  abort, error)
     chosen, KV                       pre-allocated
     allocated)                       blocks)

A worker failure sends the request back to QUEUED on other workers (a retry, before the first
token was streamed) or to PREFILLING of prompt + streamed tokens (a migration, after it), a
bounded number of times (:mod:`router.recovery`); the client sees one stream either way.

The router sees PREFILLING and TRANSFERRING as one call (the prefill RPC returns
when the decode worker acknowledged the pages). Owners of the KV blocks: the
decode worker from allocation on (it frees them when its stream ends, however
it ends), the prefill worker for its own copy until the transfer ends.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class RequestState(enum.Enum):
    QUEUED = "queued"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


@dataclass
class RequestTimes:
    """Monotonic timestamps (seconds) of one request's milestones."""

    arrived: float = field(default_factory=time.monotonic)
    dispatched: float = 0.0
    first_token: float = 0.0
    last_token: float = 0.0
    num_tokens: int = 0

    def token(self) -> None:
        """Record that an output token was sent to the client."""
        now = time.monotonic()
        if not self.num_tokens:
            self.first_token = now
        self.last_token, self.num_tokens = now, self.num_tokens + 1

    def summary(self) -> dict[str, float]:
        """queue, TTFT, TPOT (mean gap after the first token) and end-to-end seconds."""
        now = time.monotonic()
        tpot = (self.last_token - self.first_token) / (self.num_tokens - 1) if self.num_tokens > 1 else 0.0
        return {"queue_s": self.dispatched - self.arrived, "ttft_s": self.first_token - self.arrived,
                "tpot_s": tpot, "e2e_s": now - self.arrived}
