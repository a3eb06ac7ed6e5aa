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

import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from pdserve.bench.cpu_facts import cpu_facts, theoretical_peak
from pdserve.kernels.cpu import available
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
        with _torch_threads(threads):
            figure = {"torch_sum": nbytes / _best_time(buf.sum, repeats)}
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


def gemm_rates(shapes: Sequence[tuple[int, int]], rows: Sequence[int], threads: int = 1,
               budget_s: float = 0.3) -> list[dict]:
    """FLOP/s of ``x [m, K] @ W[N, K].T`` in bf16 for each ``(N, K)`` of ``shapes`` and ``m`` of ``rows``, by
    every kernel that runs here: ``f_linear``; ``onednn_prepacked`` (:class:`model.onednn_linear.OneDNNLinear`,
    where torch's oneDNN prepacking runs, from 32 rows); ``gemv_bf16`` (up to 64 rows: a few-row kernel) and
    ``gemm_bf16_avx512`` (where the module has it), ``gemm_bf16_fma`` and ``gemm_bf16_amx`` on the packed weight;
    ``packed_linear`` (``PackedBF16Linear.forward``, with its ``kernel_for(rows)`` where it has one).
    Each the fastest of repeated calls (about ``budget_s``); a kernel that raises is recorded with
    its ``error`` and no rate."""
    torch.manual_seed(0)
    out = []
    with _torch_threads(threads):
        for n, k in dict.fromkeys((int(n), int(k)) for n, k in shapes):
            weights = _Weights(n, k)
            for m in rows:
                kernels = weights.kernels(m)
                if weights.module is None and weights.packed is not None:
                    out.append({"rows": m, "n": n, "k": k, "kernel": "packed_linear", "error": weights.module_error})
                for name, fn in kernels.items():
                    row: dict = {"rows": m, "n": n, "k": k, "kernel": name}
                    try:
                        with torch.no_grad():
                            seconds = _best_time(fn, None, budget_s)
                        row.update(seconds=seconds, flops_per_s=2.0 * m * n * k / seconds)
                    except Exception as exc:    # a kernel another change broke must not stop the benchmark
                        row.update(error=f"{type(exc).__name__}: {exc}")
                    if name == "packed_linear":
                        row["kernel_path"] = kernel_path(weights.module, m)
                    out.append(row)
    return out


class _Weights:
    """One random bf16 ``[n, k]`` weight in every form the kernels of :func:`gemm_rates` take (the
    ``nn.Linear``, the packed layout, ``PackedBF16Linear``; ``module_error`` where that raised)."""

    def __init__(self, n: int, k: int) -> None:
        from pdserve.kernels.cpu.gemv import pack_weight, packed_bf16_available
        from pdserve.model.cpu_linear import PackedBF16Linear

        self.n, self.k = n, k
        self.linear = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
        self.packed = pack_weight(self.linear.weight.detach()) if packed_bf16_available() else None
        self.module, self.module_error = None, None
        try:
            self.module = PackedBF16Linear(self.linear) if self.packed is not None else None
        except Exception as exc:            # reported by gemm_rates: a module another change broke
            self.module_error = f"{type(exc).__name__}: {exc}"

    def kernels(self, m: int) -> dict[str, Callable[[], object]]:
        """``{kernel name: a call of it on a random bf16 [m, k] x}`` for every kernel that runs here."""
        from pdserve.kernels.cpu import gemv as gemv_module
        from pdserve.kernels.cpu.gemv import gemm_amx_available, gemm_bf16_amx, gemv_available, gemv_bf16
        from pdserve.model.onednn_linear import OneDNNLinear, onednn_prepack_available

        n, k, w, packed, module = self.n, self.k, self.linear.weight.detach(), self.packed, self.module
        gemm_avx512 = getattr(gemv_module, "gemm_bf16_avx512", None)
        gemm_fma = getattr(gemv_module, "gemm_bf16_fma", None) if available("gemm_bf16_fma") else None
        x = torch.randn(m, k).bfloat16()
        kernels: dict[str, Callable[[], object]] = {"f_linear": lambda: F.linear(x, w)}
        if m >= 32 and onednn_prepack_available():
            prepacked = OneDNNLinear(self.linear, m)
            kernels["onednn_prepacked"] = lambda: prepacked(x)
        if packed is not None:
            xp = F.pad(x, (0, k % 2))
            if m <= 64 and gemv_available():
                kernels["gemv_bf16"] = lambda: gemv_bf16(xp, packed, n)
            if gemm_avx512 is not None and gemv_available():
                kernels["gemm_bf16_avx512"] = lambda: gemm_avx512(xp, packed, n)
            if gemm_fma is not None:
                kernels["gemm_bf16_fma"] = lambda: gemm_fma(xp, packed, n)
            if gemm_amx_available() and k % 32 == 0:
                kernels["gemm_bf16_amx"] = lambda: gemm_bf16_amx(x, packed, n)
            if module is not None:
                kernels["packed_linear"] = lambda: module(x)
        return kernels


