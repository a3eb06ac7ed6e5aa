"""FP8 (e4m3) W8A8: quantization numerics (per-token/per-channel and DeepSeek-V3 1xG / GxG
groups), the CPU Fp8Linear path, the Triton GEMM under the interpreter (in a subprocess), and
first-token agreement on the real TinyStories model."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from pdserve.model.quant.fp8 import Fp8Linear, convert_for_runtime
from pdserve.model.quant.fp8_format import (
    E4M3_MAX,
    dequantize_e4m3,
    dequantize_e4m3_blocks,
    dequantize_e4m3_groups,
    quantize_e4m3,
    quantize_e4m3_blocks,
    quantize_e4m3_groups,
    to_e4m3_saturating,
)
from tests.triton_subprocess import run_script

ROOT = Path(__file__).resolve().parent.parent
TINYSTORIES = ROOT / "assets" / "models" / "tinystories-656k"


def _linear(k, n, bias=True, seed=0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias)


def test_round_trip_error_within_e4m3_precision():
    """|x - deq(q(x))| <= half an e4m3 ulp: 2**-4 |x| in the normal range, 2**-10 * scale below it."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 200, generator=g) * torch.logspace(-6, 4, 16)[:, None]   # rows of every magnitude
    x[3, :50] *= 1e-4                                                            # some subnormal codes
    q, s = quantize_e4m3(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (16,)
    err = (dequantize_e4m3(q, s) - x).abs()
    bound = torch.maximum(x.abs() * 2 ** -4, s[:, None] * 2 ** -10) * (1 + 1e-6)
    assert (err <= bound).all(), (err / bound).max()
    # each row's amax lands on the top code, 448
    assert torch.equal(q.float().abs().amax(-1), torch.full((16,), E4M3_MAX))
    torch.testing.assert_close(s, x.abs().amax(-1) / E4M3_MAX)


def test_out_of_range_values_saturate_instead_of_nan():
    x = torch.tensor([1e6, -1e6, 449.0, 464.0, 470.0, -500.0, float("inf"), -float("inf"), 3.0])
    q = to_e4m3_saturating(x).float()
    assert q.tolist() == [448.0, -448.0, 448.0, 448.0, 448.0, -448.0, 448.0, -448.0, 3.0]


@pytest.mark.parametrize("group_size", [None, 16])
def test_zero_rows_and_empty_input_give_no_nan(group_size):
    lin = _linear(40, 24)
    with torch.no_grad():
        lin.weight[5] = 0                                   # a zero weight row: amax 0 at load
        if group_size:
            lin.weight[16:, :16] = 0                        # and a whole zero 16x16 block (rows 16..23)
    f = Fp8Linear.from_linear(lin, group_size=group_size)
    assert torch.isfinite(f.weight_scale).all() and (f.weight_scale > 0).all()
    x = torch.randn(4, 40)
    x[2] = 0                                                # a zero token: amax 0 at run time
    y = f(x)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y[2], lin.bias.detach(), rtol=0, atol=0)
    torch.testing.assert_close(y[:, 5], lin.bias.detach()[5].expand(4), rtol=0, atol=0)
    assert f(torch.zeros(0, 40)).shape == (0, 24)
    assert f(torch.zeros(3, 0, 40)).shape == (3, 0, 24)


@pytest.mark.parametrize("k,n,bias", [(128, 384, False), (72, 100, True), (33, 7, True)])
def test_fp8linear_cpu_matches_reference_of_same_numerics_and_approximates_linear(k, n, bias):
    lin = _linear(k, n, bias)
    f = Fp8Linear.from_linear(lin)
    x = torch.randn(3, 11, k)
    y = f(x)
    assert y.shape == (3, 11, n) and y.dtype == torch.float32
    # independent reference in float64 of the same quantized numerics
    xq, sx = quantize_e4m3(x.reshape(-1, k))
    wq, sw = quantize_e4m3(lin.weight.detach())
    ref = (xq.double() @ wq.double().T) * sx.double()[:, None] * sw.double()[None, :]
    if bias:
        ref = ref + lin.bias.detach().double()
    torch.testing.assert_close(y.reshape(-1, n).double(), ref, rtol=1e-5, atol=1e-6)
    # and near the unquantized layer: e4m3 keeps ~2**-4 relative error per element
    exact = lin(x).detach()
    rel = (y - exact).norm() / exact.norm()
    assert rel < 0.04, rel


