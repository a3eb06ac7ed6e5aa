"""Checkpoints: hub repository ids from a local Hugging Face cache, sharded safetensors, loading
tensor by tensor, and the checkpoints pdserve refuses (named field, supported values)."""

from __future__ import annotations

import json
import shutil
import weakref
from pathlib import Path

import pytest
import torch

from pdserve.model import checkpoint, loader
from pdserve.model.checkpoint import INDEX_FILE
from pdserve.model.config import ModelConfig
from pdserve.model.kv_cache import KVCacheSpec
from pdserve.model.loader import load_model
from pdserve.model.model_dir import model_reference, resolve_model_dir
from pdserve.model.quant.int4_checkpoint import is_int4_checkpoint, load_int4_checkpoint, save_quantized_checkpoint
from pdserve.model.runner import ModelRunner, StepInput
from pdserve.model.tokenizer import Tokenizer
from tests.family_checkpoints import hf_model, random_prompt, write_checkpoint


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> str:
    return write_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2"), seed=3)


def _logits(model, cfg, ids):
    runner = ModelRunner(model, KVCacheSpec(16, cfg.num_layers, 4, cfg.num_kv_heads, cfg.head_dim))
    return runner.run([StepInput(ids, 0, list(range(16)))], all_logits=True)


def _fake_hub_cache(root: Path, repo_id: str, src: str, revision: str = "0123abcd") -> Path:
    """The layout huggingface_hub writes: refs/main -> commit, snapshots/<commit>/ holding the files."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    for f in Path(src).iterdir():
        shutil.copy(f, snapshot / f.name)
    return snapshot


def test_a_hub_repository_id_resolves_from_the_local_cache(tmp_path, monkeypatch, qwen2_dir):
    cache = tmp_path / "hub"
    snapshot = _fake_hub_cache(cache, "Qwen/Qwen2.5-Tiny-Instruct", qwen2_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert resolve_model_dir("Qwen/Qwen2.5-Tiny-Instruct") == snapshot
    assert model_reference("Qwen/Qwen2.5-Tiny-Instruct") == "Qwen/Qwen2.5-Tiny-Instruct"   # each process resolves
    assert model_reference(qwen2_dir) == str(Path(qwen2_dir).resolve())
    cfg = ModelConfig.from_hf_dir("Qwen/Qwen2.5-Tiny-Instruct")
    assert cfg == ModelConfig.from_hf_dir(qwen2_dir) and cfg.model_type == "qwen2"
    model, _ = load_model("Qwen/Qwen2.5-Tiny-Instruct")
    reference, _ = load_model(qwen2_dir)
    ids = random_prompt(9, seed=1)
    assert torch.equal(_logits(model, cfg, ids), _logits(reference, cfg, ids))
    assert Tokenizer("Qwen/Qwen2.5-Tiny-Instruct", cfg.bos_token_id).encode("Once upon") == \
        Tokenizer(qwen2_dir, cfg.bos_token_id).encode("Once upon")
    assert not is_int4_checkpoint("Qwen/Qwen2.5-Tiny-Instruct")


def test_an_absent_repository_says_where_it_looked(tmp_path, monkeypatch):
    cache = tmp_path / "empty-hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    for call in (resolve_model_dir, ModelConfig.from_hf_dir, load_model, model_reference,
                 lambda m: Tokenizer(m, None)):
        with pytest.raises(FileNotFoundError) as err:
            call("Qwen/Qwen2.5-0.5B-Instruct")
        assert str(cache / "models--Qwen--Qwen2.5-0.5B-Instruct" / "snapshots") in str(err.value)
    with pytest.raises(FileNotFoundError, match="no such checkpoint directory"):
        resolve_model_dir(str(tmp_path / "nowhere" / "at" / "all"))


def test_sharded_safetensors_load_through_their_index(tmp_path, qwen2_dir):
    """save_pretrained with a small max_shard_size writes shards and model.safetensors.index.json; a
    stray *.safetensors beside them is not read; a shard the index names must be there."""
    sharded = tmp_path / "sharded"
    hf_model(qwen2_dir).save_pretrained(sharded, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(qwen2_dir) / name, sharded / name)
    shards = checkpoint.safetensors_files(sharded)
    assert (sharded / INDEX_FILE).exists() and len(shards) > 2
    shutil.copy(shards[0], sharded / "stray.safetensors")
    model, cfg = load_model(sharded)
    reference, _ = load_model(qwen2_dir)
    ids = random_prompt(11, seed=2)
    assert torch.equal(_logits(model, cfg, ids), _logits(reference, cfg, ids))
    q = save_quantized_checkpoint(sharded, tmp_path / "int4", group_size=32)      # INT4 from shards
    assert not (q / INDEX_FILE).exists() and load_int4_checkpoint(q)[1] == cfg
    shards[-1].unlink()
    with pytest.raises(FileNotFoundError, match="shards that are not there"):
        load_model(sharded)


def test_tensors_are_cast_into_place_one_at_a_time(monkeypatch, tmp_path, qwen2_dir):
    """Loading a bf16 checkpoint as float32: each checkpoint tensor is gone before the next is read
    (never the whole checkpoint twice), and the model equals a cast of the bf16 weights."""
    bf16 = tmp_path / "bf16"
    hf = hf_model(qwen2_dir)
    hf.to(torch.bfloat16).save_pretrained(bf16)
    alive: list[weakref.ref] = []
    real = checkpoint.iter_tensors

    def watched(model_dir):
        for name, tensor in real(model_dir):
            assert not [r for r in alive if r() is not None], f"an earlier tensor is still held when {name} is read"
            alive.append(weakref.ref(tensor))
            yield name, tensor
            del tensor

    monkeypatch.setattr(loader, "iter_tensors", watched)
    model, _ = load_model(bf16, torch.float32)
    assert len(alive) > 10
    assert model.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(model.embed_tokens.weight, hf.model.embed_tokens.weight.float())
    k_bias = model.layers[1].self_attn.qkv_proj.bias[80:100]      # q: 4 heads x 20, then k: 1 head x 20
    assert torch.equal(k_bias, hf.model.layers[1].self_attn.k_proj.bias.float())


def _edited(tmp_path: Path, src: str, **changes) -> Path:
    out = tmp_path / "edited"
    shutil.copytree(src, out)
    raw = json.loads((out / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    (out / "config.json").write_text(json.dumps(raw))
    return out


@pytest.mark.parametrize("changes, field, supported", [
    (dict(model_type="gemma"), "model_type 'gemma'", "llama, mistral, qwen2, qwen3, phi3, granite"),
    (dict(architectures=["Qwen2ForSequenceClassification"]), "architectures", "Qwen2ForCausalLM"),
    (dict(hidden_act="gelu_pytorch_tanh"), "hidden_act 'gelu_pytorch_tanh'", "silu"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}, rope_parameters=None), "rope_scaling type 'yarn'",
     "default, linear, llama3"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}), "rope_scaling type 'dynamic'",
     "default, linear, llama3"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}, rope_parameters=None), "rope_scaling of type 'llama3'",
     "low_freq_factor"),
    (dict(quantization_config={"quant_method": "gptq", "bits": 4}), "quantization_config", "supported: none"),
    (dict(use_sliding_window=True, sliding_window=64, max_window_layers=1, layer_types=None), "sliding_window 64",
     "--max-model-len 64 or less"),
    (dict(head_dim=21), "head_dim 21", "even"),
    (dict(partial_rotary_factor=0.75), "partial_rotary_factor 0.75", "supported: 1.0"),
])
def test_unsupported_checkpoints_are_refused_naming_the_field(tmp_path, qwen2_dir, changes, field, supported):
    path = _edited(tmp_path, qwen2_dir, **changes)
    for call in (ModelConfig.from_hf_dir, load_model):
        with pytest.raises(ValueError) as err:
            call(path)
        assert field in str(err.value) and supported in str(err.value), str(err.value)


def test_mistral_sliding_window_is_refused_only_when_shorter_than_the_context(tmp_path):
    path = write_checkpoint("mistral", tmp_path / "m", sliding_window=128)       # 256-token context
    with pytest.raises(ValueError, match="sliding_window 128 .*shorter than the 256-token context"):
        load_model(path)
    for window in (256, 4096, None):
        raw = json.loads((Path(path) / "config.json").read_text()) | {"sliding_window": window}
        (Path(path) / "config.json").write_text(json.dumps(raw))
        assert ModelConfig.from_hf_dir(path).model_type == "mistral"


def test_max_model_len_serves_a_shorter_context_and_a_window_that_covers_it(tmp_path):
    """vLLM's --max-model-len: at most the checkpoint's context (0: all of it); a sliding window at least as
    long as it masks nothing, so Mistral v0.1- and Phi-3-mini-4k-like checkpoints load at their window."""
    path = write_checkpoint("mistral", tmp_path / "m", sliding_window=128)       # 256-token context
    for served in (128, 64, 1):
        cfg = ModelConfig.from_hf_dir(path, served)
        assert (cfg.max_model_len, cfg.max_position_embeddings) == (served, 256)
    for served in (129, 256):
        with pytest.raises(ValueError, match=f"shorter than the {served}-token context.*--max-model-len 128 or less"):
            load_model(path, max_model_len=served)
    model, cfg = load_model(path, max_model_len=100)
    assert cfg.max_model_len == model.cfg.max_model_len == 100
    raw = json.loads((Path(path) / "config.json").read_text()) | {"sliding_window": None}
    (Path(path) / "config.json").write_text(json.dumps(raw))
    assert ModelConfig.from_hf_dir(path).max_model_len == 256                    # 0: the checkpoint's
    for bad, match in ((257, "max_model_len 257 is longer than the checkpoint's context .*256"),
                       (-1, "max_model_len must be a whole number"), (True, "max_model_len must be a whole number")):
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_hf_dir(path, bad)


def test_phi3_long_rope_and_short_windows_are_refused(tmp_path):
    """Phi-3's longrope scaling (Phi-3.5, Phi-4-mini) and a window under the context (Phi-3-mini-4k's 2,047 of
    4,096) are refused by name; Phi-4's config (no window, plain RoPE) loads."""
    path = write_checkpoint("phi3", tmp_path / "p")
    assert ModelConfig.from_hf_dir(path).model_type == "phi3"
    for changes, match in ((dict(rope_scaling={"type": "longrope", "short_factor": [1.0] * 10,
                                               "long_factor": [1.0] * 10}, rope_parameters=None),
                            "rope_scaling type 'longrope'"),
                           (dict(sliding_window=128), "sliding_window 128 .*shorter than the 256-token context"),
                           (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                  "partial_rotary_factor": 0.75}), "partial_rotary_factor 0.75")):
        with pytest.raises(ValueError, match=match):
            load_model(_edited(tmp_path / match[:8], path, **changes))


