"""Scaling a running cluster on a real local Ray: `pdserve scale` from a second driver, drain
of a worker with a request streaming through it, `pdserve status`, and Ray restarting a killed
worker. One Ray instance and one cluster for the whole module (tests run in file order).

The workers serve a seeded random-weight ``bench-9m`` checkpoint (4096 positions): its
long generations take seconds, long enough to drain a worker mid-stream.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid

import grpc
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.cluster.registry import RegistryReader, WorkerInfo
from pdserve.deploy import cli, client
from pdserve.deploy.config import ClusterConfig
from pdserve.deploy.make_model import make_model
from pdserve.deploy.planner import PlannerConfig, PlannerState
from pdserve.deploy.ray_cluster import RayCluster
from pdserve.proto import pdserve_pb2

PDSERVE = [sys.executable, "-m", "pdserve.deploy.cli"]
LONG = 600  # output tokens of a long request (several seconds on bench-9m)


@pytest.fixture(scope="module")
def rc(redis_url, tmp_path_factory):
    model = make_model("bench-9m", tmp_path_factory.mktemp("scale") / "bench-9m", seed=0, dtype="float32")
    cluster = RayCluster(ClusterConfig(
        model_dir=str(model), cluster="scale-" + uuid.uuid4().hex[:8], redis_url=redis_url, local_num_cpus=8,
        num_blocks=256, worker_options={"lease_s": 2.0}, unroute_s=0.5, drain_timeout_s=60.0, max_restarts=2,
        decode_options={"graph": False}))
    cluster.start()
    yield cluster
    cluster.stop()


async def aregistered(rc: RayCluster) -> list[WorkerInfo]:
    """The workers whose lease is live."""
    reader = RegistryReader(rc.cfg.redis_url, rc.cfg.cluster)
    try:
        return await reader.list_workers()
    finally:
        await reader.close()


def registered(rc: RayCluster) -> list[WorkerInfo]:
    return asyncio.run(aregistered(rc))


def wait_until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def assert_pools_free(rc: RayCluster) -> None:
    """Every registered worker reports its whole KV pool free (no leaked block)."""
    def free():
        workers = registered(rc)
        return workers and all(w.num_free_blocks == w.num_total_blocks for w in workers)
    wait_until(free, 10, f"all KV blocks free: {[(w.worker_id, w.num_free_blocks) for w in registered(rc)]}")


def roles(workers: list[WorkerInfo]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for w in workers:
        out.setdefault(w.role, []).append(w.worker_id)
    return out


def generate(rc: RayCluster, n: int, max_tokens: int, one_at_a_time: bool = False) -> list[client.Completion]:
    """``n`` concurrent requests of ``max_tokens`` output tokens each. ``one_at_a_time``: each starts
    once the previous one shows in a decode worker's heartbeat and the router has re-read the registry."""
    async def one(ch, i: int) -> client.Completion:
        return await client.complete(ch, client.make_request(f"Once upon a time {i}", max_tokens=max_tokens,
                                                             ignore_eos=True, temperature=0.0), timeout_s=120)

    async def go():
        async with grpc.aio.insecure_channel(rc.router_address) as ch:
            tasks = []
            for i in range(n):
                if one_at_a_time and tasks:
                    while sum(w.num_running for w in await aregistered(rc) if w.role == "decode") < i:
                        await asyncio.sleep(0.02)
                    await asyncio.sleep(2 * 0.25)  # two router registry polls (RouterConfig.registry_poll_s)
                tasks.append(asyncio.create_task(one(ch, i)))
            return await asyncio.gather(*tasks)
    return asyncio.run(go())


async def health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
        return reply.status


