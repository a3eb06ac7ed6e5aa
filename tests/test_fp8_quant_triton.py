"""The one-kernel per-token FP8 quantization (``kernels/fp8_quant_triton.py``) against
``quantize_e4m3`` bit for bit, under the Triton interpreter in a subprocess (TRITON_INTERPRET=1 must
be set before Triton is imported)."""

from __future__ import annotations

import textwrap

import pytest

from tests.triton_subprocess import run_script

_SCRIPT = textwrap.dedent("""
    import json, os
    assert os.environ["TRITON_INTERPRET"] == "1"
    import torch
    from pdserve.kernels.fp8_quant_triton import quantize_e4m3_rows
    from pdserve.model.quant.fp8_format import quantize_e4m3

    def same(x):
        q, s = quantize_e4m3_rows(x)
        rq, rs = quantize_e4m3(x)
        k = x.shape[1]
        return {"shape": list(q.shape), "dtype": str(q.dtype),
                "scale_equal": bool(torch.allclose(s, rs, rtol=0, atol=0, equal_nan=True)),
                "codes_equal": bool(torch.equal(q.view(torch.uint8)[:, :k], rq.view(torch.uint8))),
                "pad_zero": not bool(q.view(torch.uint8)[:, k:].any())}

    out = {}
    torch.manual_seed(0)
    for m, k in [(1, 33), (37, 70), (3, 4096), (2, 5000), (4, 16)]:   # K below, at and over one block
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            x = (torch.randn(m, k) * torch.logspace(-8, 3, m)[:, None]).to(dt)   # row scales 1e-8 .. 1e3
            if m > 2:
                x[1] = 0                                                          # amax floor
            out[f"{m}x{k}_{str(dt)[6:]}"] = same(x)
    # every e4m3 value, every midpoint between neighbours and its two fp32 neighbours, both signs,
    # with 448 in the row so the scale is exactly 1: each rounding boundary, ties to even included
    codes = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (codes[1:] + codes[:-1]) / 2
    vals = torch.cat([codes, mids, mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9))])
    out["boundaries"] = same(torch.cat([vals, -vals, torch.tensor([448.0])])[None])
    x = torch.randn(3, 40)
    x[0, 5], x[1, 3] = float("nan"), float("inf")                     # NaN row, inf row, a plain row
    out["nonfinite"] = same(x)
    x = torch.randn(6, 64)[:, ::2]                                    # a K stride other than 1 is refused
    try:
        quantize_e4m3_rows(x)
        out["strided_refused"] = False
    except ValueError:
        out["strided_refused"] = True
    print(json.dumps(out))
""")


def test_quantize_rows_kernel_matches_torch_bit_for_bit_under_interpreter():
    pytest.importorskip("triton")
    res = run_script(_SCRIPT)
    assert res.pop("strided_refused")
    assert res["2x5000_float32"]["shape"] == [2, 5008]               # padded to 16 for cuBLASLt
    for name, r in res.items():
        assert r["dtype"] == "torch.float8_e4m3fn", name
        assert r["scale_equal"] and r["codes_equal"] and r["pad_zero"], (name, r)
