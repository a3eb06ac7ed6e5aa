"""The per-request record of a replay (what ``results.json`` stores for every request)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

OK = "OK"
TIME_LIMIT = "TIME_LIMIT"  # not finished when the replay's time limit ran out


@dataclass
class RequestRecord:
    """One replayed request, timed at the client.

    Times are seconds. ``ttft_s`` and ``e2e_s`` run from the request's *scheduled* arrival
    (open loop: a late send or a wait for the concurrency cap counts against the request);
    ``tpot_s`` is the mean gap between output tokens after the first,
    ``(last - first token time) / (tokens - 1)``, ``None`` with fewer than 2 tokens.

    Attributes:
        index: position in the trace.
        arrival_s: scheduled arrival, seconds after the replay's start.
        send_delay_s: seconds from the scheduled arrival to the RPC's start.
        prompt_tokens: prompt length sent (tokens).
        output_tokens: tokens asked for (``max_tokens``, with ``ignore_eos``).
        tokens: tokens received.
        cached_prompt_tokens: prompt tokens served from the prefix cache (``final.usage``).
        status: ``OK``, a gRPC status code name, or ``TIME_LIMIT``.
        error: the error's details (empty when OK).
        finish_reason: the ``FinishReason`` name of the final message.
        server_ttft_s, server_tpot_s: the router's own timings (``final.timings``).
    """

    index: int = 0
    arrival_s: float = 0.0
    send_delay_s: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    cached_prompt_tokens: int = 0
    status: str = ""
    error: str = ""
    finish_reason: str = ""
    server_ttft_s: float | None = None
    server_tpot_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == OK

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RequestRecord:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
