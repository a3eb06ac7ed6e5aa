"""Configuration of a decode worker process."""

from __future__ import annotations

from dataclasses import dataclass

from deploy.worker_process import WorkerConfig


@dataclass(frozen=True)
class DecodeWorkerConfig(WorkerConfig):
    """A decode worker: :class:`WorkerConfig` plus its batching and KV receiver settings.

    Attributes:
        kv_port: TCP port of the KV receiver (0 = pick a free one).
        max_batch_size: requests decoded together in one step at most.
        kv_io_timeout_s: a KV connection idle this long (seconds) is dropped.
    """

    kv_port: int = 0
    max_batch_size: int = 64
    kv_io_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_batch_size <= 0:
            raise ValueError(f"max_batch_size must be positive, got {self.max_batch_size}")
        if self.kv_io_timeout_s <= 0:
            raise ValueError(f"kv_io_timeout_s must be positive, got {self.kv_io_timeout_s}")
