"""CPU steps that mix decode rows with prefill chunks (a colocated worker's chunked prefill): the metadata's
split into the two groups, each group on its own kernel, and the torch path's gather indices left unbuilt
where the C kernels read the block tables."""

from __future__ import annotations

import textwrap

import pytest
import torch

import pdserve.kernels.paged_attention as pa
from pdserve.kernels.cpu.attention import (
    attention_available,
    paged_attention_cpu,
    prefill_attention_available,
    prefill_attention_cpu,
)
from pdserve.kernels.paged_attention import build_attention_metadata, paged_attention, paged_attention_torch
from pdserve.model.kv_cache import KVCacheSpec
from pdserve.model.loader import load_model
from pdserve.model.runner import ModelRunner, StepInput
from tests.triton_subprocess import run_script

needs_kernels = pytest.mark.skipif(not (attention_available() and prefill_attention_available(64)),
                                   reason="no C compiler or no AVX2")

# a 40-token chunk after 20 tokens, a decode row, a 3-token verification block, a fresh 9-token prompt
QUERY_LENS, SEQ_LENS = [40, 1, 3, 9], [60, 33, 17, 9]


def _tables(block_size: int) -> list[list[int]]:
    tables, at = [], 0
    for s in SEQ_LENS:
        n = -(-s // block_size)
        tables.append(list(range(at + n - 1, at - 1, -1)))      # each sequence's blocks in reverse order
        at += n
    return tables


@needs_kernels
def test_a_mixed_step_is_split_into_its_decode_sized_and_its_prefill_sequences():
    meta = build_attention_metadata(QUERY_LENS, SEQ_LENS, _tables(16), 16, "cpu", torch.bfloat16)
    d, p = meta.split.decode, meta.split.prefill
    assert d.rows.tolist() == [40, 41, 42, 43] and p.rows.tolist() == list(range(40)) + list(range(44, 53))
    assert d.query_start_loc.tolist() == [0, 1, 4] and p.query_start_loc.tolist() == [0, 40, 49]
    assert d.seq_lens.tolist() == [33, 17] and p.seq_lens.tolist() == [60, 9]
    assert d.block_tables.tolist() == [[6, 5, 4, 0], [8, 7, 0, 0]]
    assert p.block_tables.tolist() == [[3, 2, 1, 0], [9, 0, 0, 0]]
    assert all(t.dtype == torch.int32 for t in (d.query_start_loc, d.seq_lens, d.block_tables))


@pytest.mark.parametrize("query_lens, seq_lens, kv_dtype", [
    ([1, 1, 8], [5, 9, 20], torch.bfloat16),        # decode-sized only: the decode kernel takes the whole step
    ([40, 9], [60, 9], torch.bfloat16),             # prefill chunks only
    ([40, 1], [60, 9], None),                       # no cache dtype: no CPU kernels considered
    ([40, 1], [60, 9], torch.float16),              # a cache the C kernels do not read
])
def test_steps_that_are_not_mixed_or_not_for_the_c_kernels_are_not_split(query_lens, seq_lens, kv_dtype):
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(query_lens))]
    assert build_attention_metadata(query_lens, seq_lens, tables, 16, "cpu", kv_dtype).split is None


def _cache_and_queries(block_size: int = 16, heads: int = 12, kv_heads: int = 4, head_dim: int = 64):
    torch.manual_seed(0)
    num_blocks = sum(len(t) for t in _tables(block_size))
    cache = torch.randn(num_blocks, 2, 2, block_size, kv_heads, head_dim).bfloat16()
    q = (torch.randn(sum(QUERY_LENS), heads, head_dim) * 2).bfloat16()
    return cache, q


@needs_kernels
def test_each_group_of_a_mixed_step_gets_its_own_kernels_result_and_torchs_within_bf16():
    cache, q = _cache_and_queries()
    meta = build_attention_metadata(QUERY_LENS, SEQ_LENS, _tables(16), 16, "cpu", torch.bfloat16, head_dim=64)
    out = paged_attention(q, None, None, cache, 1, meta, 0.2)
    d, p = meta.split.decode, meta.split.prefill
    alone_d = paged_attention_cpu(q[d.rows], cache, 1, d.query_start_loc, d.seq_lens, d.block_tables, 0.2)
    alone_p = prefill_attention_cpu(q[p.rows], cache, 1, p.query_start_loc, p.seq_lens, p.block_tables, 0.2)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out[d.rows], alone_d) and torch.equal(out[p.rows], alone_p)
    reference = build_attention_metadata(QUERY_LENS, SEQ_LENS, _tables(16), 16)     # the torch path's
    ref = paged_attention_torch(q.float(), None, None, cache.float(), 1, reference, 0.2)
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=ref.abs().max().item() * 2 ** -7)


