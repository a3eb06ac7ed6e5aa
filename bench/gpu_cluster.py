"""A prefill and a decode worker on one CUDA GPU, with the router and Redis: the whole serving path
(router -> prefill -> KV pages -> decode -> client) as an operator runs it, on a GPU. Not run in CI.

Both workers share the GPU, so their KV pages move device to device through CUDA IPC (``--kv-transport
cuda-ipc``, the default here) or over TCP through host staging buffers (``--transport tcp``); NCCL cannot
join two ranks on one device. Parts, each recorded even when an
earlier one fails:

- ``exact``: greedy tokens of the embedded TinyStories model (float32) through the cluster against
  ``transformers`` on the same GPU; ``exact_moe`` the same for a small random mixture of experts
  (``pdserve make-model --preset tiny-qwen3-moe``).
- ``pair``: a Llama-3.2-1B-shaped random checkpoint (``pdserve make-model --preset bench-1b``, bf16):
  TTFT at 512 and 2,048 prompt tokens and batch-1 TPOT through the cluster; 32 concurrent streams;
  then, with the cluster stopped, the same model's prefill step and batch-1 decode step in this process
  (the decode engine as the worker loads it): what the path adds.
- ``int4``: the decode worker with ``--weights int4`` (RTN, group 128): batch-1 TPOT through the cluster.

    python bench/gpu_cluster.py --out DIR [--transport tcp]   # DIR/gpu_cluster.json; a summary on stdout
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import traceback
import uuid
from pathlib import Path

import grpc
import torch

from pdserve.deploy import client
from pdserve.deploy.config import EMBEDDED_MODEL
from pdserve.deploy.processes import spawn_role
from pdserve.deploy.redis_server import ensure_redis

REDIS_URL = "redis://127.0.0.1:6379/0"
DEVICE = "cuda"  # --device: cpu runs the same script on a small model, to check it without a GPU
TRANSPORT = "cuda-ipc"  # --transport


def start_cluster(model: str, dtype: str, decode_flags: dict | None = None, max_batch_size: int = 64) -> list:
    """Router, one prefill and one decode worker on :data:`DEVICE`; returns the processes, router last."""
    name = "gpu-" + uuid.uuid4().hex[:8]
    common = dict(model_dir=model, cluster=name, redis_url=REDIS_URL, dtype=dtype, device=DEVICE,
                  kv_transport=TRANSPORT if DEVICE != "cpu" else "tcp", num_blocks=4096)
    procs = []
    try:
        procs.append(spawn_role("decode_worker", dict(worker_id="d0", max_batch_size=max_batch_size,
                                                      **common, **(decode_flags or {})), timeout_s=600))
        procs.append(spawn_role("prefill_worker", dict(worker_id="p0", max_num_batched_tokens=2048, **common),
                                timeout_s=600))
        procs.append(spawn_role("router", dict(model_dir=model, cluster=name, redis_url=REDIS_URL), timeout_s=120))
    except BaseException:
        stop(procs)
        raise
    return procs


LOGS: dict[str, str] = {}
"""The last lines each stopped process wrote to stderr (kept for a part that fails)."""


def stop(procs: list) -> None:
    for p in reversed(procs):
        p.stop()
        if p.proc.stderr is not None:
            LOGS[p.name] = p.proc.stderr.read()[-2500:]


async def timed_stream(channel, prompt: list[int], max_tokens: int) -> dict:
    """One greedy request: its tokens, TTFT and the seconds from the first token to the last (client side)."""
    start, first, last, tokens = time.perf_counter(), 0.0, 0.0, []
    request = client.make_request(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True)
    async for msg in client.stream(channel, request):
        if msg.token_ids:
            now = time.perf_counter()
            first = first or now
            last = now
            tokens += list(msg.token_ids)
    return {"tokens": tokens, "ttft_s": first - start, "decode_s": last - first}


def prompts_of(vocab: int, lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def exact(new_tokens: int = 48, model: str = EMBEDDED_MODEL) -> dict:
    """Greedy tokens through the cluster (float32, both workers on the GPU) against ``transformers``."""
    from transformers import AutoModelForCausalLM

    from pdserve.bench.gpu_model import hf_greedy

    cfg = json.loads((Path(model) / "config.json").read_text())
    prompts = prompts_of(cfg["vocab_size"], (5, 23, 61, 200), seed=1)
    procs = start_cluster(model, "float32")
    try:
        async def run() -> list[list[int]]:
            async with grpc.aio.insecure_channel(procs[-1].address) as ch:
                return [r["tokens"] for r in await asyncio.gather(*(timed_stream(ch, p, new_tokens) for p in prompts))]
        got = asyncio.run(run())
    finally:
        stop(procs)
    dev = torch.device(DEVICE)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(dev).eval()
    want = [hf_greedy(hf, p, new_tokens, dev) for p in prompts]
    match = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w))) for g, w in zip(got, want)]
    return {"prompt_tokens": [len(p) for p in prompts], "new_tokens": new_tokens, "matching_prefix": match,
            "all_equal": got == want}


def exact_moe() -> dict:
    """:func:`exact` on a random Qwen3-MoE-shaped checkpoint (float32)."""
    from pdserve.deploy.make_model import make_model

    return exact(model=str(make_model("tiny-qwen3-moe", "/tmp/tiny-qwen3-moe", dtype="float32")))


def cluster_figures(address: str, vocab: int, reps: int = 5, concurrency: int = 32) -> dict:
    """TTFT at 512 / 2,048 prompt tokens, batch-1 TPOT, and ``concurrency`` concurrent streams."""
    async def run() -> dict:
        out: dict = {}
        async with grpc.aio.insecure_channel(address) as ch:
            for p in prompts_of(vocab, (512,) * 3, seed=9):          # warm-up
                await timed_stream(ch, p, 16)
            for n in (512, 2048):
                runs = [await timed_stream(ch, p, 1) for p in prompts_of(vocab, (n,) * reps, seed=n)]
                out[f"ttft_{n}_s"] = statistics.median(r["ttft_s"] for r in runs)
                out[f"ttft_{n}_runs_s"] = [r["ttft_s"] for r in runs]
            runs = [await timed_stream(ch, p, 257) for p in prompts_of(vocab, (512,) * 3, seed=3)]
            tpots = [r["decode_s"] / (len(r["tokens"]) - 1) for r in runs]
            out["tpot_b1_s"], out["tpot_b1_runs_s"] = statistics.median(tpots), tpots
            prompts = prompts_of(vocab, (512,) * concurrency, seed=4)
            started = time.perf_counter()
            runs = await asyncio.gather(*(timed_stream(ch, p, 128) for p in prompts))
            wall = time.perf_counter() - started
            ttfts = sorted(r["ttft_s"] for r in runs)
            out["concurrent"] = {
                "streams": concurrency, "prompt_tokens": 512, "new_tokens": 128, "wall_s": wall,
                "output_tokens_per_s": sum(len(r["tokens"]) for r in runs) / wall,
                "ttft_p50_s": ttfts[len(ttfts) // 2], "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
                "tpot_median_s": statistics.median(r["decode_s"] / (len(r["tokens"]) - 1) for r in runs)}
        return out
    return asyncio.run(run())


def _timed_s(fn, reps: int = 5) -> float:
    """Median seconds of ``fn()`` (the GPU synchronized after each), after one untimed call."""
    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def in_process(model: str, vocab: int, weights: str = "native") -> dict:
    """The decode engine as the worker loads it (same device, dtype, GraphRunner): batch-1 step seconds;
    and (bf16) its model's prefill step at 512 and 2,048 tokens on a fresh cache."""
    from pdserve.bench.decode import _engine, run_decode
    from pdserve.model.runner import StepInput

    spec = dict(device=DEVICE, int4_method="rtn") if weights == "int4" else dict(device=DEVICE)
    engine, _model = _engine(model, "bf16", weights, True, 64, 512, **spec)
    try:
        out = {"device": str(engine.runner.device)}
        steps = [run_decode(engine, prompts_of(vocab, (512,), seed=5 + i), 128)["step_s"] for i in range(3)]
        out["decode_step_b1_s"], out["decode_step_b1_runs_s"] = statistics.median(steps), steps
        if weights == "native":
            for n in (512, 2048):
                prompt = prompts_of(vocab, (n,), seed=7)[0]
                blocks = list(range(engine.spec.num_blocks_for(n)))
                out[f"prefill_{n}_s"] = _timed_s(lambda: engine.runner.run([StepInput(prompt, 0, blocks)]))
        return out
    finally:
        engine.receiver.close()


