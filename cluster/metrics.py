"""Every process's Prometheus metrics, defined once: one builder per process kind, each on the
``CollectorRegistry`` it is given (the router's ``Router.metrics``, served on ``GET /metrics`` of its
HTTP port; a worker's own, served by :func:`start_metrics_server` on ``metrics_port``).

Names follow vLLM's under the ``pdserve:`` prefix, so dashboards written for vLLM port over::

    metric (pdserve:...)                        kind       router  prefill  decode   recorded from
    time_to_first_token_seconds                 histogram    x                       Final.timings.ttft_s
    inter_token_latency_seconds                 histogram    x                       gaps between token messages
    e2e_request_latency_seconds                 histogram    x                       Final.timings.e2e_s
    request_queue_time_seconds                  histogram    x        x              Final.timings.queue_s; P's queue_s
    kv_transfer_seconds                         histogram             x              PrefillResult.transfer_s
    request_success_total{finished_reason}      counter      x                x      Final / DecodeFinished
    prompt_tokens_total                         counter      x        x       (x)    Usage; P's prompt (D: colocated)
    generation_tokens_total                     counter      x        x       x      Usage; P's first token; D's tokens
    prefix_cache_queries_total                  counter               x              prompt tokens looked up
    prefix_cache_hits_total                     counter               x              of them found cached
    kv_transfer_bytes_total                     counter               x              PrefillResult.num_kv_bytes
    admission_rejections_total{reason}          counter      x                       RESOURCE_EXHAUSTED answers
    request_retries_total                       counter      x                       Final.num_retries
    request_migrations_total                    counter      x                       Final.num_migrations
    spec_decode_num_draft_tokens_total          counter                       x      DecodeFinished
    spec_decode_num_accepted_tokens_total       counter                       x      DecodeFinished
    num_preemptions_total                       counter                       x      the engine's preemptions
    num_requests_running / num_requests_waiting gauge                 x       x      the registry entry's load,
    kv_cache_usage_perc (a fraction, 0..1)      gauge                 x       x      read at scrape time
    warmup_seconds                              gauge                 x       x      WorkerInfo.warmup_s (0: none)
    gc_frozen_objects                           gauge        x        x       x      gc.get_freeze_count()

Each registry also carries prometheus-client's standard ``python_gc_*`` (collections and objects collected per
generation) and ``process_*`` (CPU seconds, resident memory, open files) families, as a Python process's default
registry would; ``gc_frozen_objects`` is how many start-up objects the process froze out of the collector's
walks (:func:`cluster.service.freeze_startup_heap`; 0 before it has, and in a test's own process).

Worker metrics carry ``worker_id`` and ``role`` labels, so one Prometheus job scraping every worker
(their addresses are in the registry: ``WorkerInfo.metrics_address``, ``pdserve status``) sums or splits
them per pool. A worker's generation tokens are those it sampled: P the first, D the rest, so the
prefill and decode pools' ``generation_tokens_total`` add up to the router's.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import ThreadingHTTPServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    ProcessCollector,
    start_http_server,
)

PREFIX = "pdserve:"

# seconds; 0.1, 0.25, 1.0 and 2.5 are there so that goodput against the usual SLOs reads off exact buckets
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
FINISH_REASON_NAMES = {1: "stop", 2: "length"}  # pdserve.v1.FinishReason -> vLLM's label values


def _counter(name: str, doc: str, registry: CollectorRegistry, labels: tuple[str, ...] = ()) -> Counter:
    return Counter(PREFIX + name, doc, labels, registry=registry)


def _histogram(name: str, doc: str, registry: CollectorRegistry, buckets: tuple[float, ...],
               labels: tuple[str, ...] = ()) -> Histogram:
    return Histogram(PREFIX + name, doc, labels, registry=registry, buckets=buckets)


# ---- router ------------------------------------------------------------------------------
@dataclass(frozen=True)
class RouterMetrics:
    """The router's metrics (one set per router process, unlabelled but for the counters' reasons)."""

    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    queue_time: Histogram
    success: Counter
    prompt_tokens: Counter
    generation_tokens: Counter
    rejections: Counter
    retries: Counter
    migrations: Counter

    def request(self) -> RequestRecorder:
        """A recorder for one request's stream of client messages."""
        return RequestRecorder(self)

    def rejected(self, reason: str) -> None:
        """A request answered RESOURCE_EXHAUSTED (``reason``: one of :data:`REJECTION_REASONS`)."""
        self.rejections.labels(reason=reason).inc()


