"""The whole decode step in one C call (kernels/cpu/decode_graph.py, decode_stack.c: pd_decode_graph)
against the graph runner's padded per-operation step: bit-identical logits and KV cache for every
family option, bf16 and INT4 projections; rotary tables grown with the context; rows out of range
refused before anything is written; the graph rebuilt when weights move; the eager step kept where
the stack cannot run."""

from __future__ import annotations

import ctypes

import pytest
import torch

from pdserve.decode_worker.graph_runner import GraphRunner
from pdserve.kernels.cpu.decode_stack import stack_available
from pdserve.model.cpu_linear import pack_for_cpu_decode
from pdserve.model.hugepages import move_to_huge_pages
from pdserve.model.kv_cache import BlockPool, KVCacheSpec
from pdserve.model.loader import load_model
from pdserve.model.quant import int4
from pdserve.model.runner import ModelRunner, StepInput
from pdserve.model.sampling import log_noise, temperature_draw
from tests.family_checkpoints import write_checkpoint

pytestmark = pytest.mark.skipif(not stack_available(bf16_packed=True), reason="no C compiler or no AVX2")
needs_int4 = pytest.mark.skipif(not stack_available(int4=True, bf16_packed=True), reason="no AVX512-VNNI")
VARIANTS = {"llama-biases": ("llama", dict(attention_bias=True, mlp_bias=True)), "qwen2": ("qwen2", {}),
            "qwen3": ("qwen3", {}), "mistral": ("mistral", {})}
BLOCK, BLOCKS, WIDTH = 4, 400, 72


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    return {name: write_checkpoint(family, tmp_path_factory.mktemp(name), **over)
            for name, (family, over) in VARIANTS.items()}


def _runner(path: str, weights: str) -> tuple[ModelRunner, BlockPool, GraphRunner]:
    model, cfg = load_model(path, torch.bfloat16)
    if weights == "int4":
        int4.convert_for_runtime(model, group_size=32, method="rtn")
    pack_for_cpu_decode(model)                     # the bf16 projections and the LM head
    runner, pool = ModelRunner(model, KVCacheSpec.for_model(cfg, BLOCKS, BLOCK, torch.bfloat16)), BlockPool(BLOCKS)
    return runner, pool, GraphRunner(runner, pool, max_blocks_per_seq=WIDTH, buckets=(1, 2, 4, 8))


