"""oneDNN projections on a weight reordered once (model/onednn_linear.py): F.linear bit for bit, as a prefill
worker loads them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.cpu import fused as cfused
from pdserve.kernels.cpu.gemv import bf16_gemm_kernel, gemm_amx_available, packed_bf16_available
from pdserve.model.cpu_linear import FLOAT_GEMMS, dense_beats_packed_for_prefill, pack_for_cpu_decode
from pdserve.model.kv_cache import KVCacheSpec
from pdserve.model.loader import load_model
from pdserve.model.onednn_linear import (
    KERNEL,
    OneDNNGateUp,
    OneDNNLinear,
    choose_gate_up_pieces,
    onednn_prepack_available,
    prepack_for_cpu_prefill,
)
from pdserve.model.runner import ModelRunner, StepInput
from pdserve.prefill_worker.server import load_prefill_model

needs_prepack = pytest.mark.skipif(not onednn_prepack_available(), reason="no oneDNN bf16 prepacking here")
needs_pieces = pytest.mark.skipif(not (onednn_prepack_available() and cfused.vectorized()),
                                  reason="no oneDNN bf16 prepacking or no AVX-512 SiLU-and-mul here")


def float_gemm_everywhere() -> bool:
    """Whether a colocated worker's packed projections run every row count on a float32-FMA GEMM here (an AVX-512
    CPU without AVX512-BF16 or AMX, where oneDNN's bf16 prepacking still runs but is never taken)."""
    return not gemm_amx_available() and packed_bf16_available() and bf16_gemm_kernel() in FLOAT_GEMMS


def _tiny_llama(path, intermediate: int, tied: bool, layers: int):
    """A transformers Llama of hidden size 64 saved at ``path`` (returned)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=intermediate, num_hidden_layers=layers,
                                 num_attention_heads=2, num_key_value_heads=1, vocab_size=100,
                                 tie_word_embeddings=tied)).save_pretrained(path)
    return path


def _prefill_each(models, cfg, rows: int, seed: int) -> list:
    """One ``rows``-token prefill of the same random prompt on each model (bf16 cache): their outputs."""
    ids = torch.randint(3, cfg.vocab_size, (rows,), generator=torch.Generator().manual_seed(seed)).tolist()
    outs = []
    for model in models:
        runner = ModelRunner(model, KVCacheSpec(rows // 16 + 1, cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim,
                                                torch.bfloat16))
        outs.append(runner.run([StepInput(ids, 0, list(range(rows // 16 + 1)))]))
    return outs


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
    model, _ = load_model(_tiny_llama(tmp_path, 128, tied=False, layers=1), torch.bfloat16)
    assert prepack_for_cpu_prefill(model, 16) == 5 and type(model.lm_head) is OneDNNLinear


@pytest.mark.parametrize("chunk,threads", [(128, 1), (2048, 1), (128, 2)])
def test_the_prefill_worker_prepacks_exactly_where_its_projections_stay_on_f_linear(model_dir, chunk, threads):
    """oneDNN's prepacked weights for chunks where they beat the packed kernels (AMX CPUs: chunks over 512 rows, or
    a worker of more threads than the packed kernels take), the packed kernels without dense copies elsewhere."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)                  # as the worker sets its own before it loads
    try:
        model, _ = load_prefill_model(model_dir, torch.bfloat16, chunk_tokens=chunk)
    finally:
        torch.set_num_threads(before)
    kinds = {type(m).__name__ for n, m in model.named_modules() if n.endswith(("qkv_proj", "down_proj"))}
    oned = dense_beats_packed_for_prefill(chunk, threads)
    assert oned == (gemm_amx_available() and (chunk > 512 or threads > 1))
    if oned and onednn_prepack_available():
        assert kinds == {"OneDNNLinear"}
        assert type(model.lm_head) is nn.Linear                 # tied: one row per chunk on the shared weight
    else:
        assert "OneDNNLinear" not in kinds and type(model.lm_head) is not OneDNNLinear


