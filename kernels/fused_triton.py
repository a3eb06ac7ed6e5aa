"""The decoder's elementwise steps on CUDA in one Triton kernel each: RMSNorm, SiLU-and-mul, and RoPE
with the KV-cache write.

A decode step of a small model on a GPU is bound by kernel count, not bytes: torch runs RMSNorm as
six kernels (cast, square, mean, rsqrt, two multiplies), RoPE as eight per tensor, the KV write as
two index-puts, SiLU-and-mul as three; each is a few microseconds even inside a CUDA graph (H100,
1.2B Llama, batch 1: ~0.8 of a 2.2 ms step). These kernels do the same arithmetic in one launch
each, as vLLM's ``rms_norm`` / ``silu_and_mul`` / ``rotary_embedding`` custom ops do, and round
where the torch code rounds, so a bf16 result equals torch's bit for bit (the float32 sums of
RMSNorm's mean aside, which add in another order):

* RMSNorm (Zhang & Sennrich, 2019): ``w * (x * rsqrt(mean(x^2) + eps)).to(dtype)`` with the
  statistics in float32, as :class:`model.llama.RMSNorm`;
* SiLU-and-mul (Shazeer, 2020): ``silu(gate).to(dtype) * up``;
* RoPE (Su et al., 2021), rotate-half form as :func:`model.rope.apply_rotary`: each product with
  ``cos`` / ``sin`` (rounded to the dtype first) rounded, then the sum, then K and V stored at
  their slots of ``kv_cache[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``.

Run on CPU with ``TRITON_INTERPRET=1`` (tests): the interpreter truncates float32 -> bf16 casts, so
there every rounding goes through ``_round_bf16`` (``ROUND``), as :mod:`kernels.w4a16_triton` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.w4a16_triton import _round_bf16


@triton.jit
def _rounded(x, ROUND: tl.constexpr, dtype: tl.constexpr):
    """``x`` (float32) rounded to ``dtype`` to nearest even, returned as float32."""
    if ROUND:
        return _round_bf16(x)
    return x.to(dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n, stride_x, stride_o, eps,
                     BLOCK: tl.constexpr, ROUND: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    dtype = out_ptr.dtype.element_ty
    y = _rounded(x * r, ROUND, dtype) * tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, _rounded(y, ROUND, dtype).to(dtype), mask=ok)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n, stride_x, stride_o, BLOCK: tl.constexpr, ROUND: tl.constexpr):
    row, col0 = tl.program_id(0), tl.program_id(1) * BLOCK
    cols = col0 + tl.arange(0, BLOCK)
    ok = cols < n
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=ok, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = _rounded(gate / (1.0 + tl.exp(-gate)), ROUND, dtype)
    tl.store(out_ptr + row * stride_o + cols, _rounded(silu * up, ROUND, dtype).to(dtype), mask=ok)


@triton.jit
def _rope_write_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, cache_ptr, slots_ptr,
                          num_heads, half, block_size,
                          stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct,
                          stride_ot, stride_oh, stride_kot, stride_koh,
                          stride_cblk, stride_ckv, stride_ctok, stride_chead,
                          HALF_P: tl.constexpr, ROUND: tl.constexpr):
    """Program (t, h): query head h of token t (h < num_heads), else KV head h - num_heads (rotated K
    and V to the cache at the token's slot, rotated K also to ``k_out``)."""
    tok, head = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, HALF_P)
    ok = d < half
    dtype = q_out_ptr.dtype.element_ty
    c1 = _rounded(tl.load(cos_ptr + tok * stride_ct + d, mask=ok, other=0.0), ROUND, dtype)
    c2 = _rounded(tl.load(cos_ptr + tok * stride_ct + half + d, mask=ok, other=0.0), ROUND, dtype)
    s1 = _rounded(tl.load(sin_ptr + tok * stride_ct + d, mask=ok, other=0.0), ROUND, dtype)
    s2 = _rounded(tl.load(sin_ptr + tok * stride_ct + half + d, mask=ok, other=0.0), ROUND, dtype)
    if head < num_heads:
        src = q_ptr + tok * stride_qt + head * stride_qh
    else:
        src = k_ptr + tok * stride_kt + (head - num_heads) * stride_kh
    x1 = tl.load(src + d, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + half + d, mask=ok, other=0.0).to(tl.float32)
    y1 = _rounded(_rounded(x1 * c1, ROUND, dtype) + _rounded(-x2 * s1, ROUND, dtype), ROUND, dtype)
    y2 = _rounded(_rounded(x2 * c2, ROUND, dtype) + _rounded(x1 * s2, ROUND, dtype), ROUND, dtype)
    if head < num_heads:
        dst = q_out_ptr + tok * stride_ot + head * stride_oh
        tl.store(dst + d, y1.to(dtype), mask=ok)
        tl.store(dst + half + d, y2.to(dtype), mask=ok)
    else:
        kv_head = head - num_heads
        dst = k_out_ptr + tok * stride_kot + kv_head * stride_koh
        tl.store(dst + d, y1.to(dtype), mask=ok)
        tl.store(dst + half + d, y2.to(dtype), mask=ok)
        slot = tl.load(slots_ptr + tok)
        page = cache_ptr + (slot // block_size) * stride_cblk + (slot % block_size) * stride_ctok \
            + kv_head * stride_chead
        cache_dtype = cache_ptr.dtype.element_ty
        tl.store(page + d, y1.to(cache_dtype), mask=ok)
        tl.store(page + half + d, y2.to(cache_dtype), mask=ok)
        v_src = v_ptr + tok * stride_vt + kv_head * stride_vh
        tl.store(page + stride_ckv + d, tl.load(v_src + d, mask=ok, other=0.0).to(cache_dtype), mask=ok)
        tl.store(page + stride_ckv + half + d, tl.load(v_src + half + d, mask=ok, other=0.0).to(cache_dtype),
                 mask=ok)


def _round(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.bfloat16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of ``x`` (``[..., n]`` float32/bf16/fp16, last dim contiguous) by ``weight``
    (``[n]``, the same dtype); same shape and dtype as ``x``.

    Raises:
        ValueError: ``weight`` does not match the last dimension or dtype.
    """
    n = x.shape[-1]
    if weight.shape != (n,) or weight.dtype != x.dtype:
        raise ValueError(f"rms_norm: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, n, x2.stride(0), out.stride(0), float(eps),
                                         BLOCK=triton.next_power_of_2(n), ROUND=_round(x))
    return out.view(x.shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``[m, 2 * n]`` (gate, then up; last dim contiguous) -> ``[m, n]`` ``silu(gate) * up`` in ``x.dtype``."""
    m, n = x.shape[0], x.shape[-1] // 2
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        block = min(triton.next_power_of_2(n), 1024)
        _silu_and_mul_kernel[(m, triton.cdiv(n, block))](x, out, n, x.stride(0), out.stride(0), BLOCK=block,
                                                         ROUND=_round(x))
    return out


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  kv_cache: torch.Tensor, layer: int, slot_mapping: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` ``[n, H, D]`` and ``k`` ``[n, H_kv, D]`` (any token and head strides, features
    contiguous) by ``cos`` / ``sin`` (``[n, 1, D]`` float32), store rotated K and ``v`` at
    ``slot_mapping`` (``[n]`` int64) of ``layer`` in ``kv_cache``; return the rotated ``(q, k)``
    (new contiguous tensors in ``q.dtype``).

    Raises:
        ValueError: shapes that disagree, or an odd head size.
    """
    n, heads, dim = q.shape
    kv_heads = k.shape[1]
    if (k.shape != (n, kv_heads, dim) or v.shape != k.shape or dim % 2 or cos.shape[0] != n
            or cos.shape[-1] != dim or kv_cache.shape[4:] != (kv_heads, dim) or slot_mapping.shape != (n,)):
        raise ValueError(f"rope_write_kv: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"cos {tuple(cos.shape)}, kv_cache {tuple(kv_cache.shape)}, slots {tuple(slot_mapping.shape)}")
    q_out = torch.empty(n, heads, dim, dtype=q.dtype, device=q.device)
    k_out = torch.empty(n, kv_heads, dim, dtype=q.dtype, device=q.device)
    if n:
        cos, sin = cos.reshape(n, dim).contiguous(), sin.reshape(n, dim).contiguous()
        page = kv_cache[:, layer]                                          # [blocks, 2, bs, H_kv, D]
        _rope_write_kv_kernel[(n, heads + kv_heads)](
            q, k, v, cos, sin, q_out, k_out, page, slot_mapping, heads, dim // 2, kv_cache.shape[3],
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            page.stride(0), page.stride(1), page.stride(2), page.stride(3),
            HALF_P=triton.next_power_of_2(dim // 2), ROUND=_round(q))
    return q_out, k_out
