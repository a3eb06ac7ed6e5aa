"""The processes the tests start: clusters of real role processes (router, prefill and decode workers), ``pdserve
up``, a Redis of a test's own, and what ``/proc`` says about them."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from pdserve.deploy import client
from pdserve.deploy.processes import RoleProcess, spawn_role
from pdserve.deploy.redis_server import redis_answers, redis_server_binary


def proc_state(pid: int) -> tuple[str, int] | None:
    """``(state, parent pid)`` of process ``pid`` from ``/proc`` (state ``"Z"``: exited, not yet reaped);
    None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1])


def live_role_children() -> list[tuple[int, str]]:
    """(pid, command line) of this process's children still running as ``python -m pdserve.<role>``."""
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or (state := proc_state(int(entry.name))) is None:
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if state[0] != "Z" and state[1] == me and any(a.startswith(b"pdserve.") for a in argv):
            found.append((int(entry.name), b" ".join(argv).decode(errors="replace")[:300]))
    return found


class Cluster:
    """A router, prefill and decode workers as separate processes on a private registry namespace.

    Workers are started in parallel (``worker_flags_by_name`` adds flags for one worker, e.g.
    ``{"p0": {"fault_hold_transfer_s": 1.0}}``); :meth:`kill` and :meth:`restart_router` inject faults.
    """

    def __init__(self, model: str, redis_url: str, num_prefill: int = 1, num_decode: int = 1,
                 prefill_flags: dict | None = None, decode_flags: dict | None = None, router_flags: dict | None = None,
                 worker_flags_by_name: dict[str, dict] | None = None, **worker_flags) -> None:
        self.model, self.redis_url, self.cluster = model, redis_url, "test-" + uuid.uuid4().hex[:8]
        common = dict(model_dir=model, cluster=self.cluster, redis_url=redis_url, lease_s=2.0) | worker_flags
        by_name = worker_flags_by_name or {}
        specs = [("decode_worker", f"d{i}", decode_flags) for i in range(num_decode)]
        specs += [("prefill_worker", f"p{i}", prefill_flags) for i in range(num_prefill)]
        self.router_flags = dict(model_dir=model, cluster=self.cluster, redis_url=redis_url, kv_timeout_s=10.0
                                 ) | (router_flags or {})
        self.workers: list[RoleProcess] = []
        with ThreadPoolExecutor(max_workers=len(specs) + 1) as pool:
            futures = [pool.submit(spawn_role, module, dict(worker_id=name, **common | (flags or {})
                                                            | by_name.get(name, {})), name)
                       for module, name, flags in specs]
            futures.append(pool.submit(spawn_role, "router", self.router_flags, "router"))
            errors = []
            for f in futures:
                try:
                    proc = f.result()
                except Exception as exc:
                    errors.append(exc)
                    continue
                if proc.name == "router":
                    self.router = proc
                else:
                    self.workers.append(proc)
        if errors:
            self.stop()
            raise errors[0]
        self.address = self.router.address
        try:  # started in parallel: the router may have read the registry before the last worker registered
            self.wait_workers({name for _, name, _ in specs})
        except AssertionError:
            self.stop()
            raise

    def run(self, coro_fn):
        """Run ``coro_fn(channel)`` against the router and return its result."""
        async def go():
            async with grpc.aio.insecure_channel(self.address) as channel:
                return await coro_fn(channel)
        return asyncio.run(go())

    def complete(self, prompt, **kw) -> client.Completion:
        return self.run(lambda ch: client.complete(ch, client.make_request(prompt, **kw), timeout_s=60))

    def state(self):
        return self.run(client.cluster_state)

    def slo_when(self, predicate, timeout_s: float = 5.0):
        """The cluster's SLO attainment counters once ``predicate(slo)`` holds (the router writes
        outcomes to Redis in the background, just after each stream ends)."""
        deadline = time.monotonic() + timeout_s
        while not predicate(slo := self.state().slo):
            if time.monotonic() > deadline:
                raise AssertionError(f"SLO counters never satisfied the condition: {slo}")
            time.sleep(0.05)
        return slo

    def worker(self, name: str) -> RoleProcess:
        return next(p for p in self.workers if p.name == name)

    def kill(self, name: str) -> None:
        """``kill -9`` one worker (or ``"router"``) and reap it."""
        proc = self.router if name == "router" else self.worker(name)
        proc.proc.kill()
        proc.proc.wait()

    def restart_router(self) -> None:
        """``kill -9`` the router, then start a new one on the same address."""
        self.kill("router")
        port = int(self.address.rsplit(":", 1)[1])
        self.router = spawn_role("router", {**self.router_flags, "port": port}, "router")
        assert self.router.address == self.address

    def wait_workers(self, names: set[str], timeout_s: float = 10.0) -> None:
        """Wait until the router lists exactly the workers ``names`` (leases lapsed or renewed)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                seen = {w.worker_id for w in self.state().workers}
            except grpc.aio.AioRpcError:
                seen = set()
            if seen == names:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"router lists workers {sorted(seen)}, expected {sorted(names)}")
            time.sleep(0.1)

    def assert_pools_free(self, timeout_s: float = 6.0) -> None:
        """Every worker's KV pool is back to fully free (as its heartbeats report)."""
        deadline = time.monotonic() + timeout_s
        while True:
            workers = self.state().workers
            busy = {w.worker_id: (w.num_free_blocks, w.num_total_blocks) for w in workers
                    if w.num_free_blocks != w.num_total_blocks}
            if not busy and workers:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"KV blocks still allocated (free, total): {busy}; workers: {len(workers)}")
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM every process at once, then wait for each (SIGKILL after its timeout)."""
        procs = [p for p in [getattr(self, "router", None), *self.workers] if p is not None]
        for p in procs:
            if p.proc.poll() is None:
                p.proc.terminate()
        for p in procs:
            p.stop()


def colocated_cluster(model: str, redis_url: str, **flags) -> Cluster:
    """A router and one colocated worker (role ``both``, id ``b0``: it prefills and decodes) on ``model``,
    with 4-token blocks; ``flags`` add to or override its flags (e.g. ``max_num_batched_tokens``)."""
    c = Cluster(model, redis_url, num_prefill=0, num_decode=0)
    flags = dict(model_dir=model, cluster=c.cluster, redis_url=redis_url, lease_s=2.0, block_size=4,
                 colocated="true") | flags
    c.workers.append(spawn_role("decode_worker", dict(worker_id="b0", **flags), "b0"))
    c.wait_workers({"b0"})
    return c


PDSERVE = [sys.executable, "-m", "pdserve.deploy.cli"]


@contextlib.contextmanager
def pdserve_up(args: list[str], env: dict[str, str]) -> Iterator[subprocess.Popen]:
    """``pdserve up ARGS`` in its own session (text stdout/stderr piped); a test ends it with
    :func:`stop_pdserve_up`, and whatever is still running at the block's exit is killed, its process group
    (Ray's) with it."""
    up = subprocess.Popen([*PDSERVE, "up", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env, start_new_session=True)
    try:
        yield up
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()


def stop_pdserve_up(up: subprocess.Popen) -> None:
    """SIGINT, as an operator's Ctrl-C: ``pdserve up`` must exit 0 within 60 s."""
    up.send_signal(signal.SIGINT)
    assert up.wait(60) == 0


class PrivateRedis:
    """A ``redis-server`` of its own on a free port (persistence off), for tests that restart Redis."""

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir = tempfile.mkdtemp(prefix="pdserve-private-redis-")
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self, timeout_s: float = 10.0) -> None:
        """Start it (empty) and wait until it answers PING."""
        self.proc = subprocess.Popen([redis_server_binary(), "--bind", "127.0.0.1", "--port", str(self.port),
                                      "--save", "", "--appendonly", "no", "--dir", self._dir],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while not redis_answers(self.url, 0.2):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"private redis-server on port {self.port} did not start")
            time.sleep(0.05)

    def kill(self) -> None:
        """``kill -9``: everything it held is lost."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self._dir, ignore_errors=True)
