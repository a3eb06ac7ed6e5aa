"""The best bf16 GEMM rate this machine gives, per row count (:mod:`bench.limits` measures it with the rest of
the machine's limits): every kernel the project has for a model's linear shapes, timed; a probe of the best one for
a benchmark to take beside each timed pass, and the record of a faster later measurement.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from pdserve.kernels.cpu import available


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
    with torch_threads(threads):
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
                            seconds = best_time(fn, None, budget_s)
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
        with torch_threads(threads), torch.no_grad():
            return flops / best_time(fn, None, budget_s)
    return probe


def kernel_path(module: torch.nn.Module, rows: int) -> str | None:
    """``module.label_for(rows)`` (the packed linears: their kernel, an AMX gate_up's pieces named), else
    ``module.kernel_for(rows)``, as a string where the module has one, else None."""
    kernel_for = getattr(module, "label_for", None) or getattr(module, "kernel_for", None)
    if not callable(kernel_for):
        return None
    try:
        return str(kernel_for(rows))
    except Exception as exc:                # report, never fail the benchmark over a label
        return f"error: {exc}"


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


class torch_threads:
    """Context: ``torch.set_num_threads(n)`` inside, the previous count restored after."""

    def __init__(self, n: int) -> None:
        self.n, self.before = n, torch.get_num_threads()

    def __enter__(self) -> None:
        torch.set_num_threads(self.n)

    def __exit__(self, *exc) -> None:
        torch.set_num_threads(self.before)


def best_time(fn: Callable[[], object], repeats: int | None, budget_s: float = 0.3) -> float:
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
