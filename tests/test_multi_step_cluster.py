"""Multi-step decoding through the whole cluster (router -> prefill -> KV -> decode worker process ->
client): a bf16 decode worker with multi-step decoding streams, for greedy and for seeded temperature
sampling, exactly the tokens of one with single steps, its bursts reach the client as token deltas, and
every block comes back."""

from __future__ import annotations

import pytest

from pdserve.bench.common import worker_metric
from pdserve.kernels.cpu.decode_stack import stack_available
from tests.clusters import Cluster

pytestmark = pytest.mark.skipif(not stack_available(bf16_packed=True), reason="no C compiler or no AVX2")
PROMPTS = [[1, 1094, 463, 622, 100, 258], [1, 400, 500, 600], [1, 7, 8, 9, 10, 11, 12, 13]]
REQUESTS = [dict(max_tokens=40, temperature=0, ignore_eos=True), dict(max_tokens=40, temperature=0.9, seed=7,
                                                                     ignore_eos=True),
            dict(max_tokens=33, temperature=1.4, seed=11, top_k=20, ignore_eos=True),
            dict(max_tokens=25, temperature=0)]


def _outputs(redis_url: str, model_dir: str, multi_step: int) -> tuple[list[list[int]], float, float]:
    """Every request's tokens, then the decode worker's multi-step runs and the steps they ran."""
    c = Cluster(model_dir, redis_url, dtype="bfloat16", decode_flags={"multi_step": multi_step,
                                                                      "multi_step_window_s": 1.0})
    try:
        out = [c.complete(p, **kw).token_ids for p in PROMPTS for kw in REQUESTS]
        c.assert_pools_free()
        address = next(w for w in c.state().workers if w.role == "decode").metrics_address
        return (out, worker_metric(address, "decode_multi_step_runs_total"),
                worker_metric(address, "decode_multi_step_steps_total"))
    finally:
        c.stop()


def test_multi_step_streams_the_tokens_of_single_steps(redis_url, model_dir):
    single, runs, _ = _outputs(redis_url, model_dir, 1)
    multi, multi_runs, multi_steps = _outputs(redis_url, model_dir, 8)
    assert multi == single
    assert runs == 0 and multi_runs >= 12 and multi_steps >= 4 * multi_runs     # runs of several steps did happen
    assert all(len(t) == kw["max_tokens"] for t, kw in zip(multi, REQUESTS * len(PROMPTS)) if kw.get("ignore_eos"))
    assert single[1] != single[0]                      # the sampled request did sample
