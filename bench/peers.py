"""pdserve against llama.cpp on the same core, the same checkpoint, in the same run.

llama.cpp is built from the vendored sources of the pinned ``llama-cpp-python`` sdist with ISA flags
chosen from ``/proc/cpuinfo`` (:mod:`bench.peers_llamacpp`); the bench-80m checkpoint goes through
its own converter to bf16 GGUF and ``llama-quantize`` to Q4_0 and Q4_K_M. Rep by rep, interleaved,
everything pinned to one core (``taskset`` for llama.cpp; ``sched_setaffinity`` and one torch
thread in a pdserve worker subprocess that keeps its engines loaded across reps):

  * pdserve batch-1 decode, bf16 and INT4 weights (``bench/decode.py``'s engine, GraphRunner on, multi-step
    decoding as the decode worker's default and off), from an 8-token prompt for 128 tokens; llama.cpp
    ``tg128`` (128 tokens from an empty context);
  * pdserve bf16 prefill of 512 and 2,048 tokens in 512-token chunks (``bench/prefill.py``'s
    ``bench_mfu``); llama.cpp ``pp512`` / ``pp2048`` (its default micro-batch is 512 tokens too).

Medians and (min, max) over reps; the table is printed as markdown and written with everything
else to ``<out>/peers.json``.

    .venv/bin/python bench/peers.py --out docs/results/peers [--core 1] [--reps 3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from pdserve.bench.common import ROOT, machine
from pdserve.bench.peers_llamacpp import REPORTED_FLAGS, build, convert, cpu_flags, cpu_model, quantize
from pdserve.decode_worker.config import DecodeWorkerConfig

GGUF_DIR = Path.home() / ".cache" / "pdserve" / "peers" / "gguf"
PROMPT_TOKENS, DECODE_STEPS, PREFILL = 8, 128, (512, 2048)
QUANTS = ("bf16", "Q4_0", "Q4_K_M")


# ---------------------------------------------------------------- pdserve worker (subprocess)
def _worker(model_dir: str, core: int) -> None:
    """Pinned to ``core`` with one torch thread; answers one JSON line per command read from stdin:
    ``decode bf16`` / ``decode int4`` -> ``{"tokens_per_s", "step_s"}``, ``prefill`` -> ``{"rows": [...]}``."""
    os.sched_setaffinity(0, {core})
    import torch

    torch.set_num_threads(1)
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout = sys.stderr                                  # whatever the engines print stays off the protocol
    engines = {}
    prompt = [1] + torch.randint(3, 2000, (PROMPT_TOKENS - 1,), generator=torch.Generator().manual_seed(0)).tolist()
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        try:
            reply = _answer(cmd, model_dir, engines, prompt)
        except Exception as e:                 # noqa: BLE001 - kernels under change: record it, go on
            reply = {"error": f"{type(e).__name__}: {e}"}
            stale = engines.pop(cmd[-1], None)        # a failed step may leave requests behind: start afresh
            if stale is not None:
                stale.receiver.close()
        out.write(json.dumps(reply) + "\n")
        out.flush()
    for e in engines.values():
        e.receiver.close()


def _answer(cmd: list[str], model_dir: str, engines: dict, prompt: list[int]) -> dict:
    from pdserve.bench.decode import _engine, run_decode
    from pdserve.bench.prefill import bench_mfu

    if cmd[0] == "decode":
        weights = {"bf16": "native", "int4": "int4"}[cmd[1]]
        multi = {"multi_step": int(cmd[2])} if len(cmd) > 2 else {}     # else the decode worker's default
        if tuple(cmd[1:]) not in engines:
            engines[tuple(cmd[1:])] = _engine(model_dir, "bf16", weights, True, 1, 96, **multi)[0]
        res = run_decode(engines[tuple(cmd[1:])], [prompt], DECODE_STEPS)
        return {"tokens_per_s": res["tokens_per_s"], "step_s": res["step_s"]}
    if cmd[0] == "prefill":
        mfu = bench_mfu(model_dir, list(PREFILL), 512, 1)
        return {"rows": mfu["rows"], "bf16_matmul_peak_flops": mfu.get("bf16_matmul_peak_flops")}
    return {"error": f"unknown command {cmd}"}


class PdserveWorker:
    """The parent's handle on :func:`_worker`: ``ask("decode bf16")`` -> its JSON reply."""

    def __init__(self, model_dir: str, core: int) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", "--model", model_dir, "--core", str(core)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def ask(self, cmd: str) -> dict:
        """Send one command and wait for its reply.

        Raises:
            RuntimeError: the worker died (its stderr went to ours).
        """
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"pdserve worker exited ({self.proc.wait()}) on {cmd!r}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


