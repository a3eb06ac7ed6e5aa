"""The flags of ``pdserve up`` / ``pdserve demo`` and the ``ClusterConfig`` they make (``deploy/cli.py`` runs the
commands)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pdserve.cluster.args import KV_TRANSPORTS, context_length, default_redis_url
from pdserve.deploy.config import EMBEDDED_MODEL, ClusterConfig
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


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    """The flags of ``pdserve up`` and ``pdserve demo``: the model, the pools, the workers', router's and
    planner's options (``cluster_config`` turns them into a ``ClusterConfig``)."""
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
    p.add_argument("--queue-timeout", type=float, default=None,
                   help="router: seconds a request that gives no queue_timeout_s waits for a decode worker with free "
                        "KV blocks (with --admission, to be admitted) before RESOURCE_EXHAUSTED / HTTP 429, as "
                        "vLLM queues what its KV cache cannot yet hold; default "
                        f"{RouterConfig.default_queue_timeout_s:g}: refused at once")
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


def cluster_config(args: argparse.Namespace) -> ClusterConfig:
    """The ``ClusterConfig`` of parsed ``add_cluster_args`` flags, every config and the router's files checked
    (before Redis, Ray and the pools start).

    Raises:
        ValueError: flags that contradict each other or a config's ranges.
        FileNotFoundError: a checkpoint, TLS or token file that does not exist.
    """
    from pdserve.deploy.planner import PlannerConfig  # imported when a cluster starts, not for --help
    from pdserve.model.model_dir import model_reference

    autoscale = None
    if args.autoscale:
        autoscale = PlannerConfig(min_prefill=args.min_prefill, max_prefill=args.max_prefill,
                                  min_decode=args.min_decode, max_decode=args.max_decode,
                                  window_s=args.autoscale_window, cooldown_s=2 * args.autoscale_window)
    ids = {"cluster": args.cluster} if args.cluster else {}
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
                        **({"default_queue_timeout_s": args.queue_timeout} if args.queue_timeout is not None else {}),
                        **{name: str(Path(path).resolve()) for name, path in (
                            ("tls_cert_file", args.tls_cert), ("tls_key_file", args.tls_key),
                            ("token_file", args.token_file)) if path},
                        **http_options(args)})
    cfg.check_roles()
    return cfg


def http_options(args: argparse.Namespace) -> dict:
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
