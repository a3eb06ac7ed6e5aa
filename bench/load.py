"""Client side of the load benchmarks: a fixed set of varied prompts, varied requests, one
streamed request timed at the client, and nearest-rank percentiles."""

from __future__ import annotations

import math
import random
import time

import grpc

from pdserve.deploy import client
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc

WORDS = ("once upon a time there was a little girl named Lily she liked to play with her dog in the park one day "
         "the sun was big and bright Tom saw a red ball under the tree and they were happy").split()

def make_prompts(num: int, seed: int) -> list[str | list[int]]:
    """``num`` distinct prompts: even ones text (3..30 words), odd ones token ids (4..40, BOS first)."""
    rng = random.Random(seed)
    out: list[str | list[int]] = []
    while len(out) < num:
        if len(out) % 2 == 0:
            out.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30))).capitalize())
        else:
            out.append([1] + [rng.randrange(3, 2048) for _ in range(rng.randint(3, 39))])
    return out


def make_request(rng: random.Random, prompts: list) -> pdserve_pb2.GenerateRequest:
    """A varied request: a prompt of the fixed set, 4..32 tokens, greedy or seeded sampling."""
    greedy = rng.random() < 0.5
    return client.make_request(rng.choice(prompts), max_tokens=rng.randint(4, 32),
                               temperature=0.0 if greedy else 0.8, top_p=None if greedy else 0.95,
                               seed=None if greedy else rng.randrange(2**32))


def percentiles(values: list[float]) -> dict:
    """p50 and p99 (nearest rank) of ``values``; zeros when empty."""
    if not values:
        return {"p50": 0.0, "p99": 0.0, "n": 0}
    s = sorted(values)
    return {"p50": s[math.ceil(0.5 * len(s)) - 1], "p99": s[math.ceil(0.99 * len(s)) - 1], "n": len(s)}


async def stream_once(channel: grpc.aio.Channel, request, timeout_s: float) -> tuple[float, float, int]:
    """(TTFT s, TPOT s, output tokens) of one streamed request, at the client.

    Raises:
        grpc.aio.AioRpcError: the router ended the stream with an error.
        RuntimeError: the stream ended without ``final``.
    """
    start = time.perf_counter()
    first = last = 0.0
    n, final = 0, False
    async for msg in pdserve_pb2_grpc.RouterStub(channel).Generate(request, timeout=timeout_s):
        if msg.token_ids:
            last, n = time.perf_counter(), n + len(msg.token_ids)
            first = first or last
        final = final or msg.HasField("final")
    if not final or n == 0:
        raise RuntimeError(f"stream ended without final ({n} tokens)")
    return first - start, (last - first) / (n - 1) if n > 1 else 0.0, n
