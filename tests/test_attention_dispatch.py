"""The metadata a decode step builds drives the Triton kernel to the same result as the torch path
(run under the Triton interpreter in a subprocess, so the import order of triton does not matter)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import torch
    from pdserve.kernels.paged_attention import build_attention_metadata, paged_attention_torch
    from pdserve.kernels.paged_attention_triton import paged_attention_decode_triton
    from pdserve.model.kv_cache import KVCacheSpec

    torch.manual_seed(0)
    spec = KVCacheSpec(num_blocks=20, num_layers=2, block_size=5, num_kv_heads=1, head_dim=24)
    cache = torch.randn(spec.shape)
    tables = [[3, 7, 1], [12], [0, 19, 4, 8]]
    seq_lens = [13, 2, 16]
    meta = build_attention_metadata([1, 1, 1], seq_lens, tables, spec.block_size)
    q = torch.randn(3, 3, 24)
    ref = paged_attention_torch(q, None, None, cache, 1, meta, 24 ** -0.5)
    out = paged_attention_decode_triton(q, cache, 1, meta.block_tables, meta.seq_lens, 24 ** -0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    print("ok")
""")


def test_decode_metadata_drives_the_triton_kernel_like_the_torch_path():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]
