"""Configuration of the router process."""

from __future__ import annotations

from dataclasses import dataclass, field

from deploy.worker_process import default_redis_url


@dataclass(frozen=True)
class RouterConfig:
    """Router settings.

    Attributes:
        model_dir: checkpoint directory (the router reads only its config and tokenizer).
        cluster: registry namespace in Redis.
        redis_url: the registry.
        host, port: where the public gRPC API listens (port 0 = pick a free one).
        registry_poll_s: seconds between registry reads.
        kv_timeout_s: how long a decode worker waits for a request's KV pages.
        prefill_timeout_s: deadline of the prefill RPC (queue + forward + transfer).
        default_max_tokens: ``max_tokens`` when the request leaves it unset.
        prefix_routing: use the prefix index in dispatch (off: cache-blind, least-loaded).
        admission: admit a request only if its TTFT and TPOT SLOs (and those of the requests
            already admitted) are predicted to hold; reservations live in Redis.
        default_ttft_slo_s / default_tpot_slo_s: SLOs of requests that give none.
        spill_queue_s: a prefill worker whose queued work exceeds this many seconds loses
            its cache advantage to the best worker below the bound (hot-prefix guard).
    """

    model_dir: str
    cluster: str = "default"
    redis_url: str = field(default_factory=default_redis_url)
    host: str = "127.0.0.1"
    port: int = 0
    registry_poll_s: float = 0.25
    kv_timeout_s: float = 30.0
    prefill_timeout_s: float = 60.0
    default_max_tokens: int = 16
    spill_queue_s: float = 2.0
    prefix_routing: bool = True
    admission: bool = False
    default_ttft_slo_s: float = 1.0
    default_tpot_slo_s: float = 0.1

    def __post_init__(self) -> None:
        for name in ("registry_poll_s", "kv_timeout_s", "prefill_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
