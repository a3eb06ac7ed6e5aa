"""The GPU kernels with every family's shapes, under the Triton interpreter on CPU: whole-model
prefill and decode steps whose decode attention runs the paged-attention kernel (head_dim 20, 36,
40: not powers of two; Qwen3's q/k norm before it) and, in the float model's decode steps, RMSNorm,
RoPE with the KV write and SiLU-and-mul the Triton elementwise kernels, INT4 layers on the W4A16
kernel and FP8 layers on the FP8 GEMM kernel (Qwen2's q/k/v biases added in their epilogues),
against the torch paths they replace.

In a subprocess, so TRITON_INTERPRET=1 is set before Triton is imported there (see
tests/test_paged_attention_triton.py), with the checkpoints written here.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.family_checkpoints import FAMILIES, write_checkpoint
from tests.triton_subprocess import run_script

_SCRIPT = textwrap.dedent("""
    import copy, json, os, sys
    assert os.environ["TRITON_INTERPRET"] == "1"
    import torch
    from pdserve.kernels import paged_attention as pa
    from pdserve.kernels.fp8_gemm_triton import fp8_gemm_triton
    from pdserve.kernels.paged_attention_triton import paged_attention_decode_triton
    from pdserve.kernels.w4a16_triton import w4a16_matmul
    from pdserve.model import llama
    from pdserve.model.kv_cache import KVCacheSpec
    from pdserve.model.loader import load_model
    from pdserve.model.quant import fp8, fp8_format, int4

    def triton_attention(q, k, v, kv_cache, layer, meta, scale):       # the CUDA branch of pa.paged_attention
        if meta.decode_only and not meta.fresh_prefill:
            return paged_attention_decode_triton(q, kv_cache, layer, meta.block_tables, meta.seq_lens, scale)
        return pa.paged_attention_torch(q, k, v, kv_cache, layer, meta, scale)

    def int4_triton(self, x2):                                          # Int4Linear's CUDA branch
        return w4a16_matmul(x2, *self.triton_operands(), self.group_size, self.bias)

    def fp8_triton(self, x):                                            # Fp8Linear's non-sm89 CUDA branch
        x2 = x.reshape(-1, x.shape[-1])
        xq, sx = fp8_format.quantize_e4m3(x2)
        y = fp8_gemm_triton(xq, sx, self.weight.t(), self.weight_scale, out_dtype=x.dtype, bias=self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def run(model, cfg, prompts, fused=False):
        # prefill every prompt, then two decode steps over the batch (torch metadata: no C kernels);
        # fused: the decode steps' RMSNorm, RoPE + KV write and SiLU on the Triton elementwise kernels
        bs = 5
        spec = KVCacheSpec(48, cfg.num_layers, bs, cfg.num_kv_heads, cfg.head_dim)
        cache = spec.allocate("cpu")
        tables = [list(range(12 * i, 12 * i + 12)) for i in range(len(prompts))]
        seqs = [list(p) for p in prompts]
        for s, t in zip(seqs, tables):
            meta = pa.build_attention_metadata([len(s)], [len(s)], [t], bs, "cpu", None)
            s.append(int(model.compute_logits(model(torch.tensor(s), meta, cache))[-1].argmax()))
        out = []
        if fused:
            llama.triton_elementwise = lambda x: True
        for _ in range(2):
            meta = pa.build_attention_metadata([1] * len(seqs), [len(s) for s in seqs], tables, bs, "cpu", None)
            logits = model.compute_logits(model(torch.tensor([s[-1] for s in seqs]), meta, cache))
            out.append(logits)
            for s, row in zip(seqs, logits):
                s.append(int(row.argmax()))
        llama.triton_elementwise = elementwise
        return torch.cat(out)

    prompts = [[5, 9, 200, 31, 7, 8, 400], [11, 12, 13], list(range(40, 63))]
    int4.Int4Linear.exact_cpu = True          # the CPU kernel in float32, as the Triton one computes
    cpu_int4, cpu_fp8, elementwise = int4.Int4Linear._forward_cpu, fp8.Fp8Linear.forward, llama.triton_elementwise
    res = {}
    for family, path in json.loads(sys.argv[1]).items():
        model, cfg = load_model(path)
        q4, f8 = copy.deepcopy(model), copy.deepcopy(model)
        int4.convert_for_runtime(q4, group_size=32)
        fp8.convert_for_runtime(f8)
        ref = [run(m, cfg, prompts) for m in (model, q4, f8)]
        llama.paged_attention = triton_attention
        got = [run(model, cfg, prompts, fused=True)]                    # (interpreted: once per family)
        int4.Int4Linear._forward_cpu = int4_triton
        fp8.Fp8Linear.forward = fp8_triton
        got += [run(m, cfg, prompts) for m in (q4, f8)]
        llama.paged_attention = pa.paged_attention
        int4.Int4Linear._forward_cpu, fp8.Fp8Linear.forward = cpu_int4, cpu_fp8
        res[family] = {name: {"max_abs": (g - r).abs().max().item(), "scale": r.abs().max().item(),
                              "same_argmax": bool(torch.equal(g.argmax(-1), r.argmax(-1)))}
                       for name, g, r in zip(("float", "int4", "fp8"), got, ref)}
    print(json.dumps(res))
""")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    pytest.importorskip("triton")
    paths = {f: write_checkpoint(f, tmp_path_factory.mktemp(f"triton-{f}"), seed=5) for f in FAMILIES}
    return run_script(_SCRIPT, json.dumps(paths), timeout=280)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("path", ["float", "int4", "fp8"])
def test_triton_kernels_match_the_cpu_paths_for_every_family(results, family, path):
    """float: the attention kernel and the elementwise kernels; int4: W4A16 against torch's CPU INT4
    kernel, both in float32; fp8: the same e4m3 products; all differ only in summation order."""
    r = results[family][path]
    assert r["max_abs"] <= 1e-4 * max(r["scale"], 1.0) and r["same_argmax"], r
