"""A colocated worker's mixed step against its two halves: a ``--chunk``-token prefill chunk of a new prompt
beside ``--rows`` decode rows whose contexts are ``--contexts`` tokens long, on bench-80m bf16 (``--model``,
``--dtype``) loaded as a colocated decode worker loads it (``decode_worker.server.load_decode_model``).
Prints ms per step (median of ``--reps``) for the chunk alone, the decode rows alone (a step of the
per-operation path, not the decode graph) and both in one step, and writes them as JSON with the machine's
facts (``bench.common.write_result``). Not run in CI.

    taskset -c 1 .venv/bin/python bench/mixed_step.py --out docs/results/mixed_step_xeon167_amx_1129
    taskset -c 1 .venv/bin/python bench/mixed_step.py --model .bench-models/bench-9m --dtype float32 \
        --out docs/results/mixed_step_9m_fp32_xeon167_amx_1129
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from pdserve.bench.common import ROOT, write_result
from pdserve.decode_worker.config import DecodeWorkerConfig
from pdserve.decode_worker.server import load_decode_model
from pdserve.model.kv_cache import KVCacheSpec
from pdserve.model.runner import ModelRunner, StepInput


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def measure(model_dir: str, dtype: str, chunk: int, rows: int, context: int, reps: int) -> dict:
    """ms per step, medians of ``reps``, of the chunk alone, the decode rows alone and the mixed step."""
    cfg = DecodeWorkerConfig(model_dir=model_dir, worker_id="bench", dtype=dtype, colocated=True)
    model, model_cfg = load_decode_model(cfg)
    per_seq = (max(context, chunk) + 16) // 16 + 1
    runner = ModelRunner(model, KVCacheSpec.for_model(model_cfg, per_seq * (rows + 1), 16, cfg.torch_dtype))
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(rows + 1)]
    for i in range(rows):                                   # the decode rows' contexts, prefilled in chunks
        ids = _prompt(context, 100 + i, model_cfg.vocab_size)
        for s in range(0, context, 512):
            runner.run([StepInput(ids[s:s + 512], s, tables[i])])
    prefill = [StepInput(_prompt(chunk, 7, model_cfg.vocab_size), 0, tables[rows])]
    decode = [StepInput([5], context, tables[i]) for i in range(rows)]

    def ms(batch: list[StepInput]) -> float:
        runner.run(batch)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            runner.run(batch)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    alone_chunk, alone_rows, mixed = ms(prefill), ms(decode), ms(prefill + decode)
    return {"chunk_tokens": chunk, "decode_rows": rows, "context_tokens": context, "chunk_alone_ms": alone_chunk,
            "rows_alone_ms": alone_rows, "mixed_ms": mixed, "mixed_over_sum": mixed / (alone_chunk + alone_rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / ".bench-models" / "bench-80m"))
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--contexts", default="512,2048")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "mixed_step"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = []
    for context in (int(c) for c in args.contexts.split(",")):
        r = measure(args.model, args.dtype, args.chunk, args.rows, context, args.reps)
        results.append(r)
        print(f"{args.chunk}-token chunk + {args.rows} decode rows at {context} tokens of context: chunk alone "
              f"{r['chunk_alone_ms']:.1f} ms, rows alone {r['rows_alone_ms']:.1f} ms, mixed {r['mixed_ms']:.1f} ms "
              f"({r['mixed_over_sum']:.2f}x their sum)", flush=True)
    write_result({"results": results}, Path(args.out))


if __name__ == "__main__":
    main()