@needs_prepack
def test_a_colocated_worker_runs_prefill_rows_on_the_prepacked_copy_and_keeps_the_head_shared(model_dir):
    """pack_for_cpu_decode(keep_dense=True), as a colocated decode worker packs where oneDNN prepacking runs: each
    layer's projections take rows beyond the packed kernels' range on oneDNN's copy (no dense weight kept), the
    tied LM head keeps the embedding's weight; a prefill chunk 44 rows past that range (556 rows on the AMX gemm's
    and the AVX512-BF16 gemm's) equals the dense model's bit for bit. Where the packed GEMM is a float32-FMA one
    (:func:`float_gemm_everywhere`) nothing dense or prepacked is kept and every row count runs packed."""
    dense, cfg = load_model(model_dir, torch.bfloat16)
    packed, _ = load_model(model_dir, torch.bfloat16)
    pack_for_cpu_decode(packed, keep_dense=True)
    down, head = packed.layers[0].mlp.down_proj, packed.lm_head
    if float_gemm_everywhere():           # no dense weight and no oneDNN copy: prefill rows run packed too
        assert down.weight is None and down.onednn is None and down.kernel_for(100_000) == bf16_gemm_kernel()
        assert head.weight is None and head.onednn is None and head.kernel_for(100_000) == bf16_gemm_kernel()
        return
    assert down.weight is None and down.onednn is not None and down.kernel_for(100_000) == KERNEL
    assert head.onednn is None and head.weight is packed.embed_tokens.weight and head.kernel_for(100_000) == "F.linear"
    if not packed_bf16_available():
        return
    rows = down.max_rows + 44
    packed.lm_head = dense.lm_head          # the head's one sampled row runs on the gemv: compare what precedes it
    assert torch.equal(*_prefill_each((dense, packed), cfg, rows, seed=2))


def test_gate_up_pieces_follow_the_width_rule():
    assert choose_gate_up_pieces(2048, 512) == 4              # bench-80m: pieces of 1,024 columns
    assert choose_gate_up_pieces(2048, 2048) == 4
    assert choose_gate_up_pieces(2048, 256) == 1              # short chunks keep the whole weight
    assert choose_gate_up_pieces(5632, 512) == 8              # TinyLlama: 1,408
    assert choose_gate_up_pieces(11008, 512) == 16            # Llama 2 7B: 1,376
    assert choose_gate_up_pieces(768, 512) == 1               # 1,536 wide already
    assert choose_gate_up_pieces(1000, 512) == 1              # halves of 500: not a multiple of 16


@needs_pieces
@pytest.mark.parametrize("bias", [False, True])
def test_gate_up_in_pieces_is_f_linear_piece_by_piece(bias):
    """Each piece's projection is F.linear on its gate and up rows bit for bit, its SiLU-and-mul the C kernel's
    on that output; the whole projection from forward equals F.linear on the whole weight within bf16 rounding
    (oneDNN may sum a piece's columns in another order than the whole weight's)."""
    torch.manual_seed(0)
    linear = nn.Linear(96, 2 * 256, bias=bias, dtype=torch.bfloat16)
    gu = OneDNNGateUp(linear, rows_hint=64, pieces=4)
    w, b, c = linear.weight, linear.bias, 64
    for shape in ((1, 96), (70, 96), (3, 5, 96)):
        x = torch.randn(*shape).bfloat16()
        ref_act, ref_whole = [], [[], []]
        for p in range(4):
            rows = torch.cat([w[p * c:(p + 1) * c], w[256 + p * c:256 + (p + 1) * c]])
            bias_p = None if b is None else torch.cat([b[p * c:(p + 1) * c], b[256 + p * c:256 + (p + 1) * c]])
            out = F.linear(x.reshape(-1, 96), rows, bias_p)
            ref_act.append(cfused.silu_and_mul(out))
            ref_whole[0].append(out[:, :c]), ref_whole[1].append(out[:, c:])
        assert torch.equal(gu.silu_mul(x), torch.cat(ref_act, 1).view(*shape[:-1], 256))
        assert torch.equal(gu(x), torch.cat(ref_whole[0] + ref_whole[1], 1).view(*shape[:-1], 512))
        torch.testing.assert_close(gu(x), F.linear(x, w, b), rtol=1.6e-2, atol=1e-2)
    assert gu.kernel_for(64) == f"{KERNEL} x4 pieces" and (gu.in_features, gu.out_features) == (96, 512)
    with pytest.raises(ValueError, match="bf16"):
        gu.silu_mul(torch.randn(3, 96))
    with pytest.raises(ValueError, match="divisible"):
        OneDNNGateUp(nn.Linear(96, 2 * 100, dtype=torch.bfloat16), pieces=8)
    wide = torch.zeros(4, 300, dtype=torch.bfloat16)
    cfused.silu_and_mul(torch.ones(4, 200, dtype=torch.bfloat16), wide[:, 50:150])      # into a column slice
    assert wide[:, :50].eq(0).all() and wide[:, 150:].eq(0).all() and wide[:, 50:150].ne(0).all()
    with pytest.raises(ValueError, match="out must be"):
        cfused.silu_and_mul(torch.ones(4, 200, dtype=torch.bfloat16), wide[:, :99])


