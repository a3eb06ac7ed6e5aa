"""A worker's settings, checked without torch: :class:`WorkerConfig` (each role's config extends it; the
``--device`` and ``--dtype`` names it accepts are checked by :mod:`cluster.args`) and ``--no-warmup``. A worker
process parses and checks its command line from here before it loads torch (``python -m pdserve.decode_worker
--help`` or a bad flag answers at once); :mod:`cluster.compute` resolves the names on the machine, in the
worker, when a property below first asks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.cluster.args import (
    KV_TRANSPORTS,
    check_device_name,
    check_dtype_name,
    check_port,
    check_redis_url,
    check_seconds,
    default_redis_url,
)
from pdserve.model.config import check_max_model_len

if TYPE_CHECKING:
    import torch

@dataclass(frozen=True)
class WorkerConfig:
    """Settings every worker has; each role's config extends it.

    Attributes:
        model_dir: Hugging Face checkpoint directory.
        worker_id: unique id in the cluster.
        cluster: registry namespace in Redis (several clusters can share one Redis).
        redis_url: the registry.
        host: address the gRPC and KV servers bind to.
        port: gRPC port (0 = pick a free one).
        block_size: tokens per KV block.
        num_blocks: blocks in this worker's KV pool.
        dtype: weight and KV dtype name (``float32``, ``bfloat16``, ``float16``), or ``auto``: resolved in the
            worker by :func:`resolve_dtype` (:attr:`resolved_dtype`). The dataclass default stays ``float32``
            (the exactness tests compare with transformers in fp32); ``pdserve up`` and ``demo`` default
            to ``auto``.
        num_threads: torch intra-op threads.
        lease_s: Redis lease; renewed every ``lease_s / 4`` seconds.
        insecure: on a non-loopback ``host``, serve without the cluster secret instead of refusing
            to start (logged at start and every minute).
        metrics_port: port of the Prometheus metrics server on ``host`` (0 = pick a free one;
            :mod:`cluster.metrics`), advertised as ``WorkerInfo.metrics_address``.
        warmup: before registering, run every shape the worker can meet once (prefill chunk-length
            classes, decode batch buckets, kernel and sampling paths: :meth:`WorkerProcess.warm_up`), so
            the first requests do not pay first-use costs (kernel builds, oneDNN primitives). False
            (``--warmup false``, ``--no-warmup``): register at once, for tests that need a fast start.
        device: ``auto`` (the first CUDA GPU the process sees, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``:
            where the weights, the KV cache and the steps live (:func:`cluster.compute.resolve_device`).
        kv_transport: ``auto`` (every transport the KV cache's memory allows: NCCL first for a CUDA cache, then
            TCP), ``cuda-ipc``, ``tcp`` or ``nccl`` (:mod:`kvtransfer.select`). Two workers that share one GPU
            need ``cuda-ipc`` (device-to-device copies) or ``tcp`` (through host memory) on the decode worker:
            NCCL cannot join two ranks on one device.
        max_model_len: the context served, in tokens (vLLM's ``--max-model-len``): 0 (the default) serves the
            checkpoint's ``max_position_embeddings``; a shorter one refuses longer requests and sizes the KV block
            tables (and the prefill pool's one-prompt minimum) for it (:attr:`model.config.ModelConfig.max_model_len`).
            Every worker and the router of a cluster serve the same one.
    """

    model_dir: str
    worker_id: str
    cluster: str = "default"
    redis_url: str = field(default_factory=default_redis_url)
    host: str = "127.0.0.1"
    port: int = 0
    block_size: int = 16
    num_blocks: int = 512
    dtype: str = "float32"
    num_threads: int = 1
    lease_s: float = 3.0
    insecure: bool = False
    metrics_port: int = 0
    warmup: bool = True
    device: str = "auto"
    kv_transport: str = "auto"
    max_model_len: int = 0

    def __post_init__(self) -> None:
        check_dtype_name(self.dtype)
        check_device_name(self.device)
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(f"kv_transport must be one of {KV_TRANSPORTS}, got {self.kv_transport!r}")
        for name in ("block_size", "num_blocks", "num_threads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        check_seconds("lease_s", self.lease_s, low=0.1, high=3600.0)   # Redis leases in whole milliseconds
        check_port("port", self.port)
        check_redis_url("redis_url", self.redis_url)
        check_port("metrics_port", self.metrics_port)
        check_max_model_len(self.max_model_len)

    # The three properties ask the machine, in the worker process: cluster.compute (and torch) load on first use,
    # so that parsing and checking a worker's command line does not.
    @property
    def resolved_device(self) -> torch.device:
        """``device`` resolved in this process (:func:`cluster.compute.resolve_device`; not cached: a config
        pickled to another node resolves there). Raises RuntimeError for a CUDA device this process lacks."""
        from pdserve.cluster.compute import resolve_device
        return resolve_device(self.device)

    @property
    def resolved_dtype(self) -> str:
        """``dtype`` with ``auto`` resolved for this machine and :attr:`resolved_device` (not cached)."""
        from pdserve.cluster.compute import resolve_dtype
        return resolve_dtype(self.dtype, self.model_dir, self.resolved_device)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The ``torch.dtype`` of :attr:`resolved_dtype`."""
        from pdserve.cluster.compute import DTYPES
        return DTYPES[self.resolved_dtype]


def add_no_warmup_flag(parser) -> None:
    """``--no-warmup``: the same as ``--warmup false`` (:attr:`WorkerConfig.warmup`), on a parser that
    :func:`cluster.args.add_config_args` filled."""
    parser.add_argument("--no-warmup", dest="warmup", action="store_false", default=None,
                        help="register without warming up first (tests that need a fast start)")
