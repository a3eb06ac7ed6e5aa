"""A request's life on the decode worker, and the events it streams back. The decode worker owns
``TRANSFERRING``, ``PREFILLING`` (colocated only), ``DECODING`` and ``FINISHED`` of
:class:`~cluster.lifecycle.RequestState` (the whole lifecycle: :mod:`cluster.lifecycle`)::

    add_local ────► PREFILLING ──(last chunk, first token sampled here)─┐   (colocated mode)
       (blocks        │  chunks mixed with decodes                       │
        allocated)    │                                                  ▼
    add_request ──► TRANSFERRING ──(all KV pages + first token)──► DECODING ──► FINISHED
       (blocks       │  waits for the prefill worker's pages          │  one token    (stop, length)
        allocated)   │  (deadline: kv_timeout_s)                      │  per step
                     └──(transfer failed / timed out / aborted)───────┴──► FINISHED (error / abort)

    DECODING ──(pool short: preempted, blocks freed)──► PREFILLING (no blocks until the pool has them; then
                                                        prompt + output so far prefilled again, any mode)

A locally prefilled request is never TRANSFERRING. Blocks: those of the context when allocated, more as
it grows (:mod:`decode_worker.blocks`). Owner of the blocks in every state: the decode
engine, which frees them on every path into FINISHED. A request is known by its ``attempt_id``:
the ``request_id`` of the router's Generate call, which names one attempt of a client's request
(:mod:`router.recovery`), and the request id of its KV transfer.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import grpc
import torch

from pdserve.cluster.args import check_seconds
from pdserve.cluster.lifecycle import RequestState
from pdserve.cluster.rpc_fields import MAX_KV_TIMEOUT_S
from pdserve.model.sampling import History, SamplingParams, TokenLogprobs, token_logprobs
from pdserve.model.structured import Constraint


@dataclass(frozen=True)
class TokensEvent:
    """New output tokens, with their log-probabilities when the request's sampling asks (one each); a local
    prefill's first also with the prompt's (one per prompt token after the first) when its sampling asks."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass(frozen=True)
class FinishedEvent:
    """The request ended normally; ``reason`` is ``"stop"`` or ``"length"``. ``pool``: the engine's block pool
    just after the request's blocks were freed (``BlockPool.snapshot``: version, free blocks; (0, 0) unknown)."""

    reason: str
    num_output_tokens: int
    kv_wait_s: float
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    pool: tuple[int, int] = (0, 0)


@dataclass(frozen=True)
class ErrorEvent:
    """The request failed; the stream ends with this gRPC status."""

    code: grpc.StatusCode
    message: str


DecodeEventSink = Callable[[TokensEvent | FinishedEvent | ErrorEvent], None]


@dataclass
class DecodeRequest:
    """Mutable state of one request on the decode worker (engine thread only); ``state`` is
    TRANSFERRING (KV from a prefill worker) or PREFILLING (colocated) at first."""

    attempt_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stop_ids: frozenset[int]
    max_context: int
    block_table: list[int]
    emit: DecodeEventSink
    state: RequestState
    output_ids: list[int] = field(default_factory=list)  # starts with a migrated request's prior output
    num_computed: int = 0            # colocated mode: prompt (+ prior output) tokens prefilled here so far
    num_draft_tokens: int = 0        # speculative proposals verified
    num_accepted_tokens: int = 0     # of which accepted
    allocated_at: float = field(default_factory=time.monotonic)
    kv_ready_at: float = 0.0
    prompt_logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)  # prompt position -> its (local prefill)
    constraint: Constraint | None = None  # a structured answer's grammar state, past every output token so far

    @functools.cached_property
    def prompt_distinct(self) -> torch.Tensor:
        """The prompt's distinct token ids (int64), for the repetition penalty of every step."""
        return torch.unique(torch.tensor(self.prompt_ids, dtype=torch.long))

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""
        return len(self.prompt_ids) + len(self.output_ids)

    def finish_reason(self) -> str | None:
        """``"stop"``, ``"length"`` or ``None`` (keep going) after the last output token."""
        if self.output_ids and self.output_ids[-1] in self.stop_ids:
            return "stop"
        if len(self.output_ids) >= self.sampling.max_tokens or self.num_tokens >= self.max_context:
            return "length"
        return None


