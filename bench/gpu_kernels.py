"""The CUDA kernels outside the Triton interpreter: correctness against plain torch, and speed
against the GPU's measured limits (part of ``bench/gpu.py``; needs a CUDA GPU, never run in CI).

Each check draws fresh random inputs and reports ``‖out - ref‖ / ‖ref‖`` against a float32
reference, then the median time of ``triton.testing.do_bench`` (CUDA events) and the rate it
implies: bytes per second for the memory-bound kernels (decode attention, the W4A16 GEMM at
decode rows), FLOP/s for the GEMMs at prefill rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from triton.testing import do_bench


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖out - ref‖ / ‖ref‖`` in float64 (NaN anywhere gives NaN)."""
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


def median_ms(fn, warmup_ms: int = 25, rep_ms: int = 200) -> float:
    """Median milliseconds of ``fn`` over CUDA-event-timed repetitions (``triton.testing.do_bench``)."""
    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def ceilings(dev: torch.device) -> dict:
    """The GPU's measured limits: device-to-device copy bandwidth (bytes read + written per second)
    over a 2 GiB buffer, and the bf16 GEMM rate at 8192^3 on random data."""
    copy_gbs = _copy_gbs(dev, 1 << 30)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    t = median_ms(lambda: a @ b)
    props = torch.cuda.get_device_properties(dev)
    return {"gpu": props.name, "sms": props.multi_processor_count, "memory_gib": props.total_memory / 2**30,
            "torch": torch.__version__, "copy_gbs": copy_gbs, "bf16_gemm_8192_tflops": 2 * 8192**3 / t / 1e9}


def _copy_gbs(dev: torch.device, numel: int) -> float:
    """GB/s of a bf16 device-to-device copy of ``numel`` elements, bytes read plus written."""
    src = torch.empty(numel, dtype=torch.bfloat16, device=dev).normal_()
    dst = torch.empty_like(src)
    return 2 * numel * 2 / median_ms(lambda: dst.copy_(src)) / 1e6


