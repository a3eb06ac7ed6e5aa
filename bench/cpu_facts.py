"""The CPU a benchmark ran on: model, ISA features, L3, clock, which C kernels load
(:func:`cpu_facts`, recorded in every results JSON), and the ISA's paper peak
(:func:`theoretical_peak`), printed beside the measured limits of :mod:`bench.limits`."""

from __future__ import annotations

import os
import platform
import re
import subprocess
from collections.abc import Iterable
from pathlib import Path

FEATURES = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512_vnni", "avx512f", "avx2", "fma")
C_KERNELS = ("gemv_bf16", "gemm_bf16_fma", "gemm_bf16_avx2", "paged_attention", "prefill_attention",
             "prefill_attention_fma", "prefill_attention_avx2", "fused", "decode_stack", "gemv_int4", "gemv_int4_avx2",
             "membw")

# FLOP per cycle per core, by ISA. AMX: one TDPBF16PS (16x16 fp32 tile += 16x32 by 32x16 bf16,
# 16,384 FLOP) per 16 cycles = 1024 (Intel AMX, Sapphire Rapids). vdpbf16ps zmm: 16 fp32 lanes x
# 2 bf16 pairs x (mul + add) = 64 FLOP per instruction, times the issue rate per microarchitecture
# (_BF16_ISSUE). FMA: 2 FLOP per lane, 2 FMA pipes: AVX-512 2 x 16 x 2, AVX2 2 x 8 x 2; Zen 4 runs a
# 512-bit op over both 256-bit halves ("double-pumped"), so one zmm FMA or vdpbf16ps per cycle.
_AMX_BF16 = 1024
_VDPBF16PS_FLOP = 64
_FMA512_FLOP = 32          # one zmm FMA: 16 lanes x 2
_FMA256_FLOP = 16          # one ymm FMA: 8 lanes x 2


def _bf16_issue(vendor: str, family: int) -> tuple[float, str]:
    """zmm vdpbf16ps (and zmm FMA) per cycle per core, with its source.

    Intel Cooper Lake / Sapphire Rapids / Emerald Rapids: 2 (ports 0 and 5, the two 512-bit FMA
    units; LLVM's scheduling model: llvm-mca -mcpu=sapphirerapids, RThroughput 0.5). AMD Zen 4
    (family 0x19): 1 (512-bit ops double-pumped through 256-bit units; A. Yee, "Zen5's AVX512
    Teardown", numberworld.org, 2024, on Zen 4). AMD Zen 5 (family 0x1a): 2 (full 512-bit
    datapath, same article). Unknown: 2, an upper bound."""
    if vendor == "AuthenticAMD" and family == 0x19:
        return 1.0, "Zen 4 double-pumps 512-bit ops: 1 zmm vdpbf16ps/FMA per cycle"
    if vendor == "AuthenticAMD" and family >= 0x1a:
        return 2.0, "Zen 5 native 512-bit: 2 zmm vdpbf16ps/FMA per cycle"
    if vendor == "GenuineIntel":
        return 2.0, "Intel server core: 2 zmm vdpbf16ps/FMA per cycle (ports 0 and 5)"
    return 2.0, "unknown microarchitecture: assumed 2 zmm ops per cycle (upper bound)"