def test_qwen_sliding_window_counts_only_when_enabled(tmp_path, qwen2_dir):
    """Qwen2.5 checkpoints carry sliding_window with use_sliding_window false: served; layer_types
    with a sliding layer and use_sliding_window true: refused."""
    ok = _edited(tmp_path, qwen2_dir, use_sliding_window=False, sliding_window=32, max_window_layers=0)
    assert ModelConfig.from_hf_dir(ok).qkv_bias
    shutil.rmtree(ok)
    bad = _edited(tmp_path, qwen2_dir, use_sliding_window=True, sliding_window=32,
                  layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(ValueError, match=r"sliding_window 32 \(on layers 1..1\)"):
        ModelConfig.from_hf_dir(bad)


def test_family_options_follow_the_transformers_modeling_code(tmp_path):
    """Which projections carry biases and whether q/k are normalized, per family (module docstring
    of model/families.py), read from checkpoints transformers wrote."""
    want = {("llama", False): (False, False, False), ("llama", True): (True, True, False),
            ("mistral", False): (False, False, False), ("qwen2", False): (True, False, False),
            ("qwen3", False): (False, False, True), ("qwen3", True): (True, True, True)}
    for (family, bias), (qkv_bias, o_bias, qk_norm) in want.items():
        over = {"attention_bias": True} if bias else {}
        cfg = ModelConfig.from_hf_dir(write_checkpoint(family, tmp_path / f"{family}-{bias}", **over))
        assert (cfg.qkv_bias, cfg.o_proj_bias, cfg.qk_norm) == (qkv_bias, o_bias, qk_norm), (family, bias)


def test_a_cluster_serves_a_hub_repository_id(tmp_path, monkeypatch, redis_url, qwen2_dir):
    """Router and workers (separate processes, inheriting HF_HUB_CACHE) resolve the id themselves."""
    from tests.clusters import Cluster
    from tests.conftest import hf_greedy

    _fake_hub_cache(tmp_path / "hub", "Qwen/Qwen2.5-Tiny", qwen2_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    c = Cluster("Qwen/Qwen2.5-Tiny", redis_url)
    try:
        ids = random_prompt(13, seed=4)
        assert c.complete(ids, max_tokens=10, temperature=0).token_ids == hf_greedy(hf_model(qwen2_dir), ids, 10)
        assert c.state().model == "Qwen/Qwen2.5-Tiny"
        c.assert_pools_free()
    finally:
        c.stop()


@pytest.mark.parametrize("changes, words", [
    (dict(rope_theta=float("nan")), "rope_theta must be a finite positive number"),
    (dict(rope_theta=0), "rope_theta must be a finite positive number"),           # was replaced by 10000
    (dict(rms_norm_eps=-1e-6), "rms_norm_eps must be a finite positive number"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 0.0}, rope_parameters=None), "rope_scaling factor"),
    (dict(rope_scaling="linear", rope_parameters=None), "rope_scaling must be an object"),
    (dict(tie_word_embeddings="false"), "tie_word_embeddings must be true or false"),  # bool("false") is True
    (dict(attention_bias=1), "attention_bias must be true or false"),
    (dict(vocab_size=None), "config.json lacks 'vocab_size'"),
    (dict(num_attention_heads=0), "num_attention_heads must be positive"),
    (dict(hidden_size=float("inf")), "wrong type or value"),
    (dict(bos_token_id=99999), "bos_token_id 99999 is not a token id"),
    (dict(bos_token_id="<s>"), "bos_token_id '<s>' is not a token id"),
])
def test_malformed_configs_are_refused_naming_the_field(tmp_path, qwen2_dir, changes, words):
    """Values that used to load and serve NaN logits, a different head, or fail later per request, or fail
    with a bare KeyError / ZeroDivisionError naming no file."""
    path = _edited(tmp_path, qwen2_dir, **changes)
    for call in (ModelConfig.from_hf_dir, load_model):
        with pytest.raises(ValueError) as err:
            call(path)
        assert words in str(err.value) and str(path) in str(err.value), str(err.value)


