"""Running pdserve on Ray: the cluster config, the actor that hosts one process role, and
the driver-side handle that ``pdserve up`` / ``demo`` use.

    driver (pdserve up) ──► PoolController  named "pdserve-{cluster}" in namespace "pdserve"
                              ├─ RoleActor(prefill) × N   one process each, placed by deploy/placement.py
                              ├─ RoleActor(decode)  × M
                              └─ RoleActor(router)
    pdserve scale / status (another driver, ray.init(address="auto")) ──► the same named controller

Workers start first and register in Redis; the router starts last, so by the time
``pdserve up`` prints ``router listening on HOST:PORT`` every worker can take traffic.
Every actor gets the cluster secret through Ray's ``runtime_env`` env vars.
"""

from __future__ import annotations

import dataclasses
import math
import os
import uuid
from dataclasses import dataclass, field

import ray

from pdserve.cluster.secret import SECRET_ENV, SECRET_FILE_ENV, new_secret
from pdserve.cluster.service import ServiceThread
from pdserve.cluster.worker_process import default_redis_url
from pdserve.deploy.planner import PlannerConfig

NAMESPACE = "pdserve"


def controller_name(cluster: str) -> str:
    """Ray actor name of the controller of ``cluster`` (in namespace ``pdserve``)."""
    return f"pdserve-{cluster}"


@dataclass(frozen=True)
class ClusterConfig:
    """What ``pdserve up`` launches.

    Attributes:
        model_dir: checkpoint directory, readable on every node.
        num_prefill / num_decode: initial pool sizes (disaggregated).
        num_colocated: workers that prefill and decode in one process (the colocated baseline);
            when set, the prefill and decode pools are not started.
        port: router port (0 = pick a free one).
        ray_address: an existing Ray cluster; ``None`` starts a local one.
        cluster: registry namespace in Redis and controller name (default: a fresh id per launch).
        redis_url: the registry.
        block_size, num_blocks, dtype, num_threads: per-worker engine settings.
        cpus_per_worker: Ray CPU resources each worker asks for.
        prefill_options: extra :class:`PrefillWorkerConfig` fields for every prefill worker.
        decode_options: extra :class:`DecodeWorkerConfig` fields for every decode worker
            (``max_batch_size``, ``speculative``, ...).
        router_options: extra :class:`RouterConfig` fields (``admission``, SLO defaults, ...).
        worker_options: extra fields of every worker's config (e.g. ``lease_s``).
        placement_strategy: placement-group strategy of each batch of workers (``PACK``, ``SPREAD``, ...).
        separate_nodes: keep the pools on nodes declaring ``pdserve_prefill_node`` /
            ``pdserve_decode_node``; ``None``: when the Ray cluster declares both.
        max_restarts: times Ray restarts a dead worker or router actor (-1: forever).
        drain_timeout_s: a removed worker's in-flight requests get this long to finish (seconds).
        unroute_s: wait between releasing a removed worker's lease and refusing new RPCs (seconds,
            longer than the routers' registry poll).
        start_timeout_s: a worker must load its model and register within this (seconds).
        placement_timeout_s: a batch of new workers must get its placement group within this
            (seconds; on a cloud cluster Ray's autoscaler may launch nodes meanwhile). A local
            cluster refuses at once when its free resources cannot hold the batch.
        local_num_cpus: CPUs a local Ray declares (default: enough for the pools' upper bounds and
            at least 8 workers; logical CPUs, so a laptop can run a small cluster of 1-thread workers).
        autoscale: run the planner with these bounds (``None``: pools change only by ``pdserve scale``).
    """

    model_dir: str
    num_prefill: int = 1
    num_decode: int = 1
    num_colocated: int = 0
    port: int = 0
    ray_address: str | None = None
    cluster: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    redis_url: str = field(default_factory=default_redis_url)
    block_size: int = 16
    num_blocks: int = 512
    dtype: str = "float32"
    num_threads: int = 1
    cpus_per_worker: float = 1.0
    prefill_options: dict = field(default_factory=dict)
    decode_options: dict = field(default_factory=dict)
    router_options: dict = field(default_factory=dict)
    worker_options: dict = field(default_factory=dict)
    placement_strategy: str = "PACK"
    separate_nodes: bool | None = None
    max_restarts: int = 3
    drain_timeout_s: float = 30.0
    unroute_s: float = 1.0
    start_timeout_s: float = 300.0
    placement_timeout_s: float = 600.0
    local_num_cpus: int | None = None
    autoscale: PlannerConfig | None = None

    def __post_init__(self) -> None:
        if self.num_colocated < 0 or (not self.num_colocated and (self.num_prefill < 1 or self.num_decode < 1)):
            raise ValueError("a cluster needs colocated workers, or at least one prefill and one decode worker")
        if self.cpus_per_worker <= 0:
            raise ValueError(f"cpus_per_worker must be positive, got {self.cpus_per_worker}")
        if self.max_restarts < -1:
            raise ValueError(f"max_restarts must be >= -1, got {self.max_restarts}")
        if min(self.drain_timeout_s, self.start_timeout_s, self.placement_timeout_s) <= 0 or self.unroute_s < 0:
            raise ValueError("drain, start and placement timeouts must be positive, unroute_s >= 0")
        if self.autoscale is not None and self.num_colocated:
            raise ValueError("autoscaling needs the disaggregated pools (not --colocated)")

    @property
    def local(self) -> bool:
        return self.ray_address is None

    @property
    def host(self) -> str:
        """Local clusters bind to loopback; on a Ray cluster each actor binds to its node's IP."""
        return "127.0.0.1" if self.local else "node-ip"

    @property
    def max_workers(self) -> int:
        """Workers the pools can grow to under autoscaling (else their initial size)."""
        if self.autoscale is not None:
            return self.autoscale.max_prefill + self.autoscale.max_decode
        return self.num_colocated or self.num_prefill + self.num_decode


