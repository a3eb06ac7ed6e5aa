"""Mixtures of experts (Qwen3-MoE, Mixtral; model/moe.py) against ``transformers``: prefill logits of checkpoints
its own classes wrote (experts saved under their hub names), chunked prefill and paged decode through the cache,
the bf16 CPU path with the experts on the packed kernels, and greedy output through the disaggregated cluster,
single and batched; quantization refused by name."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from pdserve.deploy import client
from pdserve.deploy.config import ClusterConfig
from pdserve.kernels.cpu.gemv import packed_bf16_available
from pdserve.model.config import ModelConfig
from pdserve.model.cpu_linear import PackedBF16Linear, pack_for_cpu_decode
from pdserve.model.cpu_stack import build_decode_stack
from pdserve.model.kv_cache import KVCacheSpec
from pdserve.model.loader import load_model
from pdserve.model.moe import SparseMoeBlock
from pdserve.model.quant import int4
from pdserve.model.quant.int4_checkpoint import create_quantized_state_dict
from pdserve.model.runner import ModelRunner, StepInput
from tests.clusters import Cluster
from tests.conftest import hf_greedy
from tests.family_checkpoints import check_chunked_prefill_and_decode, hf_model, random_prompt, write_checkpoint

VARIANTS = {  # name -> (family, overrides)
    "qwen3_moe": ("qwen3_moe", {}),                                   # renormalized top-2 of 6; layer 1 dense
    "qwen3_moe-raw-top3": ("qwen3_moe", dict(norm_topk_prob=False, num_experts_per_tok=3, mlp_only_layers=[])),
    "qwen3_moe-sparse-step-2": ("qwen3_moe", dict(decoder_sparse_step=2, mlp_only_layers=[])),
    "mixtral": ("mixtral", {}),
    "qwen2_moe": ("qwen2_moe", {}),                                   # a shared expert beside top-2 of 5
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    return {name: write_checkpoint(family, tmp_path_factory.mktemp(name), seed=30 + i, **over)
            for i, (name, (family, over)) in enumerate(VARIANTS.items())}


def _runner(path, dtype=torch.float32, block_size=4):
    model, cfg = load_model(path, dtype)
    return ModelRunner(model, KVCacheSpec(128, cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim, dtype)), cfg


def test_the_sparse_layers_follow_the_config(checkpoints):
    layers = {name: ModelConfig.from_hf_dir(path).moe_layers for name, path in checkpoints.items()}
    assert layers == {"qwen3_moe": (0,), "qwen3_moe-raw-top3": (0, 1), "qwen3_moe-sparse-step-2": (1,),
                      "mixtral": (0, 1), "qwen2_moe": (0, 1)}
    model, cfg = load_model(checkpoints["qwen3_moe"])
    assert isinstance(model.layers[0].mlp, SparseMoeBlock) and not isinstance(model.layers[1].mlp, SparseMoeBlock)
    assert len(model.layers[0].mlp.experts) == 6 and model.layers[0].mlp.experts[0].intermediate == 48
    assert model.layers[1].mlp.intermediate == cfg.intermediate_size == 80


@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_logits_match_transformers(checkpoints, variant):
    runner, _ = _runner(checkpoints[variant])
    ids = random_prompt(120, seed=2)
    logits = runner.run([StepInput(ids, 0, list(range(40, 80)))], all_logits=True)
    with torch.no_grad():
        ref = hf_model(checkpoints[variant])(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, ref, rtol=0, atol=2e-5)


@pytest.mark.parametrize("variant", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_chunked_prefill_and_decode_through_the_cache_match_one_pass(checkpoints, variant):
    check_chunked_prefill_and_decode(_runner(checkpoints[variant], block_size=5)[0], seed=3)


@pytest.mark.skipif(not packed_bf16_available(), reason="needs the packed bf16 kernels (AVX-512 or AVX2)")
@pytest.mark.parametrize("variant", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_bf16_decode_steps_run_the_mixture_in_the_one_call_stack(checkpoints, variant):
    """Router and experts packed, decode steps of three sequences in the one-call C stack (decode_stack.c:
    moe_mlp; Qwen3-MoE's dense layer beside a sparse one), and their prefill and decode steps with each mixture
    in one C call (MoeBlock): bit-identical to the per-operation path in Python on the same kernels, and within
    bf16 rounding of the float32 model. Qwen2-MoE's shared expert keeps it per operation."""
    path = checkpoints[variant]
    stacked, blocked, per_op, ref = (_runner(path, dtype, 5)[0] for dtype in (torch.bfloat16,) * 3 + (torch.float32,))
    for r in (stacked, blocked, per_op):
        pack_for_cpu_decode(r.model)
    blocked.model.cpu_stack = per_op.model.cpu_stack = False
    for layer in per_op.model.layers:                 # the mixture in Python, not in one C call (MoeBlock)
        if isinstance(layer.mlp, SparseMoeBlock):
            layer.mlp.c_block = False
    block = stacked.model.layers[0].mlp
    assert type(block.gate) is PackedBF16Linear and all(
        type(e.gate_up_proj) is PackedBF16Linear and type(e.down_proj) is PackedBF16Linear for e in block.experts)
    assert (build_decode_stack(stacked.model) is None) == (variant == "qwen2_moe")
    prompts = [random_prompt(n, seed=70 + n) for n in (20, 9, 14)]
    tables = [[3, 1, 8, 9, 0], [11, 12], [20, 21, 22, 23]]
    prefills = [r.run([StepInput(p[:-1], 0, t) for p, t in zip(prompts, tables)])
                for r in (stacked, blocked, per_op, ref)]
    steps = [r.run([StepInput([p[-1]], len(p) - 1, t) for p, t in zip(prompts, tables)])
             for r in (stacked, blocked, per_op, ref)]
    assert torch.equal(prefills[0], prefills[1]) and torch.equal(prefills[1], prefills[2])
    assert torch.equal(steps[0], steps[1]) and torch.equal(steps[1], steps[2])
    torch.testing.assert_close(steps[0].float(), steps[3], rtol=0, atol=0.15)
    from pdserve.model.cpu_stack import moe_block
    sparse = next(layer.mlp for layer in blocked.model.layers if isinstance(layer.mlp, SparseMoeBlock))
    assert (moe_block(sparse, torch.bfloat16) is None) == (variant == "qwen2_moe")


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "qwen2_moe"])
def cluster(request, checkpoints, redis_url):
    c = Cluster(checkpoints[request.param], redis_url, block_size=5, prefill_flags={"max_num_batched_tokens": 8},
                decode_flags={"speculative": "ngram", "spec_k": 3, "spec_adaptive": "false", "spec_max_batch_size": 8})
    try:
        yield request.param, c
    finally:
        c.stop()