def _prefill(runner: ModelRunner, pool: BlockPool, lens: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts of ``lens`` tokens prefilled through the per-operation path; returns (prompts, block tables)."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 900, (n,), generator=gen).tolist() for n in lens]
    tables = [pool.allocate(WIDTH) for _ in lens]
    for p, t in zip(prompts, tables):
        runner.run([StepInput(p, 0, t)])
    return prompts, tables


def _decode(graph: GraphRunner, eager: bool, prompts, tables, steps: int) -> list[torch.Tensor]:
    """``steps`` greedy decode steps of every sequence (eager: the padded per-operation step)."""
    seqs, out = [list(p) for p in prompts], []
    for _ in range(steps):
        batch = [StepInput([s[-1]], len(s) - 1, t) for s, t in zip(seqs, tables)]
        if eager:
            graph._fill(batch, graph.bucket_for(len(batch)))
            logits = graph._forward(graph.bucket_for(len(batch)))[:len(batch)]
        else:
            logits = graph.run(batch)
        out.append(logits.clone())
        for s, token in zip(seqs, logits.argmax(-1).tolist()):
            s.append(token)
    return out


@pytest.mark.parametrize("weights", ["bf16", pytest.param("int4", marks=needs_int4)])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_graph_step_is_bit_identical_to_the_eager_step(variant, weights, checkpoints):
    runner, pool, graph = _runner(checkpoints[variant], weights)
    prompts, tables = _prefill(runner, pool, [3, 8, 1, 13, 254])   # mid-block, on a boundary, across 256 tokens
    before = runner.kv_cache.clone()
    eager = _decode(graph, True, prompts, tables, 6)
    eager_cache = runner.kv_cache.clone()
    assert graph._cpu_graph is None                     # the eager path never built one
    runner.kv_cache.copy_(before)
    fast = _decode(graph, False, prompts, tables, 6)
    assert graph._cpu_graph is not None and graph._cpu_graph._graph.positions >= 254 + 6
    for f, e in zip(fast, eager):
        assert f.dtype == torch.float32 and f.shape == (5, graph.runner.model.cfg.vocab_size) and torch.equal(f, e)
    real = [b for t in tables for b in t]
    assert torch.equal(runner.kv_cache[real], eager_cache[real])   # the graph step pads nothing


def test_rows_out_of_range_are_refused_before_anything_is_written(checkpoints):
    runner, pool, graph = _runner(checkpoints["qwen3"], "bf16")
    prompts, tables = _prefill(runner, pool, [5, 9])
    vocab = runner.model.cfg.vocab_size
    before = runner.kv_cache.clone()
    bad = [[StepInput([vocab], 5, tables[0]), StepInput([7], 9, tables[1])],              # token past the vocab
           [StepInput([7], 5, tables[0]), StepInput([-1], 9, tables[1])],
           [StepInput([7], 5, [0, BLOCKS]), StepInput([7], 9, tables[1])],                  # block past the cache
           [StepInput([7], WIDTH * BLOCK, tables[0])]]                                       # context past the table
    for batch in bad:
        with pytest.raises(ValueError, match="out of range"):
            graph.run(batch)
        assert torch.equal(runner.kv_cache, before)
    good = graph.run([StepInput([7], 5, tables[0]), StepInput([7], 9, tables[1])])   # the graph is still usable
    assert torch.isfinite(good).all()


def test_moved_weights_rebuild_the_graph(checkpoints):
    runner, pool, graph = _runner(checkpoints["mistral"], "bf16")
    prompts, tables = _prefill(runner, pool, [6, 11])
    before = runner.kv_cache.clone()
    want = _decode(graph, False, prompts, tables, 3)
    first = graph._cpu_graph
    move_to_huge_pages(runner.model)                    # new storages for every weight
    assert not first.valid()
    runner.kv_cache.copy_(before)
    got = _decode(graph, False, prompts, tables, 3)
    assert graph._cpu_graph is not first and graph._cpu_graph.valid()
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_models_the_stack_cannot_run_keep_the_eager_step(checkpoints):
    runner, pool, graph = _runner(checkpoints["qwen2"], "bf16")
    prompts, tables = _prefill(runner, pool, [4, 7])
    runner.model.cpu_stack = False
    off = _decode(graph, False, prompts, tables, 2)
    assert graph._cpu_graph is None
    runner.model.cpu_stack = True
    assert all(torch.isfinite(t).all() for t in off)


def _argmax_steps(graph: GraphRunner, prompts, tables, steps: int) -> list[list[int]]:
    """Per sequence, the tokens of ``steps`` single graph steps, each fed the last one's argmax."""
    return [[int(t) for t in col] for col in zip(*[lg.argmax(-1).tolist()
                                                   for lg in _decode(graph, False, prompts, tables, steps)])]


@pytest.mark.parametrize("weights", ["bf16", pytest.param("int4", marks=needs_int4)])
@pytest.mark.parametrize("variant", ["llama-biases", "qwen3"])
def test_multi_step_greedy_gives_the_tokens_and_cache_of_single_steps(variant, weights, checkpoints):
    runner, pool, graph = _runner(checkpoints[variant], weights)
    prompts, tables = _prefill(runner, pool, [3, 8, 13, 254])
    before = runner.kv_cache.clone()
    want = _argmax_steps(graph, prompts, tables, 7)
    want_cache = runner.kv_cache.clone()
    runner.kv_cache.copy_(before)
    batch = [StepInput([p[-1]], len(p) - 1, t) for p, t in zip(prompts, tables)]
    got = graph.run_steps(batch, 7)
    assert got == want
    assert torch.equal(runner.kv_cache, want_cache)
    assert graph.input_ids[:4].tolist() == [p[-1] for p in prompts]      # the static buffers are the caller's
    assert graph.seq_lens[:4].tolist() == [len(p) for p in prompts]


def test_multi_step_ends_after_a_stop_token_or_an_interrupt(checkpoints):
    runner, pool, graph = _runner(checkpoints["mistral"], "bf16")
    prompts, tables = _prefill(runner, pool, [6, 11])
    before = runner.kv_cache.clone()
    want = _argmax_steps(graph, prompts, tables, 6)
    batch = [StepInput([p[-1]], len(p) - 1, t) for p, t in zip(prompts, tables)]
    stop = want[1][3]
    first = min(i for i in range(6) if stop in (want[0][i], want[1][i]))
    runner.kv_cache.copy_(before)
    assert graph.run_steps(batch, 6, stop_ids=[stop]) == [w[:first + 1] for w in want]
    runner.kv_cache.copy_(before)
    flag = ctypes.c_int32(1)                       # work already posted: one step, then back to the scheduler
    assert graph.run_steps(batch, 6, interrupt=flag) == [w[:1] for w in want]


def test_multi_step_refuses_rows_whose_blocks_cannot_hold_every_step(checkpoints):
    runner, pool, graph = _runner(checkpoints["qwen2"], "bf16")
    prompts, tables = _prefill(runner, pool, [5, 9])
    before = runner.kv_cache.clone()
    short = [StepInput([7], 5, tables[0]), StepInput([7], WIDTH * BLOCK - 3, tables[1])]   # 3 positions left
    with pytest.raises(ValueError, match="out of range"):
        graph.run_steps(short, 4)
    assert torch.equal(runner.kv_cache, before)                     # checked before the first step wrote
    assert len(graph.run_steps(short, 3)[1]) == 3
    with pytest.raises(ValueError, match="steps"):
        graph.run_steps(short, 0)


def test_multi_step_sampling_gives_the_tokens_of_single_steps(checkpoints):
    """Rows sampled from softmax(logits / T), one with a top-k cut, with noise drawn ahead pick what
    model.sampling.temperature_draw picks from each single step's logits; a greedy row beside them stays greedy."""
    runner, pool, graph = _runner(checkpoints["qwen3"], "bf16")
    prompts, tables = _prefill(runner, pool, [4, 9, 17, 6])
    vocab, steps, temps, top_ks = runner.model.cfg.vocab_size, 6, [0.7, 0.0, 1.3, 1.1], [0, 0, 0, 5]
    noise = torch.stack([torch.stack([log_noise(11 + i, s, vocab) for i in range(4)]) for s in range(steps)])
    before = runner.kv_cache.clone()
    seqs, want = [list(p) for p in prompts], [[] for _ in prompts]
    for s in range(steps):
        logits = graph.run([StepInput([q[-1]], len(q) - 1, t) for q, t in zip(seqs, tables)])
        for i, q in enumerate(seqs):
            token = int(logits[i].argmax()) if temps[i] == 0 else temperature_draw(logits[i], temps[i], noise[s, i],
                                                                                    top_ks[i])
            q.append(token)
            want[i].append(token)
    runner.kv_cache.copy_(before)
    batch = [StepInput([p[-1]], len(p) - 1, t) for p, t in zip(prompts, tables)]
    got = graph.run_steps(batch, steps, torch.tensor(temps), noise.contiguous(),
                          top_ks=torch.tensor(top_ks, dtype=torch.int32))
    assert got == want
    assert len(set(want[0])) > 1 and want[0] != want[1]                 # the sampled rows did sample
    with pytest.raises(ValueError, match="log_noise"):
        graph.run_steps(batch, steps, torch.tensor(temps), noise[:, :2].contiguous())
