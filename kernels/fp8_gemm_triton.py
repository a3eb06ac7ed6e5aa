"""FP8 (e4m3) W8A8 GEMM in Triton with per-token / per-channel scales fused into the epilogue.

Computes, for ``A`` ``[M, K]`` and ``B`` ``[K, N]`` holding e4m3 values
(``torch.float8_e4m3fn``: 1 sign, 4 exponent bits with bias 7, 3 mantissa bits,
no infinities, max 448; Micikevicius et al., "FP8 Formats for Deep Learning", 2022)::

    C[m, n] = (sum_k A[m, k] * B[k, n]) * a_scale[m] * b_scale[n]  (+ bias[n])

with an fp32 accumulator, written as ``C``'s dtype (bf16, fp16 or fp32). This is the
W8A8 scheme of vLLM's ``fp8`` quantization with per-token dynamic activation scales
and per-output-channel weight scales.

Why the fp8 operands travel as ``uint8`` and are decoded in-kernel
-----------------------------------------------------------------
Triton's NVIDIA backend only accepts the ``fp8e4nv`` type (``float8_e4m3fn``) on
compute capability >= 8.9 (``backends/nvidia/compiler.py`` adds it to
``supported_fp8_dtypes`` only then; elsewhere lowering raises "type fp8e4nv not
supported in this architecture"). But >= 8.9 is exactly where ``torch._scaled_mm``
is used instead (:mod:`model.quant.fp8`); this kernel serves the *other* GPUs
(sm80 A100, sm86, ...). So the kernel takes the raw bytes (a zero-copy
``.view(torch.uint8)``) and turns each byte into fp16 with bit operations::

    fp16_bits = (b & 0x80) << 8 | (b & 0x7F) << 7      # sign | exponent+mantissa
    value(fp16_bits) = e4m3_value(b) * 2**-8            # bias 15 vs 7: off by 2**8

which is exact for every finite e4m3 code, subnormals included (e4m3 subnormal
``m * 2**-9`` lands on fp16 subnormal ``m * 2**-17``; fp16 has 10 mantissa bits >= 3).
The two ``2**-8`` factors are undone once, in the epilogue (``* 2**16``). The fp16
``tl.dot`` multiplies exactly and accumulates in fp32 (mma.sync HMMA on sm80).
The NaN codes ``0x7F``/``0xFF`` decode as +-480 instead of NaN; the saturating
quantizer never emits them for finite inputs.

The Triton interpreter (``TRITON_INTERPRET=1``, Triton 3.9) *does* handle
``float8_e4m3fn`` tensors (loads, ``.to(float32)``, ``tl.dot``; checked against
torch for all 256 codes: only ``0x7F`` differs, decoding as 480 instead of NaN), so the
uint8 route is not needed for the interpreter; it is used everywhere so that the
code tested on CPU is the code that runs on pre-Ada GPUs. A second interpreter quirk:
its fp32 -> bf16 cast truncates (GPUs round to nearest even), so bf16 outputs under the
interpreter can be one bf16 ulp off the reference.
"""

from __future__ import annotations

import torch

try:  # the reference below must work without Triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton is a dependency of the CUDA path only
    triton = tl = None

E4M3_MAX = 448.0  # largest finite float8_e4m3fn: 1.75 * 2**8