@needs_kernels
def test_only_the_attention_that_runs_gets_gather_indices_and_the_torch_path_refuses_metadata_without():
    tables = _tables(16)
    for_c = build_attention_metadata(QUERY_LENS, SEQ_LENS, tables, 16, "cpu", torch.bfloat16, head_dim=64)
    assert for_c.ctx_block is None and for_c.ctx_offset is None and for_c.attn_mask is None
    assert for_c.split.prefill_torch is None                  # both groups on C kernels
    cache, q = _cache_and_queries()
    with pytest.raises(ValueError, match="built for the C attention kernels"):
        paged_attention_torch(q, None, None, cache, 1, for_c, 0.2)
    fp32 = build_attention_metadata(QUERY_LENS, SEQ_LENS, tables, 16, "cpu", torch.float32, head_dim=64)
    group = fp32.split.prefill_torch                          # a float32 cache's chunks: the torch path, alone
    assert fp32.attn_mask is None and group.attn_mask.shape == (2, 1, 40, 60) and not group.fresh_prefill
    assert group.ctx_block[1].tolist() == [9] * 9 + [0] * 51                       # the fresh prompt gathers
    chunk = build_attention_metadata([40], [60], tables[:1], 16, "cpu", torch.bfloat16)   # no split, no head_dim
    assert chunk.split is None and chunk.attn_mask.shape == (1, 1, 40, 60)
    assert chunk.ctx_block[0].tolist() == [3] * 16 + [2] * 16 + [1] * 16 + [0] * 12
    assert build_attention_metadata([40], [60], tables[:1], 16, "cpu", torch.bfloat16, head_dim=64).attn_mask is None


@needs_kernels
def test_a_mixed_float32_step_pads_no_decode_row_to_the_chunk_and_matches_torch():
    cache, q = _cache_and_queries()
    cache, q = cache.float(), q.float()
    meta = build_attention_metadata(QUERY_LENS, SEQ_LENS, _tables(16), 16, "cpu", torch.float32, head_dim=64)
    out = paged_attention(q, None, None, cache, 1, meta, 0.2)
    d = meta.split.decode
    alone_d = paged_attention_cpu(q[d.rows], cache, 1, d.query_start_loc, d.seq_lens, d.block_tables, 0.2)
    assert out.dtype == torch.float32 and torch.equal(out[d.rows], alone_d)
    ref = paged_attention_torch(q, None, None, cache, 1, build_attention_metadata(QUERY_LENS, SEQ_LENS, _tables(16),
                                                                                   16), 0.2)
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-5)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_mixed_step_sends_only_its_prefill_rows_to_the_prefill_attention_and_keeps_every_rows_logits(
        model_dir, monkeypatch, dtype):
    model, cfg = load_model(model_dir, dtype)
    runner = ModelRunner(model, KVCacheSpec.for_model(cfg, 32, 16, dtype))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in (70, 30, 45)]
    tables = [list(range(0, 6)), list(range(8, 12)), list(range(16, 20))]
    runner.run([StepInput(prompts[0][:40], 0, tables[0])])
    alone = runner.run([StepInput(prompts[0][40:], 40, tables[0])])                # the chunk after, alone
    for p, t in zip(prompts[1:], tables[1:]):
        runner.run([StepInput(p[:-1], 0, t)])
    decode_alone = runner.run([StepInput(p[-1:], len(p) - 1, t) for p, t in zip(prompts[1:], tables[1:])])
    seen = []
    name = "prefill_attention_cpu" if dtype == torch.bfloat16 else "paged_attention_torch"
    kernel = getattr(pa, name)

    def spy(q, *args):
        seen.append(q.shape[0])
        return kernel(q, *args)

    monkeypatch.setattr(pa, name, spy)
    mixed = runner.run([StepInput(prompts[1][-1:], len(prompts[1]) - 1, tables[1]),
                        StepInput(prompts[0][40:], 40, tables[0]),
                        StepInput(prompts[2][-1:], len(prompts[2]) - 1, tables[2])])
    assert seen == [30] * cfg.num_layers                     # the chunk's rows only, at every layer
    atol = 0.05 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(mixed[1], alone[0], rtol=0, atol=atol)
    torch.testing.assert_close(mixed[[0, 2]], decode_alone, rtol=0, atol=atol)
    assert mixed.argmax(-1).tolist() == [decode_alone[0].argmax().item(), alone[0].argmax().item(),
                                         decode_alone[1].argmax().item()]


_TRITON_SCRIPT = textwrap.dedent("""
    import json, os
    assert os.environ["TRITON_INTERPRET"] == "1"
    import torch
    from pdserve.kernels import paged_attention as pa

    torch.manual_seed(0)
    query_lens, seq_lens, bs = [1, 20, 1, 9], [37, 50, 5, 9], 16
    tables, at = [], 0
    for s in seq_lens:
        n = -(-s // bs)
        tables.append(list(range(at + n - 1, at - 1, -1)))
        at += n
    cache = torch.randn(at, 2, 2, bs, 2, 32)
    q = torch.randn(sum(query_lens), 4, 32)
    # the groups a CUDA step gets (decode-sized: one token), built here on the CPU for the interpreter
    split = pa.split_groups(query_lens, torch.tensor(seq_lens), torch.tensor([t + [0] * (4 - len(t)) for t in tables],
                            dtype=torch.int32), bs, torch.device("cpu"), 1, True)
    out = pa.split_attention(q, cache, 1, split, 0.3, c_prefill=False, triton=True)
    ref = pa.paged_attention_torch(q, None, None, cache, 1, pa.build_attention_metadata(query_lens, seq_lens, tables,
                                                                                          bs), 0.3)
    print(json.dumps({"decode_rows": split.decode.rows.tolist(), "max_err": (out - ref).abs().max().item()}))
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter check is for machines without a GPU")
def test_a_mixed_gpu_step_runs_its_single_token_rows_on_the_triton_decode_kernel():
    """Under the Triton interpreter: a step's one-token rows on the decode kernel, its chunks on the torch path
    over their own metadata, together torch's result for the whole step."""
    result = run_script(_TRITON_SCRIPT, timeout=300)
    assert result["decode_rows"] == [0, 21]
    assert result["max_err"] < 1e-5
