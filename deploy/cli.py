"""The ``pdserve`` command: ``up``, ``generate``, ``demo``, ``scale``, ``status``, ``down``, ``make-model``,
``bench``."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import threading
from importlib.metadata import entry_points
from pathlib import Path

import grpc

from pdserve.cluster.args import context_length
from pdserve.cluster.compute import KV_TRANSPORTS
from pdserve.cluster.worker_process import default_redis_url
from pdserve.deploy import client
from pdserve.deploy.config import EMBEDDED_MODEL
from pdserve.model.reasoning import REASONING_PARSERS
from pdserve.model.tool_calls import TOOL_CALL_PARSERS
from pdserve.router.config import RouterConfig

# `up` flag -> RouterConfig field: operator limits of the router's public API (docs/operations.md, "Limits");
# unset flags keep RouterConfig's defaults
ROUTER_LIMIT_FLAGS = {
    "max_concurrent_streams": "Generate streams served at once (more: RESOURCE_EXHAUSTED)",
    "max_streams_per_token": "Generate streams at once per bearer token of --token-file (0: no per-token quota)",
    "max_tokens_limit": "largest max_tokens a request may ask for (more: INVALID_ARGUMENT)",
    "max_receive_message_bytes": "largest request message the API reads",
    "max_send_message_bytes": "largest response message the API writes",
}
# `up` flag -> RouterConfig field: the range client SLOs are clamped into (seconds; unset: RouterConfig's defaults)
ROUTER_SLO_RANGE_FLAGS = {
    "min_slo": ("min_slo_s", "client TTFT/TPOT SLOs below this are raised to it"),
    "max_ttft_slo": ("max_ttft_slo_s", "client TTFT SLOs above this are lowered to it"),
    "max_tpot_slo": ("max_tpot_slo_s", "client TPOT SLOs above this are lowered to it"),
}

DEMO_PROMPTS = [
    "Once upon a time, there was a little dog",
    "Lily and Ben went to the park. They saw",
    "Tom had a red ball. One day,",
    "The sun was shining and the birds were singing. A little girl",
    "Sam wanted to fly like a bird, so he",
    "Once upon a time, in a big forest, there lived a wise old owl",
]


def _cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=EMBEDDED_MODEL,
                   help="checkpoint directory (Llama, Mistral, Qwen2/2.5, Qwen3), or a hub repository id "
                        "in the local Hugging Face cache")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--colocated", type=int, default=0,
                   help="instead of the two pools: N workers that prefill and decode in one process (baseline)")
    p.add_argument("--weights", default="native", choices=["native", "int4"], help="decode: INT4 weight-only")
    p.add_argument("--no-graph", action="store_true",
                   help="decode: no GraphRunner (padded buckets, CUDA graphs on GPUs); on by default")
    p.add_argument("--no-warmup", action="store_true",
                   help="workers register without first running every batch bucket and chunk size (faster start, "
                        "slow first requests); warm-up is on by default")
    p.add_argument("--port", type=int, default=0, help="router port (0: any free port)")
    p.add_argument("--tls-cert", default="", help="router: PEM certificate chain; with --tls-key the API is TLS-only")
    p.add_argument("--tls-key", default="", help="router: PEM private key of --tls-cert")
    p.add_argument("--insecure", action="store_true",
                   help="allow the router and workers to listen on the network without the cluster secret "
                        "(and the router without a token or TLS); warned about every minute")
    p.add_argument("--token-file", default="",
                   help="router: file holding the bearer token clients must send (else env PDSERVE_ROUTER_TOKEN)")
    p.add_argument("--http-port", type=int, default=None,
                   help="router: serve the OpenAI-compatible HTTP API on this port too (0: any free port; "
                        "default: no HTTP API)")
    p.add_argument("--served-model-name", default="", help="router: the model's name in the HTTP API "
                                                            "(default: the checkpoint directory's name)")
    p.add_argument("--chat-template", default="",
                   help="router: Jinja chat template file for /v1/chat/completions (default: the checkpoint's)")
    p.add_argument("--tool-call-parser", default="", choices=TOOL_CALL_PARSERS,
                   help="router: the format the model writes tool calls in (hermes: Hermes, Qwen2.5, Qwen3; "
                        "llama3_json: Llama 3.1+; granite: Granite 3; mistral: Mistral v0.3, NeMo, Small; pythonic: "
                        "Llama 3.2, Llama 4); chat requests with tools then get OpenAI tool_calls back")
    p.add_argument("--reasoning-parser", default="", choices=REASONING_PARSERS,
                   help="router: how the model marks its reasoning (deepseek_r1: DeepSeek-R1, QwQ, Qwen3 "
                        "*-Thinking-2507; qwen3: Qwen3's hybrid models); chat answers then carry it as `reasoning`")
    p.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local one)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                   help="workers on GPUs (cuda: one each; waits --gpu-wait seconds for the GPU nodes the pools "
                        "need to join), on CPUs, or auto: CUDA when the Ray cluster has a GPU at start")
    p.add_argument("--kv-transport", default="auto", choices=list(KV_TRANSPORTS),
                   help="KV pages between workers: auto (NCCL between GPU caches where it loads, else TCP), "
                        "cuda-ipc (GPU to GPU copies between workers on GPUs one process sees, e.g. sharing "
                        "one GPU), tcp (GPU caches through host staging buffers too), or nccl")
    p.add_argument("--gpu-wait", type=float, default=600.0,
                   help="--device cuda: seconds to wait for GPU nodes to join the Ray cluster")
    p.add_argument("--router-node", default=None, metavar="IP",
                   help="run the router on the Ray node with this IP (default: the head node)")
    p.add_argument("--redis-url", default=default_redis_url(), help="registry (env PDSERVE_REDIS_URL)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=512, help="KV blocks per worker")
    p.add_argument("--max-model-len", type=context_length, default=0, metavar="TOKENS",
                   help="context served, prompt and output (vLLM's: 4096, 4k = 4,000, 4K = 4,096; default: the "
                        "checkpoint's max_position_embeddings); also serves a sliding-window checkpoint exactly "
                        "up to its window")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weight/KV dtype; auto (the default here, while WorkerConfig keeps float32 for the exactness "
                        "tests): the checkpoint's torch_dtype, an fp32 checkpoint in bfloat16 on an AVX-512 or AVX2 "
                        "CPU, where the packed bf16 kernels run (cluster.compute.resolve_dtype)")
    p.add_argument("--max-batch-size", type=int, default=64, help="decode: requests per step at most")
    p.add_argument("--multi-step", type=int, default=8,
                   help="decode: steps run in one C call at most for batches without top-p or logprobs requests "
                        "(ended early by new work or a stop token); 1 turns multi-step decoding off")
    p.add_argument("--multi-step-window", type=float, default=0.025,
                   help="decode: seconds a multi-step run lasts at most (tokens reach clients in bursts this long)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="prefill: token budget per step (longer prompts are chunked)")
    p.add_argument("--activations", default="native", choices=["native", "fp8"],
                   help="prefill: FP8 W8A8 matmuls (real FP8 speed needs a GPU with FP8; on CPU only the numerics)")
    p.add_argument("--no-prefix-cache", action="store_true", help="prefill: do not reuse cached prefixes")
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="router: fcfs (arrival order) or priority (requests' `priority`, lower first, as vLLM's)")
    p.add_argument("--admission", action="store_true",
                   help="router: admit only requests whose TTFT/TPOT SLOs are predicted to hold")
    p.add_argument("--ttft-slo", type=float, default=1.0, help="router: default TTFT SLO, seconds")
    p.add_argument("--tpot-slo", type=float, default=0.1, help="router: default TPOT SLO, seconds")
    p.add_argument("--stream-idle-timeout", type=float, default=None,
                   help="router: seconds a decode worker may send nothing on any of the router's streams, once a "
                        "request's first token is out, before its requests migrate as from a crashed worker "
                        f"(stalled: SIGSTOPped, partitioned, wedged); default {RouterConfig.stream_idle_timeout_s}")
    for name, what in ROUTER_LIMIT_FLAGS.items():
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                       help=f"router: {what} (default {getattr(RouterConfig, name)})")
    for flag, (name, what) in ROUTER_SLO_RANGE_FLAGS.items():
        p.add_argument("--" + flag.replace("_", "-"), type=float, default=None,
                       help=f"router: {what}, seconds (default {getattr(RouterConfig, name)})")
    p.add_argument("--speculative", default="off", choices=["off", "ngram", "self", "draft"],
                   help="decode: speculative proposer")
    p.add_argument("--spec-k", type=int, default=4, help="decode: proposal length")
    p.add_argument("--spec-draft-layers", type=int, default=1, help="decode: layers of the self-draft")
    p.add_argument("--spec-draft-model", default="", help="decode: draft checkpoint for --speculative draft")
    p.add_argument("--cluster", default=None, help="cluster id (registry namespace, controller name; default: random)")
    p.add_argument("--cpus-per-worker", type=float, default=1.0, help="Ray CPUs each worker reserves")
    p.add_argument("--placement-strategy", default="PACK", choices=["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"],
                   help="placement-group strategy of each batch of workers of a pool")
    p.add_argument("--max-restarts", type=int, default=3, help="Ray restarts of a dead worker actor (-1: forever)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds a removed worker's in-flight requests get to finish")
    p.add_argument("--autoscale", action="store_true",
                   help="planner: grow prefill on TTFT misses, decode on TPOT misses (from the SLO attainment "
                        "the router counts in Redis)")
    for pool in ("prefill", "decode"):
        p.add_argument(f"--min-{pool}", type=int, default=1, help=f"autoscale: fewest {pool} workers")
        p.add_argument(f"--max-{pool}", type=int, default=4, help=f"autoscale: most {pool} workers")
    p.add_argument("--autoscale-window", type=float, default=30.0, help="autoscale: seconds per observation")


def _start_cluster(args: argparse.Namespace):
    from pdserve.deploy.config import ClusterConfig
    from pdserve.deploy.planner import PlannerConfig
    from pdserve.deploy.ray_cluster import RayCluster
    from pdserve.deploy.redis_server import ensure_redis
    from pdserve.model.checkpoint import model_reference

    autoscale = None
    if args.autoscale:
        autoscale = PlannerConfig(min_prefill=args.min_prefill, max_prefill=args.max_prefill,
                                  min_decode=args.min_decode, max_decode=args.max_decode,
                                  window_s=args.autoscale_window, cooldown_s=2 * args.autoscale_window)
    ids = {"cluster": args.cluster} if args.cluster else {}
    try:  # every config and the router's files, before Redis, Ray and the pools start
        if args.colocated and args.activations != "native":
            raise ValueError("--activations configures prefill workers; colocated workers (--colocated) run "
                             "native activations")
        cfg = ClusterConfig(
            model_dir=model_reference(args.model), num_prefill=args.prefill, num_decode=args.decode,
            num_colocated=args.colocated, **ids, cpus_per_worker=args.cpus_per_worker,
            placement_strategy=args.placement_strategy, max_restarts=args.max_restarts,
            drain_timeout_s=args.drain_timeout, autoscale=autoscale,
            detach=getattr(args, "detach", False), device=args.device, gpu_wait_s=args.gpu_wait,
            router_node=args.router_node, port=args.port, ray_address=args.ray_address, redis_url=args.redis_url,
            block_size=args.block_size,
            num_blocks=args.num_blocks, dtype=args.dtype, max_model_len=args.max_model_len,
            prefill_options={"max_num_batched_tokens": args.max_num_batched_tokens, "activations": args.activations,
                             "prefix_cache": not args.no_prefix_cache},
            decode_options={"max_batch_size": args.max_batch_size, "speculative": args.speculative,
                            "spec_k": args.spec_k, "spec_draft_layers": args.spec_draft_layers,
                            "spec_draft_model": args.spec_draft_model,
                            "weights": args.weights, "max_num_batched_tokens": args.max_num_batched_tokens,
                            "graph": not args.no_graph, "multi_step": args.multi_step,
                            "multi_step_window_s": args.multi_step_window},
            worker_options={"kv_transport": args.kv_transport, **({"insecure": True} if args.insecure else {}),
                            **({"warmup": False} if args.no_warmup else {})},
            router_options={"insecure": args.insecure, "admission": args.admission, "default_ttft_slo_s": args.ttft_slo,
                            "scheduling_policy": args.scheduling_policy,
                            **{name: getattr(args, name) for name in ROUTER_LIMIT_FLAGS
                               if getattr(args, name) is not None},
                            **{name: getattr(args, flag) for flag, (name, _) in ROUTER_SLO_RANGE_FLAGS.items()
                               if getattr(args, flag) is not None},
                            "default_tpot_slo_s": args.tpot_slo,
                            **({"stream_idle_timeout_s": args.stream_idle_timeout}
                               if args.stream_idle_timeout is not None else {}),
                            **{name: str(Path(path).resolve()) for name, path in (
                                ("tls_cert_file", args.tls_cert), ("tls_key_file", args.tls_key),
                                ("token_file", args.token_file)) if path},
                            **_http_options(args)})
        cfg.check_roles()
    except (ValueError, FileNotFoundError) as exc:
        raise SystemExit(f"pdserve up: {exc}") from None
    redis_proc = ensure_redis(args.redis_url)
    cluster = RayCluster(cfg)
    try:
        address = cluster.start()
    except Exception:
        if redis_proc is not None:
            redis_proc.terminate()
        raise
    return cluster, address, redis_proc


def _http_options(args: argparse.Namespace) -> dict:
    """RouterConfig fields of the HTTP API flags (none without ``--http-port``).

    Raises:
        ValueError: ``--served-model-name``, ``--chat-template``, ``--tool-call-parser`` or
            ``--reasoning-parser`` without ``--http-port`` (they would be ignored).
    """
    if args.http_port is None:
        given = [flag for flag, value in (("--served-model-name", args.served_model_name),
                                          ("--chat-template", args.chat_template),
                                          ("--tool-call-parser", args.tool_call_parser),
                                          ("--reasoning-parser", args.reasoning_parser)) if value]
        if given:
            raise ValueError(f"{' and '.join(given)} configure the HTTP API: they need --http-port")
        return {}
    return {"http_port": args.http_port, "served_model_name": args.served_model_name,
            "tool_call_parser": args.tool_call_parser, "reasoning_parser": args.reasoning_parser,
            **({"chat_template": str(Path(args.chat_template).resolve())} if args.chat_template else {})}


def cmd_up(args: argparse.Namespace) -> int:
    cluster, address, redis_proc = _start_cluster(args)
    cid = cluster.cfg.cluster
    print(f"router listening on {address}", flush=True)
    print(f"cluster {cid}: resize with `pdserve scale --cluster {cid} --prefill N "
          f"--decode M`, inspect with `pdserve status --cluster {cid}`", flush=True)
    if cluster.http_address:
        print(f"http listening on {cluster.http_address}", flush=True)
    if args.detach:
        print(f"ray {cluster.ray_address}", flush=True)
        print(f"detached: cluster {cid} keeps running; stop it with `pdserve down --cluster {cid}`"
              + (f" (it also stops the Ray head this started at {cluster.ray_address})" if cluster.head else ""),
              flush=True)
        if redis_proc is not None:
            print(f"the redis-server this started (pid {redis_proc.pid}) keeps running", flush=True)
        cluster.detach()
        return 0
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    print("shutting down", file=sys.stderr, flush=True)
    cluster.stop()
    if redis_proc is not None:
        redis_proc.terminate()
    return 0


def _timings(final) -> str:
    t = final.timings
    return (f"TTFT {t.ttft_s * 1e3:.1f} ms, TPOT {t.tpot_s * 1e3:.2f} ms, e2e {t.e2e_s * 1e3:.1f} ms, "
            f"{final.usage.completion_tokens} tokens, "
            f"finish {client.pdserve_pb2.FinishReason.Name(final.finish_reason)}")


def cmd_generate(args: argparse.Namespace) -> int:
    async def run() -> int:
        request = client.make_request(args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                                      top_p=args.top_p, top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
        try:
            channel = client.open_channel(args.router, tls_ca_file=args.tls_ca or None,
                                          token=client.read_token(args.token_file or None),
                                          tls_server_name=args.tls_server_name or None)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        async with channel:
            try:
                async for msg in client.stream(channel, request):
                    sys.stdout.write(msg.text)
                    sys.stdout.flush()
                    if msg.HasField("final"):
                        print()
                        print(_timings(msg.final), file=sys.stderr)
            except grpc.aio.AioRpcError as exc:
                print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
                return 1
        return 0

    return asyncio.run(run())


def cmd_demo(args: argparse.Namespace) -> int:
    print(f"starting a cluster on Ray: {args.prefill} prefill + {args.decode} decode worker(s), model {args.model}",
          flush=True)
    cluster, address, redis_proc = _start_cluster(args)
    print(f"router listening on {address}; sending {len(DEMO_PROMPTS)} prompts concurrently\n", flush=True)

    async def run() -> list[client.Completion]:
        async with client.open_channel(address) as channel:
            return await asyncio.gather(*[
                client.complete(channel, client.make_request(p, max_tokens=args.max_tokens, temperature=0.0))
                for p in DEMO_PROMPTS])

    try:
        for prompt, done in zip(DEMO_PROMPTS, asyncio.run(run())):
            print(f"\033[1m{prompt}\033[0m{done.text}")
            print(f"    [{_timings(done.final)}]\n", flush=True)
        if cluster.http_address:
            _demo_curl(cluster, args)
    finally:
        cluster.stop()
        if redis_proc is not None:
            redis_proc.terminate()
    return 0


def _demo_curl(cluster, args: argparse.Namespace) -> None:
    """Print a curl command for the live cluster's HTTP API, then run exactly that line to show its answer."""
    import shlex
    import shutil
    import subprocess

    from pdserve.router.http.server import served_model_name

    body = json.dumps({"model": served_model_name(cluster.cfg.model_dir, args.served_model_name),
                       "prompt": DEMO_PROMPTS[0], "max_tokens": 24, "temperature": 0})
    line = (f"curl -s http://{cluster.http_address}/v1/completions -H 'Content-Type: application/json' "
            f"-d {shlex.quote(body)}")
    print(f"OpenAI-compatible HTTP API on {cluster.http_address} (this demo's cluster stops when it ends; "
          f"`pdserve up --http-port 8000` keeps one up). While it is up:\n  {line}", flush=True)
    if shutil.which("curl"):
        answer = subprocess.run(line, shell=True, capture_output=True, text=True, timeout=60)
        print(f"  -> {answer.stdout.strip() or answer.stderr.strip()}\n", flush=True)