def pair(model: str) -> dict:
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    started = time.perf_counter()
    procs = start_cluster(model, "bfloat16")
    out = {"start_s": time.perf_counter() - started}
    try:
        out["cluster"] = cluster_figures(procs[-1].address, vocab)
    finally:
        stop(procs)
    out["engine"] = in_process(model, vocab)
    return out


def int4(model: str) -> dict:
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    procs = start_cluster(model, "bfloat16", dict(weights="int4", int4_method="rtn"))
    try:
        async def run() -> list[float]:
            async with grpc.aio.insecure_channel(procs[-1].address) as ch:
                await timed_stream(ch, prompts_of(vocab, (512,), seed=9)[0], 16)
                runs = [await timed_stream(ch, p, 257) for p in prompts_of(vocab, (512,) * 3, seed=3)]
                return [r["decode_s"] / (len(r["tokens"]) - 1) for r in runs]
        tpots = asyncio.run(run())
    finally:
        stop(procs)
    return {"tpot_b1_s": statistics.median(tpots), "tpot_b1_runs_s": tpots,
            "engine": in_process(model, vocab, "int4")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="", help="the bf16 checkpoint of `pair` and `int4` (default: make bench-1b)")
    ap.add_argument("--parts", default="exact,pair,int4")
    ap.add_argument("--preset", default="bench-1b", help="the checkpoint made when --model is not given")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script (with a small --preset)")
    ap.add_argument("--transport", default="cuda-ipc", choices=["cuda-ipc", "tcp"],
                    help="the KV transport between the two workers on the GPU")
    args = ap.parse_args()
    global DEVICE, TRANSPORT
    DEVICE, TRANSPORT = args.device, args.transport
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    redis = ensure_redis(REDIS_URL)
    results: dict = {"gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "none", "device": DEVICE,
                     "kv_transport": TRANSPORT,
                     "torch": torch.__version__, "seconds": {}}
    model = args.model
    try:
        for part in args.parts.split(","):
            started = time.perf_counter()
            try:
                if part in ("pair", "int4") and not model:
                    from pdserve.deploy.make_model import make_model
                    model = str(make_model(args.preset, f"/tmp/{args.preset}", dtype="bfloat16"))
                results[part] = {"exact": exact, "exact_moe": exact_moe, "pair": lambda: pair(model),
                                 "int4": lambda: int4(model)}[part]()
            except Exception:                  # noqa: BLE001 - every part reports, whatever breaks
                results[part] = {"error": traceback.format_exc(), "logs": dict(LOGS)}
            LOGS.clear()
            results["seconds"][part] = round(time.perf_counter() - started, 1)
            (out / "gpu_cluster.json").write_text(json.dumps(results, indent=1))
            print(f"[{part}] {results['seconds'][part]} s: {json.dumps(results[part])[:3000]}", flush=True)
    finally:
        if redis is not None:
            redis.terminate()


if __name__ == "__main__":
    main()