def test_greedy_matches_transformers_through_the_cluster(cluster, checkpoints):
    """Single requests through chunked prefill, and six at once (batched decode steps routing their tokens to
    different experts; n-gram speculation verifying drafts through the mixture), each equal to transformers'
    greedy output."""
    variant, c = cluster
    hf = hf_model(checkpoints[variant])
    cases = [(random_prompt(n, seed=40 + n), 20) for n in (1, 7, 13, 26)] + [([11, 12, 13, 14] * 4, 24)]
    for ids, m in cases:
        assert c.complete(ids, max_tokens=m, temperature=0.0).token_ids == hf_greedy(hf, ids, m), len(ids)

    async def all_at_once(channel):
        return await asyncio.gather(*[client.complete(channel, client.make_request(ids, max_tokens=m, temperature=0))
                                      for ids, m in cases + [(random_prompt(9, seed=s), 16) for s in (60, 61)]])

    together = c.run(all_at_once)
    for (ids, m), done in zip(cases + [(random_prompt(9, seed=s), 16) for s in (60, 61)], together):
        assert done.token_ids == hf_greedy(hf, ids, m), len(ids)
    assert sum(done.final.speculative.num_draft_tokens for done in together) > 0
    c.assert_pools_free()


def test_int4_experts_decode_in_the_stack_as_per_operation(checkpoints):
    """--weights int4 (mse, load time) quantizes every expert and leaves the router in float; decode steps in the
    one-call stack equal the per-operation path's, and stay near the float32 model's logits."""
    path = checkpoints["qwen3_moe"]
    stacked, per_op, ref = (_runner(path, dtype, 5)[0] for dtype in (torch.bfloat16, torch.bfloat16, torch.float32))
    for r in (stacked, per_op):
        int4.convert_for_runtime(r.model, group_size=32)
        pack_for_cpu_decode(r.model)
    per_op.model.cpu_stack = False
    for layer in per_op.model.layers:                 # the mixture in Python, not in one C call (MoeBlock)
        if isinstance(layer.mlp, SparseMoeBlock):
            layer.mlp.c_block = False
    block = stacked.model.layers[0].mlp
    assert all(type(e.gate_up_proj) is int4.Int4Linear and type(e.down_proj) is int4.Int4Linear
               for e in block.experts) and type(block.gate) is PackedBF16Linear
    stack = build_decode_stack(stacked.model)
    prompts, tables = [random_prompt(n, seed=80 + n) for n in (12, 7)], [[4, 5, 6], [9, 10]]
    for r in (stacked, per_op, ref):
        r.run([StepInput(p[:-1], 0, t) for p, t in zip(prompts, tables)])
    steps = [r.run([StepInput([p[-1]], len(p) - 1, t) for p, t in zip(prompts, tables)])
             for r in (stacked, per_op, ref)]
    if stack is not None:                    # the INT4 C kernel runs here (AVX512-VNNI or AVX2)
        assert torch.equal(steps[0], steps[1])
        from pdserve.model.cpu_stack import moe_block
        x = torch.randn(9, block.gate.in_features).to(torch.bfloat16)
        assert torch.equal(moe_block(block, torch.bfloat16)(x), block.forward_per_op(x, True))  # INT4 experts
    cos = torch.nn.functional.cosine_similarity(steps[0].float(), steps[2], dim=-1)
    assert bool((cos > 0.98).all()), cos


