"""What every worker process shares: the gRPC server (:mod:`cluster.service`), the Redis lease heartbeat,
the engine thread, and the checks of its KV memory and secret; its base config is
:class:`cluster.worker_config.WorkerConfig`."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

import grpc
from prometheus_client import CollectorRegistry

from pdserve.cluster.compute import device_memory_bytes
from pdserve.cluster.grpc_auth import BearerTokenInterceptor
from pdserve.cluster.metrics import start_metrics_server
from pdserve.cluster.registry import WorkerInfo, WorkerLease
from pdserve.cluster.secret import InsecureReminder, check_exposure, cluster_secret, worker_rpc_token
from pdserve.cluster.service import start_grpc_server
from pdserve.cluster.warmup import WarmupReport
from pdserve.cluster.worker_config import WorkerConfig

log = logging.getLogger(__name__)

NUDGE_GAP_S = 0.05
"""Seconds a heartbeat waits after each renewal before the next: nudges (:meth:`Heartbeat.nudge`) coming faster
share one renewal, so a burst of aborted requests writes the registry a few times, not once each."""

def check_kv_memory(cfg: WorkerConfig, who: str, projection_bytes: float | None = None) -> None:
    """Refuse at start, before the model loads, a KV pool (``cfg.num_blocks`` blocks of the checkpoint's
    layers and heads) that does not fit the memory left on this machine, or on the worker's GPU, beside the
    weights (:func:`model.checkpoint.weights_nbytes`, at least; ``projection_bytes``: bytes a parameter of
    the quantized projections, 0.5 for INT4, 1 for FP8; :meth:`model.kv_cache.KVCacheSpec.check_fits`):
    it would otherwise fail in the middle of allocating, or be killed, after the weights had loaded.

    Raises:
        MemoryError: naming ``who``, the pool's bytes, the weights' and the memory available.
        FileNotFoundError, ValueError: the checkpoint's ``config.json`` (:meth:`model.config.ModelConfig.from_hf_dir`)
            or weight files (:func:`model.checkpoint.weights_nbytes`).
    """
    from pdserve.model.checkpoint import weights_nbytes
    from pdserve.model.config import ModelConfig
    from pdserve.model.kv_cache import KVCacheSpec
    model_cfg = ModelConfig.from_hf_dir(cfg.model_dir, cfg.max_model_len)
    spec = KVCacheSpec.for_model(model_cfg, cfg.num_blocks, cfg.block_size, cfg.torch_dtype)
    weights = weights_nbytes(cfg.model_dir, cfg.torch_dtype, projection_bytes)
    spec.check_fits(who, device_memory_bytes(cfg.resolved_device), beside=weights)


def worker_secret(cfg: WorkerConfig, who: str) -> bytes | None:
    """The worker process's cluster secret (:func:`cluster.secret.cluster_secret`), resolved once at
    start, before anything binds.

    Raises:
        cluster.secret.InsecureBindError: ``cfg.host`` is not loopback, there is no secret, and
            ``cfg.insecure`` is not set.
        ValueError: the configured secret is unreadable or too short.
    """
    secret = cluster_secret()
    check_exposure(who, cfg.host, secret, cfg.insecure)
    return secret


class Heartbeat(threading.Thread):
    """Renews the worker's lease with its current load until stopped; on stop, releases it.
    ``secret``: the cluster secret that signs the entry (None: unsigned). ``healthy`` is asked before
    each renewal: while it says False the lease is released and not renewed, so routers stop sending
    work the worker cannot do. ``on_registry(workers)``, if given, runs every ``lease_s`` seconds with the
    live workers the registry lists, while ``wants_registry()`` says True."""

    def __init__(self, cfg: WorkerConfig, info: Callable[[], WorkerInfo], tick: Callable[[], None] = lambda: None,
                 secret: bytes | None = None, healthy: Callable[[], bool] = lambda: True,
                 on_registry: Callable[[list[WorkerInfo]], None] | None = None,
                 wants_registry: Callable[[], bool] = lambda: True) -> None:
        super().__init__(name="heartbeat", daemon=True)
        self._lease = WorkerLease(cfg.redis_url, cfg.cluster, cfg.lease_s, secret=secret)
        exposed = secret is None and cfg.insecure and check_exposure(cfg.worker_id, cfg.host, None, True)
        self._insecure = InsecureReminder(f"worker {cfg.worker_id}", cfg.host, log=log) if exposed else None
        self._info, self._tick, self._period, self._halt = info, tick, cfg.lease_s / 4, threading.Event()
        self._nudged = threading.Event()   # set by nudge() and stop(): renew now rather than at the period's end
        self._healthy, self._left = healthy, False
        self._on_registry, self._wants_registry = on_registry, wants_registry
        self._registry_every_s, self._registry_at = cfg.lease_s, time.monotonic()
        self._failed_at = float("-inf")    # the last renewal failure logged: nudges must not flood the log
        self._lease.renew(info())  # registered before start() returns: fail fast if Redis is down

    def nudge(self) -> None:
        """Renew the entry now (at most once per :data:`NUDGE_GAP_S`), not at the period's end: called when the
        worker's load changed in a way no request stream reports to the routers (an aborted or failed request's
        KV blocks freed). Thread-safe."""
        self._nudged.set()

    def run(self) -> None:
        while True:
            self._nudged.wait(self._period)
            if self._halt.is_set():
                return
            self._nudged.clear()
            self._renew()
            if self._halt.wait(NUDGE_GAP_S):     # nudges coming faster share one renewal
                return                            # stopped meanwhile (its nudge may have been cleared above)

    def _renew(self) -> None:
        """One heartbeat: renew the lease with the current entry (or leave while unhealthy), then the periodic
        work."""
        if self._insecure is not None:
            self._insecure.tick()
        try:
            if not self._healthy():
                self._leave()
                return
            self._lease.renew(self._info())
            if self._left:
                log.warning("worker %s is healthy again: renewing its lease", self._info().worker_id)
                self._left = False
            self._tick()
            if self._on_registry is not None and time.monotonic() - self._registry_at >= self._registry_every_s:
                self._registry_at = time.monotonic()
                if self._wants_registry():
                    self._on_registry(self._lease.list_workers())
        except Exception as exc:  # Redis down: keep trying, the lease lapses meanwhile
            if time.monotonic() - self._failed_at >= self._period:   # once a period, nudged or not
                self._failed_at = time.monotonic()
                log.warning("lease renewal failed: %s", exc)

    def _leave(self) -> None:
        """Unhealthy: release the lease once (retried while Redis fails) and log it once."""
        if not self._left:
            worker_id = self._info().worker_id
            self._lease.release(worker_id)
            self._left = True
            log.error("worker %s is unhealthy (its KV transport stopped?): released its lease, not renewing it",
                      worker_id)

    def stop(self) -> None:
        self._halt.set()
        self._nudged.set()
        self.join(timeout=2)
        try:
            self._lease.release(self._info().worker_id)
        except Exception as exc:
            log.warning("lease release failed: %s", exc)
        self._lease.close()


class WorkerProcess:
    """A worker's running parts, started in this order: engine thread (which first warms up, when
    ``cfg.warmup``: :meth:`warm_up`), gRPC server once the warm-up is done, and last the Redis lease,
    so that traffic arrives only when the worker can take it at full speed (vLLM likewise profiles
    and captures its CUDA graphs before it serves).
    Subclasses build the engine (anything with ``run_forever(stop_event)``) and say
    which servicer to serve and what load to report.

    ``secret`` is the process's cluster secret (:func:`cluster.secret.cluster_secret`, resolved once
    by the subclass, which also hands it to the engine's KV transport): it signs the registry entry
    and, through :func:`cluster.secret.worker_rpc_token`, guards the gRPC port. None: neither.
    """

    service_name = ""

    def __init__(self, cfg: WorkerConfig, engine, secret: bytes | None = None) -> None:
        self.cfg, self.engine, self._secret = cfg, engine, secret
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._engine_main, name=f"{type(self).__name__}-engine", daemon=True)
        self._warmed = threading.Event()
        self._warmup_report: WarmupReport | BaseException = WarmupReport()
        self.address = ""
        self.metrics = CollectorRegistry()  # this worker's Prometheus metrics (cluster.metrics), served on start
        self.metrics_address = ""
        self._metrics_server = None
        self._grace_s, self._unroute_s = 1.0, 0.0
        self.warmup_s = 0.0  # seconds the start-up warm-up took (0: none); in the registry entry and metrics

    def warm_up(self) -> WarmupReport:
        """Run every shape and path the engine can meet once, on scratch KV blocks that are all free again
        afterwards, leaving no request, cached prefix or request metric behind. Runs on the engine thread
        before it serves (:meth:`start` waits for it; nothing else reaches the engine yet), so it may drive
        the engine directly. Default: nothing to warm.

        Raises:
            RuntimeError: a warm-up step failed or left blocks allocated (the worker must not serve).
        """
        return WarmupReport()

    def _engine_main(self) -> None:
        """The engine thread: warm up (when configured; on this thread, so that per-thread state such as
        the OpenMP team serving torch is the serving thread's own), tell :meth:`start`, then serve."""
        if self.cfg.warmup:
            started = time.perf_counter()
            try:
                self._warmup_report = self.warm_up()
            except BaseException as exc:  # start() raises it; the engine never serves
                self._warmup_report = exc
                self._warmed.set()
                return
            self.warmup_s = max(time.perf_counter() - started, 1e-6)  # > 0: the entry shows it warmed up
        self._warmed.set()
        self.engine.run_forever(self._halt)

    def add_servicer(self, server: grpc.aio.Server) -> None:
        raise NotImplementedError

    def info(self) -> WorkerInfo:
        """This worker's registry entry with its current load."""
        raise NotImplementedError

    def on_heartbeat(self) -> None:
        """Periodic work on the heartbeat thread after each lease renewal (default: none)."""

    def _kv_ends(self) -> list:
        """The engine's KV transport ends: its ``receiver`` and ``kv_sender`` attributes, where present."""
        return [end for end in (getattr(self.engine, "receiver", None), getattr(self.engine, "kv_sender", None))
                if end is not None]

    def healthy(self) -> bool:
        """Whether this worker can still serve, asked before each lease renewal: while False the worker
        leaves the registry (routers stop choosing it; its in-flight requests go on). Default: every KV
        transport end of the engine that reports ``alive`` (a KV receiver: its accept and deadline
        threads run) is alive."""
        return all(getattr(end, "alive", True) for end in self._kv_ends())

    def keeps_peer_state(self) -> bool:
        """Whether the engine's KV transport holds per-peer state (NCCL communicators) that
        :meth:`on_registry` should prune; only then does the heartbeat read the registry."""
        return any(getattr(end, "keeps_peer_state", False) for end in self._kv_ends())

    def on_registry(self, workers: list[WorkerInfo]) -> None:
        """Every ``lease_s`` on the heartbeat thread, with the live workers the registry lists: the KV
        transport forgets its state of peers that left (a receiver's communicators of senders whose worker
        id is gone, a sender's communicators to KV addresses no worker advertises)."""
        for end in self._kv_ends():
            evict = getattr(end, "evict_peers_except", None)
            if evict is not None:
                live = [w.worker_id for w in workers] if end is getattr(self.engine, "receiver", None) \
                    else [w.kv_address for w in workers if w.kv_address]
                evict(live)

    async def start(self) -> str:
        """Start serving and register. Returns the gRPC ``host:port``.

        Raises:
            RuntimeError: the warm-up failed (:meth:`warm_up`), or the port could not be bound.
            redis.RedisError: the registry is unreachable.
        """
        log.info("worker %s serving %s in %s (dtype %s)", self.cfg.worker_id, self.cfg.model_dir,
                 self.cfg.resolved_dtype, self.cfg.dtype)
        self._thread.start()
        await asyncio.to_thread(self._warmed.wait)
        report = self._warmup_report
        if isinstance(report, BaseException):
            raise RuntimeError(f"worker {self.cfg.worker_id}: warm-up failed: {report}") from report
        if self.cfg.warmup:
            log.info("worker %s warmed up in %.2f s: %d prefill shapes, %d decode buckets", self.cfg.worker_id,
                     self.warmup_s, report.num_prefill_shapes, report.num_decode_buckets)
        # with a secret, only the router (which derives the same token) may call
        auth = [BearerTokenInterceptor(worker_rpc_token(self._secret))] if self._secret is not None else []
        self._server, port = await start_grpc_server(self.cfg.host, self.cfg.port, self.add_servicer,
                                                     [self.service_name], auth)
        self.address = f"{self.cfg.host}:{port}"
        self._metrics_server = start_metrics_server(self.cfg.host, self.cfg.metrics_port, self.metrics)
        self.metrics_address = self._metrics_server.address
        self._heartbeat = Heartbeat(self.cfg, self.info, self.on_heartbeat, self._secret, self.healthy,
                                    self.on_registry, self.keeps_peer_state)
        self._heartbeat.start()
        if hasattr(self.engine, "on_pool_freed"):   # a decode worker: freed blocks no stream reports, at once
            self.engine.on_pool_freed = self._heartbeat.nudge
        return self.address

    async def drain(self, grace_s: float, unroute_s: float = 1.0) -> None:
        """Leave the cluster without failing what is in flight (scale-down)::

            release lease ─ wait unroute_s ─ refuse new RPCs, in-flight ones run ≤ grace_s ─ stop engine

        Routers drop the worker at their next registry read, so ``unroute_s`` should exceed
        their poll period. An RPC still running after ``grace_s`` is cancelled: its stream ends
        with an error status and its KV blocks are freed. The KV pool itself goes with the process.
        """
        self._grace_s, self._unroute_s = grace_s, unroute_s
        await self.stop()

    async def stop(self) -> None:
        """Deregister, stop serving (in-flight RPCs get the drain grace, 1 s by default),
        then stop the engine (which fails what is still in flight)."""
        self._heartbeat.stop()
        await asyncio.sleep(self._unroute_s)
        await self._server.stop(grace=self._grace_s)
        self._halt.set()
        await asyncio.to_thread(self._thread.join, 5)
        if self._metrics_server is not None:
            self._metrics_server.stop()
