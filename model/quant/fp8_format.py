"""FP8 (e4m3) quantization: the format, the scales and the (de)quantizers behind :mod:`model.quant.fp8`.

Format: ``float8_e4m3fn`` (Micikevicius et al., "FP8 Formats for Deep Learning", 2022):
max finite 448, no infinities, 3 mantissa bits. Two scaling granularities, chosen by
``group_size`` (``G``) in :meth:`model.quant.fp8.Fp8Linear.from_linear` / :func:`model.quant.fp8.convert_for_runtime`:

``group_size=None`` (default) -- vLLM's ``fp8`` W8A8 with per-token dynamic activation
scales and per-output-channel weight scales::

    weight  W [N, K]  ->  Wq = sat_e4m3(W / sw[:, None]),  sw[n] = amax_k |W[n, k]| / 448   (once, at load)
    input   x [M, K]  ->  xq = sat_e4m3(x / sx[:, None]),  sx[m] = amax_k |x[m, k]| / 448   (every call, per token)
    y[m, n] = (sum_k xq[m, k] * Wq[n, k]) * sx[m] * sw[n]  (+ b[n])       fp32 accumulator, output in x.dtype

``group_size=G`` -- fine-grained scaling of DeepSeek-V3 (DeepSeek-AI, "DeepSeek-V3
Technical Report", 2024, §3.3, "Fine-Grained Quantization"; G=128 there): activations per
token per ``1 x G`` tile along K, weights per ``G x G`` block, and the K-group partial
products are scaled and summed in fp32 (``g`` runs over the ``Kg = ceil(K/G)`` groups; K and
N need not be multiples of G: the last tile/block is zero-padded, which changes neither amax
nor the sums)::

    sx[m, g]     = amax |x[m, gG:(g+1)G]| / 448                      sx: [M, Kg] fp32
    sw[j, g]     = amax |W[jG:(j+1)G, gG:(g+1)G]| / 448               sw: [ceil(N/G), Kg] fp32
    y[m, n] = sum_g (sum_{k in g} xq[m, k] * Wq[n, k]) * sx[m, g] * sw[n // G, g]  (+ b[n])

``sat_e4m3`` clamps to [-448, 448] before the round-to-nearest-even cast (older torch casts
map out-of-range values to NaN). Scales are fp32; an all-zero row/tile/block (amax 0) uses
amax 1e-12 so its scale stays a normal fp32 number and its codes are 0, not NaN.
Non-finite inputs give non-finite rows. Activation scales never mix tokens, so batch
composition does not change a token's numerics (beyond fp32 summation order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

E4M3_MAX = 448.0           # largest finite float8_e4m3fn (1.75 * 2**8)
_AMAX_FLOOR = 1e-12        # amax of all-zero rows: keeps the scale finite and normal


def to_e4m3_saturating(x: torch.Tensor) -> torch.Tensor:
    """Already-scaled values -> ``float8_e4m3fn``, clamping to [-448, 448] first (+-inf -> +-448).

    The format has no inf; older torch casts (c10 ``Float8_e4m3fn`` before it learned to
    saturate) turned out-of-range values into the NaN code 0x7F, so the clamp makes saturation
    independent of the torch version and device. NaN stays NaN. Rounding: nearest, ties to even.
    """
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _div_448(amax: torch.Tensor) -> torch.Tensor:
    """``amax / 448`` rounded once (IEEE division) on every device: torch's CUDA kernels divide by a
    Python scalar as a multiplication by its reciprocal (1/448 is inexact), which on an H100 moved 1,173
    of 2,048 per-token scales by an ulp against the CPU's; a tensor divisor is divided exactly. The
    divisor is filled on the device (no host-to-device copy), so the division stays capturable in a
    CUDA graph."""
    return amax / torch.full_like(amax, E4M3_MAX)


def quantize_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric FP8 quantization along the last dim.

    Args:
        x: ``[..., K]`` any float dtype.
    Returns:
        ``(q, scale)``: ``q`` ``[..., K]`` ``float8_e4m3fn`` = ``sat(x / scale)`` rounded to
        nearest even; ``scale`` ``[...]`` fp32 = ``max(amax_row, 1e-12) / 448``, so that
        ``q.float() * scale[..., None]`` approximates ``x`` (relative error <= 2**-4 for
        values in the e4m3 normal range, i.e. >= 2**-6 * scale).
    """
    x = x.float()
    amax = x.abs().amax(dim=-1).clamp(min=_AMAX_FLOOR)
    scale = _div_448(amax)
    q = to_e4m3_saturating(x / scale.unsqueeze(-1))
    return q, scale


