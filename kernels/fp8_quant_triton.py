"""Per-token FP8 (e4m3) activation quantization in one Triton kernel.

For ``x`` ``[M, K]`` (bf16, fp16 or fp32) it writes, per row ``m``::

    scale[m] = max(amax_k |x[m, k]|, 1e-12) / 448                      fp32
    q[m, k]  = e4m3(clamp(x[m, k] / scale[m], -448, 448))  for k < K  (round to nearest even)
    q[m, k]  = 0                                           for K <= k < K_pad

which is :func:`model.quant.fp8_format.quantize_e4m3` bit for bit (the division is IEEE round-to-nearest,
``tl.math.div_rn``, as torch's; NaN propagates through the max as through ``amax``), with the
columns zero-padded to the multiple of 16 that ``torch._scaled_mm`` requires. The torch version
is eight kernels over float32 copies (cast, abs, amax, clamp, two divisions, clamp, cast, then a
pad copy); this one reads ``x`` twice (once for the row's amax, once to quantize; a 2,048 x 8,192
bf16 row block is in L2 the second time) and writes one byte per element. It is the activation
half of vLLM's dynamic per-token FP8 scheme (its ``dynamic_per_token_scaled_fp8_quant`` CUDA op).

The codes are rounded with integer operations and stored as bytes, so the kernel needs no fp8
type: it runs on any CUDA GPU Triton supports and, for the tests, under the Triton interpreter
(``TRITON_INTERPRET=1``) on the CPU. The CUDA path of ``Fp8Linear`` uses it.
"""

from __future__ import annotations

import torch

from pdserve.kernels.fp8_gemm_triton import E4M3_MAX

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton is a dependency of the CUDA path only
    triton = tl = None

AMAX_FLOOR = 1e-12         # as model.quant.fp8: an all-zero row keeps a finite, normal scale

if triton is not None:
    _MAX = tl.constexpr(E4M3_MAX)          # a jit function reads module globals only as constexpr
    _FLOOR = tl.constexpr(AMAX_FLOOR)

    @triton.jit
    def _e4m3_bits(y):
        """fp32 ``y`` already in [-448, 448] (or NaN) -> its e4m3 code as int32 0..255, rounded to
        nearest even with integer operations only (the interpreter's own fp8 cast carries a mantissa
        overflow into the wrong exponent, and pre-Ada GPUs have none)."""
        bits = y.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        a = bits & 0x7FFFFFFF
        # normal e4m3 (|y| >= 2**-6): drop 20 of fp32's 23 mantissa bits, a carry bumps the exponent
        normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
        # subnormal e4m3 (|y| < 2**-6): code = round(|y| * 2**9) = round(m * 2**(e - 141))
        shift = tl.minimum(141 - (a >> 23), 31)
        m = (a & 0x7FFFFF) | 0x800000
        q = m >> shift
        rem = m & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        sub = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
        code = tl.where(a >= 0x3C800000, normal, sub)
        code = tl.where(a > 0x7F800000, 0x7F, code)        # NaN
        return sign | code

    @triton.jit
    def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, K, K_PAD, stride_x, stride_q, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        x_row = x_ptr + row * stride_x
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        nans = tl.zeros([BLOCK], dtype=tl.int32)
        for k0 in range(0, K, BLOCK):
            x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
            nans = nans | (x != x).to(tl.int32)
        a = tl.maximum(tl.max(amax, axis=0), _FLOOR)
        a = tl.where(tl.max(nans, axis=0) > 0, float("nan"), a)   # as torch's amax: NaN wins
        scale = tl.math.div_rn(a, _MAX)
        tl.store(s_ptr + row, scale)
        q_row = q_ptr + row * stride_q
        for k0 in range(0, K_PAD, BLOCK):
            x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            y = tl.math.div_rn(x, scale)
            y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -_MAX), _MAX))
            code = tl.where(k0 + offs < K, _e4m3_bits(y), 0)
            tl.store(q_row + k0 + offs, code.to(tl.uint8), mask=k0 + offs < K_PAD)


def quantize_e4m3_rows(x: torch.Tensor, pad_to: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token e4m3 quantization of ``x`` ``[M, K]`` in one kernel launch.

    Args:
        x: ``[M, K]`` bf16, fp16 or fp32 with unit stride along K, on a CUDA device (no fp8 type is
            needed) or, under the Triton interpreter, on the CPU.
        pad_to: the returned codes have ``K_pad = ceil(K / pad_to) * pad_to`` columns, the extra ones
            0x00 (+0.0); ``torch._scaled_mm`` needs 16.
    Returns:
        ``(q, scale)``: ``q`` ``[M, K_pad]`` ``float8_e4m3fn`` contiguous, ``scale`` ``[M]`` fp32, equal
        bit for bit to :func:`model.quant.fp8_format.quantize_e4m3` of ``x`` (then zero-padded).
    Raises:
        ValueError: ``x`` not 2-D, of another dtype, with a non-unit K stride, or ``pad_to`` < 1.
    """
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or x.stride(1) != 1:
        raise ValueError(f"quantize_e4m3_rows: want a 2-D bf16/fp16/fp32 [M, K] with unit K stride, "
                         f"got {x.dtype} {tuple(x.shape)} strides {x.stride()}")
    if pad_to < 1:
        raise ValueError(f"quantize_e4m3_rows: pad_to must be >= 1, got {pad_to}")
    m, k = x.shape
    k_pad = -(-k // pad_to) * pad_to
    q = torch.empty(m, k_pad, dtype=torch.uint8, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        block = min(4096, triton.next_power_of_2(max(k_pad, 16)))
        _quant_rows_kernel[(m,)](x, q, scale, k, k_pad, x.stride(0), q.stride(0), BLOCK=block,
                                 num_warps=4 if block <= 1024 else 8)
    return q.view(torch.float8_e4m3fn), scale
