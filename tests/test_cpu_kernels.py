"""The C kernels of CPU decode (kernels/cpu): packed bf16 gemv and AMX gemm, paged attention,
fused RMSNorm / RoPE + KV write / SiLU-and-mul, each against the torch code it replaces, on
awkward shapes; and the packed GEMMs' next-chunk prefetches present in their builds (the decode model
with them against the model without: test_cpu_packed_model.py)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.cpu import KernelUnavailable, _build, available
from pdserve.kernels.cpu import fused as cfused
from pdserve.kernels.cpu.attention import attention_available, paged_attention_cpu
from pdserve.kernels.cpu.gemv import (
    AMX_SIDE_MIN_ROWS,
    amx_gate_up_silu,
    bf16_gemm_kernel,
    gemm_amx_available,
    gemm_bf16_amx,
    gemm_bf16_avx512,
    gemv_available,
    gemv_bf16,
    pack_weight,
    packed_bf16_available,
    run_unchecked,
    unpack_weight,
)
from pdserve.kernels.paged_attention import build_attention_metadata, paged_attention_torch, write_kv
from pdserve.model.cpu_linear import PackedBF16Linear
from pdserve.model.llama import RMSNorm
from pdserve.model.rope import apply_rotary
from tests.disassembly import count_instruction, needs_objdump

needs_gemv = pytest.mark.skipif(not gemv_available(), reason="no AVX512-BF16 or no C compiler")
needs_amx = pytest.mark.skipif(not gemm_amx_available(), reason="no AMX-BF16")
needs_packed = pytest.mark.skipif(not packed_bf16_available(), reason="no AVX2 or no C compiler")
needs_attention = pytest.mark.skipif(not attention_available(), reason="no C compiler")


def _bf16_close(y: torch.Tensor, ref: torch.Tensor) -> None:
    """``y`` (bf16) is ``ref`` (float32, exact) rounded once: within half a bf16 ulp of |ref| plus
    the float32 summation-order error."""
    tol = ref.abs() * 2 ** -8 + 1e-4 * ref.abs().max()
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    assert ((y.float() - ref).abs() <= tol).all(), (y.float() - ref).abs().max()


@needs_gemv
@pytest.mark.parametrize("n,k,m", [(37, 100, 1), (16, 2, 3), (1000, 72, 2), (33, 7, 1), (1280, 768, 3)])
def test_gemv_matches_float32_product_and_is_batch_invariant(n, k, m):
    torch.manual_seed(n + k + m)
    w, x = torch.randn(n, k).bfloat16(), torch.randn(m, k).bfloat16()
    packed = pack_weight(w)
    assert torch.equal(unpack_weight(packed, n, k), w)
    xp = F.pad(x, (0, k % 2))
    y = gemv_bf16(xp, packed, n)
    _bf16_close(y, x.float() @ w.float().t())
    for row in range(m):                                  # a row alone == the same row in a batch
        assert torch.equal(gemv_bf16(xp[row:row + 1].contiguous(), packed, n), y[row:row + 1])


@needs_gemv
def test_gemv_refuses_what_it_cannot_take():
    packed = pack_weight(torch.randn(20, 8))
    with pytest.raises(ValueError, match="row-major 2-D bf16"):
        gemv_bf16(torch.randn(1, 8), packed, 20)                         # float32 input
    with pytest.raises(ValueError, match="8 columns"):
        gemv_bf16(torch.randn(1, 8).bfloat16(), packed, 33)              # more outputs than packed rows
    with pytest.raises(ValueError, match="pack_weight"):
        gemv_bf16(torch.randn(1, 8).bfloat16(), torch.randn(20, 8).bfloat16(), 20)


@needs_gemv
@pytest.mark.parametrize("n,k,m", [(37, 2, 3), (50, 34, 5), (16, 770, 17), (1000, 72, 33), (33, 770, 64),
                                   (1280, 768, 3), (40, 600, 300), (100, 2050, 9), (49, 3074, 300),
                                   (37, 2050, 8), (100, 1030, 6), (17, 3074, 7)])     # 5-8 rows: one lone tile
def test_avx512_gemm_is_the_gemv_row_for_row(n, k, m):
    """Bit-identical to the gemv (same summation order), for any M (row tails, more than one 256-row
    pass), N (column tails, n_valid < Np) and K (one pair, odd pair counts, several 1,024-column chunks
    with a one-pair tail);
    each row alone gives the same bits as in the batch; a strided x the same as a contiguous one."""
    torch.manual_seed(n + k + m)
    w, x = torch.randn(n, k).bfloat16(), torch.randn(m, k).bfloat16()
    packed = pack_weight(w)
    y = gemm_bf16_avx512(x, packed, n)
    assert torch.equal(y, gemv_bf16(x, packed, n))
    _bf16_close(y, x.float() @ w.float().t())
    for row in (0, m // 2, m - 1):
        assert torch.equal(gemm_bf16_avx512(x[row:row + 1], packed, n), y[row:row + 1])
    strided = torch.zeros(m, k + 6).bfloat16()
    strided[:, 3:3 + k] = x
    assert torch.equal(gemm_bf16_avx512(strided[:, 3:3 + k], packed, n), y)


@needs_gemv
@pytest.mark.parametrize("n,k,m", [(37, 770, 5), (100, 34, 33), (16, 2, 64)])
def test_avx512_gemm_rounds_the_exact_product_once(n, k, m):
    """Small integers: every float32 partial sum is exact, so the result must be the exact product
    rounded once to bf16, bit for bit."""
    torch.manual_seed(k)
    w, x = torch.randint(-8, 9, (n, k)).bfloat16(), torch.randint(-8, 9, (m, k)).bfloat16()
    ref = (x.double() @ w.double().t()).bfloat16()
    assert torch.equal(gemm_bf16_avx512(x, pack_weight(w), n), ref)


@needs_gemv
def test_avx512_gemm_refuses_what_it_cannot_take():
    packed = pack_weight(torch.randn(20, 8))
    for bad, match in ((torch.randn(3, 8), "row-major 2-D bf16"),                  # float32
                       (torch.randn(8, 3).bfloat16().t(), "row-major 2-D bf16"),   # column-major
                       (torch.randn(3, 10).bfloat16(), "10 columns")):             # wrong width
        with pytest.raises(ValueError, match=match):
            gemm_bf16_avx512(bad, packed, 20)
    with pytest.raises(ValueError, match="out_features=4"):
        gemm_bf16_avx512(torch.randn(3, 8).bfloat16(), packed, 4)                  # a whole block short
    with pytest.raises(ValueError, match="pack_weight"):
        gemm_bf16_avx512(torch.randn(3, 8).bfloat16(), torch.randn(20, 8).bfloat16(), 20)


@needs_packed
def test_kernel_for_names_the_path_each_row_count_takes():
    lin = nn.Linear(64, 40).bfloat16().requires_grad_(False)
    packed_only, with_dense = PackedBF16Linear(lin, keep_dense=False), PackedBF16Linear(lin, keep_dense=True)
    big = "gemm-amx" if gemm_amx_available() else bf16_gemm_kernel()
    # the gemv up to 2 rows beside AMX, up to 4 (one weight pass) beside the AVX512-BF16 gemm, never
    # beside the FMA gemm (which sums in another order)
    gemv_rows = 2 if gemm_amx_available() else 4 if bf16_gemm_kernel() == "gemm-avx512bf16" else 0
    rows = (1, 2, 3, 4, 5, 32, 100_000)
    assert [packed_only.kernel_for(r) for r in rows] == ["gemv-avx512bf16" if r <= gemv_rows else big for r in rows]
    # beyond the packed kernels' range F.linear, but never beside the float32-FMA GEMMs (it is 4-9x slower there)
    beyond = big if big in ("gemm-fma", "gemm-avx2") else "F.linear"
    assert with_dense.kernel_for(32) == big and with_dense.kernel_for(100_000) == beyond
    assert (with_dense.weight is None) == (beyond == big)          # no dense copy kept where it is never used
    x = torch.randn(5, 64).bfloat16()                                 # what it names is what runs
    assert torch.equal(packed_only(x), run_unchecked(x, packed_only.packed, 40, packed_only.kernel_for(5))
                       + lin.bias)


@needs_amx
@pytest.mark.parametrize("n,k,m", [(37, 64, 4), (16, 32, 17), (1000, 96, 33), (48, 2048, 64), (8, 32, 1),
                                   (101, 64, 3), (130, 96, 16), (64, 32, 20), (80, 64, 32), (200, 128, 70),
                                   (200, 768, 130), (70, 512, 128), (48, 2048, 300), (33, 4096, 161)])
def test_amx_gemm_matches_float32_product_and_is_batch_invariant(n, k, m):
    """Up to 16 rows, 17-32, 33-127 and from 128 (input columns in slices of 256 where k <= 1,024, rows in
    groups of 128-512) take four different tile plans (and 4, 3, 2 or 1 weight streams at the last columns): each
    matches the float32 product, and a row's result does not depend on the others."""
    torch.manual_seed(n * m)
    w, x = torch.randn(n, k).bfloat16(), torch.randn(m, k).bfloat16()
    y = gemm_bf16_amx(x, pack_weight(w), n)
    _bf16_close(y, x.float() @ w.float().t())
    for rows in (slice(0, 1), slice(m - 1, m), slice(0, min(m, 17))):
        assert torch.equal(gemm_bf16_amx(x[rows].contiguous(), pack_weight(w), n), y[rows])