def test_scale_up_from_a_second_driver_registers_workers_only_once_they_serve(rc):
    before = {w.worker_id for w in registered(rc)}
    assert sorted(w.role for w in registered(rc)) == ["decode", "prefill"]
    proc = subprocess.Popen([*PDSERVE, "scale", "--ray-address", "auto", "--cluster", rc.cfg.cluster,
                             "--prefill", "2", "--decode", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)

    async def watch() -> dict[str, int]:
        """Health of each new worker at the moment its lease first appears."""
        reader, seen = RegistryReader(rc.cfg.redis_url, rc.cfg.cluster), {}
        try:
            while proc.poll() is None or len(seen) < 2:
                for w in await reader.list_workers():
                    if w.worker_id not in before and w.worker_id not in seen:
                        seen[w.worker_id] = await health(w.address)
                if proc.poll() is not None and time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.02)
        finally:
            await reader.close()
        return seen

    deadline = time.monotonic() + 300
    seen = asyncio.run(watch())
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert len(seen) == 2 and all(status == health_pb2.HealthCheckResponse.SERVING for status in seen.values()), seen
    new = {w.worker_id: w.role for w in registered(rc) if w.worker_id not in before}
    assert sorted(new.values()) == ["decode", "prefill"] and set(new) == set(seen)
    assert all(wid in out for wid in new) and out.startswith("added: ")
    assert {r: len(ids) for r, ids in roles(registered(rc)).items()} == {"prefill": 2, "decode": 2}

    # two long requests, the second once the first shows in its decode worker's heartbeat: the
    # router puts it on the other decode worker, so old and new both serve
    busy: set[str] = set()
    done = threading.Event()

    def sample():
        while not done.is_set():
            busy.update(w.worker_id for w in registered(rc) if w.role == "decode" and w.num_running)
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        results = generate(rc, 2, LONG, one_at_a_time=True)
    finally:
        done.set()
        sampler.join()
    assert [len(r.token_ids) for r in results] == [LONG] * 2
    assert all(r.final.finish_reason == pdserve_pb2.FINISH_REASON_LENGTH for r in results)
    assert busy == set(roles(registered(rc))["decode"])
    assert_pools_free(rc)


def test_status_prints_every_worker_with_its_free_blocks(rc, capsys):
    generate(rc, 1, max_tokens=2)  # counted by the router in Redis (admission off): status shows attainment
    assert_pools_free(rc)
    deadline = time.monotonic() + 5  # the router writes the outcome just after the stream ends
    while True:
        assert cli.main(["status", "--cluster", rc.cfg.cluster, "--redis-url", rc.cfg.redis_url]) == 0
        lines = capsys.readouterr().out.splitlines()
        if "SLO attainment" in lines[0] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    pools, _, attainment = lines[0].partition("; ")
    assert pools == f"cluster {rc.cfg.cluster}: prefill 2 workers, decode 2 workers"
    assert re.fullmatch(r"SLO attainment [01]\.\d\d \([1-9]\d* finished, 0 rejected, 60 s\)", attainment), attainment
    assert lines[1].split() == ["POOL", "WORKER", "ADDRESS", "RUNNING", "WAITING", "FREE", "KV", "BLOCKS", "LEASE",
                                "AGE", "METRICS"]
    workers = {w.worker_id: w for w in registered(rc)}
    rows = {line.split()[1]: line.split() for line in lines[2:]}
    assert set(rows) == set(workers)
    for wid, row in rows.items():
        w = workers[wid]
        assert row[0] == w.role and row[2] == w.address
        assert row[5] == f"{w.num_total_blocks}/{w.num_total_blocks}"  # idle: the whole pool free
        assert row[7] == "s" and 0 <= float(row[6]) < rc.cfg.worker_options["lease_s"]
        assert row[8] == w.metrics_address and w.metrics_address.startswith("127.0.0.1:")


