"""Request traces: the Azure LLM inference trace 2023 (CSV) and the Mooncake synthetic
trace (JSONL), loaded into one :class:`TraceRequest` form and scaled to the machine.

Sources (see ``/work/shared/traces/README.md``):

- Azure LLM inference trace 2023, code service: ``TIMESTAMP,ContextTokens,GeneratedTokens``.
  CC-BY. Patel et al., "Splitwise: Efficient generative LLM inference using phase
  splitting", ISCA 2024 (``Azure/AzurePublicDataset``, ``data/AzureLLMInferenceTrace_code.csv``).
- Mooncake synthetic trace: ``{"timestamp": ms, "input_length", "output_length", "hash_ids"}``,
  one hash id per 512-token block of the prompt; equal ids are equal blocks of prompt tokens.
  Apache-2.0. Qin et al., "Mooncake: Trading More Storage for Less Computation", FAST 2025
  (``kvcache-ai/Mooncake``, ``FAST25-release/traces/synthetic_trace.jsonl``).

Scaling (all done by :func:`load_trace` with :class:`TraceOptions`):

- arrivals start at 0 s; ``time_scale`` multiplies every inter-arrival gap, or ``rate``
  rescales the gaps so the mean rate is ``rate`` requests/s, where the mean rate of ``n``
  requests spanning ``T`` seconds is ``(n - 1) / T`` (one gap per request after the first);
- ``length_scale`` multiplies prompt lengths (``output_scale``, default the same, multiplies
  output lengths), rounded, then clamped to ``[min, max]`` tokens;
- Mooncake blocks scale with the prompt: a hash id stands for ``round(512 * length_scale)``
  tokens (at least 1). The scaled prompt keeps the first ``ceil(prompt_tokens / block)``
  ids, so a prompt cut by ``max_prompt_tokens`` keeps its prefix (and its sharing).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

SHARED_TRACES = Path("/work/shared/traces")
NAMED_TRACES = {
    "azure": SHARED_TRACES / "azure_llm_inference_2023_code.csv",
    "mooncake": SHARED_TRACES / "mooncake_synthetic_trace.jsonl",
}
CITATIONS = {
    "azure": "Azure LLM inference trace 2023 (code), CC-BY; Patel et al., \"Splitwise: Efficient generative "
             "LLM inference using phase splitting\", ISCA 2024",
    "mooncake": "Mooncake synthetic trace, Apache-2.0; Qin et al., \"Mooncake: Trading More Storage for Less "
                "Computation\", FAST 2025",
}
MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash id in the original trace


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        arrival_s: seconds after the first request's arrival.
        prompt_tokens: prompt length in tokens.
        output_tokens: tokens to generate.
        block_ids: Mooncake hash ids, one per block of prompt tokens (``None`` for Azure).
    """

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    block_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class TraceOptions:
    """How to cut and scale a trace (see the module docstring).

    Attributes:
        max_requests: keep only the first this many requests (``None``: all).
        time_scale: multiplies inter-arrival gaps (ignored when ``rate`` is set).
        rate: target mean request rate in requests/s (``None``: keep the trace's timing).
        length_scale: multiplies prompt lengths (and Mooncake's 512-token block size).
        output_scale: multiplies output lengths (``None``: ``length_scale``).
        min_prompt_tokens, max_prompt_tokens: clamp of scaled prompt lengths (tokens).
        min_output_tokens, max_output_tokens: clamp of scaled output lengths (tokens).
    """

    max_requests: int | None = None
    time_scale: float = 1.0
    rate: float | None = None
    length_scale: float = 1.0
    output_scale: float | None = None
    min_prompt_tokens: int = 1
    max_prompt_tokens: int | None = None
    min_output_tokens: int = 1
    max_output_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.time_scale <= 0 or self.length_scale <= 0 or (self.output_scale or 1.0) <= 0:
            raise ValueError("time_scale, length_scale and output_scale must be positive")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate must be positive requests/s, got {self.rate}")
        if self.min_prompt_tokens < 1 or self.min_output_tokens < 1:
            raise ValueError("minimum prompt and output lengths are at least 1 token")


@dataclass(frozen=True)
class Trace:
    """Scaled requests of one trace, ordered by arrival.

    Attributes:
        name: ``azure``, ``mooncake`` or the file name.
        format: ``azure`` or ``mooncake``.
        requests: the requests.
        block_tokens: tokens per hash id after scaling (Mooncake), ``None`` without hash ids.
        source: the citation of the trace.
    """

    name: str
    format: str
    requests: tuple[TraceRequest, ...]
    block_tokens: int | None
    source: str

    def mean_rate(self) -> float:
        """Mean arrival rate in requests/s, ``(n - 1) / span`` (0 with fewer than 2 arrivals or no span)."""
        return mean_rate(self.requests)

    def at_rate(self, rate: float) -> Trace:
        """The same requests with inter-arrival gaps rescaled to a mean of ``rate`` requests/s."""
        return dataclasses.replace(self, requests=tuple(rescale_arrivals(self.requests, rate=rate)))


