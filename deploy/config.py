"""The embedded model, what ``pdserve up`` launches (:class:`ClusterConfig`, the pool controller's one config), the Ray
names of a cluster's controller, and the cluster-secret env vars every actor gets."""

from __future__ import annotations

import math
import os
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.cluster.args import check_port, check_redis_url, check_seconds, default_redis_url
from pdserve.cluster.secret import SECRET_ENV, SECRET_FILE_ENV, new_secret
from pdserve.deploy.planner import PlannerConfig
from pdserve.model.config import ModelConfig, check_max_model_len
from pdserve.router.config import TOKEN_ENV

EMBEDDED_MODEL = str(Path(__file__).resolve().parent.parent / "assets" / "models" / "tinystories-656k")
"""The checkpoint that ships with pdserve (TinyStories-656K; ``pdserve demo`` serves it)."""

NAMESPACE = "pdserve"
DEVICES = ("auto", "cuda", "cpu")
_CLUSTER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def controller_name(cluster: str) -> str:
    """Ray actor name of the controller of ``cluster`` (in namespace ``pdserve``)."""
    return f"pdserve-{cluster}"


def actor_name(cluster: str, member: str) -> str:
    """Ray actor name of the router (``member`` = ``router``) or a worker (its worker id) of ``cluster``,
    in namespace ``pdserve``: ``pdserve-{cluster}/{member}`` (a controller's name has no ``/``)."""
    return f"{controller_name(cluster)}/{member}"


def cluster_keys_pattern(cluster: str) -> str:
    """Redis SCAN pattern of every key of ``cluster`` (registry leases, KV event streams and snapshots,
    admission and SLO keys, the launch record): all live under ``pdserve:{cluster}:``."""
    return f"pdserve:{cluster}:*"


def launch_key(cluster: str) -> str:
    """Redis hash ``pdserve up`` writes for a running cluster (Ray address, router and HTTP addresses,
    the local Ray head it started, if any); ``pdserve status`` lists these, ``pdserve down`` reads one."""
    return f"pdserve:{cluster}:launch"