def cmd_make_model(args: argparse.Namespace) -> int:
    from pdserve.deploy.make_model import PRESETS, make_model, num_parameters

    out = make_model(args.preset, args.out, seed=args.seed, dtype=args.dtype)
    print(f"wrote {args.preset} ({num_parameters(PRESETS[args.preset]) / 1e6:.1f}M parameters, {args.dtype}) to {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="launch a router and worker pools on Ray; serve until interrupted")
    _cluster_args(up)
    up.add_argument("--detach", action="store_true",
                    help="leave the cluster running as detached Ray actors and return (locally: on a Ray head "
                         "that outlives this command); `pdserve down --cluster ID` removes it")
    up.set_defaults(func=cmd_up)

    gen = sub.add_parser("generate", help="stream a completion from a running router")
    gen.add_argument("--router", required=True, help="router host:port")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--tls-ca", default="", help="PEM CA certificate of a TLS router (default: plaintext)")
    gen.add_argument("--tls-server-name", default="", help="name in the router's certificate, if not the host")
    gen.add_argument("--token-file", default="",
                     help="file holding the router's bearer token (default: env PDSERVE_ROUTER_TOKEN, if set)")
    gen.add_argument("prompt")
    gen.set_defaults(func=cmd_generate)

    demo = sub.add_parser("demo", help="bring a cluster up on the embedded model, run a few prompts, shut down")
    _cluster_args(demo)
    demo.add_argument("--max-tokens", type=int, default=64)
    demo.set_defaults(http_port=0)  # the demo shows the HTTP API too
    demo.set_defaults(func=cmd_demo)

    from pdserve.deploy import pool_cli

    pool_cli.add_commands(sub)

    mk = sub.add_parser("make-model", help="write a seeded random-weight checkpoint at a preset")
    mk.add_argument("--preset", required=True, help="bench-80m, bench-80m-qwen3 (about 80M parameters), bench-9m, "
                                                    "or tiny-{llama,qwen2,qwen3,mistral,phi3,granite} (awkward shapes)")
    mk.add_argument("--out", required=True, help="output directory")
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    mk.set_defaults(func=cmd_make_model)

    for command in entry_points(group="pdserve.commands"):  # e.g. `pdserve bench`, from pdserve.bench
        command.load()(sub)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
