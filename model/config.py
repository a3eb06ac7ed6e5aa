"""Model configuration read from a Hugging Face ``config.json`` of a supported family
(:mod:`model.families`: Llama, Mistral, Qwen2/2.5, Qwen3, Phi-3/Phi-4, Granite 3, and the mixtures of experts
Qwen3-MoE and Mixtral)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.model.families import FAMILIES, check_supported, family_options, flag, moe_options, multipliers
from pdserve.model.model_dir import read_json, resolve_model_dir


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder of one of the supported families, and its family options.

    ``head_dim`` is read from the config when given (it need not equal ``hidden / heads``), and no
    size is assumed to be a multiple of anything. The family options, as :mod:`model.families`
    derives them from ``config.json``:

    Attributes:
        model_type: ``llama``, ``mistral``, ``qwen2``, ``qwen3``, ``phi3``, ``granite``, ``qwen3_moe``, ``mixtral``
            or ``qwen2_moe``.
        qkv_bias: the q, k and v projections have biases (Qwen2; Llama/Qwen3 with ``attention_bias``).
        o_proj_bias: the output projection has a bias (Llama/Qwen3 with ``attention_bias``).
        mlp_bias: gate, up and down projections have biases (Llama's ``mlp_bias``).
        qk_norm: per-head RMSNorm (weights ``[head_dim]``, ``rms_norm_eps``) on queries and keys
            before RoPE (Qwen3's ``q_norm`` / ``k_norm``).
        attention_multiplier: the softmax scale of attention (Granite's); None: ``head_dim ** -0.5``
            (:attr:`attention_scale`).
        embedding_multiplier, residual_multiplier, logits_scaling: Granite's other multipliers (1: none):
            embeddings times the first, each block's output times the second before its residual add, the
            logits divided by the third. :func:`model.loader.load_model` folds them into the weights and
            returns a config with them at 1.
        num_experts, num_experts_per_tok, moe_intermediate_size: a mixture of experts (0: a dense model): experts
            per sparse layer, experts each token runs, and their SwiGLU width (:mod:`model.moe`).
        moe_layers: the sparse layers' indices (the others run a dense MLP of ``intermediate_size``).
        norm_topk_prob: the top-k routing probabilities are renormalized to sum to 1.
        moe_weights_in_float: the routing weights stay float32 (Mixtral's), else they are rounded to the model's
            dtype first (Qwen3-MoE's).
        shared_expert_intermediate_size: Qwen2-MoE's shared expert, which every token runs beside its routed ones,
            gated by ``sigmoid(shared_expert_gate(x))`` (0: none).
        max_model_len: the context served, in tokens (prompt and output together): vLLM's ``--max-model-len``,
            at most ``max_position_embeddings``; 0 (the default) resolves to ``max_position_embeddings``.
            Every context bound of the serving path reads this one (requests refused beyond it, KV block tables
            and the prefill pool sized for it).

    Raises:
        ValueError: from ``__post_init__`` when sizes are inconsistent (e.g. the attention heads
            are not a multiple of the KV heads, an odd ``head_dim``) or the family is unknown.
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
    model_type: str = "llama"
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    attention_multiplier: float | None = None
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()
    norm_topk_prob: bool = False
    moe_weights_in_float: bool = False
    shared_expert_intermediate_size: int = 0
    max_model_len: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config: {name} must be positive, got {getattr(self, name)}")
        check_max_model_len(self.max_model_len, self.max_position_embeddings)
        if not self.max_model_len:
            object.__setattr__(self, "max_model_len", self.max_position_embeddings)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"config: {self.num_heads} attention heads is not a multiple of "
                             f"{self.num_kv_heads} KV heads")
        if self.head_dim % 2:
            raise ValueError(f"config: head_dim {self.head_dim} is odd (RoPE rotates pairs)")
        if self.model_type not in FAMILIES:
            raise ValueError(f"config: model_type {self.model_type!r} is not one of {FAMILIES}")
        for name in ("rms_norm_eps", "rope_theta"):        # NaN, 0 or negative: every logit NaN
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"config: {name} must be a finite positive number, got {value}")
        for key, value in self.rope_scaling or ():
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise ValueError(f"config: rope_scaling {key} must be a number or a name, got {value!r}")
            if key != "rope_type" and key != "type" and not (isinstance(value, (int, float)) and math.isfinite(value)
                                                             and value > 0):
                raise ValueError(f"config: rope_scaling {key} must be a finite positive number, got {value!r}")
        ids = ([] if self.bos_token_id is None else [("bos_token_id", self.bos_token_id)]) + [
            ("eos_token_id", t) for t in self.eos_token_ids]
        for name, t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"config: {name} {t!r} is not a token id of the vocabulary [0, {self.vocab_size})")

    @property
    def attention_scale(self) -> float:
        """The softmax scale of attention: ``attention_multiplier``, else ``head_dim ** -0.5``."""
        return self.attention_multiplier if self.attention_multiplier is not None else self.head_dim ** -0.5

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads sharing one KV head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        """Features of all query heads (``num_heads * head_dim``; may differ from ``hidden_size``)."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Features of all key (or value) heads (``num_kv_heads * head_dim``)."""
        return self.num_kv_heads * self.head_dim

    @property
    def rope_scaling_dict(self) -> dict | None:
        """``rope_scaling`` as a dict, or ``None``."""
        return dict(self.rope_scaling) if self.rope_scaling else None

    @classmethod
    def from_hf_dir(cls, model_dir: str | Path, max_model_len: int = 0) -> "ModelConfig":
        """Read ``config.json`` (and ``generation_config.json`` for EOS ids) of a checkpoint
        directory or a hub repository id in the local cache (:func:`model.model_dir.resolve_model_dir`),
        served at ``max_model_len`` tokens (0: the checkpoint's ``max_position_embeddings``).

        Raises:
            FileNotFoundError: no such checkpoint, or no ``config.json``.
            ValueError: an unsupported family or setting (:mod:`model.families`; the message names the
                field and the supported values), inconsistent sizes, or a ``max_model_len`` beyond the
                checkpoint's context.
        """
        model_dir = resolve_model_dir(model_dir)
        raw = read_json(model_dir, "config.json")
        if raw is None:
            raise FileNotFoundError(f"{model_dir}: no config.json")
        try:
            return cls._from_raw(raw, read_json(model_dir, "generation_config.json") or {}, max_model_len)
        except KeyError as exc:
            raise ValueError(f"{model_dir}: config.json lacks {exc}") from None
        except (ValueError, TypeError, AttributeError, ZeroDivisionError, OverflowError) as exc:
            kind = "" if isinstance(exc, ValueError) else "a field of the wrong type or value: "
            raise ValueError(f"{model_dir}: {kind}{exc}") from None

    @classmethod
    def _from_raw(cls, raw: dict, generation: dict, max_model_len: int = 0) -> "ModelConfig":
        model_type = raw.get("model_type", "llama")
        options = family_options(model_type, raw)
        positions = int(raw.get("max_position_embeddings", 2048))
        check_max_model_len(max_model_len, positions)
        # transformers >= 5 writes `rope_parameters` (theta and scaling together); older ones
        # write `rope_theta` and `rope_scaling`.
        rope = _object(raw, "rope_parameters")
        scaling = _object(raw, "rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        check_supported(model_type, raw, scaling, options["head_dim"], max_model_len or positions)
        eos = generation.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        num_heads = int(raw["num_attention_heads"])
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            max_position_embeddings=positions,
            max_model_len=max_model_len,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw["rope_theta"] if raw.get("rope_theta") is not None
                             else rope.get("rope_theta", 10000.0)),
            rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
            tie_word_embeddings=flag(raw, "tie_word_embeddings"),
            model_type=model_type,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **options,
            **multipliers(model_type, raw),
            **moe_options(model_type, raw),
        )


def check_max_model_len(max_model_len: int, max_position_embeddings: int | None = None) -> None:
    """Refuse a served context (tokens; 0: the checkpoint's) that is negative or longer than the checkpoint's
    ``max_position_embeddings`` (None: not known yet, as in a process config checked before the checkpoint is
    read), as vLLM refuses a ``--max-model-len`` beyond the derived one.

    Raises:
        ValueError: naming both lengths.
    """
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 0:
        raise ValueError(f"max_model_len must be a whole number of tokens >= 0 (0: the checkpoint's), got "
                         f"{max_model_len!r}")
    if max_position_embeddings is not None and max_model_len > max_position_embeddings:
        raise ValueError(f"max_model_len {max_model_len} is longer than the checkpoint's context "
                         f"(max_position_embeddings {max_position_embeddings}); supported: 0 (the checkpoint's) "
                         f"or 1..{max_position_embeddings}")


def _object(raw: dict[str, Any], name: str) -> dict[str, Any]:
    """The JSON object ``raw[name]`` (empty when absent or null).

    Raises:
        ValueError: any other value.
    """
    value = raw.get(name) or {}
    if not isinstance(value, dict):
        raise ValueError(f"config.json {name} must be an object, got {value!r}")
    return value