REJECTION_REASONS = ("stream_limit", "no_kv_blocks", "admission", "other")


def _process_metrics(registry: CollectorRegistry) -> None:
    """The process's own families on ``registry``: prometheus-client's GC and process collectors and
    ``gc_frozen_objects`` (read at scrape time)."""
    GCCollector(registry=registry)
    ProcessCollector(registry=registry)
    Gauge(PREFIX + "gc_frozen_objects", "Objects frozen out of the garbage collector's walks at start",
          registry=registry).set_function(gc.get_freeze_count)


def router_metrics(registry: CollectorRegistry, waiting_for_kv: Callable[[], int] = lambda: 0) -> RouterMetrics:
    """Build the router's metrics on ``registry`` (every label value exported from the start, at 0);
    ``waiting_for_kv()`` is read at scrape time: the requests in the router's line for KV room
    (:mod:`router.room_queue`)."""
    _process_metrics(registry)
    Gauge(PREFIX + "router_requests_waiting_for_kv", "Requests waiting in the router's line for KV room on the "
          "decode workers (--queue-timeout)", registry=registry).set_function(waiting_for_kv)
    m = RouterMetrics(
        ttft=_histogram("time_to_first_token_seconds", "Arrival to first token sent, at the router",
                        registry, TTFT_BUCKETS),
        itl=_histogram("inter_token_latency_seconds", "Time per output token after the first, at the router",
                       registry, ITL_BUCKETS),
        e2e=_histogram("e2e_request_latency_seconds", "Arrival to the final message, finished requests",
                       registry, REQUEST_BUCKETS),
        queue_time=_histogram("request_queue_time_seconds", "Arrival to prefill dispatch (worker choice, "
                              "admission, KV allocation)", registry, REQUEST_BUCKETS),
        success=_counter("request_success_total", "Requests finished", registry, ("finished_reason",)),
        prompt_tokens=_counter("prompt_tokens_total", "Prompt tokens of finished requests", registry),
        generation_tokens=_counter("generation_tokens_total", "Output tokens of finished requests", registry),
        rejections=_counter("admission_rejections_total", "Requests refused RESOURCE_EXHAUSTED", registry,
                            ("reason",)),
        retries=_counter("request_retries_total", "Dispatches restarted before the first token (finished requests)",
                         registry),
        migrations=_counter("request_migrations_total", "Moves to another decode worker mid-stream "
                            "(finished requests)", registry))
    for reason in FINISH_REASON_NAMES.values():
        m.success.labels(finished_reason=reason)
    for reason in REJECTION_REASONS:
        m.rejections.labels(reason=reason)
    return m


