"""Operator flags outside what a process can run are refused when its config is built, naming the flag:
ports beyond 65535 (the OS wrapped 70000 to 4464 and served there), NaN or infinite timeouts and
intervals (NaN passes every ``<=`` check: a NaN prefill timeout failed every request, a NaN registry
poll spun a core, a NaN stall timeout never fired), a router KV timeout the decode workers refuse per
request, leases Redis cannot hold, a colocated prefill budget of 0 tokens (one token a step), a NaN CPU
share, a Redis URL the client cannot parse. Found by an audit of the flags; each case was accepted before."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from pdserve.decode_worker.config import DecodeWorkerConfig
from pdserve.deploy.config import ClusterConfig
from pdserve.model.kv_cache import KVCacheSpec, available_memory_bytes
from pdserve.prefill_worker.config import PrefillWorkerConfig
from pdserve.router.config import RouterConfig

NAN, INF = math.nan, math.inf


def router(**kw):
    return RouterConfig(model_dir="m", **kw)


def prefill(**kw):
    return PrefillWorkerConfig(model_dir="m", worker_id="p", **kw)


def decode(**kw):
    return DecodeWorkerConfig(model_dir="m", worker_id="d", **kw)


def cluster(**kw):
    return ClusterConfig(model_dir="m", **kw)


@pytest.mark.parametrize("make, field, value", [
    (router, "port", 70000), (router, "port", -1), (prefill, "port", 70000), (decode, "kv_port", 70000),
    (decode, "metrics_port", 65536), (cluster, "port", 70000),
    (router, "prefill_timeout_s", NAN), (router, "prefill_timeout_s", INF), (router, "registry_poll_s", NAN),
    (router, "stream_idle_timeout_s", NAN), (router, "kv_timeout_s", NAN), (router, "kv_timeout_s", 4000.0),
    (router, "registry_grace_s", NAN),
    (prefill, "lease_s", NAN), (prefill, "lease_s", INF), (prefill, "lease_s", 1e300), (decode, "lease_s", 0.0001),
    (prefill, "snapshot_interval_s", 0.0), (prefill, "snapshot_interval_s", NAN), (prefill, "kv_io_timeout_s", INF),
    (decode, "kv_io_timeout_s", NAN), (decode, "max_num_batched_tokens", 0),
    (cluster, "cpus_per_worker", NAN), (cluster, "drain_timeout_s", NAN), (cluster, "unroute_s", INF),
    (router, "redis_url", "garbage"), (prefill, "redis_url", "http://127.0.0.1:6379"), (cluster, "redis_url", ""),
    (prefill, "device", "gpu"), (decode, "device", "cuda:x"), (decode, "device", ""),
    (prefill, "kv_transport", "rdma"), (decode, "kv_transport", "TCP"),
    (router, "scheduling_policy", "lifo"), (router, "tool_call_parser", "deepseek_v3"),
    (router, "max_model_len", -1), (prefill, "max_model_len", -4096), (decode, "max_model_len", 2.5),
    (cluster, "max_model_len", -1),
])
def test_out_of_range_flags_are_refused_naming_them(make, field, value):
    with pytest.raises(ValueError, match=field):
        make(**{field: value})


def test_the_edges_of_each_range_are_accepted():
    router(port=65535, kv_timeout_s=3600.0, registry_grace_s=0.0)
    prefill(port=0, lease_s=0.5, snapshot_interval_s=0.5)
    decode(kv_port=65535, lease_s=3600.0, max_num_batched_tokens=1)
    cluster(port=0, unroute_s=0.0, gpu_wait_s=0.0, redis_url="unix:///tmp/redis.sock")
    router(redis_url="rediss://example:6380/0", scheduling_policy="priority", tool_call_parser="mistral")
    for device in ("auto", "cpu", "cuda", "cuda:7"):  # named, not resolved: a GPU name is fine on a CPU box
        decode(device=device, kv_transport="tcp")
        prefill(device=device, kv_transport="nccl")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the errors of a machine without CUDA")
def test_a_cuda_device_without_a_gpu_is_refused_at_start(model_dir):
    """--device cuda where torch sees no GPU: the worker exits before loading anything, saying so (and
    ``auto`` is the CPU here)."""
    assert decode().resolved_device == torch.device("cpu")
    run = subprocess.run([sys.executable, "-m", "pdserve.decode_worker", "--model-dir", model_dir, "--worker-id", "w",
                          "--device", "cuda", "--no-warmup"], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "ready" not in run.stdout
    assert "--device cuda: torch sees no CUDA GPU here" in run.stderr and "use --device cpu" in run.stderr, run.stderr


@pytest.mark.parametrize("module, flags, words", [
    ("pdserve.router", ["--model-dir", "m", "--port", "70000"], "port must be in [0, 65535]"),
    ("pdserve.prefill_worker", ["--model-dir", "m", "--worker-id", "p", "--lease-s", "nan"], "lease_s"),
    ("pdserve.decode_worker", ["--model-dir", "m", "--worker-id", "d", "--redis-url", "x"], "redis_url"),
    ("pdserve.prefill_worker", ["--model-dir", "m", "--worker-id", "p", "--max-model-len", "4kb"],
     "expected a token count such as 4096, 4k or 4K"),
])
def test_a_role_process_refuses_a_bad_flag_as_argparse_does(module, flags, words):
    """Usage and the config's message, exit status 2: no traceback."""
    run = subprocess.run([sys.executable, "-m", module, *flags], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and words in run.stderr and "Traceback" not in run.stderr, run.stderr


@pytest.mark.parametrize("module, role", [("pdserve.decode_worker", "decode"), ("pdserve.prefill_worker", "prefill")])
def test_a_kv_pool_larger_than_the_memory_left_is_refused_at_start(model_dir, module, role):
    """--num-blocks past the machine's memory: the worker exits at once naming the pool's size and the memory
    available (it had loaded the model, then died inside the allocation, or been killed)."""
    run = subprocess.run([sys.executable, "-m", module, "--model-dir", model_dir, "--worker-id", "w",
                          "--num-blocks", str(10**9), "--no-warmup"], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "ready" not in run.stdout
    assert f"MemoryError: {role} worker w: a KV cache of 1000000000 blocks x 16384 bytes" in run.stderr, run.stderr
    assert "GiB of memory available here; lower --num-blocks" in run.stderr


def test_kv_spec_check_fits_counts_every_block():
    spec = KVCacheSpec(num_blocks=10, num_layers=2, block_size=16, num_kv_heads=4, head_dim=8, dtype=torch.bfloat16)
    assert spec.nbytes == 10 * 2 * 2 * 16 * 4 * 8 * 2
    spec.check_fits("w", available=spec.nbytes)                     # exactly fits
    with pytest.raises(MemoryError, match=r"w: a KV cache of 10 blocks x 4096 bytes \(0\.0 GiB\)"):
        spec.check_fits("w", available=spec.nbytes - 1)
    assert available_memory_bytes() is None or available_memory_bytes() > 0


def test_kv_spec_check_fits_counts_the_weights_beside_the_pool():
    """A pool that fits alone is refused when the weights that load beside it leave too little."""
    spec = KVCacheSpec(num_blocks=10, num_layers=2, block_size=16, num_kv_heads=4, head_dim=8, dtype=torch.bfloat16)
    spec.check_fits("w", available=spec.nbytes + 3 * 2**30, beside=3 * 2**30)
    with pytest.raises(MemoryError, match=r"w: a KV cache of 10 blocks x 4096 bytes \(0\.0 GiB\) beside 3\.0 GiB "
                                          r"of weights does not fit the 3\.0 GiB of memory available here"):
        spec.check_fits("w", available=spec.nbytes + 3 * 2**30 - 1, beside=3 * 2**30)


def test_weights_nbytes_reads_every_parameter_from_the_headers(awkward_model_dir):
    """The checkpoint's parameters as transformers counts them, at the serving dtype; the decoder layers'
    projections at the quantized size where a worker quantizes them."""
    from transformers import AutoConfig, LlamaForCausalLM

    from pdserve.model.checkpoint import weights_nbytes
    hf = LlamaForCausalLM.from_pretrained(awkward_model_dir)
    params = sum(p.numel() for p in hf.parameters())
    c = AutoConfig.from_pretrained(awkward_model_dir)
    head_dim = c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    projections = c.num_hidden_layers * (c.hidden_size * (q + 2 * kv) + q * c.hidden_size
                                         + 3 * c.hidden_size * c.intermediate_size)
    assert weights_nbytes(awkward_model_dir, torch.float32) == 4 * params
    assert weights_nbytes(awkward_model_dir, torch.bfloat16) == 2 * params
    assert weights_nbytes(awkward_model_dir, torch.bfloat16, 0.5) == 2 * (params - projections) + projections // 2


def test_pdserve_up_hands_its_gpu_placement_and_kv_transport_to_the_workers():
    """The controller passes ``cuda`` where its placement gave each worker a GPU (the workers had computed
    on the CPU whatever Ray reserved), and ``--kv-transport`` reaches every worker's config."""
    from pdserve.deploy import cluster_args

    cfg = cluster(worker_options={"kv_transport": "tcp"})
    for role in ("prefill", "decode", "both"):
        worker = cfg.worker_config(role, "w", "cuda")
        assert (worker.device, worker.kv_transport) == ("cuda", "tcp")
    assert cluster().worker_config("decode", "w").device == "auto"
    import argparse

    parser = argparse.ArgumentParser()
    cluster_args.add_cluster_args(parser)
    assert parser.parse_args([]).kv_transport == "auto"
    assert parser.parse_args(["--kv-transport", "tcp"]).kv_transport == "tcp"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-transport", "rdma"])
