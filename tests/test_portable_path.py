"""The portable path, forced: with ``PDSERVE_CPU_KERNELS=torch`` no C kernel library is built or
loaded (as on a CPU without AVX-512 or without a compiler), and the bf16 model loaded as the decode
worker loads it still decodes greedily token for token as ``transformers`` does.

The check runs in a subprocess: :func:`kernels.cpu.available` caches its answer per process, so the
variable must be set before anything asks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = r"""
import json, sys
import torch
from transformers import AutoModelForCausalLM

from pdserve.decode_worker.config import DecodeWorkerConfig
from pdserve.decode_worker.server import load_decode_model
from pdserve.kernels.cpu import library
from pdserve.kernels.paged_attention import build_attention_metadata
from pdserve.model.cpu_linear import PackedBF16Linear, pack_for_cpu_decode
from pdserve.model.kv_cache import KVCacheSpec
from pdserve.model.runner import ModelRunner, StepInput

model_dir, prompts, new_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
cfg = DecodeWorkerConfig(model_dir=model_dir, worker_id="portable", dtype="bfloat16", num_blocks=64, block_size=4)
model, model_cfg = load_decode_model(cfg)
spec = KVCacheSpec.for_model(model_cfg, 64, 4, torch.bfloat16)
runner = ModelRunner(model, spec)
hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
ours, theirs = [], []
for i, prompt in enumerate(prompts):
    table = list(range(16 * i, 16 * i + 16))
    ids, out = list(prompt), []
    logits = runner.run([StepInput(ids, 0, table)])
    for _ in range(new_tokens):
        out.append(int(logits[0].argmax()))
        logits = runner.run([StepInput(out[-1:], len(ids), table)])
        ids.append(out[-1])
    ours.append(out)
    with torch.no_grad():
        gen = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0)
    theirs.append(gen[0, len(prompt):].tolist())
print(json.dumps({
    "ours": ours, "transformers": theirs,
    "weight_dtype": str(model.layers[0].mlp.down_proj.weight.dtype),
    "packed_modules": sum(isinstance(m, PackedBF16Linear) for m in model.modules()),
    "pack_for_cpu_decode": pack_for_cpu_decode(model),
    "attention_cpu_kernels": build_attention_metadata([1], [3], [[0]], 4, "cpu", torch.bfloat16).cpu_kernels,
    "libraries_loaded": library.cache_info().currsize,
}))
"""


def test_forced_portable_path_decodes_as_transformers_without_c_kernels(model_dir):
    prompts = [[1, 1094, 463, 622, 100, 258, 461, 715, 299], [1, 306, 1058, 45, 17]]
    env = {**os.environ, "PDSERVE_CPU_KERNELS": "torch"}
    proc = subprocess.run([sys.executable, "-c", PROBE, model_dir, json.dumps(prompts), "24"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["weight_dtype"] == "torch.bfloat16"
    assert got["packed_modules"] == 0 and got["pack_for_cpu_decode"] == 0     # projections stay nn.Linear
    assert got["attention_cpu_kernels"] is False                              # attention: the torch path
    assert got["libraries_loaded"] == 0                                       # no C library was even loaded
    assert got["ours"] == got["transformers"]
