"""The Triton elementwise kernels (RMSNorm, SiLU-and-mul, RoPE with the KV write) against the torch
code they replace on CUDA, under the Triton interpreter on CPU.

In one subprocess, so TRITON_INTERPRET=1 is set before Triton is imported there (see
tests/test_paged_attention_triton.py); each check is reported by its own test here.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.triton_subprocess import run_script

_SCRIPT = textwrap.dedent("""
    import json, os
    assert os.environ["TRITON_INTERPRET"] == "1"
    import torch
    import torch.nn.functional as F
    from pdserve.kernels import fused_triton as ft
    from pdserve.kernels.paged_attention import write_kv
    from pdserve.model.rope import apply_rotary

    def report(got, want):
        # max |difference| in units of the dtype's spacing at |want|; share of bit-identical elements
        ulp = torch.finfo(want.dtype).eps * want.float().abs().clamp_min(torch.finfo(want.dtype).tiny)
        diff = (got.float() - want.float()).abs()
        return {"ulps": float((diff / ulp).max()), "identical": float((got == want).float().mean()),
                "finite": bool(got.isfinite().all())}

    torch.manual_seed(0)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        for rows, n in ((1, 768), (5, 80), (3, 2048)):
            x = (torch.randn(rows, n) * 3).to(dtype)
            w = (1 + 0.1 * torch.randn(n)).to(dtype)
            xf = x.float()
            want = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
            out[f"rms_norm-{name}-{rows}x{n}"] = report(ft.rms_norm(x, w, 1e-5), want)
        qkv_view = torch.randn(4, 3 * 2 * 40).to(dtype)[:, 40:40 + 2 * 40].view(4, 2, 40)   # strided heads
        w = (1 + 0.1 * torch.randn(40)).to(dtype)
        xf = qkv_view.float()
        want = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
        out[f"rms_norm-{name}-strided-heads"] = report(ft.rms_norm(qkv_view, w, 1e-6), want)
        for rows, n in ((1, 2048), (7, 100)):
            gu = (torch.randn(rows, 2 * n) * 4).to(dtype)
            out[f"silu_and_mul-{name}-{rows}x{n}"] = report(ft.silu_and_mul(gu), F.silu(gu[:, :n]) * gu[:, n:])
        for tokens, heads, kv_heads, dim, bs in ((1, 4, 2, 64, 16), (9, 3, 1, 20, 5), (6, 8, 4, 128, 16)):
            qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
            q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
            q, k, v = (t.reshape(tokens, -1, dim) for t in (q, k, v))
            pos = torch.randint(0, 4000, (tokens,)).float()
            freqs = pos[:, None] * (10000.0 ** (-torch.arange(0, dim, 2).float() / dim))[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
            slots = torch.randperm(6 * bs)[:tokens]
            cache_want = torch.randn(6, 2, 2, bs, kv_heads, dim).to(dtype)
            cache_got = cache_want.clone()
            qw, kw = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            write_kv(cache_want, 1, kw, v, slots)
            qg, kg = ft.rope_write_kv(q, k, v, cos, sin, cache_got, 1, slots)
            key = f"rope_write_kv-{name}-{tokens}x{heads}/{kv_heads}x{dim}"
            out[key + "-q"], out[key + "-k"] = report(qg, qw), report(kg, kw)
            out[key + "-cache"] = report(cache_got, cache_want)
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def results() -> dict:
    pytest.importorskip("triton")
    return run_script(_SCRIPT, timeout=280, OMP_NUM_THREADS="1")


def test_every_check_ran(results):
    assert len(results) == 2 * (3 + 1 + 2 + 3 * 3)


@pytest.mark.parametrize("kind", ["rms_norm", "silu_and_mul", "rope_write_kv"])
def test_kernels_round_as_the_torch_code(results, kind):
    """RoPE and the KV write are bit-identical (same products, same roundings); RMSNorm's mean and
    SiLU's exp may differ in the last float32 bit, so a bf16 result may be one bf16 step away, rarely."""
    checks = {k: r for k, r in results.items() if k.startswith(kind)}
    assert checks
    for key, r in checks.items():
        assert r["finite"], key
        if kind == "rope_write_kv":
            assert r["identical"] == 1.0, (key, r)
        elif "float32" in key:
            assert r["ulps"] <= 8, (key, r)
        else:
            assert r["ulps"] <= 1 and r["identical"] >= 0.99, (key, r)
