"""KV page transfer between two caches in this process over one transport (``--transport tcp``, the default;
``cuda-ipc`` between two caches on one GPU): the rate a prompt's pages move at, and for TCP on a GPU how much
of it the host staging copies take (:mod:`kvtransfer.tcp.pages`). Not run in CI. (In one process a CUDA IPC
receiver maps memory of its own process; the copies and the protocol are those of two processes.)

Caches of Llama-3.2-1B's KV shape (16 layers, 8 KV heads of 64, 16-token blocks, bf16: 512 KiB a block).
For each prompt size: the whole transfer (connect, pages, done, ack; median of 5), and on a GPU the staging
copies alone (device -> pinned host for the sender, host -> device for the receiver).

    python bench/kv_transfer.py --out DIR [--device cuda] [--transport cuda-ipc]   # DIR/kv_transfer.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from pdserve.bench.common import machine
from pdserve.kvtransfer.select import make_receiver, make_sender
from pdserve.kvtransfer.tcp.pages import StagedPageMemory
from pdserve.model.kv_cache import KVCacheSpec

SPEC = KVCacheSpec(num_blocks=520, num_layers=16, block_size=16, num_kv_heads=8, head_dim=64, dtype=torch.bfloat16)


def _median_s(fn, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(device: str, transport: str = "tcp", prompt_tokens: tuple[int, ...] = (512, 2048, 8192)) -> list[dict]:
    src = torch.randn(SPEC.shape, device=device).to(SPEC.dtype)
    dst = torch.zeros(SPEC.shape, dtype=SPEC.dtype, device=device)
    rx = make_receiver(dst, SPEC, transport=transport)
    tx = make_sender(src, SPEC, transport=transport)
    rows, seq = [], iter(range(10**6))
    try:
        for tokens in prompt_tokens:
            blocks = list(range(SPEC.num_blocks_for(tokens)))

            def transfer() -> None:
                rid, done = f"r{next(seq)}", []
                rx.expect(rid, blocks, 30.0, lambda *a: done.append(a), lambda *a: done.append(("failed", *a)))
                channel = tx.open(rid, rx.address)
                channel.send_pages((0, SPEC.num_layers), blocks, blocks)
                channel.finish(1)
                assert done and done[0][0] != "failed", done

            nbytes = len(blocks) * SPEC.block_nbytes
            row = {"prompt_tokens": tokens, "blocks": len(blocks), "bytes": nbytes, "transfer_s": _median_s(transfer)}
            row["transfer_gbs"] = nbytes / row["transfer_s"] / 1e9
            assert torch.equal(dst[blocks], src[blocks])
            if device != "cpu" and transport == "tcp":
                staged = StagedPageMemory(src, SPEC)
                row["stage_read_s"] = _median_s(lambda: [None for _ in staged.read(blocks, 0, SPEC.num_layers)])
                landing = StagedPageMemory(dst, SPEC)
                row["stage_write_s"] = _median_s(lambda: [None for _ in landing.write(blocks, 0, SPEC.num_layers)])
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        tx.close()
        rx.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--transport", default="tcp", choices=["tcp", "cuda-ipc"])
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        host = machine()
    except Exception as exc:                  # noqa: BLE001 - a GPU host without a C compiler still measures
        host = {"error": repr(exc)}
    result = {"machine": host, "device": args.device, "transport": args.transport,
              "gpu": torch.cuda.get_device_name() if args.device != "cpu" else None,
              "rows": run(args.device, args.transport)}
    (out / f"kv_transfer_{args.transport}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