def fp8_gemm_reference(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                       out_dtype: torch.dtype = torch.bfloat16, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The math of :func:`fp8_gemm_triton` in plain torch (fp32 accumulation).

    Args:
        a: ``[M, K]`` ``float8_e4m3fn`` (or its ``uint8`` bytes).
        a_scale: ``[M]`` fp32, per-row (per-token) dequantization scale.
        b: ``[K, N]`` ``float8_e4m3fn`` (or ``uint8`` bytes), any strides.
        b_scale: ``[N]`` fp32, per-column (per-output-channel) dequantization scale.
        out_dtype: dtype of the result.
        bias: optional ``[N]``, added after scaling.
    Returns:
        ``[M, N]`` ``out_dtype``. Every e4m3 value and every product of two is exact in fp32,
        so only the order of the fp32 sums differs from the kernel.
    """
    a, b = _as_e4m3(a), _as_e4m3(b)
    acc = a.float() @ b.float()
    out = acc * a_scale.float()[:, None] * b_scale.float()[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def _as_e4m3(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.float8_e4m3fn) if t.dtype == torch.uint8 else t


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8)
    if t.dtype != torch.uint8:
        raise TypeError(f"expected float8_e4m3fn or its uint8 bytes, got {t.dtype}")
    return t


if triton is not None:

    @triton.jit
    def _e4m3_to_f16_scaled(x):
        """``uint8`` e4m3 bytes -> fp16 holding ``value * 2**-8`` exactly (see module docstring)."""
        x = x.to(tl.int32)
        bits = ((x & 0x80) << 8) | ((x & 0x7F) << 7)
        return bits.to(tl.int16).to(tl.float16, bitcast=True)

    @triton.jit
    def _fp8_gemm_kernel(a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, bias_ptr,
                         M, N, K,
                         stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                         HAS_BIAS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """One ``BLOCK_M x BLOCK_N`` tile of C; masks handle M, N, K that are not tile multiples."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok, n_ok = rm < M, rn < N
        a_ptrs = a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak
        b_ptrs = b_ptr + rk[:, None] * stride_bk + rn[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + rk) < K
            # masked bytes are 0x00 = +0.0 in e4m3, so padding adds nothing to the sum
            a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0)
            acc = tl.dot(_e4m3_to_f16_scaled(a), _e4m3_to_f16_scaled(b), acc, out_dtype=tl.float32)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        # epilogue: acc = sum(a*b) * 2**-16  ->  C = acc * 2**16 * a_scale[m] * b_scale[n] (+ bias[n])
        sa = tl.load(a_scale_ptr + rm, mask=m_ok, other=0.0)
        sb = tl.load(b_scale_ptr + rn, mask=n_ok, other=0.0)
        out = acc * 65536.0 * sa[:, None] * sb[None, :]
        if HAS_BIAS:
            out += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
        tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _default_blocks(m: int) -> tuple[int, int, int]:
    """Tile sizes: narrow M tiles for decode-sized batches, 64x64x64 for prefill."""
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    return bm, 64, 64


def fp8_gemm_triton(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                    out_dtype: torch.dtype = torch.bfloat16, bias: torch.Tensor | None = None,
                    block_m: int | None = None, block_n: int | None = None,
                    block_k: int | None = None) -> torch.Tensor:
    """``C = (A @ B) * a_scale[:, None] * b_scale[None, :] (+ bias)`` with e4m3 operands.

    Args:
        a: ``[M, K]`` ``float8_e4m3fn`` (or ``uint8`` bytes of one), any strides.
        a_scale: ``[M]`` fp32 per-token scales (``amax_row / 448``).
        b: ``[K, N]`` ``float8_e4m3fn`` (or bytes), any strides; pass ``weight.t()`` of an
            ``[N, K]`` weight without copying.
        b_scale: ``[N]`` fp32 per-output-channel scales.
        out_dtype: ``torch.bfloat16``, ``torch.float16`` or ``torch.float32``.
        bias: optional ``[N]`` of any float dtype.
        block_m, block_n, block_k: tile sizes (powers of two, >= 16); defaults by ``M``.
    Returns:
        ``[M, N]`` ``out_dtype`` on ``a``'s device.
    Raises:
        RuntimeError: Triton is not installed.
        ValueError: shapes disagree.
    """
    if triton is None:
        raise RuntimeError("fp8_gemm_triton needs Triton")
    a, b = _as_bytes(a), _as_bytes(b)
    (m, k), (k2, n) = a.shape, b.shape
    if k != k2 or a_scale.shape != (m,) or b_scale.shape != (n,) or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"fp8_gemm: A {tuple(a.shape)}, B {tuple(b.shape)}, a_scale {tuple(a_scale.shape)}, "
                         f"b_scale {tuple(b_scale.shape)}, bias {None if bias is None else tuple(bias.shape)}")
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    dm, dn, dk = _default_blocks(m)
    bm, bn, bk = block_m or dm, block_n or dn, block_k or dk
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    a_scale, b_scale = a_scale.float().contiguous(), b_scale.float().contiguous()
    _fp8_gemm_kernel[grid](a, b, c, a_scale, b_scale, bias if bias is not None else a_scale,
                           m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
                           HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    return c
