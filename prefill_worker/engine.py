"""The prefill engine: chunked prefill over a paged cache, pages streamed while computing.

Each :meth:`PrefillEngine.step`:

    1. schedule     requests already prefilling first, then queued ones (FCFS), each
                    taking a chunk of at most the remaining token budget
                    (``max_num_batched_tokens``); a queued request is admitted when its
                    blocks can be had (cached prefix matched, the rest allocated)
    2. run          one forward over every chunk; chunks attend to earlier chunks'
                    KV through the paged cache
    3. postprocess  hand every block the step completed to the KV senders; for
                    prompts that are done, sample the first token and queue ``Finish``

Chunked prefill: Agrawal et al., "Sarathi-Serve" (OSDI 2024); vLLM's chunked prefill.
The prefill worker's states (``QUEUED``, ``PREFILLING``, ``TRANSFERRING``, ``FINISHED`` of
:class:`~cluster.lifecycle.RequestState`) are drawn in :mod:`prefill_worker.request`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from pdserve.cluster.kv_events import KVEvent
from pdserve.cluster.lifecycle import RequestState
from pdserve.kvtransfer.select import make_sender
from pdserve.model.config import ModelConfig
from pdserve.model.kv_cache import BlockPool, KVCacheSpec, NoFreeBlocks
from pdserve.model.llama import LlamaForCausalLM
from pdserve.model.runner import ModelRunner, StepInput
from pdserve.model.sampling import prompt_logprobs, sample, token_logprobs
from pdserve.model.structured import Grammars
from pdserve.prefill_worker.blocks import BlockSource, PlainBlocks
from pdserve.prefill_worker.config import PrefillWorkerConfig
from pdserve.prefill_worker.prefix_cache import PrefixCache, PrefixMatch
from pdserve.prefill_worker.request import PrefillRequest, PrefillResult
from pdserve.prefill_worker.sender import Finish, KVSendLoop, Release, SendPages

log = logging.getLogger(__name__)


class PrefillEngine:
    """Owns the prefill worker's model, KV cache, blocks and KV senders. ``secret``: the cluster
    secret its KV connections authenticate with (None: none)."""

    def __init__(self, cfg: PrefillWorkerConfig, model: LlamaForCausalLM, model_cfg: ModelConfig,
                 on_kv_event: Callable[[KVEvent], None] | None = None, secret: bytes | None = None) -> None:
        self.cfg, self.model_cfg = cfg, model_cfg
        self.spec = KVCacheSpec.for_model(model_cfg, cfg.num_blocks, cfg.block_size, cfg.torch_dtype)
        if self.spec.num_blocks_for(model_cfg.max_model_len) > cfg.num_blocks:
            raise ValueError(f"num_blocks={cfg.num_blocks} cannot hold one prompt of the model's "
                             f"{model_cfg.max_model_len}-token context (serve a shorter one with --max-model-len, or "
                             f"give it more blocks)")
        self.runner = ModelRunner(model, self.spec)
        self.grammars = Grammars(cfg.model_dir, model_cfg.vocab_size, model_cfg.eos_token_ids)   # compiled on demand
        self.pool = BlockPool(cfg.num_blocks)
        self.blocks: BlockSource = (PrefixCache(self.pool, cfg.block_size, on_kv_event) if cfg.prefix_cache
                                    else PlainBlocks(self.pool))
        self.kv_sender = make_sender(self.runner.kv_cache, self.spec, cfg.kv_connect_timeout_s, cfg.kv_io_timeout_s,
                                     secret=secret, sender_id=cfg.worker_id, transport=cfg.kv_transport)
        self.sender = KVSendLoop(self.kv_sender, self.blocks, model_cfg.num_layers, self._finished,
                                 cfg.fault_hold_transfer_s)
        self._lock = threading.Condition()
        self._queue: deque[PrefillRequest] = deque()     # QUEUED, by priority, then oldest first
        self._running: list[PrefillRequest] = []          # PREFILLING (engine thread)
        self._live: dict[str, PrefillRequest] = {}        # every request not yet delivered
        self.seconds_per_token: float | None = None       # measured prefill cost (moving average)

    # ---- called from other threads -------------------------------------------------
    def add_request(self, req: PrefillRequest) -> None:
        """Queue a prompt.

        Raises:
            ValueError: duplicate attempt id, a destination block table that does not fit the prompt, or a
                structured output schema that does not compile.
        """
        if req.sampling.constrained and req.constraint is None:   # in process; the server compiles it off its loop
            req.constraint = self.grammars.constraint(req.sampling.grammar, req.history(())[1],
                                                      req.sampling.grammar_after)
        need = self.spec.num_blocks_for(len(req.token_ids))
        if len(req.dst_block_ids) != need:
            raise ValueError(f"{len(req.dst_block_ids)} destination blocks for a {len(req.token_ids)}-token "
                             f"prompt; need {need}")
        with self._lock:
            if req.attempt_id in self._live:
                raise ValueError(f"request id {req.attempt_id!r} is already in use on this worker")
            self._live[req.attempt_id] = req
            at = len(self._queue)      # lower priority values first, ties in arrival order (vLLM's priority)
            while at and self._queue[at - 1].sampling.priority > req.sampling.priority:
                at -= 1
            self._queue.insert(at, req)
            self._lock.notify()

    def abort(self, attempt_id: str) -> None:
        """Stop the request wherever it is; its blocks are released. Idempotent."""
        with self._lock:
            if attempt_id in self._live:
                self._live[attempt_id].aborted = True

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    @property
    def num_in_flight(self) -> int:
        """Requests admitted and not yet delivered (prefilling or transferring)."""
        with self._lock:
            return len(self._live) - len(self._queue)

    @property
    def num_queued_tokens(self) -> int:
        """Prompt tokens still to compute, queued or prefilling."""
        with self._lock:
            return sum(r.num_remaining for r in self._queue) + sum(r.num_remaining for r in self._running)

    # ---- engine thread ---------------------------------------------------------------
    def run_forever(self, stop: threading.Event) -> None:
        """Step until ``stop`` is set."""
        while not stop.is_set():
            with self._lock:
                if not self._queue and not self._running:
                    self._lock.wait(timeout=0.05)
                    continue
            try:
                self.step()
            except Exception:  # fail the running requests, keep serving
                log.exception("prefill step failed")
                for req in self._running:
                    self.sender.submit(Release(req, "prefill step failed on the worker (see its log)"))
                self._running.clear()
        with self._lock:
            leftovers, self._queue = [*self._queue], deque()
        for req in leftovers:
            self._finished(req, PrefillResult(error="prefill worker shutting down"))
        for req in self._running:
            self.sender.submit(Release(req, "prefill worker shutting down"))
        self.sender.close()

    def step(self) -> None:
        """Schedule chunks, run them in one forward, hand finished pages and first tokens to the sender."""
        chunks = self._schedule()
        if not chunks:
            return
        started = time.monotonic()
        logits = self._forward(chunks)
        self._measure(time.monotonic() - started, sum(n for _, n in chunks))
        done = [(i, r) for i, (r, n) in enumerate(chunks) if n == r.num_remaining]
        eos = self.model_cfg.eos_token_ids
        firsts = sample(logits[[i for i, _ in done]], [r.sampling for _, r in done],
                        [r.first_output_index for _, r in done], [r.history(eos) for _, r in done],
                        [r.constraint for _, r in done]) if done else []
        wants = [(i, r, t) for (i, r), t in zip(done, firsts) if r.sampling.logprobs is not None]
        if wants:  # only requests that ask pay for the log-softmax
            for (_, r, _), lp in zip(wants, token_logprobs(logits[[i for i, _, _ in wants]], [t for _, _, t in wants],
                                                           [r.sampling.logprobs for _, r, _ in wants])):
                r.first_logprobs = lp
        now = time.monotonic()
        for req, n in chunks:
            req.num_computed += n
        for (_, req), token in zip(done, firsts):
            req.first_token, req.computed_at, req.state = token, now, RequestState.TRANSFERRING
            self.blocks.insert(req.token_ids, req.block_table, req.sampling.cache_salt)
            self._running.remove(req)
        for req, _ in chunks:
            ready = len(req.block_table) if req.num_remaining == 0 else req.num_computed // self.spec.block_size
            if ready > req.num_blocks_handed:
                self.sender.submit(SendPages(req, req.num_blocks_handed, ready))
                req.num_blocks_handed = ready
            if req.num_remaining == 0:
                self.sender.submit(Finish(req))

    def _forward(self, chunks: list[tuple[PrefillRequest, int]]) -> torch.Tensor:
        """The chunks' forward: the logits of each chunk's last token ``[len(chunks), vocab]``; the prompt
        log-probabilities of the chunks whose requests ask for them are kept on their requests."""
        inputs = [StepInput(r.token_ids[r.num_computed:r.num_computed + n], r.num_computed, r.block_table)
                  for r, n in chunks]
        whole = [r.sampling.prompt_logprobs is not None for r, _ in chunks]
        if not any(whole):
            return self.runner.run(inputs)
        logits, rows = self.runner.run_with_rows(inputs, whole)
        for (req, _), row_logits in zip(chunks, rows):
            if row_logits is not None:
                req.prompt_logprobs += prompt_logprobs(row_logits, req.token_ids, req.num_computed,
                                                       req.sampling.prompt_logprobs)
        return logits

    def _measure(self, seconds: float, num_tokens: int, weight: float = 0.2) -> None:
        """Moving average of prefill seconds per computed token over whole steps: the worker's
        throughput, which routers use to cost a prompt (per-request times would count the
        other requests sharing the steps)."""
        sample_s = seconds / num_tokens
        old = self.seconds_per_token
        self.seconds_per_token = sample_s if old is None else (1 - weight) * old + weight * sample_s

    def _schedule(self) -> list[tuple[PrefillRequest, int]]:
        """(request, chunk tokens) pairs for this step, within the token budget."""
        budget = self.cfg.max_num_batched_tokens
        for req in [r for r in self._running if r.aborted or r.error]:  # no compute for a dead transfer
            self._running.remove(req)
            self.sender.submit(Release(req, "aborted"))
        chunks = []
        for req in self._running:
            if budget == 0:
                break
            n = min(req.num_remaining, budget)
            chunks.append((req, n))
            budget -= n
        with self._lock:
            while self._queue and budget > 0:
                req = self._queue[0]
                if req.aborted:
                    self._queue.popleft()
                    self._finished(req, PrefillResult(error="aborted"))
                    continue
                if not self._admit(req):
                    break  # blocks come back as transfers finish
                self._queue.popleft()
                self._running.append(req)
                n = min(req.num_remaining, budget)
                chunks.append((req, n))
                budget -= n
        return chunks

    def _admit(self, req: PrefillRequest) -> bool:
        """Match the cached prefix and allocate the rest of the prompt's blocks; False if they cannot be had."""
        # a prompt's log-probabilities need every position computed: no cached prefix for it
        match = self.blocks.match(req.token_ids, req.sampling.cache_salt) if req.sampling.prompt_logprobs is None \
            else PrefixMatch([], 0)
        try:
            fresh = self.blocks.allocate(self.spec.num_blocks_for(len(req.token_ids)) - len(match.block_ids))
        except NoFreeBlocks:
            self.blocks.release(match.block_ids)
            return False
        req.block_table = match.block_ids + fresh
        req.num_cached_tokens = req.num_computed = match.num_cached_tokens
        req.state, req.admitted_at = RequestState.PREFILLING, time.monotonic()
        return True

    def _finished(self, req: PrefillRequest, result: PrefillResult) -> None:
        """FINISHED: deliver a request's result (a sender lane, or the engine for never-admitted requests)."""
        req.state = RequestState.FINISHED
        with self._lock:
            self._live.pop(req.attempt_id, None)
        req.on_done(result)
