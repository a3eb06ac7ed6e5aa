"""W4A16 GEMM in Triton: ``y = x @ dequant(W).T + bias`` with 4-bit weights unpacked in-kernel.

Weight format (shared with :mod:`model.quant.int4`, tinygemm zero-point convention)::

    qweight_t  uint8 [Kp // 2, N]    nibble of (k, n): byte qweight_t[k // 2, n] >> (4 * (k % 2)) & 0xF
    sz         fp32  [Kp // G, N, 2] sz[g, n] = (scale, zero)
    W[n, k] = (q[n, k] - 8) * scale[k // G, n] + zero[k // G, n]

``qweight_t`` is the transpose of the canonical ``[N, Kp // 2]`` buffer (so one k-row of a
tile is ``BLOCK_N`` contiguous bytes); ``Kp = ceil(K / G) * G`` is the weight's K padded to
whole groups. Activations are *not* padded: loads of ``x`` beyond ``K`` are masked to 0, so
the padded weight columns contribute nothing.

Algorithm: the usual fused dequantize-in-the-K-loop GEMM of W4A16 kernels (Frantar et al.,
"GPTQ", 2023 and its Triton kernels; Lin et al., "AWQ", 2024; the tinygemm layout used by
gpt-fast). Each K-tile lies inside one quantization group (``BLOCK_K`` divides ``G``), so the
tile's scales and zeros are one ``[BLOCK_N]`` load each. Dequantized weights are cast to the
activation dtype for ``tl.dot`` (fp32 for fp32 input, exact "ieee" precision), the accumulator
is fp32, the result is cast back to ``x.dtype``.

Run on CPU with ``TRITON_INTERPRET=1`` set before ``triton`` is first imported. The interpreter
(triton 3.9) multiplies the raw bits of bfloat16 ``tl.dot`` operands (triton-lang/triton#11584,
"not supported yet") and truncates fp32 -> bf16 casts, so for bf16 on a CPU device the kernel
(``UPCAST``) rounds the weights to bf16 (ties to even) with integer ops and feeds fp32 operands to
``tl.dot`` -- the same products (bf16 x bf16 is exact in fp32) and fp32 accumulation as the GPU
path -- and rounds the result the same way before the store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _round_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), still as fp32: ``(b + 0x7FFF + lsb) & ~0xFFFF``."""
    b = x.to(tl.uint32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _w4a16_kernel(
    x_ptr, qw_ptr, sz_ptr, bias_ptr, y_ptr,
    M, N, K, Kp, k_per_split,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_ys, stride_ym, stride_yn,
    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    ROUND_OUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Program (i, j, s): output tile (i, j) over K range ``[s * k_per_split, (s + 1) * k_per_split)``
    (whole groups), stored at ``y_ptr + s * stride_ys`` (split partials in float32, or with one split the
    result)."""
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = split * k_per_split
    for k0 in range(k_lo, tl.minimum(k_lo + k_per_split, Kp), BLOCK_K):
        k = k0 + offs_k
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :] * stride_xk,
                    mask=m_ok[:, None] & (k[None, :] < K), other=0.0)                    # [BM, BK]
        b = tl.load(qw_ptr + (k // 2)[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                    mask=n_ok[None, :], other=0)                                          # [BK, BN] uint8
        q = ((b >> ((k % 2) * 4).to(tl.uint8)[:, None]) & 0xF).to(tl.float32)           # even k: low nibble
        g = k0 // GROUP                                                                   # whole tile in group g
        s = tl.load(sz_ptr + g * stride_sg + offs_n * stride_sn, mask=n_ok, other=0.0)
        z = tl.load(sz_ptr + g * stride_sg + offs_n * stride_sn + 1, mask=n_ok, other=0.0)
        w = (q - 8.0) * s[None, :] + z[None, :]                                          # [BK, BN] fp32
        if UPCAST:  # interpreter, bf16: the same bf16 (RTNE) weights and exact fp32 products
            acc += tl.dot(a.to(tl.float32), _round_bf16(w), input_precision="ieee")
        elif IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w.to(a.dtype))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if ROUND_OUT:  # the interpreter's fp32 -> bf16 cast truncates; round to nearest even first
        acc = _round_bf16(acc)
    tl.store(y_ptr + split * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn,
             acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _w4a16_dequant_kernel(qw_ptr, sz_ptr, w_ptr, N, K, stride_qk, stride_qn, stride_sg, stride_sn,
                          GROUP: tl.constexpr, UPCAST: tl.constexpr, BLOCK_K: tl.constexpr,
                          BLOCK_N: tl.constexpr):
    """Program (i, j): ``w[k, n]`` for a ``BLOCK_K x BLOCK_N`` tile, in ``w_ptr``'s dtype (``[K, N]`` contiguous)."""
    k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (k[:, None] < K) & (n[None, :] < N)
    b = tl.load(qw_ptr + (k // 2)[:, None] * stride_qk + n[None, :] * stride_qn, mask=ok, other=0)
    q = ((b >> ((k % 2) * 4).to(tl.uint8)[:, None]) & 0xF).to(tl.float32)
    sz = sz_ptr + (k // GROUP)[:, None] * stride_sg + n[None, :] * stride_sn
    w = (q - 8.0) * tl.load(sz, mask=ok, other=0.0) + tl.load(sz + 1, mask=ok, other=0.0)
    if UPCAST:  # the interpreter's fp32 -> bf16 cast truncates; round to nearest even first
        w = _round_bf16(w)
    tl.store(w_ptr + k[:, None] * N + n[None, :], w.to(w_ptr.dtype.element_ty), mask=ok)


DEQUANT_MIN_ROWS = 128
"""Rows from which :func:`w4a16_matmul` dequantizes the weight to the activation dtype once and runs
the vendor GEMM (prefill-sized steps), rather than unpacking each weight tile ``ceil(M / BLOCK_M)``
times in the fused kernel (H100, 512 x 8192 x 2048 bf16: 0.15 ms fused, 0.037 ms for the GEMM alone)."""


def _num_splits(tiles: int, k_groups: int, device: torch.device) -> int:
    """K splits so that a launch of ``tiles`` output tiles has about four programs per multiprocessor
    (a fixed 8 programs under the interpreter, so that tests take the split path), in whole groups."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        target = 4 * torch.cuda.get_device_properties(index).multi_processor_count
    else:
        target = 8
    return max(1, min(-(-target // tiles), k_groups))


def w4a16_matmul(x: torch.Tensor, qweight_t: torch.Tensor, sz: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None = None, num_splits: int | None = None, block_n: int = 64,
                 num_warps: int | None = None) -> torch.Tensor:
    """``x`` ``[M, K]`` (fp32/bf16/fp16, any strides) -> ``[M, N]`` in ``x.dtype``.

    Args:
        qweight_t: ``[Kp // 2, N]`` uint8, packed as in the module docstring (any strides).
        sz: ``[Kp // group_size, N, 2]`` float32 (scale, tinygemm zero); last dim contiguous.
        group_size: quantization group along K; a multiple of 16 (32..256 in practice).
        bias: ``[N]`` or ``None``.
        num_splits: K splits, each its own program per output tile writing float32 partials that one
            sum adds in a fixed order (split-K, for decode-sized ``M`` whose few output tiles cannot
            fill a GPU); None: enough for about four programs per multiprocessor. From
            :data:`DEQUANT_MIN_ROWS` rows the weight is dequantized once instead and multiplied
            by the vendor GEMM.
        block_n, num_warps: output columns per program (a power of two >= 16) and its warps (None: 2 up
            to 16 rows, else 4; H100, one row of 2048 x 16384: 0.033 ms with 2 warps, 0.052 with 4, both
            with the weight in L2).
    Raises:
        ValueError: inconsistent shapes.
    """
    M, K = x.shape
    Kp, N = qweight_t.shape[0] * 2, qweight_t.shape[1]
    if K > Kp or Kp % group_size or group_size % 16 or tuple(sz.shape) != (Kp // group_size, N, 2):
        raise ValueError(f"w4a16_matmul: x {tuple(x.shape)}, qweight_t {tuple(qweight_t.shape)}, "
                         f"sz {tuple(sz.shape)}, group_size {group_size} are inconsistent")
    if sz.stride(2) != 1:
        sz = sz.contiguous()
    if M == 0 or N == 0:
        return torch.empty(M, N, dtype=x.dtype, device=x.device)
    upcast = x.device.type == "cpu" and x.dtype == torch.bfloat16
    if M >= DEQUANT_MIN_ROWS:
        w = torch.empty(K, N, dtype=x.dtype, device=x.device)
        _w4a16_dequant_kernel[(triton.cdiv(K, 64), triton.cdiv(N, 64))](
            qweight_t, sz, w, N, K, qweight_t.stride(0), qweight_t.stride(1), sz.stride(0), sz.stride(1),
            GROUP=group_size, UPCAST=upcast, BLOCK_K=64, BLOCK_N=64)
        return torch.addmm(bias.to(x.dtype), x, w) if bias is not None else x @ w
    block_m = 16 if M <= 16 else (32 if M <= 32 else 64)
    block_k = min(group_size, 64)
    tiles = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    splits = _num_splits(tiles[0] * tiles[1], Kp // group_size, x.device) if num_splits is None else num_splits
    groups_per_split = -(-(Kp // group_size) // splits)
    splits = -(-(Kp // group_size) // groups_per_split)                    # none empty
    y = torch.empty(M, N, dtype=x.dtype, device=x.device) if splits == 1 else \
        torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    _w4a16_kernel[(*tiles, splits)](
        x, qweight_t, sz, bias if bias is not None and splits == 1 else sz, y,
        M, N, K, Kp, groups_per_split * group_size,
        x.stride(0), x.stride(1), qweight_t.stride(0), qweight_t.stride(1), sz.stride(0), sz.stride(1),
        y.stride(0) if splits > 1 else 0, y.stride(-2), y.stride(-1),
        GROUP=group_size, HAS_BIAS=bias is not None and splits == 1, IEEE=x.dtype == torch.float32,
        UPCAST=upcast, ROUND_OUT=upcast and splits == 1,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps or (2 if M <= 16 else 4),
    )
    if splits == 1:
        return y
    y = y.sum(0)                                                            # fixed order: deterministic
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


def w4a16_matmul_reference(x: torch.Tensor, qweight_t: torch.Tensor, sz: torch.Tensor, group_size: int,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch: dequantize to fp32, round to ``x.dtype`` (as the kernel feeds ``tl.dot``),
    matmul in fp32, add bias, cast to ``x.dtype``. Same arguments and result as :func:`w4a16_matmul`."""
    Kp, K = qweight_t.shape[0] * 2, x.shape[1]
    q = torch.stack([qweight_t & 0xF, qweight_t >> 4], dim=1).reshape(Kp, -1).float()  # [Kp, N]
    s, z = (sz[..., i].float().repeat_interleave(group_size, dim=0) for i in (0, 1))   # [Kp, N]
    w = ((q - 8.0) * s + z)[:K].to(x.dtype).float()                                   # [K, N]
    y = x.float() @ w
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
