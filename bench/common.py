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


def median_time(fn: Callable[[], object], repeats: int = 5, warmup: int = 1,
                clock: Callable[[], float] = time.perf_counter) -> float:
    """Median time of ``fn()`` in seconds after ``warmup`` calls, by ``clock`` (wall time; pass
    ``time.thread_time`` for the calling thread's CPU time, which another process's load moves less)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)


def memory_bandwidths(nbytes: int | None = None, threads: int = 1) -> dict[str, float]:
    """Streaming read bandwidth in bytes/s over an ``nbytes`` buffer (default DRAM-sized: >= 1 GiB and
    >= 4x the L3; :func:`bench.limits.dram_buffer_bytes`), in 4 KiB and huge pages: ``c_read_*`` the
    C kernel's best vector read (:mod:`kernels.cpu.membw`; absent without a C compiler),
    ``torch_sum_*`` a ``torch.sum`` over the same buffer (the second figure)."""
    from pdserve.bench.cpu_facts import cpu_facts
    from pdserve.bench.limits import dram_buffer_bytes, read_bandwidths

    figures = read_bandwidths(nbytes or dram_buffer_bytes(cpu_facts()["l3_bytes"]), threads)
    out = {}
    for pages in ("4k", "huge"):
        if figures[pages]["c_read"] is not None:
            out[f"c_read_{pages}"] = figures[pages]["c_read"]
        out[f"torch_sum_{pages}"] = figures[pages]["torch_sum"]
    return out


def memory_bandwidth(nbytes: int | None = None, threads: int = 1) -> float:
    """The machine's speed of light for streaming memory, bytes/s: the best C vector read of
    :func:`memory_bandwidths` (the best torch figure where the C kernel cannot run), so a kernel
    cannot look fast against a handicapped measurement."""
    figures = memory_bandwidths(nbytes, threads)
    c = [v for k, v in figures.items() if k.startswith("c_read")]
    return max(c or figures.values())


def matmul_peak(dtype: torch.dtype = torch.bfloat16, n: int = 2048) -> float:
    """Measured FLOP/s of one ``n x n @ n x n`` in ``dtype``: a single shape, kept for old callers; the
    benchmarks' compute limit is :func:`bench.limits.measure_limits` (best over the model's shapes and
    every kernel the project has)."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n ** 3 / median_time(lambda: a @ b, repeats=5)


def machine() -> dict:
    """What every results file records about the machine: platform, torch and its threads, and the CPU
    facts of :func:`bench.cpu_facts.cpu_facts` (model, ISA flags, L3, clock, which C kernels load)."""
    from pdserve.bench.cpu_facts import cpu_facts

    return {"platform": platform.platform(), "processor": platform.processor(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "cpu": cpu_facts()}


def worker_metric(metrics_address: str, name: str) -> float:
    """The sum over labels of a worker's ``pdserve:<name>`` samples (a counter's name ends in ``_total``),
    scraped from its ``GET /metrics`` at ``metrics_address`` (``host:port``) and parsed by prometheus-client."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == f"pdserve:{name}")


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
