"""Group-wise INT4 weight-only quantization: the math, Int4Linear on CPU (torch's int4 kernels),
the Triton W4A16 kernel under the interpreter, and the TinyStories model end to end."""

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

from pdserve.kernels.cpu.int4 import int4_available
from pdserve.model.kv_cache import KVCacheSpec
from pdserve.model.loader import load_model
from pdserve.model.quant.int4 import Int4Linear, convert_for_runtime
from pdserve.model.quant.int4_format import dequantize_weight, pack_int4, quantize_weight, unpack_int4
from pdserve.model.runner import ModelRunner, StepInput
from tests.conftest import all_logits

REPO = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _int4_pair(k: int, n: int, g: int, bias: bool, method: str = "mse", seed: int = 0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    return lin, Int4Linear.from_linear(lin, g, method)


# ----------------------------------------------------------------------------- quantization math

def test_pack_unpack_round_trip():
    q = torch.randint(0, 16, (5, 12), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(q)), q)
    assert pack_int4(torch.tensor([[3, 12]]))[0, 0] == 3 | (12 << 4)   # even column -> low nibble


@pytest.mark.parametrize("shape,g", [((100, 72), 32), ((128, 384), 128), ((33, 100), 64), ((16, 40), 128)])
def test_rtn_error_is_at_most_half_a_step_per_group(shape, g):
    """RTN: |W - W^| <= scale / 2 in every group (padding columns excluded from the statistics)."""
    n, k = shape
    w = torch.randn(n, k) * 0.05
    w[0, : min(k, g)] = 0.25                                     # a flat group: reconstructed exactly
    qw, s, z = quantize_weight(w, g, "rtn")
    kp = -(-k // g) * g
    assert qw.shape == (n, kp // 2) and qw.dtype == torch.uint8 and s.shape == z.shape == (n, kp // g)
    err = (dequantize_weight(qw, s, z, k) - w).abs()
    bound = s.repeat_interleave(g, dim=1)[:, :k] / 2
    assert (err <= bound * (1 + 1e-5) + 1e-7).all(), (err - bound).max()
    assert err[0, : min(k, g)].max() < 1e-6


def test_scale_search_lowers_squared_error():
    """The clip search + least-squares refit (``mse``) beats min/max RTN on Gaussian weights."""
    torch.manual_seed(0)
    w = torch.randn(256, 384)
    for g in (32, 128):
        errs = {m: ((dequantize_weight(*quantize_weight(w, g, m), 384) - w) ** 2).sum().item()
                for m in ("rtn", "mse")}
        assert errs["mse"] < 0.93 * errs["rtn"], errs


def test_bad_settings_are_clear_errors():
    with pytest.raises(ValueError, match="group_size"):
        quantize_weight(torch.randn(16, 64), 48)
    with pytest.raises(ValueError, match="method"):
        quantize_weight(torch.randn(16, 64), 32, "awq")


# ----------------------------------------------------------------------------- Int4Linear on CPU

def _reference(m: Int4Linear, x: torch.Tensor, kernel_dtype: torch.dtype) -> torch.Tensor:
    """Dequantize-then-matmul in fp32 with the rounding the CPU kernel applies in ``kernel_dtype``
    (activations, scales and zeros rounded to it; output rounded to it, then to ``x.dtype``)."""
    s, z = m.scales.to(kernel_dtype).float(), m.zeros.to(kernel_dtype).float()
    w = dequantize_weight(m.qweight, s, z, m.in_features)
    y = (x.to(kernel_dtype).float() @ w.t()).to(kernel_dtype).to(x.dtype)
    return y + m.bias.to(x.dtype) if m.bias is not None else y


def _default_reference(m: Int4Linear, x: torch.Tensor) -> torch.Tensor:
    """What the default CPU path computes: with the VNNI kernel, activations quantized to int8 per row
    and group (``round(x * 127 / max|x|)``, scale ``max|x| / 127``), fp32 products, output in ``x.dtype``;
    otherwise :func:`_reference` in bf16."""
    if m.kernel_for(x.numel() // m.in_features) not in ("int4-vnni", "int4-amx"):     # the same bits
        return _reference(m, x, torch.bfloat16)
    g, kp = m.group_size, m.qweight.shape[1] * 2
    xg = F.pad(x.float().reshape(-1, m.in_features), (0, kp - m.in_features)).view(-1, kp // g, g)
    a = xg.abs().amax(-1, keepdim=True).double()
    xq = torch.round(xg * torch.where(a > 0, 127 / a, 0.0).float()).clamp(-127, 127)
    xd = (xq * (a / 127).float()).view(-1, kp)[:, : m.in_features]
    y = (xd @ dequantize_weight(m.qweight, m.scales, m.zeros, m.in_features).t()).to(x.dtype)
    y = y + m.bias.to(x.dtype) if m.bias is not None else y
    return y.view(*x.shape[:-1], m.out_features)


@pytest.mark.parametrize("k,n,g,bias", [(384, 128, 128, False), (72, 100, 32, True), (72, 100, 128, True),
                                        (128, 1152, 64, False), (100, 33, 64, True)])
def test_int4_linear_cpu_matches_dequantized_matmul(k, n, g, bias):
    lin, m = _int4_pair(k, n, g, bias)
    x = torch.randn(2, 3, k)
    with torch.inference_mode():
        # exact mode: the kernel in fp32, against fp32 dequantize-then-matmul
        m.exact_cpu = True
        torch.testing.assert_close(m(x), _reference(m, x, torch.float32), rtol=1e-5, atol=1e-5)
        # default: the VNNI kernel (int8 activations) where it runs, else torch's kernel in bf16
        m.exact_cpu = False
        for xx in (x, x.bfloat16()):
            y, ref = m(xx), _default_reference(m, xx)
            assert y.dtype == xx.dtype and y.shape == (2, 3, n)
            torch.testing.assert_close(y.float(), ref.float(), rtol=0, atol=ref.abs().max().item() * 2 ** -7)
        # many rows: dequantize + dense matmul, fp32 throughout
        xl = torch.randn(max(m.dequant_min_rows, m.dequant_min_rows_vnni) + 5, k)
        assert m.kernel_for(xl.shape[0]) == "int4-dequant-F.linear"
        w = dequantize_weight(m.qweight, m.scales, m.zeros, k)
        torch.testing.assert_close(m(xl), F.linear(xl, w, lin.bias), rtol=1e-5, atol=1e-5)
        # and the quantized layer is close to the float one (sanity of the whole format)
        rel = (m(xl) - lin(xl)).norm() / lin(xl).norm()
        assert rel < 0.15, rel


def test_int4_linear_state_dict_round_trip_rebuilds_kernel_layout():
    _, a = _int4_pair(72, 100, 32, True, seed=0)
    _, b = _int4_pair(72, 100, 32, True, seed=1)
    x = torch.randn(1, 72)
    ya, yb = a(x), b(x)                                          # both prepared
    b.load_state_dict(a.state_dict())                            # in-place copy into prepared buffers
    assert set(a.state_dict()) == {"qweight", "scales", "zeros", "bias"}
    torch.testing.assert_close(b(x), ya, rtol=0, atol=0)
    assert not torch.equal(ya, yb)


# ----------------------------------------------------------------------------- Triton kernel

_TRITON_SCRIPT = r"""
import torch
from torch import nn
from pdserve.kernels.w4a16_triton import w4a16_matmul, w4a16_matmul_reference
from pdserve.model.quant.int4 import Int4Linear
from pdserve.model.quant.int4_format import dequantize_weight
torch.manual_seed(0)
# split-K (None: the kernel's choice; 2 splits of 3 groups: the last one short), and 130 rows: dequantized
cases = [(72, 100, 32, True, 1, None), (384, 128, 128, False, 5, None), (130, 40, 64, True, 20, None),
         (130, 40, 64, True, 3, 2), (384, 128, 128, False, 4, 1), (130, 40, 64, True, 130, None)]
for k, n, g, bias, m_rows, splits in cases:
    lin = nn.Linear(k, n, bias=bias)
    mod = Int4Linear.from_linear(lin, g)
    qt, sz = mod.triton_operands()
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(m_rows, k).to(dtype)
        b = lin.bias.detach().to(dtype) if bias else None
        y = w4a16_matmul(x, qt, sz, g, b, num_splits=splits)
        ref = w4a16_matmul_reference(x, qt, sz, g, b)
        assert y.dtype == dtype and y.shape == (m_rows, n)
        tol = 1e-5 if dtype == torch.float32 else ref.abs().max().item() * 2 ** -7
        torch.testing.assert_close(y.float(), ref.float(), rtol=0, atol=tol)
        if dtype == torch.float32:   # the reference is the format's dequantize-then-matmul
            w = dequantize_weight(mod.qweight, mod.scales, mod.zeros, k)
            torch.testing.assert_close(ref, x @ w.t() + (b if bias else 0), rtol=1e-5, atol=1e-5)
    xs = torch.randn(k, 3).t()                                   # non-contiguous activations
    torch.testing.assert_close(w4a16_matmul(xs, qt, sz, g), w4a16_matmul_reference(xs, qt, sz, g),
                               rtol=0, atol=1e-5)
print("TRITON-OK")
"""


def test_triton_w4a16_kernel_under_interpreter_matches_reference():
    """In a subprocess, so TRITON_INTERPRET=1 is set before triton is first imported."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "TRITON-OK" in proc.stdout, proc.stderr[-3000:]


# ----------------------------------------------------------------------------- TinyStories end to end

@pytest.fixture(scope="module")
def tiny(model_dir):
    """The float model and 3 greedy continuations of it to 171 tokens (513 teacher-forced positions)."""
    from pdserve.model.tokenizer import Tokenizer

    model, cfg = load_model(model_dir)
    tok = Tokenizer(model_dir, cfg.bos_token_id)
    runner = ModelRunner(model, KVCacheSpec(11, cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim))
    seqs = []
    for prompt in ("Once upon a time, there was a little dog", "Lily and Ben went to the park",
                   "Tom had a red ball"):
        ids = tok.encode(prompt)
        step = StepInput(ids, 0, list(range(11)))
        while len(ids) < 171:                                    # greedy decode through the KV cache
            ids.append(int(runner.run([step])[0].argmax()))
            step = StepInput(ids[-1:], len(ids) - 1, list(range(11)))
        seqs.append(ids)
    return model, cfg, seqs, [all_logits(model, cfg, s) for s in seqs]


# Measured (pytest -q -s tests/test_int4.py -k agreement): see the printed lines; the 95% hoped for
# is not reached: this 656K-parameter model is so sensitive that quantizing any single one of its
# 8 linears alone costs 3-7 points (mse method).
@pytest.fixture(scope="module")
def agreement(tiny):
    """(method, group_size) -> (top-1 agreement, mean KL) against the float model."""
    model, cfg, seqs, refs = tiny
    out = {}
    for method in ("mse", "gptq"):
        for group_size in (32, 128):
            qmodel = copy.deepcopy(model)
            convert_for_runtime(qmodel, group_size, method)
            assert all(isinstance(layer.mlp.down_proj, Int4Linear) for layer in qmodel.layers)
            assert isinstance(qmodel.lm_head, nn.Linear) and isinstance(qmodel.embed_tokens, nn.Embedding)
            agree = positions = 0
            kl = 0.0
            for ids, ref in zip(seqs, refs):
                logits = all_logits(qmodel, cfg, ids)
                agree += int((logits.argmax(-1) == ref.argmax(-1)).sum())
                positions += len(ids)
                kl += F.kl_div(logits.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="sum").item()
            out[method, group_size] = (agree / positions, kl / positions)
            print(f"{method} group {group_size}: top-1 agreement {agree / positions:.4f} over {positions} "
                  f"positions, mean KL {kl / positions:.5f}")
    return out


@pytest.mark.parametrize("method,group_size,min_top1,max_kl", [("mse", 32, 0.85, 0.04), ("mse", 128, 0.80, 0.07),
                                                                ("gptq", 32, 0.85, 0.035), ("gptq", 128, 0.84, 0.05)])
def test_tinystories_greedy_agreement_and_kl(agreement, method, group_size, min_top1, max_kl):
    top1, mean_kl = agreement[method, group_size]
    assert top1 >= min_top1 and mean_kl <= max_kl, (top1, mean_kl)


def test_gptq_lowers_the_divergence_of_the_clip_search(agreement):
    for group_size in (32, 128):
        assert agreement["gptq", group_size][1] < 0.9 * agreement["mse", group_size][1], agreement


def test_gptq_needs_the_whole_model():
    with pytest.raises(ValueError, match="calibration"):
        quantize_weight(torch.randn(16, 32), 32, "gptq")


@pytest.mark.parametrize("k", [96, 100])
def test_gptq_with_an_identity_hessian_is_the_clip_search(k):
    """No input correlations: nothing to compensate, so GPTQ must give quantize_weight's tensors exactly,
    including a last group with padding columns (kept out of its statistics)."""
    from pdserve.model.quant.gptq import gptq_quantize_weight

    torch.manual_seed(k)
    w = torch.rand(24, k) + 0.5                                # all positive: padding zeros would widen the range
    for got, want in zip(gptq_quantize_weight(w, torch.eye(k), 32), quantize_weight(w, 32, "mse")):
        assert torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's CUDA tinygemm needs a CUDA GPU")
@pytest.mark.parametrize("k", [2048, 1000])  # 1000: padded to the group
def test_cuda_decode_rows_run_tinygemm_and_match_the_dequantized_weight(k):
    from pdserve.model.quant.int4 import TINYGEMM, TINYGEMM_MAX_ROWS, TRITON

    torch.manual_seed(0)
    lin = nn.Linear(k, 768, bias=True).to(torch.bfloat16)
    mod = Int4Linear.from_linear(lin, group_size=128, method="rtn").cuda()
    mod.prepare()
    assert mod.kernel_for(1) == mod.kernel_for(TINYGEMM_MAX_ROWS) == TINYGEMM
    assert mod.kernel_for(TINYGEMM_MAX_ROWS + 1) == TRITON
    w = dequantize_weight(mod.qweight, mod.scales, mod.zeros, k).float()
    for rows in (1, 7, TINYGEMM_MAX_ROWS, TINYGEMM_MAX_ROWS + 1, 300):
        x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
        want = F.linear(x.float(), w, mod.bias.float())
        got = mod(x)
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        got = got.float()
        assert (got - want).norm() / want.norm() < 1e-2, rows
    Int4Linear.cuda_tinygemm = False
    try:
        triton_only = Int4Linear.from_linear(lin, group_size=128, method="rtn").cuda()
        assert triton_only.kernel_for(1) == TRITON
        x = torch.randn(3, k, device="cuda").to(torch.bfloat16)
        assert (mod(x).float() - triton_only(x).float()).norm() / triton_only(x).float().norm() < 1e-2
    finally:
        Int4Linear.cuda_tinygemm = True


def test_triton_layout_holds_the_portable_codes_as_a_view(monkeypatch):
    """Where the Triton layout is built (CUDA; forced here on the CPU), ``qweight`` shares its bytes, and
    loading new codes, casting or dropping the layout keeps ``qweight`` right and contiguous again."""
    from pdserve.model.quant.int4 import TRITON

    monkeypatch.setattr(Int4Linear, "_wanted_layout", lambda self: TRITON)
    torch.manual_seed(0)
    lin = nn.Linear(256, 48)
    mod = Int4Linear.from_linear(lin, group_size=64, method="rtn")
    codes = mod.qweight.clone()
    mod.prepare()
    assert mod.qweight.data_ptr() == mod.triton_qweight_t.data_ptr() and not mod.qweight.is_contiguous()
    assert torch.equal(mod.qweight, codes) and torch.equal(mod.state_dict()["qweight"], codes)
    mod.half()                                                   # floats cast: the layout is rebuilt on use
    mod.prepare()
    assert mod.qweight.data_ptr() == mod.triton_qweight_t.data_ptr() and torch.equal(mod.qweight, codes)
    other = Int4Linear.from_linear(nn.Linear(256, 48), group_size=64, method="rtn")
    mod.load_state_dict(other.state_dict())                      # copied in place, into the shared bytes
    assert mod.qweight.is_contiguous() and torch.equal(mod.qweight, other.qweight)
    mod.prepare()
    assert torch.equal(mod.triton_qweight_t, other.qweight.t()) and torch.equal(mod.qweight, other.qweight)


@pytest.mark.skipif(not int4_available(), reason="the VNNI layout needs the C INT4 kernel (AVX512-VNNI or AVX2)")
def test_cpu_vnni_layout_holds_the_codes_once():
    """On the CPU's VNNI layout the portable ``qweight`` buffer is released (half a byte a weight, not
    one) and still reads back exactly: through ``qweight``, ``state_dict()``, the dequantized path of long
    prefills, new codes loaded or assigned, and a switch to torch's layout."""
    lin, mod = _int4_pair(256, 48, 64, True)
    codes, state = mod.qweight.clone(), {k: v.clone() for k, v in mod.state_dict().items()}
    x = torch.randn(3, 256)
    with torch.inference_mode():
        mod(x)                                                   # builds the layout
        assert "qweight" not in dict(mod.named_buffers())
        assert sum(b.nbytes for b in mod.buffers() if b.dtype == torch.uint8) == 48 * 256 // 2
        assert torch.equal(mod.qweight, codes)
        saved = mod.state_dict()
        assert list(saved) and set(saved) == set(state) and all(torch.equal(saved[k], state[k]) for k in state)
        xl = torch.randn(mod.dequant_min_rows_vnni + 1, 256)
        assert mod.kernel_for(xl.shape[0]) == "int4-dequant-F.linear"
        torch.testing.assert_close(mod(xl), F.linear(xl, dequantize_weight(codes, mod.scales, mod.zeros, 256),
                                                     mod.bias), rtol=1e-5, atol=1e-5)
        _, other = _int4_pair(256, 48, 64, True, seed=1)
        mod.load_state_dict(other.state_dict())                  # into the restored buffer
        assert torch.equal(mod.qweight, other.qweight) and "qweight" in dict(mod.named_buffers())
        torch.testing.assert_close(mod(x), other(x), rtol=0, atol=0)
        assert "qweight" not in dict(mod.named_buffers())
        mod.qweight = codes.clone()                              # assigned while released: a buffer again
        assert "qweight" in dict(mod.named_buffers())
        ref = _default_reference(mod, x)                         # the codes of `mod`, other's scales
        torch.testing.assert_close(mod(x), ref, rtol=0, atol=ref.abs().max().item() * 2 ** -7)
        assert not torch.allclose(mod(x), other(x))
        mod.exact_cpu = True                                     # torch's layout reads the portable codes
        torch.testing.assert_close(mod(x), _reference(mod, x, torch.float32), rtol=1e-5, atol=1e-5)
        assert torch.equal(dict(mod.named_buffers())["qweight"], codes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton layout is built on a CUDA GPU")
def test_cuda_int4_weight_is_held_in_two_layouts_not_three():
    """On a GPU the portable codes cost no memory beside the Triton and tinygemm layouts, and the module
    still matches the dequantized weight (one byte a weight for the codes, not 1.5)."""
    torch.manual_seed(0)
    lin = nn.Linear(4096, 4096, bias=False).to(torch.bfloat16)
    mod = Int4Linear.from_linear(lin, group_size=128, method="rtn")
    w = dequantize_weight(mod.qweight, mod.scales, mod.zeros, 4096).float().cuda()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    mod = mod.cuda()
    mod.prepare()
    torch.cuda.synchronize()
    codes = 4096 * 4096 // 2
    held = torch.cuda.memory_allocated() - before
    assert mod.qweight.data_ptr() == mod.triton_qweight_t.data_ptr()
    assert held < 2.6 * codes, held / codes    # two layouts + scales ~2.3x the codes; three would be ~3.3x
    for rows in (1, 9):
        x = torch.randn(rows, 4096, device="cuda").to(torch.bfloat16)
        want = F.linear(x.float(), w)
        assert (mod(x).float() - want).norm() / want.norm() < 1e-2, rows
