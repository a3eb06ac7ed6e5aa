"""The router process: the public ``pdserve.v1.Router`` gRPC API, health and reflection.

Workers are discovered only from the Redis registry (re-read every
``registry_poll_s``); a worker whose lease lapsed is gone from the next read.

Client security (``RouterConfig``): TLS with ``grpc.ssl_server_credentials`` when a certificate
and key are configured, and a bearer token checked by :class:`BearerTokenInterceptor` on every
RPC except the health service, so that load balancers can probe without the token. With a
cluster secret, the router's own calls to workers carry ``cluster.secret.worker_rpc_token``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

import grpc

from pdserve.cluster.grpc_auth import BearerTokenInterceptor, bearer_interceptors
from pdserve.cluster.registry import RegistryReader, WorkerInfo
from pdserve.cluster.secret import (
    InsecureReminder,
    check_exposure,
    cluster_secret,
    is_loopback,
    worker_rpc_token,
)
from pdserve.cluster.service import start_grpc_server
from pdserve.model.config import ModelConfig
from pdserve.model.tokenizer import Tokenizer
from pdserve.proto import pdserve_pb2
from pdserve.router.admission import Admission
from pdserve.router.config import RouterConfig
from pdserve.router.dispatch import PrefillStats
from pdserve.router.generate import ClusterView, GenerateError, run_generate
from pdserve.router.kv_aware import KVAwareness
from pdserve.router.recovery import RegistryMemory
from pdserve.router.request import RequestTimes
from pdserve.router.slo import Slo, SloGate
from pdserve.router.validation import parse_request, validate

log = logging.getLogger(__name__)

SERVICE = "pdserve.v1.Router"
LONG_TEXT_CHARS = 4096  # text prompts longer than this are tokenized on a worker thread
class Router:
    """A running router: gRPC server, registry poller and worker channels.

    Raises:
        cluster.secret.InsecureBindError: from the constructor, ``cfg.host`` is not loopback and the
            cluster secret or client authentication (token or TLS) is missing, without ``cfg.insecure``.
    """

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.model_cfg = ModelConfig.from_hf_dir(cfg.model_dir)
        self.tokenizer = Tokenizer(cfg.model_dir, self.model_cfg.bos_token_id)
        secret = cluster_secret()  # resolved once: signed registry entries, and a token on calls to workers
        client_auth = cfg.bearer_token() is not None or cfg.tls_key_pair() is not None
        exposed = check_exposure("the router", cfg.host, secret, cfg.insecure, client_auth)
        self._insecure = InsecureReminder("the router", cfg.host, log=log) if exposed else None
        self.registry = RegistryReader(cfg.redis_url, cfg.cluster, secret=secret)
        self.workers: list[WorkerInfo] = []
        self._registry_memory = RegistryMemory(cfg.registry_grace_s)
        self.inflight: Counter = Counter()
        self.prefill_stats: dict[str, PrefillStats] = {}
        self.kv = KVAwareness(cfg.redis_url, cfg.cluster)
        self.gate = SloGate(cfg.redis_url, cfg.cluster, cfg.prefill_timeout_s + 5) if cfg.admission else None
        # SLO outcomes are counted with or without admission (GetClusterState, the autoscaling planner)
        self.outcomes = self.gate.admission if self.gate is not None else Admission(cfg.redis_url, cfg.cluster)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._worker_auth = bearer_interceptors(worker_rpc_token(secret)) if secret is not None else None
        self.address = ""

    # ---- RPCs --------------------------------------------------------------------
    async def Generate(self, raw: bytes, context: grpc.aio.ServicerContext):
        times = RequestTimes()
        try:
            parsed = parse_request(raw)
            args = (parsed, self.model_cfg, self.tokenizer, self.cfg.default_max_tokens,
                    Slo(self.cfg.default_ttft_slo_s, self.cfg.default_tpot_slo_s))
            # tokenizing a long text takes milliseconds: off the event loop, so other streams keep flowing
            req = await asyncio.to_thread(validate, *args) if len(parsed.text) > LONG_TEXT_CHARS else validate(*args)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if not self.workers:
            await self._refresh()
        lookup = self.kv.cached_blocks if self.cfg.prefix_routing else (lambda ids, block_size: {})
        view = ClusterView(lambda: self.workers, self.inflight, self._channel, self.prefill_stats,
                           lookup, self.kv.on_routed, self.gate, self.outcomes, self.model_cfg.eos_token_ids)
        remaining = context.time_remaining()  # the client's deadline: no retry or migration starts past it
        deadline = None if remaining is None else time.monotonic() + remaining
        try:
            async for msg in run_generate(view, req, self.tokenizer, self.cfg, times, deadline):
                yield msg
        except GenerateError as exc:
            await context.abort(exc.code, exc.message)

    async def GetClusterState(self, request: pdserve_pb2.GetClusterStateRequest, context) -> pdserve_pb2.ClusterState:
        await self._refresh()
        now = time.time()
        try:
            a = await self.outcomes.attainment(60)
        except Exception as exc:  # Redis away: the workers are still worth showing
            log.warning("SLO attainment read failed: %s", exc)
            a = None
        slo = None
        if a is not None:
            slo = pdserve_pb2.SloAttainment(
                finished=a["finished"], met_ttft=a["met_ttft"], met_tpot=a["met_tpot"], met_both=a["met_both"],
                rejected=a["rejected"], attainment_both=a["attainment_both"] or 0.0, window_s=a["window_s"])
        return pdserve_pb2.ClusterState(model=self.cfg.model_dir, slo=slo, workers=[
            pdserve_pb2.WorkerState(
                worker_id=w.worker_id, role=w.role, address=w.address, kv_address=w.kv_address,
                num_running=w.num_running, num_waiting=w.num_waiting, num_queued_tokens=w.num_queued_tokens,
                num_free_blocks=w.num_free_blocks, num_total_blocks=w.num_total_blocks,
                lease_age_s=max(0.0, now - w.heartbeat_at), num_router_inflight=self.inflight[w.worker_id],
                block_size=w.block_size, prefill_s_per_block=w.prefill_s_per_block)
            for w in self.workers])

    # ---- plumbing ----------------------------------------------------------------
    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = grpc.aio.insecure_channel(address, interceptors=self._worker_auth)
        return self._channels[address]

    async def _refresh(self) -> None:
        try:
            fresh = await self.registry.list_workers()
        except Exception as exc:  # Redis away: keep serving from the last known registry
            self._registry_memory.read_failed()
            log.warning("registry read failed: %s", exc)
            return
        # Redis restarted empty: keep the workers it does not list yet until they re-register
        self.workers = self._registry_memory.merge(self.workers, fresh)

    async def _poll_registry(self) -> None:
        while True:
            await self._refresh()
            if self._insecure is not None:
                self._insecure.tick()
            self.kv.update_workers(self.workers)
            for w in self.workers:  # the prefill workers' own throughput measurements
                if w.role == "prefill" and w.prefill_s_per_block > 0:
                    self.prefill_stats.setdefault(w.worker_id, PrefillStats()).seconds_per_block = w.prefill_s_per_block
            if self.gate is not None:
                self.gate.observe(self.workers)
            await self.kv.sync_once()
            await asyncio.sleep(self.cfg.registry_poll_s)

    async def start(self) -> str:
        """Start serving (over TLS and with a token check if configured). Returns ``host:port``.

        Raises:
            RuntimeError: the port could not be bound.
            ValueError: the TLS files or the token became unreadable since the config was made.
        """
        token, key_pair = self.cfg.bearer_token(), self.cfg.tls_key_pair()
        if token is not None and key_pair is None and not is_loopback(self.cfg.host):
            log.warning("router: bearer token over plaintext on %s: anyone on the network can read it; "
                        "configure tls_cert_file / tls_key_file", self.cfg.host)
        credentials = grpc.ssl_server_credentials([key_pair]) if key_pair is not None else None
        self._server, port = await start_grpc_server(
            self.cfg.host, self.cfg.port, self._add_services, [SERVICE],
            [BearerTokenInterceptor(token)] if token else [], credentials)
        self._poller = asyncio.create_task(self._poll_registry())
        self.address = f"{self.cfg.host}:{port}"
        return self.address

    def _add_services(self, server: grpc.aio.Server) -> None:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
            # Generate takes raw bytes so that malformed requests get INVALID_ARGUMENT, not INTERNAL.
            "Generate": grpc.unary_stream_rpc_method_handler(
                self.Generate, response_serializer=pdserve_pb2.GenerateResponse.SerializeToString),
            "GetClusterState": grpc.unary_unary_rpc_method_handler(
                self.GetClusterState, request_deserializer=pdserve_pb2.GetClusterStateRequest.FromString,
                response_serializer=pdserve_pb2.ClusterState.SerializeToString),
        }),))

    async def stop(self) -> None:
        """Stop accepting, cancel what is in flight (workers free their blocks), close channels."""
        self._poller.cancel()
        await self._server.stop(grace=1.0)
        for ch in self._channels.values():
            await ch.close()
        await self.registry.close()
        await self.kv.close()
        await self.outcomes.aclose()