def test_planner_window_reflects_the_running_pools(rc):
    window = ray.get(rc.controller.observe.remote(30.0))
    assert (window.num_prefill, window.num_decode) == (2, 2)
    free = ray.available_resources()
    assert window.fit_prefill == window.fit_decode == int(free.get("CPU", 0) // rc.cfg.cpus_per_worker)


def stream_through(rc: RayCluster, max_tokens: int, on_tokens) -> dict:
    """Run one long request; once 20 tokens have streamed and a decode worker reports it, call
    ``on_tokens(busy decode worker ids)`` in a thread.

    Returns:
        ``{"done": Completion, "final_at": monotonic time}`` or ``{"error": AioRpcError}``.
    """
    result: dict = {}

    def when_busy():  # the decode worker's next heartbeat shows the request
        busy = wait_until(lambda: [w.worker_id for w in registered(rc) if w.role == "decode" and w.num_running],
                          5, "the request in a decode worker's heartbeat")
        on_tokens(busy)

    async def go():
        out, actions = client.Completion(), []
        request = client.make_request("Once upon a time", max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        async with grpc.aio.insecure_channel(rc.router_address) as ch:
            try:
                async for msg in client.stream(ch, request, 120):
                    out.token_ids.extend(msg.token_ids)
                    if msg.HasField("final"):
                        out.final, result["final_at"] = msg.final, time.monotonic()
                    if len(out.token_ids) >= 20 and not actions:
                        actions.append(threading.Thread(target=when_busy))
                        actions[0].start()
                result["done"] = out
            except grpc.aio.AioRpcError as exc:
                result["error"] = exc
        for t in actions:
            await asyncio.to_thread(t.join)

    asyncio.run(go())
    return result


def test_scale_down_drains_a_decode_worker_while_a_request_streams_through_it(rc):
    pids = ray.get(rc.controller.worker_pids.remote())
    seen: dict = {}

    def scale_down(busy: list[str]):
        seen["busy"] = busy

        def watch():  # note when the victim's lease disappears
            while busy[0] in {w.worker_id for w in registered(rc)}:
                time.sleep(0.02)
            seen["lease_gone_at"] = time.monotonic()

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        seen["scale"] = rc.scale({"decode": 1}, remove=tuple(busy))
        watcher.join(timeout=5)

    result = stream_through(rc, LONG, scale_down)
    assert "error" not in result, result["error"]
    done = result["done"]
    assert len(done.token_ids) == LONG and done.final.finish_reason == pdserve_pb2.FINISH_REASON_LENGTH
    (victim,) = seen["busy"]
    assert seen["scale"]["removed"] == [victim] and victim not in seen["scale"]["pools"]["decode"]
    # the lease went first (no new requests), the in-flight request kept streaming to its end
    assert seen["lease_gone_at"] < result["final_at"]
    assert victim not in {w.worker_id for w in registered(rc)}
    wait_until(lambda: not _alive(pids[victim]), 30, f"process of {victim} to exit")
    assert [len(r.token_ids) for r in generate(rc, 2, 50)] == [50, 50]
    assert_pools_free(rc)


def test_drain_is_bounded_by_its_timeout_and_the_stuck_request_gets_an_error(rc):
    rc.scale({"decode": 2})
    wait_until(lambda: len(roles(registered(rc))["decode"]) == 2, 60, "a second decode worker")
    pids = ray.get(rc.controller.worker_pids.remote())
    seen: dict = {}

    def drain(busy: list[str]):
        t0 = time.monotonic()
        seen["scale"] = rc.scale({"decode": 1}, remove=tuple(busy), drain_timeout_s=0.2)
        seen["busy"], seen["drained_at"], seen["took"] = busy, time.monotonic(), time.monotonic() - t0

    result = stream_through(rc, LONG, drain)
    # the drained stream was cut: the router either moves the request to the remaining decode
    # worker (it then completes in full) or ends it with an error status, never a silent truncation
    if "error" in result:
        assert result["error"].code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
                                          grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED), result["error"]
    else:
        done = result["done"]
        assert len(done.token_ids) == LONG and done.final.finish_reason == pdserve_pb2.FINISH_REASON_LENGTH
        assert seen["drained_at"] < result["final_at"]  # the request did not keep its first worker alive
    assert seen["took"] < rc.cfg.unroute_s + 0.2 + 10
    wait_until(lambda: not _alive(pids[seen["busy"][0]]), 30, "the drained worker's process to exit")
    assert [len(r.token_ids) for r in generate(rc, 2, 50)] == [50, 50]
    assert_pools_free(rc)


def test_bad_scale_requests_are_refused_and_change_nothing(rc, capsys):
    before = ray.get(rc.controller.pools.remote())
    groups = _live_groups()
    for sizes, remove, match in [({"decode": 0}, (), "at least one"), ({"router": 2}, (), "pools"),
                                 ({"decode": 1}, ("nobody",), "no worker"),
                                 ({"prefill": 2}, (before["prefill"][0],), "below")]:
        with pytest.raises(ray.exceptions.RayTaskError, match=match):
            rc.scale(sizes, remove)
    with pytest.raises(ray.exceptions.RayTaskError, match="not enough free Ray resources"):
        rc.scale({"decode": 40})
    assert ray.get(rc.controller.pools.remote()) == before
    assert _live_groups() == groups
    assert cli.main(["scale", "--cluster", "no-such-cluster", "--decode", "2"]) == 1
    assert "no pdserve cluster 'no-such-cluster'" in capsys.readouterr().err
    assert cli.main(["scale", "--cluster", rc.cfg.cluster]) == 2
    assert "give --prefill, --decode" in capsys.readouterr().err
    assert cli.main(["scale", "--cluster", rc.cfg.cluster, "--decode", "0"]) == 1
    assert "at least one worker" in capsys.readouterr().err


def test_ray_restarts_a_killed_worker_and_it_rejoins(rc):
    pids = ray.get(rc.controller.worker_pids.remote())
    victim = ray.get(rc.controller.pools.remote())["prefill"][0]
    old = {w.worker_id: w for w in registered(rc)}[victim]
    os.kill(pids[victim], signal.SIGKILL)

    def rejoined():
        w = {w.worker_id: w for w in registered(rc)}.get(victim)
        return w if w is not None and w.address != old.address else None

    new = wait_until(rejoined, 120, f"{victim} to restart and re-register")
    assert new.role == "prefill" and asyncio.run(health(new.address)) == health_pb2.HealthCheckResponse.SERVING
    assert ray.get(rc.controller.worker_pids.remote())[victim] != pids[victim]
    assert [len(r.token_ids) for r in generate(rc, 3, 30)] == [30] * 3
    assert_pools_free(rc)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _live_groups() -> set[str]:
    return {gid for gid, g in ray.util.placement_group_table().items() if g["state"] != "REMOVED"}


def test_an_autoscale_step_shrinks_an_idle_pool_and_records_why(rc):
    """No traffic and no load: one planner window (hold 1, no cooldown) drains one prefill worker,
    never the decode pool at its minimum."""
    assert {r: len(ids) for r, ids in ray.get(rc.controller.pools.remote()).items()} == {"prefill": 2, "decode": 1}
    planner = PlannerConfig(min_prefill=1, max_prefill=2, min_decode=1, max_decode=2, hold_windows=1,
                            cooldown_s=0, window_s=10.0)
    action, state = ray.get(rc.controller.autoscale_step.remote(planner, PlannerState()))
    assert (action.role, action.delta) == ("prefill", -1)
    assert {r: len(ids) for r, ids in ray.get(rc.controller.pools.remote()).items()} == {"prefill": 1, "decode": 1}
    wait_until(lambda: sorted(w.role for w in registered(rc)) == ["decode", "prefill"], 10, "the drained lease gone")
    assert ray.get(rc.controller.info.remote())["decisions"][-1][1:3] == ("prefill", -1)
    action, _ = ray.get(rc.controller.autoscale_step.remote(planner, state))
    assert action is None  # both pools at their minimum
    assert [len(r.token_ids) for r in generate(rc, 2, 20)] == [20, 20]


def test_every_actor_got_the_launch_secret_so_every_lease_is_signed(rc):
    """The launch handed a secret (the driver's, else a fresh one) to the actors through Ray's
    runtime_env, so each worker signs its registry entry."""
    import msgpack
    import redis

    r = redis.Redis.from_url(rc.cfg.redis_url)
    try:
        keys = r.keys(f"pdserve:{rc.cfg.cluster}:worker:*")
        entries = [msgpack.unpackb(r.get(k)) for k in keys]
    finally:
        r.close()
    assert len(entries) == len(registered(rc)) >= 2
    assert all(set(e) == {"info", "mac"} and len(e["mac"]) == 32 for e in entries)
