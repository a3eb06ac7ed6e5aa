"""Model configuration read from a Hugging Face ``config.json`` (LlamaForCausalLM)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-architecture decoder.

    Any ``LlamaForCausalLM`` checkpoint is accepted: ``head_dim`` defaults to
    ``hidden_size // num_attention_heads`` but is read from the config when given,
    and no size is assumed to be a multiple of anything.

    Raises:
        ValueError: from ``__post_init__`` when sizes are inconsistent (e.g. the
            attention heads are not a multiple of the KV heads).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, object], ...] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"config: {self.num_heads} attention heads is not a multiple of "
                             f"{self.num_kv_heads} KV heads")

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads sharing one KV head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    @property
    def rope_scaling_dict(self) -> dict | None:
        """``rope_scaling`` as a dict, or ``None``."""
        return dict(self.rope_scaling) if self.rope_scaling else None

    @classmethod
    def from_hf_dir(cls, model_dir: str | Path) -> "ModelConfig":
        """Read ``config.json`` (and ``generation_config.json`` for EOS ids) from a checkpoint directory.

        Raises:
            FileNotFoundError: no ``config.json``.
            ValueError: not a Llama checkpoint, or inconsistent sizes.
        """
        model_dir = Path(model_dir)
        raw = json.loads((model_dir / "config.json").read_text())
        if raw.get("model_type", "llama") != "llama":
            raise ValueError(f"{model_dir}: model_type {raw.get('model_type')!r} is not 'llama'")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{model_dir}: hidden_act {raw['hidden_act']!r} is not supported (only silu)")
        eos = raw.get("eos_token_id")
        gen_path = model_dir / "generation_config.json"
        if gen_path.exists():
            eos = json.loads(gen_path.read_text()).get("eos_token_id", eos)
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        num_heads = int(raw["num_attention_heads"])
        # transformers >= 5 writes `rope_parameters` (theta and scaling together); older ones
        # write `rope_theta` and `rope_scaling`.
        rope = raw.get("rope_parameters") or {}
        scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // num_heads),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta", 10000.0)),
            rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