def gemm_probe(best: dict, threads: int = 1, budget_s: float = 0.25) -> Callable[[], float]:
    """A probe of the GEMM rate the machine offers now: a callable that times the kernel of ``best`` (a
    :func:`best_by_rows` entry: its ``kernel``, ``n``, ``k``, ``rows``) at its shape for about ``budget_s``
    and returns the fastest call's FLOP/s. For a benchmark to pair with each timed pass: on the VMs of
    this project's machine kind a core's float32 FMA GEMM switched between ~146 and ~115 GFLOP/s within
    seconds (2026-12-01), so a step timed in a slow spell was compared with a limit measured in a fast one.

    Raises:
        KeyError: ``best``'s kernel does not run here (it came from another machine).
    """
    torch.manual_seed(0)
    rows, weights = int(best["rows"]), _Weights(int(best["n"]), int(best["k"]))
    fn = weights.kernels(rows)[best["kernel"]]
    flops = 2.0 * rows * weights.n * weights.k

    def probe() -> float:
        with _torch_threads(threads), torch.no_grad():
            return flops / _best_time(fn, None, budget_s)
    return probe


def kernel_path(module: torch.nn.Module, rows: int) -> str | None:
    """``module.kernel_for(rows)`` as a string where the module has it (the packed linears), else None."""
    kernel_for = getattr(module, "kernel_for", None)
    if not callable(kernel_for):
        return None
    try:
        return str(kernel_for(rows))
    except Exception as exc:                # report, never fail the benchmark over a label
        return f"error: {exc}"


def kernel_paths(model: torch.nn.Module, rows: int, query_len: int = 1,
                 kv_dtype: torch.dtype = torch.bfloat16) -> dict:
    """The path each kind of linear takes at ``rows`` rows (``kernel_for`` of the packed bf16 and INT4
    modules, else the module's class: torch), and attention's for steps of ``query_len`` new tokens per
    sequence over a ``kv_dtype`` cache (:func:`kernels.paged_attention.paged_attention`'s choice: the C
    decode kernel, the C prefill kernel or torch), and ``layers``: whether such a step runs every
    decoder layer in one C call (:mod:`model.cpu_stack`) or operation by operation."""
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
    return out


