"""What only a CUDA GPU shows: the Triton kernels outside the interpreter, FP8 ``_scaled_mm``, CUDA
graph capture and replay, greedy output against ``transformers`` on the GPU, and bf16 / INT4 / FP8
prefill and decode figures of a ~1.2B random Llama against the GPU's measured limits (MBU: bytes a
step must read over the measured copy bandwidth; MFU: prefill FLOPs over the best measured bf16 GEMM
rate at the model's shapes). Not run in CI (CI has no GPU).

    python bench/gpu.py --out DIR        # writes DIR/gpu.json, prints a summary

Every part runs even when an earlier one fails; a failure is recorded with its traceback.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

import torch

from pdserve.bench.gpu_kernels import best_gemm_tflops, ceilings, run_kernels
from pdserve.bench.gpu_model import LLAMA_1B, model_flops, profile_steps, run_model

EMBEDDED_MODEL = str(Path(__file__).resolve().parent.parent / "assets" / "models" / "tinystories-656k")
"""The embedded TinyStories checkpoint (as ``deploy.config``, which needs the cluster's packages)."""


def _part(results: dict, name: str, fn, out: Path) -> None:
    start = time.perf_counter()
    try:
        results[name] = fn()
    except Exception:                          # noqa: BLE001 - every part reports, whatever breaks
        results[name] = {"error": traceback.format_exc()}
        print(results[name]["error"], flush=True)
    results.setdefault("seconds", {})[name] = round(time.perf_counter() - start, 1)
    (out / "gpu.json").write_text(json.dumps(results, indent=1))
    print(f"[{name}] {results['seconds'][name]} s", flush=True)


def summary(r: dict) -> list[str]:
    """Short lines of the figures that matter (the JSON holds everything)."""
    lines = []
    lim = r.get("ceilings", {})
    if "copy_gbs" in lim:
        lines.append(f"{lim['gpu']}: copy {lim['copy_gbs']:.0f} GB/s, bf16 GEMM 8192^3 "
                     f"{lim['bf16_gemm_8192_tflops']:.0f} TFLOP/s, best at the model's 2048-row shapes "
                     f"{r.get('gemm_2048', float('nan')):.0f}")
    for a in r.get("kernels", {}).get("attention", []):
        lines.append(f"attention b{a['batch']} ctx{a['ctx']} {a['dtype']} t{a['block_t']} s{a['num_splits']} "
                     f"h{a['heads']}/{a['kv_heads']}x{a['head_dim']}: "
                     f"err {a['rel_err']:.1e}, {a['ms']:.3f} ms, {a['kv_gbs']:.0f} GB/s")
    for w in r.get("kernels", {}).get("w4a16", []):
        opts = {k: w[k] for k in ("block_n", "num_warps", "num_splits") if k in w}
        lines.append(f"w4a16 {w['rows']}x{w['k']}x{w['n']} {opts or ''}: err {w['rel_err']:.1e}, {w['ms']:.3f} ms "
                     f"(bf16 {w['bf16_linear_ms']:.3f}), {w['weight_gbs']:.0f} GB/s")
    for f in r.get("kernels", {}).get("fp8", []):
        lines.append(f"fp8 {f['rows']}x{f['k']}x{f['n']}: bf16 {f['bf16_tflops']:.0f}, scaled_mm "
                     f"{f['scaled_mm_tflops']:.0f} (err {f['scaled_mm_rel_err']:.1e}), triton ch "
                     f"{f['triton_channel_tflops']:.0f} (err {f['triton_channel_rel_err']:.1e}), blk128 "
                     f"{f['triton_block128_tflops']:.0f} TFLOP/s (err {f['triton_block128_rel_err']:.1e}); "
                     f"Fp8Linear {f['module_torch_quant_tflops']:.0f} -> {f['module_channel_tflops']:.0f} TFLOP/s, "
                     f"quantize {f['quant_torch_ms']:.3f} -> {f['quant_triton_ms']:.3f} ms "
                     f"(bit-equal {f['quant_bit_equal']})")
    m = r.get("model", {})
    for e in m.get("exact", []):
        lines.append(f"vs transformers {e['dtype']}: matching prefix {e['matching_prefix']} of {e['tokens']}, "
                     f"graph == eager {e['graph_equals_eager']}, divergences {e.get('divergences')}")
    for s in m.get("speed", []):
        parts = [f"{s['label']}:"]
        parts += [f"prefill {n} {ms:.1f} ms ({int(n) / ms * 1e3:.0f} tok/s)" for n, ms in s["prefill_ms"].items()]
        parts += [f"decode b{b} {ms:.2f} ms ({int(b) / ms * 1e3:.0f} tok/s)" for b, ms in s["decode_ms"].items()]
        lines.append(" ".join(parts))
    for name, tables in r.get("profile", {}).items():
        if isinstance(tables, dict) and "by_host" in tables:
            lines += [f"--- {name} by host time", tables["by_host"], f"--- {name} by device time", tables["by_device"]]
    for key, val in r.get("derived", {}).items():
        lines.append(f"{key}: {val}")
    return lines


def derive(r: dict) -> dict:
    """MBU of batch-1 decode and MFU of prefill per variant, against the measured limits."""
    out, bw = {}, r.get("ceilings", {}).get("copy_gbs")
    peak = r.get("gemm_2048")
    for s in r.get("model", {}).get("speed", []):
        if bw and 1 in s["decode_ms"]:
            ms = s["decode_ms"][1]
            out[f"MBU {s['label']} b1"] = f"{(s['weight_bytes'] + s['kv_bytes_b1']) / ms / 1e6 / bw:.0%}"
        for n, ms in s["prefill_ms"].items():
            if peak:
                out[f"MFU {s['label']} prefill {n}"] = f"{model_flops(LLAMA_1B, int(n)) / ms / 1e9 / peak:.0%}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="ceilings,gemm,kernels,model,profile")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py needs a CUDA GPU")
    dev = torch.device("cuda")
    shapes = {"hidden": LLAMA_1B.hidden_size, "intermediate": LLAMA_1B.intermediate_size, "heads": LLAMA_1B.num_heads,
              "kv_heads": LLAMA_1B.num_kv_heads, "head_dim": LLAMA_1B.head_dim, "vocab": LLAMA_1B.vocab_size}
    results: dict = {"command": "python bench/gpu.py --out " + args.out}
    torch.manual_seed(0)
    parts = {"ceilings": lambda: ceilings(dev), "gemm": lambda: best_gemm_tflops(dev, shapes, 2048),
             "kernels": lambda: run_kernels(dev, shapes), "model": lambda: run_model(dev, EMBEDDED_MODEL),
             "profile": lambda: profile_steps(dev)}
    for name in args.parts.split(","):
        _part(results, "gemm_2048" if name == "gemm" else name, parts[name], out)
    results["derived"] = derive(results)
    (out / "gpu.json").write_text(json.dumps(results, indent=1))
    print("\n".join(summary(results)))


if __name__ == "__main__":
    main()
