"""A process's start: loading a model must not import ``torch._dynamo``; the router, the CLI and a worker's
command-line checks must not import torch at all.

Building a model on the meta device ran torch's Python decompositions (``nn.Embedding``'s ``normal_`` init, the
RoPE frequencies' arithmetic), whose first call imports ``torch._dynamo``: 1.2-2.5 s of every worker process's
start on these CPUs, and the larger part of the suite's many spawned workers' start-up. Checked in a fresh
interpreter, since pytest's own process has imported it long before.
"""

from __future__ import annotations

import json
import subprocess
import sys

from pdserve.deploy.config import EMBEDDED_MODEL
from tests.family_checkpoints import write_checkpoint

_SCRIPT = """
import json, sys
import torch
from pdserve.decode_worker.config import DecodeWorkerConfig
from pdserve.decode_worker.engine import DecodeEngine
from pdserve.decode_worker.warmup import warm_up_decode
from pdserve.model.loader import load_model
seen = {}
for path in sys.argv[1:]:
    model, cfg = load_model(path, dtype=torch.bfloat16)
    seen[path] = "torch._dynamo" in sys.modules
engine = DecodeEngine(DecodeWorkerConfig(model_dir=sys.argv[1], worker_id="w", num_blocks=80), *load_model(sys.argv[1]))
warm_up_decode(engine)
engine.receiver.close()
seen["engine"] = "torch._dynamo" in sys.modules
print(json.dumps(seen))
"""


def test_loading_models_and_warming_a_decode_engine_does_not_import_dynamo(tmp_path):
    moe = write_checkpoint("qwen3_moe", tmp_path / "moe")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, EMBEDDED_MODEL, moe], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not any(seen.values()), seen


def _maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def test_the_router_serves_without_loading_torch(fresh_cluster):
    """The router matches, admits and streams; it never runs a model, so it loads no libtorch (the import cost
    2.5 s of its start and 185 MB of its memory). Its workers do: the check can tell."""
    assert fresh_cluster.complete("Once upon a time", max_tokens=4).text
    assert "libtorch" not in _maps(fresh_cluster.router.proc.pid)
    assert "libtorch" in _maps(fresh_cluster.worker("p0").proc.pid)


def test_the_router_and_the_cli_import_without_torch():
    """``pdserve`` commands (status, down, pool) and a router start without torch: what they take from the layers
    below is torch-free (``model/sampling_types.py``, ``model/structured_spec.py``, ``model/model_dir.py``,
    ``kvtransfer/backends.py``, ``cluster/args.py``)."""
    code = "import sys, pdserve.deploy.cli, pdserve.router.__main__; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "False"


_BAD_FLAG = """
import runpy, sys
sys.argv = ["worker", "--model-dir", "{model}", "--worker-id", "w", "--num-blocks", "0"]
try:
    runpy.run_module("pdserve.{role}", run_name="__main__")
except SystemExit as exc:
    print(exc.code, "torch" in sys.modules)
"""


def test_a_worker_checks_its_command_line_before_loading_torch():
    """A worker process parses and checks its flags (:mod:`cluster.worker_config`) before it imports torch and its
    engine: a bad flag is answered with argparse's exit status 2 and the reason, without the seconds torch takes."""
    for role in ("decode_worker", "prefill_worker"):
        proc = subprocess.run([sys.executable, "-c", _BAD_FLAG.format(model=EMBEDDED_MODEL, role=role)],
                              capture_output=True, text=True, timeout=120)
        assert proc.stdout.split()[-2:] == ["2", "False"], (role, proc.stdout[-500:], proc.stderr[-3000:])
        assert "num_blocks must be positive, got 0" in proc.stderr, (role, proc.stderr[-1000:])
