"""What a worker's start-up warm-up covers and reports (the roles' ``warmup`` modules run it)."""

from __future__ import annotations

from dataclasses import dataclass


def row_classes(limit: int) -> list[int]:
    """Row counts that stand for every count in ``[1, limit]``: the powers of two below ``limit``, and
    ``limit`` itself. Kernels (oneDNN's matmuls, the C kernels, SDPA) pick their code paths by row count
    classes like these, so a warm-up that runs each meets every path a step of up to ``limit`` rows takes.
    Empty when ``limit < 1``."""
    out, n = [], 1
    while n < limit:
        out.append(n)
        n *= 2
    return out + [limit] if limit >= 1 else []


@dataclass(frozen=True)
class WarmupReport:
    """What a worker's start-up warm-up ran: ``num_prefill_shapes`` prefill chunk shapes (first chunks,
    continuations, multi-sequence steps) and ``num_decode_buckets`` decode batch buckets (or batch-size
    classes without the graph runner)."""

    num_prefill_shapes: int = 0
    num_decode_buckets: int = 0
