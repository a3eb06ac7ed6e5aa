"""oneDNN's AMX matmul on a SwiGLU gate_up projection, whole and in pieces (:class:`model.onednn_linear.OneDNNGateUp`):
ms a layer for the projection alone at a chunk's rows, ``--layers`` distinct weights cycled so that each is
read from memory as in a model. Behind :func:`model.onednn_linear.choose_gate_up_pieces`. Not run in CI.

    taskset -c 1 .venv/bin/python bench/gate_up_pieces.py --hidden 768 --intermediate 2048 --rows 512
    taskset -c 1 .venv/bin/python bench/gate_up_pieces.py --hidden 2048 --intermediate 5632 --layers 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pdserve.bench.cpu_facts import cpu_facts
from pdserve.model.onednn_linear import choose_gate_up_pieces, gate_up_piece, onednn_prepack_available


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--layers", type=int, default=12, help="distinct weights cycled (each read from memory)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if not onednn_prepack_available():
        raise SystemExit("oneDNN's bf16 prepacking does not run here")
    torch.set_num_threads(1)
    ops, g = torch.ops.mkldnn, torch.Generator().manual_seed(0)
    hidden, inter, rows = args.hidden, args.intermediate, args.rows
    x = torch.randn(rows, hidden, generator=g).bfloat16()
    dense = [(torch.randn(2 * inter, hidden, generator=g) * 0.02).bfloat16() for _ in range(args.layers)]
    facts = cpu_facts()
    print(f"CPU: {facts['model_name']} (family {facts['family']}, model {facts['model']}); "
          f"rule: {choose_gate_up_pieces(inter, rows)} pieces")
    flop = 2 * rows * 2 * inter * hidden
    for pieces in (p for p in (1, 2, 4, 8, 16, 32) if inter % p == 0 and (inter // p) % 16 == 0):
        packed = [[ops._reorder_linear_weight(gate_up_piece(w, p, pieces), rows) for p in range(pieces)]
                  for w in dense]

        def run(packed=packed) -> None:
            for layer in packed:
                for w in layer:
                    ops._linear_pointwise(x, w, None, "none", [], "")
        run()
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t0) / args.layers)
        t = statistics.median(times)
        print(f"{pieces:3d} pieces of {2 * inter // pieces:6d} columns: {t * 1e3:8.3f} ms a layer, "
              f"{flop / t / 1e9:7.1f} GFLOP/s", flush=True)
        del packed


if __name__ == "__main__":
    main()
