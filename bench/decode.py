"""Decode at the bandwidth limit: tokens/s against the machine's speed of light.

One run prints and records, in one process tree on this machine:
  1. the machine's limits (bench/limits.py): the C-measured streaming read bandwidth at a
     DRAM-sized buffer and at each step's working set (weight + KV bytes), the best bf16 GEMM
     rate over the model's shapes at each batch size, the ISA's paper peak, the CPU facts;
  2. decode tokens/s of the decode engine at batch 1, 8, 32 for fp32, bf16 and int4
     weights, with and without the GraphRunner, against the speed of light (working-set bytes /
     bandwidth at that size; the DRAM figure beside it), the MFU against the best GEMM rate at
     that batch, and the roofline max(bytes / bandwidth, FLOPs / GEMM rate); each row names the
     kernel path its linears and attention took;
  3. ``transformers.generate`` at batch 1 and 8 on the same checkpoint;
  4. speculative decoding on the real TinyStories model at batch 1 (n-gram and
     self-draft): speedup and acceptance, and the batch size beyond which it stops paying.

    python bench/decode.py --out docs/results/decode        # makes bench-80m if needed
    python bench/decode.py --model .bench-models/bench-9m --steps 4 --batches 1,8 \
        --skip-transformers --skip-speculative --out /tmp/decode-quick   # a quick check of the script
    taskset -c 1 python bench/decode.py --kinds bf16 --batches 1,32 --steps 48 --reps 5 \
        --skip-transformers --skip-speculative --out /tmp/decode-b32      # the batch-32 roofline, median of 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from pdserve.bench.common import ROOT, hf_generate_seconds, write_result
from pdserve.bench.gemm_limits import gemm_probe, gemm_rate_at, raise_gemm_rate
from pdserve.bench.limits import bandwidth_at, kernel_paths, linear_shapes, measure_limits, summary
from pdserve.decode_worker.config import DecodeWorkerConfig
from pdserve.decode_worker.engine import DecodeEngine
from pdserve.decode_worker.request import TokensEvent
from pdserve.decode_worker.server import load_decode_model
from pdserve.deploy.make_model import make_model
from pdserve.model.loader import load_model
from pdserve.model.moe import SparseMoeBlock
from pdserve.model.sampling import SamplingParams
from pdserve.model.tokenizer import Tokenizer

TINY = str(ROOT / "assets" / "models" / "tinystories-656k")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _engine(model_dir: str, dtype: str, weights: str, graph: bool, max_batch: int, blocks: int, **spec):
    """A decode engine with the model loaded as the decode worker loads it; ``spec``: more
    :class:`DecodeWorkerConfig` fields (speculation, ``multi_step``)."""
    dtype_name = {"fp32": "float32", "bf16": "bfloat16"}[dtype]
    wcfg = DecodeWorkerConfig(model_dir=model_dir, worker_id="bench", dtype=dtype_name, num_blocks=blocks,
                              block_size=16, max_batch_size=max_batch, graph=graph, weights=weights, **spec)
    model, cfg = load_decode_model(wcfg)
    return DecodeEngine(wcfg, model, cfg), model


def expert_shares(model: torch.nn.Module, rows: int) -> dict[int, float]:
    """``id(module)`` -> the share of its mixture's experts that ``rows`` tokens are expected to run with uniform
    routing, ``1 - (1 - top_k / experts) ** rows`` (``top_k / experts`` for one row), for every module inside a
    mixture's experts (:class:`model.moe.SparseMoeBlock`)."""
    return {id(m): 1 - (1 - b.top_k / len(b.experts)) ** rows for b in model.modules()
            if isinstance(b, SparseMoeBlock) for m in b.experts.modules()}


def weight_bytes(model: torch.nn.Module, batch: int = 1) -> int:
    """Bytes of weight a decode step of ``batch`` rows reads: every linear (the LM head too, tied or not), norms;
    not the embedding (one row per token). A module that keeps a kernel layout in non-persistent buffers (the
    packed bf16 copy, an INT4 kernel layout) is counted by that layout and its bias, not its portable
    or dense twin. A mixture's experts count by the share of them ``batch`` tokens are expected to run
    (:func:`expert_shares`)."""
    share = expert_shares(model, batch)
    total = 0.0
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            continue
        layout = [b for name, b in module.named_buffers(recurse=False)
                  if name in module._non_persistent_buffers_set and b is not None and b.numel()]
        if layout:
            bias = getattr(module, "bias", None)
            tensors = layout + ([bias] if isinstance(bias, torch.Tensor) else [])
        else:
            tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        total += share.get(id(module), 1.0) * sum(t.numel() * t.element_size() for t in tensors if t is not None)
    return int(total)


