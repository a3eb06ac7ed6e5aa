"""What structured output adds to a decode step on the host: :func:`model.sampling.sample` of one row with and
without a grammar's mask (:class:`model.structured.Constraint`: the next-token bitmask, applied to a copy of the
row, then the token accepted), at a small and a Llama-3-sized vocabulary. The grammar is a JSON string of up to
``--length`` characters, which the embedded tokenizer (letters, quote) can write; its tokenizer's vocabulary
is padded to each size, as a checkpoint's logits may be wider than its tokenizer. Not run in CI.

    taskset -c 1 .venv/bin/python bench/structured_overhead.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pdserve.bench.cpu_facts import cpu_facts
from pdserve.deploy.config import EMBEDDED_MODEL
from pdserve.kernels.cpu.fused import vectorized
from pdserve.model.sampling import SamplingParams, sample
from pdserve.model.structured import Grammars


def per_token_us(vocab: int, constrained: bool, tokens: int, reps: int, length: int) -> float:
    """Median microseconds of one greedy token (sample + mask + accept) over ``tokens`` steps, ``reps`` times."""
    grammars = Grammars(EMBEDDED_MODEL, vocab, [2])
    spec = ("json_schema", json.dumps({"type": "string", "maxLength": length}))
    params = [SamplingParams(temperature=0.0, max_tokens=tokens)]
    logits = torch.randn(tokens, 1, vocab, generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(reps):
        constraint = grammars.constraint(spec) if constrained else None
        start = time.perf_counter()
        for t in range(tokens):
            if constraint is not None and constraint.done:
                break
            sample(logits[t], params, [t], None, [constraint] if constrained else None)
        times.append((time.perf_counter() - start) / (t + 1) * 1e6)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocabs", default="2048,128256")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--length", type=int, default=200)
    args = ap.parse_args()
    facts = cpu_facts()
    isa = ", ".join(k for k, v in facts["features"].items() if v)
    print(f"CPU: {facts['model_name']} (family {facts['family']}, model {facts['model']}; {isa}); "
          f"mask kernel: {'fused.c pd_mask_logits' if vectorized() else 'scalar C or xgrammar'}; "
          f"torch threads {torch.get_num_threads()}")
    for vocab in map(int, args.vocabs.split(",")):
        free = per_token_us(vocab, False, args.tokens, args.reps, args.length)
        held = per_token_us(vocab, True, args.tokens, args.reps, args.length)
        print(f"vocab {vocab:>7}: sample {free:8.1f} us/token, with the grammar {held:8.1f} us/token "
              f"(+{held - free:.1f} us a constrained row a step)")


if __name__ == "__main__":
    main()
