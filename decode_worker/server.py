"""The decode worker process: gRPC ``DecodeWorker`` service over a :class:`DecodeEngine`.

A Generate call's ``request_id`` is the router's attempt id (:mod:`router.recovery`): the engine
keys the request by it (``attempt_id``) and expects its KV pages under it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
import torch

from pdserve.cluster.logs import request_fields
from pdserve.cluster.metrics import DecodeMetrics, decode_metrics
from pdserve.cluster.registry import WorkerInfo
from pdserve.cluster.rpc_fields import (
    Undecodable,
    add_lenient_handlers,
    check_attempt_id,
    check_decoded,
    check_sampling,
    check_token_ids,
    lenient_parser,
)
from pdserve.cluster.warmup import WarmupReport
from pdserve.cluster.worker_process import WorkerProcess, check_kv_memory, worker_secret
from pdserve.decode_worker.config import DecodeWorkerConfig
from pdserve.decode_worker.engine import DecodeEngine
from pdserve.decode_worker.request import FinishedEvent, TokensEvent, check_kv_timeout
from pdserve.decode_worker.warmup import warm_up_decode
from pdserve.model.cpu_linear import dense_beats_packed_for_prefill, pack_for_cpu_decode
from pdserve.model.hugepages import move_to_huge_pages
from pdserve.model.kv_cache import NoFreeBlocks
from pdserve.model.loader import load_model
from pdserve.model.quant import int4, int4_checkpoint
from pdserve.model.sampling import SamplingParams
from pdserve.proto import worker_pb2, worker_pb2_grpc
from pdserve.proto.convert import FINISH_REASONS, logprobs_to_wire, sampling_from_wire

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckedDecodeRequest:
    """A ``DecodeRequest`` whose every field is in range (:func:`check_decode_request`); ``kv_timeout_s`` in
    seconds (None with ``local_prefill``, which waits for no pages)."""

    attempt_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    prior_output_ids: list[int]
    kv_timeout_s: float | None
    local_prefill: bool


def check_decode_request(request: worker_pb2.DecodeRequest | Undecodable, vocab_size: int, max_context: int,
                         eos_token_ids: tuple[int, ...] = ()) -> CheckedDecodeRequest:
    """Check every field of a decode ``Generate`` request before anything is allocated for it.

    Args:
        vocab_size, max_context: the model's vocabulary and context (positions).
        eos_token_ids: the model's EOS tokens (stop tokens unless ``ignore_eos``).
    Raises:
        ValueError: undecodable request bytes; else naming the field: ``request_id`` empty, over 256
            characters or with control characters; ``prompt_token_ids`` empty or outside the vocabulary;
            sampling fields not finite or out of range (:func:`cluster.rpc_fields.check_sampling`); prompt +
            max_tokens beyond ``max_context``;
            ``prior_output_token_ids`` outside the vocabulary, reaching ``max_tokens`` or ending in a stop token;
            ``kv_timeout_s`` not finite in (0, :data:`~decode_worker.request.MAX_KV_TIMEOUT_S`] seconds (with
            ``local_prefill`` it is unused and may also be 0, unset).
    """
    request = check_decoded(request)
    attempt_id = check_attempt_id(request.request_id)
    prompt = check_token_ids("prompt_token_ids", request.prompt_token_ids, vocab_size, max_context - 1,
                             bound="the model's context less one output position")
    sampling = check_sampling(sampling_from_wire(request.sampling), vocab_size)
    if len(prompt) + sampling.max_tokens > max_context:
        raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the model's "
                         f"context of {max_context} tokens")
    prior = check_token_ids("prior_output_token_ids", request.prior_output_token_ids, vocab_size,
                            sampling.max_tokens - 1, allow_empty=True, bound="fewer than max_tokens")
    if prior and prior[-1] in sampling.stop_ids(eos_token_ids):
        raise ValueError("prior_output_token_ids already end with a stop token: nothing left to decode")
    if request.local_prefill:  # no pages to wait for: the field is unused, but must still be sane
        if request.kv_timeout_s != 0:
            check_kv_timeout(request.kv_timeout_s)
        kv_timeout_s = None
    else:
        kv_timeout_s = check_kv_timeout(request.kv_timeout_s)
    return CheckedDecodeRequest(attempt_id, prompt, sampling, prior, kv_timeout_s, request.local_prefill)


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    """Streams one request's output: ``allocated``, token deltas, ``finished``; a cancelled call
    aborts the request (its blocks are freed)."""

    def __init__(self, engine: DecodeEngine, metrics: DecodeMetrics | None = None) -> None:
        self.engine, self.metrics = engine, metrics

    async def Generate(self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext):
        """Pre-allocate the request's blocks (or prefill it here, colocated) and stream its events.
        Ends INVALID_ARGUMENT for a bad request (every field is checked before anything is allocated:
        :func:`check_decode_request`), FAILED_PRECONDITION for ``local_prefill`` on a worker that is not
        colocated, RESOURCE_EXHAUSTED when the blocks cannot be had, UNAVAILABLE when the KV transfer
        failed or timed out (or the worker is shutting down)."""
        cfg = self.engine.model_cfg
        try:
            req = check_decode_request(request, cfg.vocab_size, cfg.max_model_len, cfg.eos_token_ids)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        attempt_id = req.attempt_id  # the router's attempt id
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        emit = lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev)  # noqa: E731
        if req.local_prefill and not self.engine.cfg.colocated:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this decode worker does not prefill (not colocated)")
        try:
            constraint = await asyncio.to_thread(self.engine.grammars.constraint, req.sampling.grammar,
                                                 req.prior_output_ids, req.sampling.grammar_after) \
                if req.sampling.constrained else None
            if req.local_prefill:
                self.engine.add_local(attempt_id, req.prompt_ids, req.sampling, emit, req.prior_output_ids,
                                      constraint)
                blocks = []
            else:
                blocks = self.engine.add_request(attempt_id, req.prompt_ids, req.sampling, req.kv_timeout_s, emit,
                                                 req.prior_output_ids, constraint)
        except NoFreeBlocks as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RuntimeError as exc:  # the KV receiver closed under us: the worker is shutting down
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"decode worker cannot take requests now: {exc}")
        ended = False
        try:
            version, free = self.engine.pool.snapshot()
            yield worker_pb2.DecodeEvent(allocated=worker_pb2.Allocated(
                block_ids=blocks, kv_address=self.engine.receiver.address, num_free_blocks=free,
                pool_version=version))
            while True:
                pending = [await events.get()]
                while not events.empty():  # the stream fell behind the engine: send what piled up at once
                    pending.append(events.get_nowait())
                for ev in _coalesce(pending):
                    if isinstance(ev, TokensEvent):
                        if self.metrics is not None:
                            self.metrics.on_tokens(len(ev.token_ids))
                        yield worker_pb2.DecodeEvent(tokens=worker_pb2.TokenDelta(
                            token_ids=ev.token_ids,
                            logprobs=[logprobs_to_wire(lp) for lp in ev.logprobs] if ev.logprobs else (),
                            prompt_logprobs=[logprobs_to_wire(lp) for lp in ev.prompt_logprobs]))
                    elif isinstance(ev, FinishedEvent):
                        ended = True
                        if self.metrics is not None:
                            self.metrics.on_finished(ev, len(req.prompt_ids) if req.local_prefill else 0)
                        log.info("request %s finished (%s): %d output tokens", attempt_id, ev.reason,
                                 ev.num_output_tokens, extra=request_fields(attempt_id))
                        yield worker_pb2.DecodeEvent(finished=worker_pb2.DecodeFinished(
                            finish_reason=FINISH_REASONS[ev.reason], num_output_tokens=ev.num_output_tokens,
                            kv_wait_s=ev.kv_wait_s, num_draft_tokens=ev.num_draft_tokens,
                            num_accepted_tokens=ev.num_accepted_tokens, pool_version=ev.pool[0],
                            num_free_blocks=ev.pool[1]))
                        return
                    else:
                        ended = True
                        log.warning("request %s failed: %s", attempt_id, ev.message, extra=request_fields(attempt_id))
                        await context.abort(ev.code, ev.message)
        finally:
            if not ended:  # cancelled by the router or the client: free the blocks
                log.info("request %s aborted (stream cancelled)", attempt_id, extra=request_fields(attempt_id))
                self.engine.abort(attempt_id)


def _coalesce(events: list) -> list:
    """Merge runs of consecutive :class:`TokensEvent` into one, keeping order."""
    out: list = []
    for ev in events:
        if isinstance(ev, TokensEvent) and out and isinstance(out[-1], TokensEvent):
            logprobs = None if out[-1].logprobs is None else out[-1].logprobs + ev.logprobs  # one request: all or none
            out[-1] = TokensEvent(out[-1].token_ids + ev.token_ids, logprobs, out[-1].prompt_logprobs)
        else:
            out.append(ev)
    return out


def load_decode_model(cfg: DecodeWorkerConfig):
    """The model as ``cfg.weights`` asks: a pre-quantized INT4 checkpoint as stored, a float one
    quantized at load (gpt-fast's ``convert_for_runtime``; on the CPU, so that it equals a pre-quantized
    checkpoint on every device), or the weights as they are; then on a GPU moved to it (INT4 rebuilds its
    kernel layout there at first use), on a CPU with the bf16 projections packed for :mod:`kernels.cpu.gemv`
    (with INT4, the bf16 LM head is) and moved into huge pages, kernel layouts included."""
    if cfg.weights == "int4" and int4_checkpoint.is_int4_checkpoint(cfg.model_dir):
        model, model_cfg = int4_checkpoint.load_int4_checkpoint(cfg.model_dir, cfg.torch_dtype,
                                                              max_model_len=cfg.max_model_len)
    else:
        model, model_cfg = load_model(cfg.model_dir, cfg.torch_dtype, max_model_len=cfg.max_model_len)
        if cfg.weights == "int4":
            int4.convert_for_runtime(model, group_size=cfg.int4_group_size, method=cfg.int4_method)
    device = cfg.resolved_device
    if device.type != "cpu":
        return model.to(device), model_cfg
    # bf16 on CPU: the float linears left, for the C kernels; a colocated worker keeps dense copies for its
    # prefill chunks only where oneDNN beats the packed gemm (AMX CPUs: chunks over 512 rows, or more than one thread)
    pack_for_cpu_decode(model, keep_dense=cfg.colocated and dense_beats_packed_for_prefill(
        cfg.max_num_batched_tokens, cfg.num_threads))
    move_to_huge_pages(model)
    return model, model_cfg


class DecodeWorker(WorkerProcess):
    """A running decode worker: engine thread, gRPC server, Redis lease."""

    service_name = "pdserve.worker.v1.DecodeWorker"

    def __init__(self, cfg: DecodeWorkerConfig) -> None:
        secret = worker_secret(cfg, f"decode worker {cfg.worker_id}")  # refuse an unguarded bind first
        check_kv_memory(cfg, f"decode worker {cfg.worker_id}",   # before the weights load, not after
                        0.5 if cfg.weights == "int4" else None)
        torch.set_num_threads(cfg.num_threads)
        model, model_cfg = load_decode_model(cfg)
        super().__init__(cfg, DecodeEngine(cfg, model, model_cfg, secret), secret)
        self.stats = decode_metrics(self.metrics, cfg.worker_id, "both" if cfg.colocated else "decode", self.info)
        self.engine.multi_step_observer = self.stats.on_multi_step
        self.engine.preemption_observer = self.stats.on_preemption

    def add_servicer(self, server: grpc.aio.Server) -> None:
        """Serve ``DecodeWorker`` on ``server``; undecodable request bytes reach the servicer (INVALID_ARGUMENT)."""
        servicer = DecodeServicer(self.engine, self.stats)
        add_lenient_handlers(server, self.service_name, {"Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=lenient_parser(worker_pb2.DecodeRequest),
            response_serializer=worker_pb2.DecodeEvent.SerializeToString)})

    def info(self) -> WorkerInfo:
        e = self.engine
        version, free = e.pool.snapshot()
        return WorkerInfo(worker_id=self.cfg.worker_id, role="both" if self.cfg.colocated else "decode",
                          address=self.address,
                          kv_address=e.receiver.address, kv_backends=e.kv_backends, block_size=self.cfg.block_size,
                          num_total_blocks=e.num_usable_blocks, num_free_blocks=free, pool_version=version,
                          num_running=e.num_decoding, num_waiting=e.num_transferring + e.num_preempted,
                          step_batch=e.last_step[0], step_context_tokens=e.last_step[1], step_seconds=e.last_step[2],
                          metrics_address=self.metrics_address, warmup_s=self.warmup_s)

    def warm_up(self) -> WarmupReport:
        """Every decode batch bucket, speculation's verify shapes, the sampling paths and (colocated) the
        prefill chunk classes, through the engine itself: :func:`decode_worker.warmup.warm_up_decode`."""
        return warm_up_decode(self.engine)
