"""Every family's model in process against ``transformers``: prefill logits, chunked prefill and
paged decode, the CPU C kernels (per-head q/k norm fused into RoPE + KV write), colocated serving
with self-draft and draft-model speculation, and the ``make-model`` presets."""

from __future__ import annotations

import copy

import pytest
import torch

from pdserve.decode_worker.request import FinishedEvent, TokensEvent
from pdserve.kernels.cpu import available
from pdserve.kernels.cpu import fused as cfused
from pdserve.kernels.cpu.gemv import packed_bf16_available
from pdserve.kernels.paged_attention import write_kv
from pdserve.model.cpu_linear import pack_for_cpu_decode
from pdserve.model.hugepages import move_to_huge_pages
from pdserve.model.kv_cache import KVCacheSpec
from pdserve.model.llama import RMSNorm
from pdserve.model.loader import load_model
from pdserve.model.rope import apply_rotary
from pdserve.model.runner import ModelRunner, StepInput
from pdserve.model.sampling import SamplingParams
from tests.conftest import hf_greedy
from tests.family_checkpoints import (
    FAMILIES,
    check_chunked_prefill_and_decode,
    hf_model,
    random_prompt,
    write_checkpoint,
)

VARIANTS = {  # name -> (family, overrides): the families plus the options their real checkpoints vary
    "qwen2": ("qwen2", {}),
    "qwen2-untied-2kv": ("qwen2", dict(tie_word_embeddings=False, num_key_value_heads=2)),
    "qwen3": ("qwen3", {}),
    "qwen3-attention-bias-tied": ("qwen3", dict(attention_bias=True, tie_word_embeddings=True)),
    "mistral": ("mistral", {}),
    "phi3": ("phi3", {}),
    "phi3-2kv-tied": ("phi3", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   tie_word_embeddings=True)),
    "granite": ("granite", {}),
    "granite-untied": ("granite", dict(tie_word_embeddings=False, attention_bias=False, mlp_bias=False)),
    "llama-rope-llama3": ("llama", dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                          high_freq_factor=4.0, original_max_position_embeddings=64))),
    "llama-rope-linear": ("llama", dict(rope_scaling=dict(rope_type="linear", factor=4.0))),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    return {name: write_checkpoint(family, tmp_path_factory.mktemp(name), seed=i, **over)
            for i, (name, (family, over)) in enumerate(VARIANTS.items())}


def _runner(path, dtype=torch.float32, num_blocks=128, block_size=4):
    model, cfg = load_model(path, dtype)
    return ModelRunner(model, KVCacheSpec(num_blocks, cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim,
                                          dtype)), cfg


@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_logits_match_transformers(checkpoints, variant):
    runner, cfg = _runner(checkpoints[variant])
    hf = hf_model(checkpoints[variant])
    ids = random_prompt(150, seed=0)            # past the llama3 variant's original 64-token context
    logits = runner.run([StepInput(ids, 0, list(range(40, 80)))], all_logits=True)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, ref, rtol=0, atol=2e-5)


@pytest.mark.parametrize("variant", ["qwen2", "qwen3-attention-bias-tied", "mistral", "phi3", "granite"])
def test_chunked_prefill_and_decode_through_the_cache_match_one_pass(checkpoints, variant):
    """Chunks ending mid-block over scattered blocks, and decode steps on the C kernels (fp32), equal
    one unchunked pass."""
    check_chunked_prefill_and_decode(_runner(checkpoints[variant], block_size=5)[0], seed=1)


