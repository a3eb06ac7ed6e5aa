"""Starting role processes as plain subprocesses (``python -m pdserve.<role>``) and waiting
until they are ready. Used by tests and benchmarks; ``pdserve up`` uses Ray."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass

from pdserve.cluster.service import PARENT_PID_ENV


@dataclass
class RoleProcess:
    """A started role process, the gRPC address it printed, and the router's HTTP API address
    (``http host:port`` before ``ready``; empty without one)."""

    name: str
    proc: subprocess.Popen
    address: str
    http_address: str = ""

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, wait, SIGKILL if needed; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def spawn_role(role: str, flags: dict[str, object], name: str = "", timeout_s: float = 120.0,
               env: dict[str, str] | None = None, cpus: str | None = None) -> RoleProcess:
    """Run ``python -m pdserve.<role> --flag value ...`` (``role``: ``router``, ``prefill_worker`` or
    ``decode_worker``) and wait for its ``ready host:port`` line (a router started with ``http_port``
    prints ``http host:port`` before it).
    ``cpus`` (e.g. ``"0"`` or ``"0-1"``) pins the process to those cores with ``taskset``. The process
    stops by itself once this one has exited (:data:`cluster.service.PARENT_PID_ENV`), so that a test or
    benchmark that dies without stopping it leaves no orphan serving on.

    Raises:
        RuntimeError: the process exited or did not get ready within ``timeout_s`` seconds
            (its stderr is included).
    """
    argv = (["taskset", "-c", cpus] if cpus else []) + [sys.executable, "-m", f"pdserve.{role}"]
    for key, value in flags.items():
        argv += ["--" + key.replace("_", "-"), str(value)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, PARENT_PID_ENV: str(os.getpid()), **(env or {})})
    deadline, http_address = time.monotonic() + timeout_s, ""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline()
            if line.startswith("http "):  # `ready` follows at once (maybe already in the read buffer, unseen by select)
                http_address = line.split()[1]
                line = proc.stdout.readline()
            if line.startswith("ready "):
                return RoleProcess(name or role, proc, line.split()[1], http_address)
            if line == "" and proc.poll() is not None:
                break
        elif proc.poll() is not None:
            break
    proc.kill()
    _, err = proc.communicate(timeout=5)
    raise RuntimeError(f"{name or role} did not start: exit {proc.returncode}\n{err[-4000:]}")
