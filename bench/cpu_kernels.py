"""The CPU decode kernels against the torch operators they replace, one thread, in one run.

1. The projections of one bench-80m decode step (12 layers of qkv, o, gate_up, down; bf16,
   weights in huge pages) at 1..512 activation rows: the packed AVX512-BF16 gemv, the AMX gemm
   on the same packed weights, and ``F.linear`` on the dense weights; at one row also the gemv
   over weights in ordinary 4 KiB pages. The crossovers set
   ``GEMV_MAX_ROWS`` and ``AMX_MAX_ROWS`` in ``model/cpu_linear.py``.
2. Paged attention of one bench-80m layer (12 heads, 4 KV heads, head_dim 64, bf16 cache):
   the C kernel against the torch path, for decode batches and short query blocks.

    python bench/cpu_kernels.py --out docs/results/cpu_kernels
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from pdserve.bench.common import ROOT, median_time, write_result
from pdserve.kernels.cpu.attention import paged_attention_cpu
from pdserve.kernels.cpu.gemv import gemm_amx_available, gemm_bf16_amx, gemv_bf16, pack_weight
from pdserve.kernels.paged_attention import build_attention_metadata, paged_attention_torch
from pdserve.model.hugepages import copies_in_huge_pages, empty_huge

BENCH_80M = [(1280, 768), (768, 768), (4096, 768), (768, 2048)] * 12   # (out, in) of a step's projections


def bench_linears(rows_list: list[int]) -> list[dict]:
    torch.manual_seed(0)
    dense = copies_in_huge_pages([torch.randn(n, k).bfloat16() for n, k in BENCH_80M])
    packed_4k = [pack_weight(w) for w in dense]                        # ordinary 4 KiB pages
    packed = copies_in_huge_pages(packed_4k)
    weight_bytes = sum(w.numel() * 2 for w in dense)
    out = []
    for m in rows_list:
        xs = {k: torch.randn(m, k).bfloat16() for k in {k for _, k in BENCH_80M}}
        row = {"rows": m, "weight_bytes": weight_bytes,
               "gemv_s": median_time(lambda: [gemv_bf16(xs[p.shape[1] * 2], p, w.shape[0])
                                              for w, p in zip(dense, packed)]),
               "f_linear_s": median_time(lambda: [F.linear(xs[w.shape[1]], w) for w in dense])}
        if m == 1:
            row["gemv_4k_pages_s"] = median_time(lambda: [gemv_bf16(xs[p.shape[1] * 2], p, w.shape[0])
                                                          for w, p in zip(dense, packed_4k)])
            print(f"  1 row, weights in 4 KiB pages: gemv {row['gemv_4k_pages_s'] * 1e3:6.1f} ms "
                  f"({weight_bytes / row['gemv_4k_pages_s'] / 1e9:.1f} GB/s)", flush=True)
        if gemm_amx_available():
            row["amx_s"] = median_time(lambda: [gemm_bf16_amx(xs[p.shape[1] * 2], p, w.shape[0])
                                                for w, p in zip(dense, packed)])
        out.append(row)
        print(f"{m:3d} rows: gemv {row['gemv_s'] * 1e3:6.1f} ms, AMX {row.get('amx_s', float('nan')) * 1e3:6.1f} ms, "
              f"F.linear {row['f_linear_s'] * 1e3:6.1f} ms  (gemv streams weights at "
              f"{weight_bytes / row['gemv_s'] / 1e9:.1f} GB/s)", flush=True)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,3,4,8,32,64,96,256,512")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "cpu_kernels"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    result = {"linears": bench_linears([int(r) for r in args.rows.split(",")]),
              "attention": bench_attention([(1, 1), (8, 1), (32, 1), (1, 5), (4, 8), (4, 16)])}
    write_result(result, Path(args.out))


if __name__ == "__main__":
    main()
