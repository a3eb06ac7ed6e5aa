"""Open-loop load generator: sends trace requests to a router at their arrival times.

Every request asks for exactly its trace output length (``max_tokens`` = output tokens,
``ignore_eos=True``), greedy by default (``temperature=0``; each request carries the seed
``seed + index`` so sampled runs repeat). Requests are sent at their scheduled arrival
whatever the state of earlier ones (open loop), except that at most ``max_concurrency``
are in flight (a safety cap: a request that waits for it is late, and its TTFT counts
the wait). The replay stops at ``time_limit_s``; unfinished requests are ``TIME_LIMIT``.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from pdserve.bench.replay.records import OK, TIME_LIMIT, RequestRecord
from pdserve.bench.replay.traces import TraceRequest
from pdserve.deploy import client
from pdserve.proto import pdserve_pb2


@dataclass(frozen=True)
class RunnerConfig:
    """Load generator settings.

    Attributes:
        max_concurrency: requests in flight at most (safety cap).
        time_limit_s: seconds after the replay's start when unfinished requests are cancelled.
        request_timeout_s: gRPC deadline of each request in seconds (``None``: none).
        temperature: 0 = greedy.
        seed: request ``i`` uses sampling seed ``seed + i``.
        progress: show a tqdm bar (``None``: only when stderr is a terminal).
    """

    max_concurrency: int = 256
    time_limit_s: float = 600.0
    request_timeout_s: float | None = None
    temperature: float = 0.0
    seed: int = 0
    progress: bool | None = None

    def __post_init__(self) -> None:
        if self.max_concurrency < 1 or self.time_limit_s <= 0:
            raise ValueError("max_concurrency must be >= 1 and time_limit_s > 0")


@dataclass
class ReplayResult:
    """Records of one replay (in trace order) and its wall time in seconds."""

    records: list[RequestRecord]
    wall_s: float


async def replay(channel: grpc.aio.Channel, requests: Sequence[TraceRequest], prompts: Sequence[list[int]],
                 cfg: RunnerConfig = RunnerConfig(), desc: str = "") -> ReplayResult:
    """Replay ``requests`` (with prompt token ids ``prompts``) on ``channel``; see the module docstring."""
    if len(prompts) != len(requests):
        raise ValueError(f"{len(requests)} requests but {len(prompts)} prompts")
    records = [RequestRecord(index=i, arrival_s=r.arrival_s, prompt_tokens=len(p), output_tokens=r.output_tokens)
               for i, (r, p) in enumerate(zip(requests, prompts))]
    sem = asyncio.Semaphore(cfg.max_concurrency)
    bar = _progress_bar(len(requests), desc, cfg.progress)
    start = time.perf_counter()

    async def one(i: int) -> None:
        rec = records[i]
        scheduled = start + rec.arrival_s
        await asyncio.sleep(max(0.0, scheduled - time.perf_counter()))
        first = last = None
        try:
            async with sem:
                rec.send_delay_s = time.perf_counter() - scheduled
                request = client.make_request(prompts[i], max_tokens=rec.output_tokens, temperature=cfg.temperature,
                                              seed=cfg.seed + i, ignore_eos=True)
                async for msg in client.stream(channel, request, cfg.request_timeout_s):
                    if msg.token_ids:
                        last = time.perf_counter()
                        first = first or last
                        rec.tokens += len(msg.token_ids)
                    if msg.HasField("final"):
                        _read_final(rec, msg.final)
                rec.status = OK
        except grpc.aio.AioRpcError as exc:
            rec.status, rec.error = exc.code().name, exc.details() or ""
        except Exception as exc:  # noqa: BLE001 - a client-side failure is a failed request, not a crash
            rec.status, rec.error = "CLIENT_ERROR", repr(exc)
        finally:
            if first is not None:
                rec.ttft_s = first - scheduled
                rec.tpot_s = (last - first) / (rec.tokens - 1) if rec.tokens > 1 else None
            if rec.status:
                rec.e2e_s = time.perf_counter() - scheduled
                bar.update(1)

    tasks = [asyncio.create_task(one(i)) for i in range(len(requests))]
    try:
        _, pending = await asyncio.wait(tasks, timeout=cfg.time_limit_s) if tasks else (set(), set())
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    finally:
        bar.close()
    for rec in records:
        if not rec.status:
            rec.status, rec.error = TIME_LIMIT, f"unfinished after the {cfg.time_limit_s:g} s time limit"
    return ReplayResult(records, time.perf_counter() - start)


def run_replay(address: str, requests: Sequence[TraceRequest], prompts: Sequence[list[int]],
               cfg: RunnerConfig = RunnerConfig(), desc: str = "") -> ReplayResult:
    """:func:`replay` against the router at ``address`` (``host:port``) in a fresh event loop."""
    async def go() -> ReplayResult:
        async with grpc.aio.insecure_channel(address) as channel:
            return await replay(channel, requests, prompts, cfg, desc)
    return asyncio.run(go())


async def warm_up(channel: grpc.aio.Channel, prompt: list[int], n: int, max_tokens: int = 4) -> None:
    """Send ``n`` short requests one after another (not recorded) so first-call costs are paid."""
    for i in range(n):
        await client.complete(channel, client.make_request(prompt, max_tokens=max_tokens, temperature=0.0,
                                                           seed=i, ignore_eos=True), timeout_s=120)


def _read_final(rec: RequestRecord, final: pdserve_pb2.Final) -> None:
    rec.cached_prompt_tokens = final.usage.cached_prompt_tokens
    rec.finish_reason = pdserve_pb2.FinishReason.Name(final.finish_reason)
    rec.server_ttft_s, rec.server_tpot_s = final.timings.ttft_s, final.timings.tpot_s


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int, desc: str, enabled: bool | None):
    """A tqdm bar on stderr (auto-disabled off a terminal when ``enabled`` is None); a no-op without tqdm."""
    if enabled is False:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, disable=None if enabled is None else False,
                leave=False)
