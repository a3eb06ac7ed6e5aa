"""Ray processes on this machine: a local head that outlives its driver (``pdserve up --detach``),
a driver-started local Ray (retried once when Ray's raylet misses its startup wait), attaching to
a running cluster, and stopping exactly the processes one of these started.

The driver-side cluster handle and the teardown are :mod:`deploy.ray_cluster`.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import ray

log = logging.getLogger(__name__)
HEAD_PREFIX = "pdserve-ray-"  # a local head's --temp-dir; short, Ray's socket paths must fit in 107 bytes


@dataclass(frozen=True)
class LocalHead:
    """A Ray head ``pdserve up --detach`` started on this machine: its GCS ``address`` and its private
    ``temp_dir`` (every process of it carries that path on its command line)."""

    address: str
    temp_dir: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_command() -> list[str]:
    beside = Path(sys.executable).parent / "ray"
    return [str(beside)] if beside.exists() else [sys.executable, "-c", "from ray.scripts.scripts import main; main()"]


def start_local_head(num_cpus: int, timeout_s: float = 180.0) -> LocalHead:
    """Start a local Ray head that outlives this process (``ray start --head`` in its own session),
    with every port it listens on chosen free and no dashboard.

    Raises:
        RuntimeError: ``ray start`` failed or timed out (anything it started is stopped again).
    """
    temp_dir = tempfile.mkdtemp(prefix=HEAD_PREFIX, dir="/tmp")
    port = _free_port()
    head = LocalHead(f"127.0.0.1:{port}", temp_dir)
    cmd = [*_ray_command(), "start", "--head", f"--port={port}",
           f"--num-cpus={num_cpus}", "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}",
           f"--ray-client-server-port={_free_port()}", f"--dashboard-port={_free_port()}",
           f"--dashboard-agent-listen-port={_free_port()}", f"--runtime-env-agent-port={_free_port()}"]
    log_path = Path(temp_dir) / "ray-start.log"
    try:
        with open(log_path, "wb") as log:  # not a pipe: the daemons it forks would hold it open
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, timeout=timeout_s).returncode
    except subprocess.TimeoutExpired:
        rc = -1
    if rc != 0:
        tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
        stop_local_head(head)
        raise RuntimeError(f"`ray start --head` failed (exit {rc}):\n{tail}")
    return head


def connect(address: str | None, **kwargs) -> None:
    """``ray.init`` as a driver of the Ray cluster at ``address`` (``None``/``"auto"``: the local one). Like
    ``address="auto"`` does, it sends the local Ray auth token (``~/.ray/auth_token``) when there is one:
    ``ray start --head`` turns token auth on by default, and an explicit address would not send it."""
    if address not in (None, "auto"):
        try:
            from ray._private.authentication.authentication_token_setup import (
                maybe_enable_token_auth_if_token_available,
            )
        except ImportError:  # a Ray without token auth
            pass
        else:
            maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    ray.init(address=address or "auto", **kwargs)


LOCAL_START_ATTEMPTS = 3
# how Ray says one of its own daemons did not come up in time (messages of ray 2.60's node start-up)
STARTUP_TIMEOUTS = ("timed out during startup", "Timed out waiting for file")


def init_local_ray(**kwargs) -> None:
    """``ray.init`` of a Ray that this driver starts on its own machine, tried up to
    :data:`LOCAL_START_ATTEMPTS` times when Ray reports that one of its daemons missed its start-up
    wait (:data:`STARTUP_TIMEOUTS`): Ray waits a fixed 30 s for the raylet to register ("The current
    node timed out during startup", ray-project/ray#47087 and #62883) and a fixed time for the GCS to
    write its port file ("Timed out waiting for file .../gcs_server_port_..."). Both were seen here in
    full test runs on a 2-core VM, each leaving no log of the daemon at all; the same start alone
    succeeds. Between attempts the half-started node's processes (this process's Ray children) are stopped.

    Raises:
        Exception: Ray's own, when the last attempt fails too or the failure is another one.
    """
    for attempt in range(1, LOCAL_START_ATTEMPTS + 1):
        try:
            ray.init(**kwargs)
            return
        except Exception as exc:
            if attempt == LOCAL_START_ATTEMPTS or not any(m in str(exc) for m in STARTUP_TIMEOUTS):
                raise
            log.warning("local Ray did not start (attempt %d of %d): %s; starting it again", attempt,
                        LOCAL_START_ATTEMPTS, exc)
            ray.shutdown()
            _stop_ray_children()


def _stop_ray_children(timeout_s: float = 10.0) -> None:
    """Stop this process's child processes that belong to Ray (what a failed local start left running)."""
    import psutil  # Ray's own copy (ray/thirdparty_files, on sys.path once ray is imported)

    _terminate_gcs_last([p for p in psutil.Process().children(recursive=True) if _is_ray_process(p)], timeout_s)


def _is_ray_process(p) -> bool:
    try:
        return any("ray" in part for part in p.cmdline()[:3])
    except Exception:  # gone, or not ours to read
        return False


def head_processes(temp_dir: str) -> list:
    """The processes of the local head whose ``--temp-dir`` is ``temp_dir`` (their command line names it),
    and their descendants (the actors' worker processes), as ``psutil.Process`` objects."""
    import psutil  # Ray's own copy (ray/thirdparty_files, on sys.path once ray is imported)

    procs: dict[int, psutil.Process] = {}
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(temp_dir in arg for arg in p.info["cmdline"] or ()):
                procs[p.pid] = p
                procs.update((c.pid, c) for c in p.children(recursive=True))
        except psutil.Error:
            continue
    procs.pop(os.getpid(), None)
    return list(procs.values())


def stop_local_head(head: LocalHead, grace_s: float = 10.0) -> int:
    """Stop every process of the local head ``head`` (:func:`head_processes`): SIGTERM, then SIGKILL after
    ``grace_s``, the GCS server last; remove its temp dir. Other Ray instances on the machine are left
    alone (unlike ``ray stop``). Returns how many processes were running.

    The GCS goes last because the raylet and the autoscaler's monitor talk to it as they exit: terminated
    together with it, the raylet retried for ~10 s and the monitor outlived the grace period (SIGKILLed),
    so `pdserve down` took ~15 s after the actors had stopped; in this order the head is gone in ~4 s
    (2-core VM, 2026-11-28)."""
    procs = head_processes(head.temp_dir)
    _terminate_gcs_last(procs, grace_s)
    shutil.rmtree(head.temp_dir, ignore_errors=True)
    return len(procs)


def _terminate_gcs_last(procs: list, grace_s: float) -> None:
    """:func:`_terminate` the Ray processes ``procs``, the GCS server's after all the others'."""
    gcs = [p for p in procs if _name(p) == "gcs_server"]
    _terminate([p for p in procs if p not in gcs], grace_s)
    _terminate(gcs, grace_s)


def _name(p) -> str:
    """A ``psutil.Process``'s name, or "" once it is gone or unreadable."""
    try:
        return p.name()
    except Exception:  # gone, or not ours to read
        return ""


def _terminate(procs: list, grace_s: float) -> None:
    """SIGTERM every process of ``procs`` (``psutil.Process``), SIGKILL those alive after ``grace_s``."""
    import psutil

    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)


def _answers(address: str, timeout_s: float = 3.0) -> bool:
    """True when something accepts TCP connections at the GCS ``host:port``."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False