def step_flops(model: torch.nn.Module, batch: int, context: int) -> float:
    """Matmul FLOPs of one decode step of ``batch`` sequences at ``context`` tokens each: 2 x rows x
    (N x K) per linear (the LM head included; a mixture's experts ``top_k / experts`` of theirs: each row runs
    ``top_k``) + attention (QK^T and PV over the context)."""
    cfg = model.cfg
    share = expert_shares(model, 1)
    linear = sum(share.get(id(m), 1.0) * m.in_features * m.out_features for m in model.modules()
                 if hasattr(m, "in_features") and hasattr(m, "out_features"))
    return 2.0 * batch * linear + 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context * batch


def tokens_budget(cfg: DecodeWorkerConfig, steps: int, warmup: int = 3) -> int:
    """``max_tokens`` for a request of :func:`run_decode`: ``warmup`` engine steps and ``steps`` tokens
    with room to spare, whatever an engine step yields (a speculative step ``spec_k + 1`` tokens at most,
    a multi-step run ``multi_step``)."""
    per_step = max(cfg.spec_k + 1, cfg.multi_step)
    return (warmup + 1) * per_step + steps + 2


def run_decode(engine: DecodeEngine, prompts: list[list[int]], steps: int, warmup: int = 3,
               temperature: float = 0.0) -> dict:
    """Admit every prompt (local prefill), run ``warmup`` engine steps, then time engine steps until
    every request has streamed ``steps`` more tokens (``steps`` decode steps of the batch; more tokens
    an engine step when it speculates or runs several steps). tokens/s counts what was streamed;
    ``step_s`` is seconds per token of a row (a decode step's time however steps are grouped),
    ``engine_step_s`` seconds per :meth:`DecodeEngine.step`."""
    counted = {"n": 0}

    def emit(ev) -> None:
        if isinstance(ev, TokensEvent):
            counted["n"] += len(ev.token_ids)

    budget = tokens_budget(engine.cfg, steps, warmup)
    for i, p in enumerate(prompts):
        engine.add_local(f"r{i}", p, SamplingParams(temperature=temperature, max_tokens=budget, ignore_eos=True,
                                                    seed=i), emit)
    engine.step()  # takes the requests in
    while engine.num_prefilling or engine.num_transferring:  # local prefill of every prompt first
        engine.step()
    for _ in range(warmup):
        engine.step()
    counted["n"], engine_steps = 0, 0
    start = time.perf_counter()
    while counted["n"] < steps * len(prompts):
        engine.step()
        engine_steps += 1
    seconds = time.perf_counter() - start
    reqs = list(engine._requests.values())
    drafted = sum(r.num_draft_tokens for r in reqs)
    accepted = sum(r.num_accepted_tokens for r in reqs)
    for r in reqs:
        engine.abort(r.attempt_id)
    engine.step()
    return {"tokens_per_s": counted["n"] / seconds, "step_s": seconds * len(prompts) / counted["n"],
            "engine_step_s": seconds / engine_steps, "acceptance": accepted / drafted if drafted else None}


KINDS = {"fp32": ("fp32", "native"), "bf16": ("bf16", "native"), "int4": ("bf16", "int4")}   # --kinds: dtype, weights


