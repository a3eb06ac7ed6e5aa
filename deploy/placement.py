"""Where Ray puts each worker: actor resources and placement-group bundles per pool.

One worker = one Ray actor = one process. On CUDA each worker asks for exactly one GPU
(Ray sets ``CUDA_VISIBLE_DEVICES`` per actor, so two workers never share a GPU, and a
prefill and a decode worker on the same node land on different GPUs). Without CUDA a
worker asks for CPUs only.

Pool separation across nodes uses custom node resources, declared by the cluster configs
(``deploy/ray/cluster.yaml``, ``deploy/kuberay/raycluster.yaml``) as one unit per GPU::

    prefill node:  {"GPU": 8, "pdserve_prefill_node": 8}     decode node:  {"GPU": 8, "pdserve_decode_node": 8}
    prefill worker asks {"GPU": 1, "pdserve_prefill_node": 1}, so it can only land on a prefill node.

The workers added together (a pool at ``pdserve up``, a batch at ``pdserve scale``) are
reserved as one placement group with one bundle per worker, so a batch is placed whole or
not at all (no half-started pool holding GPUs). ``PACK`` puts a batch on as few nodes as
possible (whole nodes stay free for the other pool); ``SPREAD`` / ``STRICT_SPREAD`` spread
it for fault isolation. This follows Ray Serve's per-deployment bundles and vLLM's
one-bundle-per-GPU-worker placement groups.
"""

from __future__ import annotations

from dataclasses import dataclass

