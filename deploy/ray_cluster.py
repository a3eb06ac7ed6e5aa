"""Placing the router and the worker pools on Ray.

Each process role runs inside a Ray actor (its own process) on a background
event loop. Workers ask Ray for one GPU each when CUDA is present, CPUs
otherwise; the router asks for a small CPU share. Workers start first and
register in Redis; the router starts last, so by the time ``pdserve up`` prints
``router listening on HOST:PORT`` every worker can take traffic.
"""

from __future__ import annotations

import dataclasses
import math
import os
import uuid
from dataclasses import dataclass, field

import ray

from decode_worker.config import DecodeWorkerConfig
from deploy.service import ServiceThread
from deploy.worker_process import default_redis_url
from prefill_worker.config import PrefillWorkerConfig
from router.config import RouterConfig


@dataclass(frozen=True)
class ClusterConfig:
    """What ``pdserve up`` launches.

    Attributes:
        model_dir: checkpoint directory, readable on every node.
        num_prefill / num_decode: pool sizes (disaggregated).
        num_colocated: workers that prefill and decode in one process (the colocated baseline);
            when set, the prefill and decode pools are not started.
        port: router port (0 = pick a free one).
        ray_address: an existing Ray cluster; ``None`` starts a local one.
        cluster: registry namespace in Redis (default: a fresh id per launch).
        redis_url: the registry.
        block_size, num_blocks, dtype, num_threads: per-worker engine settings.
        cpus_per_worker: Ray CPU resources each worker asks for (without CUDA).
        prefill_options: extra :class:`PrefillWorkerConfig` fields for every prefill worker.
        decode_options: extra :class:`DecodeWorkerConfig` fields for every decode worker
            (``max_batch_size``, ``speculative``, ...).
        router_options: extra :class:`RouterConfig` fields (``admission``, SLO defaults, ...).
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

    def __post_init__(self) -> None:
        if self.num_colocated < 0 or (not self.num_colocated and (self.num_prefill < 1 or self.num_decode < 1)):
            raise ValueError("a cluster needs colocated workers, or at least one prefill and one decode worker")
        if self.cpus_per_worker <= 0:
            raise ValueError(f"cpus_per_worker must be positive, got {self.cpus_per_worker}")

    @property
    def local(self) -> bool:
        return self.ray_address is None

    @property
    def host(self) -> str:
        """Local clusters bind to loopback; on a Ray cluster each actor binds to its node's IP."""
        return "127.0.0.1" if self.local else "node-ip"


class RoleActor:
    """One process role inside a Ray actor."""

    def __init__(self, role: str, cfg) -> None:
        if cfg.host == "node-ip":
            cfg = dataclasses.replace(cfg, host=ray.util.get_node_ip_address())
        self._service = ServiceThread(lambda: _make_service(role, cfg))

    def start(self) -> str:
        return self._service.start()

    def stop(self) -> None:
        self._service.stop()


def _make_service(role: str, cfg):
    if role == "prefill":
        from prefill_worker.server import PrefillWorker
        return PrefillWorker(cfg)
    if role == "decode":
        from decode_worker.server import DecodeWorker
        return DecodeWorker(cfg)
    from router.server import Router
    return Router(cfg)


def worker_resources(cpus: float, cuda: bool) -> dict[str, float]:
    """Ray resources of one worker actor: one GPU when CUDA is present, else ``cpus`` CPUs."""
    return {"num_cpus": 1.0, "num_gpus": 1.0} if cuda else {"num_cpus": cpus, "num_gpus": 0.0}


class RayCluster:
    """Starts and stops a router plus prefill and decode pools on Ray."""

    ROUTER_CPUS = 0.25

    def __init__(self, cfg: ClusterConfig) -> None:
        self.cfg = cfg
        self._actors: list = []
        self.router_address = ""

    def start(self) -> str:
        """Place and start every actor; returns the router's ``host:port``.

        Raises:
            Exception: an actor failed to start (everything started is stopped again).
        """
        import torch

        cfg = self.cfg
        cuda = torch.cuda.is_available()
        if not ray.is_initialized():
            need = cfg.cpus_per_worker * (cfg.num_colocated or cfg.num_prefill + cfg.num_decode) + self.ROUTER_CPUS
            local_cpus = {"num_cpus": max(os.cpu_count() or 1, math.ceil(need))} if cfg.local else {}
            ray.init(address=cfg.ray_address, include_dashboard=False, log_to_driver=False,
                     configure_logging=False, **local_cpus)
        common = dict(model_dir=cfg.model_dir, cluster=cfg.cluster, redis_url=cfg.redis_url, host=cfg.host,
                      block_size=cfg.block_size, num_blocks=cfg.num_blocks, dtype=cfg.dtype,
                      num_threads=cfg.num_threads)
        if cfg.num_colocated:
            specs = [("decode", DecodeWorkerConfig(worker_id=f"both-{i}", colocated=True, **common,
                                                   **cfg.decode_options)) for i in range(cfg.num_colocated)]
        else:
            specs = [("prefill", PrefillWorkerConfig(worker_id=f"prefill-{i}", **common, **cfg.prefill_options))
                     for i in range(cfg.num_prefill)]
            specs += [("decode", DecodeWorkerConfig(worker_id=f"decode-{i}", **common, **cfg.decode_options))
                      for i in range(cfg.num_decode)]
        actor_cls = ray.remote(RoleActor)
        try:
            workers = [actor_cls.options(**worker_resources(cfg.cpus_per_worker, cuda)).remote(role, wcfg)
                       for role, wcfg in specs]
            self._actors += workers
            ray.get([a.start.remote() for a in workers])
            router = actor_cls.options(num_cpus=self.ROUTER_CPUS).remote("router", RouterConfig(
                model_dir=cfg.model_dir, cluster=cfg.cluster, redis_url=cfg.redis_url, host=cfg.host, port=cfg.port,
                **cfg.router_options))
            self._actors.append(router)
            self.router_address = ray.get(router.start.remote())
        except Exception:
            self.stop()
            raise
        return self.router_address

    def stop(self) -> None:
        """Stop the router first (no new requests), then the workers; shut down a local Ray."""
        for actor in reversed(self._actors):
            try:
                ray.get(actor.stop.remote(), timeout=30)
            except Exception:
                pass
            ray.kill(actor)
        self._actors.clear()
        if self.cfg.local and ray.is_initialized():
            ray.shutdown()
