"""Shared fixtures: the real Redis, checkpoints, and clusters of real processes (built by :mod:`tests.clusters`)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from pdserve.cluster.args import default_redis_url
from pdserve.deploy.config import EMBEDDED_MODEL
from pdserve.deploy.redis_server import ensure_redis
from pdserve.kernels.paged_attention import build_attention_metadata
from pdserve.model.kv_cache import KVCacheSpec
from tests.clusters import Cluster, PrivateRedis, live_role_children

AWKWARD_SHAPES = dict(hidden_size=72, intermediate_size=100, num_hidden_layers=2, num_attention_heads=3,
                      num_key_value_heads=1, head_dim=24, vocab_size=1000, max_position_embeddings=256,
                      tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=500.0, bos_token_id=1, eos_token_id=2)


def pytest_terminal_summary(terminalreporter) -> None:
    """Name every role process a test left running (its cluster name finds the test), then stop it; each
    would also stop by itself once pytest exits (``PDSERVE_PARENT_PID``)."""
    leaked = live_role_children()
    if leaked:
        terminalreporter.section("role processes left running by the tests")
    for pid, argv in leaked:
        terminalreporter.write_line(f"pid {pid}: {argv}")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


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


@pytest.fixture
def private_redis():
    """A Redis of the test's own, which the test may kill and restart."""
    r = PrivateRedis()
    yield r
    r.stop()


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


@pytest.fixture
def engine(model_dir):
    """A colocated decode engine in process on the embedded model: 64 blocks of 4 tokens, batch
    bound 4, an 8-token step budget (longer prompts are prefilled in chunks beside decodes)."""
    from pdserve.decode_worker.config import DecodeWorkerConfig
    from pdserve.decode_worker.engine import DecodeEngine
    from pdserve.model.loader import load_model

    model, cfg = load_model(model_dir)
    e = DecodeEngine(DecodeWorkerConfig(model_dir=model_dir, worker_id="t", num_blocks=64, block_size=4,
                                        max_batch_size=4, colocated=True, max_num_batched_tokens=8), model, cfg)
    yield e
    e.receiver.close()


def prefill_then_decode(prefill_model, decode_model, model_cfg, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy tokens as a disaggregated pair computes them, in process: ``prefill_model`` runs the prompt
    (the first token and the KV pages, fp32, 4 blocks of 16), ``decode_model`` continues over a copy of
    those pages (what the decode worker receives)."""
    from pdserve.model.kv_cache import KVCacheSpec
    from pdserve.model.runner import ModelRunner, StepInput

    spec = KVCacheSpec.for_model(model_cfg, 4, 16, torch.float32)
    prefill, decode = ModelRunner(prefill_model, spec), ModelRunner(decode_model, spec)
    table = [0, 1, 2, 3]
    out = [int(prefill.run([StepInput(prompt, 0, table)])[0].argmax())]
    decode.kv_cache.copy_(prefill.kv_cache)
    for i in range(num_tokens - 1):
        out.append(int(decode.run([StepInput([out[-1]], len(prompt) + i, table)])[0].argmax()))
    return out


@pytest.fixture
def env_choice(monkeypatch):
    """``env_choice(var, value, choice)``: set the environment override ``var`` to ``value`` (``None``:
    unset) and clear ``choice``, the cached function that reads it; at teardown the environment is
    restored and every choice touched cleared again, so no other test sees a forced kernel."""
    touched = []

    def set_choice(var: str, value: str | None, choice) -> None:
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
        choice.cache_clear()
        touched.append(choice)
    yield set_choice
    monkeypatch.undo()
    for choice in touched:
        choice.cache_clear()


@pytest.fixture(scope="module")
def one_torch_thread():
    """Small ops: one thread avoids OpenMP spin-waits when the 2 cores are busy (restored after the module).
    Use with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def all_logits(model, cfg, ids: list[int]) -> torch.Tensor:
    """Teacher-forced ``[len(ids), vocab]`` float32 logits of one sequence (one prefill pass)."""
    n, bs = len(ids), 16
    table = list(range(-(-n // bs)))
    kv = KVCacheSpec(len(table), cfg.num_layers, bs, cfg.num_kv_heads, cfg.head_dim).allocate("cpu")
    return model.compute_logits(model(torch.tensor(ids), build_attention_metadata([n], [n], [table], bs), kv))


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """``transformers`` greedy generation: the output token ids (EOS included when reached)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long), pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


CHATML = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHAT_MODEL = "tinystories-chat"


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory, model_dir) -> str:
    """The embedded model with a ChatML-like chat template in its tokenizer_config.json."""
    out = tmp_path_factory.mktemp("chat") / CHAT_MODEL
    shutil.copytree(model_dir, out)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": CHATML}, indent=2))
    return str(out)


@pytest.fixture(scope="module")
def http_cluster(redis_url, chat_model_dir):
    """1 prefill + 1 decode worker + a router serving gRPC and the OpenAI HTTP API, on the templated
    checkpoint; one per test module that uses it (each test checks the pools free), stopped at the
    module's end so its processes and channels do not outlive it (tests that count the process's file
    descriptors run later)."""
    c = Cluster(chat_model_dir, redis_url, router_flags={"http_port": 0})
    yield c
    c.stop()