@needs_amx
@pytest.mark.parametrize("inter,k,m,pieces", [(2048, 768, 512, 4), (512, 96, 130, 2), (1408, 2048, 200, 8),
                                              (256, 64, 128, 1)])
def test_amx_gate_up_in_pieces_with_the_silu_beside_is_the_gemm_then_the_silu(inter, k, m, pieces):
    """Each piece's SiLU-and-mul run inside the next piece's gemm (pd_gemm_bf16_amx_side) gives the whole gate_up
    projection's C SiLU-and-mul bit for bit; bad shapes are refused."""
    torch.manual_seed(inter + m)
    w, x = (torch.randn(2 * inter, k) * 0.05).bfloat16(), torch.randn(m, k).bfloat16()
    packed = pack_weight(w)
    ref = cfused.silu_and_mul(gemm_bf16_amx(x, packed, 2 * inter))
    assert torch.equal(amx_gate_up_silu(x, packed, inter, pieces), ref)
    with pytest.raises(ValueError, match="amx_gate_up_silu"):
        amx_gate_up_silu(x[:AMX_SIDE_MIN_ROWS - 1], packed, inter, pieces)
    with pytest.raises(ValueError, match="amx_gate_up_silu"):
        amx_gate_up_silu(x, packed, inter, 3)


