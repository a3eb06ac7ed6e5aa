"""The pool controller: one named Ray actor per cluster that owns the router and the pools.

It runs as an async actor named ``pdserve-{cluster}`` in namespace ``pdserve``, so any driver
attached to the Ray cluster (``pdserve scale``, ``pdserve down``) can find it; with ``detach`` it is a
detached actor and outlives the driver that made it. The router and worker actors it creates
(named ``pdserve-{cluster}/router``, ``pdserve-{cluster}/prefill-1``, ...) are owned by it: they die
with it, and Ray restarts one that dies alone (``max_restarts``). The router is pinned to the head
node, or the node ``router_node`` names, so its address is stable.

Scale-up of a pool by k::

    check free Ray resources ─ reserve a placement group of k bundles (all or nothing)
      ─ k RoleActors: load model ─ gRPC up ─ Redis lease (only now do routers see them)

Scale-down by k (least loaded first, newest on ties)::

    leave the pool ─ drain (release lease, wait unroute_s, in-flight RPCs get drain_timeout_s)
      ─ kill the actor (its KV pool goes with the process) ─ free its bundle

With ``autoscale`` set, a loop feeds :func:`deploy.planner.plan` one window at a time and
applies its actions through the same two paths.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from pdserve.cluster.secret import cluster_secret
from pdserve.deploy.config import NAMESPACE, ClusterConfig, actor_name
from pdserve.deploy.placement import Placement, cluster_has_pool_resources, router_node_id
from pdserve.deploy.planner import Action, PlannerConfig, PlannerState, Window, plan
from pdserve.deploy.roles import RoleActor

log = logging.getLogger(__name__)

ROUTER_CPUS = 0.25


@dataclass
class _Worker:
    worker_id: str
    role: str
    actor: ray.actor.ActorHandle
    group: PlacementGroup
    seq: int  # creation order: higher is newer


class PoolController:
    """Owns a cluster's router and worker pools; see the module docstring.

    Args:
        cfg: the cluster to run.
        env: env vars every actor gets (the cluster secret).
        router_env: env vars only the router gets besides (its bearer token, :func:`deploy.config.router_env`).
    """

    def __init__(self, cfg: ClusterConfig, env: dict[str, str], router_env: dict[str, str] | None = None) -> None:
        self.cfg, self._env, self._router_env = cfg, env, dict(router_env or {})
        self._secret = cluster_secret()  # this actor's copy, from env: verifies the registry entries it reads
        self.workers: dict[str, _Worker] = {}
        self.router = None
        self.router_address = ""
        self.http_address = ""  # the router's OpenAI-compatible HTTP API ("" without one)
        self.placement: Placement | None = None
        self.decisions: deque[tuple[float, str, int, str]] = deque(maxlen=20)  # (unix time, role, delta, reason)
        self._groups: Counter = Counter()  # placement group id -> live workers in it
        self._seq = 0
        self._lock = asyncio.Lock()
        self._planner: asyncio.Task | None = None

    @property
    def roles(self) -> tuple[str, ...]:
        """The pools this cluster has: ``prefill`` and ``decode``, or ``both`` (colocated)."""
        return ("both",) if self.cfg.num_colocated else ("prefill", "decode")

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> str:
        """Start the pools, then the router; returns the router's ``host:port`` (its HTTP API's, when
        ``router_options`` asks for one with ``http_port``, is then in :attr:`http_address`).

        Raises:
            RuntimeError: not enough Ray resources, or a worker did not start in time.
        """
        cfg, total = self.cfg, ray.cluster_resources()
        separate = cluster_has_pool_resources(total) if cfg.separate_nodes is None else cfg.separate_nodes
        # the driver resolved "cuda" (after waiting for GPU nodes) or "cpu"; "auto" decides here
        cuda = {"cuda": True, "cpu": False}.get(cfg.device, total.get("GPU", 0) > 0)
        self.placement = Placement(cuda=cuda, cpus_per_worker=cfg.cpus_per_worker,
                                   separate_nodes=separate, strategy=cfg.placement_strategy)
        sizes = {"both": cfg.num_colocated} if cfg.num_colocated else {"prefill": cfg.num_prefill,
                                                                       "decode": cfg.num_decode}
        async with self._lock:
            await asyncio.gather(*(self._add(role, n) for role, n in sizes.items()))
        node = router_node_id(ray.nodes(), cfg.router_node)  # the head (or --router-node): a stable address
        pin = {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)} if node else {}
        self.router = ray.remote(RoleActor).options(
            name=actor_name(cfg.cluster, "router"), namespace=NAMESPACE, **pin,
            num_cpus=ROUTER_CPUS, max_restarts=cfg.max_restarts,
            runtime_env={"env_vars": {**self._env, **self._router_env}}).remote(
            "router", cfg.router_config())
        self.router_address = await self.router.address.remote()
        self.http_address = await self.router.http_address.remote()
        if cfg.autoscale is not None:
            self._planner = asyncio.create_task(self._autoscale_loop())
        return self.router_address

    async def stop(self) -> None:
        """Stop the planner, the router (no new requests), then every worker; free the reservations."""
        if self._planner is not None:
            self._planner.cancel()
        if self.router is not None:
            await self._stop_actor(self.router)
            self.router = None
        async with self._lock:
            workers, self.workers = list(self.workers.values()), {}
            await asyncio.gather(*(self._stop_actor(w.actor) for w in workers))
            for w in workers:
                self._release(w)

    # ---- scaling -------------------------------------------------------------------------
    async def scale(self, sizes: dict[str, int], remove: tuple[str, ...] | list[str] = (),
                    drain_timeout_s: float | None = None) -> dict:
        """Set pool sizes, e.g. ``{"prefill": 2, "decode": 3}``; pools not named keep their size.
        Removals run first (they free resources), then additions.

        Args:
            remove: worker ids to drain first when a pool shrinks (e.g. a worker on a bad node);
                the rest are chosen least loaded, newest on ties.
            drain_timeout_s: override of the cluster's drain timeout for this call (seconds).

        Returns:
            ``{"added": [worker ids], "removed": [worker ids], "pools": {role: [worker ids]}}``.
        Raises:
            ValueError: unknown pool, a size below 1, an unknown worker in ``remove`` or one that
                its pool's new size would not remove, a non-positive drain timeout.
            RuntimeError: not enough Ray resources, or a new worker did not start (nothing is left behind).
        """
        for role, n in sizes.items():
            if role not in self.roles:
                raise ValueError(f"this cluster's pools are {list(self.roles)}, not {role!r}")
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"a pool needs at least one worker, got {role}={n!r}")
        if drain_timeout_s is not None and not drain_timeout_s > 0:
            raise ValueError(f"drain_timeout_s must be positive, got {drain_timeout_s}")
        async with self._lock:
            pools = self.pools()
            for wid in remove:
                w = self.workers.get(wid)
                if w is None:
                    raise ValueError(f"no worker {wid!r} in this cluster (workers: {sorted(self.workers)})")
                shrink = len(pools[w.role]) - sizes.get(w.role, len(pools[w.role]))
                if sum(self.workers[i].role == w.role for i in remove) > max(shrink, 0):
                    raise ValueError(f"removing {wid!r} needs --{w.role} below {len(pools[w.role])}")
            removed = [wid for role, n in sizes.items() if n < len(pools[role])
                       for wid in await self._remove(role, len(pools[role]) - n, list(remove), drain_timeout_s)]
            added = [wid for role, n in sizes.items() if n > len(pools[role])
                     for wid in await self._add(role, n - len(pools[role]))]
        return {"added": added, "removed": removed, "pools": self.pools()}

    def pools(self) -> dict[str, list[str]]:
        """Worker ids per pool, oldest first."""
        out: dict[str, list[str]] = {role: [] for role in self.roles}
        for w in sorted(self.workers.values(), key=lambda w: w.seq):
            out[w.role].append(w.worker_id)
        return out

    async def worker_pids(self) -> dict[str, int]:
        """Process id of each live worker actor (a worker being restarted is left out)."""
        ids = list(self.workers)
        pids = await asyncio.gather(*(self.workers[i].actor.pid.remote() for i in ids), return_exceptions=True)
        return {i: p for i, p in zip(ids, pids) if isinstance(p, int)}

    def info(self) -> dict:
        """Router address (gRPC; ``http``: its HTTP API, "" without one), pools, placement and the planner's
        recent decisions."""
        p = self.placement
        return {"cluster": self.cfg.cluster, "router": self.router_address, "http": self.http_address,
                "pools": self.pools(),
                "placement": None if p is None else {"cuda": p.cuda, "separate_nodes": p.separate_nodes,
                                                     "strategy": p.strategy},
                "decisions": list(self.decisions)}

    async def _add(self, role: str, n: int) -> list[str]:
        """Start ``n`` workers of ``role`` in one placement group; all start or none is left."""
        bundles, strategy = self.placement.bundles(role, n)
        free = ray.available_resources()
        if self.cfg.local and self.placement.num_fit(role, free) < n:  # (a cloud cluster may add nodes)
            raise RuntimeError(f"not enough free Ray resources for {n} more {role} worker(s): each needs "
                               f"{self.placement.worker_demand(role)}, free {_short(free)}")
        group = placement_group(bundles, strategy=strategy)
        actors = []
        try:
            await asyncio.wait_for(group.ready(), timeout=self.cfg.placement_timeout_s)
            ids = []
            for i in range(n):
                self._seq += 1
                ids.append(f"{role}-{self._seq}")
                actors.append(ray.remote(RoleActor).options(
                    name=actor_name(self.cfg.cluster, ids[-1]), namespace=NAMESPACE,
                    **self.placement.actor_options(role), max_restarts=self.cfg.max_restarts,
                    runtime_env={"env_vars": self._env},
                    scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
                ).remote(role, self.cfg.worker_config(role, ids[-1], "cuda" if self.placement.cuda else "cpu")))
            await asyncio.wait_for(asyncio.gather(*(a.address.remote() for a in actors)), self.cfg.start_timeout_s)
        except BaseException as exc:
            for a in actors:
                ray.kill(a, no_restart=True)
            remove_placement_group(group)
            if isinstance(exc, asyncio.TimeoutError):
                raise RuntimeError(f"{n} {role} worker(s) were not placed and serving within the timeout "
                                   f"(bundles {bundles}, strategy {strategy})") from None
            raise
        for wid, actor in zip(ids, actors):
            self.workers[wid] = _Worker(wid, role, actor, group, int(wid.rsplit("-", 1)[1]))
            self._groups[group.id] += 1
        return ids

    async def _remove(self, role: str, n: int, prefer: list[str], drain_timeout_s: float | None) -> list[str]:
        """Drain ``n`` workers of ``role``: those in ``prefer``, then the least loaded (registry),
        the newest on ties."""
        from pdserve.cluster.registry import RegistryReader

        reader = RegistryReader(self.cfg.redis_url, self.cfg.cluster, secret=self._secret)
        try:
            load = {w.worker_id: w.num_running + w.num_waiting for w in await reader.list_workers()}
        finally:
            await reader.close()
        pool = [w for w in self.workers.values() if w.role == role]
        victims = sorted(pool, key=lambda w: (w.worker_id not in prefer, load.get(w.worker_id, -1), -w.seq))[:n]
        for w in victims:  # out of the pool at once: status and the planner stop counting it
            del self.workers[w.worker_id]
        grace = drain_timeout_s or self.cfg.drain_timeout_s
        results: list = [None] * len(victims)
        try:
            results = await asyncio.gather(
                *(asyncio.wait_for(w.actor.drain.remote(grace, self.cfg.unroute_s), self.cfg.unroute_s + grace + 60)
                  for w in victims), return_exceptions=True)
        finally:  # also when cancelled (controller stopping): the victims are out of self.workers already
            for w, result in zip(victims, results):
                if isinstance(result, BaseException):
                    log.warning("worker %s did not drain cleanly: %r", w.worker_id, result)
                ray.kill(w.actor, no_restart=True)
                self._release(w)
        return [w.worker_id for w in victims]

    def _release(self, w: _Worker) -> None:
        self._groups[w.group.id] -= 1
        if self._groups[w.group.id] <= 0:
            del self._groups[w.group.id]
            remove_placement_group(w.group)

    async def _stop_actor(self, actor) -> None:
        try:
            await asyncio.wait_for(actor.stop.remote(), 30)
        except BaseException as exc:  # already dead or stuck: killed below either way
            log.warning("actor did not stop cleanly: %r", exc)
        ray.kill(actor, no_restart=True)

    # ---- autoscaling ---------------------------------------------------------------------
    async def observe(self, window_s: float = 60.0) -> Window:
        """One planner window from Redis (attainment counters of the last ``window_s`` seconds,
        worker load) and Ray (free resources)."""
        from pdserve.cluster.registry import RegistryReader
        from pdserve.router.admission import Admission

        admission, reader = Admission(self.cfg.redis_url, self.cfg.cluster), RegistryReader(
            self.cfg.redis_url, self.cfg.cluster, secret=self._secret)
        try:
            a = await admission.attainment(window_s)
            registered = await reader.list_workers()
        finally:
            await admission.aclose()
            await reader.close()
        load = Counter()
        for w in registered:
            if w.worker_id in self.workers:
                load[w.role] += w.num_running + w.num_waiting
        pools, free = self.pools(), ray.available_resources()
        return Window(now=time.monotonic(), finished=a["finished"], met_ttft=a["met_ttft"], met_tpot=a["met_tpot"],
                      rejected_ttft=a.get("rejected_ttft", 0), rejected_tpot=a.get("rejected_tpot", 0),
                      num_prefill=len(pools.get("prefill", [])), num_decode=len(pools.get("decode", [])),
                      prefill_load=load["prefill"], decode_load=load["decode"],
                      fit_prefill=self.placement.num_fit("prefill", free),
                      fit_decode=self.placement.num_fit("decode", free))

    async def apply(self, action: Action) -> None:
        """Carry out one planner action (+1 / -1 worker)."""
        self.decisions.append((time.time(), action.role, action.delta, action.reason))
        size = len(self.pools()[action.role]) + action.delta
        if size >= 1:
            await self.scale({action.role: size})

    async def autoscale_step(self, planner: PlannerConfig, state: PlannerState) -> tuple[Action | None, PlannerState]:
        """One planner window: observe, :func:`~deploy.planner.plan`, apply. Returns the action
        taken (or ``None``) and the state for the next window."""
        action, state = plan(planner, state, await self.observe(planner.window_s))
        if action is not None:
            log.warning("autoscale: %s %+d (%s)", action.role, action.delta, action.reason)
            await self.apply(action)
        return action, state

    async def _autoscale_loop(self) -> None:
        state = PlannerState()
        while True:
            await asyncio.sleep(self.cfg.autoscale.window_s)
            try:
                _, state = await self.autoscale_step(self.cfg.autoscale, state)
            except Exception as exc:  # Redis or Ray hiccup: try again next window
                log.warning("autoscale window failed: %r", exc)


def _short(resources: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 2) for k, v in resources.items() if not k.startswith(("node:", "memory", "object_store"))}
