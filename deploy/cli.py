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

import grpc

from pdserve.deploy import client
from pdserve.deploy.cluster_args import add_cluster_args, cluster_config

DEMO_PROMPTS = [
    "Once upon a time, there was a little dog",
    "Lily and Ben went to the park. They saw",
    "Tom had a red ball. One day,",
    "The sun was shining and the birds were singing. A little girl",
    "Sam wanted to fly like a bird, so he",
    "Once upon a time, in a big forest, there lived a wise old owl",
]


def _start_cluster(args: argparse.Namespace):
    """Redis (started if none answers), Ray and the cluster of ``args`` (``cluster_args.add_cluster_args``);
    returns (cluster, router address, the redis-server process started or None). Exits on bad flags."""
    from pdserve.deploy.ray_cluster import RayCluster
    from pdserve.deploy.redis_server import ensure_redis

    try:
        cfg = cluster_config(args)
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
    add_cluster_args(up)
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
    add_cluster_args(demo)
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
