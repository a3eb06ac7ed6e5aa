"""The AVX-512 paged attention kernel's grouped-query and page-walk paths (kernels/cpu/paged_attention.c)
against the torch path, on each of its paths this CPU runs (AVX-512, AVX2, portable C): every group size
1, 2, 3, 4, 8 of query heads per KV head, contexts of one token,
one page, a page plus one and mid-page, query blocks, batch invariance, scores rising along the context,
and the page prefetches present in the built library; and the same for the
prefill kernel (kernels/cpu/prefill_attention.c): whole prompts and later chunks, key tiles cut at
every edge, groups wider than its query tile, every head size it takes."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.cpu import available, library
from pdserve.kernels.cpu.attention import (
    PREFILL_ENV,
    attention_available,
    paged_attention_cpu,
    prefill_attention_available,
    prefill_attention_cpu,
    prefill_attention_path,
    prefill_library,
)
from pdserve.kernels.cpu.gemv import GEMM_ENV, bf16_gemm_kernel, gemm_amx_available, gemv_available
from pdserve.kernels.paged_attention import build_attention_metadata, paged_attention, paged_attention_torch
from tests.disassembly import count_instruction, needs_objdump

needs_attention = pytest.mark.skipif(not attention_available(), reason="no C compiler")
# pd_attention_force's paths
_DECODE_PATHS = {"cpu": 0, "avx2": 1, "portable": 2, "avx512-page-major": 3, "avx512-head-major": 4}


@pytest.fixture(params=list(_DECODE_PATHS))
def decode_path(request):
    """The decode kernel's paths this CPU can run: the one it chooses (AVX-512 where it has it), the AVX2
    path (what a CPU without AVX-512 takes), the portable C path and, on an AVX-512 CPU, both walks of the
    AVX-512 path (page-major, head-major: Zen 4 takes the second, other CPUs the first), forced through the
    library."""
    force = library("paged_attention").pd_attention_force
    if force(_DECODE_PATHS[request.param]) != 0:
        pytest.skip(f"no {request.param} path here")
    yield request.param
    assert force(0) == 0


needs_prefill = pytest.mark.skipif(not prefill_attention_available(64), reason="no C compiler or no AVX2")
_PREFILL_BUILDS = {"dpbf16": "prefill_attention", "fma": "prefill_attention_fma", "avx2": "prefill_attention_avx2",
                   "amx": "prefill_attention_amx"}


@pytest.fixture(params=list(_PREFILL_BUILDS))
def prefill_build(request, env_choice):
    """Each build of the prefill kernel this CPU can run: on AMX tiles (where granted), on ``vdpbf16ps``
    (AVX512-BF16 only), on 16-lane float32 FMAs (AVX-512) and on 8-lane ones (AVX2), chosen as a worker
    chooses it (AMX where granted, else through the bf16 GEMM choice; ``avx2`` is what a CPU without
    AVX-512 runs, forced here on one with it)."""
    if request.param == "amx" and not (gemm_amx_available() and available("prefill_attention_amx")):
        pytest.skip("no AMX")
    if request.param == "dpbf16" and not gemv_available():
        pytest.skip("no AVX512-BF16")
    if request.param == "fma" and not available("gemm_bf16_fma"):
        pytest.skip("no AVX-512")
    env_choice(PREFILL_ENV, "amx" if request.param == "amx" else "c", prefill_attention_path)
    if request.param != "amx":
        env_choice(GEMM_ENV, request.param, bf16_gemm_kernel)
    assert prefill_library() == _PREFILL_BUILDS[request.param]
    yield request.param


def _case(heads, kv_heads, head_dim, block_size, query_lens, seq_lens, dtype, seed=0):
    torch.manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    cache = torch.full((num_blocks, 2, 2, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    perm, tables = torch.randperm(num_blocks).tolist(), []
    for s in seq_lens:
        n = -(-s // block_size)
        tables.append(perm[:n])
        perm = perm[n:]
        for b in tables[-1]:
            cache[b] = torch.randn(2, 2, block_size, kv_heads, head_dim).to(dtype)
        for p in range(s, n * block_size):                    # slots past the context stay NaN
            cache[tables[-1][p // block_size], :, :, p % block_size] = float("nan")
    meta = build_attention_metadata(query_lens, seq_lens, tables, block_size)
    q = (torch.randn(sum(query_lens), heads, head_dim) * 2).to(dtype)
    return cache, meta, q


def _check(cache, meta, q, scale=0.2):
    ref = paged_attention_torch(q.float(), None, None, cache.nan_to_num(0.0).float(), 1, meta, scale)
    out = paged_attention_cpu(q, cache, 1, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale)
    assert out.dtype == q.dtype and not out.isnan().any()
    atol = 2e-5 if q.dtype == torch.float32 else ref.abs().max().item() * 2 ** -7
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=atol)
    return out


@needs_attention
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_every_group_size_and_context_edge_matches_torch(dtype, group, head_dim, decode_path):
    """Decode rows with 1, 2, 3, 4, 8 query heads per KV head (groups split across the kernel's
    register budget for head_dim 128), contexts of one token, exactly one page, one page + 1,
    mid-page and many pages, plus query blocks causal inside the block."""
    kv_heads = 2
    cache, meta, q = _case(group * kv_heads, kv_heads, head_dim, 16, [1, 1, 1, 1, 1, 4, 8],
                           [1, 16, 17, 45, 130, 20, 33], dtype, seed=group * head_dim)
    _check(cache, meta, q)


@needs_attention
@pytest.mark.parametrize("block_size", [1, 7, 32, 40])
def test_pages_smaller_and_larger_than_a_chunk(block_size, decode_path):
    """Pages of 1 and 7 tokens (a chunk per page) and of 32 and 40 (several chunks, the last partial)."""
    cache, meta, q = _case(6, 2, 64, block_size, [1, 1, 3], [1, 75, 64], torch.bfloat16, seed=block_size)
    _check(cache, meta, q)


@needs_attention
def test_large_scores_do_not_overflow(decode_path):
    """Scores far from 0 (the running max moves by hundreds between pages) stay finite and exact."""
    cache, meta, q = _case(4, 1, 64, 16, [1, 2], [100, 50], torch.float32)
    for t in range(0, 100, 16):
        cache[meta.block_tables[0, t // 16], 1, 0, :, 0] *= 1 + t / 10
    _check(cache, meta, q * 30, scale=1.0)


@needs_attention
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rise", [0.005, 0.02, 0.1])
def test_decode_scores_rising_along_the_context_match_torch(rise, dtype, decode_path):
    """Scores that climb along the context (rise per token: 0.8, 3.2 or 16 per 16-token chunk): a pair's
    reference max then stays for several chunks while its weights grow towards e^8, or moves at every
    chunk; either way acc / l is torch's (fails if what was summed under an old max is not rescaled)."""
    cache, meta, q = _case(6, 2, 64, 16, [1, 1, 3], [150, 37, 90], dtype, seed=11)
    direction = torch.randn(64)
    direction /= direction.norm()
    for i, length in enumerate((150, 37, 90)):
        for t in range(length):
            block, off = int(meta.block_tables[i, t // 16]), t % 16
            cache[block, 1, 0, off, 1] = (direction * rise * t * 5).to(dtype)        # kv head 1's K along one direction
    q[:] = (direction * 5).to(dtype)
    _check(cache, meta, q, scale=0.2)


@needs_attention
@needs_objdump
def test_the_built_decode_kernel_keeps_its_page_prefetches():
    """The page prefetches of the AVX-512 path are in the built library: the first pages of the batch
    into L1 (T0), the next page's rows into L2 (T1) as each page is computed. GCC 12 once dropped the
    calls to default-target prefetch helpers from AVX-512 code without a word, leaving 0-2 prefetch
    instructions, and every prefetch measured on this kernel then measured nothing. A K and a V row
    each: at least two of each hint."""
    name = library("paged_attention")._name
    assert count_instruction(name, "prefetcht0") >= 2
    assert count_instruction(name, "prefetcht1") >= 2


@needs_attention
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_is_independent_of_the_rest_of_the_batch(dtype, decode_path):
    """A sequence's output is bit-identical alone and inside a batch (batch invariance)."""
    cache, meta, q = _case(12, 4, 64, 16, [1, 1, 1, 1], [300, 17, 64, 1], dtype)
    full = paged_attention_cpu(q, cache, 1, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.2)
    for i in range(4):
        qsl = torch.tensor([0, 1], dtype=torch.int32)
        one = paged_attention_cpu(q[i:i + 1], cache, 1, qsl, meta.seq_lens[i:i + 1].contiguous(),
                                  meta.block_tables[i:i + 1].contiguous(), 0.2)
        assert torch.equal(one, full[i:i + 1])


@needs_attention
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_two_avx512_walks_give_the_same_bits(dtype):
    """Page-major and head-major walks of the AVX-512 path run each pair through the same instructions in the
    same order (only the state's trips to memory and the prefetches differ): bit-identical, for decode rows and
    for query blocks whose kv heads have several groups."""
    force = library("paged_attention").pd_attention_force
    if force(3) != 0:
        pytest.skip("no AVX-512 here")
    try:
        for query_lens, seq_lens in (([1, 1, 1, 1], [300, 17, 64, 1]), ([5, 3], [200, 40])):
            cache, meta, q = _case(12, 4, 64, 16, query_lens, seq_lens, dtype)
            outs = []
            for path in (3, 4):
                assert force(path) == 0
                outs.append(paged_attention_cpu(q, cache, 1, meta.query_start_loc, meta.seq_lens,
                                                meta.block_tables, 0.2))
            assert torch.equal(outs[0], outs[1])
            _check(cache, meta, q)
    finally:
        assert force(0) == 0


def _context_kv(cache, meta, layer=1):
    """A fresh prefill's K and V ``[L, Hkv, D]`` float32, read back from layer ``layer`` of the cache through
    the block table: what the torch path's causal branch takes (it builds no gather indices)."""
    L, size = int(meta.seq_lens[0]), cache.shape[3]
    blocks = meta.block_tables[0].long()[torch.arange(L) // size]
    kv = cache[blocks, layer, :, torch.arange(L) % size].nan_to_num(0.0).float()          # [L, 2, Hkv, D]
    return kv[:, 0], kv[:, 1]


def _check_prefill(cache, meta, q, scale=0.2):
    k, v = _context_kv(cache, meta) if meta.fresh_prefill else (None, None)
    ref = paged_attention_torch(q.float(), k, v, cache.nan_to_num(0.0).float(), 1, meta, scale)
    out = prefill_attention_cpu(q, cache, 1, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and not out.isnan().any()
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=ref.abs().max().item() * 2 ** -7)
    return out


@needs_prefill
@pytest.mark.parametrize("group", [1, 3, 4, 8, 16])          # 16 heads per KV head: wider than a 12-row tile
@pytest.mark.parametrize("head_dim", [16, 48, 64, 96, 128, 256])      # AMX: 96-256 walk the keys again per 64 dims
def test_prefill_kernel_matches_torch_for_every_group_and_head_size(group, head_dim, prefill_build):
    # whole prompts around the 16- and 32-key tile edges, a later chunk, and three sequences in one step
    for query_lens, seq_lens in ([1], [1]), ([15], [15]), ([17], [17]), ([31], [31]), ([33], [33]), ([40], [130]), \
            ([5, 64, 17], [5, 100, 90]):
        _check_prefill(*_case(2 * group, 2, head_dim, 16, query_lens, seq_lens, torch.bfloat16, seed=group))


@needs_prefill
@pytest.mark.parametrize("block_size", [1, 7, 32, 40])
def test_prefill_kernel_on_pages_of_any_size(block_size, prefill_build):
    _check_prefill(*_case(12, 4, 64, block_size, [70, 9], [150, 9], torch.bfloat16))


@needs_prefill
def test_prefill_kernel_rows_do_not_depend_on_the_batch_and_large_scores_stay_finite(prefill_build):
    cache, meta, q = _case(12, 4, 64, 16, [20, 50, 3], [60, 50, 40], torch.bfloat16, seed=3)
    together = prefill_attention_cpu(q, cache, 1, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.2)
    alone_meta = build_attention_metadata([50], [50], [meta.block_tables[1].tolist()], 16)
    alone = prefill_attention_cpu(q[20:70].contiguous(), cache, 1, alone_meta.query_start_loc, alone_meta.seq_lens,
                                  alone_meta.block_tables, 0.2)
    assert torch.equal(alone, together[20:70])
    _check_prefill(cache, meta, q, scale=40.0)                  # scores in the thousands: max-subtracted softmax


@needs_prefill
def test_prefill_kernel_flushes_subnormals_only_inside_its_call(prefill_build):
    """Each call runs with MXCSR's flush-to-zero and denormals-are-zero set (its exponentials' tiny results
    are 0, not subnormals) and gives the caller's mode back: on this thread a float32 product below 2^-126
    is still a subnormal after the call."""
    tiny = torch.tensor([1e-38])
    assert (tiny * 0.01).item() != 0.0                          # nothing flushes in this process
    _check_prefill(*_case(12, 4, 64, 16, [40], [130], torch.bfloat16, seed=5), scale=40.0)
    assert (tiny * 0.01).item() != 0.0


@needs_prefill
@pytest.mark.parametrize("rise", [0.01, 0.04, 0.2])
def test_prefill_kernel_scores_rising_across_key_tiles_match_torch(rise, prefill_build):
    """Scores that climb along the keys (5 x rise per key: 1.6, 6.4 or 32 per 32-key tile): a row's
    reference max then stays for several tiles while P grows towards e^8, or moves at every tile;
    either way O / l is torch's."""
    cache, meta, q = _case(6, 2, 64, 16, [200, 37], [200, 37], torch.bfloat16, seed=7)
    direction = torch.randn(64)
    direction /= direction.norm()
    for i, length in enumerate((200, 37)):
        for t in range(length):
            block, off = int(meta.block_tables[i, t // 16]), t % 16
            cache[block, 1, 0, off] = (direction * rise * t * 5).to(torch.bfloat16)      # K rows along one direction
    q[:] = (direction * 5).to(torch.bfloat16)                                          # every query along it too
    _check_prefill(cache, meta, q, scale=0.2)


@needs_prefill
def test_prefill_kernel_refuses_what_it_cannot_take_and_the_dispatcher_routes_bf16_prefill_to_it(prefill_build):
    cache, meta, q = _case(6, 2, 64, 16, [30], [30], torch.bfloat16)
    args = (cache, 1, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.2)
    with pytest.raises(ValueError, match="bf16"):
        prefill_attention_cpu(q.float(), *args)
    with pytest.raises(ValueError, match="int32"):
        prefill_attention_cpu(q, cache, 1, meta.query_start_loc.long(), meta.seq_lens, meta.block_tables, 0.2)
    assert not prefill_attention_available(24) and not prefill_attention_available(512)
    routed = paged_attention(q, None, None, cache, 1, meta, 0.2)  # not decode-sized: no cpu_kernels flag
    assert torch.equal(routed, prefill_attention_cpu(q, *args))


@needs_prefill
def test_bf16_prefill_attention_runs_on_amx_tiles_where_granted_or_where_told(env_choice):
    """AMX tiles where AMX is granted, the C build of the GEMM's choice elsewhere; the override wins (torch:
    the torch path), ``amx`` where AMX is not granted is ignored, and a bad value is refused."""
    cache, meta, q = _case(6, 2, 64, 16, [12], [40], torch.bfloat16)        # a chunk after 28 cached tokens
    cache = cache.nan_to_num(0.0)
    args = (cache, 1, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.2)
    amx = gemm_amx_available() and available("prefill_attention_amx")
    env_choice(PREFILL_ENV, None, prefill_attention_path)
    assert prefill_attention_path() == ("amx" if amx else "c")
    env_choice(PREFILL_ENV, "AMX", prefill_attention_path)
    assert prefill_attention_path() == ("amx" if amx else "c")
    env_choice(PREFILL_ENV, "torch", prefill_attention_path)
    assert not prefill_attention_available(64)
    assert torch.equal(paged_attention(q, None, None, cache, 1, meta, 0.2),
                       paged_attention_torch(q, None, None, cache, 1, meta, 0.2))
    env_choice(PREFILL_ENV, "c", prefill_attention_path)
    assert prefill_library() != "prefill_attention_amx"
    assert torch.equal(paged_attention(q, None, None, cache, 1, meta, 0.2), prefill_attention_cpu(q, *args))
    env_choice(PREFILL_ENV, "tiles", prefill_attention_path)
    with pytest.raises(ValueError, match="'amx', 'c' or 'torch'"):
        prefill_attention_path()