class RoleActor:
    """One process role inside a Ray actor. The service starts in the constructor, so when
    Ray restarts a dead actor (``max_restarts``) it serves and re-registers by itself."""

    def __init__(self, role: str, cfg) -> None:
        if cfg.host == "node-ip":
            cfg = dataclasses.replace(cfg, host=ray.util.get_node_ip_address())
        self.role = role
        self._service = ServiceThread(lambda: _make_service(role, cfg))
        self._address = self._service.start()

    def address(self) -> str:
        """The service's gRPC ``host:port`` (available once the constructor has returned)."""
        return self._address

    def pid(self) -> int:
        """This actor's process id (changes when Ray restarts the actor)."""
        return os.getpid()

    def drain(self, grace_s: float, unroute_s: float) -> None:
        """Leave the cluster, letting in-flight requests finish within ``grace_s`` seconds."""
        self._service.drain(grace_s, unroute_s)

    def stop(self) -> None:
        self._service.stop()


def _make_service(role: str, cfg):
    if role == "prefill":
        from pdserve.prefill_worker.server import PrefillWorker
        return PrefillWorker(cfg)
    if role in ("decode", "both"):
        from pdserve.decode_worker.server import DecodeWorker
        return DecodeWorker(cfg)
    from pdserve.router.server import Router
    return Router(cfg)


def secret_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The cluster-secret env vars every actor gets: the driver's own ``PDSERVE_CLUSTER_SECRET``
    / ``PDSERVE_CLUSTER_SECRET_FILE`` when set, else a fresh secret for this launch."""
    environ = os.environ if environ is None else environ
    given = {k: environ[k] for k in (SECRET_ENV, SECRET_FILE_ENV) if environ.get(k)}
    return given or {SECRET_ENV: new_secret()}


class RayCluster:
    """Driver-side handle: starts Ray (or joins it), the named controller, and through it the
    router and the pools; stops them again."""

    def __init__(self, cfg: ClusterConfig) -> None:
        self.cfg = cfg
        self.controller = None
        self.router_address = ""
        self._started_ray = False

    def start(self) -> str:
        """Place and start every actor; returns the router's ``host:port``.

        Raises:
            ValueError: a controller of this cluster id is already running.
            Exception: an actor failed to start (everything started is stopped again).
        """
        from pdserve.deploy.controller import PoolController

        cfg = self.cfg
        if not ray.is_initialized():
            # room for the pools' upper bound, and for `pdserve scale` to reach 8 workers on one machine
            need = cfg.cpus_per_worker * max(cfg.max_workers, 8) + 1
            local = {"num_cpus": cfg.local_num_cpus or max(os.cpu_count() or 1, math.ceil(need))} if cfg.local else {}
            ray.init(address=cfg.ray_address, include_dashboard=False, log_to_driver=False,
                     configure_logging=False, **local)
            self._started_ray = True
        try:
            ray.get_actor(controller_name(cfg.cluster), namespace=NAMESPACE)
        except ValueError:  # no such actor: the id is free
            pass
        else:
            raise ValueError(f"cluster {cfg.cluster!r} is already running on this Ray cluster")
        env = secret_env()
        self.controller = ray.remote(PoolController).options(
            name=controller_name(cfg.cluster), namespace=NAMESPACE, num_cpus=0, max_concurrency=64,
            runtime_env={"env_vars": env}).remote(cfg, env)
        try:
            self.router_address = ray.get(self.controller.start.remote())
        except Exception:
            self.stop()
            raise
        return self.router_address

    def scale(self, sizes: dict[str, int], remove: tuple[str, ...] = (), drain_timeout_s: float | None = None) -> dict:
        """Resize pools, e.g. ``{"decode": 3}``; see :meth:`deploy.controller.PoolController.scale`."""
        return ray.get(self.controller.scale.remote(sizes, list(remove), drain_timeout_s))

    def stop(self) -> None:
        """Stop the router first (no new requests), then the workers; shut down a Ray this started."""
        if self.controller is not None:
            try:
                ray.get(self.controller.stop.remote(), timeout=60)
            except Exception:
                pass
            ray.kill(self.controller)
            self.controller = None
        if self._started_ray and self.cfg.local and ray.is_initialized():
            ray.shutdown()
