"""Streaming read bandwidth measured in C with vector loads (``membw.c``): the memory limit a decode
step is held to.

A torch reduction measures torch's reduction as much as the memory; this reads the buffer with
AVX-512 (with and without software prefetch), AVX2 or scalar loads into independent
accumulators, times each pass in C, and returns the checksum of what it read (the sum modulo
2^64 of the buffer's little-endian 8-byte words, the last partial word zero-extended), so the
reads cannot be optimised away and a caller can check them. Method as in McCalpin's STREAM
(best of repeated passes over a buffer larger than the caches); this is the read-only kernel.
"""

from __future__ import annotations

import ctypes
import time

import torch

from pdserve.kernels.cpu import KernelUnavailable, available, library

PATHS = {"scalar": 0, "avx2": 1, "avx512": 2, "avx512_prefetch_t0": 3, "avx512_prefetch_nta": 4}
_NEEDS = {0: 0, 1: 1, 2: 2, 3: 2, 4: 2}          # path -> the pd_membw_best_isa() level it needs


def membw_available() -> bool:
    """Whether the C read kernel builds and loads here (it has a scalar path, so any C compiler will do)."""
    return available("membw")


def paths() -> list[str]:
    """The read paths this CPU runs, from :data:`PATHS` (empty without the kernel)."""
    if not membw_available():
        return []
    level = int(library("membw").pd_membw_best_isa())
    return [name for name, p in PATHS.items() if _NEEDS[p] <= level]


def read_pass(buf: torch.Tensor, repeats: int = 1, path: str = "avx512", threads: int = 1) -> tuple[float, int]:
    """Read every byte of ``buf`` ``repeats`` times with ``path`` on ``threads`` threads.

    ``buf``: a contiguous CPU tensor of any dtype and any start address and length.
    Returns (fastest pass in seconds, checksum as an unsigned 64-bit int; module docstring).

    Raises:
        ValueError: ``buf`` is not a contiguous CPU tensor, or ``repeats``/``threads`` < 1.
        KernelUnavailable: no kernel here, or this CPU lacks ``path``'s ISA.
    """
    if buf.device.type != "cpu" or not buf.is_contiguous():
        raise ValueError("read_pass: buf must be a contiguous CPU tensor")
    if repeats < 1 or threads < 1:
        raise ValueError(f"read_pass: repeats and threads must be >= 1, got {repeats}, {threads}")
    if path not in PATHS:
        raise ValueError(f"read_pass: unknown path {path!r}; one of {sorted(PATHS)}")
    if not membw_available():
        raise KernelUnavailable("membw: the C read kernel is unavailable")
    fn = library("membw").pd_membw_read
    if fn.argtypes is None:
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                       ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_uint64)]
        fn.restype = ctypes.c_int
    seconds, checksum = ctypes.c_double(), ctypes.c_uint64()
    rc = fn(buf.data_ptr(), buf.numel() * buf.element_size(), PATHS[path], repeats, threads,
            ctypes.byref(seconds), ctypes.byref(checksum))
    if rc == -2:
        raise KernelUnavailable(f"membw: this CPU lacks the ISA of path {path!r}")
    if rc:
        raise RuntimeError(f"membw: pd_membw_read failed ({rc})")
    return seconds.value, checksum.value


def read_bandwidth(buf: torch.Tensor, repeats: int = 5, threads: int = 1) -> float:
    """Best streaming read bandwidth over ``buf`` in bytes/s: the fastest pass of every path this CPU
    runs (after one untimed warm-up pass that faults the pages in).

    Raises:
        ValueError, KernelUnavailable: as :func:`read_pass`, or ``buf`` is empty.
    """
    nbytes = buf.numel() * buf.element_size()
    if nbytes == 0:
        raise ValueError("read_bandwidth: empty buffer")
    return nbytes / min(best_pass_seconds(buf, repeats, threads).values())


def best_pass_seconds(buf: torch.Tensor, repeats: int = 5, threads: int = 1) -> dict[str, float]:
    """Fastest pass in seconds per read path this CPU runs, after one untimed warm-up pass."""
    available_paths = paths()
    if not available_paths:
        raise KernelUnavailable("membw: the C read kernel is unavailable")
    read_pass(buf, 1, available_paths[-1], threads)
    return {p: read_pass(buf, repeats, p, threads)[0] for p in available_paths}


def measured_clock_mhz(cycles: int = 200_000_000, repeats: int = 5) -> float | None:
    """This core's clock in MHz while busy, from a chain of dependent integer adds (one cycle each)
    in C: ``cycles / seconds``, best of ``repeats`` timed runs (about 50 ms each at 4 GHz). ``None``
    without the kernel. Take it with the process pinned to the core it is about.

    Raises:
        RuntimeError: the chain's result is not what it must be (the loop did not run as written).
    """
    if not membw_available():
        return None
    fn = library("membw").pd_add_chain
    fn.argtypes, fn.restype = [ctypes.c_int64], ctypes.c_int64
    iterations = cycles // 64
    fn(iterations // 10)                                    # warm the core up to its working clock
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        got = fn(iterations)
        best = min(best, time.perf_counter() - t0)
        if got != iterations * 64:
            raise RuntimeError(f"measured_clock_mhz: the add chain returned {got}, not {iterations * 64}")
    return iterations * 64 / best / 1e6
