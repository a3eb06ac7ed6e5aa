"""Running a process role (router, prefill worker, decode worker) as a service: its gRPC server
with health checking and reflection (:func:`start_grpc_server`, the one bring-up every role uses),
in the foreground until a signal (``python -m pdserve.<role>``), or on a background event-loop
thread inside a Ray actor (:class:`ServiceThread`)."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.cluster.logs import configure_logging

log = logging.getLogger(__name__)

# gRPC keepalive on every connection, so that a peer that stops answering without closing its TCP
# connection (SIGSTOPped, partitioned, hung) fails the calls on it within about 15 s instead of never:
# each side pings after 10 s and drops the connection when the ack is 5 s late. grpcio 1.85 times a
# keepalive ping's ack with ``grpc.http2.ping_timeout_ms`` (default 60 s), so it is set with
# ``grpc.keepalive_timeout_ms``. Pings go on with no call in flight and without data in between.
KEEPALIVE_CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.ping_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)
# Servers ping their clients the same way, and accept the clients' pings: one every 5 s at most without
# data (half the clients' interval, for timer jitter; the C name is GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_
# WITHOUT_DATA_MS), with no call in flight too; a client pinging faster still gets GOAWAY too_many_pings.
KEEPALIVE_SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    *KEEPALIVE_CHANNEL_OPTIONS,
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
)


def freeze_startup_heap() -> int:
    """Move every object alive now (once a service is built: model, tokenizer, KV pool; once it has
    started: servers, what the warm-up left) to the collector's permanent generation, after a full
    collection so that no garbage goes with it, and return how many are frozen (``gc.get_freeze_count()``).

    A collection of the oldest generation walks every tracked object and stops the process meanwhile:
    after 100 requests through a bench-80m cluster (~316,000 tracked objects in a worker, ~220,000 in
    the router) one took 270 ms in the decode worker, 165 ms in the prefill worker and 109 ms in the
    router (2026-11-29, Xeon 207; docs/operations.md), a pause that lands on whichever step or token is
    in flight when it fires; frozen, 0.4-0.9 ms. Objects allocated later are collected as before. vLLM
    (its API server, engine core and GPU workers) and SGLang freeze their serving processes' heaps the
    same way. Called by :func:`start_frozen` twice: before the service starts, so that the long
    collection comes before it registers and no request waits on it, and after, which walks only what
    the start added."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    log.info("froze %d objects out of the collector's walks (%.1f ms)", gc.get_freeze_count(),
             (time.perf_counter() - started) * 1e3)
    return gc.get_freeze_count()


async def start_frozen(service: Service) -> str:
    """Start ``service`` between two :func:`freeze_startup_heap` calls; return its address. For
    :func:`run_foreground` and :class:`ServiceThread`, which each run one service per process; never for
    tests that start services in their own process, whose heaps later services would otherwise keep
    alive."""
    freeze_startup_heap()
    address = await service.start()
    freeze_startup_heap()
    return address


def unfreeze_heap() -> None:
    """Undo :func:`freeze_startup_heap` once the service has stopped, so that the interpreter's last
    collections reach the start-up objects again (frozen, extension objects still alive at exit made
    nanobind, under Triton, print leak reports on stderr, breaking ``--log-format json``)."""
    gc.unfreeze()


class Service(Protocol):
    """A role's running object: ``start`` returns its gRPC ``host:port``."""

    async def start(self) -> str: ...
    async def stop(self) -> None: ...


def run_foreground(factory: Callable[[], Service], log_format: str = "text", log_level: str = "WARNING") -> None:
    """Build the service, start it with its start-up heap frozen (:func:`start_frozen`), print
    ``ready <host:port>`` on stdout, serve until SIGINT/SIGTERM (or until the launcher named by
    :data:`PARENT_PID_ENV` has exited), then stop it cleanly. Logs go to stderr
    as ``log_format`` (``text``, or ``json``: one object per line, :mod:`cluster.logs`)."""
    configure_logging(log_format, log_level)

    async def main() -> None:
        service = factory()
        address = await start_frozen(service)
        print(f"ready {address}", flush=True)
        await wait_for_shutdown_signal(watched_parent_pid())
        await service.stop()
        unfreeze_heap()

    asyncio.run(main())
    sys.stdout.flush()