def detect_format(path: str | Path) -> str:
    """``azure`` for ``.csv``, ``mooncake`` for ``.jsonl``/``.json``.

    Raises:
        ValueError: any other extension.
    """
    suffix = Path(path).suffix.lower()
    if suffix == ".csv":
        return "azure"
    if suffix in (".jsonl", ".json"):
        return "mooncake"
    raise ValueError(f"cannot tell the trace format of {path}; pass --format azure|mooncake")


def read_azure(path: str | Path, max_requests: int | None = None) -> list[TraceRequest]:
    """Raw (unscaled) requests of an Azure LLM inference trace CSV, arrivals in s from the first."""
    out, t0 = [], None
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if max_requests is not None and len(out) >= max_requests:
                break
            t = _azure_time(row["TIMESTAMP"])
            t0 = t if t0 is None else t0
            out.append(TraceRequest(t - t0, int(row["ContextTokens"]), int(row["GeneratedTokens"])))
    return out


def read_mooncake(path: str | Path, max_requests: int | None = None) -> list[TraceRequest]:
    """Raw (unscaled) requests of a Mooncake JSONL trace, arrivals in s from the first."""
    out, t0 = [], None
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            if max_requests is not None and len(out) >= max_requests:
                break
            r = json.loads(line)
            t = r["timestamp"] / 1000.0  # ms -> s
            t0 = t if t0 is None else t0
            out.append(TraceRequest(t - t0, int(r["input_length"]), int(r["output_length"]),
                                    tuple(int(h) for h in r["hash_ids"])))
    return out


def load_trace(trace: str | Path, fmt: str | None = None, options: TraceOptions = TraceOptions()) -> Trace:
    """Load ``azure``, ``mooncake`` (the shared traces) or a file path, then cut and scale it."""
    path = NAMED_TRACES.get(str(trace), Path(trace))
    fmt = fmt or (str(trace) if str(trace) in NAMED_TRACES else detect_format(path))
    if fmt not in ("azure", "mooncake"):
        raise ValueError(f"unknown trace format {fmt!r}")
    raw = (read_azure if fmt == "azure" else read_mooncake)(path, options.max_requests)
    raw.sort(key=lambda r: r.arrival_s)
    block = mooncake_block_tokens(options.length_scale) if fmt == "mooncake" else None
    reqs = [scale_lengths(r, options, block) for r in raw]
    reqs = rescale_arrivals(reqs, time_scale=options.time_scale, rate=options.rate)
    name = str(trace) if str(trace) in NAMED_TRACES else Path(trace).name
    return Trace(name, fmt, tuple(reqs), block, CITATIONS[fmt])


def mooncake_block_tokens(length_scale: float) -> int:
    """Tokens per Mooncake hash id after scaling: ``max(1, round(512 * length_scale))``."""
    return max(1, round(MOONCAKE_BLOCK_TOKENS * length_scale))


def scale_lengths(req: TraceRequest, options: TraceOptions, block_tokens: int | None = None) -> TraceRequest:
    """Scale and clamp one request's lengths; trim its hash ids to the blocks the scaled prompt covers.

    When rounding (or ``min_prompt_tokens``) makes a Mooncake prompt longer than its ids cover
    (``len(block_ids) * block_tokens``), the prompt builder fills the rest with tokens unique
    to the request.
    """
    out_scale = options.length_scale if options.output_scale is None else options.output_scale
    prompt = _clamp(round(req.prompt_tokens * options.length_scale), options.min_prompt_tokens,
                    options.max_prompt_tokens)
    output = _clamp(round(req.output_tokens * out_scale), options.min_output_tokens, options.max_output_tokens)
    ids = req.block_ids
    if ids is not None and block_tokens is not None:
        ids = ids[:math.ceil(prompt / block_tokens)]
    return TraceRequest(req.arrival_s, prompt, output, ids)


def mean_rate(requests: list[TraceRequest] | tuple[TraceRequest, ...]) -> float:
    """Mean arrival rate in requests/s: ``(n - 1) / (last - first arrival)``; 0 if undefined."""
    if len(requests) < 2:
        return 0.0
    span = requests[-1].arrival_s - requests[0].arrival_s
    return (len(requests) - 1) / span if span > 0 else 0.0


def rescale_arrivals(requests, time_scale: float = 1.0, rate: float | None = None) -> list[TraceRequest]:
    """Shift arrivals to start at 0 s and multiply the gaps by ``time_scale``, or, when ``rate``
    (requests/s) is given, by the factor that makes the mean rate ``rate``. A trace that
    arrives all at once (no span) stays a burst."""
    if not requests:
        return []
    if rate is not None:
        current = mean_rate(requests)
        time_scale = current / rate if current > 0 else 1.0
    t0 = requests[0].arrival_s
    return [dataclasses.replace(r, arrival_s=(r.arrival_s - t0) * time_scale) for r in requests]


def _clamp(n: int, lo: int, hi: int | None) -> int:
    n = max(lo, n)
    return n if hi is None else min(n, hi)


def _azure_time(text: str) -> float:
    """Seconds since the epoch of ``2023-11-16 18:17:03.9799600`` (7 fractional digits)."""
    day, _, frac = text.strip().partition(".")
    return datetime.fromisoformat(day).replace(tzinfo=timezone.utc).timestamp() + (float("0." + frac) if frac else 0.0)
