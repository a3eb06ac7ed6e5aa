"""INT4 decode weights and FP8 prefill matmuls for every family: first tokens agree with the
family's float32 run at the rate they do for Llama (random checkpoints of the same construction),
biases stay in float, and a cluster with an FP8 prefill worker and an INT4 decode worker gives
exactly the tokens of those quantized models run in process."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pdserve.model.kv_cache import KVCacheSpec
from pdserve.model.loader import load_model
from pdserve.model.quant import fp8, int4
from pdserve.model.runner import ModelRunner, StepInput
from tests.clusters import Cluster
from tests.conftest import prefill_then_decode
from tests.family_checkpoints import FAMILIES, random_prompt, write_checkpoint

NUM_PROMPTS = 96
# Measured (96 prompts, seed 0; int4 = mse group 32, fp8 = per-channel), first-token top-1 agreement
# with float32, int4 / fp8: llama 0.47 / 0.73, qwen2 0.58 / 0.75, qwen3 0.58 / 0.72, mistral 0.55 / 0.75
# (pytest -s prints them). Random weights have flat logits (tiny top-1 margins), so these rates sit far
# below a trained model's (TinyStories: 85-91%); what is checked is that no family does worse than
# Llama by more than the sampling noise of 96 prompts (about 0.07 per rate).
MARGIN = 0.15


def _first_logits(model, cfg, prompts: list[list[int]]) -> torch.Tensor:
    """Every prompt's next-token logits, from one prefill step over all of them."""
    runner = ModelRunner(model, KVCacheSpec(3 * len(prompts), cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim))
    return runner.run([StepInput(p, 0, [3 * i, 3 * i + 1, 3 * i + 2]) for i, p in enumerate(prompts)])


def _agreement(path: str) -> dict[str, float]:
    model, cfg = load_model(path)
    prompts = [random_prompt(5 + (7 * i) % 40, seed=100 + i) for i in range(NUM_PROMPTS)]
    ref = _first_logits(model, cfg, prompts).argmax(-1)
    q4, f8 = copy.deepcopy(model), copy.deepcopy(model)
    int4.convert_for_runtime(q4, group_size=32)
    fp8.convert_for_runtime(f8)
    return {name: (_first_logits(m, cfg, prompts).argmax(-1) == ref).float().mean().item()
            for name, m in (("int4", q4), ("fp8", f8))}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    return {f: write_checkpoint(f, tmp_path_factory.mktemp(f"quant-{f}"), seed=0) for f in ("llama", *FAMILIES)}


@pytest.fixture(scope="module")
def llama_agreement(checkpoints) -> dict[str, float]:
    return _agreement(checkpoints["llama"])


@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_first_tokens_agree_as_often_as_for_llama(checkpoints, llama_agreement, family):
    got = _agreement(checkpoints[family])
    print(f"{family}: {got}, llama: {llama_agreement}")
    for kind in ("int4", "fp8"):
        assert got[kind] >= llama_agreement[kind] - MARGIN, (kind, got, llama_agreement)


def test_int4_and_fp8_keep_the_qkv_biases_in_float(checkpoints):
    model, _ = load_model(checkpoints["qwen2"])
    reference = model.layers[0].self_attn.qkv_proj.bias.clone()
    q4, f8 = copy.deepcopy(model), copy.deepcopy(model)
    int4.convert_for_runtime(q4, group_size=32)
    fp8.convert_for_runtime(f8)
    for m, kind in ((q4, int4.Int4Linear), (f8, fp8.Fp8Linear)):
        qkv = m.layers[0].self_attn.qkv_proj
        assert isinstance(qkv, kind) and qkv.bias.dtype == torch.float32 and torch.equal(qkv.bias, reference)
    qwen3, _ = load_model(checkpoints["qwen3"], torch.bfloat16)
    int4.convert_for_runtime(qwen3, group_size=32)
    attn = qwen3.layers[1].self_attn
    assert isinstance(attn.q_norm, nn.Module) and attn.k_norm.weight.dtype == torch.bfloat16   # norms stay as loaded


def _expected(path: str, prompt: list[int], num_tokens: int) -> list[int]:
    """FP8 prefill (first token and KV pages), then INT4 decode over those pages."""
    prefill_model, cfg = load_model(path)
    fp8.convert_for_runtime(prefill_model)
    decode_model, _ = load_model(path)
    int4.convert_for_runtime(decode_model, group_size=32)
    return prefill_then_decode(prefill_model, decode_model, cfg, prompt, num_tokens)


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_prefill_and_int4_decode_workers_run_the_quantized_models(redis_url, checkpoints, family):
    prompts = [random_prompt(9, seed=1), random_prompt(23, seed=2)]
    expected = [_expected(checkpoints[family], p, 12) for p in prompts]
    c = Cluster(checkpoints[family], redis_url, prefill_flags={"activations": "fp8"},
                decode_flags={"weights": "int4", "int4_group_size": 32})
    try:
        got = [c.complete(p, max_tokens=12, temperature=0, ignore_eos=True).token_ids for p in prompts]
        assert got == expected
        c.assert_pools_free()
    finally:
        c.stop()
