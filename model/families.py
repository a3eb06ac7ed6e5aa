"""The model families the one decoder serves, as small options read from ``config.json``, and the
checks that refuse what it cannot run exactly.

Each family's options follow its ``transformers`` modeling code (``models/<type>/modeling_<type>.py``),
which is the reference for token-exact output::

    model_type  projection biases                          q/k norm  head_dim if absent  sliding window
    llama       q, k, v, o: attention_bias; MLP: mlp_bias  no        hidden / heads      none
    mistral     none                                       no        hidden / heads      sliding_window, all layers
    qwen2       q, k, v always; o and MLP none             no        hidden / heads      see below
    qwen3       q, k, v, o: attention_bias                 yes       128                 see below
    phi3        none                                       no        hidden / heads      sliding_window, all layers
    granite     q, k, v, o: attention_bias; MLP: mlp_bias  no        hidden / heads      none
    qwen3_moe   as qwen3                                   yes       128                 see below
    qwen2_moe   q, k, v: qkv_bias (default on)             no        hidden / heads      see below
    mixtral     none                                       no        hidden / heads      sliding_window, all layers

    Phi-3 / Phi-4 checkpoints (``Phi3ForCausalLM``) store the projections fused as ours are, ``qkv_proj``
    (rows q | k | v) and ``gate_up_proj`` (rows gate | up): :func:`fused_in_checkpoint`.

    Granite (IBM Granite 3.x, ``GraniteForCausalLM``) is Llama with four multipliers (:func:`multipliers`):
    the attention's softmax scale (``attention_multiplier``, in place of ``head_dim ** -0.5``), the
    embeddings times ``embedding_multiplier``, each block's output times ``residual_multiplier`` before
    its residual add, and the logits divided by ``logits_scaling``. The loader folds the last three into
    the weights (:func:`model.loader.fold_multipliers`), so every kernel runs them as Llama's.

    Mixtures of experts (:func:`moe_options`; :mod:`model.moe`): Qwen3-MoE (``Qwen3MoeForCausalLM``: ``num_experts``
    experts of ``moe_intermediate_size`` on the layers ``decoder_sparse_step`` and ``mlp_only_layers`` leave sparse,
    the others a dense MLP; the top ``num_experts_per_tok`` softmax probabilities renormalized only with
    ``norm_topk_prob``, then rounded to the model's dtype) and Mixtral (``MixtralForCausalLM``: ``num_local_experts``
    experts of ``intermediate_size`` on every layer, the top-k probabilities always renormalized and kept in
    float32; its checkpoints name the block ``block_sparse_moe`` and the experts' gate, down and up projections
    ``w1``, ``w2``, ``w3``) and Qwen2-MoE (``Qwen2MoeForCausalLM``, Qwen1.5-MoE, Qwen2-57B-A14B: Qwen3-MoE's routing
    and layers plus a shared expert of ``shared_expert_intermediate_size`` that every token runs, its output times
    ``sigmoid(shared_expert_gate(x))``).

    Qwen sliding window: only with use_sliding_window, on the layers layer_types marks
    "sliding_attention", else on layers >= max_window_layers.

Refused at load, with the field and the supported values named (never loaded silently wrong):
another ``model_type`` or an ``architectures`` entry of another kind of head, a ``hidden_act``
other than SiLU, a ``rope_scaling`` type other than default / linear / llama3 (or one missing its
parameters; Phi-3's ``longrope`` among them), a ``partial_rotary_factor`` other than 1 (Phi-4-mini's: RoPE
here rotates whole heads), any ``quantization_config`` (pdserve quantizes itself: INT4 decode weights, FP8 prefill),
an odd ``head_dim`` (RoPE rotates pairs), and a sliding window shorter than the context the model is
served at (``max_position_embeddings``, or ``--max-model-len`` where given): sliding-window attention is not
implemented here, and a window at least as long as the context never masks anything (transformers' window
masks key ``j`` of query ``i`` only where ``j <= i - window``), so such checkpoints run exactly: Mistral 7B v0.1
(window 4,096) and Phi-3-mini-4k (window 2,047) at ``--max-model-len`` up to their windows.
"""

from __future__ import annotations