class RequestRecorder:
    """Records one request from the client messages the router sends: each token message after the
    first observes its gap split evenly over its tokens (``inter_token_latency_seconds``, so its count
    is the output tokens less one per request), and the ``final`` message the rest."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self._m, self._last = metrics, 0.0

    def on_message(self, msg) -> None:
        """Record a ``pdserve.v1.GenerateResponse`` about to be sent."""
        if msg.HasField("final"):
            self._final(msg.final)
            return
        n = len(msg.token_ids)
        if not n:
            return
        now = time.monotonic()
        if self._last:
            gap = (now - self._last) / n
            for _ in range(n):
                self._m.itl.observe(gap)
        elif n > 1:  # tokens sent with the first one have no gap of their own
            for _ in range(n - 1):
                self._m.itl.observe(0.0)
        self._last = now

    def _final(self, final) -> None:
        m, t, u = self._m, final.timings, final.usage
        m.ttft.observe(t.ttft_s)
        m.e2e.observe(t.e2e_s)
        m.queue_time.observe(t.queue_s)
        m.success.labels(finished_reason=FINISH_REASON_NAMES.get(final.finish_reason, "unknown")).inc()
        m.prompt_tokens.inc(u.prompt_tokens)
        m.generation_tokens.inc(u.completion_tokens)
        m.retries.inc(final.num_retries)
        m.migrations.inc(final.num_migrations)


# ---- workers -----------------------------------------------------------------------------
WORKER_LABELS = ("worker_id", "role")


def _load_gauges(registry: CollectorRegistry, labels: dict[str, str], load: Callable[[], object]) -> None:
    """``num_requests_running``, ``num_requests_waiting``, ``kv_cache_usage_perc`` and ``warmup_seconds``
    (the start-up warm-up's duration; 0 without one) read from ``load()`` (the worker's registry entry,
    :class:`cluster.registry.WorkerInfo`) at scrape time."""
    def usage() -> float:
        info = load()
        return 1.0 - info.num_free_blocks / info.num_total_blocks if info.num_total_blocks else 0.0

    for name, doc, fn in (
            ("num_requests_running", "Requests decoding (decode) or being prefilled (prefill)",
             lambda: load().num_running),
            ("num_requests_waiting", "Requests waiting: for KV pages or, preempted, for blocks (decode), in the "
             "queue (prefill)",
             lambda: load().num_waiting),
            ("kv_cache_usage_perc", "Fraction of the KV block pool in use (0..1)", usage),
            ("warmup_seconds", "Seconds the start-up warm-up took before the worker registered (0: none)",
             lambda: load().warmup_s)):
        Gauge(PREFIX + name, doc, WORKER_LABELS, registry=registry).labels(**labels).set_function(fn)


@dataclass(frozen=True)
class PrefillMetrics:
    """A prefill worker's metrics, bound to its labels."""

    queue_time: Histogram
    transfer_s: Histogram
    transfer_bytes: Counter
    prompt_tokens: Counter
    generation_tokens: Counter
    prefix_queries: Counter
    prefix_hits: Counter

    def on_prefill(self, num_prompt_tokens: int, result) -> None:
        """Record one successful prefill (``result``: :class:`prefill_worker.request.PrefillResult`); a
        migrated request's earlier output tokens count as prompt here, as it prefills them."""
        self.queue_time.observe(result.queue_s)
        self.transfer_s.observe(result.transfer_s)
        self.transfer_bytes.inc(result.num_kv_bytes)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(1)
        self.prefix_queries.inc(num_prompt_tokens)
        self.prefix_hits.inc(result.num_cached_tokens)


def prefill_metrics(registry: CollectorRegistry, worker_id: str, load: Callable[[], object]) -> PrefillMetrics:
    """Build a prefill worker's metrics on ``registry``; ``load()`` returns its current registry entry."""
    labels = {"worker_id": worker_id, "role": "prefill"}
    _process_metrics(registry)
    _load_gauges(registry, labels, load)

    def counter(name: str, doc: str) -> Counter:
        return _counter(name, doc, registry, WORKER_LABELS).labels(**labels)

    def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return _histogram(name, doc, registry, buckets, WORKER_LABELS).labels(**labels)

    return PrefillMetrics(
        queue_time=histogram("request_queue_time_seconds", "Arrival on the worker to admission", REQUEST_BUCKETS),
        transfer_s=histogram("kv_transfer_seconds", "First KV page sent to the decode worker's acknowledgement",
                             TRANSFER_BUCKETS),
        transfer_bytes=counter("kv_transfer_bytes_total", "KV page bytes sent to decode workers"),
        prompt_tokens=counter("prompt_tokens_total", "Prompt tokens prefilled (cached ones included)"),
        generation_tokens=counter("generation_tokens_total", "Output tokens sampled here (each request's first)"),
        prefix_queries=counter("prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache"),
        prefix_hits=counter("prefix_cache_hits_total", "Prompt tokens whose KV the prefix cache held"))


