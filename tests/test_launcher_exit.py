"""A role process whose launcher dies stops by itself (``PDSERVE_PARENT_PID``): a test or benchmark
killed before it could stop its cluster leaves no orphan router or worker serving on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import redis

from pdserve.cluster.service import PARENT_PID_ENV
from tests.clusters import proc_state

LAUNCHER = textwrap.dedent("""
    import json, sys
    from pdserve.deploy.processes import spawn_role
    role, flags = sys.argv[1], json.loads(sys.argv[2])
    proc = spawn_role(role, flags, "orphan")
    print(json.dumps({"pid": proc.proc.pid, "address": proc.address}), flush=True)
    sys.stdin.read()  # until the test kills this launcher
""")


def _launch(role: str, flags: dict) -> tuple[subprocess.Popen, int]:
    """A launcher process that starts ``role`` with spawn_role, prints its pid, and waits."""
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, role, json.dumps(flags)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
    line = launcher.stdout.readline()
    assert line, f"launcher exited {launcher.wait()} before its {role} was ready"
    return launcher, json.loads(line)["pid"]


def _exited(pid: int) -> bool:
    """True once ``pid`` has exited (gone, or a zombie that init has not reaped yet)."""
    state = proc_state(pid)
    return state is None or state[0] == "Z"


def _wait_exited(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not _exited(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_router_stops_when_its_launcher_is_killed(redis_url, model_dir):
    launcher, pid = _launch("router", dict(model_dir=model_dir, cluster="orphan-" + uuid.uuid4().hex[:8],
                                           redis_url=redis_url))
    try:
        assert not _wait_exited(pid, 1.5), "the router stopped while its launcher was alive"
        launcher.kill()
        launcher.wait()
        assert _wait_exited(pid, 15.0), "the router served on after its launcher was killed"
    finally:
        if not _exited(pid):
            os.kill(pid, signal.SIGKILL)


def test_worker_releases_its_lease_when_its_launcher_is_killed(redis_url, model_dir):
    """The worker stops as on SIGTERM: its registry entry goes at once, not when its lease lapses."""
    cluster = "orphan-" + uuid.uuid4().hex[:8]
    key = f"pdserve:{cluster}:worker:orphan-d0"
    launcher, pid = _launch("decode_worker", dict(model_dir=model_dir, cluster=cluster, redis_url=redis_url,
                                                  worker_id="orphan-d0", lease_s=60.0))
    r = redis.Redis.from_url(redis_url)
    try:
        assert r.exists(key)
        launcher.kill()
        launcher.wait()
        assert _wait_exited(pid, 30.0), "the decode worker served on after its launcher was killed"
        assert not r.exists(key), "the worker left its 60 s lease behind instead of releasing it"
    finally:
        if not _exited(pid):
            os.kill(pid, signal.SIGKILL)
        r.delete(key)
        r.close()


def test_an_unset_or_malformed_parent_pid_watches_nothing(monkeypatch):
    from pdserve.cluster.service import watched_parent_pid

    for raw, want in [(None, None), ("", None), ("abc", None), ("1", None), ("-5", None), ("4242", 4242)]:
        if raw is None:
            monkeypatch.delenv(PARENT_PID_ENV, raising=False)
        else:
            monkeypatch.setenv(PARENT_PID_ENV, raw)
        assert watched_parent_pid() == want, raw
