"""oneDNN projections on a weight reordered once (model/onednn_linear.py): F.linear bit for bit, as a prefill
worker loads them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.cpu.gemv import packed_bf16_available
from pdserve.model.cpu_linear import dense_beats_packed_for_prefill, pack_for_cpu_decode
from pdserve.model.kv_cache import KVCacheSpec
from pdserve.model.loader import load_model
from pdserve.model.onednn_linear import KERNEL, OneDNNLinear, onednn_prepack_available, prepack_for_cpu_prefill
from pdserve.model.runner import ModelRunner, StepInput
from pdserve.prefill_worker.server import load_prefill_model

needs_prepack = pytest.mark.skipif(not onednn_prepack_available(), reason="no oneDNN bf16 prepacking here")


@needs_prepack
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_linear_is_f_linear_bit_for_bit_at_any_row_count(bias):
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=bias, dtype=torch.bfloat16)
    packed = OneDNNLinear(linear, rows_hint=64)
    for rows in (1, 5, 64, 300):
        x = torch.randn(rows, 96).bfloat16()
        assert torch.equal(packed(x), F.linear(x, linear.weight, linear.bias))
    x3 = torch.randn(2, 7, 96).bfloat16()
    assert torch.equal(packed(x3), F.linear(x3, linear.weight, linear.bias))
    assert packed.kernel_for(512) == KERNEL and (packed.in_features, packed.out_features) == (96, 200)
    with pytest.raises(ValueError, match="bf16"):
        packed(torch.randn(3, 96))
    with pytest.raises(ValueError, match="bf16"):
        OneDNNLinear(nn.Linear(8, 8))


@needs_prepack
def test_a_prepacked_model_prefills_as_the_dense_one(model_dir):
    dense, cfg = load_model(model_dir, torch.bfloat16)
    packed, _ = load_model(model_dir, torch.bfloat16)
    assert prepack_for_cpu_prefill(packed, 64) == 4 * cfg.num_layers             # the layers' projections only
    assert type(packed.lm_head) is nn.Linear and packed.lm_head.weight is packed.embed_tokens.weight   # still tied
    assert prepack_for_cpu_prefill(packed, 64) == 0
    ids = torch.randint(3, cfg.vocab_size, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    outs = []
    for model in (dense, packed):
        runner = ModelRunner(model, KVCacheSpec(16, cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16))
        table = list(range(6))
        outs.append((runner.run([StepInput(ids[:70], 0, table)]), runner.run([StepInput(ids[70:], 70, table)])))
    assert all(torch.equal(a, b) for a, b in zip(*outs))


@needs_prepack
def test_an_untied_head_is_prepacked_too(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, vocab_size=100, tie_word_embeddings=False)
    LlamaForCausalLM(hf).save_pretrained(tmp_path)
    model, _ = load_model(tmp_path, torch.bfloat16)
    assert prepack_for_cpu_prefill(model, 16) == 5 and type(model.lm_head) is OneDNNLinear


def test_the_prefill_worker_prepacks_exactly_where_its_projections_stay_on_f_linear(model_dir):
    model, _ = load_prefill_model(model_dir, torch.bfloat16, chunk_tokens=128)
    kinds = {type(m).__name__ for n, m in model.named_modules() if n.endswith(("qkv_proj", "down_proj"))}
    if dense_beats_packed_for_prefill() and onednn_prepack_available():
        assert kinds == {"OneDNNLinear"}
        assert type(model.lm_head) is nn.Linear                 # tied: one row per chunk on the shared weight
    else:
        assert "OneDNNLinear" not in kinds and type(model.lm_head) is not OneDNNLinear


@needs_prepack
def test_a_colocated_worker_runs_prefill_rows_on_the_prepacked_copy_and_keeps_the_head_shared(model_dir):
    """pack_for_cpu_decode(keep_dense=True), as a colocated decode worker packs where oneDNN prepacking runs: each
    layer's projections take rows beyond the packed kernels' range on oneDNN's copy (no dense weight kept), the
    tied LM head keeps the embedding's weight; a prefill chunk 44 rows past that range (300 rows on an AMX CPU,
    556 on the AVX512-BF16 gemm's) equals the dense model's bit for bit."""
    dense, cfg = load_model(model_dir, torch.bfloat16)
    packed, _ = load_model(model_dir, torch.bfloat16)
    pack_for_cpu_decode(packed, keep_dense=True)
    down, head = packed.layers[0].mlp.down_proj, packed.lm_head
    assert down.weight is None and down.onednn is not None and down.kernel_for(100_000) == KERNEL
    assert head.onednn is None and head.weight is packed.embed_tokens.weight and head.kernel_for(100_000) == "F.linear"
    if not packed_bf16_available():
        return
    rows = down.max_rows + 44
    packed.lm_head = dense.lm_head          # the head's one sampled row runs on the gemv: compare what precedes it
    ids = torch.randint(3, cfg.vocab_size, (rows,), generator=torch.Generator().manual_seed(2)).tolist()
    outs = []
    for model in (dense, packed):
        runner = ModelRunner(model, KVCacheSpec(rows // 16 + 1, cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim,
                                                torch.bfloat16))
        outs.append(runner.run([StepInput(ids, 0, list(range(rows // 16 + 1)))]))
    assert torch.equal(*outs)
