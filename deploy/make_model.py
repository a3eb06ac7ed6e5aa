"""``pdserve make-model``: seeded, randomly initialised checkpoints of every supported family
(Llama, Qwen2, Qwen3, Mistral) in Hugging Face format, with the embedded model's tokenizer.

Benchmarks need models large enough that weights, not Python, set the pace; the embedded
TinyStories model (656K parameters) is too small for that (``bench-*`` presets). Tests need
small models with awkward shapes of each family (``tiny-*``: head_dim not a power of two, one
KV head, tied and untied heads, Qwen3's head_dim unrelated to hidden / heads). Weights are drawn
from N(0, ``init_std``) (0.02, the usual initialiser, for benchmarks; larger for the tiny presets
so that their greedy output is not flat), biases likewise, norm weights are 1 + N(0, ``norm_std``)
(ones for benchmarks). ``transformers`` loads every preset with its own model class.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from pdserve.deploy.config import EMBEDDED_MODEL
from pdserve.model.families import ARCHITECTURES, family_options, fused_in_checkpoint, moe_options

_TINY = dict(num_hidden_layers=2, vocab_size=2048, max_position_embeddings=512, init_std=0.15, norm_std=0.1)
PRESETS: dict[str, dict] = {
    # ~78.6M parameters: the decode/prefill benchmark model.
    "bench-80m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                      num_key_value_heads=4, vocab_size=2048, max_position_embeddings=8192),
    # ~79.5M parameters, Qwen3-shaped: 8 heads of 128 (queries 1024 wide over a 768 hidden), q/k norm, tied head.
    "bench-80m-qwen3": dict(model_type="qwen3", hidden_size=768, intermediate_size=2048, num_hidden_layers=11,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=128, vocab_size=2048,
                            max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=1e6),
    # ~1.24B parameters, Llama-3.2-1B's shape (tied head, 128,256 vocabulary): the GPU benchmark model.
    "bench-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                     tie_word_embeddings=True, rope_theta=500000.0),
    # ~0.36B parameters, ~43M active per token, Mixtral-shaped (llama.cpp converts it with the embedded tokenizer;
    # its Qwen3-MoE converter wants a Qwen tokenizer): bench-80m's attention, 32 experts of 384 per layer and 2 a
    # token (Qwen3-30B-A3B runs 8 of 128): the mixture-of-experts benchmark model.
    "bench-moe": dict(model_type="mixtral", hidden_size=768, intermediate_size=384, num_local_experts=32,
                      num_experts_per_tok=2, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                      vocab_size=2048, max_position_embeddings=8192),
    # ~8.9M parameters: quick checks of the benchmark scripts.
    "bench-9m": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=8,
                     num_key_value_heads=2, vocab_size=2048, max_position_embeddings=4096),
    # tiny awkward presets for tests (hidden <= 96, 2 layers)
    "tiny-llama": dict(_TINY, model_type="llama", hidden_size=72, intermediate_size=100, num_attention_heads=3,
                       num_key_value_heads=1, head_dim=24, tie_word_embeddings=True, rope_theta=500.0),
    "tiny-qwen2": dict(_TINY, model_type="qwen2", hidden_size=80, intermediate_size=136, num_attention_heads=4,
                       num_key_value_heads=1, tie_word_embeddings=True, rope_theta=1e6),      # head_dim 20
    "tiny-qwen3": dict(_TINY, model_type="qwen3", hidden_size=64, intermediate_size=96, num_attention_heads=3,
                       num_key_value_heads=1, head_dim=40, tie_word_embeddings=False, rope_theta=1e6),
    "tiny-mistral": dict(_TINY, model_type="mistral", hidden_size=96, intermediate_size=120, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=36, tie_word_embeddings=False, rope_theta=1e4),
    "tiny-phi3": dict(_TINY, model_type="phi3", hidden_size=60, intermediate_size=88, num_attention_heads=3,
                      num_key_value_heads=1, tie_word_embeddings=False, rope_theta=2.5e5),      # head_dim 20
    "tiny-granite": dict(_TINY, model_type="granite", hidden_size=64, intermediate_size=112, num_attention_heads=4,
                         num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e4,       # head_dim 16
                         embedding_multiplier=6.0, attention_multiplier=0.05, residual_multiplier=0.4,
                         logits_scaling=4.0),
    "tiny-qwen3-moe": dict(_TINY, model_type="qwen3_moe", hidden_size=64, intermediate_size=96,
                           moe_intermediate_size=40, num_experts=5, num_experts_per_tok=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, rope_theta=1e6,
                           mlp_only_layers=[1]),
    "tiny-mixtral": dict(_TINY, model_type="mixtral", hidden_size=64, intermediate_size=40, num_local_experts=4,
                         num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6),
}
_PRIVATE = ("init_std", "norm_std")    # preset keys that shape the weights, not the config


def hf_config(preset: dict, dtype: str = "bfloat16") -> dict:
    """The ``config.json`` dict of a preset (family defaults filled in, no sliding window)."""
    shape = {k: v for k, v in preset.items() if k not in _PRIVATE}
    model_type = shape.pop("model_type", "llama")
    cfg = {"architectures": [ARCHITECTURES[model_type]], "model_type": model_type, "hidden_act": "silu",
           "rms_norm_eps": 1e-5 if model_type == "llama" else 1e-6, "rope_theta": 10000.0,
           "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": dtype}
    cfg |= {"llama": {"attention_bias": False, "mlp_bias": False}, "mistral": {"sliding_window": None},
            "qwen2": {"use_sliding_window": False, "sliding_window": None},
            "qwen3": {"attention_bias": False, "use_sliding_window": False, "sliding_window": None},
            "phi3": {"sliding_window": None, "pad_token_id": 0},
            "granite": {"attention_bias": False, "mlp_bias": False},
            "qwen3_moe": {"attention_bias": False, "use_sliding_window": False, "sliding_window": None,
                          "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []},
            "mixtral": {"sliding_window": None}}[model_type]
    return cfg | shape


def num_parameters(cfg: dict) -> int:
    """Parameters of the model a preset or ``config.json`` dict ``cfg`` describes (a tied head counted once)."""
    cfg = hf_config(cfg) if "architectures" not in cfg else cfg
    opts = family_options(cfg["model_type"], cfg)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * opts["head_dim"], cfg["num_key_value_heads"] * opts["head_dim"]
    per_layer = 2 * h * q + 2 * h * kv + 3 * h * i + 2 * h
    per_layer += (q + 2 * kv) * opts["qkv_bias"] + h * opts["o_proj_bias"] + (2 * i + h) * opts["mlp_bias"]
    per_layer += 2 * opts["head_dim"] * opts["qk_norm"]
    moe = moe_options(cfg["model_type"], cfg)
    experts = len(moe.get("moe_layers", ())) * (moe["num_experts"] * (3 * h * moe["moe_intermediate_size"] + h)
                                                 - 3 * h * i) if moe else 0     # a sparse layer's MLP
    return cfg["num_hidden_layers"] * per_layer + experts + (1 if cfg["tie_word_embeddings"] else 2) * v * h + h


def make_model(preset: str, out: str | Path, seed: int = 0, dtype: str = "bfloat16",
               tokenizer_from: str | Path | None = None) -> Path:
    """Write the checkpoint of ``preset`` to ``out`` and return its path.

    Raises:
        ValueError: unknown preset or dtype.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"dtype must be bfloat16, float16 or float32, got {dtype!r}")
    cfg = hf_config(PRESETS[preset], dtype)
    tensors = _random_tensors(cfg, PRESETS[preset], seed, torch_dtype)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    if tokenizer_from is None:
        tokenizer_from = EMBEDDED_MODEL
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        src = Path(tokenizer_from) / name
        if src.exists():
            shutil.copy(src, out / name)
    (out / "README.md").write_text(
        f"Random-weight {cfg['model_type']} model, preset `{preset}` ({num_parameters(cfg) / 1e6:.1f}M parameters), "
        f"seed {seed}, {dtype}. Made by `pdserve make-model --preset {preset}`; tokenizer copied from the embedded "
        "TinyStories model. For benchmarks and tests only: its output is noise.\n")
    return out


