"""The attention kernels' inline exponential (kernels/cpu/exp16.h): exp16 (AVX-512) and exp8 (AVX2) agree
lane for lane, stay within 2 ulp of float64 exp, and never return a subnormal: below x = -87 they return
exactly 0 (Intel cores take a microcode assist on every instruction that makes a subnormal, which had
made each decode page with masked lanes 2.3x slower on a Xeon)."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from pdserve.kernels import cpu

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("cc") is None
                                and shutil.which("gcc") is None, reason="needs an x86-64 C compiler")

SOURCE = r"""
#include <stdint.h>
#include "exp16.h"
/* y16 / y8 = exp16 / exp8 of x[0..n), n a multiple of 16; returns 1 | 2 for the ISAs this CPU ran. */
__attribute__((target("avx512f"))) static void run16(const float *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) _mm512_storeu_ps(y + i, exp16(_mm512_loadu_ps(x + i)));
}
__attribute__((target("avx2,fma"))) static void run8(const float *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(y + i, exp8(_mm256_loadu_ps(x + i)));
}
int sweep(const float *x, float *y16, float *y8, int64_t n) {
    __builtin_cpu_init();
    int ran = 0;
    if (__builtin_cpu_supports("avx512f")) { run16(x, y16, n); ran |= 1; }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) { run8(x, y8, n); ran |= 2; }
    return ran;
}
"""


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    d = tmp_path_factory.mktemp("exp16")
    (d / "sweep.c").write_text(SOURCE)
    cc = shutil.which("cc") or shutil.which("gcc")
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-I", str(Path(cpu.__file__).parent), str(d / "sweep.c"),
                    "-o", str(d / "sweep.so")], check=True, capture_output=True)
    fn = ctypes.CDLL(str(d / "sweep.so")).sweep
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64]
    fn.restype = ctypes.c_int

    def run(x: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
        x = np.ascontiguousarray(x, dtype=np.float32)
        y16, y8 = np.full_like(x, np.nan), np.full_like(x, np.nan)
        ran = fn(x.ctypes.data, y16.ctypes.data, y8.ctypes.data, x.size)
        return ran, y16, y8
    return run


def _inputs() -> np.ndarray:
    rng = np.random.default_rng(0)
    edges = np.array([-np.inf, np.nan, -1e30, -200, -104, -87.5, -87.0001, -87, -86.9999, -80, -1e-30, 0, 1e-30,
                      1, 8, 80, 88], dtype=np.float32)
    # every float32 around the floor, and a dense sweep of the range the kernels call it on
    around = np.arange(np.float32(-87).view(np.int32) - 2000, np.float32(-87).view(np.int32) + 2000,
                       dtype=np.int32).view(np.float32)
    x = np.concatenate([edges, around, rng.uniform(-120, 88, 200_000).astype(np.float32)])
    return np.concatenate([x, np.zeros(-x.size % 16, np.float32)])


def test_exp16_and_exp8_agree_lane_for_lane_and_never_return_a_subnormal(sweep):
    x = _inputs()
    ran, y16, y8 = sweep(x)
    if ran == 0:
        pytest.skip("this CPU has neither AVX-512 nor AVX2")
    ys = [y for bit, y in ((1, y16), (2, y8)) if ran & bit]
    if ran == 3:
        assert np.array_equal(y16.view(np.int32), y8.view(np.int32))
    for y in ys:
        assert not np.any((y != 0) & (np.abs(y) < np.finfo(np.float32).tiny)), "a subnormal result"
        below = ~(x >= -87)                                  # NaN and -inf included
        assert np.all(y[below] == 0)
        above = x >= -87
        exact = np.exp(x[above].astype(np.float64))
        assert np.all(y[above] >= np.finfo(np.float32).tiny)
        ulp = np.spacing(exact.astype(np.float32)).astype(np.float64)
        assert np.max(np.abs(y[above] - exact) / ulp) <= 2.0
