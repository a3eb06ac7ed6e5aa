"""The AMX tile unit's own limits, measured: how fast ``TDPBF16PS`` issues with its operands in tile
registers, and how fast 1 KiB tile loads run from each level of the cache (``gemm_amx.h:
pd_amx_tdp_probe``, ``pd_amx_tile_load_probe``), and what a gemm's tile work costs a weight stream read from
memory beside it (``pd_amx_stream_probe``).

The paper peak of an AMX core is one ``TDPBF16PS`` (16 x 16 x 32 multiply-adds, 16,384 FLOP) per 16 cycles at
the core's clock. On the Emerald Rapids core of this project's VMs (family 6, model 207, 2026-12-01) the tile
unit issued one per 7.0 ns (2,340 GFLOP/s, 16 cycles at 2.3 GHz where the scalar clock measured 3.4-3.9 GHz),
and in other minutes of the same session one per 15.4-18.5 ns on the same loop: the matrix unit's rate moves with
the host, so :mod:`bench.limits` records it beside every run's GEMM figures. A tile load took 3.3 ns from L1,
8 ns from L2 and ~40 ns from the L3 without prefetching: a 2 x 2 tile-blocked GEMM (four loads to four
``TDPBF16PS``) whose operands come from L2 is bound by its loads, not by the matrix unit.
"""

from __future__ import annotations

import ctypes
import math
import time

import torch

from pdserve.kernels.cpu import KernelUnavailable, library
from pdserve.kernels.cpu.gemv import gemm_amx_available

TDP_FLOP = 2 * 16 * 16 * 32          # one TDPBF16PS on full 16-row tiles
PANEL = 2 * 16 * 768 * 2             # bytes of a panel of pd_amx_stream_probe's walk (two 16 x 768 bf16 blocks)


def _fn(name: str, argtypes: list) -> ctypes._CFuncPtr:
    fn = getattr(library("gemv_bf16"), name)
    fn.argtypes, fn.restype = argtypes, ctypes.c_float
    return fn


def _best_seconds(call, reps: int) -> tuple[float, float]:
    """Fastest of ``reps`` timed calls (after one untimed warm-up) and the last call's result."""
    result = call()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        result = call()
        best = min(best, time.perf_counter() - start)
    return best, result


def tdp_seconds(rounds: int = 50_000, reps: int = 5) -> float:
    """Seconds per ``TDPBF16PS`` with every operand in tile registers (best of ``reps`` runs of
    ``4 * rounds`` instructions, four independent accumulators).

    Raises:
        KernelUnavailable: no AMX-BF16 here, or this process may not use tile data.
        RuntimeError: the accumulated result is not ``32 * rounds`` (the loop did not run as built).
    """
    if not gemm_amx_available():
        raise KernelUnavailable("amx_probe: this CPU or process cannot use AMX-BF16")
    if not 0 < rounds <= 1 << 19:                 # 32 x rounds stays exact in float32
        raise ValueError(f"rounds must be in 1..{1 << 19}, got {rounds}")
    src = torch.ones(2048, dtype=torch.bfloat16)
    fn = _fn("pd_amx_tdp_probe", [ctypes.c_void_p, ctypes.c_int64])
    seconds, c00 = _best_seconds(lambda: fn(src.data_ptr(), rounds), reps)
    if c00 != 32.0 * rounds:
        raise RuntimeError(f"amx_probe: TDPBF16PS loop returned {c00}, expected {32.0 * rounds}")
    return seconds / (4 * rounds)