# ---------------------------------------------------------------- llama.cpp side
def llama_bench(info: dict, gguf: Path, core: int, repetitions: int,
                prefill: Sequence[int] = PREFILL) -> tuple[dict, dict, list[str]]:
    """``llama-bench -t 1 -p 512,2048 -n 128 -o json`` pinned to ``core``: ({test: tokens/s}, raw record, command).

    Test names are ``pp512``, ``pp2048``, ``tg128``; ``prefill=()`` runs ``tg128`` alone (``-p 0``).

    Raises:
        subprocess.CalledProcessError: llama-bench failed.
    """
    cmd = ["taskset", "-c", str(core), str(Path(info["bin"]) / "llama-bench"), "-m", str(gguf), "-t", "1",
           "-p", ",".join(map(str, prefill)) or "0", "-n", str(DECODE_STEPS), "-r", str(repetitions), "-o", "json"]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    records = json.loads(res.stdout)
    rates = {(f"pp{r['n_prompt']}" if r["n_gen"] == 0 else f"tg{r['n_gen']}"): r["avg_ts"] for r in records}
    return rates, records[0], cmd


# ---------------------------------------------------------------- the run
def _stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "reps": xs}


def model_key(model_dir: str) -> str:
    """A name for ``model_dir``'s GGUF files: its folder's name and a digest of its ``config.json`` and weight
    files (names, sizes, modification times), so another checkpoint never reuses a cached conversion."""
    folder = Path(model_dir)
    digest = hashlib.sha1((folder / "config.json").read_bytes())
    for f in sorted(folder.glob("*.safetensors")):
        digest.update(f"{f.name} {f.stat().st_size} {f.stat().st_mtime_ns}".encode())
    return f"{folder.name}-{digest.hexdigest()[:12]}"


