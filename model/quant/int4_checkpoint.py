"""Pre-quantized INT4 checkpoints: the offline half of :mod:`model.quant.int4`.

A checkpoint directory holds ``config.json`` and the tokenizer files of the source model
(copied unchanged, but for Granite's multipliers, which the weights hold: :func:`model.loader.fold_multipliers`)
and one ``model.safetensors`` with pdserve tensor names (fused
``qkv_proj`` / ``gate_up_proj``, no ``model.`` prefix): for each quantized module
``<prefix>.qweight`` / ``.scales`` / ``.zeros`` (and ``.bias`` if any), every other tensor
in the source checkpoint's dtype (``lm_head.weight`` left out when tied). The settings
are JSON in the safetensors header metadata under :data:`METADATA_KEY`::

    {"format_version": 1, "method": "int4-mse-asym", "bits": 4, "group_size": 128,
     "modules": ["self_attn.qkv_proj", ...], "layout": "...", "source_dtype": "bfloat16"}

never in file names.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from pdserve.model.checkpoint import iter_tensors, open_safetensors, safetensors_files
from pdserve.model.config import ModelConfig
from pdserve.model.families import refuse_mixture
from pdserve.model.llama import LlamaForCausalLM
from pdserve.model.loader import FOLDED, Placement, assemble_state, expected_tensors, finish_model, load_model
from pdserve.model.model_dir import resolve_model_dir
from pdserve.model.quant.int4 import Int4Linear, calibrated_weights, iter_targets
from pdserve.model.quant.int4_format import (
    FORMAT_VERSION,
    METADATA_KEY,
    METHODS,
    SUPPORTED_GROUP_SIZES,
    TARGET_MODULES,
    quantization_settings,
    quantize_weight,
)

_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def create_quantized_state_dict(model: LlamaForCausalLM, group_size: int = 128,
                                method: str = "mse") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Quantize the decoder layers' linear weights of ``model`` (which is not modified).

    Returns:
        ``(tensors, metadata)``: the model's state dict with each target module's ``weight``
        replaced by ``qweight`` (uint8 ``[N, Kp // 2]``), ``scales`` and ``zeros`` (float32
        ``[N, Kp // G]``), other tensors as they are (``lm_head.weight`` dropped when tied to
        the embedding); and the safetensors header metadata, ``{"format": "pt",
        METADATA_KEY: <settings JSON>}``.
    Raises:
        ValueError: unsupported group size or method.
    """
    settings = quantization_settings(group_size, method) if method in METHODS else None
    if settings is None:
        raise ValueError(f"int4: method must be one of {sorted(METHODS)}, got {method!r}")
    refuse_mixture(model, "a pre-quantized INT4 checkpoint (quantize at load: --weights int4)")
    state = dict(model.state_dict())
    if model.cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    calibrated = calibrated_weights(model, group_size, method)          # GPTQ: all layers at once
    for i, layer in enumerate(model.layers):
        for path in TARGET_MODULES:
            prefix = f"layers.{i}.{path}"
            mod = layer.get_submodule(path)
            if isinstance(mod, Int4Linear):                      # already converted: take its buffers
                if mod.group_size != group_size:
                    raise ValueError(f"int4: {prefix} is already quantized with group_size {mod.group_size}, "
                                     f"not {group_size}")
                q, s, z = mod.qweight, mod.scales, mod.zeros
            else:
                q, s, z = calibrated.get(mod) or quantize_weight(mod.weight, group_size, method)
            state.pop(f"{prefix}.weight", None)
            state |= {f"{prefix}.qweight": q, f"{prefix}.scales": s, f"{prefix}.zeros": z}
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    return state, {"format": "pt", METADATA_KEY: json.dumps(settings)}


def _source_dtype(model_dir: Path) -> torch.dtype:
    """dtype of the first floating tensor in the checkpoint (header only)."""
    for path in safetensors_files(model_dir):
        with open_safetensors(path) as f:
            for name in f.keys():
                dtype = _SAFETENSORS_DTYPES.get(f.get_slice(name).get_dtype())
                if dtype is not None:
                    return torch.float32 if dtype == torch.float64 else dtype
    raise FileNotFoundError(f"{model_dir}: no floating-point tensors in *.safetensors")


def save_quantized_checkpoint(model_dir_in: str | Path, out_dir: str | Path, group_size: int = 128,
                              method: str = "mse") -> Path:
    """Write a pre-quantized INT4 checkpoint of ``model_dir_in`` to ``out_dir`` and return its path.

    Quantizes from the float32 values of the source weights (exact for bf16/fp16 sources), so
    loading the result equals ``load_model`` + :func:`~model.quant.int4.convert_for_runtime`.
    Non-safetensors files (config, tokenizer, ...) are copied; ``out_dir`` must not be the source.

    Raises:
        FileNotFoundError, ValueError: as :func:`model.loader.load_model`, or bad settings.
    """
    model_dir_in, out_dir = resolve_model_dir(model_dir_in), Path(out_dir)
    if out_dir.resolve() == model_dir_in.resolve():
        raise ValueError(f"{out_dir}: refusing to overwrite the source checkpoint")
    src_dtype = _source_dtype(model_dir_in)
    model, _ = load_model(model_dir_in, dtype=src_dtype)
    tensors, metadata = create_quantized_state_dict(model, group_size, method)
    settings = json.loads(metadata[METADATA_KEY]) | {"source_dtype": _DTYPE_NAMES[src_dtype]}
    metadata[METADATA_KEY] = json.dumps(settings)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("*.safetensors*"):                  # stale shards would be read too
        old.unlink()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata=metadata)
    for src in model_dir_in.iterdir():
        if src.is_file() and ".safetensors" not in src.name:
            shutil.copy(src, out_dir / src.name)
    raw = json.loads((model_dir_in / "config.json").read_text())
    if any(raw.get(name, 1.0) != 1.0 for name in FOLDED):   # the weights hold Granite's multipliers: say so
        folded = {name: 1.0 for name in FOLDED} | {"tie_word_embeddings": model.cfg.tie_word_embeddings}
        (out_dir / "config.json").write_text(json.dumps(raw | folded, indent=2))
    return out_dir