def test_eos_ids_of_the_generation_config_are_checked(tmp_path, qwen2_dir):
    path = _edited(tmp_path, qwen2_dir)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [[2]]}))  # unhashable per request
    with pytest.raises(ValueError, match=r"eos_token_id \[2\] is not a token id"):
        ModelConfig.from_hf_dir(path)


@pytest.mark.parametrize("text, words", [("{not json", "not a JSON file"), ("[1, 2]", "holds a JSON list"),
                                         ("\udcff".encode("utf-8", "surrogateescape"), "not a JSON file")])
def test_a_config_that_is_not_a_json_object_is_refused_naming_the_file(tmp_path, qwen2_dir, text, words):
    path = _edited(tmp_path, qwen2_dir)
    (path / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError, match=words) as err:
        ModelConfig.from_hf_dir(path)
    assert "config.json" in str(err.value)


def test_a_tied_head_stored_apart_from_its_embedding_is_refused(tmp_path, qwen2_dir):
    """A qwen3 checkpoint stores its own lm_head.weight: declared tied, one copy used to overwrite the other
    (the embedding took the head's weights, silently). A tied checkpoint (qwen2 here) loads tied."""
    untied = write_checkpoint("qwen3", tmp_path / "qwen3", seed=3)
    with pytest.raises(ValueError, match="differs from the tensor it is tied to"):
        load_model(_edited(tmp_path, untied, tie_word_embeddings=True))
    model, cfg = load_model(qwen2_dir)
    assert cfg.tie_word_embeddings and model.lm_head.weight is model.embed_tokens.weight


