"""Running pdserve on Ray: the driver-side handle that ``pdserve up`` / ``demo`` use (the config is
:mod:`deploy.config`, the actor that hosts one role :mod:`deploy.roles`).

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

import math
import os
import sys

import ray

from pdserve.deploy.config import NAMESPACE, ClusterConfig, controller_name, router_env, secret_env
from pdserve.deploy.controller import PoolController


class RayCluster:
    """Driver-side handle: starts Ray (or joins it), the named controller, and through it the
    router and the pools; stops them again."""

    def __init__(self, cfg: ClusterConfig) -> None:
        self.cfg = cfg
        self.controller = None
        self.router_address = ""
        self.http_address = ""  # the router's OpenAI-compatible HTTP API, when the config asks for one
        self._started_ray = False

    def start(self) -> str:
        """Place and start every actor; returns the router's ``host:port``.

        Raises:
            ValueError: a controller of this cluster id is already running.
            Exception: an actor failed to start (everything started is stopped again).
        """
        cfg = self.cfg
        if not ray.is_initialized():
            # room for the pools' upper bound, and for `pdserve scale` to reach 8 workers on one machine
            need = cfg.cpus_per_worker * max(cfg.max_workers, 8) + 1
            local = {"num_cpus": cfg.local_num_cpus or max(os.cpu_count() or 1, math.ceil(need))} if cfg.local else {}
            # the actors' logs (warnings, retries, failures) reach a terminal that runs `pdserve up`; output
            # piped elsewhere (tests, scripts, a service manager capturing stdout) stays quiet
            ray.init(address=cfg.ray_address, include_dashboard=False, log_to_driver=sys.stdout.isatty(),
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
            runtime_env={"env_vars": env}).remote(cfg, env, router_env())
        try:
            self.router_address = ray.get(self.controller.start.remote())
            self.http_address = ray.get(self.controller.info.remote())["http"]
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
