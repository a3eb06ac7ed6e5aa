"""The prefill worker process: gRPC ``PrefillWorker`` service over a :class:`PrefillEngine`.

A Prefill call's ``request_id`` is the router's attempt id (:mod:`router.recovery`): the worker
knows the request by it (``attempt_id``) and so does the KV transfer to the decode worker.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import torch

from pdserve.cluster.kv_events import KVEventPublisher
from pdserve.cluster.registry import WorkerInfo
from pdserve.cluster.secret import cluster_secret
from pdserve.cluster.worker_process import WorkerProcess
from pdserve.model.loader import load_model
from pdserve.model.quant import fp8
from pdserve.prefill_worker.config import PrefillWorkerConfig
from pdserve.prefill_worker.engine import PrefillEngine
from pdserve.prefill_worker.request import PrefillRequest, PrefillResult
from pdserve.proto import worker_pb2, worker_pb2_grpc
from pdserve.proto.convert import sampling_from_wire


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    """Answers once the request's KV pages and first token reached the decode worker; a cancelled call
    aborts the request (:meth:`PrefillEngine.abort`)."""

    def __init__(self, engine: PrefillEngine) -> None:
        self.engine = engine

    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        """Prefill the prompt and push its KV and first token to the decode worker; answer with the
        first token and timings once the decode worker acknowledged. Ends INVALID_ARGUMENT for a bad
        prompt, sampling or block table, UNAVAILABLE when the prefill or the transfer failed."""
        vocab = self.engine.model_cfg.vocab_size
        ids = list(request.token_ids)
        if not ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty prompt")
        if any(not 0 <= t < vocab for t in ids):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"token ids outside the vocabulary [0, {vocab})")
        if len(ids) > self.engine.model_cfg.max_position_embeddings:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt longer than the model's context")
        sampling = sampling_from_wire(request.sampling)
        try:
            sampling.validate(vocab)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if not 0 <= request.first_output_index < sampling.max_tokens:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"first_output_index must be in [0, max_tokens={sampling.max_tokens}), "
                                f"got {request.first_output_index}")
        loop = asyncio.get_running_loop()
        done: asyncio.Future[PrefillResult] = loop.create_future()
        on_done = lambda r: loop.call_soon_threadsafe(lambda: done.done() or done.set_result(r))  # noqa: E731
        attempt_id = request.request_id  # the router's attempt id
        req = PrefillRequest(attempt_id, ids, sampling, request.dst_kv_address,
                             list(request.dst_block_ids), on_done, first_output_index=request.first_output_index)
        try:
            self.engine.add_request(req)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            result = await done
        except asyncio.CancelledError:
            self.engine.abort(attempt_id)
            raise
        if result.error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, result.error)
        return worker_pb2.PrefillResponse(first_token=result.first_token, queue_s=result.queue_s,
                                          prefill_s=result.prefill_s, transfer_s=result.transfer_s,
                                          transfer_tail_s=result.transfer_tail_s, num_kv_bytes=result.num_kv_bytes,
                                          num_cached_tokens=result.num_cached_tokens)


class PrefillWorker(WorkerProcess):
    """A running prefill worker: engine and sender threads, gRPC server, Redis lease."""

    service_name = "pdserve.worker.v1.PrefillWorker"

    def __init__(self, cfg: PrefillWorkerConfig) -> None:
        torch.set_num_threads(cfg.num_threads)
        model, model_cfg = load_model(cfg.model_dir, cfg.torch_dtype)
        if cfg.activations == "fp8":
            fp8.convert_for_runtime(model)
        secret = cluster_secret()
        self.events = None
        if cfg.prefix_cache and cfg.kv_events:
            self.events = KVEventPublisher(cfg.redis_url, cfg.cluster, cfg.worker_id, secret=secret)
            self.events.publish_cleared(cfg.block_size)  # a (re)started worker holds nothing
        engine = PrefillEngine(cfg, model, model_cfg, self.events.publish if self.events else None, secret)
        super().__init__(cfg, engine, secret)
        self._last_snapshot = 0.0

    def add_servicer(self, server: grpc.aio.Server) -> None:
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(PrefillServicer(self.engine), server)

    def info(self) -> WorkerInfo:
        e = self.engine  # cached blocks no request holds count as free: they are evicted on demand
        return WorkerInfo(worker_id=self.cfg.worker_id, role="prefill", address=self.address,
                          block_size=self.cfg.block_size, num_total_blocks=e.pool.num_blocks,
                          num_free_blocks=e.blocks.num_available, num_running=e.num_in_flight,
                          num_waiting=e.num_queued, num_queued_tokens=e.num_queued_tokens,
                          prefill_s_per_block=(e.seconds_per_token or 0.0) * self.cfg.block_size,
                          kv_backends=e.kv_sender.backends)

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
