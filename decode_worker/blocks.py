"""The decode worker's KV blocks, taken as requests grow, and the room a step needs.

A request gets, when it is admitted, the blocks for the positions it has (prompt and prior output) and
for the position its next token is written at; then one more block each time its context crosses a
block boundary, just before the step that writes there (vLLM's on-demand allocation; until 2026-11-29
the worker took ``prompt + max_tokens`` positions up front, so a chat request without ``max_tokens``
held 4,096 positions of blocks for its whole life). When a step's rows need a block the pool does not
have, the engine preempts the most recently admitted running request: its blocks are freed and it is
prefilled again later, prompt and output so far (:meth:`~decode_worker.engine.DecodeEngine.step`;
vLLM's recompute preemption, Kwon et al., SOSP 2023).
"""

from __future__ import annotations

import logging

from pdserve.cluster.lifecycle import RequestState
from pdserve.decode_worker.request import DecodeRequest, by_priority, preemption_victim
from pdserve.model.kv_cache import BlockPool, KVCacheSpec, NoFreeBlocks

log = logging.getLogger(__name__)


def max_positions(num_prompt: int, max_tokens: int, max_context: int) -> int:
    """Token positions a request can ever write KV at: its prompt and every output token but the last
    (which is streamed, never fed back), at most the context."""
    return min(num_prompt + max_tokens - 1, max_context)


def first_blocks(spec: KVCacheSpec, num_context: int, limit: int) -> int:
    """Blocks a request takes when admitted with ``num_context`` tokens (prompt + prior output): those
    tokens' positions and the next one's, at most ``limit`` (:func:`max_positions`)."""
    return spec.num_blocks_for(min(num_context + 1, limit))


def grow(pool: BlockPool, spec: KVCacheSpec, req: DecodeRequest, positions: int) -> bool:
    """Extend ``req.block_table`` to cover token positions ``[0, positions)`` (at most the request's
    :func:`max_positions`). Returns False, with nothing taken, when the pool has too few free blocks."""
    cap = max_positions(len(req.prompt_ids), req.sampling.max_tokens, req.max_context)
    need = spec.num_blocks_for(min(positions, cap)) - len(req.block_table)
    if need <= 0:
        return True
    try:
        req.block_table.extend(pool.allocate(need))
    except NoFreeBlocks:
        return False
    return True


def covered(spec: KVCacheSpec, req: DecodeRequest) -> int:
    """Token positions ``req``'s blocks hold."""
    return len(req.block_table) * spec.block_size


class BlockGrowth:
    """The decode engine's side of on-demand blocks (mixed into :class:`~decode_worker.engine.DecodeEngine`,
    engine thread only): rows given their next block, preemption, preempted requests readmitted. Uses the
    engine's ``pool``, ``spec``, ``_requests`` (admission order), ``proposer``, its request counters,
    ``_blocks_lock`` and ``preemption_observer``."""

    def take_with_reserve(self, num: int) -> list[int]:
        """``num`` blocks for a request joining (admitted, or readmitted after a preemption), leaving a block
        free per DECODING request for its next block boundary, so that a newcomer does not preempt an older
        request a few steps later. Call with ``_blocks_lock`` held (any thread).

        Raises:
            NoFreeBlocks: fewer than ``num`` blocks would be free beyond that reserve (nothing is taken).
        """
        reserve = self.num_decoding
        if self.pool.num_free - num < reserve:
            raise NoFreeBlocks(f"need {num} KV blocks beside {reserve} kept for the running requests' next "
                               f"blocks, {self.pool.num_free} of {self.num_usable_blocks} free")
        return self.pool.allocate(num)

    def _runnable(self) -> bool:
        """Work for a step: a DECODING request, or a PREFILLING one with blocks (preempted requests get
        blocks first where the pool has them). Without any, the engine waits on its inbox."""
        self._readmit_preempted()
        return self.num_decoding > 0 or self.num_prefilling > self.num_preempted

    def _make_room(self, batch: list[DecodeRequest]) -> list[DecodeRequest]:
        """Give every row of ``batch`` (DECODING, oldest first) the block its next token is written to;
        while the pool is short, preempt a request that holds blocks (which may be the row itself): the most
        recently admitted of those with the highest ``priority`` value (:func:`preemption_victim`). Returns the
        rows still DECODING."""
        kept = []
        for req in batch:
            while req.state is RequestState.DECODING and not grow(self.pool, self.spec, req, req.num_tokens):
                if not self._trim_lookahead():
                    self._preempt(preemption_victim(r for r in self._requests.values() if r.block_table
                                                    and r.state in (RequestState.DECODING, RequestState.PREFILLING)))
            if req.state is RequestState.DECODING:
                kept.append(req)
        return kept

    def _trim_lookahead(self) -> int:
        """Free the blocks DECODING requests took ahead of their next token (for a multi-step run or
        speculative drafts) beyond the one it is written to. Returns how many were freed."""
        freed = 0
        for r in self._requests.values():
            keep = self.spec.num_blocks_for(r.num_tokens)
            if r.state is RequestState.DECODING and len(r.block_table) > keep:
                self.pool.free(r.block_table[keep:])
                freed += len(r.block_table) - keep
                del r.block_table[keep:]
        return freed

    def _preempt(self, req: DecodeRequest) -> None:
        """DECODING (or PREFILLING) -> PREFILLING with no blocks and nothing computed: its prompt and
        output so far are prefilled again once blocks are free (:meth:`_readmit_preempted`)."""
        if req.state is RequestState.DECODING:
            self.num_decoding -= 1
            self.num_prefilling += 1
        with self._blocks_lock:     # freed and counted at once: admission sees both or neither
            self.pool.free(req.block_table)
            self.num_preempted += 1
        req.block_table, req.num_computed, req.state = [], 0, RequestState.PREFILLING
        if self.proposer is not None:
            self.proposer.forget(req)   # a draft model's cache mirrors the blocks just freed
        self.num_preemptions += 1
        if self.preemption_observer is not None:
            self.preemption_observer()
        log.info("preempted %s at %d tokens (KV pool short: %d of %d blocks free); it is prefilled again "
                 "when blocks free up", req.attempt_id, req.num_tokens, self.pool.num_free, self.num_usable_blocks)

    def _readmit_preempted(self) -> None:
        """Blocks for preempted requests, by priority then oldest first, while the pool has them beside the
        running requests' reserve (:meth:`take_with_reserve`): they prefill again."""
        if not self.num_preempted:
            return
        for req in by_priority(self._requests.values()):
            if req.state is RequestState.PREFILLING and not req.block_table:
                positions = max_positions(len(req.prompt_ids), req.sampling.max_tokens, req.max_context)
                with self._blocks_lock:
                    try:
                        req.block_table = self.take_with_reserve(first_blocks(self.spec, req.num_tokens, positions))
                    except NoFreeBlocks:
                        return
                    self.num_preempted -= 1
                if not self.num_preempted:
                    return