def best_by_rows(measurements: list[dict]) -> dict[str, dict]:
    """``{str(rows): the fastest measurement at that row count}`` (its FLOP/s, kernel, shape)."""
    best: dict[str, dict] = {}
    for r in measurements:
        if "flops_per_s" not in r:
            continue
        key = str(r["rows"])
        if key not in best or r["flops_per_s"] > best[key]["flops_per_s"]:
            best[key] = r
    return best


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
                             GEMM rates, or None without AMX

    Without a C compiler the bandwidths are torch's (``best_path`` ``"torch_sum"``) and only
    ``F.linear`` is measured.
    """
    threads = threads or torch.get_num_threads()
    cpu = cpu_facts()
    dram = read_bandwidths(dram_bytes or dram_buffer_bytes(cpu["l3_bytes"]), threads)
    working = {str(int(b)): read_bandwidths(int(b), threads) for b in dict.fromkeys(working_set_bytes)}
    amx_before = amx_limits(cpu["l3_bytes"])
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


def amx_limits(l3_bytes: int | None) -> dict | None:
    """:func:`kernels.cpu.amx_probe.measure` where AMX-BF16 runs in this process, else ``None``."""
    from pdserve.kernels.cpu import amx_probe
    from pdserve.kernels.cpu.gemv import gemm_amx_available

    return amx_probe.measure(l3_bytes) if gemm_amx_available() else None


def best_amx(samples: list[dict]) -> dict:
    """The sample of :func:`amx_limits` with the fastest ``TDPBF16PS``, with every sample's ``tdp_ns`` beside it
    (``tdp_ns_samples``). :func:`measure_limits` takes one before and one after the GEMM rates: on the AMX Xeons of
    these VMs the tile unit ran 2-2.6x slower in some minutes than in others (7.0 against 15.4-18.5 ns), and a
    ceiling taken in a slow minute fell below GEMM rates measured in a fast one."""
    best = min(samples, key=lambda a: a["tdp_ns"])
    return {**best, "tdp_ns_samples": [a["tdp_ns"] for a in samples]}


def bandwidth_at(limits: dict, nbytes: int, threads: int | None = None) -> float:
    """Best C read bandwidth (bytes/s) for a working set of ``nbytes``: measured now and added to
    ``limits["bandwidth"]["working_set"]`` unless a figure within 5% of that size is there."""
    table = limits["bandwidth"]["working_set"]
    for key, figure in table.items():
        if abs(int(key) - nbytes) <= 0.05 * nbytes:
            return figure["best"]
    table[str(int(nbytes))] = read_bandwidths(int(nbytes), threads or limits["threads"])
    return table[str(int(nbytes))]["best"]


def gemm_rate_at(limits: dict, rows: int) -> dict:
    """The best measurement at ``rows`` rows (else at the nearest measured row count)."""
    by_rows = limits["gemm"]["best_by_rows"]
    return by_rows[_nearest_rows(by_rows, rows)]


def _nearest_rows(by_rows: dict, rows: int) -> str:
    return min(by_rows, key=lambda r: (abs(math.log(int(r) / rows)), int(r)))


def raise_gemm_rate(limits: dict, rows: int, flops_per_s: float) -> bool:
    """Record a later, faster measurement (FLOP/s) of the entry :func:`gemm_rate_at` gives for ``rows``, such as a
    :func:`gemm_probe` of it: the entry (and ``best_gemm_flops_per_s`` where it passes that) takes the rate, marked
    ``"raised_by": "gemm_probe"``, so that a limit measured in one of the host's slow spells does not stand
    for the best the machine gave during the run. Returns whether it raised anything."""
    by_rows = limits["gemm"]["best_by_rows"]
    key = _nearest_rows(by_rows, rows)
    entry = by_rows[key]
    if flops_per_s <= entry["flops_per_s"]:
        return False
    work = 2.0 * int(entry["rows"]) * int(entry["n"]) * int(entry["k"])
    by_rows[key] = {**entry, "flops_per_s": flops_per_s, "seconds": work / flops_per_s, "raised_by": "gemm_probe",
                    "measured_flops_per_s": entry.get("measured_flops_per_s", entry["flops_per_s"])}
    if flops_per_s > limits["best_gemm_flops_per_s"]:
        limits["best_gemm_flops_per_s"], limits["gemm"]["best"] = flops_per_s, by_rows[key]
    return True


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
    return "\n".join(lines)


class _torch_threads:
    """Context: ``torch.set_num_threads(n)`` inside, the previous count restored after."""

    def __init__(self, n: int) -> None:
        self.n, self.before = n, torch.get_num_threads()

    def __enter__(self) -> None:
        torch.set_num_threads(self.n)

    def __exit__(self, *exc) -> None:
        torch.set_num_threads(self.before)


def _best_time(fn: Callable[[], object], repeats: int | None, budget_s: float = 0.3) -> float:
    """Fastest of ``repeats`` calls of ``fn`` in seconds after one warm-up call; ``repeats=None``:
    as many as fit in about ``budget_s`` (3 to 50)."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    if repeats is None:
        repeats = int(min(50, max(3, budget_s / max(first, 1e-6))))
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


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