@dataclass(frozen=True)
class DecodeMetrics:
    """A decode (or colocated) worker's metrics, bound to its labels."""

    success: Counter
    prompt_tokens: Counter
    generation_tokens: Counter
    spec_draft: Counter
    spec_accepted: Counter
    multi_step_runs: Counter
    multi_step_steps: Counter
    preemptions: Counter
    labels: dict[str, str]

    def on_multi_step(self, steps: int) -> None:
        """A multi-step run of ``steps`` decode steps in one call ended (any thread)."""
        self.multi_step_runs.inc()
        self.multi_step_steps.inc(steps)

    def on_preemption(self) -> None:
        """The engine preempted a request (its blocks freed, to be prefilled again)."""
        self.preemptions.inc()

    def on_tokens(self, n: int) -> None:
        """``n`` output tokens sampled here were streamed."""
        self.generation_tokens.inc(n)

    def on_finished(self, event, num_prompt_tokens: int = 0) -> None:
        """Record a request that ended normally (``event``: :class:`decode_worker.request.FinishedEvent`);
        ``num_prompt_tokens``: the prompt it prefilled here (colocated), else 0."""
        self.success.labels(**self.labels, finished_reason=event.reason).inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.spec_draft.inc(event.num_draft_tokens)
        self.spec_accepted.inc(event.num_accepted_tokens)


def decode_metrics(registry: CollectorRegistry, worker_id: str, role: str, load: Callable[[], object],
                   ) -> DecodeMetrics:
    """Build a decode worker's metrics on ``registry`` (``role``: ``decode``, or ``both`` colocated);
    ``load()`` returns its current registry entry."""
    labels = {"worker_id": worker_id, "role": role}
    _process_metrics(registry)
    _load_gauges(registry, labels, load)

    def counter(name: str, doc: str) -> Counter:
        return _counter(name, doc, registry, WORKER_LABELS).labels(**labels)

    m = DecodeMetrics(
        success=_counter("request_success_total", "Requests finished on this worker", registry,
                         (*WORKER_LABELS, "finished_reason")),
        prompt_tokens=counter("prompt_tokens_total", "Prompt tokens prefilled here (colocated workers)"),
        generation_tokens=counter("generation_tokens_total", "Output tokens sampled here"),
        spec_draft=counter("spec_decode_num_draft_tokens_total", "Speculative proposals verified"),
        spec_accepted=counter("spec_decode_num_accepted_tokens_total", "Speculative proposals accepted"),
        multi_step_runs=counter("decode_multi_step_runs_total", "Runs of several decode steps in one call "
                                "(multi-step decoding)"),
        multi_step_steps=counter("decode_multi_step_steps_total", "Decode steps run inside multi-step runs"),
        preemptions=counter("num_preemptions_total", "Requests preempted when the KV pool ran short (their "
                            "blocks freed; prefilled again)"),
        labels=labels)
    for reason in FINISH_REASON_NAMES.values():
        m.success.labels(**labels, finished_reason=reason)
    return m


# ---- serving a worker's registry ---------------------------------------------------------
class MetricsServer:
    """prometheus_client's own HTTP server for one registry, on a daemon thread: ``GET /metrics``
    (any path answers the same). ``address``: ``host:port`` as bound."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry) -> None:
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.port = self._server.server_address[1]
        self.address = f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def stop(self) -> None:
        """Stop answering and close the socket."""
        server: ThreadingHTTPServer = self._server
        server.shutdown()
        server.server_close()


def start_metrics_server(host: str, port: int, registry: CollectorRegistry) -> MetricsServer:
    """Serve ``registry`` on ``host:port`` (0: any free port).

    Raises:
        OSError: the port could not be bound.
    """
    return MetricsServer(host, port, registry)
