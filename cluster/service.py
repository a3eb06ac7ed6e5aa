"""Running a process role (router, prefill worker, decode worker) as a service:
in the foreground until a signal (``python -m pdserve.<role>``), or on a background
event-loop thread inside a Ray actor."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from collections.abc import Callable
from typing import Protocol


class Service(Protocol):
    """A role's running object: ``start`` returns its gRPC ``host:port``."""

    async def start(self) -> str: ...
    async def stop(self) -> None: ...


def run_foreground(factory: Callable[[], Service]) -> None:
    """Build the service, start it, print ``ready <host:port>`` on stdout, serve until
    SIGINT/SIGTERM, then stop it cleanly."""
    from pdserve.cluster.worker_process import wait_for_shutdown_signal

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    async def main() -> None:
        service = factory()
        address = await service.start()
        print(f"ready {address}", flush=True)
        await wait_for_shutdown_signal()
        await service.stop()

    asyncio.run(main())
    sys.stdout.flush()


class ServiceThread:
    """Runs a service on its own event loop in a daemon thread (for Ray actors)."""

    def __init__(self, factory: Callable[[], Service]) -> None:
        self._factory = factory
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="service-loop", daemon=True)

    def start(self, timeout_s: float = 300.0) -> str:
        """Build and start the service; return its address.

        Raises:
            Exception: whatever the service raised while starting.
        """
        self._thread.start()
        self._service = self._factory()
        return asyncio.run_coroutine_threadsafe(self._service.start(), self._loop).result(timeout_s)

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
