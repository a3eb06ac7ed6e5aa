"""The model against ``transformers`` in-process: prefill, chunked prefill and paged decode."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.model.config import ModelConfig
from pdserve.model.kv_cache import KVCacheSpec
from pdserve.model.loader import load_model
from pdserve.model.runner import ModelRunner, StepInput


def _runner(model_dir, block_size=4, num_blocks=128):
    model, cfg = load_model(model_dir)
    return ModelRunner(model, KVCacheSpec(num_blocks, cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim)), cfg


@pytest.mark.parametrize("which", ["model_dir", "awkward_model_dir"])
def test_prefill_logits_match_transformers(request, which):
    from transformers import AutoModelForCausalLM

    path = request.getfixturevalue(which)
    runner, cfg = _runner(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(3, cfg.vocab_size, (23,), generator=torch.Generator().manual_seed(0)).tolist()
    logits = runner.run([StepInput(ids, 0, list(range(10, 16)))])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(logits[0], ref, rtol=0, atol=1e-5)


def test_chunked_prefill_and_decode_through_the_cache_match_one_pass(model_dir):
    """Chunks attend to earlier chunks' KV through non-contiguous blocks; a decode step
    reads the whole paged context; both equal one unchunked pass."""
    runner, cfg = _runner(model_dir, block_size=4)
    ids = list(range(5, 35))
    table = [7, 3, 90, 11, 2, 40, 41, 9]                          # 8 blocks of 4: deliberately scattered
    full = runner.run([StepInput(ids, 0, table)])
    runner.kv_cache.zero_()
    runner.run([StepInput(ids[:9], 0, table)])                   # a chunk ending mid-block
    runner.run([StepInput(ids[9:20], 9, table)])
    chunked = runner.run([StepInput(ids[20:], 20, table)])
    torch.testing.assert_close(chunked, full, rtol=0, atol=1e-5)
    runner.kv_cache.zero_()
    runner.run([StepInput(ids[:-1], 0, table)])
    decoded = runner.run([StepInput(ids[-1:], len(ids) - 1, table)])
    torch.testing.assert_close(decoded, full, rtol=0, atol=1e-5)


def test_mixed_batch_equals_each_sequence_alone(model_dir):
    """One step over a prefill and two decodes of different lengths gives each its own logits."""
    runner, _ = _runner(model_dir, block_size=4)
    a, b, c = list(range(3, 20)), list(range(40, 46)), list(range(100, 131))
    ta, tb, tc = [0, 1, 2, 3, 4], [10, 11], [20, 21, 22, 23, 24, 25, 26, 27]
    alone = [runner.run([StepInput(a, 0, ta)]), runner.run([StepInput(b, 0, tb)]), runner.run([StepInput(c, 0, tc)])]
    runner.kv_cache.zero_()
    runner.run([StepInput(b[:-1], 0, tb)])
    runner.run([StepInput(c[:-1], 0, tc)])
    mixed = runner.run([StepInput(a, 0, ta), StepInput(b[-1:], len(b) - 1, tb), StepInput(c[-1:], len(c) - 1, tc)])
    for i in range(3):
        torch.testing.assert_close(mixed[i], alone[i][0], rtol=0, atol=1e-5)


def test_missing_tensor_is_a_clear_error(tmp_path, awkward_model_dir):
    import shutil

    from safetensors.torch import load_file, save_file

    for f in ("config.json", "tokenizer.json"):
        shutil.copy(f"{awkward_model_dir}/{f}", tmp_path / f)
    tensors = load_file(f"{awkward_model_dir}/model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensors"):
        load_model(tmp_path)


def test_config_rejects_inconsistent_heads(tmp_path, awkward_model_dir):
    raw = json.loads(open(f"{awkward_model_dir}/config.json").read())
    raw["num_key_value_heads"] = 2  # 3 query heads cannot share 2 KV heads
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="not a multiple"):
        ModelConfig.from_hf_dir(tmp_path)


def test_rope_parameters_of_new_transformers_are_read(tmp_path, awkward_model_dir):
    raw = json.loads(open(f"{awkward_model_dir}/config.json").read())
    assert ModelConfig.from_hf_dir(awkward_model_dir).rope_theta == 500.0
    raw.pop("rope_parameters", None)
    raw["rope_theta"] = 1234.0
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert ModelConfig.from_hf_dir(tmp_path).rope_theta == 1234.0
