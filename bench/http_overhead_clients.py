"""The client side of ``bench/http_overhead.py``: one greedy streamed request timed at the client through each API
(gRPC ``Generate``, HTTP ``POST /v1/completions``), batch 1's pairs of them, and the load phases, whose clients
run in child processes, with the CPU time they and the router spend."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import grpc

try:  # the `openai` package's HTTP client (same API as httpx)
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

from pdserve.bench.common import timed_stream
from pdserve.bench.http_overhead_stats import quantile, summary
from pdserve.deploy import client

APIS = ("grpc", "http")
CLIENTS_PER_CHANNEL = 50  # as bench/soak.py: separate HTTP/2 connections, as independent clients would open
LOAD_ORDER = ("grpc", "http", "http", "grpc")


class HttpStreamError(RuntimeError):
    """The HTTP API answered an error status or an error event."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status


# -- one request, timed at the client ----------------------------------------------------------------

async def grpc_once(channel: grpc.aio.Channel, prompt: str | list[int], max_tokens: int,
                    timeout_s: float) -> tuple[float, float, int]:
    """(TTFT s, per-token s, tokens) of one greedy streamed ``Generate`` (``client.stream``)."""
    request = client.make_request(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ttft, span, n, final = await asyncio.wait_for(timed_stream(channel, request), timeout_s)
    if final is None or n == 0:
        raise RuntimeError(f"gRPC stream ended without final ({n} tokens)")
    return ttft, span / (n - 1) if n > 1 else 0.0, n


async def http_once(http: httpx.AsyncClient, url: str, prompt: str | list[int], max_tokens: int,
                    timeout_s: float) -> tuple[float, float, int]:
    """(TTFT s, per-token s, tokens) of one greedy streamed ``POST /v1/completions``: the clock is read
    when an SSE ``data`` line arrives, before it is parsed; chunks without tokens are not counted."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    start = time.perf_counter()
    first = last = 0.0
    n, done = 0, False
    async with http.stream("POST", url, json=body, timeout=timeout_s) as r:
        if r.status_code != 200:
            raise HttpStreamError(r.status_code, (await r.aread()).decode(errors="replace")[:200])
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            now = time.perf_counter()
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise HttpStreamError(200, str(chunk["error"])[:200])
            ids = chunk["choices"][0].get("token_ids") if chunk["choices"] else None
            if ids:
                first = first or now
                last, n = now, n + len(ids)
    if not done or n == 0:
        raise RuntimeError(f"HTTP stream ended without [DONE] ({n} tokens)")
    return first - start, (last - first) / (n - 1) if n > 1 else 0.0, n


def _http_client(connections: int, timeout_s: float) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s))



# -- batch 1 ---------------------------------------------------------------------------------------------

async def batch1(address: str, url: str, prompts: list, repeats: int, warmup: int, max_tokens: int,
                 timeout_s: float) -> dict[str, dict[str, list[float]]]:
    """``repeats`` pairs, one request per API each, alternating which goes first; raw samples."""
    got = {api: {"ttft_s": [], "tpot_s": []} for api in APIS}
    async with client.open_channel(address) as channel, _http_client(4, timeout_s) as http:
        calls = {"grpc": lambda p: grpc_once(channel, p, max_tokens, timeout_s),
                 "http": lambda p: http_once(http, url, p, max_tokens, timeout_s)}
        for i in range(warmup):
            for api in APIS:
                await calls[api](prompts[i % len(prompts)])
        for i in range(repeats):
            prompt = prompts[i % len(prompts)]
            for api in (APIS if i % 2 == 0 else APIS[::-1]):
                ttft, tpot, n = await calls[api](prompt)
                if n != max_tokens:
                    raise RuntimeError(f"{api} streamed {n} of {max_tokens} tokens")
                got[api]["ttft_s"].append(ttft)
                got[api]["tpot_s"].append(tpot)
    return got


# -- load (client processes) -----------------------------------------------------------------------------

async def _load_clients(api: str, address: str, url: str, num_clients: int, start_at: float, end_at: float,
                        prompts: list, max_tokens: int, timeout_s: float, seed: int) -> list[tuple]:
    records: list[tuple] = []
    channels = [client.open_channel(address) for _ in range(-(-num_clients // CLIENTS_PER_CHANNEL))] \
        if api == "grpc" else []
    http = _http_client(num_clients + 4, timeout_s) if api == "http" else None

    async def loop(i: int) -> None:
        rng = random.Random(seed * 100_003 + i)
        while (now := time.time()) < end_at:
            prompt = rng.choice(prompts)
            try:
                if api == "grpc":
                    ttft, tpot, n = await grpc_once(channels[i // CLIENTS_PER_CHANNEL], prompt, max_tokens, timeout_s)
                else:
                    ttft, tpot, n = await http_once(http, url, prompt, max_tokens, timeout_s)
                records.append((now - start_at, "OK", ttft, tpot, n))
            except grpc.aio.AioRpcError as e:
                records.append((now - start_at, e.code().name, 0.0, 0.0, 0, (e.details() or "")[:200]))
            except HttpStreamError as e:
                records.append((now - start_at, f"HTTP_{e.status}", 0.0, 0.0, 0, str(e)[:200]))
            except Exception as e:  # counted, never hidden
                records.append((now - start_at, "CLIENT_" + type(e).__name__, 0.0, 0.0, 0, str(e)[:200]))

    try:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        await asyncio.gather(*(loop(i) for i in range(num_clients)))
    finally:
        for ch in channels:
            await ch.close()
        if http is not None:
            await http.aclose()
    return records


def run_load_clients(api: str, address: str, url: str, num_clients: int, start_at: float, end_at: float,
                     prompts: list, max_tokens: int, timeout_s: float, seed: int) -> tuple[list[tuple], float]:
    """Child-process entry: ``num_clients`` clients of ``api`` loop requests from ``start_at`` until
    ``end_at`` (``time.time()``), each finishing its last one. Returns one record per request,
    ``(start s after start_at, status, TTFT s, per-token s, tokens[, error details])``, and the CPU
    seconds this process spent."""
    cpu = time.process_time()
    records = asyncio.run(_load_clients(api, address, url, num_clients, start_at, end_at, prompts, max_tokens,
                                        timeout_s, seed))
    return records, time.process_time() - cpu


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def load(address: str, url: str, prompts: list, clients: int, duration_s: float, warmup_s: float,
         client_procs: int, max_tokens: int, timeout_s: float, seed: int, router_pid: int) -> dict:
    """Phases gRPC, HTTP, HTTP, gRPC of ``warmup_s + duration_s / 2`` seconds each; per API the
    requests started after each phase's warm-up, summarized over both of its phases, and the CPU
    time of the router and of the clients per completed request (whole phases, warm-up included)."""
    from pdserve.bench import http_overhead_clients as me  # picklable by its package name in the children

    procs_n = max(1, min(client_procs, clients))
    share = [clients // procs_n + (i < clients % procs_n) for i in range(procs_n)]
    window = duration_s / 2
    records: dict[str, list[tuple]] = {api: [] for api in APIS}
    cpu = {api: {"router_s": 0.0, "clients_s": 0.0, "requests": 0} for api in APIS}
    phases = []
    with ProcessPoolExecutor(procs_n, mp_context=get_context("spawn")) as pool:
        for p, api in enumerate(LOAD_ORDER):
            start_at = time.time() + (3.0 + 0.5 * procs_n if p == 0 else 1.0)  # children import first
            end_at = start_at + warmup_s + window
            futures = [pool.submit(me.run_load_clients, api, address, url, n, start_at, end_at, prompts, max_tokens,
                                   timeout_s, seed + 1000 * p + i) for i, n in enumerate(share)]
            router_cpu = cpu_seconds(router_pid)
            done = [f.result() for f in futures]
            router_cpu = cpu_seconds(router_pid) - router_cpu
            got = [r for rec, _ in done for r in rec]
            cpu[api]["router_s"] += router_cpu
            cpu[api]["clients_s"] += sum(c for _, c in done)
            cpu[api]["requests"] += sum(r[1] == "OK" for r in got)
            measured = [r for r in got if r[0] >= warmup_s and r[1] == "OK"]
            phases.append({"api": api, "requests": len(measured), "errors": sum(r[1] != "OK" for r in got),
                           "tokens_per_s": sum(r[4] for r in measured) / window,
                           "ttft_p50_s": quantile([r[2] for r in measured], 0.5),
                           "tpot_p50_s": quantile([r[3] for r in measured], 0.5),
                           "router_cpu_ms_per_request": 1e3 * router_cpu / max(1, sum(r[1] == "OK" for r in got))})
            records[api] += got
    out: dict = {}
    for api in APIS:
        rec = records[api]
        measured = [r for r in rec if r[0] >= warmup_s and r[1] == "OK"]
        errors: dict[str, str] = {}
        for r in rec:
            if r[1] != "OK":
                errors.setdefault(r[1], r[5] if len(r) > 5 else "")
        out[api] = {"requests": len(measured), "requests_per_s": len(measured) / duration_s,
                    "tokens_per_s": sum(r[4] for r in measured) / duration_s,
                    "errors": sum(r[1] != "OK" for r in rec), "error_examples": errors,
                    "ttft_s": summary([r[2] for r in measured]), "tpot_s": summary([r[3] for r in measured]),
                    "router_cpu_ms_per_request": 1e3 * cpu[api]["router_s"] / max(1, cpu[api]["requests"]),
                    "client_cpu_ms_per_request": 1e3 * cpu[api]["clients_s"] / max(1, cpu[api]["requests"]),
                    "samples": {"ttft_s": [r[2] for r in measured], "tpot_s": [r[3] for r in measured]}}
    out["phases"] = phases
    return out