@needs_pieces
def test_a_wide_mlp_is_prepacked_in_pieces_and_prefills_as_the_dense_model(tmp_path):
    _tiny_llama(tmp_path, 1024, tied=True, layers=2)
    dense, cfg = load_model(tmp_path, torch.bfloat16)
    packed, _ = load_model(tmp_path, torch.bfloat16)
    assert prepack_for_cpu_prefill(packed, 512) == 4 * cfg.num_layers
    gate_up = packed.layers[0].mlp.gate_up_proj
    assert type(gate_up) is OneDNNGateUp and gate_up.pieces == 2           # 2,048 columns in two of 1,024
    ids = torch.randint(3, cfg.vocab_size, (90,), generator=torch.Generator().manual_seed(3)).tolist()
    outs = []
    for model in (dense, packed):
        runner = ModelRunner(model, KVCacheSpec(8, cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16))
        outs.append(runner.run([StepInput(ids, 0, list(range(6)))]))
    torch.testing.assert_close(outs[1], outs[0], rtol=0.05, atol=0.05)


@needs_pieces
def test_a_colocated_worker_runs_a_wide_mlps_prefill_rows_in_pieces(tmp_path):
    """pack_for_cpu_decode(keep_dense=True) on a model whose gate_up the rule cuts: the prepacked copy is in
    pieces, rows past the packed kernels' range take them piece by piece (close to the dense model), and rows
    within it take the packed kernels then the C SiLU-and-mul, as the MLP runs them without pieces. Where the
    packed GEMM is a float32-FMA one nothing is prepacked and no MLP is cut."""
    if not packed_bf16_available():
        pytest.skip("no packed bf16 kernels here")
    _tiny_llama(tmp_path, 1024, tied=True, layers=2)
    dense, cfg = load_model(tmp_path, torch.bfloat16)
    packed, _ = load_model(tmp_path, torch.bfloat16)
    pack_for_cpu_decode(packed, keep_dense=True)
    gate_up = packed.layers[0].mlp.gate_up_proj
    if float_gemm_everywhere():           # never in pieces: every row count runs the packed GEMM
        assert gate_up.onednn is None and not hasattr(gate_up, "silu_mul")
        assert gate_up.kernel_for(100_000) == bf16_gemm_kernel()
        return
    assert type(gate_up.onednn) is OneDNNGateUp and gate_up.onednn.pieces == 2
    assert gate_up.kernel_for(100_000) == f"{KERNEL} x2 pieces"
    assert not hasattr(packed.layers[0].mlp.down_proj, "silu_mul")
    few = torch.randn(3, 64).bfloat16()
    assert torch.equal(gate_up.silu_mul(few), cfused.silu_and_mul(gate_up(few)))
    rows = gate_up.max_rows + 44
    packed.lm_head = dense.lm_head
    calls, pieces_silu_mul = [], gate_up.onednn.silu_mul
    gate_up.onednn.silu_mul = lambda x: calls.append(x.shape[0]) or pieces_silu_mul(x)
    want, got = _prefill_each((dense, packed), cfg, rows, seed=4)
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)
    assert calls == [rows]                                  # layer 0's MLP ran its chunk in pieces