def run(model_dir: str, core: int, reps: int, llama_reps: int, log=print) -> dict:
    """Build, convert, measure both peers ``reps`` times interleaved; returns the result dict (see module doc)."""
    info = build(log=log)
    key = model_key(model_dir)
    ggufs = {"bf16": convert(info, model_dir, GGUF_DIR / f"{key}-bf16.gguf", "bf16")}
    for q in QUANTS[1:]:
        ggufs[q] = quantize(info, ggufs["bf16"], GGUF_DIR / f"{key}-{q.lower()}.gguf", q)
    samples: dict[str, list[float]] = {}
    worker = PdserveWorker(model_dir, core)
    record, commands, errors = None, {}, {}
    try:
        for rep in range(reps):
            t0 = time.perf_counter()
            order = ("bf16", "int4", "bf16 1", "int4 1")    # every other rep reversed: none always first
            for w in order if rep % 2 == 0 else order[::-1]:
                reply = worker.ask(f"decode {w}")
                if "error" in reply:
                    errors.setdefault(f"pdserve decode {w}", reply["error"])
                else:
                    samples.setdefault(f"pdserve decode {w}", []).append(reply["tokens_per_s"])
            reply = worker.ask("prefill")
            errors.update({"pdserve prefill": reply["error"]} if "error" in reply else {})
            for row in reply.get("rows", []):
                samples.setdefault(f"pdserve prefill {row['prompt_tokens']}", []).append(row["tokens_per_s"])
            for q, path in ggufs.items():    # prompt processing is compared in bf16 only: the quantized
                # models' (AMX tiles where the build has them) died with SIGILL on an AMX Xeon under KVM
                rates, record, cmd = llama_bench(info, path, core, llama_reps, PREFILL if q == "bf16" else ())
                commands[q] = " ".join(cmd)
                for test, ts in rates.items():
                    samples.setdefault(f"llama.cpp {q} {test}", []).append(ts)
            log(f"rep {rep + 1}/{reps} ({time.perf_counter() - t0:.0f} s): " + ", ".join(
                f"{k} {v[-1]:.1f}" for k, v in samples.items()), flush=True)
    finally:
        worker.close()
    stats = {k: _stats(v) for k, v in samples.items()}
    rows = [_row("bf16 decode b1 (tok/s)", stats, "pdserve decode bf16", "llama.cpp bf16 tg128"),
            _row("INT4 decode b1 vs Q4_0 (tok/s)", stats, "pdserve decode int4", "llama.cpp Q4_0 tg128"),
            _row("INT4 decode b1 vs Q4_K_M (tok/s)", stats, "pdserve decode int4", "llama.cpp Q4_K_M tg128"),
            _row("bf16 decode b1, multi-step off (tok/s)", stats, "pdserve decode bf16 1", "llama.cpp bf16 tg128"),
            _row("INT4 decode b1 vs Q4_0, multi-step off (tok/s)", stats, "pdserve decode int4 1",
                 "llama.cpp Q4_0 tg128")]
    rows += [_row(f"bf16 prefill {n} (tok/s)", stats, f"pdserve prefill {n}", f"llama.cpp bf16 pp{n}")
             for n in PREFILL]
    flags = cpu_flags()
    return {"model": model_dir, "core": core, "reps": reps, "llama_bench_repetitions": llama_reps,
            "cpu_model": cpu_model(), "isa_flags": {f: f in flags for f in REPORTED_FLAGS},
            "llama_cpp": {k: v for k, v in info.items() if k not in ("bin", "src")} | {
                "build_commit_reported": record and record.get("build_commit"),
                "build_number_reported": record and record.get("build_number"),
                "cpu_info": record and record.get("cpu_info"), "backends": record and record.get("backends"),
                "commands": commands},
            "pdserve_settings": {"decode_prompt_tokens": PROMPT_TOKENS, "decode_steps": DECODE_STEPS,
                                 "graph_runner": True, "prefill_chunk": 512, "torch_threads": 1,
                                 "multi_step": DecodeWorkerConfig.multi_step,
                                 "multi_step_window_s": DecodeWorkerConfig.multi_step_window_s},
            "rows": rows, "samples": stats, "errors": errors}


def _row(name: str, stats: dict, ours: str, theirs: str) -> dict:
    a, b = stats.get(ours), stats.get(theirs)
    return {"row": name, "pdserve": a, "llama_cpp": b, "pdserve_key": ours, "llama_cpp_key": theirs,
            "ratio": a["median"] / b["median"] if a and b else None}


def markdown(result: dict) -> str:
    """The table: one line per row, medians with (min-max) over reps, and pdserve / llama.cpp."""
    def cell(s):
        return f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f})" if s else "-"
    lines = [f"CPU: {result['cpu_model']}, core {result['core']}, 1 thread; llama.cpp "
             f"{result['llama_cpp']['commit'][:9]} ({result['llama_cpp']['version']}); "
             f"median (min-max) of {result['reps']} reps", "",
             "| | pdserve | llama.cpp | pdserve / llama.cpp |", "|---|---:|---:|---:|"]
    for r in result["rows"]:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        lines.append(f"| {r['row']} | {cell(r['pdserve'])} | {cell(r['llama_cpp'])} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / ".bench-models" / "bench-80m"))
    ap.add_argument("--core", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--llama-bench-repetitions", type=int, default=2, help="llama-bench -r (its own average)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "peers"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return _worker(args.model, args.core)
    if not Path(args.model, "config.json").exists():
        from pdserve.deploy.make_model import make_model
        make_model("bench-80m", args.model, dtype="bfloat16")
    result = run(args.model, args.core, args.reps, args.llama_bench_repetitions)
    result = {"command": "python " + " ".join(sys.argv), "machine": machine(), **result}
    table = markdown(result)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "peers.json").write_text(json.dumps(result, indent=2))
    (out / "peers.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