def test_what_a_mixture_cannot_be_quantized_with_is_refused_by_name(checkpoints):
    path = checkpoints["qwen3_moe"]
    model, _ = load_model(path)
    with pytest.raises(ValueError, match="INT4 gptq calibration .*not supported for mixture-of-experts"):
        int4.convert_for_runtime(model, group_size=32, method="gptq")
    with pytest.raises(ValueError, match="a pre-quantized INT4 checkpoint .*not supported for mixture-of-experts"):
        create_quantized_state_dict(model, 32, "mse")
    cfg = ClusterConfig(model_dir=path)
    for change, flag in ((dict(decode_options={"weights": "int4", "int4_method": "gptq"}), "--int4-method gptq"),
                         (dict(prefill_options={"activations": "fp8"}), "--activations fp8")):
        with pytest.raises(ValueError, match=f"{flag}: not supported for mixture-of-experts"):
            dataclasses.replace(cfg, **change).check_roles()
    dataclasses.replace(cfg, decode_options={"weights": "int4"}).check_roles()


def test_a_config_with_more_experts_a_token_than_experts_is_refused(checkpoints, tmp_path):
    raw = json.loads((Path(checkpoints["qwen3_moe"]) / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(raw | {"num_experts_per_tok": 7}))
    with pytest.raises(ValueError, match="num_experts_per_tok in \\[1, num_experts\\].*6 experts, 7 per token"):
        ModelConfig.from_hf_dir(bad)
