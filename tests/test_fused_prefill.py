"""The fused C kernels on prefill-sized bf16 rows: residual add + RMSNorm, RoPE + KV write with bf16
queries, SiLU-and-mul, each against the torch code it replaces, and a model's prefill with and without them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels.cpu import fused as cfused
from pdserve.kernels.paged_attention import write_kv
from pdserve.model import llama
from pdserve.model.kv_cache import KVCacheSpec
from pdserve.model.loader import load_model
from pdserve.model.rope import apply_rotary
from pdserve.model.runner import ModelRunner, StepInput

needs_vector = pytest.mark.skipif(not cfused.vectorized(), reason="the fused kernels are not built for AVX-512 here")


@pytest.fixture(params=["lookup", "arithmetic"])
def silu_path(request):
    """Each path of the bf16 SiLU in turn (kernels/cpu/silu_mul.h), the process's own choice restored after."""
    chosen = cfused.silu_path()
    cfused.set_silu_path(request.param)
    yield request.param
    cfused.set_silu_path(chosen)


@needs_vector
def test_silu_paths_are_the_ones_named_and_bad_names_are_refused(silu_path):
    assert cfused.silu_path() == silu_path
    with pytest.raises(ValueError, match="not a path"):
        cfused.set_silu_path("table")


@needs_vector
def test_silu_and_mul_is_torch_bit_for_bit_on_prefill_rows_and_at_the_exp_range_edges(silu_path):
    g = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(300, 2 * 1000, generator=g) * 4).bfloat16()     # a 1000-wide row: masked tails
    edges = torch.tensor([-1e30, -100.0, -88.8, -88.7, -87.5, -87.0, -0.0, 0.0, 87.0, 87.5, 88.7, 100.0,
                          float("inf"), float("-inf"), float("nan"), 1e-40])
    gate_up[0, :16] = edges.bfloat16()
    gate, up = gate_up.split(1000, -1)
    got, ref = cfused.silu_and_mul(gate_up), F.silu(gate) * up
    assert torch.equal(got.isnan(), ref.isnan())
    assert torch.equal(got.nan_to_num(0.0), ref.nan_to_num(0.0))
    assert torch.equal(got.signbit(), ref.signbit())                          # -0 where torch gives -0


@needs_vector
def test_silu_and_mul_over_every_bf16_gate_value_rounds_as_torch(silu_path):
    # every one of the 65,536 bf16 bit patterns as a gate, times 1 and times random ups: the C SiLU must round
    # to bf16 as torch's does (a faster quotient, vrcp14ps and a Newton step, was checked here and measured
    # slower). Where torch's SiLU or its product is subnormal (or rounded up to the least normal) the kernel's
    # bf16 conversion (vcvtneps2bf16) may have flushed the float32 value to zero.
    gate = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(256, 256)
    g = torch.Generator().manual_seed(3)
    for up in (torch.ones_like(gate), (torch.randn(256, 256, generator=g) * 3).bfloat16()):
        got, ref = cfused.silu_and_mul(torch.cat([gate, up], 1)), F.silu(gate) * up
        tiny = torch.zeros_like(ref, dtype=torch.bool)
        for t in (F.silu(gate), ref):
            tiny |= (t.float().abs() <= torch.finfo(torch.float32).tiny) & (t != 0)
        assert torch.equal(got.isnan(), ref.isnan())
        keep = ~tiny & ~ref.isnan()
        assert torch.equal(got[keep], ref[keep]) and torch.equal(got[keep].signbit(), ref[keep].signbit())
        assert ((got[tiny] == 0) | (got[tiny] == ref[tiny])).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [200, 8200])  # rows kept in float32 between the passes, and rows too wide for that
