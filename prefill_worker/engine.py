"""The prefill engine: batches prompts into forward steps and hands their KV to a sender.

A request's life on the prefill worker::

    add_request ──► QUEUED ──(blocks allocated, forward, first token sampled)──► PREFILLED
                      │                                                          │
                      │ aborted: dropped                          sender thread: │ KV pages + first token
                      ▼                                                          ▼ to the decode worker
                   FINISHED ◄──────────── blocks freed, result delivered ───── TRANSFERRING

Each :meth:`PrefillEngine.step` is: schedule (queued prompts within the token
budget and the free blocks) -> run (one forward over all of them) -> postprocess
(sample each first token, queue the KV transfer). The sender thread owns a
request's local blocks from then on and frees them whatever the transfer's fate.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtransfer import TransferError
from kvtransfer.tcp import TcpKVSender
from model.config import ModelConfig
from model.kv_cache import BlockPool, KVCacheSpec
from model.llama import LlamaForCausalLM
from model.runner import ModelRunner, StepInput
from model.sampling import SamplingParams, sample
from prefill_worker.config import PrefillWorkerConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillResult:
    """Outcome of one prefill: the first token and timings (seconds), or an error message."""

    first_token: int = -1
    error: str = ""
    queue_s: float = 0.0
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    num_kv_bytes: int = 0


@dataclass
class PrefillRequest:
    """One prompt to prefill and where its KV goes."""

    request_id: str
    token_ids: list[int]
    sampling: SamplingParams
    dst_kv_address: str
    dst_block_ids: list[int]
    on_done: Callable[[PrefillResult], None]
    arrived_at: float = field(default_factory=time.monotonic)
    aborted: bool = False


@dataclass
class _Transfer:
    req: PrefillRequest
    block_table: list[int]
    first_token: int
    queue_s: float
    prefill_s: float


class PrefillEngine:
    """Owns the prefill worker's model, KV cache, block pool and KV sender."""

    def __init__(self, cfg: PrefillWorkerConfig, model: LlamaForCausalLM, model_cfg: ModelConfig) -> None:
        self.cfg, self.model_cfg = cfg, model_cfg
        self.spec = KVCacheSpec.for_model(model_cfg, cfg.num_blocks, cfg.block_size, cfg.torch_dtype)
        if self.spec.num_blocks_for(model_cfg.max_position_embeddings) > cfg.num_blocks:
            raise ValueError(f"num_blocks={cfg.num_blocks} cannot hold one prompt of the model's "
                             f"{model_cfg.max_position_embeddings}-token context")
        self.runner = ModelRunner(model, self.spec)
        self.pool = BlockPool(cfg.num_blocks)
        self.sender = TcpKVSender(self.runner.kv_cache, self.spec, connect_timeout_s=cfg.kv_connect_timeout_s,
                                  io_timeout_s=cfg.kv_io_timeout_s)
        self._queue: deque[PrefillRequest] = deque()
        self._lock = threading.Condition()
        self._transfers: queue.SimpleQueue[_Transfer | None] = queue.SimpleQueue()
        self._by_id: dict[str, PrefillRequest] = {}

    # ---- called from other threads -------------------------------------------------
    def add_request(self, req: PrefillRequest) -> None:
        """Queue a prompt.

        Raises:
            ValueError: duplicate request id, or a destination block table that cannot hold the prompt.
        """
        if len(req.dst_block_ids) != self.spec.num_blocks_for(len(req.token_ids)):
            raise ValueError(f"{len(req.dst_block_ids)} destination blocks for a {len(req.token_ids)}-token prompt; "
                             f"need {self.spec.num_blocks_for(len(req.token_ids))}")
        with self._lock:
            if req.request_id in self._by_id:
                raise ValueError(f"request id {req.request_id!r} is already in use on this worker")
            self._by_id[req.request_id] = req
            self._queue.append(req)
            self._lock.notify()

    def abort(self, request_id: str) -> None:
        """Drop a queued request, or make its transfer abort. Idempotent."""
        with self._lock:
            req = self._by_id.get(request_id)
            if req is not None:
                req.aborted = True

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    @property
    def num_in_flight(self) -> int:
        """Requests taken from the queue and not yet delivered (prefilling or transferring)."""
        with self._lock:
            return len(self._by_id) - len(self._queue)

    @property
    def num_queued_tokens(self) -> int:
        return sum(len(r.token_ids) for r in list(self._queue))

    # ---- engine thread ---------------------------------------------------------------
    def run_forever(self, stop: threading.Event) -> None:
        """Step until ``stop`` is set; the sender thread runs alongside."""
        sender = threading.Thread(target=self._send_loop, name="kv-sender", daemon=True)
        sender.start()
        while not stop.is_set():
            with self._lock:
                if not self._queue:
                    self._lock.wait(timeout=0.05)
                    continue
            self.step()
        self._transfers.put(None)
        sender.join(timeout=5)
        self.sender.close()
        with self._lock:
            dropped, self._queue = list(self._queue), deque()
        for req in dropped:
            self._deliver(req, PrefillResult(error="prefill worker shutting down"))

    def step(self) -> None:
        """Schedule queued prompts, run them in one forward, sample, queue their transfers."""
        batch, tables = self._schedule()
        if not batch:
            return
        started = time.monotonic()
        try:
            logits = self.runner.run([StepInput(r.token_ids, 0, t) for r, t in zip(batch, tables)])
            firsts = sample(logits, [r.sampling for r in batch], [0] * len(batch))
        except Exception:  # fail this batch, keep serving
            log.exception("prefill step failed")
            for req, table in zip(batch, tables):
                self.pool.free(table)
                self._deliver(req, PrefillResult(error="prefill step failed on the worker (see its log)"))
            return
        prefill_s = time.monotonic() - started
        for req, table, token in zip(batch, tables, firsts):
            self._transfers.put(_Transfer(req, table, token, started - req.arrived_at, prefill_s))

    def _schedule(self) -> tuple[list[PrefillRequest], list[list[int]]]:
        batch, tables, budget = [], [], self.cfg.max_num_batched_tokens
        with self._lock:
            while self._queue:
                req = self._queue[0]
                if req.aborted:
                    self._queue.popleft()
                    self._deliver(req, PrefillResult(error="aborted"))
                    continue
                need = self.spec.num_blocks_for(len(req.token_ids))
                if (batch and len(req.token_ids) > budget) or need > self.pool.num_free:
                    break  # the next step takes it (blocks come back as transfers finish)
                self._queue.popleft()
                tables.append(self.pool.allocate(need))
                batch.append(req)
                budget -= len(req.token_ids)
        return batch, tables

    def _send_loop(self) -> None:
        """Sender thread: move each prefilled request's KV pages to its decode worker."""
        while (job := self._transfers.get()) is not None:
            self._transfer(job)

    def _transfer(self, job: _Transfer) -> None:
        req, started = job.req, time.monotonic()
        result = PrefillResult(error="aborted")
        channel = None
        try:
            if not req.aborted:
                channel = self.sender.open(req.request_id, req.dst_kv_address)
                channel.send_pages((0, self.model_cfg.num_layers), job.block_table, req.dst_block_ids)
                stats = channel.finish(job.first_token)
                result = PrefillResult(job.first_token, "", job.queue_s, job.prefill_s,
                                       time.monotonic() - started, stats.num_bytes)
        except Exception as exc:  # TransferError, or anything else: the request fails, the thread lives
            if not isinstance(exc, TransferError):
                log.exception("KV transfer of %s failed", req.request_id)
            if channel is not None:
                channel.abort(str(exc))
            result = PrefillResult(error=f"KV transfer to {req.dst_kv_address} failed: {exc}")
        finally:
            self.pool.free(job.block_table)
            self._deliver(req, result)

    def _deliver(self, req: PrefillRequest, result: PrefillResult) -> None:
        with self._lock:
            self._by_id.pop(req.request_id, None)
        req.on_done(result)
