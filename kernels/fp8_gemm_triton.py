"""FP8 (e4m3) W8A8 GEMM in Triton with per-token/per-channel or per-group (block) scales.

Computes, for ``A`` ``[M, K]`` and ``B`` ``[K, N]`` holding e4m3 values
(``torch.float8_e4m3fn``: 1 sign, 4 exponent bits with bias 7, 3 mantissa bits,
no infinities, max 448; Micikevicius et al., "FP8 Formats for Deep Learning", 2022)::

    group_size=None:  C[m, n] = (sum_k A[m, k] * B[k, n]) * a_scale[m] * b_scale[n]  (+ bias[n])
    group_size=G:     C[m, n] = sum_g (sum_{k in g} A[m, k] * B[k, n]) * a_scale[m, g] * b_scale[g, n // G]  (+ bias[n])

with fp32 accumulators, written as ``C``'s dtype (bf16, fp16 or fp32); ``g`` runs over the
``ceil(K/G)`` K-groups ``[gG, (g+1)G)``. The first is the W8A8 scheme of vLLM's ``fp8``
quantization (per-token dynamic activation scales, per-output-channel weight scales; the
scales go in the epilogue). The second is DeepSeek-V3's fine-grained scaling (DeepSeek-AI,
"DeepSeek-V3 Technical Report", 2024, §3.3, "Fine-Grained Quantization"): ``A`` scaled per
token per ``1 x G`` tile, ``B`` per ``G x G`` block; the K tile divides G, so each K step's ``tl.dot`` partial product
belongs to one group and is scaled before it is added to the fp32 accumulator (as vLLM's
``w8a8_block_fp8_matmul`` does). ``G`` must be a multiple of 16 (``tl.dot``'s minimum K).

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
                       out_dtype: torch.dtype = torch.bfloat16, bias: torch.Tensor | None = None,
                       group_size: int | None = None) -> torch.Tensor:
    """The math of :func:`fp8_gemm_triton` in plain torch (fp32 accumulation).

    Args:
        a: ``[M, K]`` ``float8_e4m3fn`` (or its ``uint8`` bytes).
        a_scale: fp32 dequantization scales of ``a``: ``[M]`` per row (per token), or with
            ``group_size`` ``[M, ceil(K/G)]`` per row per ``1 x G`` tile.
        b: ``[K, N]`` ``float8_e4m3fn`` (or ``uint8`` bytes), any strides.
        b_scale: fp32 scales of ``b``: ``[N]`` per column (per output channel), or with
            ``group_size`` ``[ceil(K/G), ceil(N/G)]`` per ``G x G`` block.
        out_dtype: dtype of the result.
        bias: optional ``[N]``, added after scaling.
        group_size: None, or G: one fp32 matmul per K-group, scaled, then summed.
    Returns:
        ``[M, N]`` ``out_dtype``. Every e4m3 value and every product of two is exact in fp32,
        so only the order of the fp32 sums differs from the kernel.
    """
    a, b = _as_e4m3(a), _as_e4m3(b)
    if group_size is None:
        out = (a.float() @ b.float()) * a_scale.float()[:, None] * b_scale.float()[None, :]
    else:
        g, n = group_size, b.shape[1]
        sb = b_scale.float().repeat_interleave(g, dim=1)[:, :n]                  # [Kg, N]
        out = sum((a[:, k0:k0 + g].float() @ b[k0:k0 + g].float()) * a_scale.float()[:, j, None] * sb[j]
                  for j, k0 in enumerate(range(0, a.shape[1], g)))
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
                         stride_sam, stride_sak, stride_sbk, stride_sbn,
                         HAS_BIAS: tl.constexpr, GROUP: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """One ``BLOCK_M x BLOCK_N`` tile of C; masks handle M, N, K that are not tile multiples.

        ``GROUP == 0``: per-row/per-column scales in the epilogue (scale strides unused).
        ``GROUP > 0`` (a multiple of ``BLOCK_K``): K step ``k0`` lies in group ``k0 // GROUP``;
        its partial product is scaled by ``a_scale[m, g]`` and ``b_scale[g, n // GROUP]``.
        """
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
            if GROUP > 0:
                g = k0 // GROUP
                sa = tl.load(a_scale_ptr + rm * stride_sam + g * stride_sak, mask=m_ok, other=0.0)
                sb = tl.load(b_scale_ptr + g * stride_sbk + (rn // GROUP) * stride_sbn, mask=n_ok, other=0.0)
                part = tl.dot(_e4m3_to_f16_scaled(a), _e4m3_to_f16_scaled(b), out_dtype=tl.float32)
                acc += part * sa[:, None] * sb[None, :]
            else:
                acc = tl.dot(_e4m3_to_f16_scaled(a), _e4m3_to_f16_scaled(b), acc, out_dtype=tl.float32)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        # epilogue: acc = sum(a*b) * 2**-16  ->  C = acc * 2**16 (* a_scale[m] * b_scale[n]) (+ bias[n])
        if GROUP > 0:
            out = acc * 65536.0
        else:
            sa = tl.load(a_scale_ptr + rm, mask=m_ok, other=0.0)
            sb = tl.load(b_scale_ptr + rn, mask=n_ok, other=0.0)
            out = acc * 65536.0 * sa[:, None] * sb[None, :]
        if HAS_BIAS:
            out += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
        tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _default_blocks(m: int, group_size: int | None = None) -> tuple[int, int, int]:
    """Tile sizes: narrow M tiles for decode-sized batches, 64x64x64 for prefill; with groups the
    K tile is the largest of 64, 32, 16 that divides G."""
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    bk = 64 if group_size is None else next(t for t in (64, 32, 16) if group_size % t == 0)
    return bm, 64, bk


def fp8_gemm_triton(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                    out_dtype: torch.dtype = torch.bfloat16, bias: torch.Tensor | None = None,
                    group_size: int | None = None, block_m: int | None = None, block_n: int | None = None,
                    block_k: int | None = None) -> torch.Tensor:
    """``C = (A @ B) * a_scale[:, None] * b_scale[None, :] (+ bias)`` with e4m3 operands, or its
    per-K-group form (module docstring) when ``group_size`` is given.

    Args:
        a: ``[M, K]`` ``float8_e4m3fn`` (or ``uint8`` bytes of one), any strides.
        a_scale: fp32 ``[M]`` per-token scales (``amax_row / 448``), or with ``group_size``
            ``[M, ceil(K/G)]`` per-token per-``1 x G``-tile scales; any strides.
        b: ``[K, N]`` ``float8_e4m3fn`` (or bytes), any strides; pass ``weight.t()`` of an
            ``[N, K]`` weight without copying.
        b_scale: fp32 ``[N]`` per-output-channel scales, or with ``group_size``
            ``[ceil(K/G), ceil(N/G)]`` per ``G x G`` block of ``b`` (``weight_scale.t()`` of an
            ``[ceil(N/G), ceil(K/G)]`` weight scale, no copy needed); any strides.
        out_dtype: ``torch.bfloat16``, ``torch.float16`` or ``torch.float32``.
        bias: optional ``[N]`` of any float dtype.
        group_size: None, or G, a positive multiple of 16.
        block_m, block_n, block_k: tile sizes (powers of two, >= 16; ``block_k`` must divide G);
            defaults by ``M`` (and G).
    Returns:
        ``[M, N]`` ``out_dtype`` on ``a``'s device.
    Raises:
        RuntimeError: Triton is not installed.
        ValueError: shapes disagree, or a bad ``group_size`` / ``block_k``.
    """
    if triton is None:
        raise RuntimeError("fp8_gemm_triton needs Triton")
    a, b = _as_bytes(a), _as_bytes(b)
    (m, k), (k2, n) = a.shape, b.shape
    g = group_size
    if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g <= 0 or g % 16):
        raise ValueError(f"fp8_gemm: group_size must be None or a positive multiple of 16, got {g!r}")
    sa_shape, sb_shape = ((m,), (n,)) if g is None else ((m, -(-k // g)), (-(-k // g), -(-n // g)))
    if (k != k2 or tuple(a_scale.shape) != sa_shape or tuple(b_scale.shape) != sb_shape
            or (bias is not None and bias.shape != (n,))):
        raise ValueError(f"fp8_gemm: A {tuple(a.shape)}, B {tuple(b.shape)}, a_scale {tuple(a_scale.shape)}, "
                         f"b_scale {tuple(b_scale.shape)}, bias {None if bias is None else tuple(bias.shape)}")
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    dm, dn, dk = _default_blocks(m, g)
    bm, bn, bk = block_m or dm, block_n or dn, block_k or dk
    if g is not None and g % bk:
        raise ValueError(f"fp8_gemm: block_k {bk} must divide group_size {g}")
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    a_scale, b_scale = a_scale.float(), b_scale.float()
    if g is None:
        a_scale, b_scale = a_scale.contiguous(), b_scale.contiguous()
        s_strides = (0, 0, 0, 0)
    else:
        s_strides = (a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1))
    _fp8_gemm_kernel[grid](a, b, c, a_scale, b_scale, bias if bias is not None else a_scale,
                           m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
                           *s_strides, HAS_BIAS=bias is not None, GROUP=g or 0,
                           BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    return c
