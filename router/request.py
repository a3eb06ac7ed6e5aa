"""The router's part of a request's lifecycle (:mod:`cluster.lifecycle`) and the request's timestamps.

The router owns ``QUEUED``, ``PREFILLING``, ``DECODING`` and ``FINISHED`` of
:class:`~cluster.lifecycle.RequestState`::

    QUEUED ──────────► PREFILLING ─────────────► DECODING ──────────► FINISHED
    (validated; P       (P.Prefill outstanding:   (first token from    (stop, length,
     chosen, admission,  P computes the KV and     P's answer, then     abort, error)
     D.Generate opened:  pushes it to D; P's       D's tokens relayed)
     D pre-allocated     PREFILLING and
     the blocks)         TRANSFERRING are one
                         call here)

A worker failure sends the request back to QUEUED for a new attempt on other workers: a retry
(before the first token was streamed) or a migration (after it: the prefill runs prompt + the
streamed tokens), a bounded number of times (:mod:`router.recovery`); the client sees one stream
either way. Owners of the KV blocks: the decode worker from allocation on (it frees them when its
stream ends, however it ends), the prefill worker for its own copy until the transfer ends.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


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
