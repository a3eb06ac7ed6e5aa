"""The machine's limits, measured as limits once per benchmark run, with the ISA's paper peak beside them.

* **Read bandwidth**: the streaming read in C (:mod:`kernels.cpu.membw`, vector loads, best of
  its paths), in 4 KiB pages (``torch.empty``) and 2 MiB pages (:func:`model.hugepages.empty_huge`),
  at a DRAM-sized buffer (>= 1 GiB and >= 4x the L3) and at the sizes a caller asks for (a decode
  step's working set: weights + KV; one smaller than the L3 streams from cache, so its speed of
  light is the cache's). A ``torch.sum`` over the same buffer is kept as a second figure.
* **Compute**: the best GEMM rate over the model's linear shapes ``[N, K]`` at each row count, over
  every bf16 kernel the project has for it (``F.linear``; oneDNN on a weight reordered once,
  ``onednn_prepacked``; the packed ``gemv_bf16`` and ``gemm_bf16_amx``; ``PackedBF16Linear.forward``,
  whatever it selects).
* **Theoretical peak**: cores x clock x FLOP/cycle/core of the best ISA present (:func:`theoretical_peak`).
* **The AMX tile unit's own rate** where AMX runs (:mod:`kernels.cpu.amx_probe`): ``TDPBF16PS`` with its
  operands in registers, and 1 KiB tile loads from L1, L2 and L3. On the AMX Xeons of this project's VMs the
  matrix unit issued at 16 cycles of a ~2.3 GHz clock, not of the 3.4-3.9 GHz scalar clock the paper peak
  uses, and at half that rate in some minutes: the figure says which the run met.
* **CPU facts**: model, ISA flags, L3, which C kernels load here (:func:`cpu_facts`).

    python bench/limits.py --model .bench-models/bench-80m --threads 1
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from pdserve.bench.cpu_facts import cpu_facts, theoretical_peak
from pdserve.bench.gemm_limits import best_by_rows, best_time, gemm_rates, kernel_path, torch_threads
from pdserve.kernels.cpu.gemv import dp_fma_ratio

ROWS = (1, 8, 32, 512, 2048)
GIB = 1 << 30

def dram_buffer_bytes(l3_bytes: int | None) -> int:
    """Buffer size for the DRAM figure: >= 1 GiB and >= 4x the L3, at most a quarter of free memory."""
    want = max(GIB, 4 * (l3_bytes or 0))
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return want
    return max(64 << 20, min(want, avail // 4))


def read_bandwidths(nbytes: int, threads: int = 1) -> dict:
    """Streaming read of an ``nbytes`` buffer, bytes/s, in 4 KiB and huge pages: the C kernel's best path
    (``c_read``, ``c_path``, every path in ``c_paths``) and ``torch.sum`` over float32 as a second figure.
    ``best`` is the best C figure; where the C kernel cannot run (no compiler) it is the best torch
    figure and ``best_path`` says ``"torch_sum"``."""
    from pdserve.kernels.cpu import KernelUnavailable
    from pdserve.kernels.cpu.membw import best_pass_seconds
    from pdserve.model.hugepages import empty_huge

    numel = max(16, nbytes // 4)
    nbytes = numel * 4
    repeats = int(min(50, max(3, (256 << 20) // nbytes)))
    out: dict = {"bytes": nbytes, "threads": threads}
    for pages, alloc in (("4k", lambda: torch.empty(numel)), ("huge", lambda: empty_huge(numel, torch.float32))):
        buf = alloc().fill_(1.0)                          # touch every page before timing
        with torch_threads(threads):
            figure = {"torch_sum": nbytes / best_time(buf.sum, repeats)}
        try:
            per_path = best_pass_seconds(buf, repeats, threads)
        except KernelUnavailable:
            figure.update(c_read=None, c_path="torch_sum", c_paths={})
        else:
            path = min(per_path, key=per_path.get)
            figure.update(c_read=nbytes / per_path[path], c_path=path,
                          c_paths={p: nbytes / s for p, s in per_path.items()})
        out[pages] = figure
        del buf
    best = max(("4k", "huge"), key=lambda p: out[p]["c_read"] or out[p]["torch_sum"])
    out.update(best=out[best]["c_read"] or out[best]["torch_sum"], best_pages=best, best_path=out[best]["c_path"],
               torch_sum_best=max(out["4k"]["torch_sum"], out["huge"]["torch_sum"]))
    return out


def kernel_paths(model: torch.nn.Module, rows: int, query_len: int = 1,
                 kv_dtype: torch.dtype = torch.bfloat16) -> dict:
    """The path each kind of linear takes at ``rows`` rows (``kernel_for`` of the packed bf16 and INT4
    modules, else the module's class: torch), and attention's for steps of ``query_len`` new tokens per
    sequence over a ``kv_dtype`` cache (:func:`kernels.paged_attention.paged_attention`'s choice: the C
    decode kernel, the C prefill kernel or torch), and ``layers``: whether such a step runs every
    decoder layer in one C call (:mod:`model.cpu_stack`) or operation by operation, and ``silu``: the path of
    bf16 SiLU-and-mul (:func:`kernels.cpu.fused.silu_path`)."""
    from pdserve.kernels.cpu import fused
    from pdserve.kernels.cpu.attention import prefill_attention_available, prefill_library
    from pdserve.kernels.cpu.decode_stack import KERNEL as STACK_KERNEL
    from pdserve.kernels.paged_attention import cpu_kernels_apply
    from pdserve.model.cpu_stack import decode_stack

    out: dict = {}
    for name, module in model.named_modules():
        if hasattr(module, "in_features") and hasattr(module, "out_features"):
            kind = name.rsplit(".", 1)[-1]
            out.setdefault(kind, kernel_path(module, rows) or f"{type(module).__name__} (torch)")
    c = cpu_kernels_apply(torch.device("cpu"), query_len, rows, kv_dtype)
    cfg = getattr(model, "cfg", None)
    prefill_c = cfg is not None and kv_dtype == torch.bfloat16 and prefill_attention_available(cfg.head_dim)
    out["attention"] = "paged_attention (C)" if c else f"{prefill_library(cfg.head_dim)} (C)" if prefill_c else "torch"
    stacked = c and cfg is not None and getattr(model, "cpu_stack", False) and decode_stack(model) is not None
    out["layers"] = f"{STACK_KERNEL} (C, one call)" if stacked else "per operation"
    out["silu"] = f"{fused.silu_path()} (C)" if fused.available("fused") else "torch"
    return out


def measure_limits(model_shapes: Sequence[tuple[int, int]], rows: Sequence[int] = ROWS,
                   working_set_bytes: Sequence[int] = (), threads: int | None = None,
                   dram_bytes: int | None = None) -> dict:
    """Measure this machine's limits for a model whose linears have ``model_shapes`` (``[N, K]`` each).

    ``rows``: GEMM row counts to measure; ``working_set_bytes``: buffer sizes at which to measure the
    read bandwidth besides the DRAM-sized one (a decode step's weight + KV bytes); ``threads``: cores
    used (default ``torch.get_num_threads()``); ``dram_bytes``: the DRAM buffer's size (default
    :func:`dram_buffer_bytes`; smaller only to test). Returns a JSON-ready dict::

        cpu                  cpu_facts()
        threads              cores measured on
        bandwidth            {"dram": read_bandwidths(...), "working_set": {str(bytes): read_bandwidths(...)}}
        bandwidth_bytes_per_s   best C read at the DRAM size (bytes/s); torch_sum_bytes_per_s beside it
        gemm                 {"measurements": [...], "best_by_rows": {str(rows): {...}}, "best": {...}}
        best_gemm_flops_per_s   the overall best measured rate (FLOP/s)
        theoretical_peak     theoretical_peak(...) for these threads at cpu_facts()'s clock (measured or reported)
        amx                  best_amx() of kernels.cpu.amx_probe.measure(...) on one core before and after the
                             GEMM rates (the weight stream beside the tile work at the DRAM size, before), or
                             None without AMX

    Without a C compiler the bandwidths are torch's (``best_path`` ``"torch_sum"``) and only
    ``F.linear`` is measured.
    """
    threads = threads or torch.get_num_threads()
    cpu = cpu_facts()
    dram = read_bandwidths(dram_bytes or dram_buffer_bytes(cpu["l3_bytes"]), threads)
    working = {str(int(b)): read_bandwidths(int(b), threads) for b in dict.fromkeys(working_set_bytes)}
    amx_before = amx_limits(cpu["l3_bytes"], dram["bytes"])
    measurements = gemm_rates(model_shapes, rows, threads)
    by_rows = best_by_rows(measurements)
    best = max(by_rows.values(), key=lambda r: r["flops_per_s"])
    flags = [f for f, present in cpu["features"].items() if present]
    amx = amx_before and best_amx([amx_before, amx_limits(cpu["l3_bytes"])])
    return {"cpu": cpu, "threads": threads, "amx": amx,
            "bandwidth": {"dram": dram, "working_set": working},
            "bandwidth_bytes_per_s": dram["best"], "torch_sum_bytes_per_s": dram["torch_sum_best"],
            "gemm": {"measurements": measurements, "best_by_rows": by_rows, "best": best},
            "best_gemm_flops_per_s": best["flops_per_s"],
            "theoretical_peak": theoretical_peak(flags, cpu["clock_mhz"], threads, cpu["vendor"], cpu["family"],
                                                 dp_fma_ratio())}


def amx_limits(l3_bytes: int | None, stream_bytes: int | None = None) -> dict | None:
    """:func:`kernels.cpu.amx_probe.measure` where AMX-BF16 runs in this process (with the weight stream's
    rates over ``stream_bytes`` where given), else ``None``."""
    from pdserve.kernels.cpu import amx_probe
    from pdserve.kernels.cpu.gemv import gemm_amx_available
    from pdserve.model.hugepages import empty_huge

    if not gemm_amx_available():
        return None
    src = None if not stream_bytes else empty_huge(stream_bytes // 2, torch.bfloat16).fill_(1.0)   # pages touched
    return amx_probe.measure(l3_bytes, src)


def best_amx(samples: list[dict]) -> dict:
    """The sample of :func:`amx_limits` with the fastest ``TDPBF16PS``, with every sample's ``tdp_ns`` beside it
    (``tdp_ns_samples``). :func:`measure_limits` takes one before and one after the GEMM rates: on the AMX Xeons of
    these VMs the tile unit ran 2-2.6x slower in some minutes than in others (7.0 against 15.4-18.5 ns), and a
    ceiling taken in a slow minute fell below GEMM rates measured in a fast one."""
    best = min(samples, key=lambda a: a["tdp_ns"])
    streams = {k: v for a in samples for k, v in a.items() if k.startswith("stream")}   # taken in one sample
    return {**best, **streams, "tdp_ns_samples": [a["tdp_ns"] for a in samples]}


def bandwidth_at(limits: dict, nbytes: int, threads: int | None = None) -> float:
    """Best C read bandwidth (bytes/s) for a working set of ``nbytes``: measured now and added to
    ``limits["bandwidth"]["working_set"]`` unless a figure within 5% of that size is there."""
    table = limits["bandwidth"]["working_set"]
    for key, figure in table.items():
        if abs(int(key) - nbytes) <= 0.05 * nbytes:
            return figure["best"]
    table[str(int(nbytes))] = read_bandwidths(int(nbytes), threads or limits["threads"])
    return table[str(int(nbytes))]["best"]


def linear_shapes(model: torch.nn.Module) -> list[tuple[int, int]]:
    """``[N, K]`` of every linear layer of ``model`` (``nn.Linear`` or anything with in/out_features), deduplicated."""
    shapes = [(int(m.out_features), int(m.in_features)) for m in model.modules()
              if hasattr(m, "in_features") and hasattr(m, "out_features")]
    return list(dict.fromkeys(shapes))


def summary(limits: dict) -> str:
    """Lines to print: bandwidths, best GEMM rate per row count, and the paper peak."""
    cpu, peak, dram = limits["cpu"], limits["theoretical_peak"], limits["bandwidth"]["dram"]
    lines = [f"CPU: {cpu['model_name']} ({limits['threads']} thread(s)); kernels: "
             + ", ".join(k for k, ok in cpu["kernels"].items() if ok),
             f"read bandwidth, {dram['bytes'] / GIB:.2f} GiB buffer: C {dram['best'] / 1e9:.1f} GB/s "
             f"({dram['best_pages']} pages, {dram['best_path']}); torch.sum {dram['torch_sum_best'] / 1e9:.1f} GB/s"]
    for key, ws in limits["bandwidth"]["working_set"].items():
        lines.append(f"read bandwidth, {int(key) / 2**20:.1f} MiB working set: C {ws['best'] / 1e9:.1f} GB/s "
                     f"({ws['best_pages']} pages, {ws['best_path']}); torch.sum {ws['torch_sum_best'] / 1e9:.1f} GB/s")
    for key, r in limits["gemm"]["best_by_rows"].items():
        lines.append(f"best bf16 GEMM at {int(key):5d} rows: {r['flops_per_s'] / 1e9:7.1f} GFLOP/s "
                     f"({r['kernel']}{' -> ' + r['kernel_path'] if r.get('kernel_path') else ''}, "
                     f"N={r['n']} K={r['k']})")
    failed = sorted({r["kernel"] for r in limits["gemm"]["measurements"] if "error" in r})
    if failed:
        lines.append("kernels that raised (see gemm.measurements): " + ", ".join(failed))
    lines.append(f"theoretical peak: {peak['flops'] / 1e9:.0f} GFLOP/s = {peak['cores']} core(s) x "
                 f"{peak['clock_mhz']:.0f} MHz ({cpu['clock_source']}) x {peak['flop_per_cycle_per_core']:.0f} "
                 f"FLOP/cycle ({peak['isa']}: {peak['note']})")
    amx = limits.get("amx")
    if amx:
        loads = ", ".join(f"{level} {ns:.1f}" for level, ns in amx["tile_load_ns"].items())
        samples = ", ".join(f"{ns:.2f}" for ns in amx.get("tdp_ns_samples", [amx["tdp_ns"]]))
        lines.append(f"AMX tile unit, measured: {amx['tdp_ns']:.2f} ns a TDPBF16PS with operands in tiles "
                     f"({amx['tdp_flops_per_s'] / 1e9:.0f} GFLOP/s a core; samples {samples} ns); 1 KiB tile load "
                     f"ns: {loads}")
        if amx.get("stream_bytes_per_s"):
            st = amx["stream_bytes_per_s"]
            lines.append(f"AMX weight stream, {amx['stream_bytes'] / GIB:.2f} GiB: vector loads "
                         f"{st['vectors'] / 1e9:.1f} GB/s alone, {st['beside_32_row_tile_work'] / 1e9:.1f} GB/s beside "
                         f"a 32-row gemm's tile work ({st['beside_32_row_tile_work'] / st['vectors']:.0%}; its tile "
                         f"loads alone {st['beside_tile_loads'] / 1e9:.1f}, its TDPBF16PS alone "
                         f"{st['beside_tdp'] / 1e9:.1f})")
    return "\n".join(lines)


def main() -> None:
    import argparse
    import json

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a model directory: measure its linear shapes (default: bench-80m's)")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", help="write the limits as JSON here")
    args = ap.parse_args()
    if args.model:
        from pdserve.model.loader import load_model
        shapes = linear_shapes(load_model(args.model, torch.bfloat16)[0])
    else:
        shapes = [(1280, 768), (768, 768), (4096, 768), (768, 2048), (2048, 768)]
    limits = measure_limits(shapes, [int(r) for r in args.rows.split(",")], threads=args.threads)
    print(summary(limits))
    if args.out:
        Path(args.out).with_suffix(".json").write_text(json.dumps(limits, indent=2))


if __name__ == "__main__":
    main()
