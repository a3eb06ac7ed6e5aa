"""The INT4 x int8 VNNI kernel (kernels/cpu/gemv_int4.c) against an exact integer reference, and
Int4Linear's use of it: layouts in non-persistent buffers, path names, the portable fallback, and
the TinyStories model through the kernel against the exact-activation path."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.cpu import KernelUnavailable, available, library
from pdserve.kernels.cpu.int4 import (
    AMX_MIN_ROWS,
    gemm_int4_amx,
    gemv_int4,
    int4_amx_available,
    int4_available,
    int4_path,
    pack_int4_weight,
    quantize_activations,
)
from pdserve.model.hugepages import move_to_huge_pages
from pdserve.model.quant.int4 import Int4Linear, convert_for_runtime
from pdserve.model.quant.int4_format import dequantize_weight, padded_in_features, quantize_weight

REPO = Path(__file__).resolve().parents[1]
needs_vnni = pytest.mark.skipif(not int4_available(), reason="no C compiler or no AVX512-VNNI or AVX2 here")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _weight(n: int, k: int, g: int, seed: int = 0):
    torch.manual_seed(seed)
    w = torch.randn(n, k) * 0.05 + 0.01 * torch.randn(n, 1)     # row offsets: zeros far from 8 s
    return quantize_weight(w, g, "rtn")


def _quantize_ref(x: torch.Tensor, g: int, kp: int):
    """The kernel's activation quantization, written in torch: per row and group, a = max|x|,
    xq = round_half_even(x * (127 / a)) (0 where a = 0), sx = a / 127, each op one fp32 rounding
    (the divisions through float64: torch's vectorized fp32 division may multiply by a reciprocal)."""
    m = x.shape[0]
    xg = F.pad(x.float(), (0, kp - x.shape[1])).view(m, kp // g, g)
    a = xg.abs().amax(-1)
    inv = torch.where(a > 0, 127.0 / a.double(), 0.0).float()
    xq = torch.round(xg * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return xq.view(m, kp), (a.double() / 127).float()


def _reference(xq, sx, qw, s, z, k):
    """float64 ``y = sum_g sx (s dot(q, xq) + (z - 8 s) sum(xq))`` from the integers; and the
    magnitude ``|x^| @ |W^|.T`` that bounds its fp32 rounding."""
    m, kp = xq.shape
    g = kp // s.shape[1]
    xdq = (xq.double().view(m, -1, g) * sx.double()[..., None]).view(m, kp)[:, :k]
    w = dequantize_weight(qw, s, z, k).double()
    return xdq @ w.t(), xdq.abs() @ w.abs().t()


@needs_vnni
@pytest.mark.parametrize("g", [32, 64, 128, 256])
@pytest.mark.parametrize("n,k_groups,k_extra", [(17, 1, 0), (100, 3, -5), (16, 2, 0), (1, 1, -31)])
def test_kernel_matches_integer_reference(g, n, k_groups, k_extra):
    """Awkward shapes: N not a multiple of 16, K = one group, K short of a whole group; M in 1, 2, 3, 5, 17;
    fp32 and bf16 activations and outputs."""
    k = k_groups * g + k_extra
    qw, s, z = _weight(n, k, g)
    kp = padded_in_features(k, g)
    wq, sc, zc = pack_int4_weight(qw, s, z, g)
    for m in (1, 2, 3, 5, 17):
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(m, k) * torch.logspace(-2, 1, m)[:, None]).to(dtype)
            xq, sx, sxs = quantize_activations(x, g, kp)
            xq_ref, sx_ref = _quantize_ref(x, g, kp)
            assert torch.equal(xq, xq_ref) and torch.equal(sx, sx_ref)
            assert torch.allclose(sxs, sx * xq.view(m, -1, g).sum(-1).float(), rtol=1e-6, atol=0)
            ref, mag = _reference(xq, sx, qw, s, z, k)
            y32 = gemv_int4(x, wq, sc, zc, n, g, torch.float32)
            assert y32.shape == (m, n) and y32.dtype == torch.float32
            assert ((y32.double() - ref).abs() <= 4e-6 * mag + 1e-30).all(), ((y32.double() - ref).abs() / mag).max()
            y16 = gemv_int4(x, wq, sc, zc, n, g)
            assert y16.dtype == dtype
            if dtype == torch.bfloat16:                      # one rounding of the fp32 result to bf16
                assert torch.equal(y16, y32.to(torch.bfloat16))


@needs_vnni
def test_rows_do_not_depend_on_the_batch():
    """Row i's output is bitwise the same alone, in any batch size, and wherever it sits."""
    qw, s, z = _weight(100, 200, 64)
    wq, sc, zc = pack_int4_weight(qw, s, z, 64)
    x = torch.randn(17, 200).bfloat16()
    full = gemv_int4(x, wq, sc, zc, 100, 64)
    for i in range(17):
        assert torch.equal(gemv_int4(x[i:i + 1], wq, sc, zc, 100, 64), full[i:i + 1])
    for m in (2, 3, 5):
        assert torch.equal(gemv_int4(x[:m], wq, sc, zc, 100, 64), full[:m])
    assert torch.equal(gemv_int4(x.flip(0), wq, sc, zc, 100, 64), full.flip(0))


@needs_vnni
def test_zero_and_nan_activations_and_strided_rows():
    qw, s, z = _weight(40, 128, 32)
    wq, sc, zc = pack_int4_weight(qw, s, z, 32)
    x = torch.randn(3, 128)
    x[1] = 0.0
    x[2, :32] = 0.0                                             # one group of zeros: sx = 0, no NaN
    y = gemv_int4(x, wq, sc, zc, 40, 32)
    assert torch.equal(y[1], torch.zeros(40)) and torch.isfinite(y).all()
    x[0, 5] = float("nan")                                      # NaN in, NaN out (that row only)
    y2 = gemv_int4(x, wq, sc, zc, 40, 32)
    assert y2[0].isnan().all() and torch.equal(y2[1:], y[1:])
    wide = torch.randn(3, 160)
    assert torch.equal(gemv_int4(wide[:, :128], wq, sc, zc, 40, 32), gemv_int4(wide[:, :128].contiguous(),
                                                                             wq, sc, zc, 40, 32))


@needs_vnni
def test_bad_inputs_are_refused():
    qw, s, z = _weight(40, 128, 32)
    wq, sc, zc = pack_int4_weight(qw, s, z, 32)
    x = torch.randn(2, 128)
    bad_calls = [
        lambda: gemv_int4(x.half(), wq, sc, zc, 40, 32),                     # dtype
        lambda: gemv_int4(x.to(torch.int32), wq, sc, zc, 40, 32),
        lambda: gemv_int4(torch.randn(2, 129), wq, sc, zc, 40, 32),          # wider than Kp
        lambda: gemv_int4(x[None], wq, sc, zc, 40, 32),                      # 3-D
        lambda: gemv_int4(torch.randn(128, 2).t(), wq, sc, zc, 40, 32),      # column stride
        lambda: gemv_int4(x, wq, sc, zc, 40, 64),                            # group size of another weight
        lambda: gemv_int4(x, wq, sc, zc, 40, 24),
        lambda: gemv_int4(x, wq, sc, zc, 49, 32),                            # out_features beyond the blocks
        lambda: gemv_int4(x, wq, sc, zc, 32, 32),                            # a whole block unused
        lambda: gemv_int4(x, wq, sc.double(), zc, 40, 32),
        lambda: gemv_int4(x, wq[:, :-1], sc, zc, 40, 32),
        lambda: gemv_int4(x, wq.view(torch.int8), sc, zc, 40, 32),
        lambda: gemv_int4(x, wq, sc, zc, 40, 32, torch.float16),
        lambda: pack_int4_weight(qw, s[:, :1], z, 32),
        lambda: pack_int4_weight(qw, s, z, 48),
        lambda: pack_int4_weight(qw.float(), s, z, 32),
    ]
    for call in bad_calls:
        with pytest.raises(ValueError):
            call()


# ----------------------------------------------------------------------------- Int4Linear on the kernel

def _module(k=200, n=100, g=64, bias=True, seed=0) -> tuple[nn.Linear, Int4Linear]:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    return lin, Int4Linear.from_linear(lin, g, "rtn")


@needs_vnni
def test_int4_linear_runs_the_kernel_with_layout_in_non_persistent_buffers():
    _, mod = _module()
    before = {name: t.clone() for name, t in mod.state_dict().items()}
    mod.prepare()
    state = mod.state_dict()
    assert set(state) == {"qweight", "scales", "zeros", "bias"}                 # the portable format only
    assert all(torch.equal(state[name], t) for name, t in before.items())
    assert {name for name, _ in mod.named_buffers()} >= {"vnni_wq", "vnni_scales", "vnni_zc"}
    assert mod.kernel_for(1) == "int4-vnni"
    assert mod.kernel_for(mod.dequant_min_rows_vnni - 1) == ("int4-amx" if int4_amx_available() else "int4-vnni")
    assert mod.kernel_for(mod.dequant_min_rows_vnni) == "int4-dequant-F.linear"
    x = torch.randn(2, 3, 200)
    with torch.inference_mode():
        y = mod(x)
        xq, sx = _quantize_ref(x.view(6, 200), 64, 256)
        ref, mag = _reference(xq, sx, mod.qweight, mod.scales, mod.zeros, 200)
        assert y.shape == (2, 3, 100) and y.dtype == torch.float32
        err = (y.view(6, 100).double() - mod.bias.double() - ref).abs()
        assert (err <= 4e-6 * mag + 1e-6).all()
        for dtype in (torch.bfloat16, torch.float16):                           # fp16 runs in fp32
            yd = mod(x.to(dtype))
            assert yd.dtype == dtype
            torch.testing.assert_close(yd.float(), y, rtol=2 ** -7, atol=2 ** -7 * y.abs().max().item())
        ptr = mod.vnni_wq.data_ptr()
        moved = move_to_huge_pages(mod)                                         # the layout moves with the module
        assert moved > 0 and mod.vnni_wq.data_ptr() != ptr and mod._layout == "int4-vnni"
        assert torch.equal(mod(x), y)


@needs_vnni
def test_load_state_dict_rebuilds_the_layout_and_exact_cpu_takes_torch():
    _, a = _module(seed=0)
    _, b = _module(seed=1)
    x = torch.randn(1, 200)
    with torch.inference_mode():
        ya = a(x)
        b(x)
        b.load_state_dict(a.state_dict())
        assert torch.equal(b(x), ya)
        b.exact_cpu = True                                                      # torch's kernel, fp32 activations
        assert b.kernel_for(1) == "int4-torch"
        w = dequantize_weight(b.qweight, b.scales, b.zeros, 200)
        torch.testing.assert_close(b(x), F.linear(x, w, b.bias), rtol=1e-5, atol=1e-5)
        assert "vnni_wq" not in dict(b.named_buffers()) and "tinygemm_packed" in dict(b.named_buffers())


@needs_vnni
def test_a_cast_of_the_module_rebuilds_the_layout_from_the_cast_tensors():
    """``.to(bfloat16)`` casts the portable buffers (and would cast the fp32 layout): the layout is rebuilt."""
    _, mod = _module()
    x = torch.randn(2, 200)
    with torch.inference_mode():
        mod(x)
        mod.to(torch.bfloat16)
        assert mod.scales.dtype == torch.bfloat16 and "vnni_scales" not in dict(mod.named_buffers())
        y = mod(x)
        assert mod.vnni_scales.dtype == torch.float32 and mod.kernel_for(2) == "int4-vnni"
        fresh = Int4Linear(200, 100, True, 64)
        fresh.load_state_dict(mod.state_dict())                                 # bf16 values in fp32 buffers
        assert torch.equal(y, fresh(x))


_PORTABLE = r"""
import torch
from torch import nn
import torch.nn.functional as F
from pdserve.model.quant.int4 import Int4Linear
from pdserve.model.quant.int4_format import dequantize_weight
torch.manual_seed(0)
mod = Int4Linear.from_linear(nn.Linear(200, 100), 64)
x = torch.randn(3, 200)
assert mod.kernel_for(3) == "int4-torch", mod.kernel_for(3)
y = mod(x)
ref = F.linear(x, dequantize_weight(mod.qweight, mod.scales, mod.zeros, 200), mod.bias)
assert (y - ref).abs().max() <= ref.abs().max() * 2 ** -7, (y - ref).abs().max()
print("PORTABLE-OK")
"""


def test_without_the_kernel_int4_linear_keeps_torchs_path():
    """``PDSERVE_CPU_KERNELS=torch`` (as on a CPU without AVX-512): torch's tinygemm, same results."""
    env = {**os.environ, "PDSERVE_CPU_KERNELS": "torch", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", _PORTABLE], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "PORTABLE-OK" in proc.stdout, proc.stderr[-3000:]


@needs_vnni
def test_tinystories_through_the_kernel_tracks_exact_activations(model_dir):
    """Decode-sized steps (4 rows) of the INT4 model through the VNNI kernel (int8 activations) against
    the same INT4 weights with exact fp32 activations (dequantize + F.linear), over 256 tokens."""
    from pdserve.model.kv_cache import KVCacheSpec
    from pdserve.model.loader import load_model
    from pdserve.model.runner import ModelRunner, StepInput

    model, cfg = load_model(model_dir)
    convert_for_runtime(model, 128, "mse")
    exact = copy.deepcopy(model)
    for mod in exact.modules():
        if isinstance(mod, Int4Linear):
            mod.dequant_min_rows_vnni = 0                                      # every row count dequantizes
    ids = list(range(3, 259))
    out = {}
    for name, m in (("vnni", model), ("exact", exact)):
        assert m.layers[0].mlp.down_proj.kernel_for(4) == (int4_path(4) if name == "vnni" else "int4-dequant-F.linear")
        runner = ModelRunner(m, KVCacheSpec(17, cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim))
        with torch.inference_mode():
            out[name] = torch.cat([runner.run([StepInput(ids[i:i + 4], i, list(range(17)))], all_logits=True)
                                   for i in range(0, len(ids), 4)]).float()
    kl = F.kl_div(out["vnni"].log_softmax(-1), out["exact"].log_softmax(-1), log_target=True,
                  reduction="batchmean").item()
    top1 = (out["vnni"].argmax(-1) == out["exact"].argmax(-1)).float().mean().item()
    print(f"vnni vs exact activations: mean KL {kl:.5f}, top-1 agreement {top1:.4f}")
    assert kl < 0.01 and top1 > 0.9, (kl, top1)


@pytest.mark.skipif(not (available("gemv_int4") and available("gemv_int4_avx2")), reason="needs AVX512-VNNI")
@pytest.mark.parametrize("m,n,k,g", [(1, 100, 200, 32), (5, 48, 768, 128), (4, 2048, 768, 64), (9, 17, 90, 32)])
def test_avx2_and_vnni_int4_kernels_are_bit_identical(monkeypatch, m, n, k, g):
    """The same integer dot products and the same float steps per lane: an AVX2 CPU serves the VNNI
    kernel's bits, bf16 and fp32, at every row tail."""
    from pdserve.kernels.cpu import int4 as kint4
    qw, s, z = _weight(n, k, g, seed=m)
    packed = pack_int4_weight(qw, s, z, g)
    x = torch.randn(m, k)
    for dtype in (torch.float32, torch.bfloat16):
        vnni = gemv_int4(x.to(dtype), *packed, n, g, dtype)
        monkeypatch.setattr(kint4, "int4_library", lambda: "gemv_int4_avx2")
        avx2 = gemv_int4(x.to(dtype), *packed, n, g, dtype)
        monkeypatch.undo()
        assert torch.equal(vnni, avx2)


@pytest.mark.skipif(not int4_amx_available(), reason="no AMX-INT8 here")
@pytest.mark.parametrize("n,k,g", [(100, 200, 32), (48, 768, 128), (40, 512, 256), (17, 90, 32), (96, 384, 64)])
def test_amx_int4_kernel_is_bit_identical_to_the_vector_kernel(n, k, g):
    """The AMX-INT8 path (tdpbsud on nibbles unpacked in L1, then the VNNI kernel's float steps) equals the
    vector kernel bit for bit at every row count: one tile's rows and fewer, a partial second tile, beyond 32
    rows (xq padded to whole 32-row chunks), N not a multiple of the two blocks it takes at a time, K short of
    a group, fp32 and bf16; NaN and zero rows stay in their rows."""
    qw, s, z = _weight(n, k, g, seed=n)
    packed = pack_int4_weight(qw, s, z, g)
    for m in (1, 3, 4, 16, 17, 32, 33, 70):
        x = torch.randn(m, k) * torch.logspace(-2, 1, m)[:, None]
        x[m // 2] = 0.0
        if m > 2:
            x[1, 3] = float("nan")
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            vector = torch.cat([gemv_int4(xd[i:i + 1], *packed, n, g, dtype) for i in range(m)])  # one row: VNNI
            amx = gemm_int4_amx(xd, *packed, n, g, dtype)
            assert torch.equal(amx.view(torch.uint8), vector.view(torch.uint8)), (m, dtype)
            assert torch.equal(gemv_int4(xd, *packed, n, g, dtype).view(torch.uint8), amx.view(torch.uint8))
    assert int4_path(AMX_MIN_ROWS - 1) == "int4-vnni" and int4_path(AMX_MIN_ROWS) == "int4-amx"
    assert library("gemv_int4").pd_int4_amx_min_rows() == AMX_MIN_ROWS          # the name follows the C dispatch


def test_amx_int4_path_is_refused_or_named_where_it_cannot_run():
    """Without AMX-INT8 the forced path raises KernelUnavailable and every row count is named int4-vnni."""
    if int4_amx_available():
        pytest.skip("AMX-INT8 is here: the bit-identity test covers it")
    qw, s, z = _weight(16, 64, 32)
    packed = pack_int4_weight(qw, s, z, 32)
    with pytest.raises(KernelUnavailable):
        gemm_int4_amx(torch.randn(8, 64), *packed, 16, 32)
    assert int4_path(64) == "int4-vnni"
