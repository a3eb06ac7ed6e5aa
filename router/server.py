"""The router process: the public ``pdserve.v1.Router`` gRPC API, health and reflection.

Workers are discovered only from the Redis registry (re-read every
``registry_poll_s``); a worker whose lease lapsed is gone from the next read.

Limits (``RouterConfig``, :mod:`router.limits`): concurrent ``Generate`` streams in all and per
bearer token (RESOURCE_EXHAUSTED beyond), gRPC's ``maximum_concurrent_rpcs`` above them as a backstop,
message sizes, and ``max_tokens`` per request (INVALID_ARGUMENT beyond). ``GetClusterState`` answers
from the poller's last registry read (a read at most every ``registry_poll_s``, whoever asks) and
cached SLO counters. What the router keeps per worker (channels, in-flight counts, prefill stats,
SLO step-time models, prefix-index entries) is dropped ``registry_grace_s`` after the worker left the
registry (:meth:`Router._prune`).

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
from collections.abc import AsyncIterator, Iterable
from contextlib import aclosing
from dataclasses import replace

import grpc
from prometheus_client import CollectorRegistry

from pdserve.cluster.grpc_auth import BearerTokenInterceptor, bearer_interceptors
from pdserve.cluster.metrics import router_metrics
from pdserve.cluster.registry import RegistryReader, WorkerInfo
from pdserve.cluster.rpc_fields import Undecodable, lenient_parser
from pdserve.cluster.secret import (
    InsecureReminder,
    check_exposure,
    cluster_secret,
    is_loopback,
    worker_rpc_token,
)
from pdserve.cluster.service import KEEPALIVE_CHANNEL_OPTIONS, start_grpc_server
from pdserve.model.config import ModelConfig
from pdserve.model.tokenizer import Tokenizer
from pdserve.proto import pdserve_pb2
from pdserve.router.admission import Admission
from pdserve.router.config import RouterConfig
from pdserve.router.dispatch import PrefillStats
from pdserve.router.generate import run_generate
from pdserve.router.http.server import HttpFrontEnd
from pdserve.router.kv_aware import KVAwareness
from pdserve.router.limits import StreamLimitExceeded, StreamSlots
from pdserve.router.pool_reports import PoolReports
from pdserve.router.recovery import GenerateError, RegistryMemory
from pdserve.router.request import RequestTimes
from pdserve.router.room_queue import RoomQueue
from pdserve.router.slo import Slo, SloGate
from pdserve.router.validation import parse_request, validate
from pdserve.router.view import ClusterView

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
        self.model_cfg = ModelConfig.from_hf_dir(cfg.model_dir, cfg.max_model_len)
        self.tokenizer = Tokenizer(cfg.model_dir, self.model_cfg.bos_token_id)
        if self.tokenizer.max_token_id >= self.model_cfg.vocab_size:  # served, but some texts cannot be
            log.warning("the checkpoint's tokenizer has token ids up to %d but its model's vocabulary is [0, %d): "
                        "text prompts that tokenize to ids past it are refused (INVALID_ARGUMENT, naming them)",
                        self.tokenizer.max_token_id, self.model_cfg.vocab_size)
        secret = cluster_secret()  # resolved once: signed registry entries, and a token on calls to workers
        client_auth = cfg.bearer_token() is not None or cfg.tls_key_pair() is not None
        exposed = check_exposure("the router", cfg.host, secret, cfg.insecure, client_auth)
        self._insecure = InsecureReminder("the router", cfg.host, log=log) if exposed else None
        self.registry = RegistryReader(cfg.redis_url, cfg.cluster, secret=secret)
        self.workers: list[WorkerInfo] = []
        self._registry_memory = RegistryMemory(cfg.registry_grace_s)
        self._pools = PoolReports()  # decode pools as request streams report them, between heartbeats
        self.room = RoomQueue()  # requests waiting for KV room, told of each report and registry read
        self._warned_unsigned = False  # the error that signed registry entries need the secret: logged once
        self.inflight: Counter = Counter()
        self.prefill_stats: dict[str, PrefillStats] = {}
        self.kv = KVAwareness(cfg.redis_url, cfg.cluster, secret=secret)
        self.gate = SloGate(cfg.redis_url, cfg.cluster, cfg.prefill_timeout_s + 5) if cfg.admission else None
        # SLO outcomes are counted with or without admission (GetClusterState, the autoscaling planner)
        self.outcomes = self.gate.admission if self.gate is not None else Admission(cfg.redis_url, cfg.cluster)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._heard: dict[str, float] = {}  # decode worker id -> its last stream event (router.generate)
        self._worker_auth = bearer_interceptors(worker_rpc_token(secret)) if secret is not None else None
        self.address = ""
        self.metrics = CollectorRegistry()  # the router's Prometheus metrics (GET /metrics of the HTTP API)
        self.stats = router_metrics(self.metrics, lambda: len(self.room))  # cluster.metrics: recorded in generate()
        # the OpenAI-compatible HTTP API (router/http/), on the internal path `generate` as gRPC's Generate
        self.http = HttpFrontEnd(self, secret) if cfg.http_port is not None else None
        self.http_address = ""
        self._slots = StreamSlots(cfg.max_concurrent_streams, cfg.bearer_tokens(), cfg.max_streams_per_token)
        self._read_lock, self._read_at = asyncio.Lock(), float("-inf")  # registry reads: one at a time
        self._attainment_lock, self._attainment_at = asyncio.Lock(), float("-inf")
        self._attainment: dict | None = None
        self._ids_at: dict[str, set[str]] = {}  # address -> worker ids listed at it (kept while in use)
        self._gone_ids: dict[str, float] = {}  # worker id -> monotonic time it was first seen unlisted
        self._gone_addresses: dict[str, float] = {}  # the same for addresses

    # ---- RPCs --------------------------------------------------------------------
    async def Generate(self, raw: bytes, context: grpc.aio.ServicerContext):
        """``Router.Generate``: the request bytes parsed strictly (INVALID_ARGUMENT), then :meth:`generate`
        under the client's deadline; its errors end the stream with their status."""
        try:
            parsed = parse_request(raw)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        remaining = context.time_remaining()  # the client's deadline: no retry or migration starts past it
        deadline = None if remaining is None else time.monotonic() + remaining
        try:
            async with aclosing(self.generate(parsed, deadline, context.invocation_metadata() or ())) as messages:
                async for msg in messages:
                    yield msg
        except GenerateError as exc:
            await context.abort(exc.code, exc.message)

    async def generate(self, parsed: pdserve_pb2.GenerateRequest, deadline: float | None = None,
                       metadata: Iterable[tuple[str, str | bytes]] = (),
                       ) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
        """One request's path, whichever front end took it (gRPC :meth:`Generate`, the HTTP API of
        :mod:`router.http`): a stream slot (:mod:`router.limits`), validation, then its run
        (:func:`router.generate.run_generate`), yielding the client's messages. Closing the iterator
        early (client gone) cancels the request on its workers, which free its blocks.

        Args:
            deadline: ``time.monotonic()`` by which the client stops waiting (None: none given).
            metadata: the call's ``authorization`` metadata, whose bearer token picks the per-token quota.
        Raises:
            GenerateError: RESOURCE_EXHAUSTED (no stream slot, no KV room, not admitted), INVALID_ARGUMENT
                (:func:`router.validation.validate`'s message), UNAVAILABLE (no worker, workers kept failing).
        """
        try:
            slot = self._slots.acquire(metadata)
        except StreamLimitExceeded as exc:
            self.stats.rejected("stream_limit")
            raise GenerateError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
        try:
            with slot:  # held until the stream ends, however it ends
                times = RequestTimes()
                args = (parsed, self.model_cfg, self.tokenizer, self.cfg.default_max_tokens,
                        Slo(self.cfg.default_ttft_slo_s, self.cfg.default_tpot_slo_s), self.cfg.max_tokens_limit,
                        self.cfg.scheduling_policy == "priority")
                try:  # tokenizing a long text takes milliseconds: off the event loop, so other streams keep flowing
                    req = (await asyncio.to_thread(validate, *args) if len(parsed.text) > LONG_TEXT_CHARS
                           else validate(*args))
                except ValueError as exc:
                    raise GenerateError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
                # into the operator's ranges before admission and the attainment counters see them
                req = replace(req, slo=req.slo.clamped(self.cfg.min_slo_s, self.cfg.max_ttft_slo_s,
                                                       self.cfg.max_tpot_slo_s),
                              queue_timeout_s=req.queue_timeout_s or self.cfg.default_queue_timeout_s)
                if not self.workers:  # none known yet (e.g. the first request after start): look now
                    await self._refresh_if_stale(max_age_s=0.0)
                lookup = self.kv.cached_blocks if self.cfg.prefix_routing else (lambda ids, block_size: {})
                view = ClusterView(lambda: self.workers, self.inflight, self._channel, self.prefill_stats,
                                   lookup, self.kv.on_routed, self.gate, self.outcomes, self.model_cfg.eos_token_ids,
                                   heard=self._heard, on_pool=self._on_pool, room=self.room)
                recorder = self.stats.request()
                async with aclosing(run_generate(view, req, self.tokenizer, self.cfg, times, deadline)) as messages:
                    async for msg in messages:
                        recorder.on_message(msg)
                        yield msg
        except GenerateError as exc:
            if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                self.stats.rejected("admission" if exc.message.startswith("not admitted")
                                    else "no_kv_blocks" if "blocks" in exc.message else "other")
            raise
        finally:  # its SLO outcome or rejection shows in the next GetClusterState
            self._attainment_at = float("-inf")

    async def GetClusterState(self, request: pdserve_pb2.GetClusterStateRequest | Undecodable,
                              context) -> pdserve_pb2.ClusterState:
        """``Router.GetClusterState`` from the last registry read and SLO counters (read from Redis at
        most every ``registry_poll_s``, and the counters once after a stream ended, however often this
        is called). Malformed request bytes: INVALID_ARGUMENT."""
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        await self._refresh_if_stale()  # normally a no-op: the poller's last read is fresh enough
        now = time.time()
        a = await self._slo_attainment()
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
                block_size=w.block_size, prefill_s_per_block=w.prefill_s_per_block, metrics_address=w.metrics_address)
            for w in self.workers])

    # ---- plumbing ----------------------------------------------------------------
    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = grpc.aio.insecure_channel(address, options=KEEPALIVE_CHANNEL_OPTIONS,
                                                                interceptors=self._worker_auth)
        return self._channels[address]

    async def _refresh(self) -> None:
        self._read_at = time.monotonic()
        try:
            fresh = await self.registry.list_workers()
        except Exception as exc:  # Redis away: keep serving from the last known registry
            self._registry_memory.read_failed()
            log.warning("registry read failed: %s", exc)
            return
        if self.registry.signed_unchecked and not self._warned_unsigned:
            self._warned_unsigned = True
            log.error("the workers of cluster %r sign their registry entries with a cluster secret, and this "
                      "router has none (PDSERVE_CLUSTER_SECRET_FILE or PDSERVE_CLUSTER_SECRET): they will refuse "
                      "its calls (UNAUTHENTICATED, \"missing 'authorization: Bearer <token>'\"); start the router "
                      "with the cluster's secret", self.cfg.cluster)
        # Redis restarted empty: keep the workers it does not list yet until they re-register
        self.workers = self._pools.apply(self._registry_memory.merge(self.workers, fresh))
        self.room.changed()
        for w in self.workers:
            self._ids_at.setdefault(w.address, set()).add(w.worker_id)

    def _on_pool(self, worker_id: str, version: int, num_free_blocks: int) -> None:
        """A decode stream's report of its worker's pool (:mod:`router.pool_reports`), into the view now; the
        line of requests waiting for room tries again where the report moved the view (not for an older one)."""
        before, self.workers = self.workers, self._pools.report(self.workers, worker_id, version, num_free_blocks)
        if self.workers is not before:
            self.room.changed()

    async def _refresh_if_stale(self, max_age_s: float | None = None) -> None:
        """Read the registry unless a read (usually the poller's) started less than ``max_age_s``
        (default ``registry_poll_s``) before this call; concurrent callers wait for one read, so
        Redis sees at most one registry read per ``registry_poll_s`` however many clients ask
        (``max_age_s=0``: only a read that started after this call will do)."""
        asked = time.monotonic()
        async with self._read_lock:
            if self._read_at <= asked - (self.cfg.registry_poll_s if max_age_s is None else max_age_s):
                await self._refresh()

    async def _slo_attainment(self) -> dict | None:
        """The SLO attainment counters of the last minute, read from Redis at most every
        ``registry_poll_s`` and once after each of this router's streams ended (so a client sees its own
        rejection at once); None while Redis is away: the workers are still worth showing."""
        async with self._attainment_lock:
            if time.monotonic() - self._attainment_at >= self.cfg.registry_poll_s:
                self._attainment_at = time.monotonic()
                try:
                    self._attainment = await self.outcomes.attainment(60)
                except Exception as exc:
                    log.warning("SLO attainment read failed: %s", exc)
                    self._attainment = None
        return self._attainment

    async def _prune(self, now: float | None = None) -> None:
        """Forget what the router keeps per worker once the worker has been out of the registry view
        for ``registry_grace_s`` (``now``: ``time.monotonic()`` by default): its in-flight entry (at 0),
        prefill stats and SLO step-time model; and close the channel of an address no listed worker
        has, once no request is in flight on a worker listed at it (else at a later poll: a channel is
        never closed under a live call). Per-worker state stays bounded by the workers listed plus
        those with requests in flight, however many come and go."""
        now = time.monotonic() if now is None else now
        grace = self.cfg.registry_grace_s
        listed = {w.worker_id for w in self.workers}
        busy = {wid for wid, n in self.inflight.items() if n > 0}
        for address in {w.address for w in self.workers}:  # old ids stay mapped while busy
            self._ids_at[address] = ({w.worker_id for w in self.workers if w.address == address}
                                     | (self._ids_at.get(address, set()) & busy))
        known = set(self.inflight) | set(self.prefill_stats) | set().union(*self._ids_at.values())
        if self.gate is not None:
            known |= set(self.gate.step_models)
        if self.kv.index is not None:
            known |= set(self.kv.index.workers())
        for wid in known - listed:
            if now - self._gone_ids.setdefault(wid, now) >= grace and wid not in busy:
                self.inflight.pop(wid, None)
                self.prefill_stats.pop(wid, None)
                self.kv.forget(wid)
                if self.gate is not None:
                    self.gate.forget(wid)
                del self._gone_ids[wid]
        for wid in [wid for wid in self._gone_ids if wid in listed]:
            del self._gone_ids[wid]
        live = {w.address for w in self.workers}
        unmapped_busy = busy - listed - set().union(*self._ids_at.values())  # may be on any address
        for address in (set(self._channels) | set(self._ids_at)) - live:
            idle = not unmapped_busy and not (self._ids_at.get(address, set()) & busy)
            if now - self._gone_addresses.setdefault(address, now) >= grace and idle:
                self._ids_at.pop(address, None)
                del self._gone_addresses[address]
                channel = self._channels.pop(address, None)
                if channel is not None:
                    await channel.close()
        for address in [a for a in self._gone_addresses if a in live]:
            del self._gone_addresses[address]

    def num_worker_entries(self) -> dict[str, int]:
        """Sizes of the per-worker state this router holds (for leak checks and debugging): gRPC
        ``channels`` (one per worker address), ``inflight`` counts, decode ``pool_reports``, ``prefill_stats``,
        SLO ``step_models``, workers of the prefix index, and the bookkeeping of workers seen (addresses
        listed, ids and addresses waiting out ``registry_grace_s``)."""
        return {"channels": len(self._channels), "inflight": len(self.inflight), "pool_reports": len(self._pools),
                "prefill_stats": len(self.prefill_stats),
                "step_models": len(self.gate.step_models) if self.gate is not None else 0,
                "prefix_index_workers": len(self.kv.index.workers()) if self.kv.index is not None else 0,
                "addresses": len(self._ids_at), "gone": len(self._gone_ids) + len(self._gone_addresses)}

    async def _poll_registry(self) -> None:
        """Read the registry every ``registry_poll_s`` and apply the view. A read a caller made (a stale
        ``GetClusterState``) stands for the poller's, and the next is due ``registry_poll_s`` after it: the
        poller's and stale calls' reads never start closer than that, however they interleave (a poller that
        slept a fixed interval read again just after a caller's read, 4 reads in 0.4 s at a 0.2 s interval).
        Only a request that finds no worker known reads at once."""
        while True:
            await self._refresh_if_stale()
            if self._insecure is not None:
                self._insecure.tick()
            self.kv.update_workers(self.workers)
            for w in self.workers:  # the prefill workers' own throughput measurements
                if w.role == "prefill" and w.prefill_s_per_block > 0:
                    self.prefill_stats.setdefault(w.worker_id, PrefillStats()).seconds_per_block = w.prefill_s_per_block
            if self.gate is not None:
                self.gate.observe(self.workers)
            try:
                await self._prune()
            except Exception:  # never let bookkeeping stop the poller
                log.exception("pruning per-worker state failed")
            await self.kv.sync_once()
            await asyncio.sleep(max(0.0, self._read_at + self.cfg.registry_poll_s - time.monotonic()))

    async def start(self) -> str:
        """Start serving (over TLS and with a token check if configured), and the HTTP API when
        configured (its address then in ``http_address``). Returns the gRPC API's ``host:port``.

        Raises:
            RuntimeError: the port could not be bound.
            ValueError: the TLS files or the token became unreadable since the config was made.
        """
        token, key_pair = self.cfg.bearer_token(), self.cfg.tls_key_pair()
        if token is not None and key_pair is None and not is_loopback(self.cfg.host):
            log.warning("router: bearer token over plaintext on %s: anyone on the network can read it; "
                        "configure tls_cert_file / tls_key_file", self.cfg.host)
        tokens = self.cfg.bearer_tokens()
        credentials = grpc.ssl_server_credentials([key_pair]) if key_pair is not None else None
        self._server, port = await start_grpc_server(
            self.cfg.host, self.cfg.port, self._add_services, [SERVICE],
            [BearerTokenInterceptor(tokens)] if tokens else [], credentials,
            options=[("grpc.max_receive_message_length", self.cfg.max_receive_message_bytes),
                     ("grpc.max_send_message_length", self.cfg.max_send_message_bytes)],
            maximum_concurrent_rpcs=self.cfg.max_concurrent_rpcs)
        self._poller = asyncio.create_task(self._poll_registry())
        self.address = f"{self.cfg.host}:{port}"
        if self.http is not None:
            self.http_address = await self.http.start()
        return self.address

    def _add_services(self, server: grpc.aio.Server) -> None:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
            # Generate takes raw bytes so that malformed requests get INVALID_ARGUMENT, not INTERNAL.
            "Generate": grpc.unary_stream_rpc_method_handler(
                self.Generate, response_serializer=pdserve_pb2.GenerateResponse.SerializeToString),
            "GetClusterState": grpc.unary_unary_rpc_method_handler(   # malformed bytes: INVALID_ARGUMENT too
                self.GetClusterState, request_deserializer=lenient_parser(pdserve_pb2.GetClusterStateRequest),
                response_serializer=pdserve_pb2.ClusterState.SerializeToString),
        }),))

    async def stop(self) -> None:
        """Stop accepting, cancel what is in flight (workers free their blocks), close channels."""
        self._poller.cancel()
        await asyncio.gather(self._server.stop(grace=1.0), *([self.http.stop()] if self.http is not None else []))
        for ch in self._channels.values():
            await ch.close()
        await self.registry.close()
        await self.kv.close()
        await self.outcomes.aclose()
