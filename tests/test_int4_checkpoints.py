"""INT4 checkpoints: saved once quantized (mse, GPTQ; float32, bf16 and awkward shapes; Granite's folded
multipliers), loaded back equal to load-time quantization, and clear errors for missing or unknown metadata."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pdserve.model.loader import load_model
from pdserve.model.quant.int4 import convert_for_runtime
from pdserve.model.quant.int4_checkpoint import is_int4_checkpoint, load_int4_checkpoint, save_quantized_checkpoint
from pdserve.model.quant.int4_format import METADATA_KEY
from tests.conftest import all_logits
from tests.family_checkpoints import random_prompt, write_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_prequantized_checkpoint_equals_load_time_quantization(tmp_path, model_dir):
    out = save_quantized_checkpoint(model_dir, tmp_path / "q", group_size=32)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        settings = json.loads(f.metadata()[METADATA_KEY])
        names = set(f.keys())
    assert settings["format_version"] == 1 and settings["group_size"] == 32
    assert settings["method"] == "int4-mse-asym" and settings["source_dtype"] == "float32"
    assert "lm_head.weight" not in names and "layers.0.mlp.down_proj.qweight" in names  # tied head not stored
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    assert is_int4_checkpoint(out) and not is_int4_checkpoint(model_dir)

    loaded, _ = load_int4_checkpoint(out)
    converted, cfg = load_model(model_dir)
    convert_for_runtime(converted, 32)
    assert loaded.quantization["group_size"] == 32 and loaded.lm_head.weight is loaded.embed_tokens.weight
    ids = random_prompt(60, seed=2)
    assert torch.equal(all_logits(loaded, cfg, ids), all_logits(converted, cfg, ids))
    assert torch.equal(all_logits(loaded, cfg, ids[:5]), all_logits(converted, cfg, ids[:5]))


def test_a_granite_checkpoint_keeps_its_folded_multipliers_once(tmp_path):
    """Granite's embedding, residual and logits multipliers are in the loaded weights (its tied head untied):
    the INT4 checkpoint saved from them says so in its config.json (multipliers 1, head untied), so loading it
    equals load-time quantization, and folds nothing twice."""
    src = write_checkpoint("granite", tmp_path / "granite")
    out = save_quantized_checkpoint(src, tmp_path / "q", group_size=32)
    saved = json.loads((out / "config.json").read_text())
    assert saved["tie_word_embeddings"] is False and saved["attention_multiplier"] == 0.05
    assert [saved[k] for k in ("embedding_multiplier", "residual_multiplier", "logits_scaling")] == [1.0] * 3
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" in set(f.keys())
    loaded, cfg = load_int4_checkpoint(out)
    converted, converted_cfg = load_model(src)
    convert_for_runtime(converted, 32)
    assert converted_cfg.tie_word_embeddings is False and converted_cfg.embedding_multiplier == 1.0
    ids = random_prompt(40, seed=1)
    assert torch.equal(all_logits(loaded, cfg, ids), all_logits(converted, converted_cfg, ids))


def test_gptq_checkpoint_equals_load_time_gptq(tmp_path, model_dir):
    """Calibration is seeded: the offline and the load-time GPTQ give the same tensors."""
    out = save_quantized_checkpoint(model_dir, tmp_path / "q", group_size=128, method="gptq")
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert json.loads(f.metadata()[METADATA_KEY])["method"] == "int4-gptq-asym"
    loaded, _ = load_int4_checkpoint(out)
    converted, _ = load_model(model_dir)
    convert_for_runtime(converted, 128, "gptq")
    for a, b in zip(loaded.layers, converted.layers):
        for name in ("qweight", "scales", "zeros"):
            assert torch.equal(getattr(a.mlp.down_proj, name), getattr(b.mlp.down_proj, name))
            assert torch.equal(getattr(a.self_attn.qkv_proj, name), getattr(b.self_attn.qkv_proj, name))


def test_bf16_and_awkward_checkpoints_round_trip(tmp_path, model_dir, awkward_model_dir):
    """A bf16 source keeps its unquantized tensors in bf16; odd shapes (hidden 72, head_dim 24,
    qkv 120 rows, intermediate 100, untied head) quantize, save and load."""
    bf16_dir = tmp_path / "bf16"
    bf16_dir.mkdir()
    for f in Path(model_dir).iterdir():
        if f.suffix == ".safetensors":
            save_file({k: v.bfloat16() for k, v in load_file(f).items()}, str(bf16_dir / f.name))
        elif f.is_file():
            (bf16_dir / f.name).write_bytes(f.read_bytes())
    for src, g, dtype in ((bf16_dir, 64, torch.bfloat16), (Path(awkward_model_dir), 32, torch.float32)):
        out = save_quantized_checkpoint(src, tmp_path / f"q-{src.name}", group_size=g)
        loaded, cfg = load_int4_checkpoint(out, dtype=dtype)
        converted, _ = load_model(src, dtype=dtype)
        convert_for_runtime(converted, g)
        assert loaded.embed_tokens.weight.dtype == dtype
        ids = list(range(3, 43))
        for n in (40, 3):
            assert torch.equal(all_logits(loaded, cfg, ids[:n]), all_logits(converted, cfg, ids[:n]))
    with safe_open(str(tmp_path / "q-bf16" / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("embed_tokens.weight").get_dtype() == "BF16"


def test_missing_or_unknown_metadata_is_a_clear_error(tmp_path, model_dir):
    with pytest.raises(ValueError, match=METADATA_KEY):
        load_int4_checkpoint(model_dir)                          # a float checkpoint
    out = save_quantized_checkpoint(model_dir, tmp_path / "q", group_size=128, method="rtn")
    tensors = load_file(out / "model.safetensors")
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        settings = json.loads(f.metadata()[METADATA_KEY])
    assert settings["method"] == "int4-rtn-asym"
    for meta, match in (({"format": "pt"}, METADATA_KEY),
                        ({METADATA_KEY: json.dumps(settings | {"format_version": 99})}, "format_version 99"),
                        ({METADATA_KEY: "{not json"}, "not valid JSON"),
                        ({METADATA_KEY: json.dumps(settings | {"group_size": 48})}, "group_size")):
        save_file(tensors, str(out / "model.safetensors"), metadata=meta)
        with pytest.raises(ValueError, match=match):
            load_int4_checkpoint(out)