def by_priority(reqs: Iterable[DecodeRequest]) -> list[DecodeRequest]:
    """``reqs`` (in admission order) with lower ``priority`` values first, ties kept in admission order."""
    return sorted(reqs, key=lambda r: r.sampling.priority)


def preemption_victim(reqs: Iterable[DecodeRequest]) -> DecodeRequest:
    """Whom to preempt among ``reqs`` (in admission order): the highest ``priority`` value, the most recently
    admitted among those (vLLM's priority policy; with equal priorities, its recompute policy's last in)."""
    return max(reversed(list(reqs)), key=lambda r: r.sampling.priority)


def rows_logprobs(logits: torch.Tensor, batch: list[DecodeRequest], tokens: list[int],
                  ) -> list[list[TokenLogprobs] | None]:
    """Per request of ``batch`` (one row of ``logits`` [len(batch), vocab] float32 and one sampled token each):
    its token's log-probabilities, or None when its sampling does not ask. Nothing is computed when none asks."""
    out: list[list[TokenLogprobs] | None] = [None] * len(batch)
    rows = [i for i, r in enumerate(batch) if r.sampling.logprobs is not None]
    if rows:
        lps = token_logprobs(logits[rows], [tokens[i] for i in rows], [batch[i].sampling.logprobs for i in rows])
        for i, lp in zip(rows, lps):
            out[i] = [lp]
    return out


def constraints(batch: list[DecodeRequest]) -> list[Constraint | None] | None:
    """Each request's grammar state (:func:`model.sampling.sample`'s ``constraints``); None when no request of
    ``batch`` has one."""
    return [r.constraint for r in batch] if any(r.constraint for r in batch) else None


def allows(req: DecodeRequest, token: int) -> bool:
    """Take ``token`` (sampled for ``req`` elsewhere: a prefill worker's first token) into its grammar state;
    False, taking nothing, when its grammar does not allow it (always True without a grammar)."""
    if req.constraint is None:
        return True
    try:
        req.constraint.accept(token)
    except ValueError:
        return False
    return True


def grammar_dead_end(req: DecodeRequest) -> ErrorEvent | None:
    """The error that ends ``req`` when its grammar reached a dead end (:attr:`Constraint.dead_end`: its
    schema cannot be completed), else None."""
    if req.constraint is None or not req.constraint.dead_end:
        return None
    return ErrorEvent(grpc.StatusCode.INVALID_ARGUMENT, f"the structured output grammar allows no token after "
                      f"{len(req.output_ids) - 1} output tokens: the schema cannot be completed")


def histories(batch: list[DecodeRequest]) -> list[History]:
    """Each request's prompt, output so far and stop tokens (:func:`model.sampling.sample`'s ``histories``:
    read only by the rows with ``min_tokens``, a logit bias or penalties)."""
    return [(r.prompt_distinct if r.sampling.repetition_penalty != 1.0 else r.prompt_ids, r.output_ids, r.stop_ids)
            for r in batch]


# What other threads post to the engine's inbox (the engine thread alone changes request state).
@dataclass(frozen=True)
class KVArrived:
    """Every KV page of ``attempt_id`` has arrived, with the first token the prefill worker sampled."""

    attempt_id: str
    first_token: int


@dataclass(frozen=True)
class KVFailed:
    """The KV transfer of ``attempt_id`` failed or timed out; ``reason`` goes into the request's error."""

    attempt_id: str
    reason: str


@dataclass(frozen=True)
class AbortRequest:
    """End ``attempt_id`` (its client is gone); idempotent."""

    attempt_id: str


def check_kv_timeout(kv_timeout_s: float) -> float:
    """Return ``kv_timeout_s`` (seconds) if it is a usable KV deadline: finite, in (0, :data:`MAX_KV_TIMEOUT_S`].

    Raises:
        ValueError: anything else (NaN, infinite, zero, negative, above the maximum); the message names
            the range.
    """
    check_seconds("kv_timeout_s", kv_timeout_s, high=MAX_KV_TIMEOUT_S)   # the router's config checks the same
    return float(kv_timeout_s)