def test_fp8linear_bf16_input_and_cpu_bf16_matmul_option():
    lin = _linear(64, 48)
    x = torch.randn(9, 64)
    y32 = Fp8Linear.from_linear(lin)(x)
    y_bf = Fp8Linear.from_linear(lin)(x.bfloat16())
    assert y_bf.dtype == torch.bfloat16                                     # same numerics, bf16 out:
    torch.testing.assert_close(y_bf, Fp8Linear.from_linear(lin)(x.bfloat16().float()).bfloat16(), rtol=0, atol=0)
    y_mm_bf = Fp8Linear.from_linear(lin, cpu_matmul_dtype=torch.bfloat16)(x)
    assert y_mm_bf.dtype == torch.float32
    torch.testing.assert_close(y_mm_bf, y32, rtol=2 ** -7, atol=1e-2)       # bf16-rounded accumulator


def test_activation_scales_are_per_token():
    """Scaling one token by 1000 changes nothing in the other tokens' outputs."""
    f = Fp8Linear.from_linear(_linear(96, 40))
    x = torch.randn(8, 96)
    x_big = x.clone()
    x_big[3] *= 1000
    y, y_big = f(x), f(x_big)
    others = [i for i in range(8) if i != 3]
    torch.testing.assert_close(y_big[others], y[others], rtol=1e-6, atol=1e-7)
    # the scaled token itself quantizes to the same codes, so its output scales with it
    torch.testing.assert_close(y_big[3] - f.bias, (y[3] - f.bias) * 1000, rtol=1e-3, atol=1e-3)
    # batch-invariant: one token alone gives its row of the batch
    torch.testing.assert_close(f(x[5:6])[0], y[5], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("g", [16, 32, 128])
def test_group_and_block_quantization_round_trip_with_padding(g):
    """1xG tiles / GxG blocks with K=70, N=45 (no multiple of G): every tile's and block's
    amax lands on 448, scales have ceil() shapes, errors stay within half an e4m3 ulp."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 70, generator=gen) * torch.logspace(-3, 3, 70)      # magnitudes vary along K
    q, s = quantize_e4m3_groups(x, g)
    kg = -(-70 // g)
    assert q.shape == (5, 70) and q.dtype == torch.float8_e4m3fn and s.shape == (5, kg) and s.dtype == torch.float32
    w = torch.randn(45, 70, generator=gen) * torch.logspace(-2, 2, 45)[:, None]
    qw, sw = quantize_e4m3_blocks(w, g)
    assert qw.shape == (45, 70) and qw.dtype == torch.float8_e4m3fn and sw.shape == (-(-45 // g), kg)
    for j in range(kg):
        cols = slice(j * g, (j + 1) * g)
        assert torch.equal(q[:, cols].float().abs().amax(-1), torch.full((5,), E4M3_MAX))
        torch.testing.assert_close(s[:, j], x[:, cols].abs().amax(-1) / E4M3_MAX)
        for i in range(sw.shape[0]):
            assert qw[i * g:(i + 1) * g, cols].float().abs().max() == E4M3_MAX
            torch.testing.assert_close(sw[i, j], w[i * g:(i + 1) * g, cols].abs().max() / E4M3_MAX)
    for val, deq, sc in ((x, dequantize_e4m3_groups(q, s, g), s.repeat_interleave(g, 1)[:, :70]),
                         (w, dequantize_e4m3_blocks(qw, sw, g),
                          sw.repeat_interleave(g, 0)[:45].repeat_interleave(g, 1)[:, :70])):
        bound = torch.maximum(val.abs() * 2 ** -4, sc * 2 ** -10) * (1 + 1e-6)
        assert ((deq - val).abs() <= bound).all()


def test_group_scales_confine_an_outlier_to_its_tile():
    """An activation outlier changes only its own 1xG tile's codes; with a per-token scale it
    coarsens the whole token (the reason for fine-grained scaling, DeepSeek-V3 §3.3). e4m3's
    range is wide: at 1e4x the typical |x| per-token loses little (1.1-1.3x the group error);
    at 1e5x the rest of the token falls into the subnormals (step 2**-9 * scale)."""
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(0))
    x_out = x.clone()
    x_out[2, 5] = 1e5
    (q, s), (q2, s2) = quantize_e4m3_groups(x, 32), quantize_e4m3_groups(x_out, 32)
    changed = (q.view(torch.uint8) != q2.view(torch.uint8)).nonzero()
    assert changed[:, 0].eq(2).all() and changed[:, 1].lt(32).all()
    assert torch.equal(s[:, 1:], s2[:, 1:]) and torch.equal(s[[0, 1, 3]], s2[[0, 1, 3]])
    err_group = (dequantize_e4m3_groups(q2, s2, 32)[2, 32:] - x_out[2, 32:]).abs().mean()
    err_token = (dequantize_e4m3(*quantize_e4m3(x_out))[2, 32:] - x_out[2, 32:]).abs().mean()
    assert err_token > 4 * err_group, (err_token, err_group)                 # measured 6.9x


def _grouped_reference_f64(x2, w, g, bias):
    """Independent float64 reference: sum over K-groups of scaled partial products."""
    xq, sx = quantize_e4m3_groups(x2, g)
    wq, sw = quantize_e4m3_blocks(w, g)
    n = w.shape[0]
    ref = sum((xq[:, k0:k0 + g].double() @ wq[:, k0:k0 + g].double().T) * sx[:, j, None].double()
              * sw[torch.arange(n) // g, j].double()[None, :] for j, k0 in enumerate(range(0, w.shape[1], g)))
    return ref if bias is None else ref + bias.double()


@pytest.mark.parametrize("k,n,bias,g", [(128, 384, False, 16), (384, 128, True, 32), (72, 100, True, 32),
                                        (33, 7, True, 16), (72, 100, False, 128)])
def test_fp8linear_grouped_cpu_matches_per_group_reference(k, n, bias, g):
    lin = _linear(k, n, bias)
    f = Fp8Linear.from_linear(lin, group_size=g)
    assert f.group_size == g and f.weight_scale.shape == (-(-n // g), -(-k // g))
    x = torch.randn(3, 11, k)
    y = f(x)
    assert y.shape == (3, 11, n) and y.dtype == torch.float32
    ref = _grouped_reference_f64(x.reshape(-1, k), lin.weight.detach(), g, lin.bias)
    torch.testing.assert_close(y.reshape(-1, n).double(), ref, rtol=1e-5, atol=1e-6)
    exact = lin(x).detach()
    assert (y - exact).norm() / exact.norm() < 0.04
    # the kernels' torch reference (one fp32 matmul per K-group) agrees with the CPU path
    from pdserve.kernels.fp8_gemm_triton import fp8_gemm_reference
    xq, sx = quantize_e4m3_groups(x.reshape(-1, k), g)
    kref = fp8_gemm_reference(xq, sx, f.weight.t(), f.weight_scale.t(), torch.float32, f.bias, group_size=g)
    torch.testing.assert_close(kref, y.reshape(-1, n), rtol=1e-5, atol=1e-6)
    # bf16 CPU matmul: each group's partial product rounded to bf16 before its scales
    y_bf = Fp8Linear.from_linear(lin, cpu_matmul_dtype=torch.bfloat16, group_size=g)(x)
    torch.testing.assert_close(y_bf, y, rtol=2 ** -7, atol=1e-2)
    assert f(x.bfloat16()).dtype == torch.bfloat16


def test_group_size_validation():
    lin = _linear(40, 24)
    for bad in (0, -16, 8, 24, True, 16.0):
        with pytest.raises(ValueError, match="group_size"):
            Fp8Linear.from_linear(lin, group_size=bad)
    q, s = quantize_e4m3(lin.weight.detach())
    with pytest.raises(ValueError, match="weight_scale"):
        Fp8Linear(q, s, None, group_size=16)                        # per-channel scale, grouped layer
    qb, sb = quantize_e4m3_blocks(lin.weight.detach(), 16)
    with pytest.raises(ValueError, match="weight_scale"):
        Fp8Linear(qb, sb, None)                                     # block scale, per-channel layer
    assert "16x16 blocks" in repr(Fp8Linear(qb, sb, None, group_size=16))


def test_scaled_mm_path_padding_and_scales_on_cpu():
    """The >= sm89 branch's wiring (pad N, K to 16, column-major ``w.t()``, scales, bias, slicing),
    run through torch's slow CPU ``_scaled_mm``; both the fused row-wise (bf16) and the
    unit-scale fp32-accumulator variants must equal the CPU path."""
    if not hasattr(torch, "_scaled_mm"):
        pytest.skip("no torch._scaled_mm")
    f = Fp8Linear.from_linear(_linear(72, 100))                  # neither dim a multiple of 16
    x = torch.randn(13, 72)
    xq, sx = quantize_e4m3(x)
    torch.testing.assert_close(f._scaled_mm(xq, sx, torch.float32), f(x), rtol=1e-5, atol=1e-6)
    y_bf = f._scaled_mm(xq, sx, torch.bfloat16)
    assert y_bf.dtype == torch.bfloat16 and y_bf.shape == (13, 100)
    assert f._rowwise_ok                                         # the fused variant ran, no fallback
    torch.testing.assert_close(y_bf.float(), f(x), rtol=2 ** -7, atol=2 ** -7)


_INTERPRETER_SCRIPT = textwrap.dedent("""
    import json, os, sys
    assert os.environ["TRITON_INTERPRET"] == "1"
    import torch
    from pdserve.kernels.fp8_gemm_triton import fp8_gemm_reference, fp8_gemm_triton
    from pdserve.model.quant.fp8 import Fp8Linear
    from pdserve.model.quant.fp8_format import quantize_e4m3
    out = {}
    # every finite e4m3 code through the in-kernel bit decoding: column of codes times 1.0
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    a = codes.view(torch.float8_e4m3fn)[:, None]
    one = torch.ones(1, 1).to(torch.float8_e4m3fn)
    c = fp8_gemm_triton(a, torch.ones(len(codes)), one, torch.ones(1), torch.float32,
                        block_m=64, block_n=16, block_k=16)
    out["decode_exact"] = bool(torch.equal(c[:, 0], a[:, 0].float()))
    torch.manual_seed(0)
    for m, n, k in [(1, 17, 33), (37, 45, 70), (70, 19, 129)]:   # nothing a multiple of the tiles
        a, sa = quantize_e4m3(torch.randn(m, k) * 3)
        w, sw = quantize_e4m3(torch.randn(n, k))                  # [N, K]; the kernel reads w.t()
        bias = torch.randn(n)
        for dt in (torch.float32, torch.bfloat16):
            got = fp8_gemm_triton(a, sa, w.t(), sw, dt, bias=bias, block_m=16, block_n=16, block_k=32).float()
            ref = fp8_gemm_reference(a, sa, w.t(), sw, torch.float32, bias=bias)
            rel = ((got - ref).abs() / ref.abs().clamp(min=1e-6)).max().item()
            out[f"{m}x{n}x{k}_{str(dt)[6:]}"] = {"max_rel": rel, "shape_ok": list(got.shape) == [m, n]}
    # the CUDA-path wiring of Fp8Linear (weight.t() view, scales, bias) against its CPU path
    torch.manual_seed(1)
    lin = torch.nn.Linear(72, 100)
    f = Fp8Linear.from_linear(lin)
    x = torch.randn(13, 72)
    xq, sx = quantize_e4m3(x)
    got = fp8_gemm_triton(xq, sx, f.weight.t(), f.weight_scale, torch.float32, bias=f.bias)
    out["fp8linear_max_abs"] = (got - f(x)).abs().max().item()
    # per-group scales inside the K loop: K and N not multiples of G; K tile = G or smaller than G
    from pdserve.model.quant.fp8_format import quantize_e4m3_blocks, quantize_e4m3_groups
    grouped = {}
    for m, n, k, g, bk in [(1, 17, 33, 16, None), (37, 45, 70, 32, None), (37, 45, 70, 32, 16),
                           (70, 19, 129, 64, 32), (20, 130, 96, 128, None)]:
        a, sa = quantize_e4m3_groups(torch.randn(m, k) * 3, g)
        w, sw = quantize_e4m3_blocks(torch.randn(n, k), g)              # sw [Ng, Kg]; kernel reads sw.t()
        bias = torch.randn(n)
        ref = fp8_gemm_reference(a, sa, w.t(), sw.t(), torch.float32, bias=bias, group_size=g)
        for dt in (torch.float32, torch.bfloat16):
            got = fp8_gemm_triton(a, sa, w.t(), sw.t(), dt, bias=bias, group_size=g,
                                  block_m=16, block_n=16, block_k=bk).float()
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            grouped[f"{m}x{n}x{k}_g{g}_bk{bk}_{str(dt)[6:]}"] = {"err_over_max": err,
                                                                  "shape_ok": list(got.shape) == [m, n]}
    out["grouped"] = grouped
    f = Fp8Linear.from_linear(lin, group_size=32)                  # CUDA-path wiring with groups
    xq, sx = quantize_e4m3_groups(x, 32)
    got = fp8_gemm_triton(xq, sx, f.weight.t(), f.weight_scale.t(), torch.float32, bias=f.bias, group_size=32)
    out["fp8linear_grouped_max_abs"] = (got - f(x)).abs().max().item()
    print(json.dumps(out))
""")


def test_triton_kernel_under_interpreter_matches_reference():
    """Runs in a subprocess with TRITON_INTERPRET=1 set before Triton is imported there, so the
    result does not depend on which test module imported Triton first in this process."""
    pytest.importorskip("triton")
    res = run_script(_INTERPRETER_SCRIPT)
    assert res.pop("decode_exact")
    assert res.pop("fp8linear_max_abs") < 1e-5
    assert res.pop("fp8linear_grouped_max_abs") < 1e-5
    for name, r in res.pop("grouped").items():
        assert r["shape_ok"], name
        # relative to max|C|: a K tile smaller than G splits a group's sum (other fp32 order),
        # which the per-element relative error of near-zero outputs would blow up; bf16: one truncated ulp
        assert r["err_over_max"] <= (1e-6 if name.endswith("float32") else 2 ** -7), (name, r)
    for name, r in res.items():
        assert r["shape_ok"], name
        # fp32 out: only the fp32 summation order differs. bf16 out: the interpreter casts
        # fp32 -> bf16 by truncation (GPUs round to nearest even), so allow one bf16 ulp.
        assert r["max_rel"] <= (1e-5 if name.endswith("float32") else 2 ** -7), (name, r)


def _agreement(**kw):
    bench = pytest.importorskip("pdserve.bench.fp8_accuracy")
    prompts = bench.build_prompts()                                  # the full bench prompt set
    assert len(prompts) >= 64
    return bench.measure_first_token_agreement(TINYSTORIES, prompts, **kw)


@pytest.fixture(scope="module")
def tinystories_agreement():
    return _agreement()                                              # convert_for_runtime's defaults


@pytest.fixture(scope="module")
def tinystories_agreement_g16():
    return _agreement(group_size=16)


def test_convert_for_runtime_swaps_only_decoder_projections():
    from pdserve.model.loader import load_model

    model, cfg = load_model(TINYSTORIES)
    convert_for_runtime(model)
    convert_for_runtime(model)                                      # idempotent
    fp8 = [n for n, m in model.named_modules() if isinstance(m, Fp8Linear)]
    assert len(fp8) == 4 * cfg.num_layers
    assert {n.split(".", 2)[2] for n in fp8} == {"self_attn.qkv_proj", "self_attn.o_proj",
                                                "mlp.gate_up_proj", "mlp.down_proj"}
    assert [n for n, m in model.named_modules() if type(m) is nn.Linear] == ["lm_head"]
    assert model.lm_head.weight is model.embed_tokens.weight and model.lm_head.weight.dtype == torch.float32
    assert all(m.group_size is None for m in model.modules() if isinstance(m, Fp8Linear))   # default: per-channel


def test_convert_for_runtime_group_size_and_keep_high_precision():
    from pdserve.model.loader import load_model

    model, cfg = load_model(TINYSTORIES)
    with pytest.raises(ValueError, match="keep_high_precision"):
        convert_for_runtime(model, keep_high_precision=["mlp.up_proj"])
    with pytest.raises(ValueError, match="keep_high_precision"):
        convert_for_runtime(model, keep_high_precision=[f"{cfg.num_layers}.mlp.down_proj"])
    with pytest.raises(ValueError, match="group_size"):
        convert_for_runtime(model, group_size=24)
    convert_for_runtime(model, group_size=16, keep_high_precision=["mlp.down_proj", "0.self_attn.qkv_proj"])
    fp8 = {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert len(fp8) == 3 * cfg.num_layers - 1 and all(m.group_size == 16 for m in fp8.values())
    kept = sorted(n for n, m in model.named_modules() if type(m) is nn.Linear)
    assert kept == sorted(["lm_head", "layers.0.self_attn.qkv_proj"]
                          + [f"layers.{i}.mlp.down_proj" for i in range(cfg.num_layers)])


def test_tinystories_first_token_agreement_regression(tinystories_agreement):
    """Guards today's measured accuracy (90 prompts: 91.1% top-1, mean KL 0.0198 nats)."""
    r = tinystories_agreement
    assert r["num_prompts"] >= 64
    assert r["top1_agreement"] >= 0.88, r["top1_agreement"]
    assert r["mean_kl"] <= 0.03, r["mean_kl"]
    # every flip is a near-tie in fp32
    assert all(p["margin_fp32"] < 0.5 for p in r["per_prompt"] if p["top1_fp32"] != p["top1_fp8"])


def test_tinystories_group_size_16_lowers_kl(tinystories_agreement, tinystories_agreement_g16):
    """Measured (90 prompts): G=16 mean KL 0.0134 vs 0.0198 per-channel, top-1 93.3% vs 91.1%.
    Only the KL gain is asserted: one prompt is 1.1 points of top-1, which is noise-level."""
    r16 = tinystories_agreement_g16
    assert r16["num_prompts"] == tinystories_agreement["num_prompts"]
    assert r16["mean_kl"] <= 0.75 * tinystories_agreement["mean_kl"], (r16["mean_kl"], tinystories_agreement["mean_kl"])
    assert r16["top1_agreement"] >= 0.88, r16["top1_agreement"]


@pytest.mark.xfail(strict=True, reason=(
    "issue target not met on TinyStories-656K (90 bench prompts): per-channel default 91.1% top-1; "
    "DeepSeek-V3 groups G=128/64/32/16: 84.4/91.1/94.4/93.3%; reaching 97% needs 6 of 8 projections "
    "(83% of projection FLOPs) kept in fp32; e4m3's 3-bit mantissa, not scale granularity, limits it"))
def test_tinystories_first_token_agreement_meets_issue_target(tinystories_agreement):
    assert tinystories_agreement["top1_agreement"] >= 0.97