POOL_RESOURCE = {"prefill": "pdserve_prefill_node", "decode": "pdserve_decode_node", "both": "pdserve_decode_node"}
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True)
class Placement:
    """How workers are placed; one per cluster.

    Attributes:
        cuda: one GPU per worker (else CPUs only).
        cpus_per_worker: Ray CPUs each worker reserves (with CUDA: its host-side threads).
        separate_nodes: ask for the pool's custom node resource (``pdserve_prefill_node`` /
            ``pdserve_decode_node``, one unit per worker), keeping the pools on their own nodes.
            Only set it when the cluster declares those resources, else nothing can be placed.
        strategy: placement-group strategy of a batch of workers of one pool.
    """

    cuda: bool = False
    cpus_per_worker: float = 1.0
    separate_nodes: bool = False
    strategy: str = "PACK"

    def __post_init__(self) -> None:
        if self.cpus_per_worker <= 0:
            raise ValueError(f"cpus_per_worker must be positive, got {self.cpus_per_worker}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")

    def worker_demand(self, role: str) -> dict[str, float]:
        """Ray resources of one worker of ``role`` (``prefill``, ``decode`` or ``both``), in
        bundle notation (``CPU``, ``GPU``, custom names).

        Raises:
            ValueError: unknown role.
        """
        if role not in POOL_RESOURCE:
            raise ValueError(f"role must be one of {sorted(POOL_RESOURCE)}, got {role!r}")
        demand = {"CPU": float(self.cpus_per_worker)}
        if self.cuda:
            demand["GPU"] = 1.0
        if self.separate_nodes:
            demand[POOL_RESOURCE[role]] = 1.0
        return demand

    def actor_options(self, role: str) -> dict:
        """``ActorClass.options(**...)`` keyword arguments for one worker of ``role`` (without
        a placement group: the caller adds ``scheduling_strategy`` when it reserved one)."""
        demand = self.worker_demand(role)
        custom = {k: v for k, v in demand.items() if k not in ("CPU", "GPU")}
        options = {"num_cpus": demand["CPU"], "num_gpus": demand.get("GPU", 0.0)}
        if custom:
            options["resources"] = custom
        return options

    def bundles(self, role: str, num_workers: int) -> tuple[list[dict[str, float]], str]:
        """Placement-group bundles (one per worker) and strategy for ``num_workers`` workers of ``role``.

        Raises:
            ValueError: ``num_workers`` < 1 or unknown role.
        """
        if num_workers < 1:
            raise ValueError(f"a placement group needs at least one worker, got {num_workers}")
        return [self.worker_demand(role) for _ in range(num_workers)], self.strategy

    def num_fit(self, role: str, available: dict[str, float]) -> int:
        """How many more workers of ``role`` the free resources ``available`` (as
        ``ray.available_resources()`` reports them) could hold, ignoring fragmentation across nodes."""
        return min(int((available.get(k, 0.0) + 1e-9) // v) for k, v in self.worker_demand(role).items())


def cluster_has_pool_resources(total: dict[str, float]) -> bool:
    """True when the Ray cluster declares both pool node resources (``ray.cluster_resources()``)."""
    return POOL_RESOURCE["prefill"] in total and POOL_RESOURCE["decode"] in total


def pool_demand(placement: Placement, sizes: dict[str, int]) -> dict[str, float]:
    """Total Ray resources ``sizes`` workers per pool (e.g. ``{"prefill": 2, "decode": 2}``) ask for."""
    total: dict[str, float] = {}
    for role, n in sizes.items():
        for k, v in placement.worker_demand(role).items():
            total[k] = total.get(k, 0.0) + v * n
    return total


def missing_resources(demand: dict[str, float], total: dict[str, float]) -> dict[str, float]:
    """What ``total`` (``ray.cluster_resources()``) lacks to hold ``demand`` ({} when it holds it)."""
    return {k: round(v - total.get(k, 0.0), 3) for k, v in demand.items() if total.get(k, 0.0) + 1e-9 < v}


def device_decision(device: str, total: dict[str, float], sizes: dict[str, int], cpus_per_worker: float = 1.0,
                    separate_nodes: bool | None = None) -> tuple[str, dict[str, float]]:
    """Whether the pools start on ``cuda`` or ``cpu`` now, or must ``wait`` for GPU nodes to join.

    Args:
        device: ``cpu`` (never waits), ``auto`` (CUDA when ``total`` has any GPU, else CPU; never
            waits), or ``cuda`` (wait until ``total`` holds one GPU per worker, and with separate pool
            nodes the pool's node resource per worker).
        total: the Ray cluster's resources (``ray.cluster_resources()``).
        sizes: workers per pool to start.
        separate_nodes: as :attr:`ClusterConfig.separate_nodes`; ``None``: separate as soon as the
            cluster declares either pool resource (the other pool's nodes may not have joined yet).
    Returns:
        ``(decision, missing)``: ``missing`` is what the cluster lacks when the decision is ``wait``.
    Raises:
        ValueError: unknown device.
    """
    if device == "cpu":
        return "cpu", {}
    if device == "auto":
        return ("cuda" if total.get("GPU", 0.0) > 0 else "cpu"), {}
    if device != "cuda":
        raise ValueError(f"device must be auto, cuda or cpu, got {device!r}")
    separate = any(r in total for r in POOL_RESOURCE.values()) if separate_nodes is None else separate_nodes
    placement = Placement(cuda=True, cpus_per_worker=cpus_per_worker, separate_nodes=separate)
    missing = missing_resources(pool_demand(placement, sizes), total)
    return ("wait", missing) if missing else ("cuda", {})


HEAD_RESOURCE = "node:__internal_head__"  # Ray declares it on the head node only


def router_node_id(nodes: list[dict], router_node: str | None = None) -> str | None:
    """Ray node id the router is pinned to (``NodeAffinitySchedulingStrategy``): the live node whose
    IP is ``router_node``, else the head node (``None`` when no live node declares itself head).

    Args:
        nodes: ``ray.nodes()`` (``NodeID``, ``Alive``, ``NodeManagerAddress``, ``Resources``).
    Raises:
        ValueError: no live node has IP ``router_node``.
    """
    alive = [n for n in nodes if n.get("Alive")]
    if router_node:
        for n in alive:
            if n.get("NodeManagerAddress") == router_node:
                return n["NodeID"]
        ips = sorted(n.get("NodeManagerAddress", "?") for n in alive)
        raise ValueError(f"no live Ray node at {router_node} for the router (nodes: {', '.join(ips) or 'none'})")
    return next((n["NodeID"] for n in alive if HEAD_RESOURCE in n.get("Resources", {})), None)
