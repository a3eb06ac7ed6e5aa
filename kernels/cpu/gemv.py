"""bf16 linear layers for CPU decode over weights packed for ``vdpbf16ps`` (``gemv_bf16.c``).

Layout (``N`` output rows padded to 16, ``K`` input columns padded to 2)::

    W [N, K]  ->  Wp [Np / 16, Kp / 2, 16, 2],   Wp[nb, kk, j, e] = W[16 nb + j, 2 kk + e]

so one 64-byte load feeds 16 output rows with 2 input columns each and the weight is one
sequential stream. Products accumulate in float32 and round once to bf16. Four kernels
take it: :func:`gemv_bf16` (a few rows), :func:`gemm_bf16_avx512` (register-blocked, any row
count, bit-identical to the gemv), :func:`gemm_bf16_amx` (AMX tiles, its own summation order) and
:func:`gemm_bf16_fma` (``gemm_bf16_fma.c``: float32 FMAs on the widened weights, for CPUs whose
``vdpbf16ps`` issues slowly; :func:`bf16_gemm_kernel` picks it from a measurement), and
:func:`gemm_bf16_avx2` (``gemm_bf16_avx2.c``: the same on 8-lane AVX2 FMAs, for CPUs without AVX-512).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

import torch

from pdserve.kernels.cpu import KernelUnavailable, available, fused, library

log = logging.getLogger(__name__)

_i64, _p = ctypes.c_int64, ctypes.c_void_p


def gemv_available() -> bool:
    """Whether :func:`gemv_bf16` can run on this machine (compiler and AVX512-BF16)."""
    return available("gemv_bf16")


def packed_bf16_available() -> bool:
    """Whether some kernel takes the packed bf16 layout here: :func:`bf16_gemm_kernel`'s library
    (``gemv_bf16`` with AVX512-BF16, else ``gemm_bf16_fma``, which needs only AVX-512F/BW, else
    ``gemm_bf16_avx2``, which needs AVX2 and FMA)."""
    return available(SYMBOLS[bf16_gemm_kernel()][0])


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` weight (any float dtype) -> packed bf16 ``[Np // 16, Kp // 2, 16, 2]`` (zero padding)."""
    n, k = weight.shape
    np_, kp = -(-n // 16) * 16, k + k % 2
    padded = torch.zeros(np_, kp, dtype=torch.bfloat16)
    padded[:n, :k] = weight.detach().to(torch.bfloat16)
    return padded.view(np_ // 16, 16, kp // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack_weight(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """Inverse of :func:`pack_weight`: ``[out_features, in_features]`` bf16."""
    nb, k2 = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(nb * 16, k2 * 2)[:out_features, :in_features]


def gemv_bf16(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x @ W.T`` for bf16 ``x`` ``[M, K]`` and a packed ``W`` -> ``[M, out_features]`` bf16.

    ``K`` must equal the packed width (``Kp``; pad odd widths with a zero column).

    Raises:
        ValueError: wrong dtype, shape or memory layout of ``x``, or a ``packed`` not from :func:`pack_weight`.
    """
    _check(x, packed, out_features)
    return run_unchecked(x, packed, out_features, KERNELS[0])


def gemm_bf16_avx512(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """As :func:`gemv_bf16`, register-blocked for many rows (3 to a few hundred): each packed weight
    byte is read from memory once per call. Bit-identical to :func:`gemv_bf16` row for row (the
    same two float32 chains per output, rounded once), so a row's result does not depend on ``M``.

    Raises:
        ValueError: as :func:`gemv_bf16`.
        MemoryError: its float32 partial sums (``M`` x 384 bytes, for widths over 256) could not be allocated.
    """
    _check(x, packed, out_features)
    return run_unchecked(x, packed, out_features, KERNELS[1])


def gemm_bf16_fma(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """As :func:`gemm_bf16_avx512` on float32 FMAs (each packed pair widened by a shift and a mask):
    1.6x its rate on an Emerald Rapids core whose ``vdpbf16ps`` issues at a quarter of the FMA rate.
    One float32 chain per output in ``k`` order, rounded once: batch-invariant, but not bit-identical
    to the ``vdpbf16ps`` kernels. Needs AVX-512 only.

    Raises:
        ValueError: as :func:`gemv_bf16`.
        MemoryError: its float32 copy of ``x`` (up to 1 MiB) could not be allocated.
    """
    _check(x, packed, out_features)
    return run_unchecked(x, packed, out_features, KERNELS[3])


KERNELS = ("gemv-avx512bf16", "gemm-avx512bf16", "gemm-amx", "gemm-fma", "gemm-avx2")  # run_unchecked's names
# (library, C function) of each kernel; all five take the same arguments
SYMBOLS = dict(zip(KERNELS, (("gemv_bf16", "pd_gemv_bf16"), ("gemv_bf16", "pd_gemm_bf16_avx512"),
                              ("gemv_bf16", "pd_gemm_bf16_amx"), ("gemm_bf16_fma", "pd_gemm_bf16_fma"),
                              ("gemm_bf16_avx2", "pd_gemm_bf16_avx2"))))
GEMM_ENV = "PDSERVE_BF16_GEMM"     # "fma", "dpbf16" or "avx2": overrides bf16_gemm_kernel's measurement
DP_FMA_SLOW = 2.0                  # vdpbf16ps does 2x an FMA's FLOPs: slower than this, FMAs win


def dp_fma_ratio() -> float:
    """How many times longer a zmm ``vdpbf16ps`` takes to issue than a zmm FMA on this core, measured
    (``gemm_bf16_fma.c: pd_dp_fma_ratio``, a few ms): 4.1 on an Emerald Rapids core under KVM, about 1 on
    AMD Zen 4 / Zen 5. 0.0 where either kernel library cannot run."""
    if not (available("gemm_bf16_fma") and gemv_available()):
        return 0.0
    fn = library("gemm_bf16_fma").pd_dp_fma_ratio
    fn.argtypes, fn.restype = [ctypes.c_int64], ctypes.c_double
    return float(fn(100_000))


@functools.cache
def bf16_gemm_kernel() -> str:
    """The packed bf16 GEMM for this CPU when AMX does not serve: ``"gemm-avx2"`` on a CPU without
    AVX-512 (its library may still be unavailable: no AVX2 or no compiler); ``"gemm-fma"`` where ``vdpbf16ps``
    issues more than :data:`DP_FMA_SLOW` times slower than an FMA (:func:`dp_fma_ratio`) or does not
    exist (an AVX-512 CPU without AVX512-BF16, such as Ice Lake, or a VM that hides it), else
    ``"gemm-avx512bf16"``. ``PDSERVE_BF16_GEMM=fma|dpbf16|avx2`` overrides the measurement (``dpbf16`` only
    where the CPU has the instruction, ``fma`` only with AVX-512: elsewhere logged and ignored; ``avx2``
    runs an AVX-512 CPU as one without AVX-512 would, for tests and comparisons). Every row count and the
    decode stack use the one answer, so a row's result does not depend on its batch.

    Raises:
        ValueError: ``PDSERVE_BF16_GEMM`` is set to something else.
    """
    forced = os.environ.get(GEMM_ENV, "").lower()
    if forced not in ("", "fma", "dpbf16", "avx2"):
        raise ValueError(f"{GEMM_ENV} must be 'fma', 'dpbf16' or 'avx2', got {forced!r}")
    if forced == "avx2":
        return KERNELS[4]
    if not available(SYMBOLS[KERNELS[3]][0]):
        if forced:
            log.warning("%s=%s ignored: no AVX-512 here, the bf16 GEMM runs on AVX2 FMAs", GEMM_ENV, forced)
        log.info("bf16 GEMM: %s (no AVX-512)", KERNELS[4])
        return KERNELS[4]
    if forced == "fma":
        return KERNELS[3]
    if not gemv_available():
        if forced:
            log.warning("%s=dpbf16 ignored: no AVX512-BF16 here, the bf16 GEMM runs on float32 FMAs", GEMM_ENV)
        log.info("bf16 GEMM: %s (no AVX512-BF16)", KERNELS[3])
        return KERNELS[3]
    if forced:
        return KERNELS[1]
    ratio = dp_fma_ratio()
    kernel = KERNELS[3] if ratio > DP_FMA_SLOW else KERNELS[1]
    log.info("bf16 GEMM: %s (vdpbf16ps / FMA issue time %.2f)", kernel, ratio)
    return kernel


def gemm_bf16_avx2(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """As :func:`gemm_bf16_fma` on 8-lane AVX2 FMAs, for x86 CPUs without AVX-512 (AMD Zen 2/3, older
    and client Intel cores): the same chain per output in the same order, so bit-identical to it.

    Raises:
        ValueError: as :func:`gemv_bf16`.
        MemoryError: its float32 copy of ``x`` (up to 1 MiB) could not be allocated.
    """
    _check(x, packed, out_features)
    return run_unchecked(x, packed, out_features, KERNELS[4])


def run_unchecked(x: torch.Tensor, packed: torch.Tensor, out_features: int, kernel: str) -> torch.Tensor:
    """:func:`gemv_bf16`, :func:`gemm_bf16_avx512`, :func:`gemm_bf16_amx`, :func:`gemm_bf16_fma` or
    :func:`gemm_bf16_avx2` (``kernel``, one of :data:`KERNELS`) without the argument checks, for a caller
    that validated ``packed`` once and passes row-major bf16 ``x`` of its width (a multiple of 32 for AMX).

    Raises:
        KernelUnavailable: ``gemm-amx`` on a CPU or process without AMX-BF16.
        MemoryError: the kernel's scratch memory could not be allocated.
    """
    y = torch.empty(x.shape[0], out_features, dtype=torch.bfloat16)
    rc = _fn(*SYMBOLS[kernel])(
        x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), packed.data_ptr(), packed.shape[0] * 16, out_features,
        y.data_ptr(), out_features)
    if rc == -2:
        raise KernelUnavailable(f"{kernel}: this CPU or process cannot use AMX-BF16")
    if rc:
        raise MemoryError(f"{kernel}: out of scratch memory")
    return y


def _check(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> None:
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.device.type != "cpu" or x.stride(1) != 1:
        raise ValueError(f"gemv_bf16: x must be a row-major 2-D bf16 CPU tensor, got {x.dtype} {tuple(x.shape)}")
    if packed.dtype != torch.bfloat16 or packed.dim() != 4 or packed.shape[2:] != (16, 2) \
            or not packed.is_contiguous():
        raise ValueError("gemv_bf16: packed must come from pack_weight")
    if x.shape[1] != packed.shape[1] * 2 or not packed.shape[0] * 16 - 16 < out_features <= packed.shape[0] * 16:
        raise ValueError(f"gemv_bf16: x has {x.shape[1]} columns and out_features={out_features}, "
                         f"packed weight is {packed.shape[0] * 16} x {packed.shape[1] * 2}")


def gemm_amx_available() -> bool:
    """Whether :func:`gemm_bf16_amx` can run: AMX-BF16 present and granted to this process."""
    return gemv_available() and bool(library("gemv_bf16").pd_cpu_has_amx_bf16())


def gemm_bf16_amx(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """As :func:`gemv_bf16` on AMX tiles, for more rows (input width a multiple of 32).

    Raises:
        ValueError: as :func:`gemv_bf16`, or an input width not a multiple of 32.
        MemoryError: the padded copy of ``x`` could not be allocated.
        KernelUnavailable: no AMX-BF16 here (see :func:`gemm_amx_available`).
    """
    if x.shape[-1] % 32:
        raise ValueError(f"gemm_bf16_amx: input width must be a multiple of 32, got {x.shape[-1]}")
    _check(x, packed, out_features)
    return run_unchecked(x, packed, out_features, KERNELS[2])


AMX_SIDE_MIN_ROWS = 128
"""Rows from which :func:`amx_gate_up_silu` runs (the AMX gemm's plan from ``AMX_SLICED_ROWS`` in gemm_amx.h)."""


def amx_gate_up_silu(x: torch.Tensor, packed: torch.Tensor, intermediate: int, pieces: int) -> torch.Tensor:
    """``silu(gate) * up`` of ``x`` ``[M, K]`` bf16 (row-major, ``M >= AMX_SIDE_MIN_ROWS``, ``K`` a multiple of 32)
    against a packed SwiGLU gate_up weight (``pack_weight`` of ``[2 I, K]``, gate rows first) -> ``[M, I]`` bf16, in
    ``pieces`` pieces of ``I / pieces`` gate and up columns: each piece's gate and up blocks on AMX tiles into a
    ``[M, 2 I / pieces]`` buffer, with the previous piece's SiLU-and-mul (:func:`kernels.cpu.fused.silu_and_mul`'s C
    kernel) run beside their tile work (``pd_gemm_bf16_amx_side``), the last piece's after it. Bit-identical to
    ``silu_and_mul(gemm_bf16_amx(x, packed, 2 I))``.

    Raises:
        ValueError: shapes the pieces do not fit (``I / pieces`` not a multiple of 16), too few rows, or not bf16.
        MemoryError: the kernel's scratch memory could not be allocated.
        KernelUnavailable: no AMX-BF16 here.
    """
    rows, k = x.shape
    c = intermediate // pieces
    if x.dtype != torch.bfloat16 or x.stride(1) != 1 or k % 32 or intermediate % pieces or c % 16 \
            or rows < AMX_SIDE_MIN_ROWS or packed.shape[0] * 16 < 2 * intermediate or packed.shape[1] * 2 != k:
        raise ValueError(f"amx_gate_up_silu: x {x.dtype} {tuple(x.shape)}, {pieces} pieces of {intermediate}, "
                         f"packed {tuple(packed.shape)}")
    fn = _side_fn()
    silu = fused.silu_mul_address()
    out = torch.empty(rows, intermediate, dtype=torch.bfloat16)
    bufs = [torch.empty(rows, 2 * c, dtype=torch.bfloat16) for _ in range(min(pieces, 2))]
    half = rows // 2
    for p in range(pieces):
        y, prev = bufs[p % 2], bufs[(p - 1) % 2] if p else None
        for part, (block, col) in enumerate(((p * c // 16, 0), ((intermediate + p * c) // 16, c))):
            lo, hi = (0, half) if part == 0 else (half, rows)        # the previous piece's rows done beside
            rc = fn(x.data_ptr(), rows, k, x.stride(0), packed[block].data_ptr(), c, c, y[:, col:].data_ptr(), 2 * c,
                    0, silu if prev is not None else None, prev[lo:].data_ptr() if prev is not None else None, c,
                    2 * c, out[lo:, (p - 1) * c:].data_ptr(), intermediate, hi - lo)
            if rc == -2:
                raise KernelUnavailable("amx_gate_up_silu: this CPU or process cannot use AMX-BF16")
            if rc:
                raise MemoryError("amx_gate_up_silu: out of scratch memory")
    fused.silu_and_mul(bufs[(pieces - 1) % 2], out[:, (pieces - 1) * c:])
    return out


@functools.cache
def _side_fn():
    fn = library("gemv_bf16").pd_gemm_bf16_amx_side
    fn.argtypes = [_p, _i64, _i64, _i64, _p, _i64, _i64, _p, _i64, _i64, _p, _p, _i64, _i64, _p, _i64, _i64]
    fn.restype = ctypes.c_int
    return fn


def _fn(lib: str, name: str):
    fn = getattr(library(lib), name)
    if fn.argtypes is None:
        fn.argtypes = [_p, _i64, _i64, _i64, _p, _i64, _i64, _p, _i64]
        fn.restype = ctypes.c_int
    return fn
