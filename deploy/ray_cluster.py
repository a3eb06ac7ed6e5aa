"""Running pdserve on Ray: the driver-side handle that ``pdserve up`` / ``demo`` use (the config is
:mod:`deploy.config`, the actor that hosts one role :mod:`deploy.roles`), and the teardown of
``pdserve down``.

    driver (pdserve up) ──► PoolController  named "pdserve-{cluster}" in namespace "pdserve"
                              ├─ RoleActor(prefill) × N   "pdserve-{cluster}/prefill-1", ... placed by placement.py
                              ├─ RoleActor(decode)  × M
                              └─ RoleActor(router)        "pdserve-{cluster}/router", on the head node
    pdserve scale / down (another driver, ray.init(address=...)) ──► the same named controller

Workers start first and register in Redis; the router starts last, so by the time
``pdserve up`` prints ``router listening on HOST:PORT`` every worker can take traffic.
Every actor gets the cluster secret through Ray's ``runtime_env`` env vars.

A detached cluster (``pdserve up --detach``) outlives its driver::

    local:   ray start --head (own session, private --temp-dir, free ports) ─ connect ─ detached controller
    remote:  connect to --ray-address ─ detached controller
    both:    Redis hash pdserve:{cluster}:launch = {ray_address, router, http, ray_temp_dir if it started the head}
    down:    controller.stop (router, workers, placement groups) ─ kill controller ─ delete pdserve:{cluster}:*
             ─ stop the Ray head if this cluster's up started it and no other pdserve controller is on it
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace

import ray
import redis

from pdserve.deploy.config import (
    NAMESPACE,
    ClusterConfig,
    cluster_keys_pattern,
    controller_name,
    launch_key,
    router_env,
    secret_env,
)
from pdserve.deploy.controller import PoolController
from pdserve.deploy.placement import device_decision
from pdserve.deploy.ray_local import LocalHead, _answers, connect, init_local_ray, start_local_head, stop_local_head


def wait_for_device(cfg: ClusterConfig, resources: Callable[[], dict] = ray.cluster_resources,
                    report: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True),
                    clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                    poll_s: float = 2.0, report_every_s: float = 10.0) -> str:
    """Resolve ``cfg.device`` to ``cuda`` or ``cpu`` for the pools' initial sizes; with ``cuda``, wait up
    to ``cfg.gpu_wait_s`` for the GPU nodes they need to join the Ray cluster, reporting what is missing
    every ``report_every_s`` seconds. ``auto`` on a remote cluster without GPUs reports that the workers
    run on CPUs.

    Raises:
        RuntimeError: ``cuda`` and the GPUs did not join in time (a local Ray never gains GPUs: at once).
    """
    sizes = {"both": cfg.num_colocated} if cfg.num_colocated else {"prefill": cfg.num_prefill,
                                                                   "decode": cfg.num_decode}
    deadline, next_report = clock() + (0.0 if cfg.local else cfg.gpu_wait_s), clock()
    while True:
        decision, missing = device_decision(cfg.device, resources(), sizes, cfg.cpus_per_worker, cfg.separate_nodes)
        if decision != "wait":
            if decision == "cpu" and cfg.device == "auto" and not cfg.local:
                report("no GPU in the Ray cluster: workers run on CPUs (--device cuda waits for GPU nodes)")
            return decision
        left = deadline - clock()
        if left <= 0:
            raise RuntimeError(f"--device cuda: the Ray cluster lacks {missing} for the pools {sizes}"
                               + ("" if cfg.local else f" after waiting {cfg.gpu_wait_s:.0f} s for GPU nodes"))
        if clock() >= next_report:
            report(f"waiting for GPU nodes ({left:.0f} s left): the pools {sizes} need {missing} more")
            next_report = clock() + report_every_s
        sleep(min(poll_s, max(left, 0.0)))


class RayCluster:
    """Driver-side handle: starts Ray (or joins it), the named controller, and through it the
    router and the pools; stops them again."""

    def __init__(self, cfg: ClusterConfig) -> None:
        self.cfg = cfg
        self.controller = None
        self.router_address = ""
        self.http_address = ""  # the router's OpenAI-compatible HTTP API, when the config asks for one
        self.ray_address = ""  # GCS address of the Ray cluster (detached launches)
        self.head: LocalHead | None = None  # the local head this started (detached local launches)
        self._started_ray = False

    def _init_ray(self) -> None:
        cfg = self.cfg
        # room for the pools' upper bound, and for `pdserve scale` to reach 8 workers on one machine
        need = cfg.cpus_per_worker * max(cfg.max_workers, 8) + 1
        num_cpus = cfg.local_num_cpus or max(os.cpu_count() or 1, math.ceil(need))
        # the actors' logs (warnings, retries, failures) reach a terminal that runs `pdserve up`; output
        # piped elsewhere (tests, scripts, a service manager capturing stdout) stays quiet
        quiet = dict(include_dashboard=False, log_to_driver=sys.stdout.isatty(), configure_logging=False)
        if cfg.detach and cfg.local:  # a driver-started local Ray dies with the driver: start a head
            self.head = start_local_head(num_cpus)
            connect(self.head.address, **{k: v for k, v in quiet.items() if k != "include_dashboard"})
        elif cfg.local:
            init_local_ray(num_cpus=num_cpus, **quiet)
        else:
            ray.init(address=cfg.ray_address, **quiet)
        self._started_ray = True
        self.ray_address = ray.get_runtime_context().gcs_address

    def start(self) -> str:
        """Place and start every actor; returns the router's ``host:port``.

        Raises:
            ValueError: a controller of this cluster id is already running.
            RuntimeError: ``device="cuda"`` and the GPUs did not join within ``gpu_wait_s``.
            Exception: an actor failed to start (everything started is stopped again).
        """
        if not ray.is_initialized():
            self._init_ray()
        else:
            self.ray_address = ray.get_runtime_context().gcs_address
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self.router_address

    def _start(self) -> None:
        cfg = self.cfg
        try:
            ray.get_actor(controller_name(cfg.cluster), namespace=NAMESPACE)
        except ValueError:  # no such actor: the id is free
            pass
        else:
            raise ValueError(f"cluster {cfg.cluster!r} is already running on this Ray cluster")
        cfg = self.cfg = replace(cfg, device=wait_for_device(cfg))
        env = secret_env()
        self.controller = ray.remote(PoolController).options(
            name=controller_name(cfg.cluster), namespace=NAMESPACE, num_cpus=0, max_concurrency=64,
            **({"lifetime": "detached"} if cfg.detach else {}),
            runtime_env={"env_vars": env}).remote(cfg, env, router_env())
        self.router_address = ray.get(self.controller.start.remote())
        self.http_address = ray.get(self.controller.info.remote())["http"]
        self._record()

    def _record(self) -> None:
        """Write the launch record ``pdserve status`` lists and ``pdserve down`` reads."""
        client = redis.Redis.from_url(self.cfg.redis_url)
        try:
            client.hset(launch_key(self.cfg.cluster), mapping={
                "cluster": self.cfg.cluster, "router": self.router_address, "http": self.http_address,
                "ray_address": self.ray_address, "ray_temp_dir": self.head.temp_dir if self.head else "",
                "detached": int(self.cfg.detach), "model": self.cfg.model_dir, "started_at": time.time()})
        finally:
            client.close()

    def scale(self, sizes: dict[str, int], remove: tuple[str, ...] = (), drain_timeout_s: float | None = None) -> dict:
        """Resize pools, e.g. ``{"decode": 3}``; see :meth:`deploy.controller.PoolController.scale`."""
        return ray.get(self.controller.scale.remote(sizes, list(remove), drain_timeout_s))

    def detach(self) -> None:
        """Leave a detached cluster running: disconnect this driver only."""
        self.controller = None
        if self._started_ray and ray.is_initialized():
            ray.shutdown()

    def stop(self) -> None:
        """Stop the router first (no new requests), then the workers; shut down a Ray this started."""
        if self.controller is not None:
            try:
                ray.get(self.controller.stop.remote(), timeout=60)
            except Exception:
                pass
            ray.kill(self.controller)
            self.controller = None
            _delete(self.cfg.redis_url, [launch_key(self.cfg.cluster)])
        if self._started_ray and ray.is_initialized() and (self.cfg.local or self.head):
            ray.shutdown()
        if self.head is not None:
            stop_local_head(self.head)
            self.head = None


# ---- pdserve down / status ------------------------------------------------------------------------
def _delete(redis_url: str, keys: list[str]) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        if keys:
            client.delete(*keys)
    except redis.RedisError:
        pass
    finally:
        client.close()


def read_launches(redis_url: str, cluster: str | None = None) -> dict[str, dict[str, str]]:
    """Launch records (``pdserve:{cluster}:launch``) by cluster id: every one, or ``cluster``'s.

    Raises:
        redis.RedisError: Redis is unreachable.
    """
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        keys = [launch_key(cluster)] if cluster else list(client.scan_iter(match=launch_key("*"), count=500))
        out = {}
        for key in keys:
            record = client.hgetall(key)
            if record:
                out[record.get("cluster") or key.split(":")[1]] = record
        return out
    finally:
        client.close()


def delete_cluster_keys(redis_url: str, cluster: str) -> int:
    """Delete every Redis key of ``cluster`` (``pdserve:{cluster}:*``); returns how many."""
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=cluster_keys_pattern(cluster), count=1000))
        for i in range(0, len(keys), 500):
            client.delete(*keys[i:i + 500])
        return len(keys)
    finally:
        client.close()


def cluster_actor_names(cluster: str | None = None) -> list[str]:
    """Names of the live named actors in namespace ``pdserve`` (those of ``cluster`` when given), as a
    driver connected to the Ray cluster sees them."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a.get("namespace") == NAMESPACE]
    if cluster is None:
        return names
    mine = controller_name(cluster)
    return [n for n in names if n == mine or n.startswith(mine + "/")]


