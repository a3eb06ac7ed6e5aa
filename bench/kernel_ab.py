"""One C kernel at two commits, timed interleaved in one process: the A/B behind every kernel change in
docs/benchmarks.md since the VMs of this project's machine kind proved noisy (10-25% drift within minutes,
so runs minutes apart cannot tell a 10% change). Both builds use the flags ``kernels.cpu`` builds with;
each repetition times A then B, the next B then A; medians of the repetitions; the outputs of the two
builds are compared (largest absolute difference, 0 when bit-identical).

Kernels and their cases (bench-80m's shapes: 12 heads, 4 KV heads, head_dim 64, bf16 cache, block 16):

* ``paged_attention``: a decode step's attention over 12 layers of a KV cache in huge pages whose blocks
  are shuffled, the L3 evicted first (cold) and the same step at once again (warm), per batch x context;
* ``prefill_attention`` / ``prefill_attention_fma`` / ``prefill_attention_amx``: one layer's causal attention
  over a 512- and a 2,048-token prompt (``--heads`` sets other head counts and sizes for the attention
  kernels, e.g. ``8,4,128`` for bench-80m-qwen3);
* ``gemm_bf16_fma``: bench-80m's 48 projections at 8, 32 and 128 rows, weights in huge pages, the L3
  evicted before each pass and then not (warm: what the pass before left in the L3, as in a decode loop)
  (``gemm_bf16_avx2`` at 8, 32 and 512 rows); ``gemm_bf16_amx`` (AMX tiles)
  the same at 1, 8 and 32 rows, ``gemm_bf16_avx512`` (``vdpbf16ps``) at 32 and 512, ``gemv_bf16`` at
  1 and 2 (all three in the ``gemv_bf16`` library; ``--rows`` sets other row counts for these four);
  ``gemv_int4`` the same projections as INT4 weights (group 128) at 1 and 4 rows (``--rows`` too), with
  the L3 evicted and without (its 45 MiB fit many L3s);
* ``silu_mul``: bench-80m's SiLU-and-mul at 512 rows over 12 layers, whole and in four pieces;
* ``add_rms_norm``: bench-80m's residual adds and RMSNorms (24 of 768 columns) at 512 and 32 rows;
* ``rope_write_kv``: bench-80m's RoPE with the KV cache write (12 layers) at 512 rows (bf16 queries out) and 32
  (float32 queries out, as the decode attention takes them).

    taskset -c 1 .venv/bin/python bench/kernel_ab.py --kernel paged_attention --base e6d80fa~1 --head e6d80fa
    taskset -c 1 .venv/bin/python bench/kernel_ab.py --kernel prefill_attention_fma --base bdbfe48~1
    taskset -c 1 .venv/bin/python bench/kernel_ab.py --kernel prefill_attention --base HEAD --heads 8,4,128
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import io
import shutil
import statistics
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pdserve.bench.common import ROOT
from pdserve.bench.cpu_facts import cpu_facts
from pdserve.bench.cpu_kernels import BENCH_80M, l3_evictor, scattered_decode_cache
from pdserve.kernels.cpu import available, compile_library
from pdserve.kernels.cpu.gemv import gemm_amx_available, gemv_available, pack_weight
from pdserve.kernels.cpu.int4 import pack_int4_weight
from pdserve.kernels.paged_attention import build_attention_metadata
from pdserve.model.hugepages import copies_in_huge_pages

_p, _i64, _f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_GEMM = [_p, _i64, _i64, _i64, _p, _i64, _i64, _p, _i64]
SIGNATURES = {  # C function and argument types of each kernel, and its library where not of its name
    "paged_attention": ("pd_paged_attention", [_p, _p, _i64, _i64, _i64, _p, _p, _i64, _p, ctypes.c_int, _i64,
                                               _i64, _i64, _i64, _p, _i64, _i64, _f]),
    "prefill_attention": ("pd_prefill_attention", [_p, _p, _i64, _i64, _i64, _p, _p, _i64, _p, _i64, _i64, _i64,
                                                   _i64, _p, _i64, _i64, _f]),
    "gemm_bf16_fma": ("pd_gemm_bf16_fma", _GEMM),
    "gemm_bf16_avx2": ("pd_gemm_bf16_avx2", _GEMM),
    "gemm_bf16_amx": ("pd_gemm_bf16_amx", _GEMM, "gemv_bf16"),
    "gemm_bf16_avx512": ("pd_gemm_bf16_avx512", _GEMM, "gemv_bf16"),
    "gemv_bf16": ("pd_gemv_bf16", _GEMM),
    "gemv_int4": ("pd_int4_gemv", [_p, ctypes.c_int, _i64, _i64, _i64, _i64, _i64, _p, _p, _p, _i64, _i64, _p,
                                   ctypes.c_int, _i64]),
    "silu_mul": ("pd_silu_mul_to", [_p, _i64, _i64, _i64, _p, _i64, ctypes.c_int], "fused"),
    "add_rms_norm": ("pd_add_rms_norm", [_p, _p, _p, _p, _p, _i64, _i64, _i64, _i64, _i64, _i64, _f, ctypes.c_int],
                     "fused"),
    "rope_write_kv": ("pd_rope_write_kv", [_p, _i64, _i64, _i64, _i64, _i64, _p, _p, _p, ctypes.c_int, _p, _i64, _i64,
                                           _i64, _i64, _p, _i64, ctypes.c_int, _p, _p, _f], "fused"),
}
SIGNATURES["prefill_attention_fma"] = SIGNATURES["prefill_attention_amx"] = SIGNATURES["prefill_attention"]


def library_of(kernel: str) -> str:
    """The C library (kernels/cpu/<name>.c) that holds ``kernel``: SIGNATURES' third entry, else the kernel's name."""
    return (SIGNATURES[kernel][2:] or (kernel,))[0]


HEADS, KV_HEADS, DIM, BLOCK = 12, 4, 64, 16


def build(kernel: str, rev: str | None, into: Path) -> Callable:
    """The kernel's C function built from ``kernels/cpu`` at git revision ``rev`` (``None``: the working
    tree) with the project's flags for it.

    Raises:
        subprocess.CalledProcessError: an unknown revision.
        KernelUnavailable: the build failed.
    """
    src = into / (rev or "worktree")
    if rev is None:
        shutil.copytree(ROOT / "kernels" / "cpu", src)
    else:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "kernels/cpu"], check=True,
                                 capture_output=True).stdout
        tarfile.open(fileobj=io.BytesIO(archive)).extractall(src, filter="data")
        src = src / "kernels" / "cpu"
    name, argtypes = SIGNATURES[kernel][:2]
    library = library_of(kernel)
    lib = src / f"{library}.so"
    compile_library(library, src, lib)
    fn = getattr(ctypes.CDLL(str(lib)), name)
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn


def interleaved(builds: dict[str, Callable], run: Callable[[Callable], torch.Tensor], reps: int,
                before: Callable[[], None] = lambda: None) -> dict:
    """Median seconds of ``run(fn)`` per build over ``reps`` repetitions in alternating order (``before``
    called ahead of each timed run), and the largest absolute difference of their outputs."""
    times, outs = {k: [] for k in builds}, {}
    for rep in range(reps):
        for name in (list(builds) if rep % 2 == 0 else list(builds)[::-1]):
            before()
            start = time.perf_counter()
            outs[name] = run(builds[name])
            times[name].append(time.perf_counter() - start)
    a, b = (outs[k].float() for k in builds)
    return {**{k: statistics.median(v) for k, v in times.items()}, "max_abs_diff": (a - b).abs().max().item()}


def decode_attention_cases(builds: dict, reps: int, cases=((32, 140), (32, 1024), (4, 512), (1, 140)),
                           layers: int = 12, heads: tuple[int, int, int] = (HEADS, KV_HEADS, DIM)) -> list[dict]:
    rows, evict, (nh, nkv, dim) = [], l3_evictor(), heads
    for batch, context in cases:
        cache, meta = scattered_decode_cache(batch, context, layers, nkv, dim, BLOCK)
        q = torch.randn(batch, nh, dim)
        s_block, s_layer, s_kv, s_tok, s_head, _ = cache.stride()

        def step(fn) -> torch.Tensor:
            out = torch.empty_like(q)
            for layer in range(layers):
                fn(q.data_ptr(), out.data_ptr(), nh, nkv, dim, meta.query_start_loc.data_ptr(),
                   meta.seq_lens.data_ptr(), batch, cache.data_ptr() + layer * s_layer * 2, 1, s_block, s_tok,
                   s_head, s_kv, meta.block_tables.data_ptr(), meta.block_tables.shape[1], BLOCK, dim ** -0.5)
            return out
        rows.append({"case": f"decode attention, {layers} layers, batch {batch} x {context + 1} tokens, cold",
                     **interleaved(builds, step, reps, evict)})
        rows.append({"case": f"decode attention, {layers} layers, batch {batch} x {context + 1} tokens, warm",
                     **interleaved(builds, step, reps)})
    return rows


def prefill_attention_cases(builds: dict, reps: int, heads: tuple[int, int, int] = (HEADS, KV_HEADS, DIM)
                            ) -> list[dict]:
    rows, (nh, nkv, dim) = [], heads
    for n in (512, 2048):
        blocks = n // BLOCK
        cache = torch.randn(blocks, 1, 2, BLOCK, nkv, dim).bfloat16()
        meta = build_attention_metadata([n], [n], [list(range(blocks))], BLOCK)
        q = torch.randn(n, nh, dim).bfloat16()
        s_block, _, s_kv, s_tok, s_head, _ = cache.stride()

        def run(fn) -> torch.Tensor:
            out = torch.empty_like(q)
            fn(q.data_ptr(), out.data_ptr(), nh, nkv, dim, meta.query_start_loc.data_ptr(),
               meta.seq_lens.data_ptr(), 1, cache.data_ptr(), s_block, s_tok, s_head, s_kv,
               meta.block_tables.data_ptr(), meta.block_tables.shape[1], BLOCK, dim ** -0.5)
            return out
        rows.append({"case": f"prefill attention, one layer, {n} tokens, {nh} heads / {nkv} KV heads of {dim}",
                     **interleaved(builds, run, reps)})
    return rows


def silu_mul_cases(builds: dict, reps: int, rows: int = 512, inter: int = 2048, layers: int = 12) -> list[dict]:
    g, out = torch.Generator().manual_seed(0), []
    for pieces in (1, 4):             # the whole gate_up output, and model.onednn_linear's pieces into their columns
        c = inter // pieces
        ins = [(torch.randn(rows, 2 * c, generator=g) * 3).bfloat16() for _ in range(layers * pieces)]

        def run(fn, ins=ins, c=c) -> torch.Tensor:
            act = torch.empty(rows, inter, dtype=torch.bfloat16)
            for i, x in enumerate(ins):
                fn(x.data_ptr(), rows, c, 2 * c, act[:, (i % (inter // c)) * c:].data_ptr(), inter, 1)
            return act
        out.append({"case": f"SiLU-and-mul, {layers} layers of {rows} x {inter} bf16 in {pieces} piece(s)",
                    **interleaved(builds, run, reps)})
    return out


def add_rms_norm_cases(builds: dict, reps: int, rows=(512, 32), dim: int = 768, layers: int = 12) -> list[dict]:
    """A prefill's (512 rows) and a batch-32 decode step's residual adds and RMSNorms: two a layer."""
    g, out = torch.Generator().manual_seed(0), []
    for m in rows:
        xs = [(torch.randn(m, dim, generator=g) * 3).bfloat16() for _ in range(2 * layers)]
        res = (torch.randn(m, dim, generator=g) * 3).bfloat16()
        w = (1 + torch.randn(dim, generator=g) * 0.1).bfloat16()

        def run(fn, xs=xs, res=res, w=w, m=m) -> torch.Tensor:
            s, normed = torch.empty_like(res), torch.empty_like(res)
            r = res
            for x in xs:
                fn(x.data_ptr(), r.data_ptr(), w.data_ptr(), s.data_ptr(), normed.data_ptr(), m, dim, dim, dim, dim,
                   dim, 1e-6, 1)
                r = s
            return torch.cat([normed, s])
        out.append({"case": f"add + RMSNorm, {2 * layers} calls of {m} x {dim} bf16", **interleaved(builds, run, reps)})
    return out


def rope_write_kv_cases(builds: dict, reps: int, rows=(512, 32), layers: int = 12,
                        heads: tuple[int, int, int] = (HEADS, KV_HEADS, DIM)) -> list[dict]:
    """A prefill's (512 rows, bf16 queries out) and a batch-32 decode step's (float32 queries out) RoPE with the KV
    write, over ``layers`` layers' qkv rows into a paged bf16 cache (``--heads``: other head counts and sizes)."""
    g, out, (nh, nkv, dim) = torch.Generator().manual_seed(0), [], heads
    for m in rows:
        qkvs = [torch.randn(m, (nh + 2 * nkv) * dim, generator=g).bfloat16() for _ in range(layers)]
        angles = torch.rand(m, dim // 2, generator=g) * 100
        cos, sin = torch.cat([angles.cos()] * 2, 1).contiguous(), torch.cat([angles.sin()] * 2, 1).contiguous()
        slots = torch.randperm(m + BLOCK, generator=g)[:m].long()
        q_dtype = torch.bfloat16 if m > 64 else torch.float32

        def run(fn, qkvs=qkvs, cos=cos, sin=sin, slots=slots, m=m, q_dtype=q_dtype) -> torch.Tensor:
            cache = torch.zeros(m // BLOCK + 2, 2, BLOCK, nkv, dim, dtype=torch.bfloat16)
            s_block, s_kv, s_tok, s_head, _ = cache.stride()
            q = torch.empty(m, nh, dim, dtype=q_dtype)
            for qkv in qkvs:
                fn(qkv.data_ptr(), m, qkv.stride(0), nh, nkv, dim, cos.data_ptr(), sin.data_ptr(), q.data_ptr(),
                   int(q_dtype != torch.float32), cache.data_ptr(), s_block, s_tok, s_head, s_kv, slots.data_ptr(),
                   BLOCK, 1, None, None, 1e-6)
            return torch.cat([q.float().flatten(), cache.float().flatten()])
        out.append({"case": f"RoPE + KV write, {layers} layers of {m} rows, {nh} / {nkv} heads of {dim}",
                    **interleaved(builds, run, reps)})
    return out


def gemm_cases(builds: dict, reps: int, row_counts=(8, 32, 128)) -> list[dict]:
    g, rows, evict = torch.Generator().manual_seed(0), [], l3_evictor()
    packed = copies_in_huge_pages([pack_weight(torch.randn(n, k, generator=g) * 0.02) for n, k in BENCH_80M])
    for m in row_counts:
        xs = {k: torch.randn(m, k, generator=g).bfloat16() for _, k in BENCH_80M}
        outs = {name: torch.zeros(m * sum(n for n, _ in BENCH_80M), dtype=torch.bfloat16) for name in builds}
        owner = {id(fn): name for name, fn in builds.items()}

        def run(fn) -> torch.Tensor:       # into a buffer of each build's own, allocated and touched once
            flat, at = outs[owner[id(fn)]], 0
            for (n, k), w in zip(BENCH_80M, packed):
                if fn(xs[k].data_ptr(), m, k, k, w.data_ptr(), w.shape[0] * 16, n, flat[at:].data_ptr(), n):
                    raise RuntimeError("the kernel refused its input (out of memory or no AMX)")
                at += m * n
            return flat
        rows.append({"case": f"bench-80m's 48 projections, {m} rows, L3 evicted", **interleaved(builds, run, reps,
                                                                                                 evict)})
        rows.append({"case": f"bench-80m's 48 projections, {m} rows, warm", **interleaved(builds, run, reps)})
    return rows


def int4_cases(builds: dict, reps: int, row_counts: tuple[int, ...] = (1, 4), group: int = 128) -> list[dict]:
    g, rows, evict = torch.Generator().manual_seed(0), [], l3_evictor()
    weights = [pack_int4_weight(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g),
                                torch.rand(n, k // group, generator=g) * 0.01,
                                torch.randn(n, k // group, generator=g) * 0.01, group) for n, k in BENCH_80M]
    weights = [tuple(copies_in_huge_pages(list(w))) for w in weights]
    for m in row_counts:
        xs = {k: torch.randn(m, k, generator=g).bfloat16() for _, k in BENCH_80M}

        def run(fn) -> torch.Tensor:
            ys = []
            for (n, k), (wq, sc, zc) in zip(BENCH_80M, weights):
                y = torch.empty(m, n, dtype=torch.bfloat16)
                if fn(xs[k].data_ptr(), 1, m, k, k, k, group, wq.data_ptr(), sc.data_ptr(), zc.data_ptr(),
                      wq.shape[0] * 16, n, y.data_ptr(), 1, n):
                    raise RuntimeError("the kernel is out of memory")
                ys.append(y.flatten())
            return torch.cat(ys)
        rows.append({"case": f"bench-80m's 48 INT4 projections, {m} rows, L3 evicted",
                     **interleaved(builds, run, reps, evict)})
        rows.append({"case": f"bench-80m's 48 INT4 projections, {m} rows, warm", **interleaved(builds, run, reps)})
    return rows


CASES = {"paged_attention": decode_attention_cases, "prefill_attention": prefill_attention_cases,
         "prefill_attention_fma": prefill_attention_cases, "prefill_attention_amx": prefill_attention_cases,
         "gemm_bf16_fma": gemm_cases, "gemm_bf16_avx2": lambda builds, reps: gemm_cases(builds, reps, (8, 32, 512)),
         "gemm_bf16_amx": lambda builds, reps: gemm_cases(builds, reps, (1, 8, 32)),
         "gemm_bf16_avx512": lambda builds, reps: gemm_cases(builds, reps, (32, 512)),
         "gemv_bf16": lambda builds, reps: gemm_cases(builds, reps, (1, 2)), "gemv_int4": int4_cases,
         "silu_mul": silu_mul_cases, "add_rms_norm": add_rms_norm_cases, "rope_write_kv": rope_write_kv_cases}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel", choices=sorted(CASES), required=True)
    ap.add_argument("--base", required=True, help="git revision of A")
    ap.add_argument("--head", default=None, help="git revision of B (default: the working tree)")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--rows", default=None, help="activation row counts of the gemm and gemv kernels' cases, e.g. 3,4 "
                                                 "(default: the kernel's own)")
    ap.add_argument("--heads", default=None, help="query heads, KV heads, head size of the attention cases, "
                                                  "e.g. 8,4,128 (bench-80m-qwen3; default: bench-80m's 12,4,64)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    runs = {"gemm_bf16_amx": gemm_amx_available, "gemm_bf16_avx512": gemv_available}.get(args.kernel)
    if not (runs() if runs else available(library_of(args.kernel))):
        raise SystemExit(f"{args.kernel} does not run on this CPU (kernels.cpu.available)")
    facts = cpu_facts()
    print(f"CPU: {facts['model_name']} (family {facts['family']}, model {facts['model']}; "
          f"{', '.join(f for f, on in facts['features'].items() if on)}); {args.kernel}: A = {args.base}, "
          f"B = {args.head or 'working tree'}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        builds = {"A": build(args.kernel, args.base, Path(tmp)), "B": build(args.kernel, args.head, Path(tmp))}
        cases = CASES[args.kernel]
        if args.heads and ("attention" in args.kernel or args.kernel == "rope_write_kv"):
            cases = functools.partial(cases, heads=tuple(int(h) for h in args.heads.split(",")))
        if args.rows and args.kernel.startswith(("gemm", "gemv")):
            cases = functools.partial(int4_cases if args.kernel == "gemv_int4" else gemm_cases,
                                      row_counts=tuple(int(r) for r in args.rows.split(",")))
        for row in cases(builds, args.reps):
            print(f"{row['case']}: A {row['A'] * 1e3:.2f} ms, B {row['B'] * 1e3:.2f} ms "
                  f"(B/A {row['B'] / row['A']:.3f}), max |A - B| {row['max_abs_diff']:.2e}", flush=True)


if __name__ == "__main__":
    main()