def theoretical_peak(flags: Iterable[str], mhz: float, cores: int, vendor: str = "GenuineIntel",
                     family: int = 6, dp_fma_ratio: float = 0.0) -> dict:
    """Paper peak of bf16 matmul on ``cores`` cores at ``mhz``: cores x clock x FLOP/cycle/core of the
    best ISA in ``flags`` (``/proc/cpuinfo`` names: ``amx_bf16``, ``avx512_bf16``, ``avx512f``,
    ``avx2`` + ``fma``). ``dp_fma_ratio`` (:func:`kernels.cpu.gemv.dp_fma_ratio`, 0: not measured): how
    many times longer a zmm ``vdpbf16ps`` issues than a zmm FMA on this core; where the dot product's
    FLOPs per cycle fall below the FMA's (an Emerald Rapids core under KVM measured 4.1), the peak is
    the FMA's. A pure function.

    Returns ``{"isa", "flop_per_cycle_per_core", "cores", "clock_mhz", "flops" (FLOP/s), "note"}``.
    """
    flags = set(flags)
    issue, note = _bf16_issue(vendor, family)
    if "amx_bf16" in flags and "amx_tile" in flags:
        isa, per_cycle, note = "amx_bf16", float(_AMX_BF16), "one TDPBF16PS (16,384 FLOP) per 16 cycles"
    elif "avx512_bf16" in flags and dp_fma_ratio > 0 and _VDPBF16PS_FLOP / dp_fma_ratio < _FMA512_FLOP:
        isa, per_cycle = "avx512f_fma_fp32", _FMA512_FLOP * issue
        note = f"{issue:g} zmm FMA per cycle; vdpbf16ps measured {dp_fma_ratio:.1f}x slower to issue"
    elif "avx512_bf16" in flags:
        isa, per_cycle = "avx512_bf16", _VDPBF16PS_FLOP * issue
    elif "avx512f" in flags:
        isa, per_cycle = "avx512f_fma_fp32", _FMA512_FLOP * issue
    elif "avx2" in flags and "fma" in flags:
        isa, per_cycle, note = "avx2_fma_fp32", 2.0 * _FMA256_FLOP, "2 ymm FMA per cycle"
    else:
        isa, per_cycle, note = "scalar", 2.0, "one scalar FMA per cycle"
    return {"isa": isa, "flop_per_cycle_per_core": per_cycle, "cores": cores, "clock_mhz": mhz,
            "flops": cores * mhz * 1e6 * per_cycle, "note": note}


def _cpuinfo() -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if not key and out:
                break                                       # first processor only
            out.setdefault(key, value.strip())
    except OSError:
        pass
    return out


def _lscpu() -> dict[str, str]:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.splitlines())}


def _size_bytes(text: str) -> int | None:
    """``"260 MiB (1 instance)"`` / ``"32768K"`` -> bytes."""
    m = re.match(r"\s*([\d.]+)\s*([KMG]?)i?B?", text or "")
    if not m:
        return None
    return int(float(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)])


def cpu_facts() -> dict:
    """Model name, vendor/family/model, the ISA flags that set the limits, L3 bytes, the clock used for
    the paper peak, and which C kernels build and load here. The clock is the larger of the reported
    one (lscpu's maximum, else ``cpu MHz``: under KVM often only the nominal clock) and the one measured
    on the calling thread's core (:func:`kernels.cpu.membw.measured_clock_mhz`); ``clock_source`` says
    which, both are recorded."""
    from pdserve.kernels.cpu import available
    from pdserve.kernels.cpu.membw import measured_clock_mhz

    info, ls = _cpuinfo(), _lscpu()
    flags = set(info.get("flags", "").split())
    l3 = _size_bytes(ls.get("L3 cache", "")) or _size_bytes(info.get("cache size", ""))
    if ls.get("CPU max MHz"):
        mhz, source = float(ls["CPU max MHz"]), "lscpu CPU max MHz"
    elif info.get("cpu MHz"):
        mhz, source = float(info["cpu MHz"]), "/proc/cpuinfo cpu MHz (may be only the nominal clock, e.g. under KVM)"
    else:
        mhz, source = float("nan"), "unknown"
    reported = mhz
    measured = measured_clock_mhz()
    if measured is not None and not measured <= mhz:       # a reported clock below the measured one is not the limit
        mhz, source = measured, f"measured: dependent-add chain in C ({source}: {reported:.0f} MHz)"
    return {"model_name": info.get("model name", platform.processor()), "vendor": info.get("vendor_id", ""),
            "family": int(info.get("cpu family", "0") or 0), "model": int(info.get("model", "0") or 0),
            "features": {f: f in flags for f in FEATURES}, "l3_bytes": l3, "clock_mhz": mhz,
            "clock_source": source, "clock_reported_mhz": reported, "clock_measured_mhz": measured,
            "hypervisor": ls.get("Hypervisor vendor"), "logical_cpus": os.cpu_count(),
            "kernels": {k: available(k) for k in C_KERNELS}}
