"""Decode at the bandwidth limit: tokens/s against the machine's speed of light.

One run prints and records, in one process tree on this machine:
  1. measured memory bandwidth and the speed-of-light step time it implies for the
     model's weight bytes plus the KV bytes a step reads;
  2. decode tokens/s of the decode engine at batch 1, 8, 32 for fp32, bf16 and int4
     weights, with and without the GraphRunner;
  3. ``transformers.generate`` at batch 1 and 8 on the same checkpoint;
  4. speculative decoding on the real TinyStories model at batch 1 (n-gram and
     self-draft): speedup and acceptance, and the batch size beyond which it stops paying.

    python bench/decode.py --out docs/results/decode        # makes bench-80m if needed
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from pdserve.bench.common import ROOT, hf_generate_seconds, memory_bandwidths, write_result
from pdserve.decode_worker.config import DecodeWorkerConfig
from pdserve.decode_worker.engine import DecodeEngine
from pdserve.decode_worker.request import TokensEvent
from pdserve.decode_worker.server import load_decode_model
from pdserve.deploy.make_model import make_model
from pdserve.model.cpu_linear import PackedBF16Linear
from pdserve.model.sampling import SamplingParams
from pdserve.model.tokenizer import Tokenizer

TINY = str(ROOT / "assets" / "models" / "tinystories-656k")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _engine(model_dir: str, dtype: str, weights: str, graph: bool, max_batch: int, blocks: int, **spec):
    """A decode engine with the model loaded as the decode worker loads it."""
    dtype_name = {"fp32": "float32", "bf16": "bfloat16"}[dtype]
    wcfg = DecodeWorkerConfig(model_dir=model_dir, worker_id="bench", dtype=dtype_name, num_blocks=blocks,
                              block_size=16, max_batch_size=max_batch, graph=graph, weights=weights, **spec)
    model, cfg = load_decode_model(wcfg)
    return DecodeEngine(wcfg, model, cfg), model


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weight a decode step reads: every linear (the LM head too, tied or not; the packed
    copy where there is one, not its dense twin), norms; not the embedding (one row per token)."""
    total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            continue
        if isinstance(module, PackedBF16Linear):
            tensors = [module.packed] + ([module.bias] if module.bias is not None else [])
        else:
            tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        total += sum(t.numel() * t.element_size() for t in tensors if t is not None)
    return total


def run_decode(engine: DecodeEngine, prompts: list[list[int]], steps: int, warmup: int = 3,
               temperature: float = 0.0) -> dict:
    """Admit every prompt (local prefill), then time ``steps`` engine steps; tokens/s counts what was streamed."""
    counted = {"n": 0}

    def emit(ev) -> None:
        if isinstance(ev, TokensEvent):
            counted["n"] += len(ev.token_ids)

    budget = warmup + steps * (engine.cfg.spec_k + 1) + 2
    for i, p in enumerate(prompts):
        engine.add_local(f"r{i}", p, SamplingParams(temperature=temperature, max_tokens=budget, ignore_eos=True,
                                                    seed=i), emit)
    engine.step()  # takes the requests in
    while engine.num_prefilling or engine.num_transferring:  # local prefill of every prompt first
        engine.step()
    for _ in range(warmup):
        engine.step()
    counted["n"] = 0
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    seconds = time.perf_counter() - start
    reqs = list(engine._requests.values())
    drafted = sum(r.num_draft_tokens for r in reqs)
    accepted = sum(r.num_accepted_tokens for r in reqs)
    for r in reqs:
        engine.abort(r.attempt_id)
    engine.step()
    return {"tokens_per_s": counted["n"] / seconds, "step_s": seconds / steps,
            "acceptance": accepted / drafted if drafted else None}


def bench_throughput(model_dir: str, batches: list[int], steps: int, bandwidth: float, prompt_len: int) -> list[dict]:
    rows = []
    for dtype, weights in (("fp32", "native"), ("bf16", "native"), ("bf16", "int4")):
        for graph in (False, True):
            engine, model = _engine(model_dir, dtype, weights, graph, max(batches), 64 * max(batches) + 8)
            wbytes = weight_bytes(model)
            for b in batches:
                prompts = [[1] + torch.randint(3, 2000, (prompt_len - 1,),
                                               generator=torch.Generator().manual_seed(i)).tolist() for i in range(b)]
                res = run_decode(engine, prompts, steps)
                kv_bytes = b * (prompt_len + steps) * engine.spec.block_nbytes // engine.spec.block_size
                sol_step = (wbytes + kv_bytes) / bandwidth
                rows.append({"dtype": dtype, "weights": weights, "graph": graph, "batch": b, **res,
                             "weight_bytes": wbytes, "sol_step_s": sol_step, "sol_fraction": sol_step / res["step_s"]})
                print(f"{dtype:5s} {weights:6s} graph={graph!s:5s} batch {b:3d}: {res['tokens_per_s']:8.1f} tok/s, "
                      f"step {res['step_s'] * 1e3:7.2f} ms, speed of light {sol_step * 1e3:6.2f} ms "
                      f"({sol_step / res['step_s']:.0%})", flush=True)
            engine.receiver.close()
    return rows