@needs_amx
def test_a_packed_gate_up_runs_prefill_rows_in_pieces_on_amx():
    """A gate_up packed without a dense copy (as an AMX prefill worker packs it for chunks of up to 512 rows) takes
    the pieces path from AMX_SIDE_MIN_ROWS rows (1,024 intermediate columns: four pieces of 512), equal to the
    projection then the C SiLU-and-mul; fewer rows take those two; with a bias, no pieces."""
    torch.manual_seed(0)
    gate_up = PackedBF16Linear(nn.Linear(64, 2048, bias=False, dtype=torch.bfloat16), keep_dense=False, gate_up=True)
    assert gate_up.pieces == 4
    x = torch.randn(AMX_SIDE_MIN_ROWS + 9, 64).bfloat16()
    ref = cfused.silu_and_mul(gate_up(x))
    calls = []
    with mock.patch("pdserve.model.cpu_linear.amx_gate_up_silu",
                    side_effect=lambda *a: calls.append(a[0].shape[0]) or amx_gate_up_silu(*a)):
        assert torch.equal(gate_up.silu_mul(x), ref)
        assert torch.equal(gate_up.silu_mul(x[:5]), ref[:5])
    assert calls == [AMX_SIDE_MIN_ROWS + 9]
    assert gate_up.label_for(AMX_SIDE_MIN_ROWS) == "gemm-amx x4 pieces, SiLU beside"
    assert gate_up.label_for(AMX_SIDE_MIN_ROWS - 1) == gate_up.kernel_for(AMX_SIDE_MIN_ROWS - 1) == "gemm-amx"
    assert PackedBF16Linear(nn.Linear(64, 2048, dtype=torch.bfloat16), keep_dense=False, gate_up=True).pieces == 1