@pytest.mark.skipif(not available("fused"), reason="no C compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rope_write_kv_applies_the_per_head_qk_norm_as_the_torch_code(dtype):
    """bf16: bit-identical to RMSNorm per head then RoPE; float32: within the RMS summation order."""
    torch.manual_seed(2)
    heads, kv_heads, dim, n, eps = 3, 1, 40, 4, 1e-5
    qkv = (torch.randn(n, (heads + 2 * kv_heads) * dim) * 3).to(dtype)
    q_norm, k_norm = RMSNorm(dim, eps).to(dtype), RMSNorm(dim, eps).to(dtype)
    q_norm.weight.data, k_norm.weight.data = (1 + torch.randn(dim) * 0.3).to(dtype), torch.randn(dim).to(dtype)
    pos = torch.tensor([3, 9, 10, 0])
    inv = 1.0 / (1e6 ** (torch.arange(0, dim, 2).float() / dim))
    emb = torch.cat((pos[:, None] * inv, pos[:, None] * inv), -1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    slots = torch.tensor([3, 14, 15, 29])
    cache = torch.zeros(6, 2, 2, 5, kv_heads, dim, dtype=dtype)
    q_out = cfused.rope_write_kv(qkv, cos, sin, cache, 1, slots, heads, kv_heads, dim, q_norm.weight, k_norm.weight,
                                 eps)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    q_ref = apply_rotary(q_norm(q.reshape(n, heads, dim)), cos, sin)
    ref_cache = torch.zeros_like(cache)
    write_kv(ref_cache, 1, apply_rotary(k_norm(k.reshape(n, kv_heads, dim)), cos, sin), v.view(n, kv_heads, dim), slots)
    if dtype == torch.bfloat16:
        assert torch.equal(q_out, q_ref.float()) and torch.equal(cache, ref_cache)
    else:
        torch.testing.assert_close(q_out, q_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache, ref_cache, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="q_norm and k_norm"):
        cfused.rope_write_kv(qkv, cos, sin, cache, 1, slots, heads, kv_heads, dim, q_norm.weight, None, eps)


@pytest.mark.skipif(not packed_bf16_available(), reason="no AVX2 or no C compiler")
@pytest.mark.parametrize("variant", ["qwen2", "qwen3", "mistral", "phi3", "granite"])
def test_packed_bf16_model_matches_the_plain_bf16_model(checkpoints, variant):
    """The decode worker's bf16 model (packed linears with biases added after the product, C attention,
    fused ops with the q/k norm) against the same weights through torch: logits of decode steps at 1,
    2 and 5 rows agree to bf16 precision and mostly pick the same greedy tokens."""
    plain, cfg = load_model(checkpoints[variant], torch.bfloat16)
    packed = copy.deepcopy(plain)
    assert pack_for_cpu_decode(packed) == 4 * cfg.num_layers + 1
    move_to_huge_pages(packed)
    spec = KVCacheSpec(64, cfg.num_layers, 4, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    runners = [ModelRunner(m, spec) for m in (plain, packed)]
    for rows in (1, 2, 5):
        seqs = [random_prompt(6 + r, seed=r) for r in range(rows)]
        tables = [list(range(5 * r, 5 * r + 5)) for r in range(rows)]
        outs = []
        for runner in runners:
            prefill = runner.run([StepInput(s, 0, t) for s, t in zip(seqs, tables)])
            outs.append(runner.run([StepInput([int(p.argmax())], len(s), t)
                                    for p, s, t in zip(prefill, seqs, tables)]))
        a, b = outs
        torch.testing.assert_close(b, a, rtol=0, atol=a.abs().max().item() * 2 ** -5)
        assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.6


def _colocated_engine(path: str, **flags):
    from pdserve.decode_worker.config import DecodeWorkerConfig
    from pdserve.decode_worker.engine import DecodeEngine

    model, cfg = load_model(path)
    return DecodeEngine(DecodeWorkerConfig(model_dir=path, worker_id="t", num_blocks=96, block_size=5,
                                           max_batch_size=4, colocated=True, max_num_batched_tokens=9, **flags),
                        model, cfg)


def _generate(engine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], list[FinishedEvent]]:
    events: list[list] = [[] for _ in prompts]
    for i, p in enumerate(prompts):
        engine.add_local(f"r{i}", p, SamplingParams(temperature=0, max_tokens=max_tokens), events[i].append)
    for _ in range(400):
        engine.step()
        if all(evs and not isinstance(evs[-1], TokensEvent) for evs in events):
            break
    assert all(isinstance(evs[-1], FinishedEvent) for evs in events), [evs[-1] for evs in events]
    assert engine.pool.num_free == engine.num_usable_blocks           # every block back
    return [[t for ev in evs if isinstance(ev, TokensEvent) for t in ev.token_ids] for evs in events], \
        [evs[-1] for evs in events]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["none", "self", "draft-same", "draft-other"])
def test_colocated_engine_with_speculation_matches_transformers(checkpoints, tmp_path, family, mode):
    """Colocated serving (chunked local prefill beside decodes, 9-token budget) with no speculation,
    self-draft (1 layer) or a draft model of the same family (the target's own weights: mostly
    accepted; another 1-layer random model: mostly rejected): greedy output equals transformers'."""
    flags = {}
    if mode != "none":
        flags = dict(speculative=mode.split("-")[0], spec_k=3, spec_draft_layers=1, spec_max_batch_size=4)
    if mode == "draft-same":
        flags["spec_draft_model"] = checkpoints[family]
    elif mode == "draft-other":
        flags["spec_draft_model"] = write_checkpoint(family, tmp_path / "draft", seed=9, num_hidden_layers=1)
    engine = _colocated_engine(checkpoints[family], **flags)
    try:
        prompts = [random_prompt(n, seed=10 + n) for n in (3, 12, 23)]
        prompts.append([5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7])              # repetitive: the draft is often right
        got, finished = _generate(engine, prompts, 16)
    finally:
        engine.receiver.close()
    hf = hf_model(checkpoints[family])
    assert got == [hf_greedy(hf, p, 16) for p in prompts]
    drafted, accepted = sum(f.num_draft_tokens for f in finished), sum(f.num_accepted_tokens for f in finished)
    assert (drafted > 0) == (mode != "none") and accepted <= drafted
    if mode == "draft-same":
        assert accepted > 0.8 * drafted
    print(f"{family} {mode}: {accepted}/{drafted} draft tokens accepted")


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-phi3",
                                    "tiny-granite", "tiny-qwen3-moe", "tiny-mixtral"])
def test_make_model_presets_load_in_transformers_and_here_alike(tmp_path, preset):
    from pdserve.deploy.make_model import PRESETS, make_model, num_parameters

    path = make_model(preset, tmp_path / preset, seed=4, dtype="float32")
    runner, cfg = _runner(path)
    assert cfg.model_type == PRESETS[preset]["model_type"]
    # a Granite head is untied by the multipliers' fold (model.loader.fold_multipliers)
    tied = PRESETS[preset] | {"tie_word_embeddings": cfg.tie_word_embeddings}
    assert sum(p.numel() for p in runner.model.parameters()) == num_parameters(tied)
    ids = random_prompt(20, seed=3, vocab=cfg.vocab_size)
    with torch.no_grad():
        ref = hf_model(str(path))(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(runner.run([StepInput(ids, 0, list(range(5)))])[0], ref, rtol=0, atol=2e-5)


def test_qwen3_bench_preset_is_about_80m_parameters():
    from pdserve.deploy.make_model import PRESETS, num_parameters

    assert 75e6 < num_parameters(PRESETS["bench-80m-qwen3"]) < 85e6
    assert PRESETS["bench-80m-qwen3"]["model_type"] == "qwen3"
    assert 0.35e9 < num_parameters(PRESETS["bench-moe"]) < 0.37e9       # 32 experts a layer, 2 of them a token
