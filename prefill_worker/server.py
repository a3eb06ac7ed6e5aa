"""The prefill worker process: gRPC ``PrefillWorker`` service over a :class:`PrefillEngine`.

A Prefill call's ``request_id`` is the router's attempt id (:mod:`router.recovery`): the worker
knows the request by it (``attempt_id``) and so does the KV transfer to the decode worker.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Collection
from dataclasses import dataclass

import grpc
import torch

from pdserve.cluster.kv_events import KVEventPublisher
from pdserve.cluster.logs import request_fields
from pdserve.cluster.metrics import PrefillMetrics, prefill_metrics
from pdserve.cluster.registry import WorkerInfo
from pdserve.cluster.rpc_fields import (
    Undecodable,
    add_lenient_handlers,
    check_attempt_id,
    check_block_ids,
    check_decoded,
    check_sampling,
    check_token_ids,
    lenient_parser,
)
from pdserve.cluster.warmup import WarmupReport
from pdserve.cluster.worker_process import WorkerProcess, check_kv_memory, worker_secret
from pdserve.kvtransfer.backends import backend_of_address, host_port
from pdserve.kvtransfer.wire.channel import parse_address
from pdserve.model.cpu_linear import dense_beats_packed_for_prefill, pack_for_cpu_decode
from pdserve.model.hugepages import move_to_huge_pages
from pdserve.model.loader import load_model
from pdserve.model.moe import mixture_module_names
from pdserve.model.onednn_linear import prepack_for_cpu_prefill
from pdserve.model.quant import fp8
from pdserve.model.sampling import SamplingParams
from pdserve.prefill_worker.config import PrefillWorkerConfig
from pdserve.prefill_worker.engine import PrefillEngine
from pdserve.prefill_worker.request import PrefillRequest, PrefillResult
from pdserve.prefill_worker.warmup import warm_up_prefill
from pdserve.proto import worker_pb2, worker_pb2_grpc
from pdserve.proto.convert import logprobs_to_wire, sampling_from_wire

log = logging.getLogger(__name__)

MAX_KV_ADDRESS_CHARS = 300
"""Longest ``dst_kv_address`` taken: a 253-character host name, a port and a scheme fit."""
_HOST = re.compile(r"[A-Za-z0-9._-]+|\[[0-9A-Za-z.:%_-]+\]")  # a name, an IPv4 or a bracketed IPv6 address


def check_kv_address(address: str, backends: Collection[str]) -> str:
    """Return ``address`` if it is a KV receiver address this worker can send to: ``host:port``
    (TCP), ``[v6]:port``, ``nccl://host:port`` or ``cuda-ipc://host:port``, a port in [1, 65535], a host
    of name or address characters only, of a transport in ``backends``.

    Raises:
        ValueError: empty, over :data:`MAX_KV_ADDRESS_CHARS` characters, malformed, or a transport this
            worker does not have.
    """
    if not address:
        raise ValueError("dst_kv_address is empty")
    if len(address) > MAX_KV_ADDRESS_CHARS:
        raise ValueError(f"dst_kv_address of {len(address)} characters exceeds {MAX_KV_ADDRESS_CHARS}")
    backend = backend_of_address(address)
    if backend not in backends:
        raise ValueError(f"dst_kv_address {address!r} names the {backend} KV transport; this prefill worker has "
                         f"{', '.join(backends) or 'none'}")
    hostport = host_port(address)
    parse_address(hostport)  # the port
    host = hostport.rpartition(":")[0]
    if not _HOST.fullmatch(host):
        raise ValueError(f"KV address must be 'host:port', got {address!r}")
    return address


@dataclass(frozen=True)
class CheckedPrefillRequest:
    """A ``PrefillRequest`` whose every field is in range (:func:`check_prefill_request`)."""

    attempt_id: str
    token_ids: list[int]
    sampling: SamplingParams
    dst_kv_address: str
    dst_block_ids: list[int]
    first_output_index: int


def check_prefill_request(request: worker_pb2.PrefillRequest | Undecodable, vocab_size: int, max_context: int,
                          block_size: int, kv_backends: Collection[str]) -> CheckedPrefillRequest:
    """Check every field of a ``Prefill`` request before it is queued.

    The decode worker's pool size is unknown here, so ``dst_block_ids`` are checked for shape only: one
    distinct non-negative id per ``block_size`` tokens of ``token_ids`` (the decode worker's receiver
    refuses pages for blocks it did not register).

    Args:
        vocab_size, max_context: the model's vocabulary and context (positions).
        block_size: tokens per KV block.
        kv_backends: the KV transports this worker sends over.
    Raises:
        ValueError: undecodable request bytes; else naming the field: ``request_id`` empty, over 256
            characters or with control characters; ``token_ids`` empty, outside the vocabulary or leaving no
            room in the context for one output token;
            sampling fields not finite or out of range (:func:`cluster.rpc_fields.check_sampling`);
            ``first_output_index`` outside [0, max_tokens) or the prompt before it plus max_tokens beyond the
            context; ``dst_block_ids`` of the wrong count, negative or repeated; ``dst_kv_address`` malformed
            (:func:`check_kv_address`).
    """
    request = check_decoded(request)
    attempt_id = check_attempt_id(request.request_id)
    ids = check_token_ids("token_ids", request.token_ids, vocab_size, max_context - 1,
                          bound="the model's context less one output position")
    sampling = check_sampling(sampling_from_wire(request.sampling), vocab_size)
    first = request.first_output_index
    if not 0 <= first < sampling.max_tokens:
        raise ValueError(f"first_output_index must be in [0, max_tokens={sampling.max_tokens}), got {first}")
    if first > len(ids) - 1 or len(ids) - first + sampling.max_tokens > max_context:
        raise ValueError(f"token_ids ({len(ids)} tokens, {first} of them prior output) + max_tokens "
                         f"({sampling.max_tokens}) exceed the model's context of {max_context} tokens")
    need = -(-len(ids) // block_size)
    if len(request.dst_block_ids) != need:
        raise ValueError(f"{len(request.dst_block_ids)} destination blocks for a {len(ids)}-token prompt; "
                         f"need {need}")
    blocks = check_block_ids("dst_block_ids", request.dst_block_ids)
    address = check_kv_address(request.dst_kv_address, kv_backends)
    return CheckedPrefillRequest(attempt_id, ids, sampling, address, blocks, first)


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    """Answers once the request's KV pages and first token reached the decode worker; a cancelled call
    aborts the request (:meth:`PrefillEngine.abort`)."""

    def __init__(self, engine: PrefillEngine, metrics: PrefillMetrics | None = None) -> None:
        self.engine, self.metrics = engine, metrics

    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        """Prefill the prompt and push its KV and first token to the decode worker; answer with the
        first token and timings once the decode worker acknowledged. Ends INVALID_ARGUMENT for a bad
        field (every one is checked before the request is queued: :func:`check_prefill_request`),
        UNAVAILABLE when the prefill or the transfer failed."""
        cfg = self.engine.model_cfg
        try:
            checked = check_prefill_request(request, cfg.vocab_size, cfg.max_model_len,
                                            self.engine.spec.block_size, self.engine.kv_sender.backends)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        loop = asyncio.get_running_loop()
        done: asyncio.Future[PrefillResult] = loop.create_future()
        on_done = lambda r: loop.call_soon_threadsafe(lambda: done.done() or done.set_result(r))  # noqa: E731
        attempt_id = checked.attempt_id  # the router's attempt id
        req = PrefillRequest(attempt_id, checked.token_ids, checked.sampling, checked.dst_kv_address,
                             checked.dst_block_ids, on_done, first_output_index=checked.first_output_index)
        try:
            if req.sampling.constrained:   # the grammar past a migrated request's prior output, compiled off the loop
                req.constraint = await asyncio.to_thread(self.engine.grammars.constraint, req.sampling.grammar,
                                                         req.history(())[1], req.sampling.grammar_after)
            self.engine.add_request(req)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            result = await done
        except asyncio.CancelledError:
            log.info("prefill %s aborted (call cancelled)", attempt_id, extra=request_fields(attempt_id))
            self.engine.abort(attempt_id)
            raise
        if result.error:
            log.warning("prefill %s failed: %s", attempt_id, result.error, extra=request_fields(attempt_id))
            await context.abort(grpc.StatusCode.UNAVAILABLE, result.error)
        log.info("prefill %s done: %d tokens, %d cached, %d KV bytes in %.4f s", attempt_id, len(checked.token_ids),
                 result.num_cached_tokens, result.num_kv_bytes, result.transfer_s, extra=request_fields(attempt_id))
        if self.metrics is not None:
            self.metrics.on_prefill(len(checked.token_ids), result)
        return worker_pb2.PrefillResponse(first_token=result.first_token, queue_s=result.queue_s,
                                          prefill_s=result.prefill_s, transfer_s=result.transfer_s,
                                          transfer_tail_s=result.transfer_tail_s, num_kv_bytes=result.num_kv_bytes,
                                          num_cached_tokens=result.num_cached_tokens,
                                          first_logprobs=None if req.first_logprobs is None  # set before the result
                                          else logprobs_to_wire(req.first_logprobs),
                                          prompt_logprobs=[logprobs_to_wire(lp) for lp in req.prompt_logprobs])


def load_prefill_model(model_dir: str, dtype: torch.dtype, activations: str = "native", chunk_tokens: int = 512,
                       device: torch.device | str = "cpu", max_model_len: int = 0):
    """The model as a prefill worker runs it: FP8 activation matmuls where ``activations`` is ``"fp8"``
    (weights quantized on the CPU, bit-identical to the GPU's quantization); then on a GPU ``device`` moved
    to it; on the CPU, without FP8, bf16 projections packed for the packed kernels (AVX512-BF16 gemm, AMX tiles)
    without their dense copies where they are at least as fast at chunks of ``chunk_tokens`` rows
    (:func:`model.cpu_linear.dense_beats_packed_for_prefill`: always without AMX, with it up to 512 rows on one
    torch thread), else (AMX, longer chunks or more threads) on oneDNN weights reordered once for such chunks
    (:mod:`model.onednn_linear`), a
    mixture's router and experts packed for the C kernels instead (each mixture one C call,
    :class:`kernels.cpu.moe_block.MoeBlock`: 2.5x its oneDNN form per operation at 512 rows of bench-moe on an
    AMX Xeon); then weights in huge pages.
    Served at ``max_model_len`` tokens (0: the checkpoint's context). Returns ``(model, ModelConfig)``. Raises as
    :func:`model.loader.load_model`."""
    model, model_cfg = load_model(model_dir, dtype, max_model_len=max_model_len)
    if activations == "fp8":
        fp8.convert_for_runtime(model)
    if torch.device(device).type != "cpu":
        return model.to(device), model_cfg
    if activations != "fp8" and not dense_beats_packed_for_prefill(chunk_tokens, torch.get_num_threads()):
        pack_for_cpu_decode(model, keep_dense=False)
    elif activations != "fp8":
        if names := mixture_module_names(model):   # a mixture's experts: one C call (kernels/cpu/moe_block.py)
            pack_for_cpu_decode(model, keep_dense=False, names=names)
        prepack_for_cpu_prefill(model, chunk_tokens)
    move_to_huge_pages(model)
    return model, model_cfg


class PrefillWorker(WorkerProcess):
    """A running prefill worker: engine and sender threads, gRPC server, Redis lease."""

    service_name = "pdserve.worker.v1.PrefillWorker"

    def __init__(self, cfg: PrefillWorkerConfig) -> None:
        secret = worker_secret(cfg, f"prefill worker {cfg.worker_id}")  # refuse an unguarded bind first
        check_kv_memory(cfg, f"prefill worker {cfg.worker_id}",   # before the weights load, not after
                        1.0 if cfg.activations == "fp8" else None)
        torch.set_num_threads(cfg.num_threads)
        model, model_cfg = load_prefill_model(cfg.model_dir, cfg.torch_dtype, cfg.activations,
                                              cfg.max_num_batched_tokens, cfg.resolved_device, cfg.max_model_len)
        self.events = None
        if cfg.prefix_cache and cfg.kv_events:
            self.events = KVEventPublisher(cfg.redis_url, cfg.cluster, cfg.worker_id, secret=secret)
            self.events.publish_cleared(cfg.block_size)  # a (re)started worker holds nothing
        engine = PrefillEngine(cfg, model, model_cfg, self.events.publish if self.events else None, secret)
        super().__init__(cfg, engine, secret)
        self.stats = prefill_metrics(self.metrics, cfg.worker_id, self.info)
        self._last_snapshot = 0.0

    def add_servicer(self, server: grpc.aio.Server) -> None:
        """Serve ``PrefillWorker`` on ``server``; undecodable request bytes reach the servicer (INVALID_ARGUMENT)."""
        servicer = PrefillServicer(self.engine, self.stats)
        add_lenient_handlers(server, self.service_name, {"Prefill": grpc.unary_unary_rpc_method_handler(
            servicer.Prefill, request_deserializer=lenient_parser(worker_pb2.PrefillRequest),
            response_serializer=worker_pb2.PrefillResponse.SerializeToString)})

    def info(self) -> WorkerInfo:
        e = self.engine  # cached blocks no request holds count as free: they are evicted on demand
        return WorkerInfo(worker_id=self.cfg.worker_id, role="prefill", address=self.address,
                          block_size=self.cfg.block_size, num_total_blocks=e.pool.num_blocks,
                          num_free_blocks=e.blocks.num_available, num_running=e.num_in_flight,
                          num_waiting=e.num_queued, num_queued_tokens=e.num_queued_tokens,
                          prefill_s_per_block=(e.seconds_per_token or 0.0) * self.cfg.block_size,
                          kv_backends=e.kv_sender.backends, metrics_address=self.metrics_address,
                          warmup_s=self.warmup_s)

    def warm_up(self) -> WarmupReport:
        """Every prefill chunk-length class, first and continuation chunks, the prefix-cache path and the
        sampling paths, on scratch blocks: :func:`prefill_worker.warmup.warm_up_prefill`."""
        return warm_up_prefill(self.engine)

    def on_heartbeat(self) -> None:
        """Publish a snapshot of the cached block hashes every ``snapshot_interval_s`` (for routers' re-sync),
        and at once when Redis lost it (a Redis restart): routers re-sync exactly instead of staying
        degraded until the next scheduled snapshot. Redis errors propagate to the heartbeat, which retries."""
        if self.events is None:
            return
        due = time.monotonic() - self._last_snapshot >= self.cfg.snapshot_interval_s
        if due or self.events.snapshot_missing():
            self.events.publish_snapshot(self.engine.blocks.snapshot)
            self._last_snapshot = time.monotonic()

    async def stop(self) -> None:
        await super().stop()
        if self.events is not None:
            self.events.close()
