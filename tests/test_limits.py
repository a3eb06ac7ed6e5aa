"""The machine limits the benchmarks measure against (bench/limits.py, kernels/cpu/membw.c).

The C read must really read: its checksum (sum mod 2^64 of the buffer's little-endian 8-byte words,
the last partial word zero-extended) must equal numpy's over the same bytes, for every ISA path this
CPU has, on awkward lengths and start addresses, split over several threads. No timed assertions:
measured figures are only checked to be positive and finite.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pdserve.bench import cpu_facts, gemm_limits, limits
from pdserve.kernels.cpu import KernelUnavailable, amx_probe, membw
from pdserve.kernels.cpu.gemv import gemm_amx_available

needs_membw = pytest.mark.skipif(not membw.membw_available(), reason="no C compiler: the read kernel cannot build")


def reference_checksum(buf: torch.Tensor) -> int:
    raw = buf.contiguous().view(torch.uint8).numpy().tobytes()
    raw += bytes(-len(raw) % 8)
    return int(np.frombuffer(raw, dtype="<u8").sum(dtype=np.uint64))


@needs_membw
@pytest.mark.parametrize("path", list(membw.PATHS))
def test_read_checksum_is_exact_on_awkward_lengths_and_offsets(path):
    if path not in membw.paths():
        pytest.skip(f"this CPU lacks {path}")
    base = torch.randint(0, 256, (200_000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    base[::97] = 255                                  # high bytes: carries across the 64-bit wraparound
    for length in (0, 1, 7, 8, 63, 64, 65, 255, 511, 512, 513, 2049, 4096 + 3, 100_003):
        for offset in (0, 1, 3, 8, 61):
            buf = base[offset:offset + length]
            for threads in (1, 3):
                _, checksum = membw.read_pass(buf, 2, path, threads)
                assert checksum == reference_checksum(buf), (path, length, offset, threads)


@needs_membw
def test_read_checksum_of_float_tensor_and_wraparound():
    buf = torch.full((1 << 16,), -1.0)               # 0xBF800000 words: the 64-bit sum wraps many times
    for path in membw.paths():
        assert membw.read_pass(buf, 1, path, 2)[1] == reference_checksum(buf)
    ones = torch.full((1000,), 0xFF, dtype=torch.uint8)   # 125 words of 2^64 - 1
    assert membw.read_pass(ones, 1, membw.paths()[-1])[1] == (125 * (2**64 - 1)) % 2**64


@needs_membw
def test_read_rejects_bad_arguments():
    buf = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(ValueError):
        membw.read_pass(buf[::2], 1)                  # not contiguous
    with pytest.raises(ValueError):
        membw.read_pass(buf, 0)
    with pytest.raises(ValueError):
        membw.read_pass(buf, 1, "sse9")
    with pytest.raises(ValueError):
        membw.read_bandwidth(buf[:0])
    missing = [p for p in membw.PATHS if p not in membw.paths()]
    if missing:
        with pytest.raises(KernelUnavailable):
            membw.read_pass(buf, 1, missing[0])


@needs_membw
def test_read_bandwidth_is_positive_and_finite():
    bw = membw.read_bandwidth(torch.ones(1 << 18), repeats=2, threads=2)
    assert math.isfinite(bw) and bw > 0


@needs_membw
def test_the_paper_peak_uses_the_larger_of_the_measured_and_the_reported_clock():
    mhz = membw.measured_clock_mhz(cycles=20_000_000, repeats=3)
    assert 100 < mhz < 10_000                          # a clock, not a loop the compiler folded away
    facts = cpu_facts.cpu_facts()
    reported, measured = facts["clock_reported_mhz"], facts["clock_measured_mhz"]
    assert facts["clock_mhz"] == (measured if math.isnan(reported) or measured > reported else reported)
    assert facts["clock_source"].startswith("measured") == (facts["clock_mhz"] == measured)


@pytest.mark.parametrize("flags, mhz, cores, vendor, family, isa, per_cycle", [
    ({"amx_bf16", "amx_tile", "avx512_bf16", "avx512f"}, 2000.0, 4, "GenuineIntel", 6, "amx_bf16", 1024),
    ({"avx512_bf16", "avx512f", "avx2", "fma"}, 2300.0, 1, "GenuineIntel", 6, "avx512_bf16", 128),   # EMR, no AMX
    ({"avx512_bf16", "avx512f", "avx2", "fma"}, 3000.0, 2, "AuthenticAMD", 0x19, "avx512_bf16", 64),  # Zen 4
    ({"avx512_bf16", "avx512f"}, 3000.0, 2, "AuthenticAMD", 0x1a, "avx512_bf16", 128),                # Zen 5
    ({"avx512f", "avx2", "fma"}, 2500.0, 8, "GenuineIntel", 6, "avx512f_fma_fp32", 64),
    ({"avx512f", "avx2", "fma"}, 2500.0, 8, "AuthenticAMD", 0x19, "avx512f_fma_fp32", 32),
    ({"avx2", "fma"}, 3500.0, 2, "AuthenticAMD", 0x17, "avx2_fma_fp32", 32),
    ({"amx_bf16"}, 1000.0, 1, "GenuineIntel", 6, "scalar", 2),       # AMX-BF16 without AMX tiles: not usable
])
def test_theoretical_peak(flags, mhz, cores, vendor, family, isa, per_cycle):
    peak = cpu_facts.theoretical_peak(flags, mhz, cores, vendor, family)
    assert peak["isa"] == isa
    assert peak["flop_per_cycle_per_core"] == per_cycle
    assert peak["flops"] == cores * mhz * 1e6 * per_cycle


@pytest.mark.parametrize("ratio, isa, per_cycle", [(4.1, "avx512f_fma_fp32", 64), (1.9, "avx512_bf16", 128),
                                                   (1.0, "avx512_bf16", 128), (0.0, "avx512_bf16", 128)])
def test_a_slowly_issued_vdpbf16ps_leaves_the_fma_peak(ratio, isa, per_cycle):
    """Where a zmm vdpbf16ps issues more than twice as slowly as a zmm FMA (an Emerald Rapids core under KVM:
    4.1x), its 64 FLOP per instruction fall below the FMA's 32 x 2 per cycle; 0 means not measured."""
    peak = cpu_facts.theoretical_peak({"avx512_bf16", "avx512f"}, 3000.0, 1, "GenuineIntel", 6, ratio)
    assert (peak["isa"], peak["flop_per_cycle_per_core"]) == (isa, per_cycle)