def tile_load_seconds(nbytes: int, loads: int = 200_000, reps: int = 5) -> float:
    """Seconds per 1 KiB tile load walking an ``nbytes`` buffer (rounded up to 4 KiB) over and over:
    the load rate from the cache level that holds ``nbytes``.

    Raises:
        KernelUnavailable: no AMX-BF16 here, or this process may not use tile data.
        RuntimeError: the last tile loaded does not hold the buffer's bytes.
    """
    if not gemm_amx_available():
        raise KernelUnavailable("amx_probe: this CPU or process cannot use AMX-BF16")
    nbytes = max(4096, -(-nbytes // 4096) * 4096)
    src = torch.full((nbytes // 2,), 1.5, dtype=torch.bfloat16)      # 0x3fc0 in every half-word
    fn = _fn("pd_amx_tile_load_probe", [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64])
    rounds = max(1, loads // 4)
    seconds, first = _best_seconds(lambda: fn(src.data_ptr(), nbytes, rounds), reps)
    expected = torch.tensor([0x3FC0_3FC0], dtype=torch.int32).view(torch.float32).item()
    if first != expected:
        raise RuntimeError(f"amx_probe: the tile loads returned {first!r}, expected {expected!r}")
    return seconds / (4 * rounds)


TILE_WORK = {"vectors": 0, "beside_tile_loads": 1, "beside_tdp": 2, "beside_32_row_tile_work": 3}


def stream_bytes_per_s(src: torch.Tensor, tile_work: str, reps: int = 3) -> float:
    """Bytes/s of a vector-load read of ``src`` (bf16, contiguous, every element 1.0, at least :data:`PANEL`
    bytes: its first multiple of them is read; DRAM-sized for the figure, in huge pages as the packed weights
    are): two prefetched streams walked as the 32-row AMX gemm walks a K = 768 weight's panels, best of ``reps``
    passes after one untimed, with a 32-row gemm's tile work for each 2 KiB read (``gemm_amx.h:
    pd_amx_stream_probe``), ``tile_work`` one of :data:`TILE_WORK`: none (``vectors``), its four 1 KiB tile loads
    from L1, its four ``TDPBF16PS``, or both (``beside_32_row_tile_work``). The rates side by side measure what
    the tile work costs a weight stream, and the last is the ceiling of a 32-row AMX gemm over weights read from
    memory. On the AMX Xeon model 167 (2026-12-01), 1 GiB, two runs of three: 14.7-14.8 and 15.4-15.6 GB/s alone,
    12.9-13.3 and 13.9-14.2 beside the whole tile work (87-92%; in the second, its tile loads alone 14.0-14.1, its
    TDPBF16PS alone 15.0-15.2); the 32-row gemm itself read 1 GiB of weights at 11.4-12.1 in a scratch loop.

    Raises:
        KernelUnavailable: no AMX-BF16 here, or this process may not use tile data.
        ValueError: ``tile_work`` is not a key of :data:`TILE_WORK`, or ``src`` is not a contiguous bf16 tensor
            of at least :data:`PANEL` bytes.
        RuntimeError: the returned sum is not what every load and tile product of a buffer of 1.0 gives.
    """
    if not gemm_amx_available():
        raise KernelUnavailable("amx_probe: this CPU or process cannot use AMX-BF16")
    if tile_work not in TILE_WORK:
        raise ValueError(f"tile_work must be one of {sorted(TILE_WORK)}, got {tile_work!r}")
    if src.dtype != torch.bfloat16 or not src.is_contiguous() or src.numel() * 2 < PANEL:
        raise ValueError(f"src must be a contiguous bf16 tensor of at least {PANEL} bytes, got {src.dtype} "
                         f"{tuple(src.shape)}")
    nbytes = src.numel() * 2 // PANEL * PANEL
    fn = _fn("pd_amx_stream_probe", [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int])
    mode = TILE_WORK[tile_work]
    seconds, result = _best_seconds(lambda: fn(src.data_ptr(), nbytes, mode), reps)
    steps = nbytes // 2048                       # 2 KiB read a step; each adds 32 (1.0 x 1.0 over 32 k) to C[0][0]
    expected = 0x3F80 + (32.0 * steps if mode & 2 else 0.0)     # the OR of every bf16 1.0 read, plus the tiles'
    if not math.isclose(result, expected, rel_tol=1e-6):
        raise RuntimeError(f"amx_probe: the stream returned {result}, expected {expected}")
    return nbytes / seconds


def measure(l3_bytes: int | None = None, stream_src: torch.Tensor | None = None) -> dict:
    """The tile unit's limits as a JSON-ready dict: ``tdp_ns`` (ns per ``TDPBF16PS``), ``tdp_flops_per_s``
    (FLOP/s at that rate: the matrix unit's measured ceiling), and ``tile_load_ns`` per cache level
    (``l1`` over 16 KiB, ``l2`` over 1 MiB, ``l3`` over 64 MiB or a quarter of ``l3_bytes``, whichever is
    smaller), with ``tile_load_bytes`` the buffer sizes. With ``stream_src`` (a DRAM-sized buffer as
    :func:`stream_bytes_per_s` takes it), also ``stream_bytes_per_s``: that function's rate over it for each kind
    of :data:`TILE_WORK`, and ``stream_bytes``, the bytes read.

    Raises:
        KernelUnavailable: no AMX-BF16 here.
    """
    tdp = tdp_seconds()
    sizes = {"l1": 16 << 10, "l2": 1 << 20, "l3": min(64 << 20, (l3_bytes or 256 << 20) // 4)}
    loads = {level: tile_load_seconds(n, loads=200_000 if level != "l3" else 50_000) for level, n in sizes.items()}
    out = {"tdp_ns": tdp * 1e9, "tdp_flops_per_s": TDP_FLOP / tdp,
           "tile_load_ns": {level: s * 1e9 for level, s in loads.items()}, "tile_load_bytes": sizes}
    if stream_src is not None:
        out["stream_bytes"] = stream_src.numel() * 2 // PANEL * PANEL
        out["stream_bytes_per_s"] = {work: stream_bytes_per_s(stream_src, work) for work in TILE_WORK}
    return out
