"""Load a Hugging Face checkpoint of a supported family (``config.json`` + safetensors) into the decoder.

Tensors are read one at a time (:func:`model.checkpoint.iter_tensors`) and each is cast straight
into its place in the model's state, whose tensors are allocated once in the target dtype: the
checkpoint is never held twice (peak: the model plus its largest tensor). The checkpoint's q, k, v
and gate, up projections land in row ranges of our fused ``qkv_proj`` / ``gate_up_proj``::

    qkv_proj.weight  [q_size + 2 kv_size, hidden]   rows: q_proj | k_proj | v_proj   (biases alike)
    gate_up_proj     [2 intermediate, hidden]       rows: gate_proj | up_proj

A family whose checkpoints hold them fused already (Phi-3: :func:`model.families.fused_in_checkpoint`) maps
every tensor to its own name. Granite's embedding, residual and logits multipliers are folded into the
weights once they are loaded (:func:`fold_multipliers`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from pdserve.model.checkpoint import iter_tensors
from pdserve.model.config import ModelConfig
from pdserve.model.families import fused_in_checkpoint
from pdserve.model.llama import LlamaForCausalLM
from pdserve.model.model_dir import resolve_model_dir

_FUSED = {  # our fused projection -> the checkpoint's parts, in concatenation order (an expert's too)
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
_MIXTRAL = {".mlp.": ".block_sparse_moe.", ".gate_proj.": ".w1.", ".down_proj.": ".w2.", ".up_proj.": ".w3."}
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


@dataclass(frozen=True)
class Placement:
    """Where one checkpoint tensor goes: rows ``[row, row + rows)`` of our tensor ``target``."""

    target: str
    row: int
    rows: int


def expected_tensors(model: LlamaForCausalLM, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """``model``'s state dict by name (meta or real tensors: only shapes and dtypes are read),
    the LM head left out when tied to the embedding."""
    expected = dict(model.state_dict())
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight")
    return expected


def hf_layout(cfg: ModelConfig, expected: dict[str, torch.Tensor]) -> dict[str, Placement]:
    """Checkpoint tensor name (without the ``model.`` prefix) -> :class:`Placement`, for every
    tensor a Hugging Face checkpoint of ``cfg`` must hold (a mixture's experts as ``mlp.experts.E.gate_proj``,
    Mixtral's as ``block_sparse_moe.experts.E.w1``)."""
    layout: dict[str, Placement] = {}
    for name, tensor in expected.items():
        fused = None if fused_in_checkpoint(cfg.model_type) else next((f for f in _FUSED if f".{f}." in name), None)
        if fused is None:
            layout[name] = Placement(name, 0, tensor.shape[0])
            continue
        rows = (cfg.q_size, cfg.kv_size, cfg.kv_size) if fused == "qkv_proj" else (tensor.shape[0] // 2,) * 2
        row = 0
        for part, n in zip(_FUSED[fused], rows):
            layout[name.replace(f".{fused}.", f".{part}.")] = Placement(name, row, n)
            row += n
    if cfg.model_type == "mixtral":
        layout = {_mixtral_name(name): place for name, place in layout.items()}
    return layout


def _mixtral_name(name: str) -> str:
    """A Mixtral checkpoint's name for our tensor ``name`` (its MoE block and experts' projections renamed)."""
    if ".mlp." not in name:
        return name
    for ours, theirs in _MIXTRAL.items():
        name = name.replace(ours, theirs)
    return name


def assemble_state(tensors: Iterable[tuple[str, torch.Tensor]], expected: dict[str, torch.Tensor],
                   layout: dict[str, Placement], dtype_for: Callable[[str, torch.Tensor], torch.dtype],
                   model_dir: Path, aliases: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Place each ``(name, tensor)`` (consumed one at a time) into freshly allocated state tensors.

    Args:
        tensors: checkpoint tensors; a leading ``model.`` is dropped from names, RoPE buffers ignored.
        expected: our state dict's shapes (:func:`expected_tensors`).
        layout: checkpoint name -> placement (:func:`hf_layout`, or the identity for our own names).
        dtype_for: the dtype a target is allocated in, given its name and the first tensor placed there.
        aliases: other names one layout entry may come under (a tied head stored as ``lm_head.weight``);
            a second copy of an entry must equal the first (then it is skipped).
    Returns:
        our name -> tensor, every row of every expected tensor written exactly once.
    Raises:
        ValueError: missing or unexpected tensors (named as in the checkpoint), a shape that does not
            match the config, or two copies of one entry that differ (a head stored apart from the
            embedding it is tied to).
    """
    aliases = aliases or {}
    state: dict[str, torch.Tensor] = {}
    seen: set[str] = set()
    unexpected: list[str] = []
    for raw_name, tensor in tensors:
        name = aliases.get(raw_name.removeprefix("model."), raw_name.removeprefix("model."))
        place = layout.get(name)
        if place is None and not _IGNORED.match(name):
            unexpected.append(raw_name)
        elif place is not None and name in seen:        # the tied head stored under both names: one copy
            kept = state[place.target][place.row:place.row + place.rows]
            if tuple(tensor.shape) != tuple(kept.shape) or not torch.equal(tensor.to(kept.dtype), kept):
                raise ValueError(f"{model_dir}: config.json ties the LM head to the embedding "
                                 f"(tie_word_embeddings), but the checkpoint's {raw_name} differs from the tensor "
                                 f"it is tied to: set tie_word_embeddings to false")
        elif place is not None:
            want = expected[place.target]
            shape = (place.rows, *want.shape[1:])
            if tuple(tensor.shape) != shape:
                raise ValueError(f"{model_dir}: {raw_name} has shape {tuple(tensor.shape)}, config implies {shape}")
            if place.target not in state:
                state[place.target] = torch.empty(want.shape, dtype=dtype_for(place.target, tensor))
            state[place.target][place.row:place.row + place.rows].copy_(tensor)
            seen.add(name)
        del tensor                                     # gone before the next one is read
    missing = layout.keys() - seen
    if missing or unexpected:
        raise ValueError(f"{model_dir}: missing tensors {sorted(missing)}, unexpected {sorted(unexpected)}")
    return state


def finish_model(model: LlamaForCausalLM, cfg: ModelConfig, state: dict[str, torch.Tensor],
                 device: torch.device | str) -> LlamaForCausalLM:
    """Assign ``state`` to a ``model`` built on the meta device (its RoPE buffer is real already), tie the head."""
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.to(device).eval()


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               max_model_len: int = 0) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model from a checkpoint (a directory, or a hub repository id in the local cache)
    with weights cast to ``dtype``, tensor by tensor, served at ``max_model_len`` tokens (0: the checkpoint's
    context; :attr:`model.config.ModelConfig.max_model_len`).

    Raises:
        FileNotFoundError: no such checkpoint, or ``config.json`` or the weights are missing.
        ValueError: an unsupported family or setting, or tensors that do not match the config
            (names or shapes).
    """
    model_dir = resolve_model_dir(model_dir)
    cfg = ModelConfig.from_hf_dir(model_dir, max_model_len)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    expected = expected_tensors(model, cfg)
    aliases = {"lm_head.weight": "embed_tokens.weight"} if cfg.tie_word_embeddings else {}
    state = assemble_state(iter_tensors(model_dir), expected, hf_layout(cfg, expected), lambda _n, _t: dtype,
                           model_dir, aliases)
    return fold_multipliers(finish_model(model, cfg, state, device))


FOLDED = ("embedding_multiplier", "residual_multiplier", "logits_scaling")


@torch.no_grad()
def fold_multipliers(model: LlamaForCausalLM) -> tuple[LlamaForCausalLM, ModelConfig]:
    """``(model, cfg)`` with Granite's :data:`FOLDED` multipliers in the weights, in place: the embedding
    table times ``embedding_multiplier``; ``o_proj`` and ``down_proj`` (weights and biases) times
    ``residual_multiplier``, so each block's output is scaled before its residual add; the LM head divided
    by ``logits_scaling``. A head tied to the embedding is untied first (a copy: the two take different
    factors). The returned config (also ``model.cfg``) has the three at 1 and says whether the head is still
    tied, so that what is saved from ``model`` (:func:`model.quant.int4_checkpoint.save_quantized_checkpoint`)
    describes its weights. Folding rounds once per weight where ``transformers`` rounds once per
    activation: float32 logits agree to ~1e-6. The attention multiplier stays the attention's scale."""
    cfg = model.cfg
    m, r, s = (getattr(cfg, name) for name in FOLDED)
    if (m, r, s) == (1.0, 1.0, 1.0):
        return model, cfg
    if cfg.tie_word_embeddings and (m != 1.0 or s != 1.0):
        model.lm_head.weight = torch.nn.Parameter(model.embed_tokens.weight.detach().clone(), requires_grad=False)
    model.embed_tokens.weight.mul_(m)
    model.lm_head.weight.div_(s)
    for layer in model.layers:
        for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
            proj.weight.mul_(r)
            if proj.bias is not None:
                proj.bias.mul_(r)
    tied = cfg.tie_word_embeddings and m == s == 1.0
    model.cfg = replace(cfg, embedding_multiplier=1.0, residual_multiplier=1.0, logits_scaling=1.0,
                        tie_word_embeddings=tied)
    return model, model.cfg
