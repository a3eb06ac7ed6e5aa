"""Where a colocated worker's projections should leave the packed kernels for oneDNN's prepacked copy: whole prefills
of n tokens of a checkpoint with every projection on oneDNN's weights reordered once (as an AMX prefill worker holds
them, :func:`model.onednn_linear.prepack_for_cpu_prefill`) and with the packed kernels up to ``--max-rows`` rows (as
a colocated worker holds them, :func:`model.cpu_linear.pack_for_cpu_decode` with ``keep_dense``), interleaved in one
process, a 256 MiB buffer written before each prefill so that the weights come from memory as between requests.
Behind :data:`model.cpu_linear.AMX_MAX_ROWS`. Prints medians in ms and the packed / oneDNN ratio. Not run in CI.

    taskset -c 1 .venv/bin/python bench/packed_crossover.py --lengths 16,32,64,96,128,160,192,256
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch

from pdserve.bench.common import ROOT
from pdserve.bench.cpu_facts import cpu_facts
from pdserve.kernels.cpu.gemv import gemm_amx_available
from pdserve.model import cpu_linear
from pdserve.model.cpu_linear import pack_for_cpu_decode
from pdserve.model.hugepages import move_to_huge_pages
from pdserve.model.kv_cache import KVCacheSpec
from pdserve.model.loader import load_model
from pdserve.model.onednn_linear import onednn_prepack_available, prepack_for_cpu_prefill
from pdserve.model.runner import ModelRunner, StepInput


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / ".bench-models" / "bench-80m"))
    ap.add_argument("--lengths", default="16,32,64,96,128,160,192,256")
    ap.add_argument("--max-rows", type=int, default=4096, help="rows up to which the packed model runs packed")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    if not onednn_prepack_available():
        raise SystemExit("oneDNN's bf16 prepacking does not run here")
    torch.set_num_threads(1)
    lengths = [int(n) for n in args.lengths.split(",")]
    models = {}
    for kind in ("oneDNN", "packed"):
        model, cfg = load_model(args.model, torch.bfloat16)
        if kind == "oneDNN":
            prepack_for_cpu_prefill(model, 512)
        else:
            with mock.patch.object(cpu_linear, "AMX_MAX_ROWS", args.max_rows), \
                    mock.patch.object(cpu_linear, "GEMM_MAX_ROWS", args.max_rows):
                pack_for_cpu_decode(model, keep_dense=True)
        move_to_huge_pages(model)
        models[kind] = ModelRunner(model, KVCacheSpec.for_model(cfg, max(lengths) // 16 + 2, 16, torch.bfloat16))
    facts = cpu_facts()
    print(f"CPU: {facts['model_name']} (family {facts['family']}, model {facts['model']}); packed kernels on "
          f"{'AMX tiles' if gemm_amx_available() else 'vectors'} up to {args.max_rows} rows")
    evict = torch.empty(256 << 20, dtype=torch.uint8)
    times = {(kind, n): [] for kind in models for n in lengths}
    for rep in range(args.reps):
        for n in lengths:
            ids = [(i * 7919 + n) % (cfg.vocab_size - 3) + 3 for i in range(n)]
            for kind in (list(models) if rep % 2 == 0 else list(models)[::-1]):
                evict.add_(1)
                t0 = time.perf_counter()
                models[kind].run([StepInput(ids, 0, list(range(n // 16 + 1)))])
                times[(kind, n)].append(time.perf_counter() - t0)
    for n in lengths:
        a, b = (statistics.median(times[(kind, n)]) * 1e3 for kind in models)
        print(f"{n:5d} tokens: oneDNN {a:7.2f} ms, packed {b:7.2f} ms (packed / oneDNN {b / a:.3f})")


if __name__ == "__main__":
    main()
