"""Shared fixtures: the real Redis, checkpoints, and clusters of real processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch

from pdserve.cluster.args import default_redis_url
from pdserve.deploy import client
from pdserve.deploy.config import EMBEDDED_MODEL
from pdserve.deploy.processes import RoleProcess, spawn_role
from pdserve.deploy.redis_server import ensure_redis, redis_answers, redis_server_binary

AWKWARD_SHAPES = dict(hidden_size=72, intermediate_size=100, num_hidden_layers=2, num_attention_heads=3,
                      num_key_value_heads=1, head_dim=24, vocab_size=1000, max_position_embeddings=256,
                      tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=500.0, bos_token_id=1, eos_token_id=2)


def proc_state(pid: int) -> tuple[str, int] | None:
    """``(state, parent pid)`` of process ``pid`` from ``/proc`` (state ``"Z"``: exited, not yet reaped);
    None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1])


def live_role_children() -> list[tuple[int, str]]:
    """(pid, command line) of this process's children still running as ``python -m pdserve.<role>``."""
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or (state := proc_state(int(entry.name))) is None:
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if state[0] != "Z" and state[1] == me and any(a.startswith(b"pdserve.") for a in argv):
            found.append((int(entry.name), b" ".join(argv).decode(errors="replace")[:300]))
    return found


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


class Cluster:
    """A router, prefill and decode workers as separate processes on a private registry namespace.

    Workers are started in parallel (``worker_flags_by_name`` adds flags for one worker, e.g.
    ``{"p0": {"fault_hold_transfer_s": 1.0}}``); :meth:`kill` and :meth:`restart_router` inject faults.
    """

    def __init__(self, model: str, redis_url: str, num_prefill: int = 1, num_decode: int = 1,
                 prefill_flags: dict | None = None, decode_flags: dict | None = None, router_flags: dict | None = None,
                 worker_flags_by_name: dict[str, dict] | None = None, **worker_flags) -> None:
        self.model, self.redis_url, self.cluster = model, redis_url, "test-" + uuid.uuid4().hex[:8]
        common = dict(model_dir=model, cluster=self.cluster, redis_url=redis_url, lease_s=2.0) | worker_flags
        by_name = worker_flags_by_name or {}
        specs = [("decode_worker", f"d{i}", decode_flags) for i in range(num_decode)]
        specs += [("prefill_worker", f"p{i}", prefill_flags) for i in range(num_prefill)]
        self.router_flags = dict(model_dir=model, cluster=self.cluster, redis_url=redis_url, kv_timeout_s=10.0
                                 ) | (router_flags or {})
        self.workers: list[RoleProcess] = []
        with ThreadPoolExecutor(max_workers=len(specs) + 1) as pool:
            futures = [pool.submit(spawn_role, module, dict(worker_id=name, **common | (flags or {})
                                                            | by_name.get(name, {})), name)
                       for module, name, flags in specs]
            futures.append(pool.submit(spawn_role, "router", self.router_flags, "router"))
            errors = []
            for f in futures:
                try:
                    proc = f.result()
                except Exception as exc:
                    errors.append(exc)
                    continue
                if proc.name == "router":
                    self.router = proc
                else:
                    self.workers.append(proc)
        if errors:
            self.stop()
            raise errors[0]
        self.address = self.router.address
        try:  # started in parallel: the router may have read the registry before the last worker registered
            self.wait_workers({name for _, name, _ in specs})
        except AssertionError:
            self.stop()
            raise

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

    def slo_when(self, predicate, timeout_s: float = 5.0):
        """The cluster's SLO attainment counters once ``predicate(slo)`` holds (the router writes
        outcomes to Redis in the background, just after each stream ends)."""
        deadline = time.monotonic() + timeout_s
        while not predicate(slo := self.state().slo):
            if time.monotonic() > deadline:
                raise AssertionError(f"SLO counters never satisfied the condition: {slo}")
            time.sleep(0.05)
        return slo

    def worker(self, name: str) -> RoleProcess:
        return next(p for p in self.workers if p.name == name)

    def kill(self, name: str) -> None:
        """``kill -9`` one worker (or ``"router"``) and reap it."""
        proc = self.router if name == "router" else self.worker(name)
        proc.proc.kill()
        proc.proc.wait()

    def restart_router(self) -> None:
        """``kill -9`` the router, then start a new one on the same address."""
        self.kill("router")
        port = int(self.address.rsplit(":", 1)[1])
        self.router = spawn_role("router", {**self.router_flags, "port": port}, "router")
        assert self.router.address == self.address

    def wait_workers(self, names: set[str], timeout_s: float = 10.0) -> None:
        """Wait until the router lists exactly the workers ``names`` (leases lapsed or renewed)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                seen = {w.worker_id for w in self.state().workers}
            except grpc.aio.AioRpcError:
                seen = set()
            if seen == names:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"router lists workers {sorted(seen)}, expected {sorted(names)}")
            time.sleep(0.1)

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
        """SIGTERM every process at once, then wait for each (SIGKILL after its timeout)."""
        procs = [p for p in [getattr(self, "router", None), *self.workers] if p is not None]
        for p in procs:
            if p.proc.poll() is None:
                p.proc.terminate()
        for p in procs:
            p.stop()


def colocated_cluster(model: str, redis_url: str, **flags) -> Cluster:
    """A router and one colocated worker (role ``both``, id ``b0``: it prefills and decodes) on ``model``,
    with 4-token blocks; ``flags`` add to or override its flags (e.g. ``max_num_batched_tokens``)."""
    c = Cluster(model, redis_url, num_prefill=0, num_decode=0)
    flags = dict(model_dir=model, cluster=c.cluster, redis_url=redis_url, lease_s=2.0, block_size=4,
                 colocated="true") | flags
    c.workers.append(spawn_role("decode_worker", dict(worker_id="b0", **flags), "b0"))
    c.wait_workers({"b0"})
    return c


PDSERVE = [sys.executable, "-m", "pdserve.deploy.cli"]


@contextlib.contextmanager
def pdserve_up(args: list[str], env: dict[str, str]) -> Iterator[subprocess.Popen]:
    """``pdserve up ARGS`` in its own session (text stdout/stderr piped); a test ends it with
    :func:`stop_pdserve_up`, and whatever is still running at the block's exit is killed, its process group
    (Ray's) with it."""
    up = subprocess.Popen([*PDSERVE, "up", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env, start_new_session=True)
    try:
        yield up
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()


def stop_pdserve_up(up: subprocess.Popen) -> None:
    """SIGINT, as an operator's Ctrl-C: ``pdserve up`` must exit 0 within 60 s."""
    up.send_signal(signal.SIGINT)
    assert up.wait(60) == 0


class PrivateRedis:
    """A ``redis-server`` of its own on a free port (persistence off), for tests that restart Redis."""

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir = tempfile.mkdtemp(prefix="pdserve-private-redis-")
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self, timeout_s: float = 10.0) -> None:
        """Start it (empty) and wait until it answers PING."""
        self.proc = subprocess.Popen([redis_server_binary(), "--bind", "127.0.0.1", "--port", str(self.port),
                                      "--save", "", "--appendonly", "no", "--dir", self._dir],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while not redis_answers(self.url, 0.2):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"private redis-server on port {self.port} did not start")
            time.sleep(0.05)

    def kill(self) -> None:
        """``kill -9``: everything it held is lost."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self._dir, ignore_errors=True)


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
