"""What the benchmarks share: the machine's speed of light, a cluster of real processes,
client-side timing, and result files."""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from pdserve.deploy import client
from pdserve.deploy.processes import RoleProcess, spawn_role

ROOT = Path(__file__).resolve().parent.parent


def median_time(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in seconds after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def memory_bandwidths() -> dict[str, float]:
    """Measured memory bandwidth in bytes/s on the calling thread(s): a 256 MiB float32 copy
    (read + write counted) and a sum reduction over it (read), each in 4 KiB pages and in
    huge pages (:mod:`model.hugepages`, where the decode worker keeps weights and KV)."""
    from pdserve.model.hugepages import empty_huge

    n, out = 64 * 1024 * 1024, {}
    for pages, alloc in (("4k", lambda: torch.empty(n)), ("huge", lambda: empty_huge(n, torch.float32))):
        out.update(_bandwidths(pages, alloc(), alloc()))
    return out


def _bandwidths(pages: str, src: torch.Tensor, dst: torch.Tensor) -> dict[str, float]:
    src.uniform_()
    dst.zero_()
    nbytes = src.numel() * src.element_size()
    return {f"copy_{pages}": 2 * nbytes / median_time(lambda: dst.copy_(src), repeats=7),
            f"read_{pages}": nbytes / median_time(lambda: src.sum(), repeats=7)}


def memory_bandwidth() -> float:
    """The machine's speed of light for streaming memory, bytes/s: the best of
    :func:`memory_bandwidths` (so a kernel cannot look fast against a handicapped measurement)."""
    return max(memory_bandwidths().values())


def matmul_peak(dtype: torch.dtype = torch.bfloat16, n: int = 2048) -> float:
    """Measured matmul throughput in FLOP/s: ``n x n @ n x n`` in ``dtype``."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n ** 3 / median_time(lambda: a @ b, repeats=5)


def machine() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads()}


class LocalCluster:
    """Router + prefill + decode workers as processes on a fresh registry namespace."""

    def __init__(self, model: str, redis_url: str, prefill: dict | None = None, decode: dict | None = None,
                 common: dict | None = None) -> None:
        self.cluster = "bench-" + uuid.uuid4().hex[:8]
        base = dict(model_dir=model, cluster=self.cluster, redis_url=redis_url, **(common or {}))
        self.procs: list[RoleProcess] = []
        try:
            self.procs.append(spawn_role("decode_worker", dict(worker_id="d0", **base, **(decode or {}))))
            self.procs.append(spawn_role("prefill_worker", dict(worker_id="p0", **base, **(prefill or {}))))
            self.procs.append(spawn_role("router", dict(model_dir=model, cluster=self.cluster, redis_url=redis_url,
                                                        prefill_timeout_s=600.0)))
        except Exception:
            self.stop()
            raise
        self.address = self.procs[-1].address

    def stop(self) -> None:
        stop_all(self.procs)


async def timed_stream(channel, request) -> tuple[float, float, int, object]:
    """(TTFT s, time from first to last token s, tokens, final message), measured at the client."""
    start = time.perf_counter()
    first = last = 0.0
    n, final = 0, None
    async for msg in client.stream(channel, request):
        if msg.token_ids:
            now = time.perf_counter()
            first = first or now
            last, n = now, n + len(msg.token_ids)
        if msg.HasField("final"):
            final = msg.final
    return first - start, last - first, n, final


def hf_generate_seconds(hf, ids: torch.Tensor, num_tokens: int) -> float:
    """Seconds ``transformers`` ``generate`` takes for exactly ``num_tokens`` greedy tokens of ``ids`` (``[B, T]``)."""
    start = time.perf_counter()
    with torch.no_grad():
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                    do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


def replay_trace(argv: list[str], out_dir: Path) -> dict:
    """Run ``pdserve bench`` with ``argv`` (``--out`` is set to ``out_dir``) and return its ``results.json``."""
    import argparse

    from pdserve.bench.replay import cli as replay

    parser = argparse.ArgumentParser()
    replay.add_arguments(parser)
    replay.main(parser.parse_args([*argv, "--out", str(out_dir)]))
    return json.loads((out_dir / "results.json").read_text())


def stop_all(procs: list[RoleProcess]) -> None:
    """Stop role processes, the last started first."""
    for p in reversed(procs):
        p.stop()


def write_result(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"command": "python " + " ".join(sys.argv), "machine": machine(), **result}
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
