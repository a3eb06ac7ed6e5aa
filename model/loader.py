"""Load a Hugging Face Llama checkpoint directory (``config.json`` + ``*.safetensors``)."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.model.config import ModelConfig
from pdserve.model.llama import LlamaForCausalLM
from pdserve.model.rope import RotaryEmbedding

_FUSED = {  # our fused parameter -> the checkpoint's parts, in concatenation order
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of every ``*.safetensors`` file in ``model_dir``, by name.

    Raises:
        FileNotFoundError: the directory holds no ``*.safetensors`` file.
        ValueError: a tensor name appears in two files.
    """
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name in tensors:
                    raise ValueError(f"{model_dir}: tensor {name} appears in more than one file")
                tensors[name] = f.get_tensor(name)
    return tensors


def hf_to_pdserve(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename (and fuse) Hugging Face ``LlamaForCausalLM`` tensors into our module's state dict.

    Raises:
        ValueError: tensors are missing or left over.
    """
    hf = {k.removeprefix("model."): v for k, v in hf.items() if not _IGNORED.match(k)}
    out: dict[str, torch.Tensor] = {}
    for i in range(cfg.num_layers):
        for fused, parts in _FUSED.items():
            for suffix in ("weight", "bias"):
                names = [f"layers.{i}.{p}.{suffix}" for p in parts]
                if all(n in hf for n in names):
                    out[f"layers.{i}.{fused}.{suffix}"] = torch.cat([hf.pop(n) for n in names], dim=0)
    if cfg.tie_word_embeddings:  # either name may hold the shared matrix
        head = hf.pop("lm_head.weight", None)
        hf.setdefault("embed_tokens.weight", head)
    out.update(hf)
    return out


def expected_tensors(model: LlamaForCausalLM, cfg: ModelConfig, state: dict[str, torch.Tensor],
                     model_dir: Path) -> dict[str, torch.Tensor]:
    """``model``'s state dict (a tied head counted once), after checking ``state`` has exactly its names.

    Raises:
        ValueError: tensors are missing or left over.
    """
    expected = dict(model.state_dict())
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight")
    missing, unexpected = expected.keys() - state.keys(), state.keys() - expected.keys()
    if missing or unexpected:
        raise ValueError(f"{model_dir}: missing tensors {sorted(missing)}, unexpected {sorted(unexpected)}")
    return expected


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model from a checkpoint directory with weights cast to ``dtype``.

    Raises:
        FileNotFoundError: ``config.json`` or the weights are missing.
        ValueError: the checkpoint's tensors do not match the config (names or shapes).
    """
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_hf_dir(model_dir)
    state = hf_to_pdserve(read_safetensors(model_dir), cfg)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    expected = expected_tensors(model, cfg, state, model_dir)
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(f"{model_dir}: {name} has shape {tuple(tensor.shape)}, "
                             f"config implies {tuple(expected[name].shape)}")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    model.rotary = RotaryEmbedding(cfg)  # its buffer was built on the meta device
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.to(device).eval(), cfg