def test_a_draft_model_of_another_vocabulary_is_refused_at_start(tmp_path, qwen2_dir):
    from pdserve.decode_worker.config import DecodeWorkerConfig
    from pdserve.decode_worker.speculative import make_proposer

    draft = write_checkpoint("qwen2", tmp_path / "draft", seed=9, num_hidden_layers=1, vocab_size=96)
    model, cfg = load_model(qwen2_dir)
    runner = ModelRunner(model, KVCacheSpec.for_model(cfg, 16, 8, torch.float32))
    wcfg = DecodeWorkerConfig(model_dir=qwen2_dir, worker_id="t", speculative="draft", spec_draft_model=draft)
    with pytest.raises(ValueError, match=f"vocab_size 96 is not the target's {cfg.vocab_size}"):
        make_proposer(wcfg, runner)


def test_unreadable_tokenizer_and_weight_files_are_refused_naming_the_file(tmp_path, qwen2_dir):
    from pdserve.model.chat_template import ChatTemplate

    path = _edited(tmp_path, qwen2_dir)
    (path / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(ValueError, match="tokenizer.json: not a tokenizer file"):
        Tokenizer(path, 1)
    (path / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json: no such file"):
        Tokenizer(path, 1)
    shutil.copy(Path(qwen2_dir) / "tokenizer.json", path / "tokenizer.json")
    (path / "tokenizer_config.json").write_text("[]")
    for call in (lambda: Tokenizer(path, 1), lambda: ChatTemplate.load(path)):
        with pytest.raises(ValueError, match="tokenizer_config.json: holds a JSON list"):
            call()
    shard = next(path.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-100])                     # truncated
    with pytest.raises(ValueError, match=f"{shard.name}: not a readable safetensors file"):
        load_model(path)
    (path / INDEX_FILE).write_text(json.dumps({"weight_map": {"lm_head.weight": 3}}))
    with pytest.raises(ValueError, match="weight_map values must be shard file names"):
        load_model(path)
