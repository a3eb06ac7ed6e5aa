"""Every Triton kernel compiles for a CUDA GPU on this CPU machine: for Hopper (sm90, the H100 of
``bench/gpu.py``), and the FP8 GEMM, which serves GPUs without FP8 tensor cores, for Ampere (sm80)
too. CI has no GPU and the interpreter runs the kernels' Python, not Triton's compiler, so a kernel
can pass every interpreter test and still fail to compile (as a module-level float read inside a
kernel did, on the first GPU run of ``kernels/fp8_quant_triton.py``).

How: in a subprocess without ``TRITON_INTERPRET``, ``JITFunction.run`` is replaced by a recorder;
each public wrapper is called on ``meta`` tensors (shapes, strides and dtypes, no data) at decode
(bf16 and float32) and prefill (bf16) shapes, so it takes its GPU branches and computes its real
launch arguments; every recorded launch is then compiled by ``triton.compile`` to a cubin (Triton
ships its own LLVM and ``ptxas``) with the argument types, constexprs and ``num_warps`` the wrapper
chose."""

from __future__ import annotations

import textwrap

import pytest

from tests.triton_subprocess import run_script

_SCRIPT = textwrap.dedent("""
    import json, os
    assert os.environ.get("TRITON_INTERPRET") != "1"
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    launches = []
    JITFunction.run = lambda self, *args, grid, warmup, **kw: launches.append((self, args, kw))

    from pdserve.kernels import fp8_gemm_triton as fp8g, fp8_quant_triton as fp8q, fused_triton as fu
    from pdserve.kernels import paged_attention_triton as pat, w4a16_triton as w4
    pat._kernel_is_interpreted = lambda: True          # let meta tensors through the CUDA-or-interpreter check

    meta = torch.device("meta")
    def t(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, dtype=dtype, device=meta)

    for rows, dtypes in ((1, (torch.bfloat16, torch.float32)), (2048, (torch.bfloat16,))):   # decode, prefill
        for dt in dtypes:
            fp8q.quantize_e4m3_rows(t(rows, 2050, dtype=dt))
            fu.rms_norm(t(rows, 2048, dtype=dt), t(2048, dtype=dt), 1e-5)
            fu.silu_and_mul(t(rows, 2 * 8192, dtype=dt))
            fu.rope_write_kv(t(rows, 32, 64, dtype=dt), t(rows, 8, 64, dtype=dt), t(rows, 8, 64, dtype=dt),
                             t(rows, 1, 64, dtype=torch.float32), t(rows, 1, 64, dtype=torch.float32),
                             t(64, 16, 2, 16, 8, 64, dtype=dt), 3, t(rows, dtype=torch.int64))
            w4.w4a16_matmul(t(rows, 2048, dtype=dt), t(1024, 3072, dtype=torch.uint8),
                            t(16, 3072, 2, dtype=torch.float32), 128, bias=t(3072, dtype=dt))
        for g in (None, 128):
            a_scale = t(rows, dtype=torch.float32) if g is None else t(rows, 16, dtype=torch.float32)
            b_scale = t(3072, dtype=torch.float32) if g is None else t(16, 24, dtype=torch.float32)
            fp8g.fp8_gemm_triton(t(rows, 2048, dtype=torch.uint8), a_scale, t(2048, 3072, dtype=torch.uint8),
                                 b_scale, torch.bfloat16, group_size=g)
    for dt, splits in ((torch.bfloat16, None), (torch.bfloat16, 1), (torch.float32, None)):
        pat.paged_attention_decode_triton(t(4, 32, 64, dtype=dt), t(64, 16, 2, 16, 8, 64, dtype=dt), 2,
                                          t(4, 32, dtype=torch.int32), t(4, dtype=torch.int32), 0.125,
                                          num_splits=splits or 8)

    DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.uint8: "u8",
              torch.int32: "i32", torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv"}
    def source(fn, args, kw):
        bound = {**dict(zip(fn.arg_names, args)), **{k: v for k, v in kw.items() if k in fn.arg_names}}
        options = {k: v for k, v in kw.items() if k not in fn.arg_names}
        sig, constexprs = {}, {}
        for p in fn.params:
            v = bound[p.name] if p.name in bound else p.default
            if p.is_constexpr or v is None:
                sig[p.name], constexprs[p.name] = "constexpr", v
            elif isinstance(v, torch.Tensor):
                sig[p.name] = "*" + DTYPES[v.dtype]
            elif isinstance(v, bool):
                sig[p.name] = "i1"
            elif isinstance(v, int):
                sig[p.name] = "i32" if -2 ** 31 <= v < 2 ** 31 else "i64"
            else:
                sig[p.name] = "fp32"
        return ASTSource(fn, sig, constexprs), options

    out, seen = {}, set()
    for fn, args, kw in launches:
        src, options = source(fn, args, kw)
        key = src.hash() + str(options)
        if key in seen:
            continue
        seen.add(key)
        for arch in (90, 80) if fn.__name__ == "_fp8_gemm_kernel" else (90,):   # the FP8 GEMM serves pre-Ada GPUs
            name = f"{fn.__name__}-{len(seen)}-sm{arch}"
            try:
                kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
                out[name] = {"ok": bool(kernel.asm.get("cubin")), "kernel": fn.__name__}
            except Exception as e:              # noqa: BLE001 - report every kernel, then fail the test
                out[name] = {"ok": False, "kernel": fn.__name__, "error": f"{type(e).__name__}: {e}"[-1500:]}
    print(json.dumps(out))
""")

KERNELS = {"_quant_rows_kernel", "_rms_norm_kernel", "_silu_and_mul_kernel", "_rope_write_kv_kernel",
           "_w4a16_kernel", "_w4a16_dequant_kernel", "_fp8_gemm_kernel", "_paged_attention_decode_kernel",
           "_paged_attention_reduce_kernel"}


def test_every_triton_kernel_compiles_for_a_cuda_gpu():
    pytest.importorskip("triton")
    res = run_script(_SCRIPT, interpret=False, timeout=600)
    assert {r["kernel"] for r in res.values()} == KERNELS           # every kernel was launched and compiled
    failed = {name: r.get("error") for name, r in res.items() if not r["ok"]}
    assert not failed, failed