def bench_transformers(model_dir: str, batches: list[int], new_tokens: int, prompt_len: int) -> list[dict]:
    from transformers import AutoModelForCausalLM

    rows = []
    for dtype in ("fp32", "bf16"):
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).eval()
        for b in batches:
            ids = torch.randint(3, 2000, (b, prompt_len), generator=torch.Generator().manual_seed(0))

            def gen(n: int) -> float:
                return hf_generate_seconds(hf, ids, n)

            gen(4)
            prefill = statistics.median(gen(1) for _ in range(3))
            total = statistics.median(gen(new_tokens) for _ in range(2))
            rows.append({"dtype": dtype, "batch": b, "tokens_per_s": b * (new_tokens - 1) / (total - prefill)})
            print(f"transformers {dtype} batch {b}: {rows[-1]['tokens_per_s']:.1f} tok/s", flush=True)
    return rows


SPEC_PROMPTS = [
    "Once upon a time, there was a little dog named Max. Max liked to play with his ball. One day, Max",
    "Lily saw a big red ball. She said, \"I want the big red ball!\" Her mom said, \"The big red ball",
    "Tom and Sam were friends. Tom and Sam liked to play. Tom and Sam went to the park. Tom and Sam",
    "The cat sat on the mat. The cat was happy. The cat sat on the mat and",
    # prompts whose greedy continuation the n-gram proposer predicts well (found by trying 8)
    "One, two, three, four, five. One, two, three, four, five. One, two, three,",
    "Tom said, \"I am sorry.\" Sue said, \"I am sorry.\" Tom said, \"I am sorry.\" Sue said,",
    "Once upon a time, there was a girl named Lily. Lily was",
]


def bench_speculative(steps: int) -> dict:
    tok = Tokenizer(TINY, 1)
    prompts = [tok.encode(p) for p in SPEC_PROMPTS]
    out = {"per_prompt": [], "threshold": []}
    plain, _ = _engine(TINY, "fp32", "native", True, 16, 1024)
    modes = {m: _engine(TINY, "fp32", "native", True, 16, 1024, speculative=m, spec_k=4, spec_draft_layers=1,
                        spec_max_batch_size=64)[0] for m in ("ngram", "self")}
    for p, text in zip(prompts, SPEC_PROMPTS):
        base = run_decode(plain, [p], steps)
        row = {"prompt": text, "baseline_tokens_per_s": base["tokens_per_s"]}
        for mode, engine in modes.items():
            res = run_decode(engine, [p], steps)
            row[mode] = {"tokens_per_s": res["tokens_per_s"], "speedup": res["tokens_per_s"] / base["tokens_per_s"],
                         "acceptance": res["acceptance"]}
        out["per_prompt"].append(row)
        print(f"spec: {text[:40]!r:44s} plain {base['tokens_per_s']:7.1f} tok/s | " + " | ".join(
            f"{m} x{row[m]['speedup']:.2f} (accept {row[m]['acceptance'] or 0:.0%})" for m in modes), flush=True)
    for b in (1, 2, 4, 8, 16):
        batch = [prompts[i % len(prompts)] for i in range(b)]
        base = run_decode(plain, batch, steps // 2)
        spec = run_decode(modes["ngram"], batch, steps // 2)
        out["threshold"].append({"batch": b, "plain_tokens_per_s": base["tokens_per_s"],
                                 "ngram_tokens_per_s": spec["tokens_per_s"],
                                 "speedup": spec["tokens_per_s"] / base["tokens_per_s"]})
        print(f"spec threshold: batch {b:2d}: n-gram x{out['threshold'][-1]['speedup']:.2f}", flush=True)
    paying = [r["batch"] for r in out["threshold"] if r["speedup"] > 1.0]
    out["measured_spec_max_batch_size"] = max(paying) if paying else 0
    for e in (plain, *modes.values()):
        e.receiver.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / ".bench-models" / "bench-80m"))
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "decode"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not Path(args.model, "config.json").exists():
        make_model("bench-80m", args.model)
    batches = [int(b) for b in args.batches.split(",")]
    bandwidths = memory_bandwidths()
    bandwidth = max(bandwidths.values())
    print("memory bandwidth (GB/s): " + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in bandwidths.items())
          + f"; speed of light uses the best, {bandwidth / 1e9:.1f}", flush=True)
    result = {"model": args.model, "bandwidth_bytes_per_s": bandwidth, "bandwidths": bandwidths,
              "threads": args.threads, "prompt_tokens": args.prompt_tokens}
    result["engine"] = bench_throughput(args.model, batches, args.steps, bandwidth, args.prompt_tokens)
    if not args.skip_transformers:
        result["transformers"] = bench_transformers(args.model, [b for b in batches if b <= 8], 24,
                                                    args.prompt_tokens)
    result["speculative"] = bench_speculative(max(args.steps, 48))
    out = Path(args.out)
    write_result(result, out)
    _plot(result, out.with_suffix(".png"))


def _plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    rows = result["engine"]
    for (dtype, weights, graph) in sorted({(r["dtype"], r["weights"], r["graph"]) for r in rows}):
        sel = [r for r in rows if (r["dtype"], r["weights"], r["graph"]) == (dtype, weights, graph)]
        ax.plot([r["batch"] for r in sel], [r["tokens_per_s"] for r in sel], "o-" if graph else "o--",
                label=f"{dtype} {weights}{' graph' if graph else ''}")
        if graph:
            ax.plot([r["batch"] for r in sel], [r["batch"] / r["sol_step_s"] for r in sel], ":", color="gray")
    for r in result.get("transformers", []):
        ax.scatter([r["batch"]], [r["tokens_per_s"]], marker="x", color="black")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"{Path(result['model']).name}: dotted = speed of light, x = transformers")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
