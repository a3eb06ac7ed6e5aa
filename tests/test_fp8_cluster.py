"""`--activations fp8` on the prefill worker: the cluster's first token is the FP8 model's."""

from __future__ import annotations

from pdserve.model.kv_cache import KVCacheSpec
from pdserve.model.loader import load_model
from pdserve.model.quant import fp8
from pdserve.model.runner import ModelRunner, StepInput
from tests.clusters import Cluster

PROMPTS = [[1, 400, 500, 600, 33, 44], [1, 1094, 463, 622, 100, 258, 461, 715, 299], list(range(1, 70))]


def test_prefill_worker_runs_fp8_matmuls(redis_url, model_dir):
    model, cfg = load_model(model_dir)
    fp8.convert_for_runtime(model)
    runner = ModelRunner(model, KVCacheSpec.for_model(cfg, 16, 16, model.embed_tokens.weight.dtype))
    expected = [int(runner.run([StepInput(p, 0, list(range(5)))])[0].argmax()) for p in PROMPTS]
    c = Cluster(model_dir, redis_url, prefill_flags={"activations": "fp8"})
    try:
        firsts = [c.complete(p, max_tokens=3, temperature=0).token_ids[0] for p in PROMPTS]
        assert firsts == expected
        c.assert_pools_free()
    finally:
        c.stop()
