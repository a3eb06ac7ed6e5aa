"""What bounds the CPU decode attention kernel (``kernels/cpu/paged_attention.c``): the same decode step's
attention over 12 layers of bench-80m's shape (12 heads, 4 KV heads, head_dim 64; ``--heads`` for another,
e.g. ``8,4,128`` for bench-80m-qwen3; bf16 cache, 16-token blocks) with
its cache in each arrangement below, so that compute and the cache's reads can be told apart. Not run in
CI.

* ``hot``: every sequence's block table names the same blocks and every layer reads layer 0's slice of
  them, so the step's reads hit L1/L2: the kernel's arithmetic and its own overhead alone;
* ``block-major`` (the layout the engine and the KV transfer use, ``[blocks, layers, 2, block, kv_heads,
  head_dim]``: a layer's 16 KiB of a block lies 192 KiB from the same layer's 16 KiB of the next block)
  and ``layer-major`` (vLLM's, a tensor per layer: a layer's slices of consecutive blocks side by side),
  each with block tables shuffled (a cache that has served a while) and in order (each sequence's blocks
  consecutive), the L3 evicted before each step.
* block-major with a block's K and V parts read as ``[kv heads, block, head_dim]`` (each KV head's rows side
  by side), shuffled, L3 evicted;
* one layer alone, shuffled, with the L3 evicted and with that layer's pages read into the L3 just before.

Both layouts are the same kernel given other strides. Prints ms per step (median of ``--reps``) and ns and
cycles (at the clock ``bench.cpu_facts`` reports) per (token, KV head).

    taskset -c 1 .venv/bin/python bench/attention_bounds.py
    taskset -c 1 .venv/bin/python bench/attention_bounds.py --rev f14dcf9 --cases 32x140,1x140
    taskset -c 1 .venv/bin/python bench/attention_bounds.py --heads 8,4,128 --cases 32x140
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pdserve.bench.cpu_facts import cpu_facts
from pdserve.bench.cpu_kernels import l3_evictor
from pdserve.bench.kernel_ab import BLOCK, DIM, HEADS, KV_HEADS, build
from pdserve.kernels.paged_attention import build_attention_metadata
from pdserve.model.hugepages import empty_huge

LAYERS = 12


def step_seconds(fn, cache: torch.Tensor, meta, q: torch.Tensor, s_block: int, s_layer: int | None,
                 reps: int, kv_heads: int, before=lambda: None, layers: range = range(LAYERS),
                 heads_apart: bool = False) -> float:
    """Median seconds of one step's attention over ``layers`` for ``q`` ``[batch, heads, head_dim]`` float32
    over ``kv_heads`` KV heads; ``s_layer`` elements between layers' slices (None: every layer reads layer 0's);
    strides in elements. ``heads_apart``: a block's K (and V) part read as ``[kv heads, block, head_dim]``, each
    KV head's rows side by side, instead of the cache's ``[block, kv heads, head_dim]``."""
    (batch, heads, dim), out = q.shape, torch.empty_like(q)
    s_tok, s_head, s_v = kv_heads * dim, dim, BLOCK * kv_heads * dim
    if heads_apart:
        s_tok, s_head = dim, BLOCK * dim
    times = []
    for _ in range(reps):
        before()
        start = time.perf_counter()
        for layer in layers:
            base = cache.data_ptr() + (layer * s_layer * 2 if s_layer is not None else 0)
            fn(q.data_ptr(), out.data_ptr(), heads, kv_heads, dim, meta.query_start_loc.data_ptr(),
               meta.seq_lens.data_ptr(), batch, base, 1, s_block, s_tok, s_head, s_v,
               meta.block_tables.data_ptr(), meta.block_tables.shape[1], BLOCK, dim ** -0.5)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bounds(fn, batch: int, context: int, reps: int, heads: tuple[int, int, int] = (HEADS, KV_HEADS, DIM)
           ) -> dict[str, tuple[float, int]]:
    """Seconds per step and the layers it covers, of every arrangement for ``batch`` decode rows at
    ``context + 1`` tokens, ``heads`` = (query heads, KV heads, head_dim). The last two time one layer (layer
    5) over a cold cache and with its pages read into the L3 just before: whether the kernel takes its lines
    from the L3 faster than from DRAM."""
    nh, nkv, dim = heads
    nb = -(-(context + 1) // BLOCK)
    blocks, page = batch * nb, 2 * BLOCK * nkv * dim                 # page: one layer's slice of a block
    cache = empty_huge(blocks * LAYERS * page, torch.bfloat16).normal_()
    perm = torch.randperm(blocks, generator=torch.Generator().manual_seed(0)).tolist()
    tables = {"shuffled": [perm[i * nb:(i + 1) * nb] for i in range(batch)],
              "in order": [list(range(i * nb, (i + 1) * nb)) for i in range(batch)],
              "hot": [list(range(nb))] * batch}
    metas = {k: build_attention_metadata([1] * batch, [context + 1] * batch, t, BLOCK) for k, t in tables.items()}
    q, evict = torch.randn(batch, nh, dim), l3_evictor()
    out = {"hot (L1/L2)": (step_seconds(fn, cache, metas["hot"], q, LAYERS * page, None, reps, nkv), LAYERS)}
    strides = {"block-major": (LAYERS * page, page), "layer-major": (page, blocks * page)}   # s_block, s_layer
    for layout, (s_block, s_layer) in strides.items():
        for order in ("shuffled", "in order"):
            out[f"{layout}, {order}, L3 evicted"] = (step_seconds(fn, cache, metas[order], q, s_block, s_layer,
                                                                 reps, nkv, evict), LAYERS)
    out["block-major, shuffled, KV heads' rows side by side in a block, L3 evicted"] = (step_seconds(
        fn, cache, metas["shuffled"], q, LAYERS * page, page, reps, nkv, evict, heads_apart=True), LAYERS)
    pages = [cache.view(blocks, LAYERS, page)[b, 5] for b in sorted(sum(tables["shuffled"], []))]

    def into_l3() -> None:
        evict()
        for p in pages:     # layer 5's pages read in place, page by page: no copy of them written beside
            p.sum()
    for name, before in (("L3 evicted", evict), ("its pages read into the L3 first", into_l3)):
        out[f"block-major, shuffled, one layer, {name}"] = (step_seconds(
            fn, cache, metas["shuffled"], q, LAYERS * page, page, reps, nkv, before, range(5, 6)), 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", default=None, help="git revision of kernels/cpu to build (default: the working tree)")
    ap.add_argument("--cases", default="32x140,4x512,1x140", help="batch x context, comma-separated")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--heads", default=f"{HEADS},{KV_HEADS},{DIM}",
                    help="query heads, KV heads, head size, e.g. 8,4,128 for bench-80m-qwen3")
    args = ap.parse_args()
    heads = tuple(int(v) for v in args.heads.split(","))
    torch.set_num_threads(1)
    facts = cpu_facts()
    print(f"CPU: {facts['model_name']} (family {facts['family']}, model {facts['model']}), "
          f"{facts['clock_mhz']:.0f} MHz ({facts['clock_source']}); paged_attention at {args.rev or 'working tree'}")
    with tempfile.TemporaryDirectory() as tmp:
        fn = build("paged_attention", args.rev, Path(tmp))
        for case in args.cases.split(","):
            batch, context = (int(v) for v in case.split("x"))
            for name, (seconds, layers) in bounds(fn, batch, context, args.reps, heads).items():
                pairs = batch * (context + 1) * layers * heads[1]           # (token, KV head) pairs read
                ns = seconds / pairs * 1e9
                print(f"{batch} x {context + 1}, {name}: {seconds * 1e3:.3f} ms, {ns:.2f} ns = "
                      f"{ns * facts['clock_mhz'] / 1e3:.1f} cycles per (token, KV head)", flush=True)


if __name__ == "__main__":
    main()
