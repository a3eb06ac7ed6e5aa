"""``pdserve make-model``: seeded, randomly initialised Llama checkpoints at realistic shapes,
in Hugging Face format, with the embedded model's tokenizer.

Benchmarks need models large enough that weights, not Python, set the pace; the
embedded TinyStories model (656K parameters) is too small for that. Weights are
drawn from N(0, 0.02) (the usual Llama initialiser), norms are ones.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from pdserve.deploy.config import EMBEDDED_MODEL

PRESETS: dict[str, dict] = {
    # ~78.6M parameters: the decode/prefill benchmark model.
    "bench-80m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                      num_key_value_heads=4, vocab_size=2048, max_position_embeddings=8192),
    # ~8.9M parameters: quick checks of the benchmark scripts.
    "bench-9m": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=8,
                     num_key_value_heads=2, vocab_size=2048, max_position_embeddings=4096),
}


def num_parameters(cfg: dict) -> int:
    """Parameters of a Llama with config ``cfg`` (untied head)."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    head_dim = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head_dim
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i + 2 * h
    return cfg["num_hidden_layers"] * per_layer + 2 * v * h + h


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
    shape = PRESETS[preset]
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "attention_bias": False,
           "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": dtype, **shape}
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    head_dim = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * head_dim
    gen = torch.Generator().manual_seed(seed)

    def w(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen) * 0.02).to(torch_dtype)

    tensors = {"model.embed_tokens.weight": w(v, h), "lm_head.weight": w(v, h),
               "model.norm.weight": torch.ones(h, dtype=torch_dtype)}
    for n in range(shape["num_hidden_layers"]):
        p = f"model.layers.{n}."
        tensors |= {p + "self_attn.q_proj.weight": w(h, h), p + "self_attn.k_proj.weight": w(kv, h),
                    p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, h),
                    p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h),
                    p + "mlp.down_proj.weight": w(h, i),
                    p + "input_layernorm.weight": torch.ones(h, dtype=torch_dtype),
                    p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch_dtype)}
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
        f"Random-weight Llama, preset `{preset}` ({num_parameters(cfg) / 1e6:.1f}M parameters), seed {seed}, "
        f"{dtype}. Made by `pdserve make-model --preset {preset}`; tokenizer copied from the embedded "
        "TinyStories model. For benchmarks only: its output is noise.\n")
    return out