def teardown(cluster: str, redis_url: str, ray_address: str | None = None, timeout_s: float = 120.0,
             report: Callable[[str], None] = lambda m: print(m, flush=True)) -> bool:
    """``pdserve down``: drain and remove ``cluster``'s actors (controller stop: router, then workers,
    placement groups freed; then the controller is killed), delete its Redis keys, and stop the local
    Ray head its ``up`` started when no other pdserve cluster is left on it. Returns False when no
    controller of ``cluster`` was found (its Redis keys are deleted all the same).

    Raises:
        RuntimeError: the cluster's actors were still alive after ``timeout_s``.
    """
    record = read_launches(redis_url, cluster).get(cluster, {})
    address = ray_address or record.get("ray_address") or None
    head = LocalHead(address or "", record["ray_temp_dir"]) if record.get("ray_temp_dir") else None
    found, others = False, []
    if address and not _answers(address):
        report(f"no Ray cluster answers at {address}; removing the cluster's Redis keys")
    elif address or head is None:
        try:
            connect(address, log_to_driver=False, configure_logging=False)
        except ConnectionError as exc:  # the Ray cluster is gone: nothing left to stop there
            report(f"no Ray cluster at {address or 'auto'} ({exc}); removing the cluster's Redis keys")
        else:
            try:
                found, others = _stop_actors(cluster, timeout_s, report)
            finally:
                ray.shutdown()
    removed = delete_cluster_keys(redis_url, cluster)
    report(f"removed {removed} Redis key(s) of cluster {cluster}")
    if head is not None and not others:
        n = stop_local_head(head)
        report(f"stopped the local Ray head at {head.address} ({n} process(es))")
    elif head is not None:
        report(f"left the Ray head at {head.address} running: clusters {', '.join(others)} still use it")
    return found


