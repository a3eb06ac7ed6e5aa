"""The float32-FMA bf16 GEMMs on the packed weights (kernels/cpu/gemm_bf16_fma.c on AVX-512,
gemm_bf16_avx2.c on AVX2; bit-identical to each other): the exact product rounded once, batch
invariance on every tile and pass edge, NaN kept, the same refusals as the other packed kernels;
and how a CPU's bf16 GEMM is chosen (the measured vdpbf16ps / FMA issue ratio or
``PDSERVE_BF16_GEMM``), used alike by the per-operation path and the decode stack."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pdserve.kernels.cpu import available
from pdserve.kernels.cpu.gemv import (
    DP_FMA_SLOW,
    GEMM_ENV,
    KERNELS,
    bf16_gemm_kernel,
    dp_fma_ratio,
    gemm_bf16_avx2,
    gemm_bf16_fma,
    gemv_available,
    pack_weight,
)
from pdserve.model.cpu_linear import PackedBF16Linear

needs_fma = pytest.mark.skipif(not available("gemm_bf16_fma"), reason="no AVX-512 or no C compiler")
needs_avx2 = pytest.mark.skipif(not available("gemm_bf16_avx2"), reason="no AVX2 or no C compiler")
FMA_GEMMS = [pytest.param(gemm_bf16_fma, marks=needs_fma, id="avx512"),
             pytest.param(gemm_bf16_avx2, marks=needs_avx2, id="avx2")]


@pytest.mark.parametrize("gemm", FMA_GEMMS)
@pytest.mark.parametrize("n,k,m", [(37, 770, 5), (100, 34, 33), (16, 2, 64), (49, 66, 7), (1280, 768, 1),
                                   (50, 40, 15), (33, 100, 6), (17, 1026, 9), (33, 100, 1), (17, 1026, 1),
                                   (48, 514, 32), (16, 130, 8)])
def test_fma_gemm_rounds_the_exact_product_once(gemm, n, k, m):
    """Small integers: every float32 partial sum is exact, so each output is the exact product rounded
    once to bf16, bit for bit, at every tail of the tiles (8 rows x 48 outputs on AVX-512, 4 x 16 on
    AVX2, and one row x 32 there) and k chunks (256 and 512 columns)."""
    torch.manual_seed(n * k + m)
    w, x = torch.randint(-8, 9, (n, k)).bfloat16(), torch.randint(-8, 9, (m, k)).bfloat16()
    assert torch.equal(gemm(x, pack_weight(w), n), (x.double() @ w.double().t()).bfloat16())


@needs_fma
@needs_avx2
@pytest.mark.parametrize("n,k,m", [(40, 2048, 300), (1000, 72, 65), (33, 1026, 3)])
def test_avx2_and_avx512_fma_gemms_are_bit_identical(n, k, m):
    """The same float32 chain per output in the same k order: an AVX-512 CPU and an AVX2 one serve the
    same bits (random inputs, so the roundings of the chain matter)."""
    torch.manual_seed(k)
    w, x = torch.randn(n, k).bfloat16(), torch.randn(m, k).bfloat16()
    assert torch.equal(gemm_bf16_avx2(x, pack_weight(w), n), gemm_bf16_fma(x, pack_weight(w), n))


@pytest.mark.parametrize("gemm", FMA_GEMMS)
@pytest.mark.parametrize("n,k,m", [(40, 2048, 300), (33, 770, 13), (1000, 72, 65)])
def test_fma_gemm_rows_do_not_depend_on_the_batch(gemm, n, k, m):
    """Each row alone, inside the batch, and from a strided x gives the same bits, across more than one
    pass of widened rows (300 rows of width 2048 take three); within bf16 rounding of the float32 product."""
    torch.manual_seed(m)
    w, x = torch.randn(n, k).bfloat16(), torch.randn(m, k).bfloat16()
    packed = pack_weight(w)
    y = gemm(x, packed, n)
    ref = x.float() @ w.float().t()
    assert ((y.float() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-4 * ref.abs().max()).all()
    for row in (0, m // 2, m - 1):
        assert torch.equal(gemm(x[row:row + 1], packed, n), y[row:row + 1])
    strided = torch.zeros(m, k + 6).bfloat16()
    strided[:, 3:3 + k] = x
    assert torch.equal(gemm(strided[:, 3:3 + k], packed, n), y)


@pytest.mark.parametrize("gemm", FMA_GEMMS)
def test_fma_gemm_keeps_nan_and_infinity_and_refuses_what_the_packed_kernels_refuse(gemm):
    w = torch.ones(20, 8).bfloat16()
    x = torch.ones(3, 8).bfloat16()
    x[1, 2], x[2, 0] = float("nan"), float("inf")
    y = gemm(x, pack_weight(w), 20)
    assert (y[0] == 8).all() and y[1].isnan().all() and (y[2] == float("inf")).all()
    assert gemm(x[:0], pack_weight(w), 20).shape == (0, 20)        # an empty batch is no error
    with pytest.raises(ValueError, match="row-major 2-D bf16"):
        gemm(torch.randn(3, 8), pack_weight(w), 20)
    with pytest.raises(ValueError, match="10 columns"):
        gemm(torch.randn(3, 10).bfloat16(), pack_weight(w), 20)


@pytest.mark.skipif(not gemv_available() or not available("gemm_bf16_fma"), reason="no AVX512-BF16")
def test_the_bf16_gemm_follows_the_measured_issue_ratio_or_the_override(env_choice):
    """The choice follows the measurement (a ratio of issue times is positive and below 20 on any core
    that runs both), the override wins either way, a bad override is refused, and what a packed linear
    names is what the choice says."""
    ratio = dp_fma_ratio()
    assert 0 < ratio < 20
    env_choice(GEMM_ENV, None, bf16_gemm_kernel)
    assert bf16_gemm_kernel() == (KERNELS[3] if ratio > DP_FMA_SLOW else KERNELS[1]) or \
        abs(ratio - DP_FMA_SLOW) < 0.5                          # a second measurement may fall either side
    lin = PackedBF16Linear(nn.Linear(64, 40).bfloat16(), keep_dense=False)
    for forced, kernel, one_row in (("fma", "gemm-fma", "gemm-fma"),
                                    ("DPBF16", "gemm-avx512bf16", "gemv-avx512bf16"),
                                    ("avx2", "gemm-avx2", "gemm-avx2")):
        env_choice(GEMM_ENV, forced, bf16_gemm_kernel)
        assert bf16_gemm_kernel() == kernel
        assert lin.kernel_for(32) == (KERNELS[2] if lin.amx else kernel)  # AMX tiles serve 32 rows where present
        assert lin.amx or lin.kernel_for(1) == one_row         # the gemv only beside its bit-identical gemm
    env_choice(GEMM_ENV, "amx", bf16_gemm_kernel)
    with pytest.raises(ValueError, match="'dpbf16' or 'avx2'"):
        bf16_gemm_kernel()
