"""The decode engine: continuous batching over the paged KV cache.

Other threads talk to it only through :meth:`DecodeEngine.add_request`,
:meth:`DecodeEngine.abort` and the KV receiver's callbacks, all of which post to
an inbox (its messages: :mod:`decode_worker.request`); the engine thread alone owns request state.
Each :meth:`step`:

    1. drain the inbox   (KV arrived: TRANSFERRING -> DECODING; failures and aborts -> FINISHED)
    2. schedule          (up to max_batch_size DECODING requests, oldest first, each given the block its
                          next token needs; when the pool is short the most recently admitted running
                          request is preempted, to be prefilled again: :mod:`decode_worker.blocks`)
    3. run               (one batched forward, one new token per request; or several steps in one C call,
                          ended early by new work: :mod:`decode_worker.multi_step`)
    4. postprocess       (sample, stream, retire finished requests, free their blocks)

Requests join and leave at every token boundary (continuous batching, Yu et al.,
"Orca", OSDI 2022). The states (:class:`~cluster.lifecycle.RequestState`) are drawn in
:mod:`decode_worker.request`; requests are keyed by their attempt id.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import grpc

from pdserve.cluster.lifecycle import RequestState
from pdserve.decode_worker.blocks import BlockGrowth, first_blocks, grow, max_positions
from pdserve.decode_worker.config import DecodeWorkerConfig
from pdserve.decode_worker.graph_runner import DEFAULT_BUCKETS, GraphRunner
from pdserve.decode_worker.local_prefill import LocalPrefill
from pdserve.decode_worker.multi_step import plan_steps, sampling_inputs, stop_union
from pdserve.decode_worker.request import (
    AbortRequest,
    DecodeEventSink,
    DecodeRequest,
    ErrorEvent,
    FinishedEvent,
    KVArrived,
    KVFailed,
    TokensEvent,
    allows,
    check_kv_timeout,
    constraints,
    grammar_dead_end,
    histories,
    rows_logprobs,
)
from pdserve.decode_worker.speculative import AdaptiveSpeculation, NgramProposer, make_proposer
from pdserve.decode_worker.speculative_step import SpeculativeStep
from pdserve.kvtransfer.backends import backend_of_address
from pdserve.kvtransfer.select import make_receiver
from pdserve.model.config import ModelConfig
from pdserve.model.kv_cache import BlockPool, KVCacheSpec, NoFreeBlocks
from pdserve.model.llama import LlamaForCausalLM
from pdserve.model.runner import ModelRunner, StepInput
from pdserve.model.sampling import SamplingParams, TokenLogprobs, sample
from pdserve.model.structured import Constraint, Grammars

log = logging.getLogger(__name__)


class DecodeEngine(BlockGrowth, LocalPrefill, SpeculativeStep):
    """Owns the decode worker's model, KV cache, block pool and KV receiver. ``secret``: the cluster
    secret KV senders must prove (None: none). ``on_pool_freed()`` runs on the engine thread when an aborted or
    failed request's blocks are freed, which no request stream reports to the routers (the worker process
    renews its registry entry then: :meth:`cluster.worker_process.Heartbeat.nudge`)."""

    on_pool_freed: Callable[[], None] = staticmethod(lambda: None)

    def __init__(self, cfg: DecodeWorkerConfig, model: LlamaForCausalLM, model_cfg: ModelConfig,
                 secret: bytes | None = None) -> None:
        self.cfg, self.model_cfg = cfg, model_cfg
        self.spec = KVCacheSpec.for_model(model_cfg, cfg.num_blocks, cfg.block_size, cfg.torch_dtype)
        self.runner = ModelRunner(model, self.spec)
        self.grammars = Grammars(cfg.model_dir, model_cfg.vocab_size, model_cfg.eos_token_ids)   # compiled on demand
        self.pool = BlockPool(cfg.num_blocks)
        self.proposer = make_proposer(cfg, self.runner)
        self.adaptive = AdaptiveSpeculation(cfg.spec_min_acceptance, cfg.spec_ewma_weight, cfg.spec_probe_interval,
                                            cfg.spec_max_probe_interval, shadow=isinstance(self.proposer, NgramProposer)
                                            ) if self.proposer is not None and cfg.spec_adaptive else None
        # a decoding request holds a block at least: no batch outgrows the usable pool, nor need the buckets
        # and their static buffers (a --max-batch-size of 200,000 had warmed buckets to it, 2.4 GB of them)
        self.max_batch_size = min(cfg.max_batch_size, cfg.num_blocks - cfg.graph)
        if self.max_batch_size < cfg.max_batch_size:
            log.info("max_batch_size %d is more than the %d usable KV blocks hold: batches stop at %d",
                     cfg.max_batch_size, self.max_batch_size, self.max_batch_size)
        # a mixture's data-dependent expert routing cannot be captured in a CUDA graph: eager steps there
        graphed = cfg.graph and not (model_cfg.num_experts and self.runner.kv_cache.is_cuda)
        self.graph = GraphRunner(self.runner, self.pool, self.spec.num_blocks_for(model_cfg.max_model_len),
                                 [b for b in DEFAULT_BUCKETS if b < self.max_batch_size] + [self.max_batch_size]
                                 ) if graphed else None
        self.receiver = make_receiver(self.runner.kv_cache, self.spec, host=cfg.host, port=cfg.kv_port,
                                      io_timeout_s=cfg.kv_io_timeout_s, secret=secret, transport=cfg.kv_transport)
        # advertised in the registry entry: the receiver's own backend (the routers match P's against it)
        self.kv_backends = (backend_of_address(self.receiver.address),)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._interrupt = ctypes.c_int32(0)   # set with every inbox message: ends a multi-step run early
        self._requests: dict[str, DecodeRequest] = {}   # every unfinished request (engine thread)
        self._ids_lock = threading.Lock()
        self._live_ids: set[str] = set()                 # ids taken, for duplicate checks from any thread
        self.num_transferring = 0
        self.num_prefilling = 0
        self.last_step: tuple[int, int, float] = (0, 0, 0.0)  # batch, context tokens, seconds
        self.multi_step_observer: Callable[[int], None] | None = None   # told the steps of each multi-step run
        self.preemption_observer: Callable[[], None] | None = None      # told of each preemption
        self.num_decoding = 0
        self.num_preempted = 0        # PREFILLING again after a preemption, waiting for blocks
        self._blocks_lock = threading.Lock()   # admission's check and take against preemption's free (BlockGrowth)
        self.num_preemptions = 0      # since start

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can get: the pool less the graph runner's padding block."""
        return self.pool.num_blocks - (self.graph is not None)

    # ---- called from other threads -------------------------------------------------
    def add_request(self, attempt_id: str, prompt_ids: list[int], sampling: SamplingParams,
                    kv_timeout_s: float, emit: DecodeEventSink, prior_output_ids: list[int] = (),
                    constraint: Constraint | None = None) -> list[int]:
        """Pre-allocate the request's blocks and wait for its KV pages (TRANSFERRING), received
        under ``attempt_id``.

        Blocks cover the prompt (and prior output) and the next token's position; the engine adds
        blocks as the request grows (:mod:`decode_worker.blocks`). A migrated request brings the
        output an earlier decode worker produced (``prior_output_ids``): its pages cover prompt
        plus those tokens, and output indexes, ``max_tokens`` and stop checks continue after them.
        A structured answer's grammar state (``constraint``, past the prior output) is compiled here when
        not given (:attr:`grammars`: the server compiles it off its event loop).

        Returns:
            The block ids the KV pages (of prompt + prior output) must be written into (the first blocks).
        Raises:
            ValueError: ``kv_timeout_s`` not finite in (0, :data:`MAX_KV_TIMEOUT_S`] (checked before anything
                is allocated), duplicate attempt id, prompt and max_tokens beyond the context, prior
                output that already ends the request, or a structured output schema that does not compile.
            model.kv_cache.NoFreeBlocks: the pool cannot hold the request now (or, for prompt + max_tokens,
                ever), or preempted requests are waiting for blocks.
            RuntimeError: the KV receiver is closed (the worker is shutting down).
        If registering the transfer with the receiver fails, the allocation is rolled back (the engine
        frees the blocks) before the error propagates.
        """
        check_kv_timeout(kv_timeout_s)
        req = self._allocate(attempt_id, prompt_ids, sampling, emit, prior_output_ids, RequestState.TRANSFERRING,
                             constraint)
        prompt_blocks = req.block_table[: self.spec.num_blocks_for(req.num_tokens)]
        self._post(req)  # the engine learns of it before any receiver callback can fire
        try:
            self.receiver.expect(attempt_id, prompt_blocks, kv_timeout_s,
                                 on_complete=lambda rid, tok: self._post(KVArrived(rid, tok)),
                                 on_failed=lambda rid, why: self._post(KVFailed(rid, why)))
        except BaseException:
            self._post(AbortRequest(attempt_id))  # after the request in the inbox: retired, its blocks freed
            raise
        return prompt_blocks

    def add_local(self, attempt_id: str, prompt_ids: list[int], sampling: SamplingParams,
                  emit: DecodeEventSink, prior_output_ids: list[int] = (),
                  constraint: Constraint | None = None) -> None:
        """Admit a request whose prompt (plus ``prior_output_ids``, for a migrated request) this
        worker prefills itself (PREFILLING, no KV transfer); its next token is streamed too. Used in
        process by benchmarks and colocated serving.

        Raises:
            ValueError, NoFreeBlocks: as :meth:`add_request`.
        """
        self._post(self._allocate(attempt_id, prompt_ids, sampling, emit, prior_output_ids,
                                  RequestState.PREFILLING, constraint))  # chunks run in the next steps

    def _allocate(self, attempt_id: str, prompt_ids: list[int], sampling: SamplingParams,
                  emit: DecodeEventSink, prior_output_ids: list[int], state: RequestState,
                  constraint: Constraint | None = None) -> DecodeRequest:
        max_ctx = self.model_cfg.max_model_len
        if sampling.constrained and constraint is None:
            constraint = self.grammars.constraint(sampling.grammar, prior_output_ids, sampling.grammar_after)
        if len(prompt_ids) + sampling.max_tokens > max_ctx:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({sampling.max_tokens}) "
                             f"exceeds the model's context of {max_ctx} tokens")
        stop_ids = sampling.stop_ids(self.model_cfg.eos_token_ids)
        if len(prior_output_ids) >= sampling.max_tokens:
            raise ValueError(f"{len(prior_output_ids)} prior output tokens already reach max_tokens "
                             f"({sampling.max_tokens}): nothing left to decode")
        if prior_output_ids and prior_output_ids[-1] in stop_ids:
            raise ValueError("the prior output already ends with a stop token: nothing left to decode")
        with self._ids_lock:
            if attempt_id in self._live_ids:
                raise ValueError(f"request id {attempt_id!r} is already in use on this worker")
            self._live_ids.add(attempt_id)
        positions = max_positions(len(prompt_ids), sampling.max_tokens, max_ctx)
        try:
            if self.spec.num_blocks_for(positions) > self.num_usable_blocks:
                raise NoFreeBlocks(f"prompt + max_tokens need {self.spec.num_blocks_for(positions)} KV blocks, "
                                   f"more than this worker's {self.num_usable_blocks}")
            with self._blocks_lock:
                if self.num_preempted:   # preempted requests come first; the router tries another worker
                    raise NoFreeBlocks(f"{self.num_preempted} preempted requests are waiting for KV blocks")
                table = self.take_with_reserve(first_blocks(self.spec, len(prompt_ids) + len(prior_output_ids),
                                                            positions))
        except Exception:
            self._release_id(attempt_id)
            raise
        return DecodeRequest(attempt_id, list(prompt_ids), sampling, stop_ids, max_ctx, table, emit, state,
                             output_ids=list(prior_output_ids), constraint=constraint)

    def abort(self, attempt_id: str) -> None:
        """End the request (client gone); its blocks are freed by the engine thread. Idempotent."""
        self._post(AbortRequest(attempt_id))

    def _post(self, msg) -> None:
        """Hand ``msg`` to the engine thread, ending a multi-step run after its current step."""
        self._inbox.put(msg)
        self._interrupt.value = 1

    # ---- engine thread ---------------------------------------------------------------
    def run_forever(self, stop: threading.Event) -> None:
        """Step until ``stop`` is set; idle waits block on the inbox."""
        while not stop.is_set():
            try:
                if not self._runnable():
                    try:
                        msg = self._inbox.get(timeout=0.05)
                    except queue.Empty:
                        continue
                    self._handle(msg)
                self.step()
            except Exception:  # a bug or a bad state must not hang every stream: fail the batch
                log.exception("decode step failed; failing the running requests")
                self._fail_decoding("decode step failed on the worker (see its log)")
        self._shutdown()

    def _fail_decoding(self, message: str) -> None:
        for req in [r for r in self._requests.values() if r.state in (RequestState.DECODING, RequestState.PREFILLING)]:
            self._retire(req, ErrorEvent(grpc.StatusCode.INTERNAL, message))

    def step(self) -> None:
        """One engine iteration: inbox, schedule, run, postprocess."""
        self._interrupt.value = 0      # before draining: a message posted after the drain ends a multi-step run
        self._drain_inbox()
        batch = self._make_room([r for r in self._requests.values()
                                 if r.state is RequestState.DECODING][: self.max_batch_size])
        self._readmit_preempted()
        chunks = self._prefill_chunks(self.cfg.max_num_batched_tokens - len(batch))
        if chunks:
            self._mixed_run(batch, chunks)
            return
        if not batch:
            return
        speculate = self.proposer is not None and len(batch) <= self.cfg.spec_max_batch_size \
            and not any(r.constraint for r in batch)   # a grammar's mask is taken one token at a time
        new_tokens, new_logprobs = self._speculative_run(batch) if speculate else self._plain_run(batch, multi=True)
        for req, tokens, logprobs in zip(batch, new_tokens, new_logprobs):
            self._append(req, tokens, logprobs)

    def _plain_run(self, batch: list[DecodeRequest], multi: bool = False,
                   ) -> tuple[list[list[int]], list[list[TokenLogprobs] | None]]:
        """One token per request, through the GraphRunner when there is one, or with ``multi`` as many
        as :func:`~decode_worker.multi_step.plan_steps` allows in one C call (multi-step decoding); the
        step is timed for the routers' step-time models (seconds a step). Log-probabilities only for
        the rows that ask for them."""
        steps = [StepInput([r.output_ids[-1]], r.num_tokens - 1, r.block_table) for r in batch]
        started = time.monotonic()
        vocab = self.model_cfg.vocab_size
        if multi and self.graph is not None and not self.graph.capture \
                and (k := plan_steps(self.cfg, batch, self.last_step, vocab)) > 1 \
                and all(grow(self.pool, self.spec, r, r.num_tokens + k - 1) for r in batch):   # C steps: CPUs only
            temps, noise, top_ks = sampling_inputs(batch, k, vocab)
            rows = self.graph.run_steps(steps, k, temps, noise, stop_union(batch), self._interrupt, top_ks)
            if rows is not None:
                self.last_step = (len(batch), sum(r.num_tokens for r in batch),
                                  (time.monotonic() - started) / len(rows[0]))
                if self.multi_step_observer is not None:
                    self.multi_step_observer(len(rows[0]))
                return rows, [None] * len(batch)
        logits = self.graph.run(steps) if self.graph is not None else self.runner.run(steps)
        self.last_step = (len(batch), sum(r.num_tokens for r in batch), time.monotonic() - started)
        tokens = sample(logits, [r.sampling for r in batch], [len(r.output_ids) for r in batch], histories(batch),
                        constraints(batch))
        return [[t] for t in tokens], rows_logprobs(logits, batch, tokens)

    def _append(self, req: DecodeRequest, tokens: list[int], logprobs: list[TokenLogprobs] | None = None) -> None:
        """Add a step's tokens, stopping at the first that ends the request; stream them (with their
        log-probabilities, when the request asks)."""
        kept = []
        for token in tokens:
            req.output_ids.append(token)
            kept.append(token)
            if req.finish_reason() is not None:
                break
        req.emit(TokensEvent(kept, None if logprobs is None else logprobs[:len(kept)]))
        self._finish_if_done(req)

    def _drain_inbox(self) -> None:
        while True:
            try:
                self._handle(self._inbox.get_nowait())
            except queue.Empty:
                return

    def _handle(self, msg) -> None:
        if isinstance(msg, DecodeRequest):
            self._requests[msg.attempt_id] = msg
            if msg.state is RequestState.PREFILLING:
                self.num_prefilling += 1
            else:
                self.num_transferring += 1
            return
        req = self._requests.get(msg.attempt_id)
        if req is None:
            return  # already finished (e.g. aborted, then a late callback)
        if isinstance(msg, KVArrived) and req.state is RequestState.TRANSFERRING:
            vocab = self.model_cfg.vocab_size
            if 0 <= msg.first_token < vocab and allows(req, msg.first_token):  # sampled by the prefill worker
                self._start_decoding(req, msg.first_token)
            else:  # a bad sender must not fail the whole batch at the next step
                self._retire(req, ErrorEvent(grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: first token "
                                             f"{msg.first_token} outside the vocabulary [0, {vocab}) or the "
                                             "answer's grammar"))
        elif isinstance(msg, KVFailed):
            self._retire(req, ErrorEvent(grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {msg.reason}"))
        elif isinstance(msg, AbortRequest):
            self._retire(req, None)

    def _start_decoding(self, req: DecodeRequest, first_token: int) -> None:
        """TRANSFERRING or PREFILLING -> DECODING, with the first token (sampled by P, or here)."""
        if req.state is RequestState.PREFILLING:
            self.num_prefilling -= 1
        else:
            self.num_transferring -= 1
        self.num_decoding += 1
        req.state, req.kv_ready_at = RequestState.DECODING, req.kv_ready_at or time.monotonic()
        req.output_ids.append(first_token)
        self._finish_if_done(req)

    def _finish_if_done(self, req: DecodeRequest) -> None:
        if (error := grammar_dead_end(req)) is not None:   # the client's schema, not the worker, failed
            self._retire(req, error)
            return
        reason = req.finish_reason()
        if reason is not None:
            self._retire(req, FinishedEvent(reason, len(req.output_ids), req.kv_ready_at - req.allocated_at,
                                            req.num_draft_tokens, req.num_accepted_tokens))

    def _retire(self, req: DecodeRequest, event: FinishedEvent | ErrorEvent | None) -> None:
        """FINISHED: free the blocks, forget the request, send the last event."""
        if req.state is RequestState.TRANSFERRING:
            self.receiver.cancel(req.attempt_id)
            self.num_transferring -= 1
        elif req.state is RequestState.PREFILLING:
            self.num_prefilling -= 1
            if not req.block_table:
                with self._blocks_lock:
                    self.num_preempted -= 1
        else:
            self.num_decoding -= 1
        req.state = RequestState.FINISHED
        del self._requests[req.attempt_id]
        if self.proposer is not None:
            self.proposer.forget(req)
        if self.adaptive is not None:
            self.adaptive.forget(req)
        self.pool.free(req.block_table)
        self._release_id(req.attempt_id)
        if isinstance(event, FinishedEvent):  # the router learns of the freed blocks with the request's end
            event = replace(event, pool=self.pool.snapshot())
        elif req.block_table:                 # aborted or failed: no stream reports them, the registry will
            self.on_pool_freed()
        if event is not None:
            req.emit(event)

    def _release_id(self, attempt_id: str) -> None:
        with self._ids_lock:
            self._live_ids.discard(attempt_id)

    def _shutdown(self) -> None:
        self._drain_inbox()
        for req in list(self._requests.values()):
            self._retire(req, ErrorEvent(grpc.StatusCode.UNAVAILABLE, "decode worker shutting down"))
        self.receiver.close()