def _stop_actors(cluster: str, timeout_s: float, report: Callable[[str], None]) -> tuple[bool, list[str]]:
    """Stop and kill ``cluster``'s controller; wait until none of its named actors is alive.
    Returns whether the controller was found and the other pdserve clusters (controllers) left."""
    found = False
    try:
        controller = ray.get_actor(controller_name(cluster), namespace=NAMESPACE)
    except ValueError:
        report(f"no controller of cluster {cluster} on this Ray cluster")
    else:
        found = True
        report(f"stopping cluster {cluster}: router, then workers")
        try:
            ray.get(controller.stop.remote(), timeout=timeout_s)
        except Exception as exc:  # stuck or dead: killed below either way (its workers die with it)
            report(f"the controller did not stop cleanly: {exc!r}")
        ray.kill(controller, no_restart=True)
    deadline = time.monotonic() + timeout_s
    while left := cluster_actor_names(cluster):
        if time.monotonic() > deadline:
            raise RuntimeError(f"actors of cluster {cluster} still alive after {timeout_s:.0f} s: {left}")
        for name in left:  # a worker the controller could not stop (e.g. it died first) is owned by nobody now
            try:
                ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
            except ValueError:
                pass
        time.sleep(0.5)
    others = [n[len("pdserve-"):] for n in cluster_actor_names() if "/" not in n and n.startswith("pdserve-")]
    return found, others