@dataclass(frozen=True)
class ClusterConfig:
    """The embedded model, what ``pdserve up`` launches.

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
        max_model_len: the context the router and every worker serve, in tokens (``--max-model-len``; 0: the
            checkpoint's ``max_position_embeddings``).
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
        detach: the controller is a detached Ray actor: the cluster outlives the driver (``pdserve up
            --detach``) until ``pdserve down``. The router and workers are named actors owned by it.
        device: ``cuda`` (one GPU per worker; wait up to ``gpu_wait_s`` for GPU nodes to join), ``cpu``, or
            ``auto`` (CUDA when the Ray cluster has a GPU when the pools start).
        gpu_wait_s: with ``device="cuda"``, how long to wait for the GPUs the pools need (seconds).
        router_node: IP of the Ray node the router runs on (``None``: the head node), so clients
            have a stable address.
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
    max_model_len: int = 0
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
    detach: bool = False
    device: str = "auto"
    gpu_wait_s: float = 600.0
    router_node: str | None = None

    def __post_init__(self) -> None:
        if not _CLUSTER_ID.fullmatch(self.cluster):
            raise ValueError(f"a cluster id is 1-64 letters, digits, '_', '.' or '-' (not first), got {self.cluster!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.gpu_wait_s < 0:
            raise ValueError(f"gpu_wait_s must be >= 0, got {self.gpu_wait_s}")
        if self.num_colocated < 0 or (not self.num_colocated and (self.num_prefill < 1 or self.num_decode < 1)):
            raise ValueError("a cluster needs colocated workers, or at least one prefill and one decode worker")
        if not (math.isfinite(self.cpus_per_worker) and self.cpus_per_worker > 0):
            raise ValueError(f"cpus_per_worker must be a finite positive number, got {self.cpus_per_worker}")
        check_port("port", self.port)
        check_redis_url("redis_url", self.redis_url)
        for name in ("drain_timeout_s", "start_timeout_s", "placement_timeout_s"):
            check_seconds(name, getattr(self, name))
        for name in ("unroute_s", "gpu_wait_s"):
            check_seconds(name, getattr(self, name), zero_ok=True)
        if self.max_restarts < -1:
            raise ValueError(f"max_restarts must be >= -1, got {self.max_restarts}")
        if min(self.drain_timeout_s, self.start_timeout_s, self.placement_timeout_s) <= 0 or self.unroute_s < 0:
            raise ValueError("drain, start and placement timeouts must be positive, unroute_s >= 0")
        check_max_model_len(self.max_model_len)
        if self.autoscale is not None and self.num_colocated:
            raise ValueError("autoscaling needs the disaggregated pools (not --colocated)")

    @property
    def local(self) -> bool:
        return self.ray_address is None

    @property
    def host(self) -> str:
        """Local clusters bind to loopback; on a Ray cluster each actor binds to its node's IP."""
        return "127.0.0.1" if self.local else "node-ip"

    def router_config(self):
        """The router's :class:`~router.config.RouterConfig` (``host`` as the actor will bind it)."""
        from pdserve.router.config import RouterConfig

        return RouterConfig(model_dir=self.model_dir, cluster=self.cluster, redis_url=self.redis_url, host=self.host,
                            port=self.port, max_model_len=self.max_model_len,
                            **{"http_host": self.host, **self.router_options})

    def worker_config(self, role: str, worker_id: str, device: str = "auto"):
        """The config of a ``role`` worker (``prefill``, ``decode`` or ``both``) named ``worker_id``, computing
        on ``device`` (the controller passes ``cuda`` where its placement gave the worker a GPU, else ``cpu``)."""
        from pdserve.decode_worker.config import DecodeWorkerConfig
        from pdserve.prefill_worker.config import PrefillWorkerConfig

        common = dict(model_dir=self.model_dir, worker_id=worker_id, cluster=self.cluster, redis_url=self.redis_url,
                      host=self.host, block_size=self.block_size, num_blocks=self.num_blocks, dtype=self.dtype,
                      num_threads=self.num_threads, device=device, max_model_len=self.max_model_len,
                      **self.worker_options)
        if role == "prefill":
            return PrefillWorkerConfig(**common, **self.prefill_options)
        return DecodeWorkerConfig(**common, colocated=role == "both", **self.decode_options)

    def check_roles(self) -> None:
        """Read the checkpoint's config at the served context (``max_model_len``), build the router's config and
        each worker role's this cluster runs, and read the router's token and TLS files: what would fail inside
        the Ray actors, after Ray has started and the pools have loaded the
        model, fails here at once.

        Raises:
            ValueError, FileNotFoundError: as the configs and files do (the message names the field or file).
        """
        model = ModelConfig.from_hf_dir(self.model_dir, self.max_model_len)   # a context it has, a window it fills
        int4_gptq = self.decode_options.get("weights") == "int4" and self.decode_options.get("int4_method") == "gptq"
        quantized = [flag for flag, on in (("--int4-method gptq", int4_gptq),
                                           ("--activations fp8", self.prefill_options.get("activations") == "fp8"))
                     if on]
        if model.num_experts and quantized:
            raise ValueError(f"{' and '.join(quantized)}: not supported for mixture-of-experts checkpoints "
                             f"({model.model_type}); serve them in bf16 or fp32, or with --weights int4 "
                             f"(mse or rtn)")
        router = self.router_config()
        router.bearer_tokens()
        router.tls_key_pair()
        for role in (("both",) if self.num_colocated else ("prefill", "decode")):
            self.worker_config(role, f"check-{role}")

    @property
    def max_workers(self) -> int:
        """Workers the pools can grow to under autoscaling (else their initial size)."""
        if self.autoscale is not None:
            return self.autoscale.max_prefill + self.autoscale.max_decode
        return self.num_colocated or self.num_prefill + self.num_decode


def secret_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The cluster-secret env vars every actor gets: the driver's own ``PDSERVE_CLUSTER_SECRET``
    / ``PDSERVE_CLUSTER_SECRET_FILE`` when set, else a fresh secret for this launch."""
    environ = os.environ if environ is None else environ
    given = {k: environ[k] for k in (SECRET_ENV, SECRET_FILE_ENV) if environ.get(k)}
    return given or {SECRET_ENV: new_secret()}


def router_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Env vars only the router actor gets: the driver's ``PDSERVE_ROUTER_TOKEN`` when set (a Ray
    actor does not inherit the driver's environment, so without this a router on the node IP would
    serve its public API without the token the operator configured)."""
    environ = os.environ if environ is None else environ
    return {TOKEN_ENV: environ[TOKEN_ENV]} if environ.get(TOKEN_ENV, "").strip() else {}
