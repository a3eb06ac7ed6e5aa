"""Start-up warm-up of a decode engine: every batch bucket and path once, before the worker registers.

The first step of each new shape pays one-time costs: the C kernels of :mod:`kernels.cpu` are built
(or loaded from the cache) at their first call, oneDNN creates a primitive per matmul shape, torch
initialises each operator path (sampling's sort and ``exponential_``, log-softmax). Met by a request,
they stall it; met here, before the lease, they stall nobody. vLLM does the same at start (it profiles
memory and captures a CUDA graph per batch bucket before serving); this module drives the engine
itself over synthetic requests, so the warm-up takes exactly the serving code paths::

    per decode bucket b (the GraphRunner's; without it, the batch classes 1, 2, 4, .. max_batch_size)
        n requests of a 2-token prompt and max_tokens 2, n the smallest batch the step pads to b
        step 1: one mixed step prefills the n prompts (first tokens sampled)
        step 2: one decode step at bucket b (sampling greedy / top-k top-p / logprobs rows, cycled)
    speculation (when configured), per batch class up to spec_max_batch_size
        requests of a repetitive prompt run to max_tokens through the proposer and verification,
        plus one verify-shaped step ([1 + k] tokens per row, every k <= spec_k) on scratch blocks
    colocated: one request per prefill chunk-length class (powers of two up to the step budget, and
        the budget), and one prompt longer than the budget (a continuation chunk over its prefix)

Every request ends through the engine's own retirement (its blocks freed, proposer and adaptive
state forgotten); afterwards the pool must be as full as before, else the warm-up fails. Nothing is
counted in the worker's request metrics: those are recorded by the gRPC servicer, which warm-up
requests never pass. Not warmed: the KV receiver (its pages land with ``recv_into``, no compute) and
the first connection from each prefill worker (a per-peer handshake).
"""

from __future__ import annotations

import itertools

import torch

from pdserve.cluster.warmup import WarmupReport, row_classes
from pdserve.decode_worker.engine import DecodeEngine
from pdserve.decode_worker.request import ErrorEvent
from pdserve.model.runner import StepInput
from pdserve.model.sampling import SamplingParams

MAX_WARMUP_STEPS = 10_000  # a bound on engine steps per round: a bug must fail the start, not hang it


def _sampling_variants(max_tokens: int) -> list[SamplingParams]:
    """Greedy, top-k/top-p sampled, greedy with log-probabilities, and greedy with a logit bias and penalties:
    each path :func:`model.sampling.sample` and :func:`model.sampling.token_logprobs` take. ``ignore_eos`` so
    every request lives ``max_tokens``."""
    return [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
            SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=1, max_tokens=max_tokens, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, presence_penalty=0.5,
                           frequency_penalty=0.5, repetition_penalty=1.2, logit_bias=((0, 1.0),))]


class _Driver:
    """Runs rounds of synthetic requests through a :class:`DecodeEngine` that nothing else uses yet."""

    def __init__(self, engine: DecodeEngine) -> None:
        self.engine = engine
        self._ids = itertools.count()
        self._errors: list[ErrorEvent] = []
        self._gen = torch.Generator().manual_seed(0)

    def tokens(self, n: int) -> list[int]:
        """``n`` token ids drawn (seeded) from the vocabulary."""
        return torch.randint(0, self.engine.model_cfg.vocab_size, (n,), generator=self._gen).tolist()

    def _sink(self, event) -> None:
        if isinstance(event, ErrorEvent):
            self._errors.append(event)

    def blocks_per_request(self, prompt_len: int, max_tokens: int) -> int:
        """Blocks a warm-up request holds at most (its whole life; the engine takes them as it grows)."""
        return self.engine.spec.num_blocks_for(prompt_len + max_tokens - 1)

    def round(self, requests: list[tuple[list[int], SamplingParams]]) -> None:
        """Admit ``requests`` (prompt ids, sampling) as local prefills and step until all have finished.

        Raises:
            RuntimeError: a request failed, or the engine did not finish them within the step bound.
        """
        e = self.engine
        for prompt, sampling in requests:
            e.add_local(f"warmup-{next(self._ids)}", prompt, sampling, self._sink)
        for _ in range(MAX_WARMUP_STEPS):
            e.step()
            if not (e.num_decoding or e.num_prefilling or e.num_transferring):
                break
        else:
            raise RuntimeError(f"warm-up requests still running after {MAX_WARMUP_STEPS} steps")
        if self._errors:
            raise RuntimeError(f"a warm-up request failed: {self._errors[0].message}")