def test_best_amx_takes_the_fastest_sample_and_keeps_them_all():
    slow = {"tdp_ns": 18.5, "tdp_flops_per_s": 0.9e12, "tile_load_ns": {"l1": 5.7}, "tile_load_bytes": {"l1": 1}}
    fast = {"tdp_ns": 7.0, "tdp_flops_per_s": 2.3e12, "tile_load_ns": {"l1": 3.1}, "tile_load_bytes": {"l1": 1}}
    best = limits.best_amx([slow, fast])
    assert best["tdp_ns"] == 7.0 and best["tile_load_ns"] == {"l1": 3.1} and best["tdp_ns_samples"] == [18.5, 7.0]


def test_size_parsing_and_nearest_gemm_rate():
    assert cpu_facts._size_bytes("260 MiB (1 instance)") == 260 << 20
    assert cpu_facts._size_bytes("32768 KB") == 32 << 20
    assert cpu_facts._size_bytes("") is None
    fake = {"gemm": {"best_by_rows": {"1": {"flops_per_s": 1.0}, "32": {"flops_per_s": 2.0},
                                      "512": {"flops_per_s": 3.0}}}}
    assert gemm_limits.gemm_rate_at(fake, 32)["flops_per_s"] == 2.0
    assert gemm_limits.gemm_rate_at(fake, 24)["flops_per_s"] == 2.0      # nearest on a log scale
    assert gemm_limits.gemm_rate_at(fake, 300)["flops_per_s"] == 3.0


def test_best_by_rows_skips_failed_kernels():
    rows = [{"rows": 8, "kernel": "a", "flops_per_s": 5.0}, {"rows": 8, "kernel": "b", "error": "boom"},
            {"rows": 8, "kernel": "c", "flops_per_s": 7.0}, {"rows": 1, "kernel": "a", "flops_per_s": 1.0}]
    best = gemm_limits.best_by_rows(rows)
    assert best["8"]["kernel"] == "c" and best["1"]["kernel"] == "a"


