"""INT4-weight x int8-activation products for CPU decode (``gemv_int4.c`` on AVX512-VNNI, else
``gemv_int4_avx2.c`` on AVX2: the same symbols and bit-identical results).

Weights in the portable format of :mod:`model.quant.int4_format` (``W = (q - 8) s + z`` per
group of ``G`` columns) are repacked once by :func:`pack_int4_weight`::

    wq     uint8   [Np / 16, Kp / 8, 16, 4]   wq[nb, kb, j, b] = q[16 nb + j, 8 kb + b]
                                                                 | q[16 nb + j, 8 kb + 4 + b] << 4
    scales float32 [Np / 16, Kp / G, 16]      s of rows 16 nb .. 16 nb + 15
    zc     float32 [Np / 16, Kp / G, 16]      z - 8 s

(``Np`` = N rounded up to 16; padded rows have ``q = 0``, ``s = zc = 0``). Each call quantizes
the activations per row and per group of ``G`` columns to int8 (symmetric, ``sx = max|x| / 127``,
round half to even), then computes per group ``sx (s dot(q, xq) + zc sum(xq))`` with exact int32
dot products (``vpdpbusd``), the scheme of llama.cpp's ``ggml_vec_dot_q4_0_q8_0`` adapted to an
asymmetric weight format and a 16-row layout. One 64-byte load feeds 16 output rows x 8 columns,
and the weight is streamed once per call at any row count (rows inside the weight-block loop).
From ``AMX_MIN_ROWS`` rows on a CPU with AMX-INT8 the same integer dot products run on tiles
(``gemm_int4_amx.h``: ``tdpbsud`` on nibbles unpacked in L1, then the same float steps), so the
result is bit-identical whichever path a row count takes.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from pdserve.kernels.cpu import KernelUnavailable, available, library

_i64, _int, _p = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
KERNEL, AMX_KERNEL = "int4-vnni", "int4-amx"      # the path names benchmarks record
AMX_MIN_ROWS = 8          # gemm_int4_amx.h's AMX_INT4_MIN_ROWS: from this many rows pd_int4_gemv runs on tiles


@functools.cache
def int4_library() -> str | None:
    """The INT4 kernel library this CPU runs: ``"gemv_int4"`` (AVX512-F/BW/VL/VNNI), else
    ``"gemv_int4_avx2"`` (AVX2 and FMA), else None (no compiler, or neither ISA). Cached, as
    :func:`kernels.cpu.available` is: every INT4 projection call of a decode step asks it."""
    return next((name for name in ("gemv_int4", "gemv_int4_avx2") if available(name)), None)


def int4_available() -> bool:
    """Whether :func:`gemv_int4` can run here (a C compiler and AVX512-VNNI or AVX2)."""
    return int4_library() is not None


@functools.cache
def int4_amx_available() -> bool:
    """Whether this CPU and process can run the AMX-INT8 path (AMX-INT8 present, tile data granted)."""
    return int4_library() == "gemv_int4" and bool(library("gemv_int4").pd_int4_amx_available())


def int4_path(rows: int) -> str:
    """The C path :func:`gemv_int4` takes for ``rows`` activation rows: ``"int4-amx"`` or ``"int4-vnni"``
    (the AVX2 library's bit-identical kernel is named ``"int4-vnni"`` too)."""
    return AMX_KERNEL if rows >= AMX_MIN_ROWS and int4_amx_available() else KERNEL


def pack_int4_weight(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Portable INT4 tensors -> ``(wq, scales, zc)`` in the layout of the module docstring.

    Args:
        qweight: uint8 ``[N, Kp // 2]`` (even column in the low nibble).
        scales, zeros: float ``[N, Kp // G]``.
        group_size: ``G``, a multiple of 16 dividing ``Kp``.
    Raises:
        ValueError: inconsistent shapes or dtypes.
    """
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or scales.shape != zeros.shape or scales.dim() != 2:
        raise ValueError("pack_int4_weight: qweight must be uint8 [N, Kp/2], scales and zeros [N, Kp/G]")
    n, kp = qweight.shape[0], qweight.shape[1] * 2
    if group_size % 16 or kp % group_size or scales.shape != (n, kp // group_size):
        raise ValueError(f"pack_int4_weight: qweight {tuple(qweight.shape)}, scales {tuple(scales.shape)} "
                         f"and group_size {group_size} disagree")
    pad = -n % 16
    q = torch.stack([qweight & 0xF, qweight >> 4], dim=-1).reshape(n, kp)         # [N, Kp] in 0..15
    q = F.pad(q, (0, 0, 0, pad)).view(n + pad, kp // 8, 2, 4)
    wq = (q[:, :, 0] | (q[:, :, 1] << 4)).view((n + pad) // 16, 16, kp // 8, 4).permute(0, 2, 1, 3).contiguous()

    def blocked(t: torch.Tensor) -> torch.Tensor:
        t = F.pad(t.float(), (0, 0, 0, pad))
        return t.view((n + pad) // 16, 16, -1).permute(0, 2, 1).contiguous()

    s = scales.float()
    return wq, blocked(s), blocked(zeros.float() - 8 * s)


def unpack_int4_weight(wq: torch.Tensor, out_features: int) -> torch.Tensor:
    """Inverse of :func:`pack_int4_weight` for the codes: ``wq`` uint8 ``[Np / 16, Kp / 8, 16, 4]`` ->
    the portable ``qweight`` uint8 ``[out_features, Kp // 2]`` (even column in the low nibble), on
    ``wq``'s device; the padded rows are left out. Exact: the layout is a permutation of the nibbles."""
    nb, kb = wq.shape[0], wq.shape[1]
    w = wq.permute(0, 2, 1, 3)                                                   # [Np/16, 16, Kp/8, 4]
    q = torch.stack([w & 0xF, w >> 4], dim=3).reshape(nb * 16, kb * 8)[:out_features]   # [N, Kp] in 0..15
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def quantize_activations(x: torch.Tensor, group_size: int, kp: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization, run by the C code: ``x`` ``[M, K]`` fp32 or bf16 ->
    ``(xq int8 [M, Kp], sx float32 [M, Kp // G], sxs float32 [M, Kp // G])`` with ``sxs = sx * sum(xq)``
    per group (columns past ``K`` are zero). For tests and for measuring its accuracy.

    Raises:
        ValueError: as :func:`gemv_int4`.
    """
    _check_x(x, kp)
    m, gs = x.shape[0], kp // group_size
    xq = torch.empty(m, kp, dtype=torch.int8)
    sx, sxs = torch.empty(m, gs), torch.empty(m, gs)
    _fn("pd_int4_quantize_rows")(x.data_ptr(), int(x.dtype == torch.bfloat16), m, x.shape[1], x.stride(0),
                                 group_size, kp, xq.data_ptr(), sx.data_ptr(), sxs.data_ptr())
    return xq, sx, sxs


def gemv_int4(x: torch.Tensor, wq: torch.Tensor, scales: torch.Tensor, zc: torch.Tensor, out_features: int,
              group_size: int, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ W.T`` for ``x`` ``[M, K]`` (fp32 or bf16, unit column stride, ``K <= Kp``) and a weight
    packed by :func:`pack_int4_weight` -> ``[M, out_features]`` in ``out_dtype`` (default ``x.dtype``;
    fp32 or bf16). Activations are quantized to int8 per group (module docstring).

    Raises:
        ValueError: wrong dtype, shape or memory layout of an argument.
    """
    out_dtype = _checked(x, wq, scales, zc, out_features, group_size, out_dtype)
    return run_unchecked(x, wq, scales, zc, out_features, group_size, out_dtype)


def _checked(x: torch.Tensor, wq: torch.Tensor, scales: torch.Tensor, zc: torch.Tensor, out_features: int,
             group_size: int, out_dtype: torch.dtype | None) -> torch.dtype:
    """:func:`gemv_int4`'s argument checks; returns the output dtype."""
    out_dtype = out_dtype or x.dtype
    kp = wq.shape[1] * 8
    if wq.dtype != torch.uint8 or wq.dim() != 4 or wq.shape[2:] != (16, 4) or not wq.is_contiguous():
        raise ValueError("gemv_int4: wq must come from pack_int4_weight")
    want = (wq.shape[0], kp // group_size if group_size and kp % group_size == 0 else -1, 16)
    for t in (scales, zc):
        if t.dtype != torch.float32 or tuple(t.shape) != want or not t.is_contiguous():
            raise ValueError(f"gemv_int4: scales and zc must be float32 {want} for group_size {group_size}")
    if group_size % 16 or not wq.shape[0] * 16 - 16 < out_features <= wq.shape[0] * 16:
        raise ValueError(f"gemv_int4: out_features={out_features}, group_size={group_size} do not fit "
                         f"a packed weight of {wq.shape[0] * 16} x {kp}")
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"gemv_int4: out_dtype must be float32 or bfloat16, got {out_dtype}")
    _check_x(x, kp)
    return out_dtype


def run_unchecked(x: torch.Tensor, wq: torch.Tensor, scales: torch.Tensor, zc: torch.Tensor, out_features: int,
                  group_size: int, out_dtype: torch.dtype, symbol: str = "pd_int4_gemv") -> torch.Tensor:
    """:func:`gemv_int4` without the checks, for a caller that packed the weight itself and passes
    a CPU fp32/bf16 ``x`` with unit column stride and at most ``Kp`` columns (``symbol``
    ``"pd_int4_gemm_amx"``: :func:`gemm_int4_amx`'s path, in the AVX512-VNNI library only)."""
    y = torch.empty(x.shape[0], out_features, dtype=out_dtype)
    rc = _fn(symbol)(x.data_ptr(), int(x.dtype == torch.bfloat16), x.shape[0], x.shape[1], x.stride(0),
                     wq.shape[1] * 8, group_size, wq.data_ptr(), scales.data_ptr(), zc.data_ptr(),
                     wq.shape[0] * 16, out_features, y.data_ptr(), int(out_dtype == torch.bfloat16), out_features)
    if rc == -2:
        raise KernelUnavailable("gemm_int4_amx: this CPU or process cannot use AMX-INT8 tiles")
    if rc:
        raise MemoryError("gemv_int4: out of memory for the quantized activations")
    return y


def gemm_int4_amx(x: torch.Tensor, wq: torch.Tensor, scales: torch.Tensor, zc: torch.Tensor, out_features: int,
                  group_size: int, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """As :func:`gemv_int4`, always on AMX-INT8 tiles, at any row count (:func:`gemv_int4` takes them from
    ``AMX_MIN_ROWS`` rows); bit-identical to the vector kernel. For tests and benchmarks.

    Raises:
        KernelUnavailable: no AMX-INT8 here (see :func:`int4_amx_available`).
        ValueError: as :func:`gemv_int4`.
    """
    if not int4_amx_available():          # also where the library is the AVX2 one, which has no such symbol
        raise KernelUnavailable("gemm_int4_amx: this CPU or process cannot use AMX-INT8 tiles")
    out_dtype = _checked(x, wq, scales, zc, out_features, group_size, out_dtype)
    return run_unchecked(x, wq, scales, zc, out_features, group_size, out_dtype, "pd_int4_gemm_amx")


def _check_x(x: torch.Tensor, kp: int) -> None:
    if x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2 or x.device.type != "cpu" \
            or (x.shape[1] > 1 and x.stride(1) != 1) or not 0 < x.shape[1] <= kp:
        raise ValueError(f"gemv_int4: x must be a 2-D fp32/bf16 CPU tensor with unit column stride and 1 to "
                         f"{kp} columns, got {x.dtype} {tuple(x.shape)} on {x.device}")


_SIGS = {
    "pd_int4_quantize_rows": [_p, _int, _i64, _i64, _i64, _i64, _i64, _p, _p, _p],
    "pd_int4_gemv": [_p, _int, _i64, _i64, _i64, _i64, _i64, _p, _p, _p, _i64, _i64, _p, _int, _i64],
}
_SIGS["pd_int4_gemm_amx"] = _SIGS["pd_int4_gemv"]


def _fn(name: str):
    fn = getattr(library(int4_library()), name)
    if fn.argtypes is None:
        fn.argtypes, fn.restype = _SIGS[name], None if name == "pd_int4_quantize_rows" else ctypes.c_int
    return fn