class ServiceThread:
    """Runs a service on its own event loop in a daemon thread (for Ray actors)."""

    def __init__(self, factory: Callable[[], Service], log_format: str | None = None, log_level: str = "WARNING",
                 ) -> None:
        if log_format is not None:  # the actor process's logging (Ray's worker logs, to the driver when asked)
            configure_logging(log_format, log_level)
        self._factory = factory
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="service-loop", daemon=True)

    def start(self, timeout_s: float = 300.0) -> str:
        """Build and start the service with its start-up heap frozen (:func:`start_frozen`: one service
        per Ray actor process); return its address.

        Raises:
            Exception: whatever the service raised while starting.
        """
        self._thread.start()
        self._service = self._factory()
        return asyncio.run_coroutine_threadsafe(start_frozen(self._service), self._loop).result(timeout_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the service and the loop."""
        self._finish(self._service.stop(), timeout_s)

    def drain(self, grace_s: float, unroute_s: float) -> None:
        """Drain a worker (see :meth:`cluster.worker_process.WorkerProcess.drain`), or stop a
        service that has no drain; then stop the loop. Returns within about
        ``unroute_s + grace_s`` plus the engine's shutdown."""
        drain = getattr(self._service, "drain", None)
        coro = drain(grace_s, unroute_s) if drain is not None else self._service.stop()
        self._finish(coro, unroute_s + grace_s + 30.0)

    def _finish(self, coro, timeout_s: float) -> None:
        try:
            asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout_s)
            unfreeze_heap()


async def start_grpc_server(host: str, port: int, add_services: Callable[[grpc.aio.Server], None],
                            service_names: Sequence[str], interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                            credentials: grpc.ServerCredentials | None = None,
                            options: Sequence[tuple[str, Any]] = (),
                            maximum_concurrent_rpcs: int | None = None) -> tuple[grpc.aio.Server, int]:
    """Start a ``grpc.aio`` server with the role's services (``add_services`` registers them), the
    ``grpc.health.v1`` service (SERVING for ``""`` and each of ``service_names``) and reflection.

    Args:
        interceptors: e.g. a bearer-token check (:mod:`cluster.grpc_auth`).
        credentials: TLS server credentials; None: plaintext.
        options: gRPC channel arguments of the server, e.g. ``("grpc.max_receive_message_length",
            bytes)``; added after ``("grpc.so_reuseport", 0)`` and :data:`KEEPALIVE_SERVER_OPTIONS`,
            which every role gets (a key given here replaces theirs).
        maximum_concurrent_rpcs: RPCs of every kind (health checks included) served at once; gRPC
            answers any call beyond it RESOURCE_EXHAUSTED ("Concurrent RPC limit exceeded!").
            None: no cap.
    Returns:
        The started server and the bound port.
    Raises:
        RuntimeError: ``host:port`` could not be bound.
    """
    merged = dict([("grpc.so_reuseport", 0), *KEEPALIVE_SERVER_OPTIONS, *options])  # later keys win
    server = grpc.aio.server(options=list(merged.items()), interceptors=list(interceptors) or None,
                             maximum_concurrent_rpcs=maximum_concurrent_rpcs)
    add_services(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bind = f"{host}:{port}"
    bound = server.add_insecure_port(bind) if credentials is None else server.add_secure_port(bind, credentials)
    if bound == 0:
        raise RuntimeError(f"cannot bind gRPC server to {host}:{port}")
    await server.start()
    for name in ["", *service_names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound


# Set by a launcher that owns its role processes (deploy.processes.spawn_role) to its own pid: the role
# then stops, as on SIGTERM, once that launcher has exited and it has been re-parented.
PARENT_PID_ENV = "PDSERVE_PARENT_PID"


def watched_parent_pid() -> int | None:
    """The launcher's pid from :data:`PARENT_PID_ENV`; None where unset or not a pid above 1. A role
    whose launcher had already exited when it read this stops at once (see :func:`wait_for_shutdown_signal`)."""
    raw = os.environ.get(PARENT_PID_ENV, "")
    return int(raw) if raw.isdigit() and int(raw) > 1 else None


async def _parent_gone(parent_pid: int, poll_s: float) -> None:
    """Return once this process's parent is no longer ``parent_pid`` (it exited; the kernel re-parented
    this process to init or a subreaper)."""
    while os.getppid() == parent_pid:
        await asyncio.sleep(poll_s)


async def wait_for_shutdown_signal(parent_pid: int | None = None, poll_s: float = 0.5) -> None:
    """Return on SIGINT or SIGTERM, or, with ``parent_pid``, once this process's parent is no longer that
    process (checked every ``poll_s`` seconds): a role whose launcher died, from a crash or a SIGKILL that
    gave it no chance to stop its children, stops instead of serving on as an orphan."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    waits = [asyncio.ensure_future(stop.wait())]
    if parent_pid is not None:
        waits.append(asyncio.ensure_future(_parent_gone(parent_pid, poll_s)))
    _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    if not stop.is_set():
        log.warning("launcher (pid %d) exited; stopping", parent_pid)
