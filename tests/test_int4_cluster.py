"""`--weights int4` on the decode worker: the tokens after the first are the INT4 model's,
decoding over the KV pages the (fp32) prefill worker sent."""

from __future__ import annotations

from pdserve.model.loader import load_model
from pdserve.model.quant import int4
from tests.clusters import Cluster
from tests.conftest import prefill_then_decode


def _expected(model_dir: str, prompt: list[int], num_tokens: int) -> list[int]:
    fp32, cfg = load_model(model_dir)
    quant, _ = load_model(model_dir)
    int4.convert_for_runtime(quant, group_size=32)
    return prefill_then_decode(fp32, quant, cfg, prompt, num_tokens)


def test_decode_worker_runs_int4_weights(redis_url, model_dir):
    prompt = [1, 1094, 463, 622, 100, 258, 461, 715, 299]  # INT4 greedy leaves fp32's path at the 3rd token
    expected = _expected(model_dir, prompt, 12)
    c = Cluster(model_dir, redis_url, decode_flags={"weights": "int4", "int4_group_size": 32})
    try:
        assert c.complete(prompt, max_tokens=12, temperature=0).token_ids == expected
        c.assert_pools_free()
    finally:
        c.stop()
