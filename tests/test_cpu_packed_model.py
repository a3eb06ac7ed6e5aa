"""The decode worker's CPU model as a whole: weights moved into huge pages (aligned, ties kept), the bf16 model
with packed linears, C attention and fused ops against the same weights through ``F.linear``, packed linears
without a dense copy at every row count, and a float16 model kept off the C kernels (the kernels one by one:
test_cpu_kernels.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.cpu.gemv import packed_bf16_available
from pdserve.kernels.paged_attention import build_attention_metadata
from pdserve.model.cpu_linear import PackedBF16Linear, pack_for_cpu_decode
from pdserve.model.hugepages import HUGE_PAGE, empty_huge, move_to_huge_pages
from pdserve.model.kv_cache import KVCacheSpec
from pdserve.model.loader import load_model
from pdserve.model.runner import ModelRunner, StepInput

needs_packed = pytest.mark.skipif(not packed_bf16_available(), reason="no AVX2 or no C compiler")


def test_huge_page_tensors_are_aligned_and_weights_stay_tied(model_dir):
    t = empty_huge(3 * HUGE_PAGE // 2 + 7, torch.bfloat16)
    assert t.numel() == 3 * HUGE_PAGE // 2 + 7 and t.data_ptr() % HUGE_PAGE == 0
    model, _ = load_model(model_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert move_to_huge_pages(model) > 0
    assert model.lm_head.weight is model.embed_tokens.weight          # tied stays tied
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


@needs_packed
@pytest.mark.parametrize("which", ["embedded", "awkward"])
def test_packed_bf16_model_matches_the_plain_bf16_model(which, model_dir, awkward_model_dir):
    """The decode worker's bf16 model (packed linears, huge pages, C attention and fused ops) against
    the same weights through F.linear: logits of a prefill and of decode steps at 1, 4 and 9 rows
    (gemv or gemm, AVX512-BF16 or AMX gemm, F.linear) agree to bf16 precision and pick the same greedy tokens."""
    path = model_dir if which == "embedded" else awkward_model_dir
    plain, cfg = load_model(path, torch.bfloat16)
    packed = copy.deepcopy(plain)
    assert pack_for_cpu_decode(packed) == 4 * cfg.num_layers + 1
    assert all(isinstance(m, PackedBF16Linear) for m in (packed.lm_head, packed.layers[0].mlp.down_proj))
    move_to_huge_pages(packed)
    spec = KVCacheSpec(64, cfg.num_layers, 4, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    runners = [ModelRunner(m, spec) for m in (plain, packed)]
    for rows in (1, 4, 9):
        seqs = [[(7 * r + 3 * i) % (cfg.vocab_size - 3) + 3 for i in range(6 + r)] for r in range(rows)]
        tables = [list(range(5 * r, 5 * r + 5)) for r in range(rows)]
        outs = []
        for runner in runners:
            prefill = runner.run([StepInput(s, 0, t) for s, t in zip(seqs, tables)])
            step = runner.run([StepInput([int(p.argmax())], len(s), t) for p, s, t in zip(prefill, seqs, tables)])
            outs.append((prefill, step))
        for a, b in zip(*outs):
            torch.testing.assert_close(b, a, rtol=0, atol=a.abs().max().item() * 2 ** -6)
            assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.75


@needs_packed
def test_without_a_dense_copy_every_row_count_runs_on_the_packed_weight():
    torch.manual_seed(3)
    lin = nn.Linear(64, 40).bfloat16().requires_grad_(False)
    mod = PackedBF16Linear(lin, keep_dense=False)
    assert mod.weight is None                                          # the packed kernels cover every row count
    for rows in (1, 2, 3, 40, 300, 700):
        x = torch.randn(rows, 64).bfloat16()
        ref = x.float() @ lin.weight.float().t() + lin.bias.float()       # product and bias round once each
        y = mod(x)
        assert y.dtype == torch.bfloat16 and ((y.float() - ref).abs() <= ref.abs() * 2 ** -7 + 1e-3).all()
    x = torch.randn(2, 64)                                             # a float32 caller gets float32
    torch.testing.assert_close(mod(x), F.linear(x, lin.weight.float(), lin.bias.float()), rtol=0, atol=1e-5)


def test_a_float16_model_runs_on_the_torch_path(model_dir):
    """The C kernels take float32/bf16 caches only: a float16 step must not be sent to them."""
    meta = build_attention_metadata([1], [3], [[0]], 4, "cpu", torch.float16)
    assert not meta.cpu_kernels and build_attention_metadata([1], [3], [[0]], 4, "cpu", torch.bfloat16).cpu_kernels
    half, cfg = load_model(model_dir, torch.float16)
    full, _ = load_model(model_dir, torch.float32)
    spec = KVCacheSpec(16, cfg.num_layers, 4, cfg.num_kv_heads, cfg.head_dim, torch.float16)
    outs = []
    for model, s in ((half, spec), (full, KVCacheSpec(16, cfg.num_layers, 4, cfg.num_kv_heads, cfg.head_dim))):
        runner = ModelRunner(model, s)
        prefill = runner.run([StepInput(list(range(3, 12)), 0, [0, 1, 2, 3])])
        outs.append(runner.run([StepInput([int(prefill.argmax())], 9, [0, 1, 2, 3])]))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=outs[1].abs().max().item() * 0.02)
