"""GraphRunner: bucket choice, padding, and outputs identical to the plain runner."""

from __future__ import annotations

import pytest
import torch

from pdserve.decode_worker.graph_runner import GraphRunner
from pdserve.model.kv_cache import BlockPool, KVCacheSpec
from pdserve.model.loader import load_model
from pdserve.model.runner import ModelRunner, StepInput


@pytest.fixture(scope="module")
def setup(model_dir):
    model, cfg = load_model(model_dir)
    spec = KVCacheSpec.for_model(cfg, 64, 4, torch.float32)
    runner, pool = ModelRunner(model, spec), BlockPool(64)
    graph = GraphRunner(runner, pool, max_blocks_per_seq=16, buckets=(1, 2, 4, 8))
    return runner, pool, graph


def test_bucket_choice(setup):
    _, _, graph = setup
    assert [graph.bucket_for(n) for n in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]
    for bad in (0, 9):
        with pytest.raises(ValueError):
            graph.bucket_for(bad)
    with pytest.raises(ValueError):
        GraphRunner(setup[0], BlockPool(4), 4, buckets=(4, 2))


def test_padded_steps_equal_the_plain_runner_and_leave_real_blocks_alone(setup):
    runner, pool, graph = setup
    gen = torch.Generator().manual_seed(0)
    lens = [3, 9, 16, 1, 22]                      # ends mid-block, on a block boundary, one token
    tables = [pool.allocate(-(-(n + 1) // 4)) for n in lens]
    prompts = [torch.randint(3, 2048, (n,), generator=gen).tolist() for n in lens]
    for p, t in zip(prompts, tables):
        runner.run([StepInput(p[:-1] or p, 0, t)] if len(p) > 1 else [StepInput(p, 0, t)])
    steps = [StepInput([p[-1]], len(p) - 1, t) if len(p) > 1 else StepInput([5], 1, t) for p, t in zip(prompts, tables)]
    before = runner.kv_cache.clone()
    plain = runner.run(steps)
    after_plain = runner.kv_cache.clone()
    runner.kv_cache.copy_(before)
    padded = graph.run(steps)                      # 5 rows -> bucket 8, 3 padded rows
    torch.testing.assert_close(padded, plain, rtol=2e-6, atol=1e-5)   # matmuls of 5 and 8 rows round apart
    assert padded.argmax(-1).tolist() == plain.argmax(-1).tolist()
    real = [b for t in tables for b in t]
    # padding wrote only into the scratch block (new K/V may differ in the last bits: another matmul shape)
    torch.testing.assert_close(runner.kv_cache[real], after_plain[real], rtol=0, atol=1e-5)
    assert not torch.equal(runner.kv_cache[graph.scratch_block], before[graph.scratch_block])
    with pytest.raises(ValueError, match="one new token"):
        graph.run([StepInput([1, 2], 0, tables[0])])
    for t in tables:
        pool.free(t)
    assert pool.num_free == 63                      # one block reserved for padding