@needs_membw
def test_measure_limits_on_tiny_shapes():
    out = limits.measure_limits([(48, 64), (32, 32), (48, 64)], rows=[1, 3], working_set_bytes=[1 << 20],
                                threads=1, dram_bytes=4 << 20)
    assert set(out) >= {"cpu", "threads", "bandwidth", "bandwidth_bytes_per_s", "torch_sum_bytes_per_s", "gemm",
                        "best_gemm_flops_per_s", "theoretical_peak"}
    for figure in (out["bandwidth"]["dram"], out["bandwidth"]["working_set"][str(1 << 20)]):
        for pages in ("4k", "huge"):
            assert figure[pages]["c_path"] in membw.paths()
            for v in (figure[pages]["c_read"], figure[pages]["torch_sum"]):
                assert math.isfinite(v) and v > 0
        assert figure["best"] == max(figure["4k"]["c_read"], figure["huge"]["c_read"])
    assert out["bandwidth_bytes_per_s"] == out["bandwidth"]["dram"]["best"]
    measured = {(r["n"], r["k"], r["rows"], r["kernel"]) for r in out["gemm"]["measurements"] if "flops_per_s" in r}
    assert {(n, k, m, "f_linear") for n, k in [(48, 64), (32, 32)] for m in (1, 3)} <= measured
    assert set(out["gemm"]["best_by_rows"]) == {"1", "3"}
    for r in out["gemm"]["best_by_rows"].values():
        assert math.isfinite(r["flops_per_s"]) and r["flops_per_s"] > 0
    assert out["best_gemm_flops_per_s"] == max(r["flops_per_s"] for r in out["gemm"]["best_by_rows"].values())
    assert out["theoretical_peak"]["flops"] > 0 and out["theoretical_peak"]["cores"] == 1
    if gemm_amx_available():       # the tile unit's own figures, recorded where AMX runs
        assert set(out["amx"]) == {"tdp_ns", "tdp_flops_per_s", "tile_load_ns", "tile_load_bytes", "tdp_ns_samples",
                                   "stream_bytes", "stream_bytes_per_s"}
        dram_bytes = out["bandwidth"]["dram"]["bytes"]           # read in whole panels of the gemm's walk
        assert dram_bytes - amx_probe.PANEL < out["amx"]["stream_bytes"] <= dram_bytes
        assert set(out["amx"]["stream_bytes_per_s"]) == set(amx_probe.TILE_WORK)
        assert all(v > 0 for v in out["amx"]["stream_bytes_per_s"].values())
        assert "AMX weight stream" in limits.summary(out)
        assert len(out["amx"]["tdp_ns_samples"]) == 2 and out["amx"]["tdp_ns"] == min(out["amx"]["tdp_ns_samples"])
        assert set(out["amx"]["tile_load_ns"]) == {"l1", "l2", "l3"}
        assert "AMX tile unit, measured" in limits.summary(out)
    else:
        assert out["amx"] is None and "AMX" not in limits.summary(out)
    cpu = out["cpu"]
    assert set(cpu["features"]) == set(cpu_facts.FEATURES) and set(cpu["kernels"]) == set(cpu_facts.C_KERNELS)
    assert cpu["kernels"]["membw"] is True
    # a working set within 5% of a measured one reuses it; another size is measured and recorded
    before = dict(out["bandwidth"]["working_set"])
    assert limits.bandwidth_at(out, (1 << 20) + 1000) == before[str(1 << 20)]["best"]
    assert limits.bandwidth_at(out, 2 << 20) > 0 and str(2 << 20) in out["bandwidth"]["working_set"]


def test_prefill_flops_count_packed_and_dense_projections_alike(model_dir):
    """MFU's numerator must not depend on how the projections hold their weights (a packed module has no
    dense ``weight``; counting parameters would see none and report an MFU of almost nothing)."""
    from pdserve.bench.prefill import prefill_flops
    from pdserve.model.cpu_linear import pack_for_cpu_decode
    from pdserve.model.loader import load_model

    model, cfg = load_model(model_dir, torch.bfloat16)
    dense = prefill_flops(model, 512)
    per_token = 2 * cfg.num_layers * (cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
                                      + cfg.num_heads * cfg.head_dim * cfg.hidden_size
                                      + 3 * cfg.hidden_size * cfg.intermediate_size)
    assert dense > per_token * 512
    if pack_for_cpu_decode(model):
        assert prefill_flops(model, 512) == dense


