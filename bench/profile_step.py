"""The decode engine's steady steps under ``perf``, and nothing else: loads bench-80m as the decode worker
does (GraphRunner on), then repeatedly admits ``--batch`` 128-token prompts, prefills them, and runs
``--steps`` decode steps of the full batch with perf enabled only around those steps (perf's control fifo),
so that prefill, admission and the batch's tail as requests finish stay out of the profile. Prints ms per
profiled step. Not run in CI.

    mkfifo /tmp/perf_ctl
    perf record -e cpu-clock -g -D -1 --control=fifo:/tmp/perf_ctl -o /tmp/step.data -- \\
        taskset -c 1 .venv/bin/python bench/profile_step.py --batch 32 --seconds 30 --ctl /tmp/perf_ctl
    perf report -i /tmp/step.data --no-children --sort dso,sym

(``-e cpu-clock``: the software clock, which KVM guests without a PMU still have.) Without ``--ctl`` it
only times the steps.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from pdserve.bench.common import ROOT
from pdserve.bench.decode import _engine
from pdserve.decode_worker.request import TokensEvent
from pdserve.model.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=24, help="profiled decode steps per admitted batch")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--weights", choices=("native", "int4"), default="native")
    ap.add_argument("--ctl", default=None, help="perf's control fifo (perf record --control=fifo:PATH -D -1)")
    ap.add_argument("--model", default=str(ROOT / ".bench-models" / "bench-80m"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    engine, _ = _engine(args.model, "bf16", args.weights, True, args.batch, 64 * args.batch + 8)
    prompts = [[1] + torch.randint(3, 2000, (127,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(args.batch)]
    ctl = os.open(args.ctl, os.O_WRONLY) if args.ctl else None
    warmup, profiled, tokens, rounds = 3, 0.0, 0, 0
    per_step = max(engine.cfg.spec_k + 1, engine.cfg.multi_step)        # tokens an engine step yields at most
    counted = {"n": 0}

    def emit(ev) -> None:
        if isinstance(ev, TokensEvent):
            counted["n"] += len(ev.token_ids)

    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        rounds += 1
        # room for the profiled steps after the prompt's first token, the warm-up, and the prefill steps in
        # which the first-admitted requests already decode beside later ones' prompts (max_num_batched_tokens)
        budget = (1 + warmup + args.steps + args.batch * 128 // engine.cfg.max_num_batched_tokens + 1) * per_step
        for i, p in enumerate(prompts):
            engine.add_local(f"r{rounds}_{i}", p, SamplingParams(temperature=0.0, max_tokens=budget, ignore_eos=True,
                                                                seed=i), emit)
        engine.step()
        while engine.num_prefilling or engine.num_transferring:
            engine.step()
        for _ in range(warmup):
            engine.step()
        if ctl is not None:
            os.write(ctl, b"enable\n")
        counted["n"], start = 0, time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        profiled += time.perf_counter() - start
        tokens += counted["n"]
        if ctl is not None:
            os.write(ctl, b"disable\n")
        for r in list(engine._requests.values()):
            engine.abort(r.attempt_id)
        engine.step()
    print(f"{profiled * args.batch / tokens * 1e3:.3f} ms per decode step of batch {args.batch} "
          f"({tokens} tokens in {rounds} rounds of {args.steps} engine steps)")


if __name__ == "__main__":
    main()