@needs_amx
def test_amx_gemm_needs_whole_32_column_groups():
    with pytest.raises(ValueError, match="multiple of 32"):
        gemm_bf16_amx(torch.randn(5, 40).bfloat16(), pack_weight(torch.randn(16, 40)), 16)


@needs_attention
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(8, 4, 16, 16), (3, 1, 24, 5), (12, 4, 64, 16),
                                                                 (4, 2, 128, 4), (2, 2, 48, 3)])
def test_paged_attention_matches_torch_path(dtype, heads, kv_heads, head_dim, block_size):
    """Decode rows, query blocks (speculative verification, causal inside the block), a fresh prompt
    and contexts ending mid-block, on scattered blocks; NaN in unused cache slots must not leak."""
    torch.manual_seed(head_dim)
    num_blocks = 64
    cache = torch.full((num_blocks, 2, 2, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    query_lens, seq_lens = [1, 3, 1, 2, 16, 5], [7, 20, 1, 33, 40, 5]
    perm = torch.randperm(num_blocks).tolist()
    tables = []
    for s in seq_lens:
        n = -(-s // block_size)
        tables.append(perm[:n])
        perm = perm[n:]
        for b in tables[-1]:                                  # real positions hold finite K/V
            cache[b] = torch.randn(2, 2, block_size, kv_heads, head_dim).to(dtype)
    meta = build_attention_metadata(query_lens, seq_lens, tables, block_size)
    for i, (s, t) in enumerate(zip(seq_lens, tables)):        # positions past the end are NaN again
        for p in range(s, len(t) * block_size):
            cache[t[p // block_size], :, :, p % block_size] = float("nan")
    q = torch.randn(sum(query_lens), heads, head_dim).to(dtype)
    ref = paged_attention_torch(q, None, None, cache.nan_to_num(0.0), 1, meta, 0.3)   # torch's mask lets NaN in
    out = paged_attention_cpu(q, cache, 1, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.3)
    assert out.dtype == dtype and not out.isnan().any()
    atol = 1e-5 if dtype == torch.float32 else ref.float().abs().max().item() * 2 ** -7
    torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=atol)


@needs_attention
def test_paged_attention_refuses_mismatched_shapes():
    cache = torch.zeros(4, 1, 2, 4, 2, 16)
    meta = build_attention_metadata([1], [3], [[0]], 4)
    with pytest.raises(ValueError, match="does not fit"):
        paged_attention_cpu(torch.randn(1, 3, 16), cache, 0, meta.query_start_loc, meta.seq_lens,
                            meta.block_tables, 1.0)                        # 3 heads over 2 KV heads
    with pytest.raises(ValueError, match="int32"):
        paged_attention_cpu(torch.randn(1, 4, 16), cache, 0, meta.query_start_loc.long(), meta.seq_lens,
                            meta.block_tables, 1.0)


@pytest.mark.skipif(not available("fused"), reason="no C compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [24, 64, 128])
def test_fused_ops_round_as_the_torch_code(dtype, dim):
    """bf16: bit-identical to the model's torch code; float32: RoPE and the cache bit-identical,
    RMSNorm and SiLU within the summation order / expf implementation (1e-6). RoPE at head sizes the
    AVX-512 path takes (multiples of 32) and one it does not (24)."""
    torch.manual_seed(1)
    exact = dtype == torch.bfloat16
    x = torch.randn(5, 72).to(dtype)
    norm = RMSNorm(72, 1e-5).to(dtype)
    norm.weight.data = torch.randn(72).to(dtype)
    xf = x.float()
    ref = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    _same(cfused.rms_norm(x, norm.weight, 1e-5), ref, exact)

    gate_up = torch.randn(3, 200).to(dtype)
    gate, up = gate_up.split(100, -1)
    _same(cfused.silu_and_mul(gate_up), F.silu(gate) * up, exact)

    heads, kv_heads, bs, n = 3, 1, 5, 4
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim).to(dtype)
    pos = torch.tensor([3, 9, 10, 0])
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    emb = torch.cat((pos[:, None] * inv, pos[:, None] * inv), -1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    slots = torch.tensor([3, 14, 15, 29])
    cache = torch.zeros(6, 2, 2, bs, kv_heads, dim, dtype=dtype)
    q_out = cfused.rope_write_kv(qkv, cos, sin, cache, 1, slots, heads, kv_heads, dim)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    ref_cache = torch.zeros_like(cache)
    write_kv(ref_cache, 1, apply_rotary(k.view(n, kv_heads, dim), cos, sin), v.view(n, kv_heads, dim), slots)
    assert torch.equal(q_out, apply_rotary(q.view(n, heads, dim), cos, sin).float())
    assert torch.equal(cache, ref_cache)


@pytest.mark.skipif(not cfused.vectorized(), reason="RMSNorm not built for AVX-512 here")
def test_prefill_sized_bf16_rows_take_the_c_rms_norm_within_one_rounding_of_torch():
    torch.manual_seed(2)
    x = torch.randn(512, 768).bfloat16()
    norm = RMSNorm(768, 1e-5).bfloat16()
    norm.weight.data = torch.randn(768).bfloat16()
    got = norm(x)                                            # no cpu_kernel flag: a prefill chunk's rows
    assert torch.equal(got, cfused.rms_norm(x, norm.weight, 1e-5))
    xf = x.float()
    ref = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    ulp = 2.0 ** (torch.floor(torch.log2(ref.float().abs().clamp_min(2 ** -126))) - 7)
    assert ((got.float() - ref.float()).abs() <= 2 * ulp).all()   # the sum's order moves a rounding at most


def _same(y: torch.Tensor, ref: torch.Tensor, exact: bool) -> None:
    assert y.dtype == ref.dtype and y.shape == ref.shape
    if exact:
        assert torch.equal(y, ref)
    else:
        torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6)


def test_a_missing_compiler_is_reported_not_raised(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))                 # no cc, no gcc
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))       # and nothing built yet
    with pytest.raises(KernelUnavailable, match="no C compiler"):
        _build("fused")


def test_a_failed_build_is_compiled_once_and_retried_when_its_source_changes(monkeypatch, tmp_path):
    """A library that cannot build here (an AVX-512 source on an AVX2 CPU) costs one compile, not one per
    process: the failure is recorded under the build's key, and a changed source is a new key."""
    import pdserve.kernels.cpu as kc

    src = tmp_path / "src"
    src.mkdir()
    (src / "broken.c").write_text("int f(void) { return undeclared; }\n")
    monkeypatch.setattr(kc, "_HERE", src)
    monkeypatch.setitem(kc._FLAGS, "broken", ["-O0"])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    compiles = []
    real = kc.compile_library
    monkeypatch.setattr(kc, "compile_library", lambda *a: (compiles.append(a[0]), real(*a)))
    with pytest.raises(KernelUnavailable, match="undeclared"):
        _build("broken")
    with pytest.raises(kc.BuildFailedBefore, match="failed before"):      # logged at INFO by available()
        _build("broken")
    assert compiles == ["broken"]
    (src / "broken.c").write_text("int f(void) { return 1; }\n")
    assert _build("broken").exists() and compiles == ["broken", "broken"]


def test_packed_linear_refuses_float32_weights():
    with pytest.raises(ValueError, match="bf16 CPU weight"):
        PackedBF16Linear(nn.Linear(8, 8))


def test_loading_the_kernels_leaves_subnormals_alone():
    """A library linked with -ffast-math would switch the whole process to flush-to-zero."""
    for name in ("gemv_bf16", "paged_attention", "fused"):
        available(name)
    tiny = float("5e-324")
    assert tiny * 1.0 != 0.0
    assert (torch.tensor([1e-40]) * 1.0).item() != 0.0


@needs_gemv
def test_gemv_refuses_fewer_outputs_than_its_last_packed_block():
    """Asking for outputs a whole 16-row block short of the packed weight would write past y."""
    with pytest.raises(ValueError, match="out_features=8"):
        gemv_bf16(torch.randn(1, 32).bfloat16(), pack_weight(torch.randn(64, 32)), 8)


@pytest.mark.skipif(not available("fused"), reason="no C compiler")
def test_fused_ops_refuse_what_they_cannot_take():
    qkv = torch.randn(2, 5 * 16).bfloat16()
    cos = sin = torch.zeros(2, 16)
    cache = torch.zeros(4, 1, 2, 4, 1, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="int64"):
        cfused.rope_write_kv(qkv, cos, sin, cache, 0, torch.tensor([1, 2], dtype=torch.int32), 3, 1, 16)
    with pytest.raises(ValueError, match="does not fit"):
        cfused.rope_write_kv(qkv, cos, sin, cache.float(), 0, torch.tensor([1, 2]), 3, 1, 16)
    with pytest.raises(ValueError, match="row-major"):
        cfused.silu_and_mul(torch.randn(8, 2).t())
    with pytest.raises(ValueError, match="weight must be"):
        cfused.rms_norm(torch.randn(2, 8), torch.ones(8).bfloat16(), 1e-5)


@needs_objdump
@pytest.mark.parametrize("name,insn", [("gemv_bf16", "prefetcht1"), ("gemm_bf16_avx2", "prefetcht1"),
                                       ("gemm_bf16_fma", "prefetcht0")])
def test_the_packed_gemms_keep_their_weight_prefetches(name, insn):
    """Each packed GEMM's build keeps its weight prefetches: every row tile's share of the next chunk
    (chunk_ahead.h, T1) in the vdpbf16ps and AVX2 GEMMs, each tile's own stream (T0) in the FMA GEMM.
    Helpers called from a function of another target can vanish from the build without a word (GCC 12
    did so to the decode attention's prefetches)."""
    try:
        path = _build(name)
    except KernelUnavailable as exc:
        pytest.skip(str(exc))
    assert count_instruction(path, insn) >= 1


def test_mask_logits_matches_the_bitmask_bit_for_bit():
    """fused.c's pd_mask_logits against the bits themselves, vocabularies not a multiple of 16 or 32."""
    from pdserve.kernels.cpu.fused import mask_logits_

    gen = torch.Generator().manual_seed(0)
    for vocab in (1, 15, 16, 33, 2048, 2053):
        words = -(-vocab // 32)
        bits = torch.randint(-(2**31), 2**31 - 1, (words,), dtype=torch.int32, generator=gen)
        bits[0] = -1 if vocab > 40 else bits[0]            # a word of all ones: stored unchanged
        logits = torch.randn(vocab, generator=gen)
        allowed = torch.tensor([bool(int(bits[j // 32]) >> (j % 32) & 1) for j in range(vocab)])
        expected = torch.where(allowed, logits, torch.tensor(-torch.inf))
        assert torch.equal(mask_logits_(logits.clone(), bits), expected), vocab
    with pytest.raises(ValueError, match="int32 bitmask"):
        mask_logits_(torch.zeros(64), torch.zeros(1, dtype=torch.int32))