def _random_tensors(cfg: dict, preset: dict, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under Hugging Face names (``model.layers.N....``)."""
    opts, moe = family_options(cfg["model_type"], cfg), moe_options(cfg["model_type"], cfg)
    h, i, v, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], opts["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    std, norm_std = preset.get("init_std", 0.02), preset.get("norm_std", 0.0)
    gen = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    def norm(n: int) -> torch.Tensor:  # ones draw nothing: the bench presets' weights stay as they were
        return (1 + torch.randn(n, generator=gen) * norm_std).to(dtype) if norm_std else torch.ones(n, dtype=dtype)

    tensors = {"model.embed_tokens.weight": w(v, h)}
    if not cfg["tie_word_embeddings"]:
        tensors["lm_head.weight"] = w(v, h)
    tensors["model.norm.weight"] = norm(h)
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        tensors |= {p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
                    p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q),
                    p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h),
                    p + "mlp.down_proj.weight": w(h, i),
                    p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h)}
        if opts["qkv_bias"]:
            tensors |= {p + "self_attn.q_proj.bias": w(q), p + "self_attn.k_proj.bias": w(kv),
                        p + "self_attn.v_proj.bias": w(kv)}
        if opts["o_proj_bias"]:
            tensors[p + "self_attn.o_proj.bias"] = w(h)
        if opts["mlp_bias"]:
            tensors |= {p + "mlp.gate_proj.bias": w(i), p + "mlp.up_proj.bias": w(i), p + "mlp.down_proj.bias": w(h)}
        if opts["qk_norm"]:
            tensors |= {p + "self_attn.q_norm.weight": norm(d), p + "self_attn.k_norm.weight": norm(d)}
        if n in moe.get("moe_layers", ()):        # a sparse layer: the router and the experts, named as the family does
            for name in ("gate_proj", "up_proj", "down_proj"):
                del tensors[p + f"mlp.{name}.weight"]
            size = moe["moe_intermediate_size"]
            block, (gate, up, down) = (("block_sparse_moe", ("w1", "w3", "w2")) if cfg["model_type"] == "mixtral"
                                       else ("mlp", ("gate_proj", "up_proj", "down_proj")))
            tensors[p + f"{block}.gate.weight"] = w(moe["num_experts"], h)
            for e in range(moe["num_experts"]):
                tensors |= {p + f"{block}.experts.{e}.{gate}.weight": w(size, h),
                            p + f"{block}.experts.{e}.{up}.weight": w(size, h),
                            p + f"{block}.experts.{e}.{down}.weight": w(h, size)}
        if fused_in_checkpoint(cfg["model_type"]):      # Phi-3: q | k | v and gate | up stored as one tensor each
            parts = [tensors.pop(p + f"self_attn.{x}_proj.weight") for x in "qkv"]
            tensors[p + "self_attn.qkv_proj.weight"] = torch.cat(parts)
            parts = [tensors.pop(p + f"mlp.{x}_proj.weight") for x in ("gate", "up")]
            tensors[p + "mlp.gate_up_proj.weight"] = torch.cat(parts)
    return tensors