def _header_metadata(model_dir: str | Path) -> list[dict[str, str]]:
    out = []
    for path in safetensors_files(resolve_model_dir(model_dir)):
        with open_safetensors(path) as f:
            out.append(f.metadata() or {})
    return out


def is_int4_checkpoint(model_dir: str | Path) -> bool:
    """True when a ``*.safetensors`` header in ``model_dir`` carries :data:`METADATA_KEY`
    (validity is checked by :func:`load_int4_checkpoint`); False also when there are none."""
    try:
        return any(METADATA_KEY in m for m in _header_metadata(model_dir))
    except FileNotFoundError:
        return False


def read_quantization_metadata(model_dir: str | Path) -> dict:
    """The validated settings dict of a pre-quantized checkpoint.

    Raises:
        FileNotFoundError: no ``*.safetensors`` file.
        ValueError: metadata missing, not JSON, of an unknown format version, or unsupported settings.
    """
    found = [m[METADATA_KEY] for m in _header_metadata(model_dir) if METADATA_KEY in m]
    if not found:
        raise ValueError(f"{model_dir}: not a pre-quantized int4 checkpoint: no {METADATA_KEY!r} key in the "
                         "safetensors header metadata (quantize it with save_quantized_checkpoint(), or load "
                         "the float checkpoint and call convert_for_runtime())")
    try:
        settings = json.loads(found[0])
    except json.JSONDecodeError as e:
        raise ValueError(f"{model_dir}: {METADATA_KEY!r} header metadata is not valid JSON: {e}") from None
    version = settings.get("format_version") if isinstance(settings, dict) else None
    if version != FORMAT_VERSION:
        raise ValueError(f"{model_dir}: int4 checkpoint format_version {version!r} is unknown; this pdserve "
                         f"reads version {FORMAT_VERSION} (re-quantize with save_quantized_checkpoint())")
    if settings.get("method") not in METHODS.values() or settings.get("bits") != 4:
        raise ValueError(f"{model_dir}: unknown int4 method {settings.get('method')!r} / bits "
                         f"{settings.get('bits')!r}; expected one of {sorted(METHODS.values())}, 4 bits")
    if settings.get("group_size") not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"{model_dir}: int4 group_size {settings.get('group_size')!r} is not one of "
                         f"{SUPPORTED_GROUP_SIZES}")
    if list(settings.get("modules", [])) != list(TARGET_MODULES):
        raise ValueError(f"{model_dir}: quantized modules {settings.get('modules')!r} differ from the "
                         f"supported set {list(TARGET_MODULES)}")
    return settings


def load_int4_checkpoint(model_dir: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                         max_model_len: int = 0) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model from a pre-quantized checkpoint: :class:`Int4Linear` layers, every other
    weight cast to ``dtype``; ``model.quantization`` holds the header settings. Served at ``max_model_len``
    tokens (0: the checkpoint's context).

    Raises:
        FileNotFoundError: ``config.json`` or the weights are missing.
        ValueError: missing/unknown quantization metadata, or tensors that do not match the config.
    """
    model_dir = resolve_model_dir(model_dir)
    settings = read_quantization_metadata(model_dir)
    cfg = ModelConfig.from_hf_dir(model_dir, max_model_len)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
        for parent, attr, lin in iter_targets(model):
            setattr(parent, attr, Int4Linear(lin.in_features, lin.out_features, lin.bias is not None,
                                             settings["group_size"], bias_dtype=dtype))
    expected = expected_tensors(model, cfg)
    quant_buffers = (".qweight", ".scales", ".zeros")

    def dtype_for(name: str, first: torch.Tensor) -> torch.dtype:
        if (first.dtype == torch.uint8) != (expected[name].dtype == torch.uint8):
            raise ValueError(f"{model_dir}: {name} has dtype {first.dtype}, config implies {expected[name].dtype}")
        return first.dtype if name.endswith(quant_buffers) else dtype    # quantized buffers as stored

    layout = {name: Placement(name, 0, t.shape[0]) for name, t in expected.items()}
    state = assemble_state(iter_tensors(model_dir), expected, layout, dtype_for, model_dir)
    model = finish_model(model, cfg, state, device)
    for _, _, mod in iter_targets(model):
        mod.prepare()
    model.quantization = settings
    return model, cfg
