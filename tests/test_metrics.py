"""Prometheus metrics of a live cluster (cluster/metrics.py): K requests through a router with its HTTP API
and 1 prefill + 1 decode worker; the router's ``/metrics`` and each worker's metrics server (advertised in
the registry, shown by GetClusterState and ``pdserve status``) agree with K and the usage the responses
reported."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.deploy.status import format_status
from pdserve.proto import pdserve_pb2
from tests.clusters import Cluster
from tests.test_grafana import dashboard_metric_names

K = 5
PROMPTS = ["Once upon a time", "The little dog", "A girl named Lily", "One day, the sun", "Tom and his mom"]


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        return r.read().decode()


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of a ``/metrics`` text: (name, labels, value)."""
    return [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]


def total(text: str, name: str, **labels: str) -> float:
    """The sum of the samples called ``name`` whose labels include ``labels``."""
    found = [v for n, ls, v in samples(text) if n == name and labels.items() <= ls.items()]
    assert found, f"no sample {name} {labels} in:\n{text}"
    return sum(found)


@pytest.fixture(scope="module")
def served(redis_url, model_dir):
    """The cluster and the final messages of K greedy requests (two of them ignore EOS: finish ``length``)."""
    c = Cluster(model_dir, redis_url, router_flags={"http_port": 0})
    try:
        finals = [c.complete(p, max_tokens=6 + i, temperature=0, ignore_eos=i < 2).final
                  for i, p in enumerate(PROMPTS[:K])]
        c.assert_pools_free()
        yield c, finals
    finally:
        c.stop()


def test_router_metrics_agree_with_the_responses(served):
    c, finals = served
    text = scrape(c.router.http_address)
    assert total(text, "pdserve:time_to_first_token_seconds_count") == K
    assert total(text, "pdserve:e2e_request_latency_seconds_count") == K
    assert total(text, "pdserve:request_queue_time_seconds_count") == K
    assert total(text, "pdserve:time_to_first_token_seconds_sum") == pytest.approx(
        sum(f.timings.ttft_s for f in finals), rel=1e-6)
    assert total(text, "pdserve:request_success_total") == K
    for reason, code in (("stop", pdserve_pb2.FINISH_REASON_STOP), ("length", pdserve_pb2.FINISH_REASON_LENGTH)):
        n = sum(f.finish_reason == code for f in finals)
        if n:
            assert total(text, "pdserve:request_success_total", finished_reason=reason) == n
    completion = sum(f.usage.completion_tokens for f in finals)
    assert total(text, "pdserve:prompt_tokens_total") == sum(f.usage.prompt_tokens for f in finals)
    assert total(text, "pdserve:generation_tokens_total") == completion
    # one inter-token observation per output token after each request's first
    assert total(text, "pdserve:inter_token_latency_seconds_count") == completion - K
    assert total(text, "pdserve:request_retries_total") == 0
    assert total(text, "pdserve:request_migrations_total") == 0
    assert total(text, "pdserve:router_requests_waiting_for_kv") == 0   # idle: nobody in the line


def test_worker_metrics_agree_and_are_advertised(served):
    c, finals = served
    workers = {w.worker_id: w for w in c.state().workers}
    assert set(workers) == {"p0", "d0"} and all(w.metrics_address for w in workers.values())
    p_text, d_text = scrape(workers["p0"].metrics_address), scrape(workers["d0"].metrics_address)
    p, d = {"worker_id": "p0", "role": "prefill"}, {"worker_id": "d0", "role": "decode"}
    prompt = sum(f.usage.prompt_tokens for f in finals)
    completion = sum(f.usage.completion_tokens for f in finals)
    assert total(p_text, "pdserve:prompt_tokens_total", **p) == prompt
    assert total(p_text, "pdserve:prefix_cache_queries_total", **p) == prompt
    assert total(p_text, "pdserve:prefix_cache_hits_total", **p) == sum(f.usage.cached_prompt_tokens for f in finals)
    assert total(p_text, "pdserve:kv_transfer_seconds_count", **p) == K
    assert total(p_text, "pdserve:request_queue_time_seconds_count", **p) == K
    assert total(p_text, "pdserve:kv_transfer_bytes_total", **p) > 0
    # P samples each request's first token, D the rest: together the router's count
    assert total(p_text, "pdserve:generation_tokens_total", **p) == K
    assert total(d_text, "pdserve:generation_tokens_total", **d) == completion - K
    assert total(d_text, "pdserve:request_success_total", **d) == K
    assert total(d_text, "pdserve:spec_decode_num_draft_tokens_total", **d) == 0
    for text, labels in ((p_text, p), (d_text, d)):  # idle now: nothing running, the pool free
        assert total(text, "pdserve:num_requests_running", **labels) == 0
        assert total(text, "pdserve:num_requests_waiting", **labels) == 0
        assert total(text, "pdserve:kv_cache_usage_perc", **labels) == 0


def test_status_shows_the_metrics_addresses(served):
    c, _ = served
    state = c.state()
    from pdserve.cluster.registry import WorkerInfo
    infos = [WorkerInfo(worker_id=w.worker_id, role=w.role, address=w.address, metrics_address=w.metrics_address,
                        heartbeat_at=0.0) for w in state.workers]
    text = format_status(c.cluster, infos, 0.0)
    assert "METRICS" in text.splitlines()[1]
    for w in state.workers:
        assert w.metrics_address in text


def test_the_dashboard_queries_only_exposed_metrics(served):
    """Every metric the Grafana dashboard queries is in some process's live ``/metrics``."""
    c, _ = served
    texts = [scrape(c.router.http_address)] + [scrape(w.metrics_address) for w in c.state().workers]
    exposed = {name for text in texts for name, _, _ in samples(text)}
    missing = dashboard_metric_names() - exposed
    assert not missing, f"the dashboard queries metrics no process exposes: {sorted(missing)}"


def test_every_process_froze_its_start_up_heap_and_exports_its_runtime(served):
    """Each process froze what it built at start out of the collector's walks (cluster.service.
    freeze_startup_heap: torch, the model, the tokenizer and the servers are tens of thousands of
    objects; 0 had it not), and exports prometheus-client's GC and process families beside."""
    c, _ = served
    workers = {w.worker_id: w for w in c.state().workers}
    for address in (c.router.http_address, workers["p0"].metrics_address, workers["d0"].metrics_address):
        text = scrape(address)
        assert total(text, "pdserve:gc_frozen_objects") > 10_000, address
        assert total(text, "python_gc_collections_total", generation="0") > 0   # the load collected young objects
        # a real RSS, of a process that imported torch (an empty interpreter is ~10-20 MB): the router, which holds
        # no weights, read 97.7 MB on a Xeon 207 without AVX512-BF16 (2026-12-01), under the 100 MB this once asked
        assert total(text, "process_resident_memory_bytes") > 50e6
