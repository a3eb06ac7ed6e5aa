"""Configuration of a prefill worker process."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.cluster.args import check_seconds
from pdserve.cluster.worker_config import WorkerConfig


@dataclass(frozen=True)
class PrefillWorkerConfig(WorkerConfig):
    """A prefill worker: :class:`WorkerConfig` plus its batching and KV sender settings.

    Attributes:
        max_num_batched_tokens: prompt tokens run together in one step at most
            (a longer prompt runs alone).
        kv_connect_timeout_s: seconds to reach a decode worker's KV receiver.
        kv_io_timeout_s: seconds a KV send or acknowledgement may stall.
        prefix_cache: keep computed blocks after a request leaves and reuse them for
            prompts that share a block-aligned prefix.
        kv_events: publish the prefix cache's ``stored``/``removed`` events to Redis
            (see ``docs/kv_events.md``), so routers can index which worker holds which prefix.
        snapshot_interval_s: seconds between full snapshots of the cached block hashes.
        activations: ``native`` (the weights' dtype) or ``fp8`` (W8A8 e4m3 matmuls with
            per-channel weight and per-token activation scales; see :mod:`model.quant.fp8`).
        fault_hold_transfer_s: fault-injection hook for tests only (0, the default, in service):
            hold every transfer open this many seconds after its last pages, before the done frame,
            so a test can kill the worker while the decode worker holds a half-filled block table.
            The destination's sender lane sleeps, so it also serialises this worker's transfers
            to that decode worker.
    """

    max_num_batched_tokens: int = 512
    kv_connect_timeout_s: float = 5.0
    kv_io_timeout_s: float = 10.0
    prefix_cache: bool = True
    kv_events: bool = True
    snapshot_interval_s: float = 10.0
    activations: str = "native"
    fault_hold_transfer_s: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.activations not in ("native", "fp8"):
            raise ValueError(f"activations must be native or fp8, got {self.activations!r}")
        if self.fault_hold_transfer_s < 0:
            raise ValueError(f"fault_hold_transfer_s must be >= 0, got {self.fault_hold_transfer_s}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        for name in ("kv_connect_timeout_s", "kv_io_timeout_s", "snapshot_interval_s"):
            check_seconds(name, getattr(self, name))