def bench_throughput(model_dir: str, batches: list[int], steps: int, bandwidth: float, prompt_len: int,
                     limits: dict | None = None, multi_step: int = DecodeWorkerConfig.multi_step,
                     reps: int = 1, kinds: tuple[str, ...] = tuple(KINDS)) -> list[dict]:
    """Decode rows for fp32, bf16 and int4 weights (``kinds``, keys of :data:`KINDS`), graph off/on, at each
    batch. ``bandwidth`` (bytes/s): the DRAM figure; with ``limits`` (:func:`bench.limits.measure_limits`) the
    speed of light uses the bandwidth measured at each step's working-set size, and MFU / roofline the GEMM
    rate at its batch. Each row is the median of ``reps`` timed passes by step time (``step_s_runs``: all
    of them, seconds), the same engine and prompts each time, so that one slow pass on a drifting host
    does not make the figure. With ``limits``, each pass of a bf16 or fp32 row follows a probe of the
    best GEMM's rate at that moment (:func:`bench.gemm_limits.gemm_probe`, ``passes``: step and rate in pass
    order), and the row gives its roofline against those paired rates beside the one against the best; a
    probe faster than ``limits``' figure raises it (:func:`bench.gemm_limits.raise_gemm_rate`), and every row is
    scored again at the end against the run's best (printed again where that changed its figures)."""
    rows, raised = [], False
    for dtype, weights in (KINDS[k] for k in kinds):
        for graph in (False, True):
            engine, model = _engine(model_dir, dtype, weights, graph, max(batches), 64 * max(batches) + 8,
                                    multi_step=multi_step)
            for b in batches:
                wbytes = weight_bytes(model, b)
                prompts = [[1] + torch.randint(3, 2000, (prompt_len - 1,),
                                               generator=torch.Generator().manual_seed(i)).tolist() for i in range(b)]
                probe = gemm_probe(gemm_rate_at(limits, b), limits["threads"]) if limits and weights != "int4" else None
                passes = [{"gemm_rate_flops_per_s": probe() if probe else None, **run_decode(engine, prompts, steps)}
                          for _ in range(reps)]
                for p in passes if probe else ():
                    raised = raise_gemm_rate(limits, b, p["gemm_rate_flops_per_s"]) or raised
                runs = sorted(passes, key=lambda r: r["step_s"])
                res = {**runs[len(runs) // 2], "step_s_runs": [r["step_s"] for r in runs],
                       "passes": [{k: r[k] for k in ("step_s", "gemm_rate_flops_per_s")} for r in passes]}
                kv_bytes = b * (prompt_len + steps) * engine.spec.block_nbytes // engine.spec.block_size
                row = {"dtype": dtype, "weights": weights, "graph": graph, "batch": b, "multi_step": multi_step, **res,
                       "weight_bytes": wbytes,
                       "kv_bytes": kv_bytes, "kernels": kernel_paths(model, b, 1, DTYPES[dtype])}
                row.update(_floors(row, step_flops(model, b, prompt_len + steps // 2), limits, bandwidth))
                rows.append(row)
                print(_row_line(row), flush=True)
            engine.receiver.close()
    if raised:
        print("a paired probe ran faster than the limits measured at the start; every row against the run's best:")
        for row in rows:
            row.update(_floors(row, row["step_flops"], limits, bandwidth))
            print(_row_line(row), flush=True)
    return rows


def _floors(row: dict, flops: float, limits: dict | None, dram: float) -> dict:
    """Speed of light (working set / bandwidth at that size; at DRAM beside it), MFU and roofline of a row
    whose step does ``flops`` matmul FLOPs (:func:`step_flops`).
    The compute floor uses the best bf16 GEMM rate at the batch's row count for every dtype: for fp32
    rows it is a lower floor than fp32's own rate would give (a roofline the step cannot beat). INT4 rows
    run int8 products (AVX512-VNNI), whose peak the bf16 GEMM rate does not bound: their roofline is the
    bandwidth floor alone and no MFU is given."""
    ws, step = row["weight_bytes"] + row["kv_bytes"], row["step_s"]
    bw = bandwidth_at(limits, ws) if limits else dram
    out = {"step_flops": flops, "working_set_bytes": ws, "bandwidth_bytes_per_s": bw, "sol_step_s": ws / bw,
           "sol_fraction": ws / bw / step, "sol_dram_step_s": ws / dram, "sol_dram_fraction": ws / dram / step}
    if limits and row["weights"] == "int4":
        out.update(roofline_step_s=ws / bw, roofline_bound="memory", roofline_fraction=ws / bw / step)
    elif limits:
        gemm = gemm_rate_at(limits, row["batch"])
        roofline = max(ws / bw, flops / gemm["flops_per_s"])
        out.update(gemm_rate_flops_per_s=gemm["flops_per_s"], gemm_rate_kernel=gemm["kernel"],
                   mfu=flops / step / gemm["flops_per_s"],
                   mfu_theoretical=flops / step / limits["theoretical_peak"]["flops"],
                   roofline_step_s=roofline, roofline_bound="memory" if ws / bw >= flops / gemm["flops_per_s"]
                   else "compute", roofline_fraction=roofline / step)
        out.update(paired_roofline(row.get("passes", []), ws / bw, flops))
    return out


def paired_roofline(passes: list[dict], memory_floor_s: float, flops: float) -> dict:
    """The roofline of each timed pass against the GEMM rate probed just before it: the median over passes of
    max(``memory_floor_s``, ``flops`` / rate) / step (``roofline_fraction_paired``) and the probed rates'
    range (``gemm_rate_paired_range``, FLOP/s); ``{}`` when no pass has a rate. ``passes``: dicts of
    ``step_s`` (seconds) and ``gemm_rate_flops_per_s`` (None where not probed)."""
    paired = [p for p in passes if p.get("gemm_rate_flops_per_s")]
    if not paired:
        return {}
    rates = [p["gemm_rate_flops_per_s"] for p in paired]
    return {"roofline_fraction_paired": statistics.median(
                max(memory_floor_s, flops / p["gemm_rate_flops_per_s"]) / p["step_s"] for p in paired),
            "gemm_rate_paired_range": [min(rates), max(rates)]}


def _spread(r: dict) -> str:
    runs = r.get("step_s_runs", [])
    return f" (median of {len(runs)}: {runs[0] * 1e3:.2f}-{runs[-1] * 1e3:.2f})" if len(runs) > 1 else ""


def _row_line(r: dict) -> str:
    line = (f"{r['dtype']:5s} {r['weights']:6s} graph={r['graph']!s:5s} batch {r['batch']:3d}: "
            f"{r['tokens_per_s']:8.1f} tok/s, step {r['step_s'] * 1e3:7.2f} ms{_spread(r)}, speed of light "
            f"{r['sol_step_s'] * 1e3:6.2f} ms ({r['sol_fraction']:.0%} at {r['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s "
            f"for {r['working_set_bytes'] / 2**20:.0f} MiB; at DRAM bandwidth "
            f"{r['sol_dram_step_s'] * 1e3:.2f} ms, {r['sol_dram_fraction']:.0%})")
    if "mfu" in r:
        line += f", MFU {r['mfu']:.1%} of measured ({r['mfu_theoretical']:.1%} of paper peak)"
    if "roofline_step_s" in r:
        line += f", roofline {r['roofline_step_s'] * 1e3:.2f} ms {r['roofline_bound']} ({r['roofline_fraction']:.0%})"
    if "roofline_fraction_paired" in r:
        lo, hi = (f / 1e9 for f in r["gemm_rate_paired_range"])
        line += (f"; {r['roofline_fraction_paired']:.0%} against the rate probed before each pass "
                 f"({lo:.0f}-{hi:.0f} GFLOP/s)")
    return line


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
    ap.add_argument("--multi-step", type=int, default=DecodeWorkerConfig.multi_step,
                    help="greedy steps per engine step at most (the decode worker's multi_step; 1: off)")
    ap.add_argument("--reps", type=int, default=1, help="timed passes per row; the row is their median")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"weight kinds to run, of {', '.join(KINDS)}")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--skip-speculative", action="store_true", help="leave out the speculative decoding part")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "decode"))
    args = ap.parse_args()
    kinds = tuple(args.kinds.split(","))
    if args.reps < 1 or not set(kinds) <= set(KINDS):
        ap.error(f"--reps must be >= 1 and --kinds of {', '.join(KINDS)}")
    torch.set_num_threads(args.threads)
    if not Path(args.model, "config.json").exists():
        make_model("bench-80m", args.model)
    batches = [int(b) for b in args.batches.split(",")]
    limits = measure_limits(linear_shapes(load_model(args.model, torch.bfloat16)[0]), batches, threads=args.threads)
    print(summary(limits), flush=True)
    bandwidth = limits["bandwidth_bytes_per_s"]
    result = {"model": args.model, "bandwidth_bytes_per_s": bandwidth, "limits": limits,
              "bandwidths": {"c_read": bandwidth, "torch_sum": limits["torch_sum_bytes_per_s"]},
              "threads": args.threads, "prompt_tokens": args.prompt_tokens}
    result["engine"] = bench_throughput(args.model, batches, args.steps, bandwidth, args.prompt_tokens, limits,
                                        args.multi_step, args.reps, kinds)
    if not args.skip_transformers:
        result["transformers"] = bench_transformers(args.model, [b for b in batches if b <= 8], 24,
                                                    args.prompt_tokens)
    if not args.skip_speculative:
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