def warm_up_decode(engine: DecodeEngine) -> WarmupReport:
    """Run every decode bucket, the speculative verify shapes, the sampling paths and, colocated, the
    prefill chunk classes once on ``engine`` (module docstring). Call it before the engine thread serves:
    it steps the engine on the calling thread. The engine's last-step timing is reset afterwards.

    Returns:
        The prefill chunk shapes (colocated: chunk classes plus a continuation) and decode buckets run.
    Raises:
        RuntimeError: the engine already holds requests, a warm-up step failed, or blocks stayed allocated.
    """
    e, cfg = engine, engine.cfg
    if e.num_decoding or e.num_prefilling or e.num_transferring:
        raise RuntimeError("warm-up needs an idle decode engine")
    free_before = e.pool.num_free
    driver = _Driver(e)
    max_ctx = e.model_cfg.max_model_len
    report_prefill, report_buckets = 0, 0

    # decode buckets: with the graph runner, the smallest batch each bucket pads to; else the classes
    buckets = e.graph.buckets if e.graph is not None else tuple(row_classes(e.max_batch_size))
    per_req = driver.blocks_per_request(2, 2)
    prev = 0
    for bucket in buckets:
        n = min(prev + 1 if e.graph is not None else bucket, free_before // per_req)
        reached = n > prev if e.graph is not None else n == bucket
        prev = bucket
        if not reached or n < 1:  # the pool cannot hold a batch this large: never met in serving either
            continue
        variants = _sampling_variants(2)
        driver.round([(driver.tokens(2), variants[i % len(variants)]) for i in range(n)])
        report_buckets += 1

    if e.proposer is not None and cfg.spec_max_batch_size > 0:
        report_buckets += _warm_speculation(driver)

    if cfg.colocated:
        report_prefill += _warm_local_prefill(driver, max_ctx)

    e.last_step = (0, 0, 0.0)  # no warm-up timing reaches the routers' step-time models
    if e.pool.num_free != free_before or e.num_decoding or e.num_prefilling or e.num_transferring:
        raise RuntimeError(f"warm-up left {free_before - e.pool.num_free} KV blocks allocated")
    return WarmupReport(num_prefill_shapes=report_prefill, num_decode_buckets=report_buckets)


def _warm_speculation(driver: _Driver) -> int:
    """Speculative steps at each batch class up to ``spec_max_batch_size``: requests through the proposer
    and verification, and verify-shaped steps (``1 + k`` tokens per row for every ``k <= spec_k``) on
    scratch blocks, since an adaptive n-gram request may not verify at all in a short round. Returns
    the batch classes run."""
    e, cfg = driver.engine, driver.engine.cfg
    k_max, prompt_len = cfg.spec_k, 12
    max_tokens = k_max + 3
    if prompt_len + max_tokens + k_max > e.model_cfg.max_model_len:
        return 0
    free = e.pool.num_free
    runs = 0
    for n in row_classes(min(cfg.spec_max_batch_size, e.max_batch_size)):
        if n * driver.blocks_per_request(prompt_len, max_tokens + k_max) > free:
            break
        pattern = driver.tokens(3)
        variants = _sampling_variants(max_tokens)
        driver.round([((pattern * 4)[:prompt_len], variants[i % len(variants)]) for i in range(n)])
        tables = [e.pool.allocate(e.spec.num_blocks_for(prompt_len + k_max + 1)) for _ in range(n)]
        try:
            for k in range(1, k_max + 1):
                e.runner.run([StepInput(driver.tokens(k + 1), prompt_len, t) for t in tables], all_logits=True)
        finally:
            for t in tables:
                e.pool.free(t)
        runs += 1
    return runs


def _warm_local_prefill(driver: _Driver, max_ctx: int) -> int:
    """A colocated worker's prefill chunks: one prompt per chunk-length class up to the step budget (a
    first chunk each), then one prompt a little longer than the budget (its second chunk continues over
    the first's KV). Prompts the context or the pool cannot hold are left out. Returns the chunks run."""
    e, cfg = driver.engine, driver.engine.cfg
    budget = min(cfg.max_num_batched_tokens, max_ctx - 2)
    chunks = 0
    sampling = _sampling_variants(2)[0]
    for n in row_classes(budget):
        if driver.blocks_per_request(n, 2) > e.pool.num_free:
            break
        driver.round([(driver.tokens(n), sampling)])
        chunks += 1
    tail = min(16, max_ctx - 2 - budget)
    if tail > 0 and driver.blocks_per_request(budget + tail, 2) <= e.pool.num_free:
        driver.round([(driver.tokens(budget + tail), sampling)])  # a budget-long chunk, then the tail over it
        chunks += 1
    return chunks
