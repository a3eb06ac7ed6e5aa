"""Seeded random checkpoints of every family with awkward shapes, written by ``transformers``' own
model classes (so the checkpoint format is the reference's, not ours), for the family tests.

    family    hidden  heads x head_dim   KV heads  intermediate  head     other
    llama         72  3 x 24                    1           100  untied   rope_theta 500 (+ rope_scaling variants)
    qwen2         80  4 x 20                    1           136  tied     q/k/v biases, rope_theta 1e6
    qwen3         64  3 x 40 (!= 64 / 3)        1            96  untied   q/k norm, rope_theta 1e6
    mistral       96  4 x 36 (!= 96 / 4)        2           120  untied   sliding_window = context (never masks)
    phi3          60  3 x 20                    1            88  untied   qkv_proj, gate_up_proj fused; theta 2.5e5
    granite       64  4 x 16                    2           112  tied     all biases; the four multipliers != 1
    qwen3_moe     64  4 x 16                    2     6 x 48 (80) untied  top-2 of 6 experts renormalized; layer 1 dense
    mixtral       64  4 x 16                    2        4 x 56  untied   top-2 of 4 experts
    qwen2_moe     64  4 x 16                    2     5 x 40 (+72) untied q/k/v biases; top-2 of 5 and a shared expert

Every model: 2 layers, vocab 1000, 256 positions, BOS 1, EOS 2, the embedded model's tokenizer.
Weights N(0, 0.15) (larger than transformers' init, so greedy output is not flat), biases N(0, 0.3),
norm weights 1 + N(0, 0.2) (so that q/k norm weights matter).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from pdserve.deploy.config import EMBEDDED_MODEL

FAMILIES = ("qwen2", "qwen3", "mistral", "phi3", "granite")
_COMMON = dict(num_hidden_layers=2, vocab_size=1000, max_position_embeddings=256, rms_norm_eps=1e-5,
               bos_token_id=1, eos_token_id=2)
SHAPES = {
    "llama": dict(_COMMON, hidden_size=72, intermediate_size=100, num_attention_heads=3, num_key_value_heads=1,
                  head_dim=24, tie_word_embeddings=False, rope_theta=500.0),
    "qwen2": dict(_COMMON, hidden_size=80, intermediate_size=136, num_attention_heads=4, num_key_value_heads=1,
                  tie_word_embeddings=True, rope_theta=1e6),
    "qwen3": dict(_COMMON, hidden_size=64, intermediate_size=96, num_attention_heads=3, num_key_value_heads=1,
                  head_dim=40, tie_word_embeddings=False, rope_theta=1e6),
    "mistral": dict(_COMMON, hidden_size=96, intermediate_size=120, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=36, tie_word_embeddings=False, rope_theta=1e4, sliding_window=256),
    "phi3": dict(_COMMON, hidden_size=60, intermediate_size=88, num_attention_heads=3, num_key_value_heads=1,
                 tie_word_embeddings=False, rope_theta=2.5e5, pad_token_id=0, sliding_window=None),
    "granite": dict(_COMMON, hidden_size=64, intermediate_size=112, num_attention_heads=4, num_key_value_heads=2,
                    tie_word_embeddings=True, rope_theta=1e4, attention_bias=True, mlp_bias=True,
                    embedding_multiplier=6.0, attention_multiplier=0.05, residual_multiplier=0.4, logits_scaling=4.0),
    # mixtures of experts (tests/test_moe.py)
    "qwen3_moe": dict(_COMMON, hidden_size=64, intermediate_size=80, moe_intermediate_size=48, num_experts=6,
                      num_experts_per_tok=2, norm_topk_prob=True, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, tie_word_embeddings=False, rope_theta=1e6, mlp_only_layers=[1]),
    "qwen2_moe": dict(_COMMON, hidden_size=64, intermediate_size=80, moe_intermediate_size=40, num_experts=5,
                      num_experts_per_tok=2, shared_expert_intermediate_size=72, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=False, rope_theta=1e6),
    "mixtral": dict(_COMMON, hidden_size=64, intermediate_size=56, num_local_experts=4, num_experts_per_tok=2,
                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=1e6,
                    sliding_window=None),
}


def write_checkpoint(family: str, out: str | Path, seed: int = 0, **overrides) -> str:
    """Write a random ``family`` checkpoint (:data:`SHAPES`, with ``overrides``) to ``out`` with
    ``transformers``' ``save_pretrained``; returns the directory."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    out = Path(out)
    torch.manual_seed(seed)
    config = AutoConfig.for_model(family, **(SHAPES[family] | overrides))
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0, 0.3)
            else:
                p.normal_(0, 0.15)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(EMBEDDED_MODEL) / name, out / name)
    return str(out)


def hf_model(model_dir: str):
    """The ``transformers`` float32 model of a checkpoint directory, in eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def random_prompt(n: int, seed: int, vocab: int = 1000) -> list[int]:
    """``n`` seeded token ids in ``[3, vocab)`` (no BOS, no EOS)."""
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def check_chunked_prefill_and_decode(runner, seed: int) -> None:
    """A 31-token prompt prefilled in chunks ending mid-block over scattered blocks (5-token blocks), then two
    decode steps through the cache (the CPU kernels where they run), equal one unchunked pass of ``runner``
    (a :class:`model.runner.ModelRunner`) within 2e-5."""
    from pdserve.model.runner import StepInput

    ids = random_prompt(31, seed=seed)
    table = [7, 3, 90, 11, 2, 40, 41]
    full = runner.run([StepInput(ids, 0, table)], all_logits=True)
    runner.kv_cache.zero_()
    chunks = [runner.run([StepInput(ids[a:b], a, table)], all_logits=True) for a, b in ((0, 9), (9, 20), (20, 29))]
    decoded = [runner.run([StepInput([ids[p]], p, table)]) for p in (29, 30)]
    torch.testing.assert_close(torch.cat(chunks + decoded), full, rtol=0, atol=2e-5)
