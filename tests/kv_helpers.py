"""Helpers shared by the KV transfer tests: a small cache spec and a callback recorder."""

from __future__ import annotations

import threading

import torch

from pdserve.model.kv_cache import KVCacheSpec


def make_spec(dtype: torch.dtype = torch.float32, **kw: int) -> KVCacheSpec:
    """A small KV cache: 8 blocks x 2 layers x 4 tokens x 2 KV heads x head_dim 3 unless overridden."""
    dims = dict(num_blocks=8, num_layers=2, block_size=4, num_kv_heads=2, head_dim=3) | kw
    return KVCacheSpec(**dims, dtype=dtype)


class Outcome:
    """Records every callback of one registration; ``wait`` returns the first."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.event = threading.Event()

    def on_complete(self, request_id: str, first_token: int) -> None:
        self.calls.append(("complete", request_id, first_token))
        self.event.set()

    def on_failed(self, request_id: str, reason: str) -> None:
        self.calls.append(("failed", request_id, reason))
        self.event.set()

    def wait(self, timeout: float = 5.0) -> tuple:
        assert self.event.wait(timeout), "no callback arrived"
        return self.calls[0]