def test_prefill_flops_count_the_experts_each_token_runs(tmp_path):
    """A mixture's prefill FLOPs count top_k of its experts a token, not all of them (an MFU over 100% else)."""
    from pdserve.bench.prefill import prefill_flops
    from pdserve.deploy.make_model import make_model
    from pdserve.model.loader import load_model

    model, cfg = load_model(make_model("tiny-mixtral", tmp_path / "m", dtype="float32"), torch.float32)
    n, h = 64, cfg.hidden_size
    expert = 3 * h * cfg.moe_intermediate_size
    attention = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * n * n
    per_token = cfg.num_layers * ((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim * h
                                  + cfg.num_heads * cfg.head_dim * h + cfg.num_experts * h
                                  + cfg.num_experts_per_tok * expert)
    want = 2 * per_token * n + 2 * h * cfg.vocab_size + attention
    assert prefill_flops(model, n) == pytest.approx(want, rel=1e-9)


@pytest.mark.skipif(not gemm_amx_available(), reason="no AMX-BF16 here")
def test_the_amx_probes_run_what_they_time():
    # the TDPBF16PS loop's accumulator and the tile loads' last tile are checked inside: a loop that did not
    # run (or ran other operands) raises RuntimeError
    tdp = amx_probe.tdp_seconds(rounds=1 << 19, reps=1)
    assert 0 < tdp < 1e-6
    assert 0 < amx_probe.tile_load_seconds(6000, loads=1000, reps=1) < 1e-5
    with pytest.raises(ValueError):
        amx_probe.tdp_seconds(rounds=(1 << 19) + 1)        # 32 x rounds would no longer be exact in float32
    peak = cpu_facts.theoretical_peak({"amx_bf16", "amx_tile"}, 10_000.0, 1)["flops"]
    assert amx_probe.TDP_FLOP / tdp <= peak                  # no faster than 16 cycles at a 10 GHz clock
    # the stream's sum (checked inside) holds every 2 KiB step's tile products; a buffer is read in whole panels
    src = torch.ones(3 * amx_probe.PANEL // 2 + 100, dtype=torch.bfloat16)   # reads the first 3 panels' worth
    for work in amx_probe.TILE_WORK:
        assert amx_probe.stream_bytes_per_s(src, work, reps=1) > 0
    with pytest.raises(ValueError):
        amx_probe.stream_bytes_per_s(src, "tdp")
    with pytest.raises(ValueError):
        amx_probe.stream_bytes_per_s(src[:1000], "vectors")               # under a panel
    with pytest.raises(RuntimeError):                                      # a buffer not of 1.0: its sum is off
        amx_probe.stream_bytes_per_s(torch.full_like(src, 2.0), "beside_32_row_tile_work", reps=1)


@pytest.mark.skipif(gemm_amx_available(), reason="this CPU runs AMX")
def test_the_amx_probes_refuse_without_amx():
    with pytest.raises(KernelUnavailable):
        amx_probe.tdp_seconds()
    with pytest.raises(KernelUnavailable):
        amx_probe.tile_load_seconds(4096)
    with pytest.raises(KernelUnavailable):
        amx_probe.stream_bytes_per_s(torch.ones(1 << 20, dtype=torch.bfloat16), "vectors")


def test_the_gemm_probe_times_the_best_kernel_at_its_shape():
    """bench/decode.py pairs each timed pass with a probe of the best GEMM's rate at that moment."""
    best = gemm_limits.best_by_rows(gemm_limits.gemm_rates([(48, 64)], rows=[3], budget_s=0.01))["3"]
    rate = gemm_limits.gemm_probe(best, budget_s=0.01)()
    assert math.isfinite(rate) and rate > 0
    with pytest.raises(KeyError):
        gemm_limits.gemm_probe({**best, "kernel": "a kernel of another machine"})


def test_the_paired_roofline_takes_each_pass_against_its_own_probe():
    from pdserve.bench.decode import paired_roofline

    passes = [{"step_s": 0.050, "gemm_rate_flops_per_s": 100e9},    # compute floor 40 ms: 0.8
              {"step_s": 0.040, "gemm_rate_flops_per_s": 200e9},    # 20 ms, under the 30 ms memory floor: 0.75
              {"step_s": 0.045, "gemm_rate_flops_per_s": 125e9},    # 32 ms: 0.711
              {"step_s": 0.010, "gemm_rate_flops_per_s": None}]     # not probed: left out
    out = paired_roofline(passes, memory_floor_s=0.030, flops=4e9)
    assert out["roofline_fraction_paired"] == pytest.approx(0.75)
    assert out["gemm_rate_paired_range"] == [100e9, 200e9]
    assert paired_roofline(passes[3:], 0.030, 4e9) == {}


def test_a_faster_probe_raises_the_best_gemm_rate_and_a_slower_one_does_not():
    entry = {"rows": 32, "n": 768, "k": 768, "kernel": "gemm_bf16_fma", "flops_per_s": 100e9, "seconds": 1.0}
    other = {"rows": 1, "n": 768, "k": 768, "kernel": "gemv_bf16", "flops_per_s": 120e9, "seconds": 1.0}
    out = {"gemm": {"best_by_rows": {"32": entry, "1": other}, "best": other}, "best_gemm_flops_per_s": 120e9}
    assert not gemm_limits.raise_gemm_rate(out, 32, 90e9) and gemm_limits.gemm_rate_at(out, 32) is entry
    assert gemm_limits.raise_gemm_rate(out, 30, 110e9)              # the entry gemm_rate_at gives for 30 rows: 32's
    raised = gemm_limits.gemm_rate_at(out, 32)
    assert raised["flops_per_s"] == 110e9 and raised["measured_flops_per_s"] == 100e9
    assert raised["raised_by"] == "gemm_probe" and raised["seconds"] == pytest.approx(2 * 32 * 768 * 768 / 110e9)
    assert out["best_gemm_flops_per_s"] == 120e9 and out["gemm"]["best"] is other   # 1 row's is still faster
    assert gemm_limits.raise_gemm_rate(out, 32, 130e9) and out["best_gemm_flops_per_s"] == 130e9
    assert out["gemm"]["best"]["measured_flops_per_s"] == 100e9 and entry["flops_per_s"] == 100e9   # not mutated
