"""The decode engine's step at two commits, in alternating processes: the A/B behind whole-step figures in
docs/benchmarks.md where a kernel change's effect on the step is smaller than this project's VMs drift
between runs. Each process loads bench-80m as the decode worker does (GraphRunner on), admits ``--batch``
128-token prompts and times three ``bench.decode.run_decode`` passes (128 steps at batch 1, 48 above); it
prints the median ms per step. With ``--prefill N`` each process instead loads the model as the prefill
worker does and times an N-token prefill in 512-token chunks (median of 5 after 2 untimed). Processes of A (a
git revision, checked out into a temporary worktree) and B (``--head``, default the working tree) alternate,
A first in odd pairs and B first in even ones; the medians over the pairs are printed at the end. Not run in
CI.

    taskset -c 1 .venv/bin/python bench/step_ab.py --base 26a5822 --batch 1 --pairs 5
    taskset -c 1 .venv/bin/python bench/step_ab.py --base a0efd19 --batch 1 --weights int4 --pairs 5
    taskset -c 1 .venv/bin/python bench/step_ab.py --base 0b2bb57 --prefill 2048 --pairs 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from pdserve.bench.common import ROOT

CHILD = """
import json, statistics, sys, torch
torch.set_num_threads(1)
from pdserve.bench.decode import _engine, run_decode
b, weights = int(sys.argv[1]), sys.argv[2]
engine, _ = _engine(sys.argv[3], "bf16", weights, True, b, 64 * b + 8)
prompts = [[1] + torch.randint(3, 2000, (127,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(b)]
print(json.dumps(statistics.median(run_decode(engine, prompts, 128 if b == 1 else 48)["step_s"] for _ in range(3))))
"""


PREFILL_CHILD = """
import json, statistics, sys, time, torch
torch.set_num_threads(1)
from pdserve.model.kv_cache import KVCacheSpec
from pdserve.model.runner import ModelRunner, StepInput
from pdserve.prefill_worker.server import load_prefill_model
n, model_dir = int(sys.argv[1]), sys.argv[3]
model, cfg = load_prefill_model(model_dir, torch.bfloat16, chunk_tokens=512)
runner = ModelRunner(model, KVCacheSpec.for_model(cfg, n // 16 + 2, 16, torch.bfloat16))
ids = [1] + torch.randint(3, cfg.vocab_size, (n - 1,), generator=torch.Generator().manual_seed(n)).tolist()
def run():
    for s in range(0, n, 512):
        runner.run([StepInput(ids[s:s + 512], s, list(range(n // 16 + 1)))])
times = []
for i in range(7):
    t = time.perf_counter(); run(); times.append(time.perf_counter() - t)
print(json.dumps(statistics.median(times[2:])))
"""


def step_ms(package_parent: Path, batch: int, weights: str, model: str, prefill: int = 0) -> float:
    """Median ms per decode step (or per ``prefill``-token prefill) of one child process importing ``pdserve``
    from ``package_parent``."""
    env = {**os.environ, "PYTHONPATH": str(package_parent)}
    child, size = (PREFILL_CHILD, prefill) if prefill else (CHILD, batch)
    out = subprocess.run([sys.executable, "-c", child, str(size), weights, model], env=env, cwd=package_parent,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="git revision of A")
    ap.add_argument("--head", default=None, help="git revision of B (default: the working tree)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--weights", choices=("native", "int4"), default="native")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--prefill", type=int, default=0, metavar="N", help="time an N-token prefill instead")
    ap.add_argument("--model", default=str(ROOT / ".bench-models" / "bench-80m"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        parents = {}
        for name, rev in (("A", args.base), ("B", args.head)):
            parent = Path(tmp) / name
            parent.mkdir()
            src = ROOT
            if rev is not None:
                src = Path(tmp) / f"tree{name}"
                subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(src), rev], check=True,
                               capture_output=True)
            (parent / "pdserve").symlink_to(src)        # the repository root is the package
            parents[name] = parent
        try:
            times = {"A": [], "B": []}
            for i in range(args.pairs):
                for name in ("A", "B") if i % 2 == 0 else ("B", "A"):
                    times[name].append(step_ms(parents[name], args.batch, args.weights, args.model, args.prefill))
                    print(f"pair {i + 1} {name}: {times[name][-1]:.3f} ms", flush=True)
        finally:
            for name in ("A", "B"):
                src = Path(tmp) / f"tree{name}"
                if src.exists():
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(src)], check=False)
    a, b = statistics.median(times["A"]), statistics.median(times["B"])
    what = f"{args.prefill}-token prefill" if args.prefill else f"batch {args.batch} {args.weights}"
    per = "per prefill" if args.prefill else "per step"
    print(f"{what}: A ({args.base}) {a:.3f} ms, B ({args.head or 'working tree'}) {b:.3f} ms {per}, B/A {b / a:.3f} "
          f"(medians of {args.pairs} processes each)")


if __name__ == "__main__":
    main()