def attention_case(dev: torch.device, batch: int, ctx: int, heads: int, kv_heads: int, head_dim: int,
                   dtype: torch.dtype, block_size: int = 16, block_t: int = 32, num_splits: int | None = None) -> dict:
    """The Triton paged decode attention over a scattered cache of ``batch`` sequences of up to
    ``ctx`` tokens (the first exactly ``ctx``) against :func:`paged_attention_decode_reference`."""
    from pdserve.kernels.paged_attention_triton import paged_attention_decode_reference, paged_attention_decode_triton
    lens = torch.randint(1, ctx + 1, (batch,))
    lens[0] = ctx
    per_seq = [-(-int(n) // block_size) for n in lens]
    num_blocks = sum(per_seq) + 1
    ids = torch.randperm(num_blocks)[:sum(per_seq)]
    tables = torch.zeros(batch, max(per_seq), dtype=torch.int32)
    start = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = ids[start:start + n]
        start += n
    cache = torch.randn(num_blocks, 1, 2, block_size, kv_heads, head_dim, device=dev, dtype=dtype)
    q = torch.randn(batch, heads, head_dim, device=dev, dtype=dtype)
    tables, lens = tables.to(dev), lens.to(torch.int32).to(dev)
    scale = head_dim ** -0.5
    kw = dict(block_t=block_t, num_splits=num_splits)
    out = paged_attention_decode_triton(q, cache, 0, tables, lens, scale, **kw)
    ref = paged_attention_decode_reference(q.float(), cache.float(), 0, tables, lens, scale)
    t = median_ms(lambda: paged_attention_decode_triton(q, cache, 0, tables, lens, scale, **kw))
    kv_bytes = int(lens.sum()) * 2 * kv_heads * head_dim * cache.element_size()
    return {"batch": batch, "ctx": ctx, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
            "dtype": str(dtype).removeprefix("torch."), "block_t": block_t, "num_splits": num_splits,
            "rel_err": rel_err(out, ref),
            "finite": bool(out.isfinite().all()), "ms": t, "kv_gbs": kv_bytes / t / 1e6}


def w4a16_case(dev: torch.device, rows: int, k: int, n: int, group: int = 128, **kw) -> dict:
    """The Triton W4A16 GEMM (``x [rows, k]`` bf16 by an INT4 ``[k, n]`` weight) against its
    float32 reference, and bf16 ``F.linear`` on the same shape for speed."""
    from pdserve.kernels.w4a16_triton import w4a16_matmul, w4a16_matmul_reference
    x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
    qw = torch.randint(0, 256, (k // 2, n), device=dev, dtype=torch.uint8)
    sz = torch.stack([torch.rand(k // group, n, device=dev) * 0.02 + 0.001,
                      torch.randn(k // group, n, device=dev) * 0.01], dim=-1).contiguous()
    out = w4a16_matmul(x, qw, sz, group, **kw)
    ref = w4a16_matmul_reference(x.float(), qw, sz, group)
    t = median_ms(lambda: w4a16_matmul(x, qw, sz, group, **kw))
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    t_bf16 = median_ms(lambda: F.linear(x, w))
    weight_bytes = k * n // 2 + sz.numel() * 4
    return {"rows": rows, "k": k, "n": n, "group": group, **kw, "rel_err": rel_err(out, ref), "ms": t,
            "bf16_linear_ms": t_bf16, "weight_gbs": weight_bytes / t / 1e6,
            "tflops": 2 * rows * k * n / t / 1e9}


def fp8_case(dev: torch.device, rows: int, k: int, n: int) -> dict:
    """FP8 activation matmuls at one shape: ``Fp8Linear`` per-channel (``torch._scaled_mm``), the
    Triton FP8 GEMM per-channel and with 128-blocks, each against the exact float32 math of its
    scales (:func:`fp8_gemm_reference`) and against the bf16 ``F.linear``; TFLOP/s of each."""
    from pdserve.kernels.fp8_gemm_triton import fp8_gemm_reference, fp8_gemm_triton
    from pdserve.model.quant.fp8 import Fp8Linear
    from pdserve.model.quant.fp8_format import quantize_e4m3, quantize_e4m3_groups
    x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
    lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
    torch.nn.init.normal_(lin.weight, std=0.02)
    flops = 2 * rows * k * n
    res = {"rows": rows, "k": k, "n": n}
    with torch.inference_mode():
        exact = F.linear(x, lin.weight)
        res["bf16_tflops"] = flops / median_ms(lambda: F.linear(x, lin.weight)) / 1e9
        for name, g in (("channel", None), ("block128", 128)):
            mod = Fp8Linear.from_linear(lin, group_size=g)
            xq, sx = quantize_e4m3(x) if g is None else quantize_e4m3_groups(x, g)
            sw = mod.weight_scale if g is None else mod.weight_scale.t()
            ref = fp8_gemm_reference(xq, sx, mod.weight.t(), sw, torch.float32, group_size=g)
            tri = fp8_gemm_triton(xq, sx, mod.weight.t(), sw, torch.bfloat16, group_size=g)
            res[f"triton_{name}_rel_err"] = rel_err(tri, ref)
            res[f"triton_{name}_tflops"] = flops / median_ms(
                lambda: fp8_gemm_triton(xq, sx, mod.weight.t(), sw, torch.bfloat16, group_size=g)) / 1e9
            y = mod(x)
            res[f"module_{name}_rel_err_vs_bf16"] = rel_err(y, exact)
            res[f"module_{name}_tflops"] = flops / median_ms(lambda: mod(x)) / 1e9
            if g is None:   # the activation quantization: eight torch kernels against one Triton kernel
                from pdserve.kernels.fp8_quant_triton import quantize_e4m3_rows
                tq, ts = quantize_e4m3_rows(x)
                res["quant_bit_equal"] = bool(torch.equal(ts, sx) and torch.equal(
                    tq.view(torch.uint8)[:, :k], xq.view(torch.uint8)))
                res["quant_torch_ms"] = median_ms(lambda: quantize_e4m3(x))
                res["quant_triton_ms"] = median_ms(lambda: quantize_e4m3_rows(x))
                res["module_torch_quant_tflops"] = flops / median_ms(
                    lambda: mod._scaled_mm(*quantize_e4m3(x), torch.bfloat16)) / 1e9
                res["scaled_mm_rel_err"] = rel_err(mod._scaled_mm(xq, sx, torch.bfloat16), ref)
                res["scaled_mm_tflops"] = flops / median_ms(lambda: mod._scaled_mm(xq, sx, torch.bfloat16)) / 1e9
    return res


def run_kernels(dev: torch.device, shapes: dict) -> dict:
    """Every kernel check at the 1B model's shapes (``shapes``: hidden, intermediate, heads, kv_heads,
    head_dim)."""
    h, i = shapes["hidden"], shapes["intermediate"]
    hd, nh, nkv = shapes["head_dim"], shapes["heads"], shapes["kv_heads"]
    q = nh * hd + 2 * nkv * hd
    projections = [(h, q), (nh * hd, h), (h, 2 * i), (i, h)]     # (k, n): qkv, o, gate_up, down
    out = {"attention": [], "w4a16": [], "fp8": []}
    for batch, ctx, dtype in ((1, 4096, torch.bfloat16), (32, 1024, torch.bfloat16), (64, 2048, torch.bfloat16),
                              (8, 512, torch.float32)):
        out["attention"].append(attention_case(dev, batch, ctx, nh, nkv, hd, dtype))
    out["attention"].append(attention_case(dev, 16, 777, 28, 4, 128, torch.bfloat16))   # group 7, head 128
    for batch, ctx in ((1, 4096), (64, 2048)):                                          # tile and split sweep
        for block_t, splits in ((16, None), (64, None), (32, 1)):
            out["attention"].append(attention_case(dev, batch, ctx, nh, nkv, hd, torch.bfloat16, block_t=block_t,
                                                   num_splits=splits))
    for rows in (1, 32, 512):
        for k, n in projections:
            out["w4a16"].append(w4a16_case(dev, rows, k, n))
    for k, n in ((i, h), (h, 2 * i)):                                                 # one-row sweep
        for kw in (dict(block_n=32), dict(block_n=128), dict(num_warps=2), dict(num_warps=8),
                   dict(block_n=32, num_splits=64), dict(block_n=128, num_warps=8)):
            out["w4a16"].append(w4a16_case(dev, 1, k, n, **kw))
    for rows in (16, 2048):
        for k, n in projections:
            out["fp8"].append(fp8_case(dev, rows, k, n))
    out["fp8"].append(fp8_case(dev, 4096, 4096, 4096 + 8))        # N not a multiple of 16: the padded path
    return out


def best_gemm_tflops(dev: torch.device, shapes: dict, rows: int) -> float:
    """The best bf16 ``F.linear`` rate (TFLOP/s) over the model's projection shapes at ``rows`` rows."""
    h, i, hd, nh, nkv = (shapes[k] for k in ("hidden", "intermediate", "head_dim", "heads", "kv_heads"))
    best = 0.0
    for k, n in ((h, nh * hd + 2 * nkv * hd), (nh * hd, h), (h, 2 * i), (i, h), (h, shapes["vocab"])):
        x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        best = max(best, 2 * rows * k * n / median_ms(lambda: F.linear(x, w)) / 1e9)
    return best

