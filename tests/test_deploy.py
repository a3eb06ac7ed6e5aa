"""The operator's commands: `pdserve up` on Ray, `pdserve generate`, and the Redis launcher."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import time

import pytest
import redis

from pdserve.deploy.redis_server import ensure_redis, redis_answers
from tests.clusters import PDSERVE, pdserve_up, stop_pdserve_up


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ensure_redis_starts_a_real_server_when_none_answers():
    url = f"redis://127.0.0.1:{_free_port()}/0"
    assert not redis_answers(url)
    proc = ensure_redis(url)
    try:
        assert proc is not None
        r = redis.Redis.from_url(url)
        r.set("k", "v")
        assert r.get("k") == b"v" and r.info("server")["redis_version"]
    finally:
        proc.terminate()
        proc.wait(5)


def test_ensure_redis_uses_a_running_server(redis_url):
    assert ensure_redis(redis_url) is None


def test_up_generate_and_clean_shutdown(redis_url, model_dir):
    """`pdserve up` on a local Ray instance (with chunked prefill, self-draft speculation and
    no graph runner) prints its cluster id, which `pdserve status` shows, serves `pdserve generate`,
    then exits cleanly on SIGINT."""
    env = {**os.environ, "PDSERVE_REDIS_URL": redis_url}
    with pdserve_up(["--model", model_dir, "--prefill", "1", "--decode", "1", "--speculative", "self",
                     "--max-num-batched-tokens", "8", "--no-graph"], env) as up:
        address, cluster_id, deadline = None, None, time.monotonic() + 120
        while cluster_id is None and time.monotonic() < deadline:
            if select.select([up.stdout], [], [], 0.5)[0]:
                line = up.stdout.readline()
                if line.startswith("router listening on "):
                    address = line.split()[-1]
                    line = up.stdout.readline()  # printed right after (maybe already in the read buffer)
                    assert line.startswith("cluster "), line
                    cluster_id = line.split()[1].rstrip(":")
                assert line or up.poll() is None, up.stderr.read()
        assert address and cluster_id, "pdserve up did not print its router address and cluster id"
        status = subprocess.run([*PDSERVE, "status", "--cluster", cluster_id], capture_output=True, text=True,
                                timeout=60, env=env)
        assert status.returncode == 0, status.stderr
        assert status.stdout.startswith(f"cluster {cluster_id}: prefill 1 worker, decode 1 worker\n")
        gen = subprocess.run([*PDSERVE, "generate", "--router", address, "--max-tokens", "12",
                              "Once upon a time, there was a little dog"],
                             capture_output=True, text=True, timeout=60, env=env)
        assert gen.returncode == 0, gen.stderr
        assert gen.stdout.startswith(". The dog liked to run and play")  # the model's known greedy continuation
        assert "TTFT" in gen.stderr and "TPOT" in gen.stderr
        stop_pdserve_up(up)


def test_make_model_writes_a_loadable_checkpoint(tmp_path):
    import torch

    from pdserve.deploy.make_model import PRESETS, make_model, num_parameters
    from pdserve.model.loader import load_model

    out = make_model("bench-9m", tmp_path / "m", seed=3, dtype="float32")
    model, cfg = load_model(out)
    assert sum(p.numel() for p in model.parameters()) == num_parameters(PRESETS["bench-9m"])
    assert cfg.num_kv_heads == 2 and not cfg.tie_word_embeddings and (out / "tokenizer.json").exists()
    again, _ = load_model(make_model("bench-9m", tmp_path / "m2", seed=3, dtype="float32"))
    assert torch.equal(model.layers[3].mlp.down_proj.weight, again.layers[3].mlp.down_proj.weight)  # seeded
    assert num_parameters(PRESETS["bench-80m"]) > 78e6


@pytest.mark.parametrize("flags, words", [
    (["--token-file", "/nonexistent/token"], "token_file"),
    (["--max-tokens-limit", "0"], "max_tokens_limit"),
    (["--num-blocks", "0"], "num_blocks must be positive"),
    (["--port", "70000"], "port must be in [0, 65535]"),
    (["--speculative", "draft"], "speculative=draft needs spec_draft_model"),
    (["--served-model-name", "foo"], "--served-model-name configure the HTTP API: they need --http-port"),
    (["--tool-call-parser", "hermes"], "--tool-call-parser configure the HTTP API: they need --http-port"),
    (["--reasoning-parser", "qwen3"], "--reasoning-parser configure the HTTP API: they need --http-port"),
    (["--colocated", "1", "--activations", "fp8"], "--activations configures prefill workers"),
    (["--redis-url", "garbage"], "redis_url must be a URL starting with redis://"),
])
def test_up_refuses_bad_settings_at_once_before_ray_starts(redis_url, model_dir, flags, words):
    """Settings the router or a worker would refuse fail `pdserve up` before Redis, Ray and the pools start:
    one line naming the setting, exit status 1 (it was a Ray traceback once the pools had loaded the model)."""
    env = {**os.environ, "PDSERVE_REDIS_URL": redis_url}
    up = subprocess.run([*PDSERVE, "up", "--model", model_dir, *flags], capture_output=True, text=True, timeout=120,
                        env=env)
    assert up.returncode == 1 and up.stderr.startswith("pdserve up: ") and words in up.stderr, up.stderr
    assert "Traceback" not in up.stderr and "ray" not in up.stderr.lower(), up.stderr