def test_add_rms_norm_is_the_add_then_the_c_norm(dtype, width):
    g = torch.Generator().manual_seed(1)
    x, r = (torch.randn(70, width, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(width, generator=g).to(dtype)
    normed, s = cfused.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(s, x + r)
    assert torch.equal(normed, cfused.rms_norm(x + r, w, 1e-5))
    with pytest.raises(ValueError, match="does not match"):
        cfused.add_rms_norm(x, r[:, :100].contiguous(), w, 1e-5)


def test_rope_write_kv_returns_bf16_queries_equal_to_apply_rotary():
    heads, kv_heads, dim, n = 4, 2, 64, 40
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=g).bfloat16()
    pos = torch.arange(n) * 3
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    emb = torch.cat((pos[:, None] * inv, pos[:, None] * inv), -1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    slots = torch.randperm(64, generator=g)[:n]
    cache, ref_cache = (torch.zeros(16, 2, 2, 4, kv_heads, dim, dtype=torch.bfloat16) for _ in range(2))
    q = cfused.rope_write_kv(qkv, cos, sin, cache, 1, slots, heads, kv_heads, dim, q_dtype=torch.bfloat16)
    qr, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    write_kv(ref_cache, 1, apply_rotary(k.reshape(n, kv_heads, dim), cos, sin), v.reshape(n, kv_heads, dim), slots)
    assert q.dtype == torch.bfloat16 and torch.equal(q, apply_rotary(qr.reshape(n, heads, dim), cos, sin))
    assert torch.equal(cache, ref_cache)
    with pytest.raises(ValueError, match="q_dtype"):
        cfused.rope_write_kv(qkv, cos, sin, cache, 1, slots, heads, kv_heads, dim, q_dtype=torch.float16)


@pytest.fixture(scope="module")
def model_64(tmp_path_factory) -> str:
    """A random-weight bf16 Llama with 64-dim heads (the size the C RoPE + prefill attention take)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("llama-64")
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=500, max_position_embeddings=512)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    return str(out)


@needs_vector
def test_bf16_prefill_through_the_fused_kernels_equals_the_torch_operations(model_64, monkeypatch):
    """Two chunks (the second attends to the first through the cache) of 150 and 90 rows: the hidden
    states and the KV cache equal those of the torch RoPE, cache write and SiLU, bit for bit."""
    (fused_logits, fused_cache), (torch_logits, torch_cache) = _fused_and_torch_prefill(model_64, monkeypatch,
                                                                                        torch_silu=True)
    assert torch.equal(fused_cache, torch_cache)
    assert torch.equal(fused_logits, torch_logits)


def _fused_and_torch_prefill(model_dir: str, monkeypatch, torch_silu: bool = False):
    """((logits, cache) with the C RoPE + KV write, (logits, cache) without it (and with torch's SiLU where
    ``torch_silu``)) of a bf16 prefill in two chunks (the second attends to the first through the cache) of 150
    and 90 rows; every layer of both chunks must have taken the C kernel in the first."""
    model, cfg = load_model(model_dir, torch.bfloat16)
    ids = torch.randint(3, cfg.vocab_size, (240,), generator=torch.Generator().manual_seed(3)).tolist()
    table = list(range(20, 36))

    def prefill() -> tuple[torch.Tensor, torch.Tensor]:
        runner = ModelRunner(model, KVCacheSpec(40, cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim,
                                                torch.bfloat16))
        runner.run([StepInput(ids[:150], 0, table)])
        return runner.run([StepInput(ids[150:], 150, table)]), runner.kv_cache

    calls = []
    monkeypatch.setattr(cfused, "rope_write_kv", _counting(cfused.rope_write_kv, calls))
    fused = prefill()
    assert len(calls) == 2 * cfg.num_layers                         # every layer of both chunks took it
    monkeypatch.setattr(llama.Attention, "_c_prefill", lambda self, qkv, kv_cache: False)
    if torch_silu:
        monkeypatch.setattr(llama.MLP, "_c_silu", staticmethod(lambda gate_up: False))
    reference = prefill()
    assert len(calls) == 2 * cfg.num_layers
    return fused, reference


def _counting(fn, calls: list):
    def wrapped(*args, **kwargs):
        calls.append(args[0].shape[0])
        return fn(*args, **kwargs)
    return wrapped


@needs_vector
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_write_kv_with_qk_norms_is_the_c_rms_norm_of_each_head_then_rope(dtype):
    """Qwen3's per-head q/k RMSNorm on the AVX-512 path (head_dim 128): bit for bit the C RMSNorm of every
    head, then the norm-free RoPE and cache write; within two roundings of torch's norm."""
    heads, kv_heads, dim, n, eps = 8, 4, 128, 40, 1e-6
    g = torch.Generator().manual_seed(4)
    qkv = (torch.randn(n, (heads + 2 * kv_heads) * dim, generator=g) * 3).to(dtype)
    wq, wk = (1 + torch.randn(dim, generator=g) * 0.3).to(dtype), torch.randn(dim, generator=g).to(dtype)
    pos = torch.arange(n) * 5
    inv = 1.0 / (1e6 ** (torch.arange(0, dim, 2).float() / dim))
    emb = torch.cat((pos[:, None] * inv, pos[:, None] * inv), -1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    slots = torch.randperm(64, generator=g)[:n]
    cache, ref_cache = (torch.zeros(16, 2, 2, 4, kv_heads, dim, dtype=dtype) for _ in range(2))
    q = cfused.rope_write_kv(qkv, cos, sin, cache, 1, slots, heads, kv_heads, dim, wq, wk, eps, q_dtype=dtype)
    qr, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    normed = torch.cat([cfused.rms_norm(qr.reshape(-1, dim), wq, eps).reshape(n, -1),
                        cfused.rms_norm(k.reshape(-1, dim), wk, eps).reshape(n, -1), v], -1)
    q_ref = cfused.rope_write_kv(normed, cos, sin, ref_cache, 1, slots, heads, kv_heads, dim, q_dtype=dtype)
    assert torch.equal(q, q_ref) and torch.equal(cache, ref_cache)
    norm = llama.RMSNorm(dim, eps).to(dtype)
    norm.weight.data = wq
    torch_q = apply_rotary(norm(qr.reshape(n, heads, dim)), cos, sin)      # torch's own float32 sum
    ulp = 2.0 ** (torch.floor(torch.log2(torch_q.float().abs().clamp_min(2 ** -126))) - (7 if dtype == torch.bfloat16
                                                                                         else 23))
    assert ((q.float() - torch_q.float()).abs() <= 4 * ulp + 1e-6).all()


@pytest.fixture(scope="module")
def qwen3_128(tmp_path_factory) -> str:
    """A random-weight bf16 Qwen3 with 128-dim heads and q/k norms."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = tmp_path_factory.mktemp("qwen3-128")
    cfg = Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=128, vocab_size=500, max_position_embeddings=512,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    for layer in model.model.layers:         # norms away from 1, so that a missing or misplaced one shows
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            norm.weight.data = 1 + torch.randn(128) * 0.5
    model.to(torch.bfloat16).save_pretrained(out)
    return str(out)


@needs_vector
def test_qwen3_bf16_prefill_takes_the_c_qk_norm_and_rope_and_keeps_the_torch_result(qwen3_128, monkeypatch):
    """A Qwen3 prefill in two chunks runs its q/k norms, RoPE and cache writes in C on every layer, and its
    logits and cache stay within the RMS sums' order of the torch operations' (the greedy tokens equal)."""
    assert load_model(qwen3_128, torch.bfloat16)[1].qk_norm
    (fused_logits, fused_cache), (torch_logits, torch_cache) = _fused_and_torch_prefill(qwen3_128, monkeypatch)
    fused0, torch0 = fused_cache[20:36, 0], torch_cache[20:36, 0]       # layer 0 of the table's blocks
    assert torch.equal(fused0[:, 1], torch0[:, 1]) and fused0[:, 1].abs().sum() > 0      # its values as written
    keys_differ = fused0[:, 0] != torch0[:, 0]   # its keys but where a sum's order moved a rounding (~5e-5)
    assert keys_differ.float().mean() < 1e-3
    ulp = 2.0 ** (torch.floor(torch.log2(torch0[:, 0].float().abs().clamp_min(2 ** -126))) - 7)
    assert ((fused0[:, 0].float() - torch0[:, 0].float()).abs() <= 2 * ulp).all()
    torch.testing.assert_close(fused_logits, torch_logits, rtol=0.02, atol=0.05)
    assert torch.equal(fused_logits.argmax(-1), torch_logits.argmax(-1))
