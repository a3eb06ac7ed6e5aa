"""The process roles on Ray: :class:`RoleActor` hosts one router, prefill worker or decode worker
in a Ray actor (placed by deploy/placement.py, owned by deploy/controller.py)."""

from __future__ import annotations

import dataclasses
import os

import ray

from pdserve.cluster.service import ServiceThread


class RoleActor:
    """One process role inside a Ray actor. The service starts in the constructor, so when
    Ray restarts a dead actor (``max_restarts``) it serves and re-registers by itself."""

    def __init__(self, role: str, cfg) -> None:
        if cfg.host == "node-ip":
            cfg = dataclasses.replace(cfg, host=ray.util.get_node_ip_address())
        if getattr(cfg, "http_host", None) == "node-ip":  # the router's HTTP API
            cfg = dataclasses.replace(cfg, http_host=ray.util.get_node_ip_address())
        self.role = role
        self._served = None
        self._service = ServiceThread(lambda: self._keep(_make_service(role, cfg)))
        self._address = self._service.start()

    def _keep(self, service):
        self._served = service
        return service

    def address(self) -> str:
        """The service's gRPC ``host:port`` (available once the constructor has returned)."""
        return self._address

    def http_address(self) -> str:
        """The router's OpenAI-compatible HTTP API ``host:port`` ("" for workers, or a router without one)."""
        return getattr(self._served, "http_address", "")

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
