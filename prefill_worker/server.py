"""The prefill worker process: gRPC ``PrefillWorker`` service over a :class:`PrefillEngine`."""

from __future__ import annotations

import asyncio
import threading

import grpc
import torch

from deploy.worker_process import Heartbeat, start_grpc_server
from model.loader import load_model
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.engine import PrefillEngine, PrefillRequest, PrefillResult
from proto import worker_pb2, worker_pb2_grpc
from proto.convert import sampling_from_wire
from router.registry import WorkerInfo


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    """Answers once the request's KV pages and first token reached the decode worker."""

    def __init__(self, engine: PrefillEngine) -> None:
        self.engine = engine

    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
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
        loop = asyncio.get_running_loop()
        done: asyncio.Future[PrefillResult] = loop.create_future()
        on_done = lambda r: loop.call_soon_threadsafe(lambda: done.done() or done.set_result(r))  # noqa: E731
        req = PrefillRequest(request.request_id, ids, sampling, request.dst_kv_address,
                             list(request.dst_block_ids), on_done)
        try:
            self.engine.add_request(req)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            result = await done
        except asyncio.CancelledError:
            self.engine.abort(request.request_id)
            raise
        if result.error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, result.error)
        return worker_pb2.PrefillResponse(first_token=result.first_token, queue_s=result.queue_s,
                                          prefill_s=result.prefill_s, transfer_s=result.transfer_s,
                                          num_kv_bytes=result.num_kv_bytes)


class PrefillWorker:
    """A running prefill worker: engine and sender threads, gRPC server, Redis lease."""

    def __init__(self, cfg: PrefillWorkerConfig) -> None:
        torch.set_num_threads(cfg.num_threads)
        self.cfg = cfg
        model, model_cfg = load_model(cfg.model_dir, cfg.torch_dtype)
        self.engine = PrefillEngine(cfg, model, model_cfg)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.engine.run_forever, args=(self._stop,), name="prefill-engine",
                                        daemon=True)
        self.address = ""

    def info(self) -> WorkerInfo:
        """This worker's registry entry with its current load."""
        e = self.engine
        return WorkerInfo(worker_id=self.cfg.worker_id, block_size=self.cfg.block_size, role="prefill", address=self.address,
                          num_total_blocks=e.pool.num_blocks, num_free_blocks=e.pool.num_free,
                          num_running=e.num_in_flight, num_waiting=e.num_queued,
                          num_queued_tokens=e.num_queued_tokens)

    async def start(self) -> str:
        """Start serving; register in Redis last. Returns ``host:port``."""
        self._thread.start()
        self._server, port = await start_grpc_server(
            self.cfg.host, self.cfg.port, lambda s: worker_pb2_grpc.add_PrefillWorkerServicer_to_server(
                PrefillServicer(self.engine), s), ["pdserve.worker.v1.PrefillWorker"])
        self.address = f"{self.cfg.host}:{port}"
        self._heartbeat = Heartbeat(self.cfg, self.info)
        self._heartbeat.start()
        return self.address

    async def stop(self) -> None:
        """Deregister, stop serving, fail what is queued."""
        self._heartbeat.stop()
        await self._server.stop(grace=1.0)
        self._stop.set()
        await asyncio.to_thread(self._thread.join, 5)
