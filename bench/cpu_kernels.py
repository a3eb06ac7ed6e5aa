"""The CPU decode kernels against the torch operators they replace, one thread, in one run.

1. The projections of one bench-80m decode step (12 layers of qkv, o, gate_up, down; bf16,
   weights in huge pages) at 1..512 activation rows: the packed AVX512-BF16 gemv, the
   register-blocked AVX512-BF16 gemm, the float32-FMA gemm and (where present) the AMX gemm on the
   same packed weights (each where this CPU runs it), and ``F.linear`` on the dense weights; at one
   row also the one-row kernel over weights in ordinary 4 KiB pages. Each is set against its floor,
   max(FLOPs / the best GEMM rate, weight bytes / read bandwidth): the GEMM rate is the best of the
   packed gemms and ``F.linear`` on a bench-80m shape whose weight stays in L2. The crossovers set
   the row thresholds in ``model/cpu_linear.py``.
2. Paged attention of one bench-80m layer (12 heads, 4 KV heads, head_dim 64, bf16 cache):
   the C kernel against the torch path, for decode batches and short query blocks.
3. Prefill attention of one such layer over a whole 512- and 2,048-token prompt: torch's fresh-prefill
   path against the C prefill kernel (its AVX512-BF16 or FMA build).
4. A decode step's attention over all 12 layers of a scattered KV cache evicted from the L3 before
   the step (wall time): how the decode kernel meets DRAM.
5. The elementwise work of one bench-80m layer at a prefill chunk's 512 bf16 rows: the residual add
   and RMSNorm, RoPE with the KV cache write, SiLU-and-mul, each as the model's torch code and as the
   fused C kernel (:mod:`kernels.cpu.fused`, where it runs on AVX-512).

Times are medians of the calling thread's CPU time (``time.thread_time``), so that time spent
descheduled on a shared machine is not counted; pin the run (``taskset -c 1``).

    taskset -c 1 python bench/cpu_kernels.py --out docs/results/cpu_kernels
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from pdserve.bench.common import ROOT, memory_bandwidth, write_result
from pdserve.bench.common import median_time as common_median_time
from pdserve.bench.cpu_facts import cpu_facts
from pdserve.kernels.cpu import available
from pdserve.kernels.cpu.attention import (
    paged_attention_cpu,
    prefill_attention_available,
    prefill_attention_cpu,
    prefill_library,
)
from pdserve.kernels.cpu.gemv import (
    gemm_amx_available,
    gemm_bf16_amx,
    gemm_bf16_avx2,
    gemm_bf16_avx512,
    gemm_bf16_fma,
    gemv_available,
    gemv_bf16,
    pack_weight,
)
from pdserve.kernels.paged_attention import AttentionMetadata, build_attention_metadata, paged_attention_torch
from pdserve.model.hugepages import copies_in_huge_pages, empty_huge

BENCH_80M = [(1280, 768), (768, 768), (4096, 768), (768, 2048)] * 12   # (out, in) of a step's projections


def median_time(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    """Median CPU time of the calling thread over ``repeats`` calls of ``fn()``, in seconds."""
    return common_median_time(fn, repeats, warmup, clock=time.thread_time)


def packed_kernels() -> dict[str, Callable]:
    """The packed bf16 kernels that run here, by result key: the gemv and the AVX512-BF16 gemm where the
    CPU has AVX512-BF16, AMX tiles where granted, the float32-FMA gemm on any AVX-512 CPU, its AVX2 form on
    any AVX2 CPU."""
    kernels = {"gemv_s": gemv_bf16, "gemm_s": gemm_bf16_avx512} if gemv_available() else {}
    if gemm_amx_available():
        kernels["amx_s"] = gemm_bf16_amx
    if available("gemm_bf16_fma"):
        kernels["fma_s"] = gemm_bf16_fma
    if available("gemm_bf16_avx2"):
        kernels["avx2_s"] = gemm_bf16_avx2
    return kernels


def gemm_peak(rows: int = 64) -> float:
    """FLOP/s: the best of the packed gemms and ``F.linear`` on bench-80m's o_proj shape (768 x 768,
    1.2 MB: in L2), ``rows`` rows, best of 20 calls (the machine's compute speed of light for these kernels)."""
    w, x = torch.randn(768, 768).bfloat16(), torch.randn(rows, 768).bfloat16()
    packed = pack_weight(w)
    fns = [lambda fn=fn: fn(x, packed, 768) for key, fn in packed_kernels().items() if key != "gemv_s"]
    best = min(median_time(fn, repeats=20) for fn in fns + [lambda: F.linear(x, w)])
    return 2 * rows * 768 * 768 / best


def bench_linears(rows_list: list[int]) -> list[dict]:
    torch.manual_seed(0)
    dense = copies_in_huge_pages([torch.randn(n, k).bfloat16() for n, k in BENCH_80M])
    packed_4k = [pack_weight(w) for w in dense]                        # ordinary 4 KiB pages
    packed = copies_in_huge_pages(packed_4k)
    weight_bytes = sum(w.numel() * 2 for w in dense)
    peak = gemm_peak()
    kernels = packed_kernels()
    one_row = next(iter(kernels.values()), None)           # the gemv, else the FMA gemm
    out = []
    for m in rows_list:
        xs = {k: torch.randn(m, k).bfloat16() for k in {k for _, k in BENCH_80M}}
        row = {"rows": m, "weight_bytes": weight_bytes}
        for key, fn in kernels.items():
            if key == "gemv_s" and m > 64:                 # re-reads each weight block per 4 rows
                continue
            row[key] = median_time(lambda: [fn(xs[p.shape[1] * 2], p, w.shape[0]) for w, p in zip(dense, packed)])
        row["f_linear_s"] = median_time(lambda: [F.linear(xs[w.shape[1]], w) for w in dense])
        if m == 1 and one_row is not None:
            row["one_row_4k_pages_s"] = median_time(lambda: [one_row(xs[p.shape[1] * 2], p, w.shape[0])
                                                             for w, p in zip(dense, packed_4k)])
        out.append(row)
        print(f"{m:3d} rows: " + ", ".join(f"{k[:-2]} {v * 1e3:7.1f} ms" for k, v in row.items() if k.endswith("_s")),
              flush=True)
    # floor: FLOPs at the GEMM peak (the best rate seen, the table's included), or the weight bytes at the
    # best of torch's read and the kernels' own stream
    fastest_small = min((v for r in out if r["rows"] <= 2 for k, v in r.items() if k.endswith("_s")), default=None)
    bandwidth = max(memory_bandwidth(), weight_bytes / fastest_small if fastest_small else 0.0)
    peak = max([peak] + [r["rows"] * weight_bytes / v for r in out for k, v in r.items() if k.endswith("_s")])
    print(f"GEMM peak {peak / 1e9:.1f} GFLOP/s, weight stream {bandwidth / 1e9:.1f} GB/s; floor reached:")
    for row in out:
        floor = max(row["rows"] * weight_bytes / peak, weight_bytes / bandwidth)     # 2 FLOPs per weight per row
        row.update(gemm_peak_flops=peak, bandwidth=bandwidth, floor_s=floor)
        print(f"{row['rows']:3d} rows, floor {floor * 1e3:7.1f} ms: " + ", ".join(
            f"{k[:-2]} {floor / row[k]:4.0%}" for k in ("gemv_s", "gemm_s", "amx_s", "fma_s", "avx2_s", "f_linear_s")
            if k in row))
    return out


def bench_attention(cases: list[tuple[int, int]], context: int = 150) -> list[dict]:
    heads, kv_heads, dim, bs, layers = 12, 4, 64, 16, 12
    out = []
    for batch, q_len in cases:
        blocks_per_seq = -(-(context + q_len) // bs)
        cache = empty_huge(batch * blocks_per_seq * layers * 2 * bs * kv_heads * dim, torch.bfloat16)
        cache = cache.normal_().view(batch * blocks_per_seq, layers, 2, bs, kv_heads, dim)
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
        meta = build_attention_metadata([q_len] * batch, [context + q_len] * batch, tables, bs)
        q = torch.randn(batch * q_len, heads, dim).bfloat16()
        row = {"batch": batch, "query_len": q_len, "context": context,
               "torch_s": median_time(lambda: paged_attention_torch(q, None, None, cache, 3, meta, 0.125)),
               "c_s": median_time(lambda: paged_attention_cpu(q, cache, 3, meta.query_start_loc, meta.seq_lens,
                                                              meta.block_tables, 0.125))}
        out.append(row)
        print(f"attention batch {batch:2d} x {q_len:2d} new tokens, {context} context: torch "
              f"{row['torch_s'] * 1e6:7.0f} us, C {row['c_s'] * 1e6:7.0f} us", flush=True)
    return out


def bench_prefill_attention(lengths: list[int]) -> list[dict]:
    """One bench-80m layer's causal attention over a whole prompt of each length: torch's path for a
    fresh prefill (SDPA on the step's own K/V, what a worker runs without the C kernel) against the C
    prefill kernel build this CPU runs (:func:`kernels.cpu.attention.prefill_library`)."""
    heads, kv_heads, dim, bs = 12, 4, 64, 16
    out = []
    for n in lengths:
        blocks = -(-n // bs)
        cache = torch.randn(blocks, 1, 2, bs, kv_heads, dim).bfloat16()
        meta = build_attention_metadata([n], [n], [list(range(blocks))], bs)
        q = torch.randn(n, heads, dim).bfloat16()
        k, v = (cache[:, 0, i].reshape(-1, kv_heads, dim)[:n] for i in (0, 1))
        row = {"tokens": n, "kernel": prefill_library(dim) if prefill_attention_available(dim) else None,
               "flops": 4 * n * (n + 1) / 2 * dim * heads,
               "torch_s": median_time(lambda: paged_attention_torch(q, k, v, cache, 0, meta, 0.125), repeats=3)}
        if row["kernel"]:
            row["c_s"] = median_time(lambda: prefill_attention_cpu(q, cache, 0, meta.query_start_loc, meta.seq_lens,
                                                                   meta.block_tables, 0.125), repeats=3)
        out.append(row)
        print(f"prefill attention, {n} tokens: torch {row['torch_s'] * 1e3:7.1f} ms "
              f"({row['flops'] / row['torch_s'] / 1e9:.0f} GFLOP/s)" + (
                  f", C ({row['kernel']}) {row['c_s'] * 1e3:7.1f} ms ({row['flops'] / row['c_s'] / 1e9:.0f} GFLOP/s)"
                  if "c_s" in row else ""), flush=True)
    return out


def bench_prefill_elementwise(rows: int = 512) -> list[dict]:
    """One bench-80m layer's elementwise operations over ``rows`` bf16 rows: the torch code of
    :mod:`model.llama` / :mod:`model.rope` against :mod:`kernels.cpu.fused` (skipped where it is not
    built for AVX-512: there the model keeps the torch code at these sizes)."""
    from pdserve.kernels.cpu import fused
    from pdserve.kernels.paged_attention import write_kv
    from pdserve.model.rope import apply_rotary
    if not fused.vectorized():
        return []
    heads, kv_heads, dim, hidden, inter = 12, 4, 64, 768, 2048
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(rows, hidden, generator=g).bfloat16() for _ in range(2))
    w = torch.randn(hidden, generator=g).bfloat16()
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g).bfloat16()
    gate_up = torch.randn(rows, 2 * inter, generator=g).bfloat16()
    cache = torch.zeros(rows // 16 + 1, 1, 2, 16, kv_heads, dim, dtype=torch.bfloat16)
    slots = torch.arange(rows)
    freqs = slots[:, None].float() / 10000 ** (torch.arange(0, dim, 2).float() / dim)
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]

    def torch_norm():
        s = x + r
        sf = s.float()
        return w * (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16(), s

    def torch_rope():
        q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
        k = apply_rotary(k.reshape(rows, kv_heads, dim), cos, sin)
        write_kv(cache, 0, k, v.reshape(rows, kv_heads, dim), slots)
        return apply_rotary(q.reshape(rows, heads, dim), cos, sin)

    cases = {"add_rms_norm": (torch_norm, lambda: fused.add_rms_norm(x, r, w, 1e-5)),
             "rope_write_kv": (torch_rope, lambda: fused.rope_write_kv(qkv, cos, sin, cache, 0, slots, heads, kv_heads,
                                                                       dim, q_dtype=torch.bfloat16)),
             "silu_and_mul": (lambda: F.silu(gate_up[:, :inter]) * gate_up[:, inter:],
                              lambda: fused.silu_and_mul(gate_up))}
    out = []
    for name, (torch_fn, c_fn) in cases.items():
        row = {"op": name, "rows": rows, "torch_s": median_time(torch_fn, repeats=21),
               "c_s": median_time(c_fn, repeats=21)}
        out.append(row)
        print(f"{name:14s} {rows} rows: torch {row['torch_s'] * 1e6:6.0f} us, C {row['c_s'] * 1e6:6.0f} us", flush=True)
    return out


def l3_evictor() -> Callable[[], None]:
    """A call that evicts the L3 (writes a buffer 1.5x its size; 256 MiB where its size is unknown)."""
    evict = torch.empty(int(cpu_facts()["l3_bytes"] * 1.5) // 4 or 2 ** 26)
    return lambda: evict.add_(1.0)


def scattered_decode_cache(batch: int, context: int, layers: int, kv_heads: int = 4, dim: int = 64,
                           block: int = 16) -> tuple[torch.Tensor, AttentionMetadata]:
    """A bf16 KV cache ``[blocks, layers, 2, block, kv_heads, dim]`` in huge pages, random, and the metadata
    of one decode row per sequence at ``context + 1`` tokens, each sequence's blocks taken from a shuffled
    list (a cache that has served a while scatters them so)."""
    nb = -(-(context + 1) // block)
    cache = empty_huge(batch * nb * layers * 2 * block * kv_heads * dim, torch.bfloat16)
    cache = cache.normal_().view(batch * nb, layers, 2, block, kv_heads, dim)
    perm = torch.randperm(batch * nb, generator=torch.Generator().manual_seed(0)).tolist()
    meta = build_attention_metadata([1] * batch, [context + 1] * batch,
                                    [perm[i * nb:(i + 1) * nb] for i in range(batch)], block)
    return cache, meta


def bench_cold_attention(cases: list[tuple[int, int]], layers: int = 12) -> list[dict]:
    """A decode step's attention over all ``layers`` of a KV cache in huge pages, each sequence's blocks
    scattered (a shuffled block table) and the L3 evicted before the step by writing 1.5x its size:
    seconds per step (median of 7), and the same step run again at once (warm)."""
    evict = l3_evictor()
    out = []
    for batch, context in cases:
        cache, meta = scattered_decode_cache(batch, context, layers)
        q = torch.randn(batch, 12, 64).bfloat16()

        def step() -> None:
            for layer in range(layers):
                paged_attention_cpu(q, cache, layer, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.125)
        cold, warm = [], []
        for _ in range(7):
            evict()
            t = time.perf_counter()
            step()
            cold.append(time.perf_counter() - t)
            t = time.perf_counter()
            step()
            warm.append(time.perf_counter() - t)
        row = {"batch": batch, "context": context, "layers": layers, "kv_bytes": cache.numel() * 2,
               "cold_s": statistics.median(cold), "warm_s": statistics.median(warm)}
        out.append(row)
        print(f"decode attention, {layers} layers, batch {batch} x {context} tokens, L3 evicted: "
              f"{row['cold_s'] * 1e3:.2f} ms (again at once: {row['warm_s'] * 1e3:.2f} ms)", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,3,4,8,16,32,64,128,256,512")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "cpu_kernels"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    result = {"linears": bench_linears([int(r) for r in args.rows.split(",")]),
              "attention": bench_attention([(1, 1), (8, 1), (32, 1), (1, 5), (4, 8), (4, 16)]),
              "prefill_attention": bench_prefill_attention([512, 2048]),
              "cold_attention": bench_cold_attention([(32, 140), (32, 1024), (4, 512), (4, 140)]),
              "prefill_elementwise": bench_prefill_elementwise()}
    write_result(result, Path(args.out))


if __name__ == "__main__":
    main()