def dequantize_e4m3(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q`` ``[..., K]`` e4m3 and ``scale`` ``[...]`` fp32 -> ``[..., K]`` fp32 ``q * scale``."""
    return q.float() * scale.unsqueeze(-1)


def check_group_size(group_size: int) -> None:
    """Raises ValueError unless ``group_size`` is a positive multiple of 16."""
    # the Triton kernel's K tile must divide G, and tl.dot needs K tiles >= 16
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0 or group_size % 16:
        raise ValueError(f"group_size must be None or a positive multiple of 16, got {group_size!r}")


def quantize_e4m3_groups(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row, per-``1 x G`` tile FP8 quantization along the last dim (DeepSeek-V3 activations).

    Args:
        x: ``[..., K]`` any float dtype; K need not be a multiple of ``group_size`` (the last
            tile is shorter: it is zero-padded, which does not change its amax).
        group_size: G, a positive multiple of 16.
    Returns:
        ``(q, scale)``: ``q`` ``[..., K]`` ``float8_e4m3fn``; ``scale`` ``[..., ceil(K/G)]``
        fp32 = ``max(amax_tile, 1e-12) / 448``; ``q[..., k] * scale[..., k // G]`` approximates ``x``.
    """
    check_group_size(group_size)
    x = x.float()
    k = x.shape[-1]
    kg = -(-k // group_size)
    tiles = F.pad(x, (0, kg * group_size - k)).unflatten(-1, (kg, group_size))
    scale = _div_448(tiles.abs().amax(dim=-1).clamp(min=_AMAX_FLOOR))
    q = to_e4m3_saturating(tiles / scale.unsqueeze(-1)).flatten(-2)[..., :k]
    return q, scale


def dequantize_e4m3_groups(q: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """``q`` ``[..., K]`` e4m3, ``scale`` ``[..., ceil(K/G)]`` -> ``[..., K]`` fp32
    ``q[..., k] * scale[..., k // G]``."""
    return q.float() * scale.repeat_interleave(group_size, dim=-1)[..., :q.shape[-1]]


def quantize_e4m3_blocks(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-``G x G`` block FP8 quantization of a 2-D weight (DeepSeek-V3 weights).

    Args:
        w: ``[N, K]`` any float dtype; N and K need not be multiples of G (edge blocks are
            zero-padded, which does not change their amax).
        group_size: G, a positive multiple of 16.
    Returns:
        ``(q, scale)``: ``q`` ``[N, K]`` ``float8_e4m3fn``; ``scale`` ``[ceil(N/G), ceil(K/G)]``
        fp32 = ``max(amax_block, 1e-12) / 448``; ``q[n, k] * scale[n // G, k // G]`` approximates ``w``.
    """
    check_group_size(group_size)
    w = w.float()
    (n, k), g = w.shape, group_size
    ng, kg = -(-n // g), -(-k // g)
    blocks = F.pad(w, (0, kg * g - k, 0, ng * g - n)).view(ng, g, kg, g)
    scale = _div_448(blocks.abs().amax(dim=(1, 3)).clamp(min=_AMAX_FLOOR))
    q = to_e4m3_saturating(blocks / scale[:, None, :, None]).view(ng * g, kg * g)[:n, :k]
    return q.contiguous(), scale


def dequantize_e4m3_blocks(q: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """``q`` ``[N, K]`` e4m3, ``scale`` ``[ceil(N/G), ceil(K/G)]`` -> ``[N, K]`` fp32
    ``q[n, k] * scale[n // G, k // G]``."""
    n, k = q.shape
    s = scale.repeat_interleave(group_size, dim=0)[:n].repeat_interleave(group_size, dim=1)[:, :k]
    return q.float() * s
