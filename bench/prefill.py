"""Prefill at the compute limit: MFU, chunking, prefix cache, and hidden KV transfer.

One run, on this machine, prints and records:
  1. the machine's limits (bench/limits.py: best bf16 GEMM rate over the model's shapes and the
     project's kernels at each chunk's row count, the ISA's paper peak, C-measured bandwidth, CPU
     facts) and prefill tokens/s with the MFU it implies against the best measured rate at that
     row count (paper peak beside it), for prompts of 128..4096 tokens, in process, chunked as
     the worker chunks, with the kernel path each linear kind and attention took;
  2. TTFT of a 2,048-token prompt through the cluster with and without chunking while
     8 other requests decode;
  3. TTFT of a 2,048-token prompt whose first 90% is cached, against a cold one;
  4. the transfer's tail (last chunk computed -> decode worker's acknowledgement)
     against the transfer's own duration;
  5. FP8 first-token accuracy on the real model (bench/fp8_accuracy.py).

    python bench/prefill.py --out docs/results/prefill          # makes bench-80m if needed
    python bench/prefill.py --model .bench-models/bench-9m --lengths 128,512 --mfu-only \
        --out /tmp/prefill-quick                                  # a quick check of the MFU part
    python bench/prefill.py --mfu-only --lengths 2048 --profile 2048 --out /tmp/p   # where the time goes
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from pathlib import Path

import grpc
import torch

from pdserve.bench.common import ROOT, LocalCluster, median_time, timed_stream, write_result
from pdserve.bench.decode import expert_shares
from pdserve.bench.gemm_limits import gemm_rate_at
from pdserve.bench.limits import ROWS, kernel_paths, linear_shapes, measure_limits, summary
from pdserve.cluster.args import default_redis_url
from pdserve.deploy import client
from pdserve.deploy.make_model import make_model
from pdserve.deploy.redis_server import ensure_redis
from pdserve.model.kv_cache import KVCacheSpec
from pdserve.model.loader import load_model
from pdserve.model.runner import ModelRunner, StepInput
from pdserve.model.sampling import SamplingParams
from pdserve.prefill_worker.server import load_prefill_model
from pdserve.proto import worker_pb2, worker_pb2_grpc
from pdserve.proto.convert import sampling_to_wire


def prompt(n: int, seed: int, vocab: int = 2048) -> list[int]:
    return [1] + torch.randint(3, vocab, (n - 1,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill_flops(model, num_tokens: int) -> float:
    """Matmul FLOPs of one prefill: 2 x (linear weights) per token + causal attention (QK^T and PV); a mixture's
    experts count ``top_k / experts`` of theirs (each token runs ``top_k``; :func:`bench.decode.expert_shares`)."""
    cfg = model.cfg
    share = expert_shares(model, 1)
    linear = sum(share.get(id(m), 1.0) * m.in_features * m.out_features for n, m in model.named_modules()
                 if n.startswith("layers") and hasattr(m, "in_features") and hasattr(m, "out_features"))
    linear += cfg.hidden_size * cfg.vocab_size / num_tokens  # logits only for the last token of each chunk
    attention = 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * num_tokens * num_tokens / 2
    return 2 * linear * num_tokens + attention


_LIMITS: dict[tuple, dict] = {}     # (model_dir, rows, threads) -> limits, once per process (bench/peers.py asks again)


def bench_mfu(model_dir: str, lengths: list[int], chunk: int, threads: int, limits: dict | None = None) -> dict:
    """Prefill seconds and MFU per prompt length, chunked by ``chunk`` tokens. MFU is against the best
    bf16 GEMM rate measured at the chunk's row count (``limits``: :func:`bench.limits.measure_limits`;
    if not given, measured here once per process over the model's shapes at those row counts), with
    the paper peak's fraction beside it."""
    torch.set_num_threads(threads)
    model, cfg = load_prefill_model(model_dir, torch.bfloat16, chunk_tokens=chunk)   # as the prefill worker loads it
    if limits is None:
        key = (model_dir, tuple(sorted({min(n, chunk) for n in lengths})), threads)
        if key not in _LIMITS:
            _LIMITS[key] = measure_limits(linear_shapes(model), key[1], threads=threads)
            print(summary(_LIMITS[key]), flush=True)
        limits = _LIMITS[key]
    runner = ModelRunner(model, KVCacheSpec.for_model(cfg, max(lengths) // 16 + 2, 16, torch.bfloat16))
    paper = limits["theoretical_peak"]["flops"]
    amx_unit = (limits.get("amx") or {}).get("tdp_flops_per_s")    # the tile unit's measured rate, AMX CPUs only
    out_rows = []
    for n in lengths:
        ids, table = prompt(n, n), list(range(n // 16 + 1))

        def run() -> None:
            for start in range(0, n, chunk):
                runner.run([StepInput(ids[start:start + chunk], start, table)])

        seconds = median_time(run, repeats=3)
        flops = prefill_flops(model, n)
        achieved = flops / seconds
        gemm = gemm_rate_at(limits, min(n, chunk))
        out_rows.append({"prompt_tokens": n, "seconds": seconds, "tokens_per_s": n / seconds,
                         "mfu": achieved / gemm["flops_per_s"], "gemm_rate_flops_per_s": gemm["flops_per_s"],
                         "gemm_rate_rows": gemm["rows"], "gemm_rate_kernel": gemm["kernel"],
                         "mfu_theoretical": achieved / paper, "compute_floor_s": flops / gemm["flops_per_s"],
                         "mfu_amx_unit": achieved / amx_unit if amx_unit else None,
                         "kernels": kernel_paths(model, min(n, chunk), min(n, chunk))})
    return {"bf16_matmul_peak_flops": limits["best_gemm_flops_per_s"], "theoretical_peak_flops": paper,
            "amx_unit_flops": amx_unit, "threads": threads, "chunk_tokens": chunk, "rows": out_rows}


def profile_prefill(model_dir: str, n: int, chunk: int, threads: int, repeats: int = 3, top: int = 8) -> list[dict]:
    """Where one ``n``-token prefill's time goes, by function (``cProfile``'s own time, so each operation's
    kernel shows under its Python entry: oneDNN's projections, the C attention, the fused elementwise
    kernels): the ``top`` slowest, seconds per prefill averaged over ``repeats`` after a warm-up one."""
    import cProfile
    import pstats

    torch.set_num_threads(threads)
    model, cfg = load_prefill_model(model_dir, torch.bfloat16, chunk_tokens=chunk)
    runner = ModelRunner(model, KVCacheSpec.for_model(cfg, n // 16 + 2, 16, torch.bfloat16))
    ids, table = prompt(n, n), list(range(n // 16 + 1))

    def run() -> None:
        for start in range(0, n, chunk):
            runner.run([StepInput(ids[start:start + chunk], start, table)])

    run()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(repeats):
        run()
    prof.disable()
    stats = pstats.Stats(prof).stats      # (file, line, name) -> (calls, primitive calls, own s, cumulative s, ..)
    rows = sorted(((f"{Path(k[0]).name}:{k[2]}", v[2] / repeats) for k, v in stats.items()), key=lambda r: -r[1])
    total = sum(t for _, t in rows)
    return [{"function": f, "seconds": t, "share": t / total} for f, t in rows[:top]]


async def _ttft(address: str, ids: list[int]) -> tuple[float, int]:
    async with grpc.aio.insecure_channel(address) as ch:
        ttft, _, _, final = await timed_stream(ch, client.make_request(ids, max_tokens=1, temperature=0))
        return ttft, final.usage.cached_prompt_tokens


def bench_prefix_cache(model_dir: str, redis_url: str, n: int, shared: float, repeats: int) -> dict:
    c = LocalCluster(model_dir, redis_url, common={"dtype": "bfloat16", "num_blocks": 2048})
    try:
        asyncio.run(_ttft(c.address, prompt(256, 999)))  # warm-up
        cold, warm, cached = [], [], []
        for r in range(repeats):
            base = prompt(n, 1000 + r)
            cold.append(asyncio.run(_ttft(c.address, base))[0])
            keep = int(n * shared)
            hit = base[:keep] + prompt(n - keep + 1, 5000 + r)[1:]
            t, k = asyncio.run(_ttft(c.address, hit))
            warm.append(t)
            cached.append(k)
        return {"prompt_tokens": n, "shared_fraction": shared, "cold_ttft_s": statistics.median(cold),
                "hit_ttft_s": statistics.median(warm), "cached_tokens": cached,
                "hit_over_cold": statistics.median(warm) / statistics.median(cold)}
    finally:
        c.stop()


def bench_overlap(model_dir: str, redis_url: str, n: int, repeats: int) -> dict:
    """Direct worker calls, so the prefill worker's own timings are visible."""
    c = LocalCluster(model_dir, redis_url, common={"dtype": "bfloat16", "num_blocks": 2048})
    try:
        async def run(i: int) -> worker_pb2.PrefillResponse:
            async with grpc.aio.insecure_channel(c.address) as rch:
                workers = {w.role: w for w in (await client.cluster_state(rch)).workers}
            ids = prompt(n, 7000 + i)
            sampling = sampling_to_wire(SamplingParams(temperature=0, max_tokens=1))
            rid = f"overlap-{i}"
            async with grpc.aio.insecure_channel(workers["decode"].address) as dch, \
                    grpc.aio.insecure_channel(workers["prefill"].address) as pch:
                stream = worker_pb2_grpc.DecodeWorkerStub(dch).Generate(worker_pb2.DecodeRequest(
                    request_id=rid, prompt_token_ids=ids, sampling=sampling, kv_timeout_s=120))
                allocated = (await stream.read()).allocated
                answer = await worker_pb2_grpc.PrefillWorkerStub(pch).Prefill(worker_pb2.PrefillRequest(
                    request_id=rid, token_ids=ids, sampling=sampling, dst_kv_address=allocated.kv_address,
                    dst_block_ids=allocated.block_ids), timeout=600)
                while await stream.read() is not grpc.aio.EOF:
                    pass
                return answer

        answers = [asyncio.run(run(i)) for i in range(repeats)]
        tails = [a.transfer_tail_s for a in answers]
        totals = [a.transfer_s for a in answers]
        return {"prompt_tokens": n, "transfer_s": statistics.median(totals), "tail_s": statistics.median(tails),
                "tail_over_transfer": statistics.median(t / s for t, s in zip(tails, totals)),
                "prefill_s": statistics.median(a.prefill_s for a in answers),
                "kv_bytes": answers[0].num_kv_bytes}
    finally:
        c.stop()


def bench_chunking(model_dir: str, redis_url: str, n: int, budgets: list[int], num_decoding: int) -> dict:
    out = {}
    for budget in budgets:
        c = LocalCluster(model_dir, redis_url, prefill={"max_num_batched_tokens": budget},
                         common={"dtype": "bfloat16", "num_blocks": 4096})

        async def run() -> float:
            async with grpc.aio.insecure_channel(c.address) as ch:
                requests = [client.make_request(prompt(64, 300 + i), max_tokens=4000, temperature=0, ignore_eos=True)
                            for i in range(num_decoding)]
                background = [asyncio.create_task(client.complete(ch, r)) for r in requests]
                await asyncio.sleep(3.0)  # let them reach the decode worker
                ttft, *_ = await timed_stream(ch, client.make_request(prompt(n, 4242), max_tokens=1, temperature=0))
                for t in background:
                    t.cancel()
                await asyncio.gather(*background, return_exceptions=True)
                return ttft

        try:
            out[str(budget)] = asyncio.run(run())
        finally:
            c.stop()
    return {"prompt_tokens": n, "num_decoding": num_decoding, "ttft_s_by_budget": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / ".bench-models" / "bench-80m"))
    ap.add_argument("--lengths", default="128,256,512,1024,2048,4096")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the in-process MFU run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mfu-only", action="store_true", help="only part 1 (no cluster, no FP8 accuracy)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also profile an N-token prefill by function (profile_prefill) after part 1")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "prefill"))
    args = ap.parse_args()
    if not Path(args.model, "config.json").exists():
        make_model("bench-80m", args.model)
    lengths = [int(x) for x in args.lengths.split(",")]
    torch.set_num_threads(args.threads)
    shapes = linear_shapes(load_model(args.model, torch.bfloat16)[0])
    limits = measure_limits(shapes, sorted(set(ROWS) | {min(n, args.chunk) for n in lengths}), threads=args.threads)
    print(summary(limits), flush=True)
    result = {"model": args.model, "limits": limits}
    result["mfu"] = bench_mfu(args.model, lengths, args.chunk, args.threads, limits)
    _print_mfu(result["mfu"])
    if args.profile:
        result["profile"] = profile_prefill(args.model, args.profile, args.chunk, args.threads)
        for r in result["profile"]:
            print(f"{r['function']:>48s} {r['seconds'] * 1e3:8.1f} ms a prefill {r['share']:6.1%}")
    if args.mfu_only:
        write_result(result, Path(args.out))
        return
    redis_url = default_redis_url()
    redis_proc = ensure_redis(redis_url)
    try:
        result["prefix_cache"] = bench_prefix_cache(args.model, redis_url, 2048, 0.9, args.repeats)
        print("prefix cache:", result["prefix_cache"])
        result["overlap"] = bench_overlap(args.model, redis_url, 2048, args.repeats)
        print("transfer overlap:", result["overlap"])
        result["chunking"] = bench_chunking(args.model, redis_url, 2048, [args.chunk, 8192], 8)
        print("chunking:", result["chunking"])
        from fp8_accuracy import build_prompts, measure_first_token_agreement
        result["fp8"] = measure_first_token_agreement(str(ROOT / "assets/models/tinystories-656k"), build_prompts())
        print("fp8:", {k: v for k, v in result["fp8"].items() if not isinstance(v, list)})
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
    out = Path(args.out)
    write_result(result, out)
    _plot(result, out.with_suffix(".png"))


def _print_mfu(mfu: dict) -> None:
    print(f"best measured bf16 GEMM: {mfu['bf16_matmul_peak_flops'] / 1e9:.0f} GFLOP/s, paper peak "
          f"{mfu['theoretical_peak_flops'] / 1e9:.0f} GFLOP/s ({mfu['threads']} thread(s))"
          + (f", AMX tile unit measured {mfu['amx_unit_flops'] / 1e9:.0f} GFLOP/s a core" if mfu.get("amx_unit_flops")
             else ""))
    print(f"{'prompt':>8s} {'seconds':>9s} {'tokens/s':>10s} {'MFU':>6s} {'of rate (GFLOP/s, rows, kernel)':>36s} "
          f"{'paper':>6s}  kernels")
    for r in mfu["rows"]:
        rate = f"{r['gemm_rate_flops_per_s'] / 1e9:.0f}, {r['gemm_rate_rows']}, {r['gemm_rate_kernel']}"
        kernels = ", ".join(f"{k}={v}" for k, v in r["kernels"].items())
        unit = f" ({r['mfu_amx_unit']:.1%} of the tile unit)" if r.get("mfu_amx_unit") else ""
        print(f"{r['prompt_tokens']:8d} {r['seconds']:9.3f} {r['tokens_per_s']:10.0f} {r['mfu']:6.1%} {rate:>36s} "
              f"{r['mfu_theoretical']:6.1%}{unit}  {kernels}")


def _plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["mfu"]["rows"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    a.plot([r["prompt_tokens"] for r in rows], [100 * r["mfu"] for r in rows], "o-")
    a.axhline(50, color="gray", ls="--", label="target 50%")
    a.set_xscale("log", base=2)
    a.set_xlabel("prompt tokens")
    a.set_ylabel("prefill MFU, % of best measured GEMM")
    a.legend()
    pc, ch = result["prefix_cache"], result["chunking"]["ttft_s_by_budget"]
    labels = ["cold", "90% cached", *[f"budget {k}" for k in ch]]
    values = [pc["cold_ttft_s"], pc["hit_ttft_s"], *ch.values()]
    b.bar(labels, values, color=["tab:gray", "tab:green", "tab:blue", "tab:orange"][:len(values)])
    b.set_ylabel("TTFT of a 2,048-token prompt, s")
    b.tick_params(axis="x", labelrotation=20)
    fig.suptitle(Path(result["model"]).name)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
