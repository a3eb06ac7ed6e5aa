"""Start-up warm-up of a prefill engine: every chunk-length class and attention path once, before the
worker registers.

With a chunk budget of ``B`` tokens every chunk the engine runs has 1..B rows. The kernels under a
chunk choose their code by row count (oneDNN creates a matmul primitive per shape and blocks by size
classes, the C kernels of :mod:`kernels.cpu` serve chunks of up to 8 tokens and are built at their
first call), and attention takes one of three paths: plain causal SDPA for a lone first chunk, the
C kernel for short chunks, the gathered and masked SDPA for a chunk over earlier context or several
sequences. The warm-up runs, on the engine's model runner and scratch blocks::

    first chunks         one fresh prompt per class: 1, 2, 4, .. < B, and B
    continuations        a block-aligned prefix P (about B/2) is cached, then prompt P + L for L of each
                         attention path (1, 8, 16, and B or what the context leaves): the prefix matches
                         in the prefix cache and only the L-token chunk runs, over the cached context
                         (the path a long prompt's later chunks and a prefix hit take); without a prefix
                         cache, one prompt of up to 2B tokens in two chunks
    several sequences    one step of two short chunks
    sampling             greedy, top-k/top-p and log-probabilities on the last logits

Blocks come from a private :class:`PrefixCache` over the engine's pool (so the worker's own cache
stays empty and no KV event is published) and all return to the pool; the engine's measured
``seconds_per_token`` is left unset, since warm-up steps are not representative.
"""

from __future__ import annotations

import torch

from pdserve.cluster.warmup import WarmupReport, row_classes
from pdserve.kernels.paged_attention import CPU_KERNEL_MAX_QUERY
from pdserve.model.runner import StepInput
from pdserve.model.sampling import SamplingParams, sample, token_logprobs
from pdserve.prefill_worker.blocks import BlockSource, PlainBlocks
from pdserve.prefill_worker.engine import PrefillEngine
from pdserve.prefill_worker.prefix_cache import PrefixCache

SAMPLING_PATHS = (SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=1),
                  SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
                                 logit_bias=((0, 1.0),), min_tokens=1))
MULTI_SEQ_TOKENS = 16  # tokens per sequence of the several-sequence step (beyond the C kernels' 8)


def continuation_lengths(limit: int) -> list[int]:
    """Chunk lengths (tokens, at most ``limit``) that meet every attention path of a chunk over earlier
    context: 1 and :data:`~kernels.paged_attention.CPU_KERNEL_MAX_QUERY` (the C kernel), one just above
    it and ``limit`` (the gathered, masked SDPA). Their projections are the first chunks' shapes, already
    warm, so the other row classes would add compute and no new path."""
    return sorted({n for n in (1, CPU_KERNEL_MAX_QUERY, 2 * CPU_KERNEL_MAX_QUERY, limit) if 1 <= n <= limit})


class _Prefiller:
    """Prefills prompts the way the engine does (match, allocate, chunks of at most the budget, insert,
    release), counting the chunks run."""

    def __init__(self, engine: PrefillEngine, blocks: BlockSource, budget: int) -> None:
        self.engine, self.blocks, self.budget = engine, blocks, budget
        self.num_chunks = 0
        self._gen = torch.Generator().manual_seed(0)

    def tokens(self, n: int) -> list[int]:
        """``n`` token ids drawn (seeded) from the vocabulary."""
        return torch.randint(0, self.engine.model_cfg.vocab_size, (n,), generator=self._gen).tolist()

    def prefill(self, ids: list[int]) -> torch.Tensor:
        """The ``[1, vocab]`` float32 logits of ``ids``' last token; its full blocks stay cached (evictable)."""
        spec = self.engine.spec
        match = self.blocks.match(ids)
        try:
            table = match.block_ids + self.blocks.allocate(spec.num_blocks_for(len(ids)) - len(match.block_ids))
        except BaseException:
            self.blocks.release(match.block_ids)
            raise
        try:
            done = match.num_cached_tokens
            while done < len(ids):
                n = min(self.budget, len(ids) - done)
                logits = self.engine.runner.run([StepInput(ids[done:done + n], done, table)])
                done += n
                self.num_chunks += 1
            self.blocks.insert(ids, table)
        finally:
            self.blocks.release(table)
        return logits

    def several(self, lengths: list[int]) -> torch.Tensor:
        """One step over fresh prompts of ``lengths`` together; returns their ``[len(lengths), vocab]`` logits."""
        spec = self.engine.spec
        prompts = [self.tokens(n) for n in lengths]
        tables: list[list[int]] = []
        try:
            for p in prompts:
                tables.append(self.blocks.allocate(spec.num_blocks_for(len(p))))
            logits = self.engine.runner.run([StepInput(p, 0, t) for p, t in zip(prompts, tables)])
            self.num_chunks += 1
        finally:
            for t in tables:
                self.blocks.release(t)
        return logits


def warm_up_prefill(engine: PrefillEngine) -> WarmupReport:
    """Run every chunk-length class, first and continuation chunks, a several-sequence step and the
    sampling paths once on ``engine`` (module docstring). Call it before the engine thread serves.

    Returns:
        The prefill chunks run (``num_prefill_shapes``).
    Raises:
        RuntimeError: the engine already holds requests, or blocks stayed allocated.
    """
    cfg, spec = engine.cfg, engine.spec
    if engine.num_queued or engine.num_in_flight:
        raise RuntimeError("warm-up needs an idle prefill engine")
    free_before = engine.pool.num_free
    max_prompt = engine.model_cfg.max_model_len - 1  # a prompt leaves room for one output token
    budget = min(cfg.max_num_batched_tokens, max_prompt)
    blocks = PrefixCache(engine.pool, spec.block_size) if cfg.prefix_cache else PlainBlocks(engine.pool)
    p = _Prefiller(engine, blocks, budget)
    try:
        logits = None
        for n in row_classes(budget):                              # first chunks
            logits = p.prefill(p.tokens(n))
        prefix_len = max(spec.block_size, budget // 2 // spec.block_size * spec.block_size)
        if cfg.prefix_cache and prefix_len < max_prompt:           # continuations over a cached prefix
            prefix = p.tokens(prefix_len)
            p.prefill(prefix)
            for n in continuation_lengths(min(budget, max_prompt - prefix_len)):
                p.prefill(prefix + p.tokens(n))
        elif budget < max_prompt:                                  # a prompt longer than one chunk
            p.prefill(p.tokens(min(max_prompt, budget + budget)))
        if 2 * spec.num_blocks_for(MULTI_SEQ_TOKENS) <= blocks.num_available:
            p.several([MULTI_SEQ_TOKENS, MULTI_SEQ_TOKENS])
        if logits is not None:
            rows = logits.expand(len(SAMPLING_PATHS), -1)
            history = ([0, 1], [], frozenset({0}))
            tokens = sample(rows, list(SAMPLING_PATHS), [0] * len(SAMPLING_PATHS), [history] * len(SAMPLING_PATHS))
            token_logprobs(rows, tokens, [2] * len(tokens))
    finally:
        if isinstance(blocks, PrefixCache):
            blocks.clear()
    if engine.pool.num_free != free_before:
        raise RuntimeError(f"warm-up left {free_before - engine.pool.num_free} KV blocks allocated")
    return WarmupReport(num_prefill_shapes=p.num_chunks)
