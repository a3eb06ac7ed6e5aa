"""Shared fixtures: the real Redis, checkpoints, and clusters of real processes."""

from __future__ import annotations

import asyncio
import shutil
import time
import uuid
from pathlib import Path

import grpc
import pytest
import torch

from deploy import client
from deploy.cli import EMBEDDED_MODEL
from deploy.processes import RoleProcess, spawn_role
from deploy.redis_server import ensure_redis
from deploy.worker_process import default_redis_url

AWKWARD_SHAPES = dict(hidden_size=72, intermediate_size=100, num_hidden_layers=2, num_attention_heads=3,
                      num_key_value_heads=1, head_dim=24, vocab_size=1000, max_position_embeddings=256,
                      tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=500.0, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The real Redis the suite runs against (started with deploy's launcher if none answers)."""
    url = default_redis_url()
    proc = ensure_redis(url)
    yield url
    if proc is not None:
        proc.terminate()


@pytest.fixture(scope="session")
def model_dir() -> str:
    return EMBEDDED_MODEL


@pytest.fixture(scope="session")
def awkward_model_dir(tmp_path_factory) -> str:
    """A random-weight Llama with shapes that are multiples of nothing (head_dim 24, 1 KV head,
    hidden 72, vocab 1000, untied head), written by ``transformers`` itself."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("awkward-llama")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**AWKWARD_SHAPES))
    with torch.no_grad():  # larger weights than the default init, so greedy paths are not flat
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(EMBEDDED_MODEL) / name, out / name)
    return str(out)


class Cluster:
    """A router, prefill and decode workers as separate processes on a private registry namespace."""

    def __init__(self, model: str, redis_url: str, num_prefill: int = 1, num_decode: int = 1,
                 prefill_flags: dict | None = None, decode_flags: dict | None = None, router_flags: dict | None = None,
                 **worker_flags) -> None:
        self.model, self.redis_url, self.cluster = model, redis_url, "test-" + uuid.uuid4().hex[:8]
        common = dict(model_dir=model, cluster=self.cluster, redis_url=redis_url, lease_s=2.0, **worker_flags)
        self.workers: list[RoleProcess] = []
        try:
            for i in range(num_decode):
                flags = dict(worker_id=f"d{i}", **common, **(decode_flags or {}))
                self.workers.append(spawn_role("decode_worker", flags, f"d{i}"))
            for i in range(num_prefill):
                self.workers.append(spawn_role("prefill_worker",
                                               dict(worker_id=f"p{i}", **common, **(prefill_flags or {})), f"p{i}"))
            self.router = spawn_role("router", dict(model_dir=model, cluster=self.cluster, redis_url=redis_url,
                                                    kv_timeout_s=10.0, **(router_flags or {})), "router")
        except Exception:
            self.stop()
            raise
        self.address = self.router.address

    def run(self, coro_fn):
        """Run ``coro_fn(channel)`` against the router and return its result."""
        async def go():
            async with grpc.aio.insecure_channel(self.address) as channel:
                return await coro_fn(channel)
        return asyncio.run(go())

    def complete(self, prompt, **kw) -> client.Completion:
        return self.run(lambda ch: client.complete(ch, client.make_request(prompt, **kw), timeout_s=60))

    def state(self):
        return self.run(client.cluster_state)

    def assert_pools_free(self, timeout_s: float = 6.0) -> None:
        """Every worker's KV pool is back to fully free (as its heartbeats report)."""
        deadline = time.monotonic() + timeout_s
        while True:
            workers = self.state().workers
            busy = {w.worker_id: (w.num_free_blocks, w.num_total_blocks) for w in workers
                    if w.num_free_blocks != w.num_total_blocks}
            if not busy and workers:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"KV blocks still allocated (free, total): {busy}; workers: {len(workers)}")
            time.sleep(0.2)

    def stop(self) -> None:
        for p in [getattr(self, "router", None), *self.workers]:
            if p is not None:
                p.stop()


@pytest.fixture(scope="session")
def cluster(redis_url, model_dir):
    """1 prefill + 1 decode worker + router on the embedded model; pools checked free after each test."""
    c = Cluster(model_dir, redis_url)
    yield c
    c.stop()


@pytest.fixture
def fresh_cluster(cluster):
    """The session cluster, with a leak check after the test."""
    yield cluster
    cluster.assert_pools_free()


@pytest.fixture(scope="session")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """``transformers`` greedy generation: the output token ids (EOS included when reached)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long), pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()