import math
from typing import Any

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "granite", "qwen3_moe", "mixtral", "qwen2_moe")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "granite": "GraniteForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM"}
MOE_FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe")
MULTIPLIERS = ("attention_multiplier", "embedding_multiplier", "residual_multiplier", "logits_scaling")
HIDDEN_ACTS = ("silu", "swish")              # transformers' ACT2FN maps both to SiLU
ROPE_TYPES = {"default": (), "linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
_QWEN_DEFAULT_MAX_WINDOW_LAYERS = 28       # Qwen2Config / Qwen3Config default


def family_options(model_type: str, raw: dict[str, Any]) -> dict[str, Any]:
    """The decoder options of ``model_type`` from its ``config.json`` dict ``raw``.

    Returns a dict with ``qkv_bias``, ``o_proj_bias``, ``mlp_bias``, ``qk_norm`` (bools) and
    ``head_dim`` (int).

    Raises:
        ValueError: an unsupported ``model_type``.
    """
    check_model_type(model_type, raw)
    heads = int(raw["num_attention_heads"])
    if heads <= 0:
        raise ValueError(f"config.json num_attention_heads must be positive, got {heads}")
    default_head_dim = 128 if model_type in ("qwen3", "qwen3_moe") else int(raw["hidden_size"]) // heads
    attention_bias = flag(raw, "attention_bias")
    options = {  # per family: (qkv_bias, o_proj_bias, mlp_bias, qk_norm)
        "llama": (attention_bias, attention_bias, flag(raw, "mlp_bias"), False),
        "mistral": (False, False, False, False),
        "qwen2": (True, False, False, False),
        "qwen3": (attention_bias, attention_bias, False, True),
        "phi3": (False, False, False, False),
        "granite": (attention_bias, attention_bias, flag(raw, "mlp_bias"), False),
        "qwen3_moe": (attention_bias, attention_bias, False, True),
        "mixtral": (False, False, False, False),
        "qwen2_moe": (flag(raw, "qkv_bias", True), False, False, False),
    }[model_type]
    return dict(zip(("qkv_bias", "o_proj_bias", "mlp_bias", "qk_norm"), options),
                head_dim=int(raw.get("head_dim") or default_head_dim))


def moe_options(model_type: str, raw: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts options of a :data:`MOE_FAMILIES` config (``{}`` for the others): ``num_experts``,
    ``num_experts_per_tok``, ``moe_intermediate_size``, ``moe_layers`` (the sparse layers' indices),
    ``norm_topk_prob``, ``moe_weights_in_float`` and ``shared_expert_intermediate_size`` (0: none; see the module
    docstring).

    Raises:
        ValueError: a non-positive expert count or size, or more experts per token than experts.
    """
    if model_type not in MOE_FAMILIES:
        return {}
    layers = int(raw["num_hidden_layers"])
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    if model_type == "mixtral":
        size, sparse, renorm = int(raw["intermediate_size"]), list(range(layers)), True
    else:
        size, step = int(raw.get("moe_intermediate_size") or 0), int(raw.get("decoder_sparse_step") or 1)
        dense = set(raw.get("mlp_only_layers") or ())
        sparse = [i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0]
        renorm = flag(raw, "norm_topk_prob")
    top_k = int(raw.get("num_experts_per_tok") or 0)
    if experts <= 0 or size <= 0 or not 0 < top_k <= experts:
        raise ValueError(f"config.json needs num_experts > 0, num_experts_per_tok in [1, num_experts] and a positive "
                         f"expert size; got {experts} experts, {top_k} per token, size {size}")
    shared = int(raw.get("shared_expert_intermediate_size") or 0) if model_type == "qwen2_moe" else 0
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=size,
                moe_layers=tuple(sparse), norm_topk_prob=renorm, moe_weights_in_float=model_type == "mixtral",
                shared_expert_intermediate_size=shared)


def multipliers(model_type: str, raw: dict[str, Any]) -> dict[str, float]:
    """Granite's :data:`MULTIPLIERS` from ``raw`` (each 1.0 when absent, as ``GraniteConfig`` defaults them);
    ``{}`` for the other families.

    Raises:
        ValueError: a multiplier that is not a finite positive number.
    """
    if model_type != "granite":
        return {}
    out = {}
    for name in MULTIPLIERS:
        value = raw.get(name)
        value = 1.0 if value is None else value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            raise ValueError(f"config.json {name} must be a finite positive number, got {value!r}")
        out[name] = float(value)
    return out


def fused_in_checkpoint(model_type: str) -> bool:
    """Whether the family's checkpoints hold ``qkv_proj`` and ``gate_up_proj`` fused (Phi-3), rather than
    ``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj`` and ``up_proj`` apart."""
    return model_type == "phi3"


def check_model_type(model_type: str, raw: dict[str, Any]) -> None:
    """Refuse a ``model_type`` outside :data:`FAMILIES`, or ``architectures`` naming another head.

    Raises:
        ValueError: naming the field and the supported values.
    """
    if model_type not in FAMILIES:
        raise ValueError(f"config.json model_type {model_type!r} is not supported; supported: {', '.join(FAMILIES)}")
    archs = raw.get("architectures") or []
    if archs and ARCHITECTURES[model_type] not in archs:
        raise ValueError(f"config.json architectures {archs} do not include {ARCHITECTURES[model_type]!r}, the "
                         f"causal LM of model_type {model_type!r}; supported: "
                         f"{', '.join(ARCHITECTURES.values())}")


def check_supported(model_type: str, raw: dict[str, Any], rope_scaling: dict | None, head_dim: int,
                    context: int | None = None) -> None:
    """Refuse what the decoder cannot run exactly (see the module docstring). ``context``: the tokens the model
    is served at (``--max-model-len``; None: ``max_position_embeddings``), which a sliding window must cover.

    Raises:
        ValueError: naming the ``config.json`` field and the supported values.
    """
    act = raw.get("hidden_act", "silu")
    if act not in HIDDEN_ACTS:
        raise ValueError(f"config.json hidden_act {act!r} is not supported; supported: {', '.join(HIDDEN_ACTS)}")
    if raw.get("quantization_config"):
        method = (raw["quantization_config"] or {}).get("quant_method", "?")
        raise ValueError(f"config.json quantization_config (quant_method {method!r}) is not read by pdserve; "
                         "supported: none (serve the float checkpoint; pdserve quantizes itself: --weights int4, "
                         "--activations fp8, or an INT4 checkpoint written by save_quantized_checkpoint)")
    if rope_scaling:
        kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        if kind not in ROPE_TYPES:
            raise ValueError(f"config.json rope_scaling type {kind!r} is not supported; supported: "
                             f"{', '.join(ROPE_TYPES)}")
        missing = [k for k in ROPE_TYPES[kind] if k not in rope_scaling]
        if missing:
            raise ValueError(f"config.json rope_scaling of type {kind!r} lacks {missing}")
    partial = raw.get("partial_rotary_factor", (raw.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"config.json partial_rotary_factor {partial} is not supported; supported: 1.0 "
                         "(RoPE over the whole head)")
    if head_dim % 2:
        raise ValueError(f"config.json head_dim {head_dim} is odd; supported: even head dims (RoPE rotates pairs)")
    window, layers = sliding_window(model_type, raw)
    context = int(raw.get("max_position_embeddings", 2048)) if context is None else context
    if window is not None and layers and window < context:
        raise ValueError(
            f"config.json sliding_window {window} (on layers {layers[0]}..{layers[-1]}) is shorter than the "
            f"{context}-token context it would be served at: sliding-window attention is not supported; "
            f"supported: no sliding window, or a window at least the served context (--max-model-len {window} "
            f"or less serves this checkpoint exactly)")


def sliding_window(model_type: str, raw: dict[str, Any]) -> tuple[int | None, list[int]]:
    """``(window, layers)``: the sliding window transformers applies for this config and the layers
    it applies to (``(None, [])`` when none does)."""
    num_layers = int(raw["num_hidden_layers"])
    window = raw.get("sliding_window")
    if model_type in ("mistral", "phi3", "mixtral"):
        return (int(window), list(range(num_layers))) if window is not None else (None, [])
    if model_type not in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe") or not raw.get("use_sliding_window") \
            or window is None:
        return None, []
    types = raw.get("layer_types")
    if types:
        layers = [i for i, t in enumerate(types) if t == "sliding_attention"]
    else:
        first = int(raw.get("max_window_layers", _QWEN_DEFAULT_MAX_WINDOW_LAYERS))
        layers = list(range(first, num_layers))
    return int(window), layers

def flag(raw: dict[str, Any], name: str, default: bool = False) -> bool:
    """The JSON boolean ``raw[name]`` (``default`` when absent or null).

    Raises:
        ValueError: any other value (a string ``"false"`` is not false).
    """
    value = raw.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"config.json {name} must be true or false, got {value!r}")
    return value


def refuse_mixture(model: Any, what: str) -> None:
    """Refuse ``what`` for a mixture of experts (a model whose ``cfg.moe_layers`` names sparse layers) where it does
    not cover one: FP8 activations (the experts would stay in float while the option says otherwise), GPTQ's
    calibration (an expert sees only the tokens routed to it, none for some) and the pre-quantized INT4 checkpoint
    format (dense projections' names only). Here, not in :mod:`model.moe`, so that the quantizers that call it do
    not import the mixture's module (which imports the C kernels' model code, which imports them).

    Raises:
        ValueError: naming ``what``, the model type and what is supported.
    """
    if model.cfg.moe_layers:
        raise ValueError(f"{what} is not supported for mixture-of-experts checkpoints ({model.cfg.model_type}); "
                         "supported: the float checkpoint (bf16 or fp32), or INT4 quantized at load "
                         "(--weights int4 with the mse or rtn method)")
