"""A request's life on the prefill worker: ``QUEUED``, ``PREFILLING``, ``TRANSFERRING`` and
``FINISHED`` of :class:`~cluster.lifecycle.RequestState` (the whole lifecycle: :mod:`cluster.lifecycle`)::

    add_request ─► QUEUED ─(admitted: cached prefix matched, blocks allocated)─► PREFILLING
                                                                                   │ one chunk per step;
                                                                                   │ finished blocks' pages
                                                                                   │ go to the sender at once
                                                            last chunk: first token sampled
                                                                                   ▼
    FINISHED ◄─(sender: ack from the decode worker, or failure)── TRANSFERRING (last pages + first token)

Abort (the router cancelled) or a failed transfer sends the request to FINISHED from
QUEUED or PREFILLING at the next step; a TRANSFERRING one ends when its transfer does (the
decode worker refuses the pages of a request it no longer expects). Owner of its blocks: the
engine until admission fails or the request is admitted; from admission on, blocks are
released only by the sender (its decode worker's lane), after its last job for the request, so no page is read
after its block is reused. A request is known by its ``attempt_id``: the ``request_id`` of
the router's Prefill call, which names one attempt of a client's request (:mod:`router.recovery`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.cluster.lifecycle import RequestState
from pdserve.kvtransfer import KVChannel
from pdserve.model.sampling import SamplingParams, TokenLogprobs
from pdserve.model.structured import Constraint


@dataclass(frozen=True)
class PrefillResult:
    """Outcome of one prefill: the first token and timings, or an error.

    Attributes:
        first_token: the sampled first output token (``None`` when ``error`` is set).
        error: why the request failed; empty on success.
        queue_s: seconds from arrival to admission.
        prefill_s: seconds from admission to the last chunk's end.
        transfer_s: seconds from the first page sent to the decode worker's acknowledgement.
        transfer_tail_s: seconds from the last chunk's end to the acknowledgement (the part of
            the transfer that compute did not hide).
        num_kv_bytes: KV page bytes sent.
        num_cached_tokens: prompt tokens whose KV came from the prefix cache.
    """

    first_token: int | None = None
    error: str = ""
    queue_s: float = 0.0
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    transfer_tail_s: float = 0.0
    num_kv_bytes: int = 0
    num_cached_tokens: int = 0


@dataclass
class PrefillRequest:
    """One prompt to prefill and where its KV goes (mutable engine state); ``attempt_id`` names it
    on this worker and on the KV transfer."""

    attempt_id: str
    token_ids: list[int]
    sampling: SamplingParams
    dst_kv_address: str
    dst_block_ids: list[int]
    on_done: Callable[[PrefillResult], None]
    first_output_index: int = 0        # output index of the sampled token (> 0: a migrated request)
    state: RequestState = RequestState.QUEUED
    aborted: bool = False
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_computed: int = 0              # prompt tokens whose KV is in the cache
    num_blocks_handed: int = 0         # blocks already handed to the sender
    first_token: int | None = None
    first_logprobs: TokenLogprobs | None = None  # when sampling.logprobs is set (router-bound, not sent over KV)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # tokens 1.. when sampling.prompt_logprobs
    constraint: Constraint | None = None  # a structured answer's grammar state (past any prior output)
    error: str = ""                    # set by the sender when the transfer failed
    channel: KVChannel | None = None   # its sender lane only
    arrived_at: float = field(default_factory=time.monotonic)
    admitted_at: float = 0.0
    computed_at: float = 0.0
    first_page_at: float = 0.0

    def history(self, eos_token_ids: tuple[int, ...]) -> tuple[list[int], list[int], frozenset[int]]:
        """The prompt, the prior output (a migrated request's) and the stop tokens (the model's EOS tokens
        ``eos_token_ids`` unless ignored), as the first token's ``min_tokens`` and penalties see them."""
        cut = len(self.token_ids) - self.first_output_index
        return self.token_ids[:cut], self.token_ids[cut:], self.sampling.stop_ids(eos_token_ids)

    @property
    def num_remaining(self) -> int:
        """Prompt tokens still to compute."""
        return len(self.token_ids) - self.num_computed
