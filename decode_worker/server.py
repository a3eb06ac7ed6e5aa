"""The decode worker process: gRPC ``DecodeWorker`` service over a :class:`DecodeEngine`.

A Generate call's ``request_id`` is the router's attempt id (:mod:`router.recovery`): the engine
keys the request by it (``attempt_id``) and expects its KV pages under it.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import torch

from pdserve.cluster.registry import WorkerInfo
from pdserve.cluster.secret import cluster_secret
from pdserve.cluster.worker_process import WorkerProcess
from pdserve.decode_worker.config import DecodeWorkerConfig
from pdserve.decode_worker.engine import DecodeEngine
from pdserve.decode_worker.request import FinishedEvent, TokensEvent
from pdserve.model.cpu_linear import pack_for_cpu_decode
from pdserve.model.hugepages import move_to_huge_pages
from pdserve.model.kv_cache import NoFreeBlocks
from pdserve.model.loader import load_model
from pdserve.model.quant import int4, int4_checkpoint
from pdserve.proto import worker_pb2, worker_pb2_grpc
from pdserve.proto.convert import FINISH_REASONS, sampling_from_wire

log = logging.getLogger(__name__)


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    """Streams one request's output: ``allocated``, token deltas, ``finished``; a cancelled call
    aborts the request (its blocks are freed)."""

    def __init__(self, engine: DecodeEngine) -> None:
        self.engine = engine

    async def Generate(self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext):
        """Pre-allocate the request's blocks (or prefill it here, colocated) and stream its events.
        Ends INVALID_ARGUMENT for a bad request, FAILED_PRECONDITION for ``local_prefill`` on a worker
        that is not colocated, RESOURCE_EXHAUSTED when the blocks cannot be had, UNAVAILABLE when the
        KV transfer failed or timed out."""
        attempt_id = request.request_id  # the router's attempt id
        sampling = sampling_from_wire(request.sampling)
        if not request.prompt_token_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty prompt")
        try:
            sampling.validate(self.engine.model_cfg.vocab_size)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        prior = list(request.prior_output_token_ids)
        vocab = self.engine.model_cfg.vocab_size
        if any(not 0 <= t < vocab for t in prior):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"prior_output_token_ids outside the vocabulary [0, {vocab})")
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        emit = lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev)  # noqa: E731
        if request.local_prefill and not self.engine.cfg.colocated:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this decode worker does not prefill (not colocated)")
        try:
            if request.local_prefill:
                self.engine.add_local(attempt_id, list(request.prompt_token_ids), sampling, emit, prior)
                blocks = []
            else:
                blocks = self.engine.add_request(attempt_id, list(request.prompt_token_ids), sampling,
                                                 request.kv_timeout_s or 30.0, emit, prior)
        except NoFreeBlocks as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        ended = False
        try:
            yield worker_pb2.DecodeEvent(allocated=worker_pb2.Allocated(
                block_ids=blocks, kv_address=self.engine.receiver.address))
            while True:
                pending = [await events.get()]
                while not events.empty():  # the stream fell behind the engine: send what piled up at once
                    pending.append(events.get_nowait())
                for ev in _coalesce(pending):
                    if isinstance(ev, TokensEvent):
                        yield worker_pb2.DecodeEvent(tokens=worker_pb2.TokenDelta(token_ids=ev.token_ids))
                    elif isinstance(ev, FinishedEvent):
                        ended = True
                        yield worker_pb2.DecodeEvent(finished=worker_pb2.DecodeFinished(
                            finish_reason=FINISH_REASONS[ev.reason], num_output_tokens=ev.num_output_tokens,
                            kv_wait_s=ev.kv_wait_s, num_draft_tokens=ev.num_draft_tokens,
                            num_accepted_tokens=ev.num_accepted_tokens))
                        return
                    else:
                        ended = True
                        await context.abort(ev.code, ev.message)
        finally:
            if not ended:  # cancelled by the router or the client: free the blocks
                self.engine.abort(attempt_id)


def _coalesce(events: list) -> list:
    """Merge runs of consecutive :class:`TokensEvent` into one, keeping order."""
    out: list = []
    for ev in events:
        if isinstance(ev, TokensEvent) and out and isinstance(out[-1], TokensEvent):
            out[-1] = TokensEvent(out[-1].token_ids + ev.token_ids)
        else:
            out.append(ev)
    return out


def load_decode_model(cfg: DecodeWorkerConfig):
    """The model as ``cfg.weights`` asks: a pre-quantized INT4 checkpoint as stored, a float one
    quantized at load (gpt-fast's ``convert_for_runtime``), or the weights as they are (bf16
    projections on a CPU packed for :mod:`kernels.cpu.gemv`); then moved into huge pages."""
    if cfg.weights == "int4" and int4_checkpoint.is_int4_checkpoint(cfg.model_dir):
        model, model_cfg = int4_checkpoint.load_int4_checkpoint(cfg.model_dir, cfg.torch_dtype)
    else:
        model, model_cfg = load_model(cfg.model_dir, cfg.torch_dtype)
        if cfg.weights == "int4":
            int4.convert_for_runtime(model, group_size=cfg.int4_group_size, method=cfg.int4_method)
        else:
            pack_for_cpu_decode(model, keep_dense=cfg.colocated)   # bf16 on CPU: packed for the C kernels
    move_to_huge_pages(model)
    for module in model.modules():            # INT4: rebuild the kernels' layout from the moved buffers
        if isinstance(module, int4.Int4Linear):  # now, not in the first request's step (it stays in 4 KiB pages)
            module.prepare()
    return model, model_cfg


class DecodeWorker(WorkerProcess):
    """A running decode worker: engine thread, gRPC server, Redis lease."""

    service_name = "pdserve.worker.v1.DecodeWorker"

    def __init__(self, cfg: DecodeWorkerConfig) -> None:
        torch.set_num_threads(cfg.num_threads)
        model, model_cfg = load_decode_model(cfg)
        secret = cluster_secret()
        super().__init__(cfg, DecodeEngine(cfg, model, model_cfg, secret), secret)

    def add_servicer(self, server: grpc.aio.Server) -> None:
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(DecodeServicer(self.engine), server)

    def info(self) -> WorkerInfo:
        e = self.engine
        return WorkerInfo(worker_id=self.cfg.worker_id, role="both" if self.cfg.colocated else "decode",
                          address=self.address,
                          kv_address=e.receiver.address, kv_backends=e.kv_backends, block_size=self.cfg.block_size,
                          num_total_blocks=e.num_usable_blocks, num_free_blocks=e.pool.num_free,
                          num_running=e.num_decoding, num_waiting=e.num_transferring,
                          step_batch=e.last_step[0], step_context_tokens=e.last_step[1], step_seconds=e.last_step[2])
